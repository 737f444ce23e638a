/* calib.h: activation statistics for importance-weighted quantization (`petrel convert --calib`).
 *
 * calib_run opens a Hugging Face checkpoint (bf16/FP8/f32: the model before quantization), runs
 * it over a calibration text in windows of ctx tokens (each window a fresh timeline, one batched
 * forward with every row's logits) and, through the kernels' observer (kn_set_observer), adds up
 * for every matrix the engine multiplies the mean of x_j^2 per input column j over the rows that
 * reached it (and, up to CALIB_FULL_COLS columns, the whole second-moment matrix E[x x^T], for
 * q4x's GPTQ pass): routed experts per expert (only the rows routed to it), kv_b_proj from its W_UK /
 * W_UV row views (the reconstructed MLA form is forced, so the latent is its input), lm_head from
 * the final-normed rows. Matrices never multiplied (the token embedding, a lookup; the MTP layer,
 * which a forward pass does not run) get no statistics: q4x quantizes them unweighted. Names are
 * the Hugging Face tensor names, as convert lists them. */
#ifndef PETREL_IO_CALIB_H
#define PETREL_IO_CALIB_H
#include <stdint.h>

#include "petrel.h"

typedef struct calib_stats calib_stats;

typedef struct calib_opts {
    int ctx;         /* tokens per window; 0 = 512 (clamped to the model's context) */
    int max_tokens;  /* 0 = the whole text */
    int n_threads;   /* 0 = all cores */
} calib_opts;

typedef struct calib_info {
    int64_t tokens;  /* tokens run */
    int windows;
    int matrices;    /* matrices the engine binds (excluding the router, kept f32 anyway) */
    int observed;    /* of those, matrices with statistics */
} calib_info;

/* Runs the calibration. A missing, empty, non-UTF-8 or too short (< 2 tokens) text, or a model
 * that is not a Hugging Face folder (pack, colibri artifact), is one error line. */
int calib_run(const char *model_dir, const char *text_path, const calib_opts *o, calib_stats **out,
              calib_info *info, petrel_error *err);
void calib_free(calib_stats *s);
/* Mean x_j^2 per input column [cols] of matrix `name` (view into s), or NULL when the matrix
 * got no rows or has other columns. */
const float *calib_importance(const calib_stats *s, const char *name, int64_t cols);
/* Everything q4x uses for matrix `name` (diagonal, and for matrices of up to CALIB_FULL_COLS
 * columns the second moments H and the factor of H^-1), or NULL without statistics. */
#define CALIB_FULL_COLS 1024
struct pt_q4x_ctx;
const struct pt_q4x_ctx *calib_q4x(const calib_stats *s, const char *name, int64_t cols);
/* Rows (activation vectors) that reached `name` (0 if none / unknown). */
int64_t calib_rows(const calib_stats *s, const char *name);
#endif
