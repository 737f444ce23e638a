/* test_q4x.c: the q4x quantizer (src/quant/q4x.c) against round to nearest (pt_quant_row's q4):
 * never a larger (weighted) group error on random and heavy-tailed rows, its bytes read back by
 * pt_dequant_row and by every matmul kernel (negative scales included), GPTQ's output error under
 * a correlated input, its vector loops against their scalar twin (bitwise), a q4x pack of the
 * trained fixture against its f32 logits, the calibration
 * (src/io/calib.c) statistics, and `petrel convert --calib` refusals. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "io/calib.h"
#include "io/convert.h"
#include "io/safetensors.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "quant/quant.h"
#include "test.h"

static uint64_t rs;
static void seed(void) { rs = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull | 1; }
static double u01(void) {
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return ((double)(rs >> 11) + 0.5) / 9007199254740992.0;
}
static float gauss(void) { return (float)(sqrt(-2 * log(u01())) * cos(6.283185307179586 * u01())); }
/* kind 0: uniform [-1, 1); 1: Student-t with 2 degrees of freedom (heavy tails); 2: gaussian
 * with a few 20x outliers */
static float sample(int kind) {
    if (kind == 0) return (float)(u01() * 2 - 1);
    if (kind == 1) {
        double z = gauss(), a = gauss(), b = gauss(), c = a * a + b * b;
        return (float)(z / sqrt(c / 2 + 1e-12));
    }
    float g = gauss();
    return u01() < 0.02 ? 20.f * g : g;
}

static float scale_at(const void *s, int dt, int64_t i) {
    if (dt == PT_BF16) return pt_bf16_to_f32(((const uint16_t *)s)[i]);
    if (dt == PT_F16) return pt_f16_to_f32(((const uint16_t *)s)[i]);
    return ((const float *)s)[i];
}
static int level_at(const uint8_t *row, int64_t j) { return ((row[j >> 1] >> ((j & 1) * 4)) & 15) - 8; }

/* Per group: q4x's weighted error <= RTN's (the same formula, pt_q4x_group_error); the bytes
 * dequantize to level * scale; q4x uses level -8; over all groups it is clearly better. */
TEST(q4x, never_worse_than_rtn) {
    seed();
    static const int64_t cols[] = {1, 7, 63, 64, 65, 160, 1000};
    static const int dts[] = {PT_BF16, PT_F16, PT_F32};
    double tot_x = 0, tot_r = 0;
    int used_m8 = 0, neg_scale = 0;
    for (int kind = 0; kind < 3; kind++)
        for (int ci = 0; ci < 7; ci++)
            for (int di = 0; di < 3; di++)
                for (int weighted = 0; weighted < 2; weighted++) {
                    int64_t n = cols[ci], ng = (n + 63) / 64;
                    float *w = malloc(sizeof(float) * (size_t)n), *imp = malloc(sizeof(float) * (size_t)n);
                    float *dq = malloc(sizeof(float) * (size_t)n);
                    uint8_t *bx = malloc((size_t)(n + 1) / 2), *br = malloc((size_t)(n + 1) / 2);
                    float sx[64], sr[64];
                    for (int64_t j = 0; j < n; j++) {
                        w[j] = sample(kind) * 0.05f;
                        imp[j] = (float)(u01() * u01() * 4);
                    }
                    pt_q4x_ctx ctx = {n, imp, NULL, NULL};
                    CHECK(pt_quant_row_q4x(w, n, weighted ? &ctx : NULL, bx, sx, dts[di]) == 0);
                    CHECK(pt_quant_row(PT_Q4_G64, w, n, br, sr, dts[di]) == 0);
                    pt_wview v = pt_wview_make(PT_Q4_G64, 1, n, bx, sx, dts[di]);
                    pt_dequant_row(&v, 0, dq);
                    for (int64_t g = 0; g < ng; g++) {
                        int64_t j0 = g * 64;
                        int m = (int)(n - j0 < 64 ? n - j0 : 64);
                        int8_t qx[64], qr[64];
                        float s_x = scale_at(sx, dts[di], g), s_r = scale_at(sr, dts[di], g);
                        for (int t = 0; t < m; t++) {
                            qx[t] = (int8_t)level_at(bx, j0 + t);
                            qr[t] = (int8_t)level_at(br, j0 + t);
                            CHECK(dq[j0 + t] == (float)qx[t] * s_x);
                            used_m8 |= qx[t] == -8;
                        }
                        neg_scale |= s_x < 0;
                        const float *ip = weighted ? imp + j0 : NULL;
                        double ex = pt_q4x_group_error(w + j0, ip, m, s_x, qx), er = pt_q4x_group_error(w + j0, ip, m, s_r, qr);
                        CHECK_MSG(ex <= er * (1 + 1e-5) + 1e-30, "kind %d cols %lld dtype %d weighted %d group %lld: q4x %.9g > rtn %.9g (seed %llu)",
                                  kind, (long long)n, dts[di], weighted, (long long)g, ex, er, (unsigned long long)rs);
                        tot_x += ex;
                        tot_r += er;
                    }
                    if (n & 1) CHECK_EQ_INT(bx[n / 2] >> 4, 8); /* pad nibble: level 0 */
                    free(w); free(imp); free(dq); free(bx); free(br);
                }
    CHECK(used_m8 && neg_scale);
    CHECK_MSG(tot_x < 0.9 * tot_r, "q4x total error %.6g vs rtn %.6g", tot_x, tot_r);
}

