/* r16_avx512.c: the PT_LAYOUT_R16 matmul with AVX-512 VNNI (math and layout: r16.c,
 * quant/qtypes.h). One zmm lane per weight row, 16 rows per block; per group of a block and per
 * activation: 8 vpdpbusd (q4: 16, after splitting nibbles) into an int32 accumulator that starts
 * at the group's bias, one convert, one multiply (scales x d) and one fma (q4, one row at a
 * time: the high nibbles are masked in place, 16 times their value, and their int32 sum shifted
 * back once per group: one vector op fewer per 64 bytes, the same integers). The activation
 * dword is a broadcast memory operand. Blocks go in pairs (block2: 32 rows, two weight streams in
 * flight, each activation dword broadcast once for both), one pass over the weights for up to 8
 * activations (q8; q4 4), more in further passes from L2; a task's odd last block runs alone
 * (block). Bitwise equal to kn_r16_rows_ref. */
#include <immintrin.h>
#include <string.h>

#include "kernels/kn_internal.h"
#include "kernels/r16_scales.h"

#define AI static inline __attribute__((always_inline))

/* Software prefetch of the weight stream pf bytes ahead: PFL 0 none, 1 into L1 (T0), 2 into L2
 * (T1), every other line of a 512-byte group (the hardware's adjacent-line prefetch completes the
 * 128-byte pairs), as the bandwidth probe does: with two of its eight lines (before 2026-12-04)
 * the kernels read at 85-88 % of the probe on the Intel host at 2 threads; 3 and 4 the same with
 * every line (the default): on both CPU kinds the pairs were not completed in time for products
 * of several rows, slower per byte, which then read the lines they were not given at the
 * memory's latency, one after another (AMD, one thread, q8 at 8 rows: 14 -> 22 GB/s; bench/
 * RESULTS.md, 2026-12-04 20:05 and 21:20). */
#define PF(PFL, p, pf)                                                                         \
    do {                                                                                       \
        const int step_ = PFL >= 3 ? 64 : 128;                                                 \
        for (int l_ = 0; PFL && l_ < 512; l_ += step_) {                                       \
            if (PFL == 1 || PFL == 3) _mm_prefetch((const char *)(p) + (pf) + l_, _MM_HINT_T0);  \
            else _mm_prefetch((const char *)(p) + (pf) + l_, _MM_HINT_T1);                     \
        }                                                                                      \
    } while (0)

/* The scales are a second stream (a block's 16 per group, 32 bytes in bf16, beside 512 bytes of
 * weights), which the weights' prefetch does not cover: their loads missed and stalled the
 * group's epilogue. Prefetched as far ahead in groups as the weights are (one line per group,
 * to the weights' level): alternated in one process on the dev box (AMD, 2 threads, weights from
 * memory), faster in 33 of 36 pairs, +1-4 % at one row, +5-16 % for q8 at 8 rows (bench/
 * RESULTS.md, 2026-12-05 02:15). */
AI void pf_scales(const int PFL, const pt_wview *W, int64_t idx, int64_t pf) {
    if (!PFL) return;
    const int es = W->scale_dtype == PT_F32 ? 4 : 2;
    const char *p = (const char *)W->scale + (idx + pf / 512 * 16) * es;
    if (PFL == 1 || PFL == 3) _mm_prefetch(p, _MM_HINT_T0);
    else _mm_prefetch(p, _MM_HINT_T1);
}

