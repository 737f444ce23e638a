/* amx_probe.c: what AMX instruction sequences cost on this CPU (one thread, data in L1/L2), in ns
 * per iteration and in units of one TDPBSSD on register tiles, for the tile shapes of the R16
 * kernel (r16_amx.c): K = 64 bytes (a q4 group) and K = 32 (a q8 group). Standalone, not part of
 * `make` (bench/KERNELS.md, 2026-12-05):
 *   gcc -O2 -D_GNU_SOURCE -mavx512f -mavx512bw -mamx-tile -mamx-int8 bench/amx_probe.c -o amx_probe */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tilecfg;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
#define B() __asm__ volatile("" ::: "memory")
static int8_t A[64 * 1024] __attribute__((aligned(64)));
static int8_t Bt[64 * 1024] __attribute__((aligned(64)));
static int32_t Cb[64][256] __attribute__((aligned(64)));
static int8_t *Abig;
#define N 200000

static void cfg(int kbytes) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = 16; c.colsb[t] = kbytes; }          /* A */
    for (int t = 4; t < 6; t++) { c.rows[t] = kbytes / 4; c.colsb[t] = 64; }      /* B */
    for (int t = 6; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }              /* C */
    _tile_loadconfig(&c);
}

#define RUN(name, body)                                                                       \
    do {                                                                                      \
        double best = 1e9;                                                                    \
        for (int rep = 0; rep < 5; rep++) {                                                   \
            double t0 = now();                                                                \
            for (int i = 0; i < N; i++) { body; }                                             \
            double t = (now() - t0) / N;                                                      \
            if (t < best) best = t;                                                           \
        }                                                                                     \
        printf("%-58s %7.2f ns/iter  %6.1f units of TDP\n", name, best * 1e9, best / tdp);  \
    } while (0)

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX permission\n"); return 1; }
    Abig = aligned_alloc(64, 16 * 8192 * 16);
    memset(Abig, 1, 16 * 8192 * 16);
    memset(A, 1, sizeof A); memset(Bt, 1, sizeof Bt);
    for (int kb = 64; kb >= 32; kb -= 32) {
        cfg(kb);
        printf("== K = %d bytes per A row (%s)\n", kb, kb == 64 ? "q4 group" : "q8 group");
        _tile_loadd(0, A, 64); _tile_loadd(1, A, 64); _tile_loadd(4, Bt, 64); _tile_loadd(5, Bt, 64);
        _tile_zero(6); _tile_zero(7);
        double tdp = 1;
        { /* TDP only, 2 independent C */
            double best = 1e9;
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now();
                for (int i = 0; i < N; i++) { _tile_dpbssd(6, 0, 4); _tile_dpbssd(7, 1, 5); }
                double t = (now() - t0) / N / 2;
                if (t < best) best = t;
            }
            tdp = best;
            printf("%-58s %7.2f ns/TDP (= 1 unit)\n", "TDP, register tiles, 2 C chains", best * 1e9);
        }
        RUN("TDP, 1 C chain", _tile_dpbssd(6, 0, 4));
        RUN("TLOAD A (stride 64, L1)", { B(); _tile_loadd(0, A + (i & 7) * 1024, 64); });
        RUN("TLOAD A x2 tiles alternating (stride 64, L1)", { B(); _tile_loadd(0, A + (i & 7) * 1024, 64); _tile_loadd(1, A + ((i + 1) & 7) * 1024, 64); });
        RUN("TLOAD A (stride 8192: 16 pages, L2)", { B(); _tile_loadd(0, Abig + (i & 15) * 64, 8192); });
        RUN("TSTORE C (L1, 4 buffers)", { _tile_stored(6, Cb[i & 3], 64); B(); });
        RUN("TSTORE C alternating 2 tiles", { _tile_stored(6, Cb[i & 3], 64); _tile_stored(7, Cb[(i & 3) + 4], 64); B(); });
        RUN("TZERO C", _tile_zero(6));
        RUN("TZERO + TDP (2 C alternating)", { if (i & 1) { _tile_zero(6); _tile_dpbssd(6, 0, 4); } else { _tile_zero(7); _tile_dpbssd(7, 1, 5); } });
        RUN("TDP + TSTORE (2 C alternating)", { if (i & 1) { _tile_dpbssd(6, 0, 4); _tile_stored(6, Cb[i & 7], 64); } else { _tile_dpbssd(7, 1, 5); _tile_stored(7, Cb[i & 7], 64); } B(); });
        RUN("TLOAD A + TLOAD B + TDP (accumulate, 2 sets)", { B(); if (i & 1) { _tile_loadd(0, A + (i & 7) * 1024, 64); _tile_loadd(4, Bt + (i & 7) * 1024, 64); _tile_dpbssd(6, 0, 4); } else { _tile_loadd(1, A + (i & 7) * 1024, 64); _tile_loadd(5, Bt + (i & 7) * 1024, 64); _tile_dpbssd(7, 1, 5); } });
        RUN("TLOAD B + TDP (A fixed; accumulate, 2 sets)", { B(); if (i & 1) { _tile_loadd(4, Bt + (i & 7) * 1024, 64); _tile_dpbssd(6, 0, 4); } else { _tile_loadd(5, Bt + (i & 7) * 1024, 64); _tile_dpbssd(7, 1, 5); } });
        RUN("TLOAD A + TLOAD B + TZERO + TDP + TSTORE (2 sets) = kernel", { B(); if (i & 1) { _tile_loadd(0, A + (i & 7) * 1024, 64); _tile_loadd(4, Bt + (i & 7) * 1024, 64); _tile_zero(6); _tile_dpbssd(6, 0, 4); _tile_stored(6, Cb[i & 7], 64); } else { _tile_loadd(1, A + (i & 7) * 1024, 64); _tile_loadd(5, Bt + (i & 7) * 1024, 64); _tile_zero(7); _tile_dpbssd(7, 1, 5); _tile_stored(7, Cb[i & 7], 64); } B(); });
        RUN("same, A stride 8192 (16 pages)", { B(); if (i & 1) { _tile_loadd(0, Abig + (i & 15) * 64, 8192); _tile_loadd(4, Bt + (i & 7) * 1024, 64); _tile_zero(6); _tile_dpbssd(6, 0, 4); _tile_stored(6, Cb[i & 7], 64); } else { _tile_loadd(1, Abig + (i & 15) * 64, 8192); _tile_loadd(5, Bt + (i & 7) * 1024, 64); _tile_zero(7); _tile_dpbssd(7, 1, 5); _tile_stored(7, Cb[i & 7], 64); } B(); });
        RUN("B fixed, A loaded, 2 C, TZERO + TDP + TSTORE", { B(); if (i & 1) { _tile_loadd(0, A + (i & 7) * 1024, 64); _tile_zero(6); _tile_dpbssd(6, 0, 4); _tile_stored(6, Cb[i & 7], 64); } else { _tile_loadd(1, A + (i & 7) * 1024, 64); _tile_zero(7); _tile_dpbssd(7, 1, 5); _tile_stored(7, Cb[i & 7], 64); } B(); });
        RUN("kernel step + 16 vector loads of the C stored 2 steps ago", {
            B(); if (i & 1) { _tile_loadd(0, A + (i & 7) * 1024, 64); _tile_loadd(4, Bt + (i & 7) * 1024, 64); _tile_zero(6); _tile_dpbssd(6, 0, 4); _tile_stored(6, Cb[i & 7], 64); } else { _tile_loadd(1, A + (i & 7) * 1024, 64); _tile_loadd(5, Bt + (i & 7) * 1024, 64); _tile_zero(7); _tile_dpbssd(7, 1, 5); _tile_stored(7, Cb[i & 7], 64); } B();
            __m512i s = _mm512_setzero_si512(); for (int m = 0; m < 16; m++) s = _mm512_add_epi32(s, _mm512_load_si512(&Cb[(i - 2) & 7][m * 16])); Cb[8 + (i & 7)][0] = _mm512_reduce_add_epi32(s); });
    }
    _tile_release();
    return 0;
}
