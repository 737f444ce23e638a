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

/* ---- int8 activations (kn_internal.h) ---- */
void kn_actq_quant_row(const float *x, int64_t cols, int g, int8_t *q, float *d) {
    for (int64_t j0 = 0, gi = 0; j0 < cols; j0 += g, gi++) {
        int64_t j1 = j0 + g < cols ? j0 + g : cols;
        float amax = 0.f, probe = 0.f;
        for (int64_t j = j0; j < j1; j++) {
            amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
            probe += x[j] - x[j]; /* NaN if any x is NaN or inf */
        }
        /* NaN / inf activations: their group gets a NaN scale, so the result is NaN like the f32
         * path, never a silently finite number */
        float id = amax > 0.f && amax < INFINITY ? 127.f / amax : 0.f;
        d[gi] = amax / 127.f + probe;
        for (int64_t j = j0; j < j1; j++) {
            float v = rintf(x[j] * id);
            v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
            q[j] = (int8_t)(v == v ? v : 0.f);
        }
    }
}

void kn_actq_prep(int kind, const float *x, int n, int64_t cols, uint8_t *xq) {
    const int g = kind == KN_ACTQ_Q4 ? 64 : 32, off = kind == KN_ACTQ_Q4 ? 8 : 128;
    const int64_t sc = kn_actq_step_cols(kind), rec = kn_actq_rec_bytes(kind);
    const int64_t nsteps = (cols + sc - 1) / sc, qb = kind == KN_ACTQ_Q4 ? 128 : 64;
    int8_t qstack[8192];
    float dstack[256];
    int8_t *q = cols <= 8192 ? qstack : malloc((size_t)cols);
    float *d = cols <= 8192 ? dstack : malloc((size_t)((cols + g - 1) / g) * sizeof(float));
    if (!q || !d) { /* out of memory: NaN scales make the outputs NaN */
        memset(xq, 0, (size_t)(kn_actq_row_bytes(kind, cols) * n));
        for (int i = 0; i < n; i++)
            for (int64_t s = 0; s < nsteps; s++)
                for (int l = 0; l < 16; l++) {
                    float nan = NAN;
                    memcpy(xq + i * kn_actq_row_bytes(kind, cols) + s * rec + qb + 64 + l * 4, &nan, 4);
                }
        if (q != qstack) free(q);
        if (d != dstack) free(d);
        return;
    }
    for (int i = 0; i < n; i++) {
        kn_actq_quant_row(x + (int64_t)i * cols, cols, g, q, d);
        for (int64_t s = 0; s < nsteps; s++) {
            uint8_t *r = xq + (int64_t)i * kn_actq_row_bytes(kind, cols) + s * rec;
            int8_t *rq = (int8_t *)r;
            int32_t bias[16] = {0};
            float dexp[16] = {0};
            memset(r, 0, (size_t)qb);
            for (int h = 0; h < 2; h++) {
                int64_t gi = s * 2 + h, j0 = gi * g;
                if (j0 >= cols) break;
                int64_t j1 = j0 + g < cols ? j0 + g : cols;
                int32_t sum = 0;
                for (int64_t j = j0; j < j1; j++) {
                    int64_t k = j - s * sc; /* column within the step */
                    if (kind == KN_ACTQ_Q4) rq[(k & 1) * 64 + (k >> 1)] = q[j];
                    else rq[k] = q[j];
                    sum += q[j];
                }
                bias[h * 8] = -off * sum;
                for (int l = 0; l < 8; l++) dexp[h * 8 + l] = d[gi];
            }
            memcpy(r + qb, bias, 64);
            memcpy(r + qb + 64, dexp, 64);
        }
        float *dg = (float *)(xq + (int64_t)i * kn_actq_row_bytes(kind, cols) + nsteps * rec);
        memset(dg, 0, (size_t)(kn_actq_row_bytes(kind, cols) - nsteps * rec));
        for (int64_t gi = 0; gi < (cols + g - 1) / g; gi++) dg[gi] = d[gi];
    }
    if (q != qstack) free(q);
    if (d != dstack) free(d);
}

void kn_ref_matmul_actq(const pt_wview *W, const float *x, int n, float *y) {
    int kind = W->qtype == PT_Q4_G64 ? KN_ACTQ_Q4
               : (W->qtype == PT_Q8_G32 || W->qtype == PT_Q8_ROW) ? KN_ACTQ_Q8 : 0;
    if (!kind || !W->scale) { kn_ref_matmul(W, x, n, y); return; }
    const int g = kind == KN_ACTQ_Q4 ? 64 : 32;
    const int64_t cols = W->cols, ng = (cols + g - 1) / g;
    int8_t *q = malloc((size_t)(cols > 0 ? cols : 1));
    float *d = malloc((size_t)(ng > 0 ? ng : 1) * sizeof(float));
    for (int i = 0; i < n; i++) {
        kn_actq_quant_row(x + (int64_t)i * cols, cols, g, q, d);
        for (int64_t r = 0; r < W->rows; r++) {
            const uint8_t *p = W->data + r * W->row_bytes;
            double acc = 0;
            for (int64_t gi = 0; gi < ng; gi++) {
                int64_t j1 = (gi + 1) * g < cols ? (gi + 1) * g : cols;
                int32_t dot = 0;
                for (int64_t j = gi * g; j < j1; j++) {
                    int w = kind == KN_ACTQ_Q4 ? ((p[j >> 1] >> ((j & 1) * 4)) & 15) - 8
                                               : (int)(int8_t)p[j];
                    dot += w * q[j];
                }
                float ws = W->qtype == PT_Q8_ROW ? 1.f : kn_scale_at(W, r * W->scale_cols + gi);
                acc += (double)ws * d[gi] * dot;
            }
            if (W->qtype == PT_Q8_ROW) acc *= kn_scale_at(W, r);
            y[(int64_t)i * W->rows + r] = (float)acc;
        }
    }
    free(q); free(d);
}

