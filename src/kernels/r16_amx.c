/* r16_amx.c: the PT_LAYOUT_R16 matmul on AMX tiles (Intel AMX-INT8), bitwise equal to the AVX-512
 * VNNI kernel (r16_avx512.c) and the scalar one (r16.c: kn_r16_rows_ref), for products with many
 * rows (prefill chunks, MoE expert batches, batched decode and verify windows). Also the AMX
 * peak probe kernels_bench reports, and (amx_bf16_rows) the optional AMX-BF16 product of bf16
 * weights, which is NOT exact (bf16 activations).
 *
 * Why R16 serves AMX as stored: a group of an R16 block (512 bytes: 8 dwords of 4 columns x 16
 * rows) is exactly AMX's B-tile ("VNNI") order with the 16 weight rows as N. So
 *   q8_g32: B = the group's 8 x 64 bytes as stored (u = w + 128) turned back into signed w
 *           (xor 0x80), A = the 16 activations' q of the group (16 x 32 signed bytes, straight
 *           from the prepared rows, stride xs), TDPBSSD gives sum(w q) = bias + sum(u q) exactly
 *           (the stored bytes could feed TDPBSUD directly, but then every output vector of every
 *           group needs the bias added: one AVX-512 op more per 16 outputs, on the ports that
 *           bound this kernel, against 8 xors per group and block shared by all activation tiles);
 *   q4_g64: each 64-byte dword row k of the group splits into lo nibbles (columns 8k..8k+3) and hi
 *           nibbles (8k+4..8k+7), stored as B rows 2k and 2k+1 minus 8 (signed, in [-8, 7]): K
 *           runs over the group's 64 columns in natural order, TDPBSSD gives sum((u - 8) q) =
 *           bias + sum(u q) exactly.
 * Both conversions are done per block and chunk of groups into a per-call scratch and reused
 * for every 16-row tile of activations.
 * Routed experts streamed from the SSD arrive in this layout too (the pack stores them R16), so
 * one kernel serves resident and streamed weights and nothing is laid out again at open.
 *
 * Math (identical to r16.c): per output (activation i, weight row r) and group g ascending,
 *   I = exact integer group dot (incl. bias); acc = fmaf((float)I, s_rg * d_ig, acc), acc from 0,
 * with the product s * d rounded to f32 first (the VNNI kernel's _mm512_mul_ps(s, d) then fma).
 * The integer part is exact in any order, the float part is the same ops in the same order, so
 * results are bitwise the VNNI kernel's; row i depends only on activation row i (AMX computes each
 * C row from its own A row), so batching cannot change it.
 *
 * Loop order per task (rows [r0, r1) of W, all n activations): for each chunk of groups (1 KB of
 * K per activation row, so the chunk's activations stay in L2 for all n rows), for each block (16
 * weight rows; one C tile per group, so its 16 f32 accumulators stay in registers: a pair of
 * blocks sharing one A tile spilled its 32 and was ~10 % slower on the device's Xeon, 230 vs 253
 * GMAC/s one thread warm), for each 16-row activation tile: the
 * f32 accumulators are y itself (loaded at the chunk's start, stored at its end: f32 round trips
 * are exact), pad rows of the last tile go to a scratch. Activations must be prepared for
 * round_up(n, 16) rows (dispatch.c zero-fills the pad rows) so full 16-row tiles never read past
 * the buffer.
 *
 * Speed (bench/KERNELS.md, "AMX"): ~24 % of the one-thread AMX peak warm for q4, 1.1-1.6x the VNNI
 * kernel at 512 rows, break-even at ~16-24 rows per expert: the per-group fma chain that bitwise
 * equality requires puts a tile store, 16 vector loads and 48 vector ops behind every TDPBSSD.
 *
 * Tile state is per thread: every call loads its tile configuration (LDTILECFG) first and
 * releases the tiles (TILERELEASE) at the end, so any pool worker can run any task; the OS
 * permission (arch_prctl ARCH_REQ_XCOMP_PERM) is per process, asked once by dispatch.c.
 *
 * Built twice: as itself with -mamx-* (Makefile, by file name) and, through r16_amxemu_avx512.c,
 * with KN_AMX_EMU defined: the tile instructions are then emulated in C (same data movement and
 * integer arithmetic), so the kernel's logic is tested bitwise on CPUs without AMX too. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kn_internal.h"
#include "kernels/r16_scales.h"

#define AI static inline __attribute__((always_inline))

typedef struct {
    uint8_t palette, start_row, rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tilecfg;

#ifdef KN_AMX_EMU
/* ---- C emulation of the tile instructions used below ---- */
#define FN(name) name##_emu
typedef struct { uint8_t b[16][64]; } emu_tile;
static _Thread_local emu_tile emu_t[8];
static _Thread_local tilecfg emu_cfg;
static void emu_load(int t, const void *base, int64_t stride) {
    memset(&emu_t[t], 0, sizeof emu_t[t]);
    for (int r = 0; r < emu_cfg.rows[t]; r++) memcpy(emu_t[t].b[r], (const uint8_t *)base + r * stride, emu_cfg.colsb[t]);
}
static void emu_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++) memcpy((uint8_t *)base + r * stride, emu_t[t].b[r], emu_cfg.colsb[t]);
}
/* C[m][n] += sum_k sum_t A[m][4k+t] B[k][4n+t] (as = A signed, bs = B signed; int32 C) */
static void emu_dp(int c, int a, int b, int as, int bs) {
    int M = emu_cfg.rows[a], K = emu_cfg.colsb[a] / 4, N = emu_cfg.colsb[c] / 4;
    if (emu_cfg.rows[c] != M || emu_cfg.rows[b] != K || emu_cfg.colsb[b] != emu_cfg.colsb[c]) __builtin_trap();
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t acc;
            memcpy(&acc, &emu_t[c].b[m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int t = 0; t < 4; t++) {
                    int av = as ? (int8_t)emu_t[a].b[m][4 * k + t] : emu_t[a].b[m][4 * k + t];
                    int bv = bs ? (int8_t)emu_t[b].b[k][4 * n + t] : emu_t[b].b[k][4 * n + t];
                    acc = (int32_t)((uint32_t)acc + (uint32_t)(av * bv));
                }
            memcpy(&emu_t[c].b[m][4 * n], &acc, 4);
        }
}
/* C[m][n] += sum_k sum_t A[m][2k+t] B[k][2n+t] over bf16 pairs, f32 C (the hardware's exact
 * rounding of the pair sums is not modelled: only the bf16 path uses it, and that path is
 * tested against a tolerance) */
