/* kernels.h: the compute kernels the model code calls. Every kernel has a scalar reference
 * (kn_ref_*) that stays built and tested; kn_* dispatch to the fastest variant for this CPU.
 *
 * Row independence: row i of a result depends only on row i of the input, never on how many
 * rows share the call, so batching cannot change outputs. */
#ifndef PETREL_KERNELS_H
#define PETREL_KERNELS_H
#include <stdint.h>

#include "quant/qtypes.h"

/* y[n][W->rows] = x[n][W->cols] * W^T  (f32 accumulation). */
void kn_matmul(const pt_wview *W, const float *x, int n, float *y);
void kn_ref_matmul(const pt_wview *W, const float *x, int n, float *y);

/* Kernel initialisation (CPUID, thread pool); idempotent; n_threads 0 = all cores. */
void kn_init(int n_threads);
const char *kn_isa_name(void);
#endif
