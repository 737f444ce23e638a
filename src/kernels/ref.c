/* ref.c: scalar reference kernels. Plain loops over dequantized rows: the oracle for every
 * SIMD variant. Accumulation order is fixed (j ascending) in f32 (no double), so the refs are
 * themselves batch-invariant; dispatch.c also uses them as the "scalar" ISA level. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/kn_internal.h"

void kn_ref_matmul_rows(const pt_wview *W, int64_t r0, int64_t r1, const float *x, int n,
                        float *y) {
    float stackbuf[4096];
    float *row = W->cols <= 4096 ? stackbuf : malloc((size_t)W->cols * sizeof(float));
    if (!row) { /* out of memory for a huge row: report NaN rather than stale memory */
        for (int i = 0; i < n; i++)
            for (int64_t r = r0; r < r1; r++) y[(int64_t)i * W->rows + r] = NAN;
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
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

void kn_ref_matmul(const pt_wview *W, const float *x, int n, float *y) {
    kn_ref_matmul_rows(W, 0, W->rows, x, n, y);
}

float kn_ref_dot(const float *a, const float *b, int64_t n) {
    float acc = 0.f;
    for (int64_t j = 0; j < n; j++) acc += a[j] * b[j];
    return acc;
}

void kn_ref_axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) y[j] += a * x[j];
}

void kn_ref_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    float ss = 0.f;
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    float inv = 1.0f / sqrtf(ss / (float)(n > 0 ? n : 1) + eps);
    for (int64_t j = 0; j < n; j++) out[j] = x[j] * inv * (w ? w[j] : 1.0f);
}

void kn_ref_softmax(float *x, int64_t n) {
    if (n <= 0) return;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    if (mx == -INFINITY) { /* nothing attendable: zeros, not NaN */
        memset(x, 0, (size_t)n * sizeof(float));
        return;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; j++) {
        x[j] = expf(x[j] - mx);
        sum += x[j];
    }
    float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; j++) x[j] *= inv;
}

void kn_ref_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        float g = gate[j];
        out[j] = g / (1.0f + expf(-g)) * up[j];
    }
}

/* Top-k: a min-heap of the k best seen so far, ordered by "worse": lower value, or equal value
 * and higher index. NaN counts as the worst value. O(n log k); result sorted best first. */
static int topk_worse(const float *v, int32_t a, int32_t b) { /* is a worse than b? */
    float x = v[a], y = v[b];
    if (isnan(x) || isnan(y)) {
        if (isnan(x) && isnan(y)) return a > b;
        return isnan(x);
    }
    if (x != y) return x < y;
    return a > b;
}

static void heap_down(const float *v, int32_t *h, int k, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && topk_worse(v, h[l], h[m])) m = l;
        if (r < k && topk_worse(v, h[r], h[m])) m = r;
        if (m == i) return;
        int32_t t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

int kn_topk(const float *v, int n, int k, int32_t *idx) {
    if (k > n) k = n;
    if (k <= 0) return 0;
    for (int i = 0; i < k; i++) idx[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--) heap_down(v, idx, k, i);
    for (int i = k; i < n; i++)
        if (topk_worse(v, idx[0], i)) { /* i beats the worst kept one */
            idx[0] = i;
            heap_down(v, idx, k, 0);
        }
    /* heap sort: repeatedly move the worst to the end -> best first */
    for (int m = k - 1; m > 0; m--) {
        int32_t t = idx[0]; idx[0] = idx[m]; idx[m] = t;
        heap_down(v, idx, m, 0);
    }
    return k;
}