static float emu_bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static void emu_dpbf16(int c, int a, int b) {
    int M = emu_cfg.rows[a], K = emu_cfg.colsb[a] / 4, N = emu_cfg.colsb[c] / 4;
    if (emu_cfg.rows[c] != M || emu_cfg.rows[b] != K || emu_cfg.colsb[b] != emu_cfg.colsb[c]) __builtin_trap();
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, &emu_t[c].b[m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int t = 0; t < 2; t++) {
                    uint16_t av, bv;
                    memcpy(&av, &emu_t[a].b[m][4 * k + 2 * t], 2);
                    memcpy(&bv, &emu_t[b].b[k][4 * n + 2 * t], 2);
                    acc += emu_bf(av) * emu_bf(bv);
                }
            memcpy(&emu_t[c].b[m][4 * n], &acc, 4);
        }
}
#define TCFG(p) (emu_cfg = *(p))
#define TREL() ((void)0)
#define TLOAD(t, base, stride) emu_load(t, base, stride)
#define TSTORE(t, base, stride) emu_store(t, base, stride)
#define TZERO(t) memset(&emu_t[t], 0, sizeof emu_t[t])
#define TDP_SS(c, a, b) emu_dp(c, a, b, 1, 1)
#define TDP_BF16(c, a, b) emu_dpbf16(c, a, b)
#else
#define FN(name) name
/* A compiler barrier with every tile instruction that reads memory: GCC's tileloadd asm does not
 * say it reads memory, so stores into a scratch that only tiles read could be moved past it or
 * dropped as dead. */