/* Every matmul path (SIMD, int8 activations, r16, scalar reference) reads q4x bytes, negative
 * scales included, as their dequantized values. */
TEST(q4x, kernels_read_q4x) {
    seed();
    const int R = 32, C = 256, N = 3;
    float *w = malloc(sizeof(float) * R * C), *x = malloc(sizeof(float) * N * C), *wd = malloc(sizeof(float) * R * C);
    float *y = malloc(sizeof(float) * N * R), *yr = malloc(sizeof(float) * N * R), *ye = malloc(sizeof(float) * N * R);
    uint8_t *q = malloc((size_t)R * C / 2);
    uint16_t *s = malloc(sizeof(uint16_t) * R * (C / 64));
    for (int i = 0; i < R * C; i++) w[i] = sample(2) * 0.1f;
    for (int i = 0; i < N * C; i++) x[i] = sample(0);
    int neg = 0;
    for (int r = 0; r < R; r++) CHECK(pt_quant_row_q4x(w + (size_t)r * C, C, NULL, q + (size_t)r * C / 2, s + r * (C / 64), PT_BF16) == 0);
    for (int i = 0; i < R * (C / 64); i++) neg |= pt_bf16_to_f32(s[i]) < 0;
    CHECK(neg);
    pt_wview v = pt_wview_make(PT_Q4_G64, R, C, q, s, PT_BF16);
    for (int r = 0; r < R; r++) pt_dequant_row(&v, r, wd + (size_t)r * C);
    for (int i = 0; i < N; i++)
        for (int r = 0; r < R; r++) {
            double a = 0;
            for (int j = 0; j < C; j++) a += (double)x[i * C + j] * wd[r * C + j];
            ye[i * R + r] = (float)a;
        }
    kn_ref_matmul(&v, x, N, yr);
    CHECK(test_rel_l2(yr, ye, (size_t)N * R) < 1e-5);
    kn_matmul(&v, x, N, y); /* plain layout: int8 activations where the CPU has VNNI */
    CHECK(test_rel_l2(y, ye, (size_t)N * R) < 2e-2);
    kn_ref_matmul_actq(&v, x, N, yr);
    if (kn_act_quant_active(&v)) CHECK(test_rel_l2(y, yr, (size_t)N * R) < 1e-5);
    if (kn_r16_supported(&v) && kn_r16_repack(&v) == 0) {
        kn_matmul(&v, x, N, y);
        CHECK(test_rel_l2(y, ye, (size_t)N * R) < 2e-2);
        kn_ref_matmul(&v, x, N, yr);
        CHECK(test_rel_l2(yr, ye, (size_t)N * R) < 1e-5);
    }
    free(w); free(x); free(wd); free(y); free(yr); free(ye); free(q); free(s);
}

