/* kernels.h: the compute kernels the model code calls. Every kernel has a scalar reference
 * (kn_ref_*) that stays built and tested; kn_* dispatch to the fastest variant for this CPU
 * (chosen once from CPUID; kn_force_isa overrides it for tests and benchmarks).
 *
 * Row independence: row i of a result depends only on row i of the input, never on how many
 * rows share the call or how many threads run it, so batching cannot change outputs (bitwise,
 * for a fixed ISA level).
 *
 * Threads: kn_init creates one persistent pool (src/base/pool.h) used by kn_matmul; model code
 * may run its own parallel loops on kn_pool(). Kernels are safe to call from several threads at
 * once (matmul jobs on the shared pool then take turns). */
#ifndef PETREL_KERNELS_H
#define PETREL_KERNELS_H
#include <stdint.h>

#include "quant/qtypes.h"

struct pt_pool;

/* y[n][W->rows] = x[n][W->cols] * W^T  (f32 accumulation), any pt_qtype. x and y are dense
 * row-major, must not overlap, need no alignment. Parallel over output rows. */
void kn_matmul(const pt_wview *W, const float *x, int n, float *y);
void kn_ref_matmul(const pt_wview *W, const float *x, int n, float *y);

/* Kernel initialisation (CPUID, thread pool); idempotent; n_threads 0 = all cores. Calling it
 * again with a different count rebuilds the pool (not while kernels run). kn_matmul calls
 * kn_init(0) itself if nobody did. */
void kn_init(int n_threads);
int kn_threads(void);
struct pt_pool *kn_pool(void);
/* "scalar", "avx2" or "avx512". */
const char *kn_isa_name(void);
/* Forces an ISA level ("scalar", "avx2", "avx512"; "auto" = best available). Returns 0, or -1
 * if this CPU/OS lacks it (nothing changes). "amx" is not implemented yet and returns -1. Not
 * thread-safe against running kernels: for tests and benchmarks. */
int kn_force_isa(const char *name);

/* Vector helpers. n is the length; pointers need no alignment. */
float kn_dot(const float *a, const float *b, int64_t n);                 /* sum a[j] b[j] */
void kn_axpy(float *y, float a, const float *x, int64_t n);              /* y += a x */
/* out = x / sqrt(mean(x^2) + eps) * w  (w NULL: no weight). out may equal x. */
void kn_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* In place: x = exp(x - max) / sum. -inf entries give 0; a row of only -inf gives all zeros
 * (never NaN). */
void kn_softmax(float *x, int64_t n);
/* out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). out may equal gate or up. */
void kn_silu_mul(float *out, const float *gate, const float *up, int64_t n);
/* Indices of the k largest values of v[n], largest first; ties: lower index first. NaNs rank
 * below everything. k is clamped to [0, n]; returns the number written. O(n log k). */
int kn_topk(const float *v, int n, int k, int32_t *idx);

float kn_ref_dot(const float *a, const float *b, int64_t n);
void kn_ref_axpy(float *y, float a, const float *x, int64_t n);
void kn_ref_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
void kn_ref_softmax(float *x, int64_t n);
void kn_ref_silu_mul(float *out, const float *gate, const float *up, int64_t n);
#endif