#define BARRIER() __asm__ volatile("" ::: "memory")
#define TCFG(p) _tile_loadconfig(p)
#define TREL() _tile_release()
#define TLOAD(t, base, stride) do { BARRIER(); _tile_loadd(t, base, stride); } while (0)
#define TSTORE(t, base, stride) do { _tile_stored(t, base, stride); BARRIER(); } while (0)
#define TZERO(t) _tile_zero(t)
#define TDP_SS(c, a, b) _tile_dpbssd(c, a, b)
#define TDP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* Tiles: 0 / 1 = A (activations) of even / odd groups, 2 / 3 = B, 4 / 5 = C. */
static void cfg_int8(tilecfg *c, int q4) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t <= 1; t++) { c->rows[t] = 16; c->colsb[t] = q4 ? 64 : 32; }
    for (int t = 2; t <= 3; t++) { c->rows[t] = q4 ? 16 : 8; c->colsb[t] = 64; }
    for (int t = 4; t <= 5; t++) { c->rows[t] = 16; c->colsb[t] = 64; }
}

#define KC_BYTES 1024 /* K bytes of activations per chunk and row: 16 q4 groups, 32 q8 groups */

/* q8: groups [g0, g1) of block b as signed B tiles (8 x 64 bytes per group) at dst. */
static void unpack_q8(const pt_wview *W, int64_t b, int64_t g0, int64_t g1, int8_t *dst) {
    const uint8_t *src = W->data + b * 16 * W->row_bytes + g0 * 512;
    const __m512i s = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < (g1 - g0) * 8; k++)
        _mm512_store_si512((void *)(dst + 64 * k), _mm512_xor_si512(_mm512_loadu_si512((const void *)(src + 64 * k)), s));
}

/* q4: groups [g0, g1) of block b split into signed B tiles, 1 KB per group, at dst. */
static void unpack_q4(const pt_wview *W, int64_t b, int64_t g0, int64_t g1, int8_t *dst) {
    const uint8_t *blk = W->data + b * 16 * W->row_bytes;
    const __m512i m4 = _mm512_set1_epi8(0x0F), e8 = _mm512_set1_epi8(8);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wg = blk + g * 512;
        int8_t *o = dst + (g - g0) * 1024;
        for (int k = 0; k < 8; k++) {
            __m512i v = _mm512_loadu_si512((const void *)(wg + k * 64));
            __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, m4), e8);
            __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), e8);
            _mm512_store_si512((void *)(o + 128 * k), lo);
            _mm512_store_si512((void *)(o + 128 * k + 64), hi);
        }
    }
}

/* Post-processing of one group's C tile (16 activations x the 16 weight rows of a block, int32
 * in ib): acc[m] = fma((float)I[m], s * d[m], acc[m]), the VNNI kernel's float ops. */
AI void post(const float *x0d, int64_t xs, int64_t g, __m512 s, const int32_t (*ib)[16], __m512 *acc) {
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) {
        float d;
        memcpy(&d, (const uint8_t *)x0d + (int64_t)m * xs + 4 * g, 4);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)ib[m])), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc[m]);
    }
}

/* The tile instructions of group g: A into TA, B into TB, C = A.B in TC, stored to the ring. */
#define GROUP_TILES(TA, TB, TC)                                                      \
    do {                                                                             \
        TLOAD(TA, x0 + g * gsz, xs);                                                 \
        TLOAD(TB, wb + (g - g0) * tb, 64);                                           \
        TZERO(TC);                                                                   \
        TDP_SS(TC, TA, TB);                                                          \
        TSTORE(TC, ib[(g - g0) % 3], 64);                                            \
    } while (0)

/* One 16-row activation tile (rows m0 .. m0+15, of which mr are real) against block b, groups
 * [g0, g1): accumulators (16 registers) in/out of y (first chunk: from zero).
 * Software-pipelined: even groups use tiles A0 B0 C0 (0, 2, 4), odd ones A1 B1 C1 (1, 3, 5), so the
 * loads of group g+1 need not wait for group g's product to read its tiles (tiles are not
 * renamed); the vector units post-process group g - 2 from a ring of three int32 buffers while
 * group g's tiles run, so vector loads never wait for a tile store that has not retired (tile
 * stores do not forward to loads). */
