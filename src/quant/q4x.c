/* q4x.c: a better quantizer for the PT_Q4_G64 storage format ("q4x"). Same bytes, same
 * dequantization w = (nib - 8) * s (so every kernel, the r16 layout and pack readers are
 * unchanged); only the choice of s and q differs from pt_quant_row's round-to-nearest with
 * s = max|w| / 7:
 *   - all 16 levels: the scale may be negative, so the group's largest-magnitude value can land
 *     on -8 whatever its sign (as llama.cpp's q4_0 does with d = max / -8);
 *   - a search per group: candidate scales on a grid around amax / 8 and amax / 7 (both signs),
 *     for each the values re-rounded, then the least-squares scale for those levels, rounded to
 *     the scale dtype, and the values re-rounded to that stored scale; the candidate with the
 *     smallest error sum_j u_j (w_j - s q_j)^2 is kept;
 *   - importance weights u_j: imp[j] (the mean x_j^2 of the matrix's input column j over a
 *     calibration text, src/io/calib.c) plus a floor of Q4X_IMP_FLOOR times its group mean, so
 *     a column the calibration never excited still counts; imp NULL: u_j = 1.
 * The plain round-to-nearest result (pt_quant_row's) is always among the candidates, so the
 * weighted error of a group is never larger than RTN's.
 * With the full second moments H = E[x x^T] of the input (calibration) a row is also quantized
 * as GPTQ does (Frantar et al. 2022): columns in order, each rounding error e_j spread over the
 * later columns by the row of U (upper Cholesky factor of the damped H^-1) so the product's error
 * stays small, a group's scale searched on the updated values when the group is reached; then
 * RTN, the group search and GPTQ are compared by the output error dw^T H dw and the least is kept.
 * Offline work: clarity over speed. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/quant.h"

#define Q4X_IMP_FLOOR 0.02f /* u_j = imp_j + 0.02 * mean(imp over the group) */
#define Q4X_GRID 12         /* scale candidates per orientation: max / (8 + k / 4) and max / (7 + k / 4)
                               for k = -6 .. 12 (divisors >= 4) */

static float stored(float s, int dtype) {
    switch (dtype) {
    case PT_BF16: return pt_bf16_to_f32(pt_f32_to_bf16(s));
    case PT_F16: return pt_f16_to_f32(pt_f32_to_f16(s));
    default: return s;
    }
}

static void put(void *scales, int64_t i, int dtype, float s) {
    if (dtype == PT_BF16) ((uint16_t *)scales)[i] = pt_f32_to_bf16(s);
    else if (dtype == PT_F16) ((uint16_t *)scales)[i] = pt_f32_to_f16(s);
    else ((float *)scales)[i] = s;
}

static int q_of(float w, float s) { /* nearest level of w / s in [-8, 7], ties to even */
    if (s == 0.f || !isfinite(s)) return 0;
    float v = nearbyintf(w / s);
    if (!(v >= -8.f)) v = -8.f;
    if (v > 7.f) v = 7.f;
    return (int)v;
}

/* Error of stored scale s over the group (u: weights, n <= 64) with levels re-rounded into q.
 * exact = 1: level = round(w / s) as pt_quant_row computes it; 0: round(w * (1 / s)) (may differ
 * at a tie, which only makes it another candidate). Rounding by adding and subtracting 1.5 * 2^23
 * is round-half-even in the default mode, as nearbyintf, for |w / s| < 2^22 (callers keep |s| >=
 * amax / 16, so |w / s| <= 16); the clamp is on integers, so the loop has no branches. */
/* The group loops below run over exactly 64 entries (a short group is padded with w = u = 0,
 * which adds nothing). Each has a scalar form (the reference) and a 4-lane form in GCC/clang
 * vector extensions (SSE2 on baseline x86-64) that does the same operations per element and
 * sums in the same order (lanes 0-3 and 4-7 are sum64's p0..p7), so both give bitwise the same
 * result; pt_q4x_force_scalar(1) selects the reference (tests compare the two). */
static int g_scalar;
void pt_q4x_force_scalar(int on) { g_scalar = on; }

