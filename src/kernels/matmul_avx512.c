/* matmul_avx512.c: y = x W^T for every weight format with AVX-512 (16 f32 lanes), f32
 * activations and f32 accumulation. Built with -mavx512* (Makefile, by file name); only called
 * after dispatch.c saw the CPU support it.
 *
 * Shape of the work: a tile is R weight rows (4 or 1) times B activation rows (1..4). Each step
 * of the column loop converts a few 16-wide weight vectors once and feeds them to all B
 * activations, so a weight row is read from memory once per block of 4 activations (decode, n=1,
 * is pure streaming: 4 rows in flight, each with a software prefetch one tile ahead). Rows are
 * processed in L2-sized chunks so prefill re-reads a chunk from cache, not from memory, for every
 * block of activations. Accumulator and weight arrays have fixed sizes ([4][4]), never [R][B]:
 * a variable-length array is kept on the stack, which made the kernel 2-3x slower.
 *
 * Determinism: every (row, activation) dot uses ONE 16-lane accumulator, steps in ascending
 * column order, the weight vector values w = q * s computed exactly as pt_dequant_row does
 * (single rounding), a final tail step from a zero-padded scalar buffer, then
 * _mm512_reduce_add_ps. None of this depends on R, B, n or the thread, so y rows are bitwise
 * batch- and thread-invariant.
 *
 * Per-format conversion (exact unless noted):
 *   bf16  zero-extend to 32 bits, shift left 16.
 *   f16   vcvtph2ps.
 *   fp8   (32 per step) e4m3fn bits re-placed as an f16 of value fp8 * 2^-8 (sign-extend byte to 16 bits, shift
 *         left 7, keep sign + 7 low bits; e4m3 subnormals land on f16 subnormals), vcvtph2ps, then
 *         times k = block_scale * 2^8: one rounding of the same exact product as the reference.
 *         The e4m3fn NaN pattern (0x7f/0xff) decodes as +-480 * scale here (checkpoints have none).
 *   q8    sign-extend to 32 bits, convert, times the group scale (q8_row: the row scale is
 *         applied once to the finished dot instead).
 *   q4    a byte widened to 32 bits gives the even column (& 15) and the odd column (>> 4); the
 *         nibble indexes a 16-entry table s * (nib - 8) with vpermps, which converts, recentres
 *         and scales in one instruction. */
#include <immintrin.h>
#include <string.h>

#include "kernels/kn_internal.h"

#define AI static inline __attribute__((always_inline))

enum { F_F32, F_BF16, F_F16, F_FP8, F_Q8R, F_Q8G, F_Q4 };

/* Columns per step and 16-wide vectors per step. */
#define STEP(F) ((F) == F_Q4 ? 64 : ((F) == F_Q8G || (F) == F_FP8) ? 32 : 16)
#define NVEC(F) (STEP(F) / 16)

/* Per-row state: data pointer; the row's scales are decoded to f32 into a separate array sc (one
 * per group for q8_g32 / q4_g64, one per column block for fp8, already times 2^8). */
typedef struct {
    const uint8_t *p;
    float rs;          /* q8_row scale */
    int sh;            /* fp8: step s uses sc[s >> sh] (block_cols = 32 << sh) */
} rowst;

/* Weight vector u of step s of a row. */
AI __m512 wvec(const int F, const rowst *st, const float *sc, int64_t s, int u) {
    switch (F) {
    case F_F32: return _mm512_loadu_ps((const float *)st->p + s * 16);
    case F_BF16: {
        __m256i h = _mm256_loadu_si256((const __m256i *)(st->p + s * 32));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case F_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st->p + s * 32)));
    case F_FP8: { /* 32 bytes at once (one widening, shift, and); u picks the half */
        __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(st->p + s * 32)));
        b = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16((short)0xBF80));
        __m256i h = u ? _mm512_extracti64x4_epi64(b, 1) : _mm512_castsi512_si256(b);
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(sc[s >> st->sh]));
    }
    case F_Q8R:
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(st->p + s * 16))));
    case F_Q8G: {
        __m512 q = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(st->p + s * 32 + u * 16))));
        return _mm512_mul_ps(q, _mm512_set1_ps(sc[s]));
    }
    default: { /* F_Q4: u = 0,1 -> bytes 0..15 lo/hi; u = 2,3 -> bytes 16..31 lo/hi */
        const __m512 tbl = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        __m512 t = _mm512_mul_ps(tbl, _mm512_set1_ps(sc[s]));
        __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(st->p + s * 32 + (u >> 1) * 16)));
        __m512i idx = (u & 1) ? _mm512_srli_epi32(v, 4) : v; /* vpermps uses the low 4 bits */
        return _mm512_permutexvar_ps(idx, t);
    }
    }
}

/* Scalar weight of column j (< cols) of a row, bit-identical to the vector path. */
static float wscalar(int F, const rowst *st, const float *sc, int64_t j) {
    switch (F) {
    case F_F32: return ((const float *)st->p)[j];
    case F_BF16: return pt_bf16_to_f32(((const uint16_t *)st->p)[j]);
    case F_F16: return pt_f16_to_f32(((const uint16_t *)st->p)[j]);
    case F_FP8: return pt_fp8e4m3_to_f32(st->p[j]) * (sc[(j / 32) >> st->sh] * (1.0f / 256.f));
    case F_Q8R: return (float)(int8_t)st->p[j];
    case F_Q8G: return (float)(int8_t)st->p[j] * sc[j / 32];
    default: return (float)(((st->p[j >> 1] >> ((j & 1) * 4)) & 15) - 8) * sc[j / 64];
    }
}

