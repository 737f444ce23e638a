/* qtypes.h: the number formats weights are stored in, and the typed 2-D weight view every
 * kernel consumes. A view never owns its memory (it points into an mmap'd file or a slot).
 *
 * Conventions (all formats): a weight is [rows][cols] and y = W x; rows are stored one after
 * another, row r starting at data + r * row_bytes. Formats with scales:
 *   PT_FP8_E4M3  e4m3fn bytes; scale[(r / block_rows) * scale_cols + c / block_cols] is a
 *                MULTIPLIER (HF "weight_scale_inv"): w = fp8(q) * scale.
 *   other quantized formats are described in src/quant/quant.h. */
#ifndef PETREL_QUANT_QTYPES_H
#define PETREL_QUANT_QTYPES_H
#include <stdint.h>

typedef enum pt_qtype {
    PT_F32 = 0,
    PT_BF16 = 1,
    PT_F16 = 2,
    PT_FP8_E4M3 = 3, /* with block scales (f32) */
    PT_Q8_ROW = 4,   /* int8, one f32 scale per row */
    PT_Q8_G32 = 5,   /* int8, one scale per group of 32 columns */
    PT_Q4_G64 = 6,   /* int4 symmetric, one scale per group of 64 columns */
    PT_QTYPE_COUNT
} pt_qtype;

typedef struct pt_wview {
    pt_qtype qtype;
    int64_t rows, cols;
    const uint8_t *data;   /* view: row r at data + r * row_bytes */
    int64_t row_bytes;
    const void *scale;     /* view: format-specific scales, NULL for f32/bf16/f16 */
    int scale_dtype;       /* PT_F32 / PT_BF16 / PT_F16 for the scales */
    int block_rows, block_cols; /* FP8 block shape; group size for grouped formats (block_cols) */
    int64_t scale_cols;    /* scales per row-block (FP8) or per row (grouped) */
    int layout;            /* PT_LAYOUT_PLAIN, or PT_LAYOUT_R16 (below) */
} pt_wview;

/* Layouts. PT_LAYOUT_PLAIN: row r at data + r * row_bytes, as described above.
 * PT_LAYOUT_R16 (PT_Q8_G32 and PT_Q4_G64 only; rows % 16 == 0, cols % group == 0, made in
 * place by kn_r16_repack for the int8-activation kernels): 16 rows interleaved so that one
 * 64-byte load holds 4 bytes of each of 16 rows. Block b (rows 16b..16b+15) fills bytes
 * [16 b row_bytes, 16 (b+1) row_bytes); in it, group g (32 or 64 columns) is 512 bytes at g * 512,
 * made of 8 chunks of 64 bytes; in chunk k, bytes [4 i, 4 i + 4) belong to row 16b + i:
 *   q8_g32: byte t = w[32 g + 4 k + t] + 128 (unsigned),
 *   q4_g64: byte t = (w[c + t] + 8) | (w[c + 4 + t] + 8) << 4, c = 64 g + 8 k.
 * Scales keep their dtype and count; scale (b * scale_cols + g) * 16 + i is row 16b+i's scale for
 * group g. pt_dequant_row and the reference kernels read both layouts. */
#define PT_LAYOUT_PLAIN 0
#define PT_LAYOUT_R16 1

const char *pt_qtype_name(pt_qtype t);
/* Bytes a view's payload and scales occupy (what a product over it reads). */
uint64_t pt_wview_bytes(const pt_wview *W);

/* Scalar conversions, exact. */
static inline float pt_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}
static inline uint16_t pt_f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t r = v.u + 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(r >> 16);
}
float pt_f16_to_f32(uint16_t h);
uint16_t pt_f32_to_f16(float f);
float pt_fp8e4m3_to_f32(uint8_t b);

/* Dequantizes row r of W into out[cols] (f32). The reference for every kernel. */
void pt_dequant_row(const pt_wview *W, int64_t r, float *out);
#endif
