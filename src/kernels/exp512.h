/* exp512.h: exp over 16 lanes, the one polynomial kn_softmax (actq_avx512.c) and the attention
 * core (attn_avx512.c) share; kn_ref_exp (ref.c) is its scalar twin. Include only from files built
 * with the AVX-512 flags (the Makefile gives *_avx512.c their ISA). */
#ifndef PETREL_KERNELS_EXP512_H
#define PETREL_KERNELS_EXP512_H
#include <immintrin.h>

/* exp(x), ~1-2 ulp: 2^k * p(r), r = x - k ln2 in [-ln2/2, ln2/2], degree-7 Taylor (truncation
 * 3e-9). x is clamped to [-104, 89] (results 0 and inf, as expf); NaN stays NaN (vmaxps returns
 * its second operand when either is NaN). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
    x = _mm512_min_ps(_mm512_set1_ps(89.f), x);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}
#endif
