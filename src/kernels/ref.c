/* ref.c: scalar reference kernels. Plain loops over dequantized rows: the oracle for every
 * SIMD variant. Accumulation order is fixed (j ascending) in double-free f32. */
#include <stdlib.h>

#include "kernels/kernels.h"

void kn_ref_matmul(const pt_wview *W, const float *x, int n, float *y) {
    float stackbuf[4096];
    float *row = W->cols <= 4096 ? stackbuf : malloc((size_t)W->cols * sizeof(float));
    if (!row) return; /* cannot happen for sane shapes; caller sized the scratch */
    for (int64_t r = 0; r < W->rows; r++) {
        pt_dequant_row(W, r, row);
        for (int i = 0; i < n; i++) {
            const float *xi = x + (int64_t)i * W->cols;
            float acc = 0.f;
            for (int64_t j = 0; j < W->cols; j++) acc += row[j] * xi[j];
            y[(int64_t)i * W->rows + r] = acc;
        }
    }
    if (row != stackbuf) free(row);
}
