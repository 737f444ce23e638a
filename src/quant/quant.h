/* quant.h: quantizing f32 weights into petrel's storage formats, and their byte layouts.
 *
 * Layouts (row r of a [rows][cols] weight starts at data + r * pt_qtype_row_bytes(q, cols)):
 *   PT_F32, PT_BF16, PT_F16  plain little-endian values, 4/2/2 bytes each.
 *   PT_FP8_E4M3  one e4m3fn byte per value; 2-D block scales come from the checkpoint
 *                (passthrough: petrel never quantizes to FP8, see qtypes.h).
 *   PT_Q8_ROW    int8 per value, one scale per row:            w = q * s[r]
 *   PT_Q8_G32    int8 per value, one scale per 32 columns:     w = q * s[r][j / 32]
 *   PT_Q4_G64    int4 per value stored as nibble q + 8 (0..15), two per byte, the EVEN column in
 *                the LOW nibble; a row takes ceil(cols / 2) bytes (an odd row's last high nibble
 *                is 8, i.e. q = 0); one scale per 64 columns:  w = (nib - 8) * s[r][j / 64]
 * Scales are row-major [row][group] (the last group of a row may be partial), stored as f32,
 * bf16 or f16 (scale_dtype = PT_F32 / PT_BF16 / PT_F16).
 *
 * Quantization math (symmetric, per row or group g):
 *   int8: s = max|w_g| / 127, q = clamp(round_half_even(w / s), -128, 127)
 *   int4: s = max|w_g| / 7,   q = clamp(round_half_even(w / s), -8, 7)
 *   s is floored at 1e-8 (an all-zero group gets q = 0), then rounded to scale_dtype, and q is
 *   computed from the ROUNDED scale, so dequantization uses exactly the s the quantizer divided
 *   by (a bf16 scale may round down so |w/s| can exceed 7 or 127 slightly: the clamp handles it).
 *   Error bound per value: |w - q*s| <= s/2 (+ the clamp excess, at most the scale rounding,
 *   2^-9 relative for bf16 scales, times 7 or 127). */
#ifndef PETREL_QUANT_QUANT_H
#define PETREL_QUANT_QUANT_H
#include <stdint.h>

#include "quant/qtypes.h"

/* Bytes of one row of cols values (scales excluded). */
int64_t pt_qtype_row_bytes(pt_qtype q, int64_t cols);
/* Columns per scale group: cols for PT_Q8_ROW, 32 / 64 for grouped, 0 for unscaled formats. */
int64_t pt_qtype_group(pt_qtype q, int64_t cols);
/* Scales per row: 1 for PT_Q8_ROW, ceil(cols / group) for grouped, 0 for f32/bf16/f16/fp8. */
int64_t pt_qtype_scales_per_row(pt_qtype q, int64_t cols);
/* Bytes of one scale of dtype PT_F32 / PT_BF16 / PT_F16 (0 otherwise). */
int pt_scale_dtype_bytes(int scale_dtype);

/* Quantizes w[cols] into out (pt_qtype_row_bytes bytes) and scales (pt_qtype_scales_per_row
 * values of scale_dtype; may be NULL for unscaled formats). Returns 0, or -1 for PT_FP8_E4M3
 * (passthrough only) or a bad qtype / scale_dtype. */
int pt_quant_row(pt_qtype q, const float *w, int64_t cols, uint8_t *out, void *scales,
                 int scale_dtype);

/* q4x: PT_Q4_G64 bytes (same layout and dequantization as above) chosen by a search
 * (src/quant/q4x.c). Per group: all 16 levels (the scale may be negative), a grid of candidate
 * scales with least-squares refinement, each judged by sum_j u_j (w_j - s q_j)^2 with the stored
 * (rounded) scale; u_j = imp[j] + 0.02 * mean(imp over the group), or 1 without statistics. RTN
 * (pt_quant_row's choice) is one of the candidates, so no group's error exceeds RTN's.
 * With a calibration's second moments H = E[x x^T] of the matrix's input (ctx->H, ctx->U from
 * pt_q4x_prepare) the row is also quantized GPTQ-style (columns in order, each rounding error
 * spread over the later columns through the Cholesky factor of H^-1, group scales searched when
 * a group is reached), and of {RTN, the group search, GPTQ} the row keeps the one with the
 * smallest output error dw^T H dw. */
typedef struct pt_q4x_ctx {
    int64_t cols;
    const float *imp;  /* [cols] mean x_j^2 (the diagonal of H), or NULL: unweighted */
    const double *H;   /* [cols][cols] E[x x^T], or NULL: group search only */
    const double *U;   /* [cols][cols] upper Cholesky factor of (H + damping)^-1, with H */
} pt_q4x_ctx;
/* ctx may be NULL (unweighted search). Returns 0, or -1 for a bad scale_dtype or out of memory. */
int pt_quant_row_q4x(const float *w, int64_t cols, const pt_q4x_ctx *ctx, uint8_t *out, void *scales,
                     int scale_dtype);
/* Test hook: 1 runs q4x's group loops in their scalar reference form, 0 (default) in 4-lane
 * vector form; both give bitwise the same bytes. Not thread-safe against running quantizers. */
void pt_q4x_force_scalar(int on);
/* U [cols][cols] from H (damped by 1 % of its mean diagonal, more if H is singular). Returns 0,
 * or -1 if H is not usable (U then undefined). */
int pt_q4x_prepare(const double *H, int64_t cols, double *U);
/* The weighted error q4x minimizes for one group of n <= 64 values (imp as above, may be NULL)
 * with scale s and levels q; for tests. */
double pt_q4x_group_error(const float *w, const float *imp, int n, float s, const int8_t *q);

/* Fills a view for row-major data written by pt_quant_row (not for FP8: its block scales come
 * from the checkpoint and the caller fills those fields). */
pt_wview pt_wview_make(pt_qtype q, int64_t rows, int64_t cols, const void *data,
                       const void *scales, int scale_dtype);

/* Scalar e4m3fn encoder (round half even, saturating to +-448, NaN -> 0x7f); for tests and
 * tools. */
uint8_t pt_f32_to_fp8e4m3(float f);
#endif