AI void block(const int Q4, const int B, const int PFL, const pt_wview *W, int64_t b, const uint8_t *xq, int64_t xs, int i0, int64_t pf, float *y) {
    const int g = Q4 ? 64 : 32;
    const int64_t cols = W->cols, ng = cols / g, qb = (cols + 63) / 64 * 64, fb = (ng * 4 + 63) / 64 * 64;
    const uint8_t *blk = W->data + b * 16 * W->row_bytes;
    const uint8_t *xr[4];
    const float *d[4];
    const int32_t *bias[4];
    __m512 acc[4];
#pragma GCC unroll 4
    for (int a = 0; a < B; a++) {
        xr[a] = xq + (int64_t)(i0 + a) * xs;
        d[a] = (const float *)(xr[a] + qb);
        bias[a] = (const int32_t *)(xr[a] + qb + fb);
        acc[a] = _mm512_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F), mh = _mm512_set1_epi8((char)0xF0);
    for (int64_t gi = 0; gi < ng; gi++) {
        const uint8_t *wg = blk + gi * 512;
        PF(PFL, wg, pf);
        pf_scales(PFL, W, (b * ng + gi) * 16, pf);
        __m512i ia[4], ib[4];
#pragma GCC unroll 4
        for (int a = 0; a < B; a++) {
            ia[a] = _mm512_set1_epi32(bias[a][gi]);
            ib[a] = _mm512_setzero_si512();
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m512i wv = _mm512_loadu_si512((const void *)(wg + k * 64));
            if (!Q4) {
#pragma GCC unroll 4
                for (int a = 0; a < B; a++) {
                    int32_t xv;
                    memcpy(&xv, xr[a] + gi * 32 + 4 * k, 4);
                    if (k & 1) ib[a] = _mm512_dpbusd_epi32(ib[a], wv, _mm512_set1_epi32(xv));
                    else ia[a] = _mm512_dpbusd_epi32(ia[a], wv, _mm512_set1_epi32(xv));
                }
            } else { /* the high nibbles in place (16 u): ib sums 16 x their products, exactly */
                __m512i lo = _mm512_and_si512(wv, m4), hi = _mm512_and_si512(wv, mh);
#pragma GCC unroll 4
                for (int a = 0; a < B; a++) {
                    int32_t x0, x1;
                    memcpy(&x0, xr[a] + gi * 64 + 8 * k, 4);
                    memcpy(&x1, xr[a] + gi * 64 + 8 * k + 4, 4);
                    ia[a] = _mm512_dpbusd_epi32(ia[a], lo, _mm512_set1_epi32(x0));
                    ib[a] = _mm512_dpbusd_epi32(ib[a], hi, _mm512_set1_epi32(x1));
                }
            }
        }
        __m512 s = r16_scales16(W, (b * ng + gi) * 16);
#pragma GCC unroll 4
        for (int a = 0; a < B; a++) {
            /* q4: ib is a multiple of 16 (|ib| <= 16 * 32 * 15 * 127 < 2^20), so the shift is exact */
            __m512i ibv = Q4 ? _mm512_srai_epi32(ib[a], 4) : ib[a];
            __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(ia[a], ibv));
            acc[a] = _mm512_fmadd_ps(f, _mm512_mul_ps(s, _mm512_set1_ps(d[a][gi])), acc[a]);
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < B; a++) _mm512_storeu_ps(y + (int64_t)(i0 + a) * W->rows + b * 16, acc[a]);
}

/* Two adjacent blocks (32 rows) against B activations (1-8): each activation dword is broadcast
 * once for two vpdpbusd, which halves the broadcasts per multiply (+10-20 % at n = 512 on the
 * dev box, bench/KERNELS.md round 4); 2 x 4 independent int32 chains. Above 4 activations a
 * group runs in halves of up to 4 (the group's 1 KB of weights read again from L1), so the
 * weights stream from memory once for 8 rows: two passes of 4 over a whole block pair left the
 * memory idle while the second pass ran from L2 (the head with 8 rows at 47 % of the probe on
 * the dev box). Per activation the same integer sums and the same float chain either way. */
