/* ops.c: per-row operations of the forward pass; see ops.h. Reductions accumulate in double
 * where it is free (norm statistics), so results do not depend on vector width. */
#include "model/ops.h"

#include <math.h>
#include <stdlib.h>

void op_rmsnorm(float *y, const float *x, const float *w, int n, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

void op_layernorm(float *y, const float *x, const float *w, const float *b, int n, double eps) {
    double m = 0, v = 0;
    for (int i = 0; i < n; i++) m += x[i];
    m /= n;
    for (int i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
    v /= n;
    float r = (float)(1.0 / sqrt(v + eps)), mf = (float)m;
    for (int i = 0; i < n; i++) y[i] = (x[i] - mf) * r * w[i] + b[i];
}

void op_rope_table(double theta, int dim, int64_t pos, float *cos_, float *sin_) {
    for (int i = 0; i < dim / 2; i++) {
        double inv = pow(theta, -2.0 * i / dim);
        double a = (double)pos * inv;
        cos_[i] = (float)cos(a);
        sin_[i] = (float)sin(a);
    }
}

void op_rope(float *x, const float *cos_, const float *sin_, int dim, int interleave) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) {
        int a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + half;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * cos_[i] - x1 * sin_[i];
        x[b] = x0 * sin_[i] + x1 * cos_[i];
    }
}

/* "a ranks above b": larger value, then the later position (the DSA reference's tie rule:
 * a trained indexer's ReLU'd scores are often exactly equal, mostly 0, and the cut falls inside
 * the tie). NaN ranks lowest; -0 and +0 are equal. A total order on indices, so the selection
 * is a pure function of the scores, whatever order quickselect visits them in. */
static int above(const float *v, int32_t a, int32_t b) {
    float x = v[a], y = v[b];
    if (x != x) return y != y && a > b;
    if (y != y) return 1;
    return x > y || (x == y && a > b);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void op_topk(const float *v, int n, int k, int32_t *idx, int32_t *tmp) {
    for (int i = 0; i < n; i++) tmp[i] = i;
    /* Quickselect so that tmp[0..k) are the k top-ranked indices. Deterministic pivot. */
    int lo = 0, hi = n - 1;
    while (k > 0 && k < n && lo < hi) {
        int mid = lo + (hi - lo) / 2;
        /* median of three by rank */
        int32_t a = tmp[lo], b = tmp[mid], c = tmp[hi], p;
        if (above(v, a, b)) { if (above(v, b, c)) p = b; else if (above(v, a, c)) p = c; else p = a; }
        else { if (above(v, a, c)) p = a; else if (above(v, b, c)) p = c; else p = b; }
        int i = lo, j = hi;
        while (i <= j) {
            while (above(v, tmp[i], p)) i++;
            while (above(v, p, tmp[j])) j--;
            if (i <= j) { int32_t t = tmp[i]; tmp[i] = tmp[j]; tmp[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    for (int i = 0; i < k; i++) idx[i] = tmp[i];
    qsort(idx, (size_t)k, sizeof(int32_t), cmp_i32);
}
