/* actq_avx512.c: AVX-512 kernels beyond the f32-activation matmul (matmul_avx512.c):
 *   1. the int8-activation matmul for q4_g64 / q8_g32 / q8_row with VNNI (vpdpbusd);
 *   2. the transposed product y = x W (kn_matmul_t), all formats;
 *   3. the vector helpers (dot, axpy, rmsnorm, softmax, silu_mul, argmax).
 * Built with -mavx512* -mavx512vnni (Makefile, by file name); only called after dispatch.c saw
 * the CPU support it.
 *
 * 1. int8 activations (layout and math in kn_internal.h). Per 64 weight bytes (a "step": 128
 * columns of q4, 64 of q8) and per (row, activation): q4 = and, shift+and, 2 vpdpbusd; q8 = xor,
 * 1 vpdpbusd; then one int->float convert, times the activation scales (dexp), fma with the
 * weight scales of the step's two groups (one vpermps). The int32 lanes start from the record's
 * bias (the -8 / -128 offset correction), so each lane is an exact integer (< 2^24) and the
 * only roundings are the f32 convert-mul-fma per step and the final reduce: one fixed order per
 * (row, activation), independent of n, tiling and threads (rows stay bitwise batch-invariant).
 *
 * Error against exact f32 activations: activation j of group g is replaced by d_g q_j with
 * |x_j - d_g q_j| <= d_g / 2 = amax_g / 254, so |y - y_exact| <= sum_j |w_j| amax_g(j) / 254
 * (each term under 0.4 % of the group's largest activation; random signs average it down over
 * the dot: typically ~1e-3 relative to |y| for GLM-sized dots). */
#include <immintrin.h>

#include "kernels/exp512.h"
#include <math.h>
#include <string.h>

#include "kernels/kn_internal.h"

#define AI static inline __attribute__((always_inline))

/* ======================= 1. int8-activation matmul ======================= */
enum { K_Q8R, K_Q8G, K_Q4 };

/* One step (64 weight bytes per row) of R rows x B activations. sc[a] holds the row's group
 * scales, already multiplied by the activation's d when B == 1 (then c = ws * d comes from the
 * row setup; for B > 1 the same product ws * d is formed here per step, the identical f32
 * multiplication, so both give bitwise the same fma(f, ws * d, acc)). */
AI void aq_step(const int K, const int R, const int B, const __m512i *wv,
                const float (*sc)[KN_MAX_SCALES + 32], int64_t s, const uint8_t *xq, int64_t xs,
                int i0, __m512 (*acc)[4]) {
    const int64_t rec = K == K_Q4 ? 256 : 192, qb = K == K_Q4 ? 128 : 64;
    __m512i lo[4], hi[4];
    __m512 wexp[4];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++) {
        if (K == K_Q4) {
            const __m512i m4 = _mm512_set1_epi8(0x0F);
            lo[a] = _mm512_and_si512(wv[a], m4);
            hi[a] = _mm512_and_si512(_mm512_srli_epi16(wv[a], 4), m4);
        } else {
            lo[a] = _mm512_xor_si512(wv[a], _mm512_set1_epi8((char)0x80));
            hi[a] = lo[a];
        }
        if (K != K_Q8R)
            wexp[a] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[a][2 * s]),
                                           _mm512_set1_ps(sc[a][2 * s + 1]));
        else wexp[a] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int b = 0; b < B; b++) {
        const uint8_t *xr = xq + (int64_t)(i0 + b) * xs + s * rec;
        __m512i xe = _mm512_load_si512((const void *)xr);
        __m512i xo = K == K_Q4 ? _mm512_load_si512((const void *)(xr + 64)) : xe;
        __m512i bias = _mm512_load_si512((const void *)(xr + qb));
        __m512 dx = K == K_Q8R || B > 1 ? _mm512_load_ps((const float *)(xr + qb + 64))
                                        : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m512i ia = _mm512_dpbusd_epi32(bias, lo[a], xe);
            if (K == K_Q4) ia = _mm512_dpbusd_epi32(ia, hi[a], xo);
            __m512 f = _mm512_cvtepi32_ps(ia);
            if (K == K_Q8R) acc[a][b] = _mm512_fmadd_ps(f, dx, acc[a][b]);
            else if (B == 1) acc[a][b] = _mm512_fmadd_ps(f, wexp[a], acc[a][b]);
            else acc[a][b] = _mm512_fmadd_ps(f, _mm512_mul_ps(wexp[a], dx), acc[a][b]);
        }
    }
}