AI void block2(const int Q4, const int B, const int PFL, const pt_wview *W, int64_t b, const uint8_t *xq, int64_t xs, int i0, int64_t pf, float *y) {
    const int g = Q4 ? 64 : 32;
    const int64_t cols = W->cols, ng = cols / g, qb = (cols + 63) / 64 * 64, fb = (ng * 4 + 63) / 64 * 64;
    const uint8_t *blk0 = W->data + b * 16 * W->row_bytes, *blk1 = blk0 + 16 * W->row_bytes;
    const uint8_t *xr[8];
    const float *d[8];
    const int32_t *bias[8];
    __m512 acc0[8], acc1[8];
#pragma GCC unroll 8
    for (int a = 0; a < B; a++) {
        xr[a] = xq + (int64_t)(i0 + a) * xs;
        d[a] = (const float *)(xr[a] + qb);
        bias[a] = (const int32_t *)(xr[a] + qb + fb);
        acc0[a] = acc1[a] = _mm512_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F), mh = _mm512_set1_epi8((char)0xF0);
    /* one activation (decode) and q4: the high nibbles in place into their own sums (as block) */
    const int HI = Q4 && B == 1;
    for (int64_t gi = 0; gi < ng; gi++) {
        const uint8_t *w0 = blk0 + gi * 512, *w1 = blk1 + gi * 512;
        /* each stream's prefetch runs on into its own block of the next pair (b + 2, b + 3),
         * over the other stream's block: straight on, the first stream's ran into the second's
         * block (read already) and the next pair's second block started unprefetched */
        const int64_t pfa = gi * 512 + pf >= ng * 512 ? pf + ng * 512 : pf;
        PF(PFL, w0, pfa);
        PF(PFL, w1, pfa);
        pf_scales(PFL, W, (b * ng + gi) * 16, pfa);
        pf_scales(PFL, W, ((b + 1) * ng + gi) * 16, pfa);
        __m512 s0 = r16_scales16(W, (b * ng + gi) * 16), s1 = r16_scales16(W, ((b + 1) * ng + gi) * 16);
#pragma GCC unroll 2
        for (int h = 0; h < B; h += 4) {
            const int H = B - h < 4 ? B - h : 4;
            __m512i i0a[4], i1a[4], h0 = _mm512_setzero_si512(), h1 = h0;
#pragma GCC unroll 4
            for (int a = 0; a < H; a++) i0a[a] = i1a[a] = _mm512_set1_epi32(bias[h + a][gi]);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m512i v0 = _mm512_loadu_si512((const void *)(w0 + k * 64)), v1 = _mm512_loadu_si512((const void *)(w1 + k * 64));
                if (!Q4) {
#pragma GCC unroll 4
                    for (int a = 0; a < H; a++) {
                        int32_t xv;
                        memcpy(&xv, xr[h + a] + gi * 32 + 4 * k, 4);
                        __m512i xb = _mm512_set1_epi32(xv);
                        i0a[a] = _mm512_dpbusd_epi32(i0a[a], v0, xb);
                        i1a[a] = _mm512_dpbusd_epi32(i1a[a], v1, xb);
                    }
                } else if (HI) {
                    int32_t x0, x1;
                    memcpy(&x0, xr[0] + gi * 64 + 8 * k, 4);
                    memcpy(&x1, xr[0] + gi * 64 + 8 * k + 4, 4);
                    __m512i xb0 = _mm512_set1_epi32(x0), xb1 = _mm512_set1_epi32(x1);
                    i0a[0] = _mm512_dpbusd_epi32(i0a[0], _mm512_and_si512(v0, m4), xb0);
                    i1a[0] = _mm512_dpbusd_epi32(i1a[0], _mm512_and_si512(v1, m4), xb0);
                    h0 = _mm512_dpbusd_epi32(h0, _mm512_and_si512(v0, mh), xb1);
                    h1 = _mm512_dpbusd_epi32(h1, _mm512_and_si512(v1, mh), xb1);
                } else {
                    __m512i lo0 = _mm512_and_si512(v0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
                    __m512i lo1 = _mm512_and_si512(v1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
#pragma GCC unroll 4
                    for (int a = 0; a < H; a++) {
                        int32_t x0, x1;
                        memcpy(&x0, xr[h + a] + gi * 64 + 8 * k, 4);
                        memcpy(&x1, xr[h + a] + gi * 64 + 8 * k + 4, 4);
                        __m512i xb0 = _mm512_set1_epi32(x0), xb1 = _mm512_set1_epi32(x1);
                        i0a[a] = _mm512_dpbusd_epi32(i0a[a], lo0, xb0);
                        i1a[a] = _mm512_dpbusd_epi32(i1a[a], lo1, xb0);
                        i0a[a] = _mm512_dpbusd_epi32(i0a[a], hi0, xb1);
                        i1a[a] = _mm512_dpbusd_epi32(i1a[a], hi1, xb1);
                    }
                }
            }
            if (HI) { /* 16 x the high nibbles' sums: exact multiples of 16 (block's bound) */
                i0a[0] = _mm512_add_epi32(i0a[0], _mm512_srai_epi32(h0, 4));
                i1a[0] = _mm512_add_epi32(i1a[0], _mm512_srai_epi32(h1, 4));
            }
#pragma GCC unroll 4
            for (int a = 0; a < H; a++) {
                __m512 da = _mm512_set1_ps(d[h + a][gi]);
                acc0[h + a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0a[a]), _mm512_mul_ps(s0, da), acc0[h + a]);
                acc1[h + a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1a[a]), _mm512_mul_ps(s1, da), acc1[h + a]);
            }
        }
    }