typedef float v4f __attribute__((vector_size(16)));
typedef int v4i __attribute__((vector_size(16)));
static v4f ld4(const float *p) { v4f v; memcpy(&v, p, sizeof v); return v; }
static void st4(float *p, v4f v) { memcpy(p, &v, sizeof v); }
static float hsum8(v4f a, v4f b) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((b[0] + b[1]) + (b[2] + b[3])); }
static v4i clamp4(v4i k, int lo, int hi) {
    v4i l = {lo, lo, lo, lo}, h = {hi, hi, hi, hi};
    v4i m = k < l;
    k = (k & ~m) | (l & m);
    m = k > h;
    return (k & ~m) | (h & m);
}

static float group_err_v(const float *w, const float *u, float s, int exact, float *q) {
    const v4f C = {12582912.f, 12582912.f, 12582912.f, 12582912.f};
    v4f sv = {s, s, s, s}, iv = {1.f / s, 1.f / s, 1.f / s, 1.f / s}, acc[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    for (int j = 0; j < 64; j += 4) {
        v4f wv = ld4(w + j), uv = ld4(u + j);
        v4f r = exact ? wv / sv : wv * iv;
        r = (r + C) - C;
        v4f v = __builtin_convertvector(clamp4(__builtin_convertvector(r, v4i), -8, 7), v4f);
        st4(q + j, v);
        v4f d = wv - sv * v;
        acc[(j >> 2) & 1] += uv * d * d;
    }
    return hsum8(acc[0], acc[1]);
}

static float ls_scale_v(const float *w, const float *u, const float *q) {
    v4f a[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}}, b[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    for (int j = 0; j < 64; j += 4) {
        v4f wv = ld4(w + j), uv = ld4(u + j), qv = ld4(q + j);
        a[(j >> 2) & 1] += uv * wv * qv;
        b[(j >> 2) & 1] += uv * qv * qv;
    }
    float A = hsum8(a[0], a[1]), B = hsum8(b[0], b[1]);
    return B > 0.f ? A / B : 0.f;
}

static float sum64(const float *t) { /* fixed order: 8 partial sums, then pairs */
    float p0 = 0, p1 = 0, p2 = 0, p3 = 0, p4 = 0, p5 = 0, p6 = 0, p7 = 0;
    for (int j = 0; j < 64; j += 8) {
        p0 += t[j]; p1 += t[j + 1]; p2 += t[j + 2]; p3 += t[j + 3];
        p4 += t[j + 4]; p5 += t[j + 5]; p6 += t[j + 6]; p7 += t[j + 7];
    }
    return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7));
}

static float group_err(const float *w, const float *u, float s, int exact, float *q) {
    float t[64], inv = 1.f / s;
    if (s == 0.f || !isfinite(s)) {
        for (int j = 0; j < 64; j++) { q[j] = 0.f; t[j] = u[j] * w[j] * w[j]; }
        return sum64(t);
    }
    if (!g_scalar) return group_err_v(w, u, s, exact, q);
    if (exact)
        for (int j = 0; j < 64; j++) q[j] = w[j] / s;
    else
        for (int j = 0; j < 64; j++) q[j] = w[j] * inv;
    for (int j = 0; j < 64; j++) {
        int k = (int)((q[j] + 12582912.f) - 12582912.f); /* |q| <= 16 (callers keep |s| >= amax/16) */
        k = k < -8 ? -8 : k;
        k = k > 7 ? 7 : k;
        float v = (float)k;
        q[j] = v;
        float d = w[j] - s * v;
        t[j] = u[j] * d * d;
    }
    return sum64(t);
}

/* Least-squares scale for fixed levels q (0 if all levels are 0). */
static float ls_scale(const float *w, const float *u, const float *q) {
    if (!g_scalar) return ls_scale_v(w, u, q);
    float ta[64], tb[64];
    for (int j = 0; j < 64; j++) {
        ta[j] = u[j] * w[j] * q[j];
        tb[j] = u[j] * q[j] * q[j];
    }
    float a = sum64(ta), b = sum64(tb);
    return b > 0.f ? a / b : 0.f;
}

double pt_q4x_group_error(const float *w, const float *imp, int n, float s, const int8_t *q) {
    float u[64];
    const float *up = NULL;
    if (imp) {
        double m = 0;
        for (int j = 0; j < n; j++) m += imp[j];
        m = n ? m / n : 0;
        for (int j = 0; j < n; j++) u[j] = imp[j] + Q4X_IMP_FLOOR * (float)m;
        up = u;
    }
    double e = 0;
    for (int j = 0; j < n; j++) {
        double d = (double)w[j] - (double)s * q[j];
        e += (up ? up[j] : 1.0) * d * d;
    }
    return e;
}