static void aq_scales(const pt_wview *W, int64_t r, int g, float *sc) {
    int64_t ng = (W->cols + g - 1) / g, base = r * W->scale_cols, i = 0;
    if (W->scale_dtype == PT_BF16) {
        const uint16_t *p = (const uint16_t *)W->scale + base;
        for (; i + 16 <= ng; i += 16) {
            __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + i)));
            _mm512_storeu_ps(sc + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
    }
    for (; i < ng; i++) sc[i] = kn_scale_at(W, base + i);
    memset(sc + ng, 0, 32 * sizeof(float));
}

AI void aq_tile(const int K, const int R, const int B, const pt_wview *W, int64_t r,
                const uint8_t *xq, int64_t xs, int i0, float *y) {
    float sc[4][KN_MAX_SCALES + 32] __attribute__((aligned(64)));
    const uint8_t *p[4];
    float rs[4];
    const int64_t rb = W->row_bytes, nfull = rb / 64, pf = R * rb;
#pragma GCC unroll 4
    for (int a = 0; a < R; a++) {
        p[a] = W->data + (r + a) * rb;
        rs[a] = 1.f;
        if (K == K_Q8R) rs[a] = kn_scale_at(W, r + a);
        else aq_scales(W, r + a, K == K_Q4 ? 64 : 32, sc[a]);
        if (K != K_Q8R && B == 1) { /* fold the activation's group scales in: c = ws * d */
            const int64_t kind = K == K_Q4 ? KN_ACTQ_Q4 : KN_ACTQ_Q8;
            const float *dg = (const float *)(xq + (int64_t)i0 * xs +
                                              kn_actq_nsteps(kind, W->cols) * kn_actq_rec_bytes(kind));
            int64_t ng = (W->cols + (K == K_Q4 ? 63 : 31)) / (K == K_Q4 ? 64 : 32);
            for (int64_t g = 0; g < ng; g += 16)
                _mm512_storeu_ps(sc[a] + g, _mm512_mul_ps(_mm512_loadu_ps(sc[a] + g),
                                                          _mm512_loadu_ps(dg + g)));
        }
    }
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) acc[a][b] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nfull; s++) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            _mm_prefetch((const char *)p[a] + pf + s * 64, _MM_HINT_T1);
            wv[a] = _mm512_loadu_si512((const void *)(p[a] + s * 64));
        }
        aq_step(K, R, B, wv, sc, s, xq, xs, i0, acc);
    }
    if (rb % 64) {
        __mmask64 m = ((__mmask64)1 << (rb % 64)) - 1;
        __m512i wv[4];
        for (int a = 0; a < R; a++) wv[a] = _mm512_maskz_loadu_epi8(m, p[a] + nfull * 64);
        aq_step(K, R, B, wv, sc, nfull, xq, xs, i0, acc);
    }
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) {
            float v = _mm512_reduce_add_ps(acc[a][b]);
            if (K == K_Q8R) v *= rs[a];
            y[(int64_t)(i0 + b) * W->rows + r + a] = v;
        }
}

#define AQ_CASES(K, R)                                                          \
    switch (B) {                                                                \
    case 4: aq_tile(K, R, 4, W, r, xq, xs, i0, y); break;                       \
    case 3: aq_tile(K, R, 3, W, r, xq, xs, i0, y); break;                       \
    case 2: aq_tile(K, R, 2, W, r, xq, xs, i0, y); break;                       \
    default: aq_tile(K, R, 1, W, r, xq, xs, i0, y); break;                      \
    }