#pragma GCC unroll 8
    for (int a = 0; a < B; a++) {
        _mm512_storeu_ps(y + (int64_t)(i0 + a) * W->rows + b * 16, acc0[a]);
        _mm512_storeu_ps(y + (int64_t)(i0 + a) * W->rows + b * 16 + 16, acc1[a]);
    }
}

AI void rows_q(const int Q4, const int PFL, const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, int64_t pf, float *y) {
    int64_t b = r0 / 16, be = r1 / 16;
    /* pairs of blocks (one row too: two weight streams in flight), up to 8 activations a pass
     * for q8, 4 for q4 (whose 8 would hold 34 vectors live: spilled, 8-12 % slower from L2 on
     * the dev box); a single block is left for the loop below */
    const int maxb = Q4 ? 4 : 8;
    for (; b + 1 < be; b += 2)
        for (int i0 = 0; i0 < n; i0 += maxb) switch (n - i0 < maxb ? n - i0 : maxb) {
            case 8: block2(Q4, 8, PFL, W, b, xq, xs, i0, pf, y); break;
            case 7: block2(Q4, 7, PFL, W, b, xq, xs, i0, pf, y); break;
            case 6: block2(Q4, 6, PFL, W, b, xq, xs, i0, pf, y); break;
            case 5: block2(Q4, 5, PFL, W, b, xq, xs, i0, pf, y); break;
            case 4: block2(Q4, 4, PFL, W, b, xq, xs, i0, pf, y); break;
            case 3: block2(Q4, 3, PFL, W, b, xq, xs, i0, pf, y); break;
            case 2: block2(Q4, 2, PFL, W, b, xq, xs, i0, pf, y); break;
            default: block2(Q4, 1, PFL, W, b, xq, xs, i0, pf, y); break;
            }
    for (; b < be; b++)
        for (int i0 = 0; i0 < n; i0 += 4) switch (n - i0 < 4 ? n - i0 : 4) {
            case 4: block(Q4, 4, PFL, W, b, xq, xs, i0, pf, y); break;
            case 3: block(Q4, 3, PFL, W, b, xq, xs, i0, pf, y); break;
            case 2: block(Q4, 2, PFL, W, b, xq, xs, i0, pf, y); break;
            default: block(Q4, 1, PFL, W, b, xq, xs, i0, pf, y); break;
            }
}

