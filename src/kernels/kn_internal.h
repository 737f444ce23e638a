/* kn_internal.h: the contract between dispatch.c and the per-ISA matmul files.
 *
 * dispatch.c prepares activations once per call ("xp"): each row of x is copied into a 64-byte
 * aligned buffer whose stride xs is cols rounded up to KN_XPAD, zero-filled past cols, so kernels
 * never need masked or tail loads of x. For PT_Q4_G64 every chunk of q4_chunk columns is stored
 * de-interleaved, [even columns, odd columns], because one byte holds an even column (low nibble)
 * and the next odd column (high nibble): the kernel then widens bytes and splits nibbles without
 * any shuffles.
 *
 * A kernel computes y[i][r] for r in [r0, r1) and every i < n. Per (r, i) it must use one fixed
 * accumulation order that depends only on W and cols, never on n, r0/r1 or the thread: that is
 * what makes rows of y bitwise independent of batching and threading. */
#ifndef PETREL_KERNELS_INTERNAL_H
#define PETREL_KERNELS_INTERNAL_H
#include <stdint.h>

#include "quant/qtypes.h"

#define KN_XPAD 64       /* x rows padded to a multiple of this many columns (one q4 group) */
#define KN_MAX_SCALES 2048 /* per-row scale count the SIMD kernels buffer on the stack */

typedef struct kn_mm_isa {
    const char *name;
    int q4_chunk; /* de-interleave chunk for PT_Q4_G64 activations (columns) */
    int (*supports)(const pt_wview *W);
    void (*rows)(const pt_wview *W, int64_t r0, int64_t r1, const float *xp, int64_t xs, int n,
                 float *y);
} kn_mm_isa;

extern const kn_mm_isa kn_mm_avx2, kn_mm_avx512;

/* Rows [r0, r1) of the reference matmul (plain x, stride cols). */
void kn_ref_matmul_rows(const pt_wview *W, int64_t r0, int64_t r1, const float *x, int n, float *y);

/* Shared by the SIMD files: can their generic layout handle W? (format known, row scale count
 * bounded, FP8 block width a multiple of 16). */
static inline int kn_mm_layout_ok(const pt_wview *W) {
    switch (W->qtype) {
    case PT_F32: case PT_BF16: case PT_F16: return 1;
    case PT_FP8_E4M3:
        /* block width a power of two >= 32: a step's block is s >> log2(block_cols / step) */
        return W->scale && W->block_rows > 0 && W->block_cols >= 32 &&
               (W->block_cols & (W->block_cols - 1)) == 0 &&
               (W->cols + W->block_cols - 1) / W->block_cols <= KN_MAX_SCALES;
    case PT_Q8_ROW: return W->scale != 0;
    case PT_Q8_G32: return W->scale && (W->cols + 31) / 32 <= KN_MAX_SCALES;
    case PT_Q4_G64: return W->scale && (W->cols + 63) / 64 <= KN_MAX_SCALES;
    default: return 0;
    }
}

/* Scale i of W as f32 (dtype from the view). */
static inline float kn_scale_at(const pt_wview *W, int64_t i) {
    switch (W->scale_dtype) {
    case PT_BF16: return pt_bf16_to_f32(((const uint16_t *)W->scale)[i]);
    case PT_F16: return pt_f16_to_f32(((const uint16_t *)W->scale)[i]);
    default: return ((const float *)W->scale)[i];
    }
}
#endif