AI void aq_rows(const int K, const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq,
                int64_t xs, int n, float *y) {
    const int BMAX = K == K_Q4 ? 3 : 4;
    int64_t rc = (256 << 10) / (W->row_bytes > 0 ? W->row_bytes : 1);
    rc = rc < 4 ? 4 : rc & ~(int64_t)3;
    for (int64_t c0 = r0; c0 < r1; c0 += rc) {
        int64_t c1 = c0 + rc < r1 ? c0 + rc : r1;
        for (int i0 = 0; i0 < n; i0 += BMAX) {
            int B = n - i0 < BMAX ? n - i0 : BMAX;
            int64_t r = c0;
            for (; r + 4 <= c1; r += 4) AQ_CASES(K, 4)
            for (; r < c1; r++) AQ_CASES(K, 1)
        }
    }
}

void kn_actq_rows_avx512(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq,
                         int64_t xs, int n, float *y) {
    switch (W->qtype) {
    case PT_Q8_ROW: aq_rows(K_Q8R, W, r0, r1, xq, xs, n, y); break;
    case PT_Q8_G32: aq_rows(K_Q8G, W, r0, r1, xq, xs, n, y); break;
    case PT_Q4_G64: aq_rows(K_Q4, W, r0, r1, xq, xs, n, y); break;
    default: break;
    }
}

/* Activation preparation, bit-identical to kn_actq_prep (ref.c): the same amax, d = amax / 127,
 * id = 127 / amax, q = rint(x * id) clamped (vcvtps2dq rounds to nearest even like rintf), NaN
 * products -> 0, d NaN where the group holds a NaN or inf. */
static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* One group of 16*V floats at x[j0..), cols bound: int32 q vectors, d and sum(q). */
AI void aq_group(const int V, const float *x, int64_t j0, int64_t cols, __m512i *q, float *d,
                 int32_t *sum) {
    __m512 v[4], amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
#pragma GCC unroll 4
    for (int u = 0; u < V; u++) {
        __mmask16 m = lanes(cols - (j0 + u * 16));
        v[u] = _mm512_maskz_loadu_ps(m, x + j0 + u * 16);
        bad |= _mm512_fpclass_ps_mask(v[u], 0x01 | 0x80 | 0x08 | 0x10);
        amax = _mm512_max_ps(amax, _mm512_and_ps(v[u], absm));
    }
    float am = _mm512_reduce_max_ps(amax);
    float id = am > 0.f && am < INFINITY ? 127.f / am : 0.f;
    *d = bad ? NAN : am / 127.f;
    __m512 idv = _mm512_set1_ps(id);
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int u = 0; u < V; u++) {
        __m512 t = _mm512_mul_ps(v[u], idv);
        __m512i qi = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q), t);
        qi = _mm512_max_epi32(_mm512_min_epi32(qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        q[u] = qi;
        acc = _mm512_add_epi32(acc, qi);
    }
    *sum = _mm512_reduce_add_epi32(acc);
}

void kn_actq_prep_avx512(int kind, const float *x, int n, int64_t cols, uint8_t *xq) {
    const int64_t sc = kn_actq_step_cols(kind), rec = kn_actq_rec_bytes(kind);
    const int64_t nsteps = (cols + sc - 1) / sc, qb = kind == KN_ACTQ_Q4 ? 128 : 64;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (int64_t)i * cols;
        uint8_t *row = xq + (int64_t)i * kn_actq_row_bytes(kind, cols);
        float *dg = (float *)(row + nsteps * rec);
        memset(dg, 0, (size_t)(kn_actq_row_bytes(kind, cols) - nsteps * rec));
        for (int64_t s = 0; s < nsteps; s++) {
            uint8_t *r = row + s * rec;
            int32_t bias[16] __attribute__((aligned(64))) = {0};
            float dexp[16] __attribute__((aligned(64)));
            for (int h = 0; h < 2; h++) {
                __m512i q[4];
                float d;
                int32_t sum;
                if (kind == KN_ACTQ_Q4) {
                    aq_group(4, xi, s * sc + h * 64, cols, q, &d, &sum);
                    __m512i b = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_setr_m128i(_mm512_cvtepi32_epi8(q[0]),
                                                                 _mm512_cvtepi32_epi8(q[1]))),
                        _mm256_setr_m128i(_mm512_cvtepi32_epi8(q[2]), _mm512_cvtepi32_epi8(q[3])), 1);
                    _mm256_store_si256((__m256i *)(r + h * 32), _mm512_cvtepi16_epi8(b));
                    _mm256_store_si256((__m256i *)(r + 64 + h * 32),
                                       _mm512_cvtepi16_epi8(_mm512_srai_epi16(b, 8)));
                    bias[h * 8] = -8 * sum;
                } else {
                    aq_group(2, xi, s * sc + h * 32, cols, q, &d, &sum);
                    _mm_store_si128((__m128i *)(r + h * 32), _mm512_cvtepi32_epi8(q[0]));
                    _mm_store_si128((__m128i *)(r + h * 32 + 16), _mm512_cvtepi32_epi8(q[1]));
                    bias[h * 8] = -128 * sum;
                }
                _mm256_store_ps(dexp + h * 8, _mm256_set1_ps(d));
                if ((s * sc + h * sc / 2) < cols) dg[s * 2 + h] = d;
            }
            _mm512_store_si512((void *)(r + qb), _mm512_load_si512((const void *)bias));
            _mm512_store_ps((float *)(r + qb + 64), _mm512_load_ps(dexp));
        }
    }
}

