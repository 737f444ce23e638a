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

#include "kernels/kernels.h"
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

/* ---- int8-activation path (AVX-512 VNNI; actq_avx512.c) ----
 * Formats: PT_Q4_G64 (activation groups of 64 columns, one step = 128 columns = 64 weight bytes)
 * and PT_Q8_G32 / PT_Q8_ROW (groups of 32 columns, one step = 64 columns = 64 weight bytes).
 * Each x row is quantized per group: d = amax / 127, q = clamp(rint(x * (127 / amax)), +-127)
 * (amax = 0: d = 0, q = 0). The prepared row is a sequence of step records:
 *   q8: [q: 64 x i8][bias: 16 x i32][dexp: 16 x f32]                  (192 bytes)
 *   q4: [q even cols: 64 x i8][q odd cols: 64 x i8][bias][dexp]        (256 bytes)
 * Lanes 0-7 of a step belong to its first group, lanes 8-15 to its second (vpdpbusd sums 4
 * consecutive bytes into one int32 lane). Weights enter vpdpbusd as unsigned bytes u = w + off
 * (q4: the stored nibble, off 8; q8: w ^ 0x80, off 128); bias lane 0 / 8 holds -off * sum(q) of
 * the group, so the integer lane sums add up to exactly sum((u - off) q) per group. dexp repeats
 * each group's d over its 8 lanes. Padding past cols: q = 0, bias 0, d = 0. */
#define KN_ACTQ_NONE 0
#define KN_ACTQ_Q8 1
#define KN_ACTQ_Q4 2
static inline int kn_actq_kind(const pt_wview *W) {
    switch (W->qtype) {
    case PT_Q8_ROW: return W->scale ? KN_ACTQ_Q8 : 0;
    case PT_Q8_G32: return W->scale && (W->cols + 31) / 32 <= KN_MAX_SCALES ? KN_ACTQ_Q8 : 0;
    case PT_Q4_G64: return W->scale && (W->cols + 63) / 64 <= KN_MAX_SCALES ? KN_ACTQ_Q4 : 0;
    default: return 0;
    }
}
static inline int64_t kn_actq_step_cols(int kind) { return kind == KN_ACTQ_Q4 ? 128 : 64; }
static inline int64_t kn_actq_rec_bytes(int kind) { return kind == KN_ACTQ_Q4 ? 256 : 192; }
static inline int64_t kn_actq_nsteps(int kind, int64_t cols) {
    return (cols + kn_actq_step_cols(kind) - 1) / kn_actq_step_cols(kind);
}
/* Step records, then d of every group (2 per step, f32), padded to 64 bytes. */
static inline int64_t kn_actq_row_bytes(int kind, int64_t cols) {
    int64_t ns = kn_actq_nsteps(kind, cols);
    return ns * kn_actq_rec_bytes(kind) + (ns * 8 + 63) / 64 * 64;
}
/* Quantizes one x row per group of g columns (ref.c): q[cols] natural order, d[ceil(cols/g)]. */
void kn_actq_quant_row(const float *x, int64_t cols, int g, int8_t *q, float *d);
/* Fills prepared rows (stride kn_actq_row_bytes) for n rows of x (ref.c, plain C). */
void kn_actq_prep(int kind, const float *x, int n, int64_t cols, uint8_t *xq);
/* The same, AVX-512 (bit-identical for finite x; rows need 64-byte aligned xq). */
void kn_actq_prep_avx512(int kind, const float *x, int n, int64_t cols, uint8_t *xq);
/* Rows [r0, r1) of y from prepared activations (AVX-512 VNNI). */
void kn_actq_rows_avx512(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq,
                         int64_t xs, int n, float *y);

/* ---- row-interleaved layout (r16.c, r16_avx512.c) ----
 * Prepared activations: per x row, stride kn_r16_xs(W) bytes: q (cols int8, padded to 64),
 * d (one f32 per group), bias (one int32 per group: -offset * sum of the group's q). */