AI void tile_chunk(const int Q4, const pt_wview *W, int64_t b, int64_t g0, int64_t g1, int first, const int8_t *wb,
                   const uint8_t *xq, int64_t xs, int m0, int mr, float *y, float *pad) {
    const int gsz = Q4 ? 64 : 32;
    const int64_t cols = W->cols, ng = cols / gsz, qb = (cols + 63) / 64 * 64, tb = Q4 ? 1024 : 512;
    int32_t ib[3][16][16] __attribute__((aligned(64)));
    __m512 acc[16];
    float *out[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) out[m] = m < mr ? y + (int64_t)(m0 + m) * W->rows + b * 16 : pad + m * 16;
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) acc[m] = first || m >= mr ? _mm512_setzero_ps() : _mm512_loadu_ps(out[m]);
    const uint8_t *x0 = xq + (int64_t)m0 * xs;
    const float *x0d = (const float *)(x0 + qb);
    for (int64_t g = g0; g < g1 + 2; g++) {
        if (g < g1) {
            if ((g - g0) & 1) GROUP_TILES(1, 3, 5);
            else GROUP_TILES(0, 2, 4);
        }
        if (g - 2 >= g0) {
            int64_t gp = g - 2;
            post(x0d, xs, gp, r16_scales16(W, (b * ng + gp) * 16), ib[(gp - g0) % 3], acc);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) _mm512_storeu_ps(out[m], acc[m]);
}

AI void rows_amx(const int Q4, const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y) {
    const int gsz = Q4 ? 64 : 32;
    const int64_t ng = W->cols / gsz, gc = KC_BYTES / gsz;
    tilecfg cfg;
    cfg_int8(&cfg, Q4);
    TCFG(&cfg);
    int8_t wb[KC_BYTES / 64 * 1024] __attribute__((aligned(64))); /* the chunk's B tiles (q8: half used) */
    float pad[16 * 16] __attribute__((aligned(64)));
    for (int64_t g0 = 0; g0 < ng; g0 += gc) {
        int64_t g1 = g0 + gc < ng ? g0 + gc : ng;
        for (int64_t b = r0 / 16; b < r1 / 16; b++) {
            if (Q4) unpack_q4(W, b, g0, g1, wb);
            else unpack_q8(W, b, g0, g1, wb);
            for (int m0 = 0; m0 < n; m0 += 16)
                tile_chunk(Q4, W, b, g0, g1, g0 == 0, wb, xq, xs, m0, n - m0 < 16 ? n - m0 : 16, y, pad);
        }
    }
    TREL();
}

void FN(kn_r16_rows_amx)(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y) {
    if (W->qtype == PT_Q4_G64) rows_amx(1, W, r0, r1, xq, xs, n, y);
    else rows_amx(0, W, r0, r1, xq, xs, n, y);
}

/* ---- AMX-BF16 (optional, not exact): plain bf16 weights, bf16 activations ----
 * x rows are rounded to bf16 (round to nearest even) into xb (stride xbs bytes, K padded to 32
 * columns with zeros, round_up(n, 16) rows); per 16-row block of W the weights are packed into
 * B tiles (pairs of columns: B row k = columns 2k, 2k+1 of the 16 weight rows), then
 * C (f32) += A . B over 32-column steps, and the C tile is stored into y. The f32 sums follow the
 * hardware's order: results differ from the f32 path by the bf16 rounding of x (relative 2^-9 per
 * activation) and the summation order. */
static void cfg_bf16(tilecfg *c) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    c->rows[0] = 16; c->colsb[0] = 64; /* A: 16 rows x 32 bf16 */
    c->rows[1] = 16; c->colsb[1] = 64; /* B: 16 pairs x 16 weight rows */
    c->rows[4] = 16; c->colsb[4] = 64; /* C: 16 x 16 f32 */
}

void FN(kn_amx_bf16_prep)(const float *x, int n, int64_t cols, uint16_t *xb, int64_t xbs) {
    int64_t kp = (cols + 31) / 32 * 32;
    for (int i = 0; i < n; i++) {
        uint16_t *o = (uint16_t *)((uint8_t *)xb + (int64_t)i * xbs);
        for (int64_t j = 0; j < kp; j++) o[j] = j < cols ? pt_f32_to_bf16(x[(int64_t)i * cols + j]) : 0;
    }
}