/* ======================= 2. transposed product ======================= */
/* Weights of row r, columns [c, c+16) (c a multiple of 16), natural order, as f32 exactly like
 * pt_dequant_row; m masks columns < cols. */
enum { T_F32, T_BF16, T_F16, T_FP8, T_Q8R, T_Q8G, T_Q4 };

AI __m512 tw_vec(const int F, const pt_wview *W, const uint8_t *p, int64_t r, int64_t c,
                 __mmask16 m, float rs) {
    switch (F) {
    case T_F32: return _mm512_maskz_loadu_ps(m, (const float *)p + c);
    case T_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + c)), 16));
    case T_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + c));
    case T_FP8: {
        __m256i b = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, p + c));
        b = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xBF80));
        float k = kn_scale_at(W, (r / W->block_rows) * W->scale_cols + c / W->block_cols) * 256.f;
        return _mm512_mul_ps(_mm512_cvtph_ps(b), _mm512_set1_ps(k));
    }
    case T_Q8R:
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p + c))),
                             _mm512_set1_ps(rs));
    case T_Q8G: {
        float s = kn_scale_at(W, r * W->scale_cols + c / 32);
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p + c))),
                             _mm512_set1_ps(s));
    }
    default: { /* q4: 8 bytes -> 16 nibbles, low nibble first */
        __mmask16 mb = (__mmask16)(m == 0xFFFF ? 0xFF : ((1u << ((__builtin_popcount(m) + 1) / 2)) - 1));
        __m128i b = _mm_maskz_loadu_epi8(mb, p + c / 2);
        __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
        v = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)),
                             _mm512_set1_epi32(15));
        float s = kn_scale_at(W, r * W->scale_cols + c / 64);
        __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(s), _mm512_set1_ps(-8.f * s));
        return _mm512_maskz_mov_ps(m, w);
    }
    }
}

/* Columns [c0, c0 + 64) masked to < c1, activations i0 .. i0+B-1: registers over all rows. */
AI void t_tile(const int F, const int B, const pt_wview *W, int64_t c0, int64_t c1,
               const float *x, int i0, float *y) {
    __m512 acc[4][4];
    __mmask16 m[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) {
        int64_t left = c1 - (c0 + u * 16);
        m[u] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) acc[u][b] = _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < W->rows; r++) {
        const uint8_t *p = W->data + r * W->row_bytes;
        float rs = F == T_Q8R ? kn_scale_at(W, r) : 1.f;
        __m512 xb[4];
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) xb[b] = _mm512_set1_ps(x[(int64_t)(i0 + b) * W->rows + r]);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            if (!m[u]) continue;
            __m512 w = tw_vec(F, W, p, r, c0 + u * 16, m[u], rs);
