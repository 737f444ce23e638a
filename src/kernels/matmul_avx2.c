/* matmul_avx2.c: y = x W^T for every weight format with AVX2 + FMA + F16C (8 f32 lanes), f32
 * activations and f32 accumulation; the fallback for CPUs without AVX-512. Same structure and
 * determinism rules as matmul_avx512.c (read that first): one 8-lane accumulator per
 * (row, activation) dot, ascending steps, weights w = q * s rounded exactly like
 * pt_dequant_row, zero-padded tail step, fixed-order horizontal sum. Tiles are 4 or 1 weight rows
 * by 1..2 activations (16 ymm registers).
 *
 * q4: a group of 64 columns is 32 bytes = 4 x 8 bytes; 8 bytes widened to 32 bits give 8 even
 * columns (& 15) and 8 odd columns (>> 4), so activations are de-interleaved in chunks of 16
 * (dispatch.c, q4_chunk = 16). w = fma(nib, s, -8 s) equals (nib - 8) * s rounded once, since
 * -8 s is exact. */
#include <immintrin.h>
#include <string.h>

#include "kernels/kn_internal.h"

#define AI static inline __attribute__((always_inline))

enum { F_F32, F_BF16, F_F16, F_FP8, F_Q8R, F_Q8G, F_Q4 };

#define STEP(F) ((F) == F_Q4 ? 64 : (F) == F_Q8G ? 32 : 16)
#define NVEC(F) (STEP(F) / 8)

typedef struct {
    const uint8_t *p;
    float rs; /* q8_row scale */
    int sh;   /* fp8: step s uses sc[s >> sh] */
} rowst;

AI __m256 wvec(const int F, const rowst *st, const float *sc, int64_t s, int u) {
    int64_t j = s * STEP(F) + u * 8; /* first column (not for q4) */
    switch (F) {
    case F_F32: return _mm256_loadu_ps((const float *)st->p + j);
    case F_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)(st->p + j * 2));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case F_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st->p + j * 2)));
    case F_FP8: {
        __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(st->p + j)));
        b = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xBF80));
        return _mm256_mul_ps(_mm256_cvtph_ps(b), _mm256_set1_ps(sc[s >> st->sh]));
    }
    case F_Q8R:
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(st->p + j))));
    case F_Q8G: {
        __m256 q = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(st->p + j))));
        return _mm256_mul_ps(q, _mm256_set1_ps(sc[s]));
    }
    default: { /* F_Q4: u = 2k, 2k+1 -> bytes 8k..8k+7 low / high nibbles */
        __m256i v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)(st->p + s * 32 + (u >> 1) * 8)));
        __m256i nib = (u & 1) ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
        __m256 sv = _mm256_set1_ps(sc[s]);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(nib), sv, _mm256_mul_ps(sv, _mm256_set1_ps(-8.f)));
    }
    }
}

static float wscalar(int F, const rowst *st, const float *sc, int64_t j) {
    switch (F) {
    case F_F32: return ((const float *)st->p)[j];
    case F_BF16: return pt_bf16_to_f32(((const uint16_t *)st->p)[j]);
    case F_F16: return pt_f16_to_f32(((const uint16_t *)st->p)[j]);
    case F_FP8: return pt_fp8e4m3_to_f32(st->p[j]) * (sc[(j / 16) >> st->sh] * (1.0f / 256.f));
    case F_Q8R: return (float)(int8_t)st->p[j];
    case F_Q8G: return (float)(int8_t)st->p[j] * sc[j / 32];
    default: return (float)(((st->p[j >> 1] >> ((j & 1) * 4)) & 15) - 8) * sc[j / 64];
    }
}

static void wtail(int F, const rowst *st, const float *sc, int64_t cols, float *out) {
    int64_t j0 = cols / STEP(F) * STEP(F);
    memset(out, 0, 64 * sizeof(float));
    for (int64_t j = j0; j < cols; j++) {
        int64_t k = j - j0, lane = k;
        if (F == F_Q4) lane = (k & ~15) + ((k & 15) >> 1) + ((k & 1) ? 8 : 0);
        out[lane] = wscalar(F, st, sc, j);
    }
}

static void decode_scales(int dtype, const void *src, int64_t base, int64_t n, float mul,
                          float *dst) {
    for (int64_t i = 0; i < n; i++) {
        float v = dtype == PT_BF16 ? pt_bf16_to_f32(((const uint16_t *)src)[base + i])
                  : dtype == PT_F16 ? pt_f16_to_f32(((const uint16_t *)src)[base + i])
                                    : ((const float *)src)[base + i];
        dst[i] = v * mul;
    }
}

static void row_scales(int F, const pt_wview *W, int64_t r, rowst *st, float *sc) {
    st->p = W->data + r * W->row_bytes;
    st->rs = 1.f;
    st->sh = 0;
    if (F == F_Q8R) st->rs = kn_scale_at(W, r);
    else if (F == F_Q8G || F == F_Q4) {
        int64_t g = F == F_Q8G ? 32 : 64;
        decode_scales(W->scale_dtype, W->scale, r * W->scale_cols, (W->cols + g - 1) / g, 1.f, sc);
    } else if (F == F_FP8) {
        while ((16 << st->sh) < W->block_cols) st->sh++;
        decode_scales(W->scale_dtype, W->scale, (r / W->block_rows) * W->scale_cols,
                      (W->cols + W->block_cols - 1) / W->block_cols, 256.f, sc);
    }
}