/* Packed B tiles of one 16-row block (ks KB), per thread; grows (prefill only: decode never runs
 * this path). */
static _Thread_local uint16_t *bf_buf;
static void bf16_rows_slow(const pt_wview *W, int64_t r0, int64_t r1, const uint16_t *xb, int64_t xbs, int n, float *y) {
    for (int64_t r = r0; r < r1; r++)
        for (int i = 0; i < n; i++) {
            const uint16_t *xr = (const uint16_t *)((const uint8_t *)xb + (int64_t)i * xbs), *wr = (const uint16_t *)(W->data + r * W->row_bytes);
            float acc = 0.f;
            for (int64_t c = 0; c < W->cols; c++) acc += pt_bf16_to_f32(xr[c]) * pt_bf16_to_f32(wr[c]);
            y[(int64_t)i * W->rows + r] = acc;
        }
}
static _Thread_local int64_t bf_cap;

void FN(kn_amx_bf16_rows)(const pt_wview *W, int64_t r0, int64_t r1, const uint16_t *xb, int64_t xbs, int n, float *y) {
    const int64_t cols = W->cols, ks = (cols + 31) / 32;
    if (bf_cap < ks * 512) {
        free(bf_buf);
        bf_buf = aligned_alloc(64, (size_t)ks * 1024);
        bf_cap = bf_buf ? ks * 512 : 0;
        if (!bf_buf) { bf16_rows_slow(W, r0, r1, xb, xbs, n, y); return; }
    }
    tilecfg cfg;
    cfg_bf16(&cfg);
    TCFG(&cfg);
    float ct[16][16] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r += 16) {
        int nr = r1 - r < 16 ? (int)(r1 - r) : 16;
        for (int64_t s = 0; s < ks; s++) { /* B row k of step s: columns 2k, 2k+1 of the 16 rows */
            uint16_t *bt = bf_buf + s * 512;
            for (int nn = 0; nn < 16; nn++) {
                const uint16_t *wr = (const uint16_t *)(W->data + (r + (nn < nr ? nn : 0)) * W->row_bytes);
                for (int k = 0; k < 16; k++)
                    for (int t = 0; t < 2; t++) {
                        int64_t c = s * 32 + 2 * k + t;
                        bt[k * 32 + nn * 2 + t] = nn < nr && c < cols ? wr[c] : 0;
                    }
            }
        }
        for (int m0 = 0; m0 < n; m0 += 16) {
            int mr = n - m0 < 16 ? n - m0 : 16;
            TZERO(4);
            for (int64_t s = 0; s < ks; s++) {
                TLOAD(0, (const uint8_t *)xb + (int64_t)m0 * xbs + s * 64, xbs);
                TLOAD(1, bf_buf + s * 512, 64);
                TDP_BF16(4, 0, 1);
            }
            TSTORE(4, ct, 64);
            for (int m = 0; m < mr; m++) memcpy(y + (int64_t)(m0 + m) * W->rows + r, ct[m], (size_t)nr * 4);
        }
    }
    TREL();
}

#ifndef KN_AMX_EMU
/* ---- peak probe: TDPBSSD on register tiles only (no loads), 4 independent C tiles ----
 * Returns the int8 multiply-adds done (iters * 4 * 16 * 16 * 64). */
int64_t kn_amx_peak_run(int64_t iters) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    static const int8_t z[16 * 64] __attribute__((aligned(64))) = {1};
    _tile_loadd(0, z, 64);
    _tile_loadd(1, z, 64);
    _tile_loadd(2, z, 64);
    _tile_loadd(3, z, 64);
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbssd(4, 0, 2);
        _tile_dpbssd(5, 0, 3);
        _tile_dpbssd(6, 1, 2);
        _tile_dpbssd(7, 1, 3);
    }
    int32_t out[16 * 16] __attribute__((aligned(64)));
    _tile_stored(4, out, 64);
    __asm__ volatile("" ::: "memory");
    _tile_release();
    return iters * 4 * 16 * 16 * 64 + (out[0] & 0); /* keep the chain live */
}
#endif
