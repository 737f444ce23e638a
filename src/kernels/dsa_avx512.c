/* dsa_avx512.c: the DSA lightning-indexer scores (kernels.h: kn_dsa) with AVX-512, bitwise equal
 * to kn_ref_dsa_scores (ref.c). Built with -mavx512* (Makefile, by file name); dispatch.c calls it
 * only where the CPU has AVX-512, for Hp <= 64.
 *
 * Shape of the work: the heads go in lanes (V = Hp / 16 vectors), keys in tiles of KB; per head
 * dimension d one load of each q^T vector and one broadcast of each key's d-th value feed V x KB
 * fmas (24 accumulators), so every dd[h] is one chain over d ascending, as the reference. Then
 * per key: the masked product with w, the vectors added in order, and the fixed tree of kernels.h
 * down to one score. */
#include <immintrin.h>

#include "kernels/kn_internal.h"

#define AI static inline __attribute__((always_inline))

/* The fold of kernels.h: a[i] = u[i] + u[i+8], b[i] = a[i] + a[i+4], c[i] = b[i] + b[i+2], c0 + c1. */
AI float fold16(__m512 u) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

AI void tile(const int V, const int KB, const kn_dsa *a, int64_t t0) {
    __m512 acc[12][4];
    const float *kr[12];
#pragma GCC unroll 12
    for (int j = 0; j < KB; j++) {
        kr[j] = a->k + (t0 + j) * a->k_stride;
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[j][v] = _mm512_setzero_ps();
    }
    for (int d = 0; d < a->Di; d++) {
        __m512 q[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) q[v] = _mm512_loadu_ps(a->qt + (size_t)d * a->Hp + 16 * v);
#pragma GCC unroll 12
        for (int j = 0; j < KB; j++) {
            __m512 kb = _mm512_set1_ps(kr[j][d]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[j][v] = _mm512_fmadd_ps(q[v], kb, acc[j][v]);
        }
    }
    const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int j = 0; j < KB; j++) {
        __m512 u = zero;
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) {
            __mmask16 pos = _mm512_cmp_ps_mask(acc[j][v], zero, _CMP_GT_OQ);
            __m512 m = _mm512_maskz_mul_ps(pos, _mm512_loadu_ps(a->w + 16 * v), acc[j][v]);
            u = v == 0 ? m : _mm512_add_ps(u, m);
        }
        a->score[t0 + j] = fold16(u);
    }
}

AI void run(const int V, const int KB, const kn_dsa *a) {
    int64_t t = 0;
    for (; t + KB <= a->n; t += KB) tile(V, KB, a, t);
    for (; t + 4 <= a->n; t += 4) tile(V, 4, a, t);
    for (; t < a->n; t++) tile(V, 1, a, t);
}

void kn_dsa_scores_avx512(const kn_dsa *a) {
    switch (a->Hp / 16) {
    case 1: run(1, 12, a); break;
    case 2: run(2, 12, a); break;
    case 3: run(3, 8, a); break;
    default: run(4, 6, a); break;
    }
}