/* With a correlated input (H = X^T X / N), the GPTQ candidate lowers the output error
 * ||(W - W^) x|| well below RTN's and the plain search's; never above either. */
TEST(q4x, gptq_lowers_output_error) {
    seed();
    const int R = 24, C = 160, N = 600;
    float *w = malloc(sizeof(float) * R * C), *x = malloc(sizeof(float) * N * C), *imp = malloc(sizeof(float) * C);
    double *H = calloc((size_t)C * C, sizeof(double)), *U = malloc(sizeof(double) * C * C);
    for (int i = 0; i < R * C; i++) w[i] = sample(1) * 0.05f;
    for (int n = 0; n < N; n++) { /* x = a few shared factors + noise, column scales vary */
        float f[4] = {gauss(), gauss(), gauss(), gauss()};
        for (int j = 0; j < C; j++)
            x[n * C + j] = (f[j % 4] + 0.3f * gauss()) * (1.f + (float)(j % 7));
    }
    for (int n = 0; n < N; n++)
        for (int a = 0; a < C; a++)
            for (int b = 0; b < C; b++) H[a * C + b] += (double)x[n * C + a] * x[n * C + b] / N;
    for (int j = 0; j < C; j++) imp[j] = (float)H[j * C + j];
    CHECK(pt_q4x_prepare(H, C, U) == 0);
    pt_q4x_ctx diag = {C, imp, NULL, NULL}, full = {C, imp, H, U};
    double e[3] = {0, 0, 0};
    for (int r = 0; r < R; r++) {
        uint8_t q[3][80];
        uint16_t s[3][3];
        float dq[3][160];
        pt_quant_row(PT_Q4_G64, w + r * C, C, q[0], s[0], PT_BF16);
        pt_quant_row_q4x(w + r * C, C, &diag, q[1], s[1], PT_BF16);
        pt_quant_row_q4x(w + r * C, C, &full, q[2], s[2], PT_BF16);
        double er[3] = {0, 0, 0};
        for (int k = 0; k < 3; k++) {
            pt_wview v = pt_wview_make(PT_Q4_G64, 1, C, q[k], s[k], PT_BF16);
            pt_dequant_row(&v, 0, dq[k]);
            for (int n = 0; n < N; n++) {
                double d = 0;
                for (int j = 0; j < C; j++) d += ((double)w[r * C + j] - dq[k][j]) * x[n * C + j];
                er[k] += d * d;
            }
            e[k] += er[k];
        }
        CHECK_MSG(er[2] <= er[0] * (1 + 1e-4) && er[2] <= er[1] * (1 + 1e-4), "row %d: gptq %.6g rtn %.6g search %.6g", r, er[2], er[0], er[1]);
    }
    CHECK_MSG(e[2] < 0.7 * e[0], "output error: gptq %.6g vs rtn %.6g (search %.6g)", e[2], e[0], e[1]);
    free(w); free(x); free(imp); free(H); free(U);
}

static const char *tmpf(const char *name) {
    static char buf[4][600];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", test_tmpdir(), name);
    return buf[k];
}

static float *logits_of(const char *model, const int32_t *ids, int T) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(model, NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "open %s: %s", model, err.msg); return NULL; }
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s = NULL;
    if (petrel_session_create(e, T, &s, &err) || petrel_session_forward(s, ids, T, lg, 1, &err)) {
        test_fail(__FILE__, __LINE__, "%s", err.msg);
        free(lg);
        lg = NULL;
    }
    petrel_session_free(s);
    petrel_engine_close(e);
    return lg;
}

static const char *calib_text(void) {
    const char *p = tmpf("calib.txt");
    FILE *f = fopen(p, "w");
    if (!f) return p;
    for (int i = 0; i < 6; i++)
        fputs("The :mod:`json` module exposes an API familiar to users of the standard library\n"
              "marshal and pickle modules.  Encoding basic Python object hierarchies::\n\n"
              "    >>> import json\n    >>> json.dumps(['foo', {'bar': ('baz', None, 1.0, 2)}])\n\n", f);
    fclose(f);
    return p;
}