#pragma GCC unroll 4
            for (int b = 0; b < B; b++) acc[u][b] = _mm512_fmadd_ps(xb[b], w, acc[u][b]);
        }
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++)
            _mm512_mask_storeu_ps(y + (int64_t)(i0 + b) * W->cols + c0 + u * 16, m[u], acc[u][b]);
}

/* The MLA absorption (W_UK^T q per head) for B activation rows (1-6; q8_g32, whole 64-column
 * tiles): the same arithmetic as t_tile (w = q * s rounded, then fma(x, w, acc), r ascending)
 * with each row's four accumulators in registers and one scale load per 32 columns, so every
 * output element is the same chain whatever B: bitwise t_tile's and a row run alone. For
 * several rows this is faster than staging the tile's floats through t_tile_many's buffer (one
 * dev-box core, 64 heads of [192 x 512]: 2 rows 1.19 -> 0.45 ms, 6 rows 1.2-1.5 -> 0.7-0.85,
 * 8 rows 1.6-2.0 -> 1.1-1.3; in the engine the batched step's W_UK^T products 6.0 -> 3.2 ms at
 * 8 rows). */
AI void t_tile_q8g_m(const int B, const pt_wview *W, int64_t c0, const float *x, int i0, float *y) {
    __m512 a[6][4];
#pragma GCC unroll 6
    for (int b = 0; b < B; b++) a[b][0] = a[b][1] = a[b][2] = a[b][3] = _mm512_setzero_ps();
    const int64_t g0 = c0 / 32;
    const float *xr = x + (int64_t)i0 * W->rows;
    /* the first tile pulls whole rows (a few ahead) into L2, so the later tiles of the same rows
     * hit the cache instead of each walking memory with a stride of one row */
    const int pull = c0 == 0;
    for (int64_t r = 0; r < W->rows; r++) {
        const uint8_t *p = W->data + r * W->row_bytes + c0;
        if (pull && r + 16 < W->rows)
            for (int64_t b = 0; b < W->row_bytes; b += 64) _mm_prefetch((const char *)W->data + (r + 16) * W->row_bytes + b, _MM_HINT_T1);
        const int64_t si = r * W->scale_cols + g0;
        __m512 s0 = _mm512_set1_ps(kn_scale_at(W, si)), s1 = _mm512_set1_ps(kn_scale_at(W, si + 1));
        __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), s0);
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))), s0);
        __m512 w2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32)))), s1);
        __m512 w3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 48)))), s1);
#pragma GCC unroll 6
        for (int b = 0; b < B; b++) {
            __m512 xb = _mm512_set1_ps(xr[(int64_t)b * W->rows + r]);
            a[b][0] = _mm512_fmadd_ps(xb, w0, a[b][0]);
            a[b][1] = _mm512_fmadd_ps(xb, w1, a[b][1]);
            a[b][2] = _mm512_fmadd_ps(xb, w2, a[b][2]);
            a[b][3] = _mm512_fmadd_ps(xb, w3, a[b][3]);
        }
    }
#pragma GCC unroll 6
    for (int b = 0; b < B; b++) {
        float *yr = y + (int64_t)(i0 + b) * W->cols + c0;
        _mm512_storeu_ps(yr, a[b][0]);
        _mm512_storeu_ps(yr + 16, a[b][1]);
        _mm512_storeu_ps(yr + 32, a[b][2]);
        _mm512_storeu_ps(yr + 48, a[b][3]);
    }
}


/* Several activation rows (n >= 2): a 64-column tile's weights are dequantized once per chunk
 * of TW_R rows (tw_vec: the floats t_tile uses) into a stack buffer, then every activation row
 * runs against it, six at a time (24 accumulators, 4 loads + 6 broadcasts per 24 fma): the
 * dequantization is no longer repeated per four rows. Each output element is the same fma chain
 * over r ascending as t_tile (partial sums pass through y between chunks, exactly), so results
 * are bitwise those of t_tile and of a row run alone. */