/* The zero-padded last partial step of a row, in the same lane layout as wvec. */
static void wtail(int F, const rowst *st, const float *sc, int64_t cols, float *out) {
    int64_t j0 = cols / STEP(F) * STEP(F);
    memset(out, 0, 64 * sizeof(float));
    for (int64_t j = j0; j < cols; j++) {
        int64_t k = j - j0, lane = k;
        if (F == F_Q4) lane = (k & ~31) + ((k & 31) >> 1) + ((k & 1) ? 16 : 0);
        out[lane] = wscalar(F, st, sc, j);
    }
}

/* n scales of dtype from src (element index base) to f32 dst, times mul (exact: 1 or 2^8). */
static void decode_scales(int dtype, const void *src, int64_t base, int64_t n, float mul,
                          float *dst) {
    int64_t i = 0;
    __m512 m = _mm512_set1_ps(mul);
    if (dtype == PT_BF16) {
        const uint16_t *p = (const uint16_t *)src + base;
        for (; i + 16 <= n; i += 16) {
            __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + i)));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), m));
        }
        for (; i < n; i++) dst[i] = pt_bf16_to_f32(p[i]) * mul;
    } else if (dtype == PT_F16) {
        const uint16_t *p = (const uint16_t *)src + base;
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i))), m));
        for (; i < n; i++) dst[i] = pt_f16_to_f32(p[i]) * mul;
    } else {
        const float *p = (const float *)src + base;
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(p + i), m));
        for (; i < n; i++) dst[i] = p[i] * mul;
    }
}

/* Sets up row r: data pointer and decoded scales (see rowst). */
static void row_scales(int F, const pt_wview *W, int64_t r, rowst *st, float *sc) {
    st->p = W->data + r * W->row_bytes;
    st->rs = 1.f;
    st->sh = 0;
    if (F == F_Q8R) st->rs = kn_scale_at(W, r);
    else if (F == F_Q8G || F == F_Q4) {
        int64_t g = F == F_Q8G ? 32 : 64;
        decode_scales(W->scale_dtype, W->scale, r * W->scale_cols, (W->cols + g - 1) / g, 1.f, sc);
    } else if (F == F_FP8) {
        while ((32 << st->sh) < W->block_cols) st->sh++;
        decode_scales(W->scale_dtype, W->scale, (r / W->block_rows) * W->scale_cols,
                      (W->cols + W->block_cols - 1) / W->block_cols, 256.f, sc);
    }
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
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) acc[a][b] = _mm512_setzero_ps();
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
            __m512 w[4];                                                             \
            _Pragma("GCC unroll 4") for (int a = 0; a < R; a++)                    \
                w[a] = wvec(F, &st[a], sc[a], s, (u));                             \
            _Pragma("GCC unroll 4") for (int b = 0; b < B; b++) {                  \
                __m512 xv = _mm512_load_ps(xb + b * xs + s * STEP(F) + (u) * 16);      \
                _Pragma("GCC unroll 4") for (int a = 0; a < R; a++)                \
                    acc[a][b] = _mm512_fmadd_ps(w[a], xv, acc[a][b]);                   \
            }                                                                      \
        }
        STEP_U(0) STEP_U(1) STEP_U(2) STEP_U(3)
#undef STEP_U
    }
    if (cols % STEP(F)) {
        float wt[4][64] __attribute__((aligned(64)));
        for (int a = 0; a < R; a++) wtail(F, &st[a], sc[a], cols, wt[a]);
        for (int u = 0; u < NVEC(F); u++)
            for (int b = 0; b < B; b++) {
                __m512 xv = _mm512_load_ps(xb + b * xs + nstep * STEP(F) + u * 16);
                for (int a = 0; a < R; a++)
                    acc[a][b] = _mm512_fmadd_ps(_mm512_load_ps(wt[a] + u * 16), xv, acc[a][b]);
            }
    }
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < B; b++) {
            float v = _mm512_reduce_add_ps(acc[a][b]);
            if (F == F_Q8R) v *= st[a].rs;
            y[(int64_t)(i0 + b) * W->rows + r + a] = v;
        }
}

#define TILE_CASES(F, R)                                                        \
    switch (B) {                                                                \
    case 4: tile(F, R, 4, W, r, xp, xs, i0, y); break;                          \
    case 3: tile(F, R, 3, W, r, xp, xs, i0, y); break;                          \
    case 2: tile(F, R, 2, W, r, xp, xs, i0, y); break;                          \
    default: tile(F, R, 1, W, r, xp, xs, i0, y); break;                         \
    }

AI void rows_fmt(const int F, const pt_wview *W, int64_t r0, int64_t r1, const float *xp,
                 int64_t xs, int n, float *y) {
    /* L2 chunk: about 256 KB of weights, a multiple of 4 rows */
    int64_t rc = (256 << 10) / (W->row_bytes > 0 ? W->row_bytes : 1);
    rc = rc < 4 ? 4 : rc & ~(int64_t)3;
    for (int64_t c0 = r0; c0 < r1; c0 += rc) {
        int64_t c1 = c0 + rc < r1 ? c0 + rc : r1;
        for (int i0 = 0; i0 < n; i0 += 4) {
            int B = n - i0 < 4 ? n - i0 : 4;
            int64_t r = c0;
            for (; r + 4 <= c1; r += 4) TILE_CASES(F, 4)
            for (; r < c1; r++) TILE_CASES(F, 1)
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

const kn_mm_isa kn_mm_avx512 = {"avx512", 32, kn_mm_layout_ok, mm_rows};
