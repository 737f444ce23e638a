/* ops.h: the small per-row operations of the forward pass that the kernel table does not
 * cover (norms with double statistics, RoPE, selection top-k); dot/axpy/softmax/SwiGLU are
 * kn_* kernels. Plain f32 loops with fixed accumulation order: cheap next to the matrix products, and
 * row-independent by construction. */
#ifndef PETREL_MODEL_OPS_H
#define PETREL_MODEL_OPS_H
#include <stdint.h>

/* y = w * (x / sqrt(mean(x^2) + eps)); y may alias x. */
void op_rmsnorm(float *y, const float *x, const float *w, int n, double eps);
/* y = (x - mean) / sqrt(var + eps) * w + b; y may alias x. */
void op_layernorm(float *y, const float *x, const float *w, const float *b, int n, double eps);
/* Rotates x[0..dim) in place by angles pos * inv_freq[i], from precomputed cos/sin [dim/2].
 * interleave: pairs (2i, 2i+1); otherwise half-split pairs (i, i + dim/2). */
void op_rope(float *x, const float *cos_, const float *sin_, int dim, int interleave);
/* cos/sin tables [dim/2] for one position, angle computed in double. */
void op_rope_table(double theta, int dim, int64_t pos, float *cos_, float *sin_);
/* Indices of the k largest v[0..n) (ties: the higher index, i.e. the later
 * position, wins; NaN ranks lowest), written to idx[0..k) in ascending
 * index order. tmp needs n entries. k <= n. */
void op_topk(const float *v, int n, int k, int32_t *idx, int32_t *tmp);
#endif