#define TW_R 128
AI void t_acc(const int B, const float *wb, int nr, const float *x, int64_t rows, int64_t r0, int i0,
              const __mmask16 m[4], int first, float *y, int64_t cols, int64_t c0) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int b = 0; b < B; b++)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
            acc[b][u] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m[u], y + (int64_t)(i0 + b) * cols + c0 + u * 16);
    const float *xr = x + (int64_t)i0 * rows + r0;
    for (int r = 0; r < nr; r++) {
        __m512 w[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) w[u] = _mm512_load_ps(wb + (size_t)r * 64 + u * 16);
#pragma GCC unroll 6
        for (int b = 0; b < B; b++) {
            __m512 xb = _mm512_set1_ps(xr[(int64_t)b * rows + r]);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) acc[b][u] = _mm512_fmadd_ps(xb, w[u], acc[b][u]);
        }
    }
#pragma GCC unroll 6
    for (int b = 0; b < B; b++)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(y + (int64_t)(i0 + b) * cols + c0 + u * 16, m[u], acc[b][u]);
}

AI void t_tile_many(const int F, const pt_wview *W, int64_t c0, int64_t c1, const float *x, int n, float *y) {
    float wb[TW_R * 64] __attribute__((aligned(64)));
    __mmask16 m[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) {
        int64_t left = c1 - (c0 + u * 16);
        m[u] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    }
    for (int64_t r0 = 0; r0 < W->rows; r0 += TW_R) {
        int nr = W->rows - r0 < TW_R ? (int)(W->rows - r0) : TW_R;
        for (int r = 0; r < nr; r++) {
            const uint8_t *p = W->data + (r0 + r) * W->row_bytes;
            float rs = F == T_Q8R ? kn_scale_at(W, r0 + r) : 1.f;
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++)
                _mm512_store_ps(wb + (size_t)r * 64 + u * 16, m[u] ? tw_vec(F, W, p, r0 + r, c0 + u * 16, m[u], rs) : _mm512_setzero_ps());
        }
        for (int i0 = 0; i0 < n; i0 += 6) switch (n - i0 < 6 ? n - i0 : 6) {
            case 6: t_acc(6, wb, nr, x, W->rows, r0, i0, m, r0 == 0, y, W->cols, c0); break;
            case 5: t_acc(5, wb, nr, x, W->rows, r0, i0, m, r0 == 0, y, W->cols, c0); break;
            case 4: t_acc(4, wb, nr, x, W->rows, r0, i0, m, r0 == 0, y, W->cols, c0); break;
            case 3: t_acc(3, wb, nr, x, W->rows, r0, i0, m, r0 == 0, y, W->cols, c0); break;
            case 2: t_acc(2, wb, nr, x, W->rows, r0, i0, m, r0 == 0, y, W->cols, c0); break;
            default: t_acc(1, wb, nr, x, W->rows, r0, i0, m, r0 == 0, y, W->cols, c0); break;
            }
    }
}

AI void t_cols(const int F, const pt_wview *W, int64_t c0, int64_t c1, const float *x, int n,
               float *y) {
    for (int64_t c = c0; c < c1; c += 64) {
        if (F == T_Q8G && n <= 8 && c + 64 <= c1 && c % 32 == 0) { /* passes of up to 6 rows (8 = 6 + 2; 6 + 2 and 4 + 4 measured alike) */
            for (int i0 = 0; i0 < n; i0 += 6) switch (n - i0 < 6 ? n - i0 : 6) {
                case 6: t_tile_q8g_m(6, W, c, x, i0, y); break;
                case 5: t_tile_q8g_m(5, W, c, x, i0, y); break;
                case 4: t_tile_q8g_m(4, W, c, x, i0, y); break;
                case 3: t_tile_q8g_m(3, W, c, x, i0, y); break;
                case 2: t_tile_q8g_m(2, W, c, x, i0, y); break;
                default: t_tile_q8g_m(1, W, c, x, i0, y); break;
                }
        } else if (n >= 2) t_tile_many(F, W, c, c1, x, n, y);
        else t_tile(F, 1, W, c, c1, x, 0, y);
    }
}