/* Calibration on the trained fixture: statistics with the right shapes and row counts. */
TEST(q4x, calib_collects_statistics) {
    calib_stats *s = NULL;
    calib_info ci;
    petrel_error err = {0};
    calib_opts o = {64, 0, 0};
    if (calib_run(test_data("trained"), calib_text(), &o, &s, &ci, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    CHECK(ci.tokens > 100 && ci.windows == (int)((ci.tokens + 63) / 64));
    CHECK(ci.observed > 0 && ci.observed < ci.matrices);
    const petrel_config *c = NULL;
    (void)c;
    const float *imp = calib_importance(s, "model.layers.0.self_attn.q_a_proj.weight", 160);
    CHECK(imp != NULL);
    for (int j = 0; imp && j < 160; j++) CHECK(imp[j] > 0);
    CHECK(calib_importance(s, "model.layers.0.self_attn.q_a_proj.weight", 96) == NULL); /* wrong shape */
    CHECK_EQ_INT(calib_rows(s, "model.layers.0.self_attn.q_a_proj.weight"), ci.tokens);
    CHECK_EQ_INT(calib_rows(s, "lm_head.weight"), ci.tokens);
    CHECK_EQ_INT(calib_rows(s, "model.embed_tokens.weight"), 0); /* a lookup, never multiplied */
    CHECK(calib_importance(s, "model.layers.1.self_attn.kv_b_proj.weight", 64) != NULL); /* via W_UK / W_UV */
    int64_t routed = 0;
    for (int e = 0; e < 32; e++) {
        char n[128];
        snprintf(n, sizeof n, "model.layers.2.mlp.experts.%d.down_proj.weight", e);
        routed += calib_rows(s, n);
    }
    CHECK_EQ_INT(routed, ci.tokens * 4); /* top-4 routing: each row reaches 4 experts */
    const pt_q4x_ctx *q = calib_q4x(s, "model.layers.3.mlp.experts.5.gate_proj.weight", 160);
    if (calib_rows(s, "model.layers.3.mlp.experts.5.gate_proj.weight") > 0) CHECK(q && q->H && q->U && q->imp && q->cols == 160);
    calib_free(s);
}

/* A q4x pack of the trained fixture (calibrated and not) loads, stays near the f32 logits, and
 * is closer to them than the RTN q4 pack of the same bytes. */
TEST(q4x, pack_near_f32_and_better_than_q4) {
    st_set *gold = NULL;
    petrel_error err = {0};
    char gp[600];
    snprintf(gp, sizeof gp, "%s/golden.safetensors", test_data("trained"));
    if (st_open(gp, &gold, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    const st_tensor *idt = test_gold(gold, 0, "ids");
    int T = (int)idt->shape[0];
    const int32_t *ids = (const int32_t *)idt->data;
    float *ref = logits_of(test_data("trained"), ids, T);
    calib_stats *cs = NULL;
    calib_info ci;
    calib_opts co = {256, 4096, 0}; /* the start of bench/data/calib.txt (not prompt 0's text) */
    if (calib_run(test_data("trained"), test_data("../../bench/data/calib.txt"), &co, &cs, &ci, &err)) test_fail(__FILE__, __LINE__, "%s", err.msg);
    double rel[3] = {0, 0, 0};
    for (int k = 0; k < 3; k++) {
        convert_opts o = {0};
        o.quant = k == 0 ? CVQ_Q4 : CVQ_Q4X;
        for (int c = 0; c < CV_CLASS_COUNT; c++) o.cls[c] = o.quant; /* every class int4: the format alone */
        o.cls[CV_MTP] = CVQ_Q8;
        o.calib = k == 2 ? cs : NULL;
        const char *out = tmpf(k == 0 ? "t-q4.pack" : k == 1 ? "t-q4x.pack" : "t-q4xc.pack");
        convert_result res;
        if (convert_hf(test_data("trained"), out, &o, &res, &err)) { test_fail(__FILE__, __LINE__, "convert: %s", err.msg); continue; }
        float *lg = logits_of(out, ids, T);
        if (lg && ref) rel[k] = test_rel_l2(lg, ref, (size_t)T * 4096);
        free(lg);
    }
    CHECK_MSG(rel[0] > 0 && rel[0] < 0.5 && rel[1] < 0.5 && rel[2] < 0.5, "rel L2 vs f32: q4 %.4f q4x %.4f q4x+calib %.4f", rel[0], rel[1], rel[2]);
    CHECK_MSG(rel[1] < rel[0] && rel[2] < rel[1], "rel L2 vs f32: q4 %.4f q4x %.4f q4x+calib %.4f", rel[0], rel[1], rel[2]);
    calib_free(cs);
    free(ref);
    st_close(gold);
}

/* Bad calibration input: one clear line and a non-zero status (library and CLI). */
TEST(q4x, calib_bad_input) {
    calib_stats *s = NULL;
    petrel_error err = {0};
    CHECK(calib_run(test_data("trained"), tmpf("no-such-calib.txt"), NULL, &s, NULL, &err) < 0 && !s);
    CHECK(strstr(err.msg, "no-such-calib.txt") && !strchr(err.msg, '\n'));
    const char *empty = tmpf("empty-calib.txt");
    FILE *f = fopen(empty, "w");
    if (f) fclose(f);
    CHECK(calib_run(test_data("trained"), empty, NULL, &s, NULL, &err) == PETREL_EINVAL && !s);
    CHECK(strstr(err.msg, "empty") != NULL);
    const char *bin = getenv("PETREL_BIN");
    if (!bin) return;
    char cmd[2048], out[4096], e2[4096];
    snprintf(cmd, sizeof cmd, "%s convert --in %s --out %s --quant q4x --calib %s --quiet", bin, test_data("trained"), tmpf("bad.pack"), tmpf("no-such-calib.txt"));
    CHECK(test_sh(cmd, out, sizeof out, e2, sizeof e2) != 0);
    CHECK_EQ_INT(test_count_lines(e2), 1);
    CHECK(strstr(e2, "no-such-calib.txt") != NULL);
    snprintf(cmd, sizeof cmd, "%s convert --in %s --out %s --quant q4x --calib %s --quiet", bin, test_data("trained"), tmpf("bad.pack"), empty);
    CHECK(test_sh(cmd, out, sizeof out, e2, sizeof e2) != 0);
    CHECK_EQ_INT(test_count_lines(e2), 1);
    CHECK(strstr(e2, "empty") != NULL);
    snprintf(cmd, sizeof cmd, "%s convert --in %s --out %s --quant q4 --calib %s --quiet", bin, test_data("trained"), tmpf("bad.pack"), calib_text());
    CHECK(test_sh(cmd, out, sizeof out, e2, sizeof e2) != 0);
    CHECK_EQ_INT(test_count_lines(e2), 1);
    CHECK(strstr(e2, "q4x") != NULL);
}

/* The 4-lane group loops give bitwise the bytes of their scalar reference. */
TEST(q4x, vector_equals_scalar) {
    seed();
    static const int64_t cols[] = {1, 33, 64, 160, 1000};
    static const int dts[] = {PT_BF16, PT_F16, PT_F32};
    for (int kind = 0; kind < 3; kind++)
        for (int ci = 0; ci < 5; ci++)
            for (int di = 0; di < 3; di++)
                for (int weighted = 0; weighted < 2; weighted++) {
                    int64_t n = cols[ci];
                    float w[1000], imp[1000], s[2][64];
                    uint8_t b[2][500];
                    for (int64_t j = 0; j < n; j++) {
                        w[j] = sample(kind) * 0.05f;
                        imp[j] = (float)(u01() * 3);
                    }
                    pt_q4x_ctx ctx = {n, imp, NULL, NULL};
                    for (int k = 0; k < 2; k++) {
                        pt_q4x_force_scalar(k);
                        CHECK(pt_quant_row_q4x(w, n, weighted ? &ctx : NULL, b[k], s[k], dts[di]) == 0);
                    }
                    pt_q4x_force_scalar(0);
                    CHECK_MSG(!memcmp(b[0], b[1], (size_t)(n + 1) / 2) && !memcmp(s[0], s[1], (size_t)((n + 63) / 64) * pt_scale_dtype_bytes(dts[di])),
                              "kind %d cols %lld dtype %d weighted %d (seed %llu)", kind, (long long)n, dts[di], weighted, (unsigned long long)rs);
                }
}