int64_t kn_r16_xs(const pt_wview *W);
void kn_r16_prep(const pt_wview *W, const float *x, int n, uint8_t *xq);
void kn_r16_prep_avx512(const pt_wview *W, const float *x, int n, uint8_t *xq); /* bit-identical */
/* Rows [r0, r1) (multiples of 16) of y; the reference and its AVX-512 VNNI twin (bitwise equal). */
void kn_r16_rows_ref(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y);
/* pf: software prefetch distance in bytes ahead of the weight stream (0: none), pf_l2: into L2
 * rather than L1, pf_all: every 64-byte line rather than every other (kn_table's choices, from
 * the open options); results do not depend on them. */
void kn_r16_rows_avx512(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y, int pf, int pf_l2, int pf_all);

/* ---- AMX (r16_amx.c; *_emu: the same code with the tile instructions emulated, for tests) ----
 * kn_r16_rows_amx: kn_r16_rows_avx512's result bitwise, on AMX-INT8 tiles; xq must hold
 * round_up(n, 16) prepared rows (pad rows: any finite content, zeros from dispatch.c).
 * kn_amx_bf16_*: bf16 weights (PT_BF16, plain) against bf16-rounded activations, not exact; xb
 * rows of xbs bytes (>= 2 * round_up(cols, 32)), round_up(n, 16) rows. */
void kn_r16_rows_amx(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y);
void kn_r16_rows_amx_emu(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y);
void kn_amx_bf16_prep(const float *x, int n, int64_t cols, uint16_t *xb, int64_t xbs);
void kn_amx_bf16_prep_emu(const float *x, int n, int64_t cols, uint16_t *xb, int64_t xbs);
void kn_amx_bf16_rows(const pt_wview *W, int64_t r0, int64_t r1, const uint16_t *xb, int64_t xbs, int n, float *y);
void kn_amx_bf16_rows_emu(const pt_wview *W, int64_t r0, int64_t r1, const uint16_t *xb, int64_t xbs, int n, float *y);
static inline int64_t kn_amx_bf16_xbs(int64_t cols) { return (cols + 31) / 32 * 64; }
/* The AMX int8 peak probe (kernels_bench): iters x 4 TDPBSSD on register tiles; returns the
 * multiply-adds done. Only on a CPU (and process) with AMX enabled. */
int64_t kn_amx_peak_run(int64_t iters);

/* ---- transposed product (matmul_t) and helpers, per ISA ---- */
/* y[i][c] for c in [c0, c1), every i < n: y[i][c] = sum_r x[i][r] W[r][c], r ascending. */
void kn_ref_matmul_t_cols(const pt_wview *W, int64_t c0, int64_t c1, const float *x, int n,
                          float *y);
void kn_matmul_t_cols_avx512(const pt_wview *W, int64_t c0, int64_t c1, const float *x, int n,
                             float *y);
float kn_dot_avx512(const float *a, const float *b, int64_t n);
void kn_axpy_avx512(float *y, float a, const float *x, int64_t n);
void kn_rmsnorm_avx512(float *out, const float *x, const float *w, int64_t n, float eps);
void kn_softmax_avx512(float *x, int64_t n);
void kn_silu_mul_avx512(float *out, const float *gate, const float *up, int64_t n);
int64_t kn_argmax_avx512(const float *x, int64_t n);

/* ---- attention core (kernels.h: kn_attn) ----
 * Queries go in blocks of KN_ATTN_MB (two 16-lane vectors, a query per lane). Scratch per block:
 * q^T [(D + Dr)][KN_ATTN_MB] (zero past M), scores / probabilities [N][KN_ATTN_MB], nk [KN_ATTN_MB]. */
#define KN_ATTN_MB 32
float kn_ref_exp(float x);
void kn_attn_core_many_avx512(const kn_attn *a, int n, float *const *scr);
void kn_dsa_scores_avx512(const kn_dsa *a);

/* Scale i of W as f32 (dtype from the view). */
static inline float kn_scale_at(const pt_wview *W, int64_t i) {
    switch (W->scale_dtype) {
    case PT_BF16: return pt_bf16_to_f32(((const uint16_t *)W->scale)[i]);
    case PT_F16: return pt_f16_to_f32(((const uint16_t *)W->scale)[i]);
    default: return ((const float *)W->scale)[i];
    }
}
#endif