/* One group of n <= 64 values: writes the stored scale (returned) and levels q. */
static float quant_group(const float *wg, const float *imp, int n, int dtype, int8_t *qout) {
    float w[64] = {0}, u[64] = {0}, q[64], tq[64];
    float amax = 0.f, mx = 0.f;
    memcpy(w, wg, sizeof(float) * (size_t)n);
    for (int j = 0; j < n; j++)
        if (fabsf(w[j]) > amax) { amax = fabsf(w[j]); mx = w[j]; }
    if (imp) {
        float m = 0.f;
        for (int j = 0; j < n; j++) m += imp[j];
        m = n ? m / (float)n : 0.f;
        for (int j = 0; j < n; j++) u[j] = imp[j] + Q4X_IMP_FLOOR * m;
    } else {
        for (int j = 0; j < n; j++) u[j] = 1.f;
    }
    /* candidate 0: round to nearest with s = amax / 7, exactly as pt_quant_row */
    float s_rtn = amax / 7.f;
    if (s_rtn < 1e-8f) s_rtn = 1e-8f;
    float best_s = stored(s_rtn, dtype);
    float best = group_err(w, u, best_s, 1, q);
    if (amax >= 1e-30f) {
        /* the grid, then least-squares refinement from the two best grid points */
        float top_s[2] = {0, 0}, top_e[2] = {INFINITY, INFINITY};
        for (int o = 0; o < 2; o++)
            for (int k = -Q4X_GRID / 2; k <= Q4X_GRID; k++) {
                /* o = 0: the extreme value on level -8 (negative scale for a positive extreme);
                 * o = 1: on level +7 (the RTN orientation) */
                float div = o == 0 ? 8.f + 0.25f * (float)k : 7.f + 0.25f * (float)k;
                if (div < 4.f) continue;
                float s = stored(o == 0 ? -mx / div : mx / div, dtype);
                float e = group_err(w, u, s, 0, tq);
                if (e < best) { best = e; best_s = s; memcpy(q, tq, sizeof q); }
                if (e < top_e[1]) {
                    int at = e < top_e[0] ? 0 : 1;
                    if (at == 0) { top_e[1] = top_e[0]; top_s[1] = top_s[0]; }
                    top_e[at] = e;
                    top_s[at] = s;
                }
            }
        for (int c = 0; c < 2; c++) {
            float s = top_s[c];
            if (s == 0.f) continue;
            group_err(w, u, s, 0, tq);
            for (int it = 0; it < 3; it++) {
                float s2 = stored(ls_scale(w, u, tq), dtype);
                if (s2 == s || !(fabsf(s2) >= amax / 16.f)) break;
                s = s2;
                float e = group_err(w, u, s, 0, tq);
                if (e < best) { best = e; best_s = s; memcpy(q, tq, sizeof q); }
            }
        }
    }
    for (int j = 0; j < n; j++) qout[j] = (int8_t)q[j];
    return best_s;
}

/* Cholesky A = L L^T in place (lower triangle; the upper is left as is). 0, or -1 if not PD. */
static int chol(double *A, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        double d = A[j * n + j];
        for (int64_t k = 0; k < j; k++) d -= A[j * n + k] * A[j * n + k];
        if (!(d > 0)) return -1;
        d = sqrt(d);
        A[j * n + j] = d;
        for (int64_t i = j + 1; i < n; i++) {
            double v = A[i * n + j];
            for (int64_t k = 0; k < j; k++) v -= A[i * n + k] * A[j * n + k];
            A[i * n + j] = v / d;
        }
    }
    return 0;
}

