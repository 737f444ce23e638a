/* dispatch.c: picks kernel variants at start from CPUID. Until SIMD variants land, the scalar
 * reference serves every call. */
#include "kernels/kernels.h"

void kn_init(int n_threads) { (void)n_threads; }
const char *kn_isa_name(void) { return "scalar"; }
void kn_matmul(const pt_wview *W, const float *x, int n, float *y) { kn_ref_matmul(W, x, n, y); }