void kn_matmul_t_cols_avx512(const pt_wview *W, int64_t c0, int64_t c1, const float *x, int n,
                             float *y) {
    switch (W->qtype) {
    case PT_F32: t_cols(T_F32, W, c0, c1, x, n, y); break;
    case PT_BF16: t_cols(T_BF16, W, c0, c1, x, n, y); break;
    case PT_F16: t_cols(T_F16, W, c0, c1, x, n, y); break;
    case PT_FP8_E4M3: t_cols(T_FP8, W, c0, c1, x, n, y); break;
    case PT_Q8_ROW: t_cols(T_Q8R, W, c0, c1, x, n, y); break;
    case PT_Q8_G32: t_cols(T_Q8G, W, c0, c1, x, n, y); break;
    case PT_Q4_G64: t_cols(T_Q4, W, c0, c1, x, n, y); break;
    default: kn_ref_matmul_t_cols(W, c0, c1, x, n, y); break;
    }
}

/* ======================= 3. vector helpers ======================= */
static inline __mmask16 tailmask(int64_t left) {
    return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
}

float kn_dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(b + j + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 32), _mm512_loadu_ps(b + j + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 48), _mm512_loadu_ps(b + j + 48), s3);
    }
    for (; j < n; j += 16) {
        __mmask16 m = tailmask(n - j);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + j), _mm512_maskz_loadu_ps(m, b + j), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

void kn_axpy_avx512(float *y, float a, const float *x, int64_t n) {
    __m512 av = _mm512_set1_ps(a);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = tailmask(n - j);
        _mm512_mask_storeu_ps(y + j, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + j),
                                                        _mm512_maskz_loadu_ps(m, y + j)));
    }
}

void kn_rmsnorm_avx512(float *out, const float *x, const float *w, int64_t n, float eps) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
        s0 = _mm512_fmadd_ps(a, a, s0);
        s1 = _mm512_fmadd_ps(b, b, s1);
    }
    for (; j < n; j += 16) {
        __m512 a = _mm512_maskz_loadu_ps(tailmask(n - j), x + j);
        s0 = _mm512_fmadd_ps(a, a, s0);
    }
    float ss = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(ss / (float)(n > 0 ? n : 1) + eps));
    for (j = 0; j < n; j += 16) {
        __mmask16 m = tailmask(n - j);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), inv);
        if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + j));
        _mm512_mask_storeu_ps(out + j, m, v);
    }
}


void kn_softmax_avx512(float *x, int64_t n) {
    if (n <= 0) return;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16)
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tailmask(n - j), x + j));
    float m = _mm512_reduce_max_ps(mx);
    if (m == -INFINITY) {
        memset(x, 0, (size_t)n * sizeof(float));
        return;
    }
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tailmask(n - j);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), mv));
        e = _mm512_maskz_mov_ps(k, e);
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(x + j, k, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tailmask(n - j);
        _mm512_mask_storeu_ps(x + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + j), inv));
    }
}

void kn_silu_mul_avx512(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = tailmask(n - j);
        __m512 g = _mm512_maskz_loadu_ps(k, gate + j), u = _mm512_maskz_loadu_ps(k, up + j);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(out + j, k, _mm512_mul_ps(s, u));
    }
}

/* kn_argmax (kernels.h): the largest value that is not NaN in one pass (ordered lanes only),
 * then the first index holding it (== treats -0 and +0 alike, as the scalar's > does). */
int64_t kn_argmax_avx512(const float *x, int64_t n) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    __mmask16 seen = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 ok = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
        mx = _mm512_mask_max_ps(mx, ok, mx, v);
        seen |= ok;
    }
    if (i < n) {
        __mmask16 t = (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(t, x + i);
        __mmask16 ok = _mm512_mask_cmp_ps_mask(t, v, v, _CMP_ORD_Q);
        mx = _mm512_mask_max_ps(mx, ok, mx, v);
        seen |= ok;
    }
    if (!seen) return n - 1;
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= n; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
    __mmask16 t = (__mmask16)((1u << (n - i)) - 1);
    __mmask16 eq = _mm512_mask_cmp_ps_mask(t, _mm512_maskz_loadu_ps(t, x + i), mv, _CMP_EQ_OQ);
    return eq ? i + __builtin_ctz(eq) : n - 1; /* the maximum is among them (eq is never 0 here) */
}