int pt_q4x_prepare(const double *H, int64_t n, double *U) {
    if (n <= 0) return -1;
    double *A = malloc(sizeof(double) * (size_t)(n * n)), *B = malloc(sizeof(double) * (size_t)(n * n));
    if (!A || !B) { free(A); free(B); return -1; }
    double md = 0;
    for (int64_t i = 0; i < n; i++) md += H[i * n + i];
    md /= (double)n;
    if (!(md > 0)) md = 1;
    int rc = -1;
    for (double damp = 0.01; damp <= 10.0 && rc < 0; damp *= 10) {
        memcpy(A, H, sizeof(double) * (size_t)(n * n));
        for (int64_t i = 0; i < n; i++) A[i * n + i] += damp * md + (H[i * n + i] > 0 ? 0 : md);
        if (chol(A, n) < 0) continue;
        /* B = L^-1 (lower), then H^-1 = B^T B */
        memset(B, 0, sizeof(double) * (size_t)(n * n));
        for (int64_t i = 0; i < n; i++) {
            B[i * n + i] = 1.0 / A[i * n + i];
            for (int64_t j = 0; j < i; j++) {
                double v = 0;
                for (int64_t k = j; k < i; k++) v -= A[i * n + k] * B[k * n + j];
                B[i * n + j] = v / A[i * n + i];
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j <= i; j++) {
                double v = 0;
                for (int64_t k = i; k < n; k++) v += B[k * n + i] * B[k * n + j];
                A[i * n + j] = A[j * n + i] = v;
            }
        if (chol(A, n) < 0) continue;
        /* U = L^T of H^-1's factor */
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < n; j++) U[i * n + j] = j >= i ? A[j * n + i] : 0;
        rc = 0;
    }
    free(A);
    free(B);
    return rc;
}

/* dw^T H dw for the row w against the levels q and group scales s. */
static double out_err(const double *H, const float *w, int64_t n, const int8_t *q, const float *s, double *dw) {
    for (int64_t j = 0; j < n; j++) dw[j] = (double)w[j] - (double)s[j / 64] * q[j];
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double v = 0;
        for (int64_t j = 0; j < n; j++) v += H[i * n + j] * dw[j];
        e += dw[i] * v;
    }
    return e;
}

/* GPTQ pass over row w into levels q: fixed = 0 searches each group's scale s[g] when the group
 * is reached, fixed = 1 keeps the given s. wk: scratch [n]. */
static void gptq_pass(const float *w, int64_t n, const pt_q4x_ctx *ctx, int dtype, int fixed, int8_t *q, float *s, float *wk) {
    const double *U = ctx->U;
    memcpy(wk, w, sizeof(float) * (size_t)n);
    for (int64_t j = 0; j < n; j++) {
        if (j % 64 == 0 && !fixed) {
            int m = (int)(n - j < 64 ? n - j : 64);
            int8_t tq[64];
            s[j / 64] = quant_group(wk + j, ctx->imp ? ctx->imp + j : NULL, m, dtype, tq);
        }
        float sg = s[j / 64];
        q[j] = (int8_t)q_of(wk[j], sg);
        double e = ((double)wk[j] - (double)sg * q[j]) / U[j * n + j];
        for (int64_t k = j + 1; k < n; k++) wk[k] -= (float)(e * U[j * n + k]);
    }
}

/* Group scales minimizing (w - s.q)^T H (w - s.q) for fixed levels q (normal equations, ng <= 16
 * unknowns), stored to dtype; a singular system leaves s as it is. */
static void refit_scales(const double *H, const float *w, int64_t n, const int8_t *q, float *s, int dtype) {
    int ng = (int)((n + 63) / 64);
    if (ng > 16) return;
    double M[16][17], hq[1024];
    if (n > 1024) return;
    for (int g = 0; g < ng; g++) {
        /* hq = H restricted to the columns of group g, times q there */
        for (int64_t i = 0; i < n; i++) {
            double v = 0;
            for (int64_t j = g * 64; j < n && j < (g + 1) * 64; j++) v += H[i * n + j] * q[j];
            hq[i] = v;
        }
        for (int h = 0; h < ng; h++) {
            double v = 0;
            for (int64_t i = h * 64; i < n && i < (h + 1) * 64; i++) v += q[i] * hq[i];
            M[h][g] = v;
        }
        double r = 0;
        for (int64_t i = 0; i < n; i++) r += hq[i] * w[i];
        M[g][ng] = r;
    }
    for (int c = 0; c < ng; c++) { /* Gaussian elimination with partial pivoting */
        int p = c;
        for (int r = c + 1; r < ng; r++)
            if (fabs(M[r][c]) > fabs(M[p][c])) p = r;
        if (!(fabs(M[p][c]) > 1e-30)) return;
        if (p != c)
            for (int k = 0; k <= ng; k++) { double t = M[c][k]; M[c][k] = M[p][k]; M[p][k] = t; }
        for (int r = 0; r < ng; r++) {
            if (r == c) continue;
            double f = M[r][c] / M[c][c];
            for (int k = c; k <= ng; k++) M[r][k] -= f * M[c][k];
        }
    }
    for (int g = 0; g < ng; g++) {
        float v = stored((float)(M[g][ng] / M[g][g]), dtype);
        if (isfinite(v) && v != 0.f) s[g] = v;
    }
}