/* Fixed-order horizontal sum: (lo128 + hi128), then pairs. */
AI float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

AI void tile(const int F, const int R, const int B, const pt_wview *W, int64_t r,
             const float *xp, int64_t xs, int i0, float *y) {
    float sc[4][KN_MAX_SCALES]; /* fixed sizes, not [R]: a VLA would never live in registers */
    rowst st[4];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++) {
        sc[a][0] = 0.f; /* formats without scales never read it; keeps -Wmaybe-uninitialized quiet */
        row_scales(F, W, r + a, &st[a], sc[a]);
    }
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) acc[a][b] = _mm256_setzero_ps();
    const int64_t cols = W->cols, nstep = cols / STEP(F);
    const float *xb = xp + (int64_t)i0 * xs;
    /* bytes of one row per step; prefetch runs one tile ahead in lockstep: the stream of row a
     * continues R rows later, where the next tile starts. Short rows (2048 columns) otherwise
     * restart the hardware prefetcher every few KB. Prefetches never fault past the end. */
    const int64_t sb = W->row_bytes * STEP(F) / (cols > 0 ? cols : 1), pf = R * W->row_bytes;
    for (int64_t s = 0; s < nstep; s++) {
        _Pragma("GCC unroll 4") for (int a = 0; a < R; a++)
            _mm_prefetch((const char *)st[a].p + pf + s * sb, _MM_HINT_T1);
        /* the vectors of one step, spelled out: a runtime u loop keeps accumulators in memory,
         * and gcc 12 rejects an unroll pragma on a loop it already folded (NVEC == 1) */
#define STEP_U(u)                                                                  \
        if ((u) < NVEC(F)) {                                                        \
            __m256 w[4];                                                             \
            _Pragma("GCC unroll 4") for (int a = 0; a < R; a++)                    \
                w[a] = wvec(F, &st[a], sc[a], s, (u));                             \
            _Pragma("GCC unroll 4") for (int b = 0; b < B; b++) {                  \
                __m256 xv = _mm256_load_ps(xb + b * xs + s * STEP(F) + (u) * 8);      \
                _Pragma("GCC unroll 4") for (int a = 0; a < R; a++)                \
                    acc[a][b] = _mm256_fmadd_ps(w[a], xv, acc[a][b]);                   \
            }                                                                      \
        }
        STEP_U(0) STEP_U(1) STEP_U(2) STEP_U(3)
        STEP_U(4) STEP_U(5) STEP_U(6) STEP_U(7)
#undef STEP_U
    }
    if (cols % STEP(F)) {
        float wt[4][64] __attribute__((aligned(32)));
        for (int a = 0; a < R; a++) wtail(F, &st[a], sc[a], cols, wt[a]);
        for (int u = 0; u < NVEC(F); u++)
            for (int b = 0; b < B; b++) {
                __m256 xv = _mm256_load_ps(xb + b * xs + nstep * STEP(F) + u * 8);
                for (int a = 0; a < R; a++)
                    acc[a][b] = _mm256_fmadd_ps(_mm256_load_ps(wt[a] + u * 8), xv, acc[a][b]);
            }
    }
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) {
            float v = hsum(acc[a][b]);
            if (F == F_Q8R) v *= st[a].rs;
            y[(int64_t)(i0 + b) * W->rows + r + a] = v;
        }
}

AI void rows_fmt(const int F, const pt_wview *W, int64_t r0, int64_t r1, const float *xp,
                 int64_t xs, int n, float *y) {
    int64_t rc = (256 << 10) / (W->row_bytes > 0 ? W->row_bytes : 1);
    rc = rc < 4 ? 4 : rc & ~(int64_t)3;
    for (int64_t c0 = r0; c0 < r1; c0 += rc) {
        int64_t c1 = c0 + rc < r1 ? c0 + rc : r1;
        for (int i0 = 0; i0 < n; i0 += 2) {
            int64_t r = c0;
            if (n - i0 >= 2) {
                for (; r + 4 <= c1; r += 4) tile(F, 4, 2, W, r, xp, xs, i0, y);
                for (; r < c1; r++) tile(F, 1, 2, W, r, xp, xs, i0, y);
            } else {
                for (; r + 4 <= c1; r += 4) tile(F, 4, 1, W, r, xp, xs, i0, y);
                for (; r < c1; r++) tile(F, 1, 1, W, r, xp, xs, i0, y);
            }
        }
    }
}

static void mm_rows(const pt_wview *W, int64_t r0, int64_t r1, const float *xp, int64_t xs,
                    int n, float *y) {
    switch (W->qtype) {
    case PT_F32: rows_fmt(F_F32, W, r0, r1, xp, xs, n, y); break;
    case PT_BF16: rows_fmt(F_BF16, W, r0, r1, xp, xs, n, y); break;
    case PT_F16: rows_fmt(F_F16, W, r0, r1, xp, xs, n, y); break;
    case PT_FP8_E4M3: rows_fmt(F_FP8, W, r0, r1, xp, xs, n, y); break;
    case PT_Q8_ROW: rows_fmt(F_Q8R, W, r0, r1, xp, xs, n, y); break;
    case PT_Q8_G32: rows_fmt(F_Q8G, W, r0, r1, xp, xs, n, y); break;
    case PT_Q4_G64: rows_fmt(F_Q4, W, r0, r1, xp, xs, n, y); break;
    default: break;
    }
}

const kn_mm_isa kn_mm_avx2 = {"avx2", 16, kn_mm_layout_ok, mm_rows};