void kn_r16_rows_avx512(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y, int pf, int pf_l2, int pf_all) {
    int lv = pf <= 0 ? 0 : (pf_l2 ? 2 : 1) + (pf_all ? 2 : 0);
#define R16_LEVELS(Q4)                                                                         \
    switch (lv) {                                                                              \
    case 1: rows_q(Q4, 1, W, r0, r1, xq, xs, n, pf, y); break;                                 \
    case 2: rows_q(Q4, 2, W, r0, r1, xq, xs, n, pf, y); break;                                 \
    case 3: rows_q(Q4, 3, W, r0, r1, xq, xs, n, pf, y); break;                                 \
    case 4: rows_q(Q4, 4, W, r0, r1, xq, xs, n, pf, y); break;                                 \
    default: rows_q(Q4, 0, W, r0, r1, xq, xs, n, 0, y); break;                                 \
    }
    if (W->qtype == PT_Q4_G64) R16_LEVELS(1) else R16_LEVELS(0)
#undef R16_LEVELS
}

/* kn_r16_prep with AVX-512, bit-identical to the scalar one (r16.c / kn_actq_quant_row): per
 * group amax over |x| ignoring NaN, d = amax / 127 (+ NaN when the group holds a NaN or inf),
 * q = round-to-nearest-even(x * (127 / amax)) clamped to +-127, NaN -> 0, bias = -off * sum q. */
void kn_r16_prep_avx512(const pt_wview *W, const float *x, int n, uint8_t *xq) {
    const int g = W->qtype == PT_Q8_G32 ? 32 : 64, nv = g / 16, off = W->qtype == PT_Q8_G32 ? 128 : 8;
    const int64_t cols = W->cols, ng = cols / g, xs = kn_r16_xs(W), qb = (cols + 63) / 64 * 64, fb = (ng * 4 + 63) / 64 * 64;
    const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
    for (int i = 0; i < n; i++) {
        const float *xr = x + (int64_t)i * cols;
        uint8_t *row = xq + i * xs;
        int8_t *q = (int8_t *)row;
        float *d = (float *)(row + qb);
        int32_t *bias = (int32_t *)(row + qb + fb);
        for (int64_t gi = 0; gi < ng; gi++) {
            const float *xg = xr + gi * g;
            __m512 v[4], am = _mm512_setzero_ps();
            __mmask16 bad = 0;
            for (int u = 0; u < nv; u++) {
                v[u] = _mm512_loadu_ps(xg + 16 * u);
                __mmask16 ord = _mm512_cmp_ps_mask(v[u], v[u], _CMP_ORD_Q);
                am = _mm512_max_ps(am, _mm512_maskz_mov_ps(ord, _mm512_abs_ps(v[u])));
                bad |= (__mmask16)~_mm512_cmp_ps_mask(_mm512_sub_ps(v[u], v[u]), _mm512_sub_ps(v[u], v[u]), _CMP_ORD_Q);
            }
            float amax = _mm512_reduce_max_ps(am);
            float id = amax > 0.f && amax < __builtin_inff() ? 127.f / amax : 0.f;
            float probe = 0.f; /* NaN when the group holds a NaN or inf: summed as the reference does */
            if (bad)
                for (int j = 0; j < g; j++) probe += xg[j] - xg[j];
            d[gi] = amax / 127.f + probe;
            __m512 vid = _mm512_set1_ps(id);
            __m512i sum = _mm512_setzero_si512();
            for (int u = 0; u < nv; u++) {
                __m512 t = _mm512_mul_ps(v[u], vid);
                __mmask16 ord = _mm512_cmp_ps_mask(t, t, _CMP_ORD_Q);
                t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                t = _mm512_maskz_mov_ps(ord, _mm512_min_ps(_mm512_max_ps(t, nlim), lim));
                __m512i qi = _mm512_cvtps_epi32(t);
                sum = _mm512_add_epi32(sum, qi);
                _mm_storeu_si128((__m128i *)(q + gi * g + 16 * u), _mm512_cvtepi32_epi8(qi));
            }
            bias[gi] = -off * _mm512_reduce_add_epi32(sum);
        }
        memset(q + cols, 0, (size_t)(qb - cols));
    }
}