int pt_quant_row_q4x(const float *w, int64_t cols, const pt_q4x_ctx *ctx, uint8_t *out, void *scales,
                     int scale_dtype) {
    if (!scales || pt_scale_dtype_bytes(scale_dtype) == 0) return -1;
    if (ctx && ctx->cols != cols) ctx = NULL;
    const float *imp = ctx ? ctx->imp : NULL;
    int64_t ng = (cols + 63) / 64;
    int use_h = ctx && ctx->H && ctx->U;
    int8_t *q = malloc((size_t)cols * (use_h ? 4 : 1));
    float *s = malloc(sizeof(float) * (size_t)ng * (use_h ? 4 : 1));
    float *wk = use_h ? malloc(sizeof(float) * (size_t)cols) : NULL;
    double *dw = use_h ? malloc(sizeof(double) * (size_t)cols) : NULL;
    if (!q || !s || (use_h && (!wk || !dw))) { free(q); free(s); free(wk); free(dw); return -1; }
    /* candidate A: the group search */
    for (int64_t g = 0; g < ng; g++) {
        int64_t j0 = g * 64;
        int n = (int)(cols - j0 < 64 ? cols - j0 : 64);
        s[g] = quant_group(w + j0, imp ? imp + j0 : NULL, n, scale_dtype, q + j0);
    }
    const int8_t *bq = q;
    const float *bs = s;
    if (use_h) {
        int8_t *q2 = q + cols, *q3 = q + 2 * cols, *q4 = q + 3 * cols;
        float *s2 = s + ng, *s3 = s + 2 * ng, *s4 = s + 3 * ng;
        /* candidate B: RTN */
        for (int64_t g = 0; g < ng; g++) {
            int64_t j0 = g * 64, j1 = j0 + 64 < cols ? j0 + 64 : cols;
            float amax = 0.f;
            for (int64_t j = j0; j < j1; j++) amax = fmaxf(amax, fabsf(w[j]));
            float sr = amax / 7.f;
            if (sr < 1e-8f) sr = 1e-8f;
            s2[g] = stored(sr, scale_dtype);
            for (int64_t j = j0; j < j1; j++) q2[j] = (int8_t)q_of(w[j], s2[g]);
        }
        /* candidate C: GPTQ over the columns in order, group scales searched on the way, then
         * refitted to its levels; D: GPTQ again with C's scales fixed, refitted again */
        gptq_pass(w, cols, ctx, scale_dtype, 0, q3, s3, wk);
        refit_scales(ctx->H, w, cols, q3, s3, scale_dtype);
        memcpy(s4, s3, sizeof(float) * (size_t)ng);
        gptq_pass(w, cols, ctx, scale_dtype, 1, q4, s4, wk);
        refit_scales(ctx->H, w, cols, q4, s4, scale_dtype);
        double ea = out_err(ctx->H, w, cols, q, s, dw), eb = out_err(ctx->H, w, cols, q2, s2, dw),
               ec = out_err(ctx->H, w, cols, q3, s3, dw), ed = out_err(ctx->H, w, cols, q4, s4, dw), best = ea;
        if (eb < best) { best = eb; bq = q2; bs = s2; }
        if (ec < best) { best = ec; bq = q3; bs = s3; }
        if (ed < best) { best = ed; bq = q4; bs = s4; }
    }
    memset(out, 0x88, (size_t)pt_qtype_row_bytes(PT_Q4_G64, cols)); /* pad nibble: q = 0 */
    for (int64_t g = 0; g < ng; g++) put(scales, g, scale_dtype, bs[g]);
    for (int64_t j = 0; j < cols; j++) {
        uint8_t nib = (uint8_t)(bq[j] + 8), *b = &out[j >> 1];
        *b = (j & 1) ? (uint8_t)((*b & 0x0f) | (nib << 4)) : (uint8_t)((*b & 0xf0) | nib);
    }
    free(q);
    free(s);
    free(wk);
    free(dw);
    return 0;
}