/* ---- transposed product ---- */
void kn_ref_matmul_t_cols(const pt_wview *W, int64_t c0, int64_t c1, const float *x, int n,
                          float *y) {
    float stackbuf[4096];
    float *row = W->cols <= 4096 ? stackbuf : malloc((size_t)W->cols * sizeof(float));
    for (int i = 0; i < n; i++)
        for (int64_t c = c0; c < c1; c++) y[(int64_t)i * W->cols + c] = row ? 0.f : NAN;
    if (!row) return;
    for (int64_t r = 0; r < W->rows; r++) {
        pt_dequant_row(W, r, row);
        for (int i = 0; i < n; i++) {
            float a = x[(int64_t)i * W->rows + r];
            float *yi = y + (int64_t)i * W->cols;
            for (int64_t c = c0; c < c1; c++) yi[c] += a * row[c];
        }
    }
    if (row != stackbuf) free(row);
}

void kn_ref_matmul_t(const pt_wview *W, const float *x, int n, float *y) {
    kn_ref_matmul_t_cols(W, 0, W->cols, x, n, y);
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

/* ---- attention core (kernels.h: kn_attn) ---- */
size_t kn_attn_scratch_floats(int M, int64_t N, int D, int Dr) {
    size_t nmb = ((size_t)(M > 0 ? M : 0) + KN_ATTN_MB - 1) / KN_ATTN_MB;
    return nmb * KN_ATTN_MB * ((size_t)D + (size_t)Dr + (size_t)N + 1) + 16;
}

/* kn_softmax's AVX-512 exp (actq_avx512.c exp512, attn_avx512.c) one lane at a time: the same
 * clamp, the same rounding of k, fused steps and scaling by 2^k, so the results are bitwise
 * equal (nearbyintf: round to nearest even, as vroundscaleps; ldexpf rounds once, as vscalefps). */
float kn_ref_exp(float x) {
    x = x < -104.f ? -104.f : x; /* NaN stays NaN, as vmaxps(-104, x) */
    x = x > 89.f ? 89.f : x;
    float k = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-k, 0.693359375f, x);
    r = fmaf(-k, -2.12194440e-4f, r);
    float p = 1.f / 5040.f;
    p = fmaf(p, r, 1.f / 720.f);
    p = fmaf(p, r, 1.f / 120.f);
    p = fmaf(p, r, 1.f / 24.f);
    p = fmaf(p, r, 1.f / 6.f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    return ldexpf(p, (int)k);
}

/* The definition in kernels.h, one query at a time; scr holds the query's scores. */
void kn_ref_attn(const kn_attn *a, float *scr) {
    const int64_t N = a->N;
    for (int m = 0; m < a->M; m++) {
        const float *q = a->q + (int64_t)m * a->q_stride, *qp = a->qpe + (int64_t)m * a->qpe_stride;
        int64_t n = a->nk ? a->nk[m] : N;
        float *s = scr, mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < N; t++) {
            float acc = 0.f;
            for (int k = 0; k < a->D; k++) acc = fmaf(q[k], a->kc[t][k], acc);
            for (int k = 0; k < a->Dr; k++) acc = fmaf(qp[k], a->kp[t][k], acc);
            s[t] = a->scale * acc;
        }
        for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        for (int64_t t = 0; t < n; t++) {
            s[t] = kn_ref_exp(s[t] - mx);
            sum += s[t];
        }
        float inv = 1.f / sum;
        for (int64_t t = 0; t < N; t++) s[t] = t < n ? s[t] * inv : 0.f;
        float *lat = a->lat + (int64_t)m * a->lat_stride;
        for (int j = 0; j < a->D; j++) {
            float acc = 0.f;
            for (int64_t t = 0; t < N; t++) acc = fmaf(s[t], a->kc[t][j], acc);
            lat[j] = acc;
        }
    }
}

/* The definition in kernels.h (kn_dsa), one key at a time. */
void kn_ref_dsa_scores(const kn_dsa *a) {
    const int Hp = a->Hp;
    for (int64_t t = 0; t < a->n; t++) {
        const float *k = a->k + t * a->k_stride;
        float u[16];
        for (int i = 0; i < 16; i++) u[i] = 0.f;
        for (int h = 0; h < Hp; h++) {
            float dd = 0.f;
            for (int d = 0; d < a->Di; d++) dd = fmaf(a->qt[(size_t)d * Hp + h], k[d], dd);
            float m = dd > 0.f ? a->w[h] * dd : 0.f;
            u[h % 16] = h < 16 ? m : u[h % 16] + m;
        }
        float b8[8], b4[4], b2[2];
        for (int i = 0; i < 8; i++) b8[i] = u[i] + u[i + 8];
        for (int i = 0; i < 4; i++) b4[i] = b8[i] + b8[i + 4];
        for (int i = 0; i < 2; i++) b2[i] = b4[i] + b4[i + 2];
        a->score[t] = b2[0] + b2[1];
    }
}

int64_t kn_ref_argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best] || x[best] != x[best]) best = i;
    return best;
}
