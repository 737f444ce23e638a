/* ops.c: per-row operations of the forward pass; see ops.h. Reductions accumulate in double
 * where it is free (norm statistics), so results do not depend on vector width. */
#include "model/ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* The rank of op_topk as an unsigned key: a larger value ranks above, -0 and +0 are equal, NaN
 * ranks lowest (key 0; every number maps above it). Equal keys are ordered by position (the
 * later wins: the DSA reference's tie rule: a trained indexer's ReLU'd scores are often exactly
 * equal, mostly 0, and the cut falls inside the tie). */
static uint32_t rank_key(float x) {
    if (x != x) return 0;
    uint32_t u;
    if (x == 0) x = 0; /* -0 -> +0 */
    memcpy(&u, &x, 4);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* A radix select over the keys (11, 11 and 10 bits: three counting passes find the k-th key),
 * then one pass in index order takes every key above it and, of the keys equal to it, the
 * latest ones: O(n) and the same selection as a sort by (key, position). */
void op_topk(const float *v, int n, int k, int32_t *idx, int32_t *tmp) {
    if (k <= 0) return;
    if (k >= n) {
        for (int i = 0; i < n; i++) idx[i] = i;
        return;
    }
    uint32_t *key = (uint32_t *)tmp, prefix = 0, mask = 0;
    for (int i = 0; i < n; i++) key[i] = rank_key(v[i]);
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    uint32_t hist[2048];
    int need = k; /* keys still to take among those matching prefix in the bits decided so far */
    for (int p = 0; p < 3; p++) {
        uint32_t dm = (1u << width[p]) - 1;
        memset(hist, 0, sizeof(uint32_t) * (dm + 1));
        for (int i = 0; i < n; i++)
            if ((key[i] & mask) == prefix) hist[(key[i] >> shift[p]) & dm]++;
        uint32_t d = dm;
        for (int above = 0;; d--) { /* the digit holding the need-th key from the top */
            if (above + (int)hist[d] >= need) {
                need -= above;
                break;
            }
            above += (int)hist[d];
        }
        prefix |= d << shift[p];
        mask |= dm << shift[p];
    }
    /* prefix is now the k-th key: every key above it is in, and the `need` latest equal to it */
    int cut = n;
    for (int i = n - 1, eq = 0; i >= 0 && eq < need; i--)
        if (key[i] == prefix) eq++, cut = i;
    for (int i = 0, j = 0; i < n; i++)
        if (key[i] > prefix || (key[i] == prefix && i >= cut)) idx[j++] = i;
}
