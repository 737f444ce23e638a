/* r16_scales.h: the 16 per-row scales of an R16 (block, group) as f32, shared by the AVX-512 and
 * AMX R16 kernels (each includes it under its own ISA flags; AVX-512 intrinsics). */
#ifndef PETREL_KERNELS_R16_SCALES_H
#define PETREL_KERNELS_R16_SCALES_H
#include <immintrin.h>
#include <stdint.h>

#include "quant/qtypes.h"

static inline __attribute__((always_inline)) __m512 r16_scales16(const pt_wview *W, int64_t idx) {
    if (W->scale_dtype == PT_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)W->scale + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (W->scale_dtype == PT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)W->scale + idx)));
    return _mm512_loadu_ps((const float *)W->scale + idx);
}
#endif
