/* test_cuda.c: the CUDA backend (src/cuda) against its slower twins: every product form and
 * weight format against the scalar reference, the GPU top-k against op_topk (ties, NaN, -0),
 * every fixture's logits against the Hugging Face reference and against the CPU engine (f32:
 * within 1e-5), greedy continuations, a batch of sessions at different positions against each
 * session alone, a q4 pack's quality against the CPU's. Tests that need a GPU skip (counted)
 * where none is visible or the binary has no CUDA (build/petrel-tests; make cuda builds
 * build/petrel-tests-cuda). The refusals run everywhere. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cu.h"
#include "io/convert.h"
#include "io/safetensors.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/ops.h"
#include "quant/quant.h"
#include "test.h"

static int need_gpu(void) {
    if (!cu_built()) { test_skip("built without CUDA (make cuda: build/petrel-tests-cuda)"); return 0; }
    if (cu_device_count() <= 0) { test_skip("no CUDA GPU visible"); return 0; }
    return 1;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* a random [rows][cols] weight in format q (scales f32 or bf16) */
static pt_wview rand_weight(pt_qtype q, int64_t rows, int64_t cols, int sdt, uint8_t **data, void **scales) {
    pt_wview W;
    memset(&W, 0, sizeof W);
    int64_t rb = pt_qtype_row_bytes(q, cols), spr = pt_qtype_scales_per_row(q, cols);
    *data = malloc((size_t)(rows * rb));
    *scales = spr ? malloc((size_t)(rows * spr * pt_scale_dtype_bytes(sdt))) : NULL;
    float *w = malloc(sizeof(float) * (size_t)cols);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) w[c] = frand();
        pt_quant_row(q, w, cols, *data + r * rb, spr ? (uint8_t *)*scales + r * spr * pt_scale_dtype_bytes(sdt) : NULL, sdt);
    }
    free(w);
    W.qtype = q, W.rows = rows, W.cols = cols, W.data = *data, W.row_bytes = rb, W.scale = *scales, W.scale_dtype = sdt;
    W.block_cols = (int)pt_qtype_group(q, cols), W.scale_cols = spr;
    return W;
}

TEST(cuda, matmul_formats) {
    if (!need_gpu()) return;
    const pt_qtype fmts[] = {PT_F32, PT_BF16, PT_F16, PT_Q8_ROW, PT_Q8_G32, PT_Q4_G64};
    const int64_t shapes[][2] = {{64, 256}, {37, 96}, {130, 1000}, {16, 100}, {257, 64}, {9000, 64}, {4100, 72}}; /* the last two: 2 and 4 rows a warp */
    const int ns[] = {1, 2, 3, 8, 9, 70};
    petrel_error err = {0};
    for (size_t f = 0; f < sizeof fmts / sizeof fmts[0]; f++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            uint8_t *d;
            void *sc;
            int sdt = s % 2 ? PT_BF16 : PT_F32;
            pt_wview W = rand_weight(fmts[f], shapes[s][0], shapes[s][1], sdt, &d, &sc);
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                float *x = malloc(sizeof(float) * n * W.cols), *ref = malloc(sizeof(float) * n * W.rows), *y = malloc(sizeof(float) * n * W.rows);
                for (int64_t i = 0; i < n * W.cols; i++) x[i] = frand();
                kn_ref_matmul(&W, x, n, ref);
                for (int path = 1; path <= 3; path++) { /* 3: tensor cores (bf16 operands where the format takes them) */
                    int rc = cu_matmul_check(&W, x, n, y, path, &err);
                    CHECK_MSG(rc == 0, "cu_matmul_check: %s", err.msg);
                    double e = rc ? 1 : test_rel_l2(y, ref, (size_t)n * W.rows);
                    int bf = path == 3 && (W.qtype == PT_Q4_G64 || W.qtype == PT_Q8_G32 || W.qtype == PT_Q8_ROW) && W.cols % 8 == 0;
                    CHECK_MSG(e < (bf ? 1e-2 : 2e-6), "%s [%lld x %lld] n=%d %s: rel err %.3g", pt_qtype_name(W.qtype), (long long)W.rows,
                              (long long)W.cols, n, path == 1 ? "gemv" : path == 2 ? "gemm" : "gemm (tensor cores)", e);
                    if (bf) CHECK_MSG(e > 0, "%s: the tensor-core form gave the exact bits: did it run?", pt_qtype_name(W.qtype));
                }
                /* a row's result does not depend on the other rows of its form */
                if (n > 1) {
                    float *y1 = malloc(sizeof(float) * W.rows);
                    CHECK(cu_matmul_check(&W, x + (n - 1) * W.cols, 1, y1, 2, &err) == 0);
                    CHECK(cu_matmul_check(&W, x, n, y, 2, &err) == 0);
                    CHECK_MSG(!memcmp(y1, y + (n - 1) * W.rows, sizeof(float) * W.rows), "%s n=%d: gemm row depends on its batch", pt_qtype_name(W.qtype), n);
                    free(y1);
                }
                free(x), free(ref), free(y);
            }
            /* the row-interleaved layout (packs' experts for the CPU's VNNI kernels): read as the
             * plain one, to the bit */
            if (kn_r16_supported(&W)) {
                int n = 3;
                float *x = malloc(sizeof(float) * n * W.cols), *y0 = malloc(sizeof(float) * n * W.rows), *y1 = malloc(sizeof(float) * n * W.rows);
                for (int64_t i = 0; i < n * W.cols; i++) x[i] = frand();
                CHECK(cu_matmul_check(&W, x, n, y0, 1, &err) == 0);
                CHECK(kn_r16_repack(&W) == 0 && W.layout == PT_LAYOUT_R16);
                CHECK_MSG(cu_matmul_check(&W, x, n, y1, 1, &err) == 0, "r16: %s", err.msg);
                CHECK_MSG(!memcmp(y0, y1, sizeof(float) * n * W.rows), "%s [%lld x %lld]: r16 layout differs from plain", pt_qtype_name(W.qtype),
                          (long long)W.rows, (long long)W.cols);
                free(x), free(y0), free(y1);
            }
            free(d), free(sc);
        }
}

/* cu_matmul_check's int8 path `path` (4 the GEMV, 6 the GEMM) on n rows of x into y against the
 * CPU's int8-activation reference (kn_ref_matmul_actq: the same int8 values and scales, the
 * float sums in another order): 1e-5; and the last row alone the bits of that row in the call.
 * 0 where the path refused W (PETREL_EUNSUPPORTED), else 1. */
static int int8_path_matches(const pt_wview *W, const float *x, int n, int path, const char *what, float *y) {
    petrel_error err = {0};
    int rc = cu_matmul_check(W, x, n, y, path, &err);
    if (rc == PETREL_EUNSUPPORTED) return 0;
    CHECK_MSG(rc == 0, "cu_matmul_check int8 %s: %s", what, err.msg);
    float *ref = malloc(sizeof(float) * n * W->rows), *y1 = malloc(sizeof(float) * W->rows);
    kn_ref_matmul_actq(W, x, n, ref);
    double e = rc ? 1 : test_rel_l2(y, ref, (size_t)n * W->rows);
    CHECK_MSG(e < 1e-5, "%s [%lld x %lld] n=%d: int8 %s vs the CPU's int8 reference rel err %.3g", pt_qtype_name(W->qtype), (long long)W->rows,
              (long long)W->cols, n, what, e);
    CHECK(cu_matmul_check(W, x + (n - 1) * W->cols, 1, y1, path, &err) == 0);
    CHECK_MSG(!memcmp(y1, y + (n - 1) * W->rows, sizeof(float) * W->rows), "%s n=%d: int8 %s row depends on its call", pt_qtype_name(W->qtype), n, what);
    free(ref), free(y1);
    return 1;
}

/* an inf in x row 1 (of n >= 3): path's row 1 all NaN and rows 0 and 2 finite (the CPU's rule) */
static void inf_row_nan(const pt_wview *W, float *x, int n, int path, const char *what, float *y) {
    petrel_error err = {0};
    x[W->cols + 5] = INFINITY;
    CHECK(cu_matmul_check(W, x, n, y, path, &err) == 0);
    int nan1 = 1, fin = 1;
    for (int64_t r = 0; r < W->rows; r++) nan1 &= y[W->rows + r] != y[W->rows + r], fin &= y[r] == y[r] && y[2 * W->rows + r] == y[2 * W->rows + r];
    CHECK_MSG(nan1 && fin, "%s: an inf activation must make its int8 %s row NaN and only it", pt_qtype_name(W->qtype), what);
}

/* the quantized path's GEMV (int8 x, dp4a) against the CPU's int8-activation reference
 * (kn_ref_matmul_actq: the same int8 values and scales, the float sums in another order), a
 * row alone equal to the bits of the row in a call of n, the slot form on remapped rows, a
 * group with inf giving NaN rows, and the formats it does not take refused */
TEST(cuda, gemv_int8_activations) {
    if (!need_gpu()) return;
    const pt_qtype fmts[] = {PT_Q8_G32, PT_Q4_G64};
    const int64_t shapes[][2] = {{64, 256}, {130, 1024}, {257, 64}, {9000, 128}, {2048, 6144}, {37, 96}};
    const int ns[] = {1, 2, 3, 8, 9};
    petrel_error err = {0};
    for (size_t f = 0; f < 2; f++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            uint8_t *d;
            void *sc;
            pt_wview W = rand_weight(fmts[f], shapes[s][0], shapes[s][1], s % 2 ? PT_BF16 : PT_F32, &d, &sc);
            int takes = W.cols % (fmts[f] == PT_Q4_G64 ? 64 : 32) == 0;
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                float *x = malloc(sizeof(float) * n * W.cols), *xr = malloc(sizeof(float) * n * W.cols);
                float *ref = malloc(sizeof(float) * n * W.rows), *y = malloc(sizeof(float) * n * W.rows);
                for (int64_t i = 0; i < n * W.cols; i++) x[i] = frand() * (i % 7 == 0 ? 9.f : 1.f);
                int took = int8_path_matches(&W, x, n, 4, "GEMV", y);
                CHECK_MSG(took == takes, "%s [%lld x %lld]: the int8 GEMV %s", pt_qtype_name(W.qtype), (long long)W.rows, (long long)W.cols,
                          takes ? "refused whole groups" : "took a partial group");
                if (!took) {
                    free(x), free(xr), free(ref), free(y);
                    break;
                }
                /* slots: y[i] = W x[n-1-i] */
                for (int i = 0; i < n; i++) memcpy(xr + (int64_t)i * W.cols, x + (int64_t)(n - 1 - i) * W.cols, sizeof(float) * W.cols);
                kn_ref_matmul_actq(&W, xr, n, ref);
                CHECK_MSG(cu_matmul_check(&W, x, n, y, 5, &err) == 0, "slots: %s", err.msg);
                double e = test_rel_l2(y, ref, (size_t)n * W.rows);
                CHECK_MSG(e < 1e-5, "%s [%lld x %lld] n=%d: int8 GEMV slots rel err %.3g", pt_qtype_name(W.qtype), (long long)W.rows,
                          (long long)W.cols, n, e);
                if (n == 3) inf_row_nan(&W, x, n, 4, "GEMV", y);
                free(x), free(xr), free(ref), free(y);
            }
            free(d), free(sc);
        }
    /* a format the int8 GEMV does not take */
    uint8_t *d;
    void *sc;
    pt_wview W = rand_weight(PT_Q8_ROW, 64, 256, PT_F32, &d, &sc);
    float x[256] = {0}, y[64];
    CHECK_EQ_INT(cu_matmul_check(&W, x, 1, y, 4, &err), PETREL_EUNSUPPORTED);
    free(d), free(sc);
}

/* the quantized path's GEMM on int8 tensor cores (prefill and batched rows past 8) against
 * the CPU's int8 reference: 1e-5; a row alone bitwise as in a call of n; an inf activation
 * makes its row NaN; widths not whole 64 columns refused */
TEST(cuda, gemm_int8_tensor_cores) {
    if (!need_gpu()) return;
    const pt_qtype fmts[] = {PT_Q8_G32, PT_Q4_G64};
    const int64_t shapes[][2] = {{64, 256}, {130, 1024}, {257, 64}, {2048, 6144}, {37, 96}};
    const int ns[] = {9, 64, 100};
    petrel_error err = {0};
    for (size_t f = 0; f < 2; f++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            uint8_t *d;
            void *sc;
            pt_wview W = rand_weight(fmts[f], shapes[s][0], shapes[s][1], s % 2 ? PT_BF16 : PT_F32, &d, &sc);
            int takes = W.cols % 64 == 0;
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                float *x = malloc(sizeof(float) * n * W.cols), *y = malloc(sizeof(float) * n * W.rows);
                for (int64_t i = 0; i < n * W.cols; i++) x[i] = frand() * (i % 7 == 0 ? 9.f : 1.f);
                int took = int8_path_matches(&W, x, n, 6, "GEMM", y);
                CHECK_MSG(took == takes, "%s [%lld x %lld]: the int8 GEMM %s", pt_qtype_name(W.qtype), (long long)W.rows, (long long)W.cols,
                          takes ? "refused whole 64 columns" : "took a partial 64 columns");
                if (!took) {
                    free(x), free(y);
                    break;
                }
                float *yt = malloc(sizeof(float) * n * W.rows);
                CHECK(cu_matmul_check(&W, x, n, yt, 7, &err) == 0);
                CHECK_MSG(!memcmp(yt, y, sizeof(float) * n * W.rows), "%s n=%d: the int8 GEMM over a row list (64-row tiles) differs from plain rows",
                          pt_qtype_name(W.qtype), n);
                free(yt);
                if (k == 0) inf_row_nan(&W, x, n, 6, "GEMM", y);
                free(x), free(y);
            }
            free(d), free(sc);
        }
}

/* bf16 of f, round to nearest even (finite values) */
static double bf16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
/* the bf16 GEMMs' operands exactly: y = sum of bf16(x) bf16(v bf16(s)), in double, with v the
 * stored value (q4: nibble - 8, q8: the int8) and s its group's scale */
static void ref_gemm_bf16(const pt_wview *W, const float *x, int n, float *y) {
    double *w = malloc(sizeof(double) * (size_t)W->cols), *xb = malloc(sizeof(double) * (size_t)(n * W->cols));
    for (int64_t i = 0; i < n * W->cols; i++) xb[i] = bf16_rn(x[i]);
    for (int64_t r = 0; r < W->rows; r++) {
        const uint8_t *q = W->data + r * W->row_bytes;
        for (int64_t c = 0; c < W->cols; c++) {
            int64_t si = r * W->scale_cols + c / W->block_cols;
            float s;
            if (W->scale_dtype == PT_F32) memcpy(&s, (const uint8_t *)W->scale + 4 * si, 4);
            else {
                uint16_t h;
                memcpy(&h, (const uint8_t *)W->scale + 2 * si, 2);
                uint32_t u = (uint32_t)h << 16;
                memcpy(&s, &u, 4);
            }
            int v = W->qtype == PT_Q4_G64 ? (c & 1 ? q[c >> 1] >> 4 : q[c >> 1] & 15) - 8 : (int8_t)q[c];
            w[c] = bf16_rn((float)(v * bf16_rn(s)));
        }
        for (int i = 0; i < n; i++) {
            double acc = 0;
            for (int64_t c = 0; c < W->cols; c++) acc += xb[(int64_t)i * W->cols + c] * w[c];
            y[(int64_t)i * W->rows + r] = (float)acc;
        }
    }
    free(w), free(xb);
}

/* the prompts' GEMMs on bf16 tensor cores (weights unpacked to bf16 with their scales): q4 (the
 * routed experts) on mma.sync and on warpgroup MMA, q8 (`bench --cuda-dense wgmma`) on warpgroup
 * MMA; each against a double sum over the same bf16 operands: 3e-5; over a row list (128-row
 * tiles, one and two a call) bitwise equal to plain rows; a row alone as in a call of n; the two
 * q4 forms within 3e-5 of each other; the formats and widths a form does not take refused */
TEST(cuda, gemm_bf16) {
    if (!need_gpu()) return;
    const pt_qtype fmts[] = {PT_Q4_G64, PT_Q8_G32};
    const int64_t shapes[][2] = {{64, 256}, {130, 1024}, {257, 64}, {2048, 6144}, {37, 96}, {200, 512}};
    const int ns[] = {9, 40, 75, 90, 100, 200}; /* the wgmma form's tile widths 32, 64, 80, 96, 128 (200: 128 + 72) */
    static const char *const form[3] = {"mma.sync q4", "wgmma q4", "wgmma q8"};
    petrel_error err = {0};
    for (size_t f = 0; f < 2; f++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            uint8_t *d;
            void *sc;
            pt_wview W = rand_weight(fmts[f], shapes[s][0], shapes[s][1], s % 2 ? PT_BF16 : PT_F32, &d, &sc);
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                if (W.cols >= 4096 && n > 100) break; /* the double reference's time */
                float *x = malloc(sizeof(float) * n * W.cols), *ref = malloc(sizeof(float) * n * W.rows), *y1 = malloc(sizeof(float) * W.rows);
                float *y[3] = {malloc(sizeof(float) * n * W.rows), malloc(sizeof(float) * n * W.rows), malloc(sizeof(float) * n * W.rows)};
                float *yl = malloc(sizeof(float) * n * W.rows);
                for (int64_t i = 0; i < n * W.cols; i++) x[i] = frand() * (i % 7 == 0 ? 9.f : 1.f);
                int ok[3] = {0, 0, 0}, have_ref = 0;
                for (int v = 0; v < 3; v++) {
                    int takes = (v < 2 ? W.qtype == PT_Q4_G64 : W.qtype == PT_Q8_G32) && W.cols % 64 == 0;
                    int rc = cu_matmul_check(&W, x, n, y[v], 8 + 2 * v, &err);
                    CHECK_MSG(takes ? rc == 0 : rc == PETREL_EUNSUPPORTED, "%s [%lld x %lld]: the bf16 GEMM (%s) %s (%s)", pt_qtype_name(W.qtype),
                              (long long)W.rows, (long long)W.cols, form[v], takes ? "refused" : "took it", err.msg);
                    if (!(ok[v] = rc == 0)) continue;
                    if (!have_ref) ref_gemm_bf16(&W, x, n, ref), have_ref = 1;
                    double e = test_rel_l2(y[v], ref, (size_t)n * W.rows);
                    CHECK_MSG(e < 3e-5, "%s [%lld x %lld] n=%d: bf16 GEMM (%s) vs the double sum of its operands rel err %.3g", pt_qtype_name(W.qtype),
                              (long long)W.rows, (long long)W.cols, n, form[v], e);
                    if (getenv("PETREL_TEST_VERBOSE"))
                        fprintf(stderr, "  bf16 GEMM (%s) [%lld x %lld] n=%d rel err %.3g\n", form[v], (long long)W.rows, (long long)W.cols, n, e);
                    CHECK(cu_matmul_check(&W, x, n, yl, 9 + 2 * v, &err) == 0);
                    CHECK_MSG(!memcmp(yl, y[v], sizeof(float) * n * W.rows), "n=%d: the bf16 GEMM (%s) over a row list differs from plain rows", n,
                              form[v]);
                    CHECK(cu_matmul_check(&W, x + (int64_t)(n - 1) * W.cols, 1, y1, 8 + 2 * v, &err) == 0);
                    CHECK_MSG(!memcmp(y1, y[v] + (int64_t)(n - 1) * W.rows, sizeof(float) * W.rows), "n=%d: a bf16 GEMM (%s) row depends on its call", n,
                              form[v]);
                }
                if (ok[0] && ok[1]) {
                    double e = test_rel_l2(y[1], y[0], (size_t)n * W.rows);
                    CHECK_MSG(e < 3e-5, "%s [%lld x %lld] n=%d: the wgmma and mma.sync forms differ by %.3g", pt_qtype_name(W.qtype), (long long)W.rows,
                              (long long)W.cols, n, e);
                }
                free(x), free(y[0]), free(y[1]), free(y[2]), free(yl), free(ref), free(y1);
                if (!ok[0] && !ok[1] && !ok[2]) break; /* no form takes it: the refusals were checked */
            }
            free(d), free(sc);
        }
}

/* a GEMM form (cu_matmul_check's path) against the twin it stands in for (twin): bitwise over
 * n random x rows of W; alone: also a row alone as in the call */
static void check_twin(const pt_wview *W, int n, int path, int twin, int alone, const char *what) {
    petrel_error err = {0};
    float *x = malloc(sizeof(float) * n * W->cols), *yt = malloc(sizeof(float) * n * W->rows), *yw = malloc(sizeof(float) * n * W->rows);
    float *y1 = malloc(sizeof(float) * W->rows);
    for (int64_t i = 0; i < n * W->cols; i++) x[i] = frand() * (i % 7 == 0 ? 9.f : 1.f);
    int rc = cu_matmul_check(W, x, n, yt, path, &err);
    CHECK_MSG(rc == 0, "%s [%lld x %lld] n=%d: %s failed (%s)", pt_qtype_name(W->qtype), (long long)W->rows, (long long)W->cols, n, what, err.msg);
    CHECK(cu_matmul_check(W, x, n, yw, twin, &err) == 0);
    if (rc == 0) {
        size_t diff = 0;
        for (int64_t i = 0; i < n * W->rows; i++) diff += memcmp(&yt[i], &yw[i], 4) != 0;
        CHECK_MSG(!diff, "%s [%lld x %lld] n=%d: %s differs from its twin in %zu of %lld values (rel err %.3g)", pt_qtype_name(W->qtype), (long long)W->rows,
                  (long long)W->cols, n, what, diff, (long long)(n * W->rows), test_rel_l2(yt, yw, (size_t)n * W->rows));
        if (alone) {
            CHECK(cu_matmul_check(W, x + (int64_t)(n - 1) * W->cols, 1, y1, path, &err) == 0);
            CHECK_MSG(!memcmp(y1, yt + (int64_t)(n - 1) * W->rows, sizeof(float) * W->rows), "%s [%lld x %lld] n=%d: a row of %s depends on its call",
                      pt_qtype_name(W->qtype), (long long)W->rows, (long long)W->cols, n, what);
        }
        if (getenv("PETREL_TEST_VERBOSE"))
            fprintf(stderr, "  %s [%lld x %lld] n=%d: %zu values differ from its twin\n", what, (long long)W->rows, (long long)W->cols, n, diff);
    }
    free(x), free(yt), free(yw), free(y1);
}
/* a format and width a form does not take: refused */
static void check_refused(pt_qtype qt, int64_t cols, int path, const char *what) {
    petrel_error err = {0};
    uint8_t *d;
    void *sc;
    pt_wview W = rand_weight(qt, 64, cols, PT_F32, &d, &sc);
    float *x = calloc((size_t)(2 * cols), sizeof(float)), y[64 * 2];
    CHECK_MSG(cu_matmul_check(&W, x, 2, y, path, &err) == PETREL_EUNSUPPORTED, "%s took %s [64 x %lld]", what, pt_qtype_name(qt), (long long)cols);
    free(x), free(d), free(sc);
}

/* the q8 products' TMA GEMM (weights unpacked once into bf16, both operands loaded by TMA):
 * bitwise equal to the wgmma form it stands in for (the same operands and slices in the same
 * order), over partial tiles of x rows (128 a block) and of weight rows (256), one step of 64
 * columns and many; a row alone as in a call of n; q4 refused */
TEST(cuda, gemm_tma) {
    if (!need_gpu()) return;
    const int64_t shapes[][2] = {{64, 256}, {300, 1024}, {257, 64}, {2048, 6144}, {512, 128}, {37, 512}};
    const int ns[] = {9, 130, 300, 600};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        uint8_t *d;
        void *sc;
        pt_wview W = rand_weight(PT_Q8_G32, shapes[s][0], shapes[s][1], s % 2 ? PT_BF16 : PT_F32, &d, &sc);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            check_twin(&W, ns[k], 14, 12, 1, "the TMA GEMM");
            if (W.cols >= 4096 && ns[k] >= 300) break; /* the time */
        }
        free(d), free(sc);
    }
    check_refused(PT_Q4_G64, 256, 14, "the TMA GEMM");
}

/* the routed experts' GEMM with its loads on the TMA unit: bitwise equal to the wgmma form
 * (the same fragments and order), plain rows and over a row list with x gathered by it (rows
 * uploaded in reverse, gathered back through a second map), at
 * every tile width (32, 64, 80, 96, 128 x rows; 200: 128 + 72) and partial blocks of weight
 * rows; q8 and widths its scales' boxes do not take refused */
TEST(cuda, gemm_w4t) {
    if (!need_gpu()) return;
    const int64_t shapes[][2] = {{64, 256}, {300, 1024}, {257, 512}, {2048, 6144}, {37, 768}};
    const int ns[] = {9, 40, 75, 90, 100, 200};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        uint8_t *d;
        void *sc;
        pt_wview W = rand_weight(PT_Q4_G64, shapes[s][0], shapes[s][1], s % 2 ? PT_BF16 : PT_F32, &d, &sc);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            check_twin(&W, ns[k], 15, 10, 0, "the TMA-loaded GEMM");
            check_twin(&W, ns[k], 16, 11, 0, "the TMA-loaded GEMM over a row list");
            if (W.cols >= 4096 && ns[k] >= 90) break; /* the time */
        }
        free(d), free(sc);
    }
    check_refused(PT_Q8_G32, 256, 15, "the TMA-loaded GEMM");
    check_refused(PT_Q4_G64, 64, 15, "the TMA-loaded GEMM");
}

/* the fused SwiGLU form of the int8 GEMV (gate and up rows of one warp, silu(g) * u written)
 * against the CPU's int8 reference of each product, plain rows and slots */
TEST(cuda, swiglu_int8_activations) {
    if (!need_gpu()) return;
    const pt_qtype fmts[] = {PT_Q8_G32, PT_Q4_G64};
    const int64_t shapes[][2] = {{64, 256}, {2048, 6144}, {257, 128}};
    petrel_error err = {0};
    for (size_t f = 0; f < 2; f++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int slots = 0; slots <= 1; slots++) {
                uint8_t *dg, *du;
                void *sg, *su;
                pt_wview G = rand_weight(fmts[f], shapes[s][0], shapes[s][1], PT_F32, &dg, &sg);
                pt_wview U = rand_weight(fmts[f], shapes[s][0], shapes[s][1], PT_BF16, &du, &su);
                int n = slots ? 9 : 3;
                float *x = malloc(sizeof(float) * n * G.cols), *xr = malloc(sizeof(float) * n * G.cols);
                float *g = malloc(sizeof(float) * n * G.rows), *u = malloc(sizeof(float) * n * G.rows), *y = malloc(sizeof(float) * n * G.rows);
                for (int64_t i = 0; i < n * G.cols; i++) x[i] = frand();
                for (int i = 0; i < n; i++) memcpy(xr + (int64_t)i * G.cols, x + (int64_t)(slots ? n - 1 - i : i) * G.cols, sizeof(float) * G.cols);
                kn_ref_matmul_actq(&G, xr, n, g);
                kn_ref_matmul_actq(&U, xr, n, u);
                for (int64_t i = 0; i < n * G.rows; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
                int rc = cu_swiglu_check(&G, &U, x, n, y, slots, &err);
                CHECK_MSG(rc == 0, "cu_swiglu_check: %s", err.msg);
                double e = rc ? 1 : test_rel_l2(y, g, (size_t)n * G.rows);
                CHECK_MSG(e < 1e-5, "%s [%lld x %lld] %s: int8 SwiGLU vs the CPU's int8 products rel err %.3g", pt_qtype_name(G.qtype),
                          (long long)G.rows, (long long)G.cols, slots ? "slots" : "rows", e);
                free(x), free(xr), free(g), free(u), free(y), free(dg), free(sg), free(du), free(su);
            }
}

/* the decode form's q~ = W_UK[h]^T q_nope[h], read from a q8_g32 kv_b as it is (no f32 copy),
 * against a double sum over kv_b's dequantized rows: 1e-5 */
TEST(cuda, uk_from_kv_b) {
    if (!need_gpu()) return;
    const int shapes[][6] = {{4, 32, 8, 24, 96, 3}, {64, 128, 64, 128, 512, 1}, {64, 128, 64, 128, 512, 8}, {3, 40, 16, 8, 288, 2}};
    petrel_error err = {0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int NH = shapes[k][0], Dn = shapes[k][1], Dr = shapes[k][2], Dv = shapes[k][3], Rkv = shapes[k][4], T = shapes[k][5];
        uint8_t *d;
        void *sc;
        pt_wview W = rand_weight(PT_Q8_G32, (int64_t)NH * (Dn + Dv), Rkv, k & 1 ? PT_BF16 : PT_F32, &d, &sc);
        float *q = malloc(sizeof(float) * (size_t)T * NH * (Dn + Dr)), *y = malloc(sizeof(float) * (size_t)T * NH * Rkv);
        float *ref = malloc(sizeof(float) * (size_t)T * NH * Rkv), *w = malloc(sizeof(float) * (size_t)NH * (Dn + Dv) * Rkv);
        for (size_t i = 0; i < (size_t)T * NH * (Dn + Dr); i++) q[i] = frand();
        for (int64_t r = 0; r < W.rows; r++) pt_dequant_row(&W, r, w + r * Rkv);
        for (int r = 0; r < T; r++)
            for (int h = 0; h < NH; h++)
                for (int j = 0; j < Rkv; j++) {
                    double a = 0;
                    for (int i = 0; i < Dn; i++) a += (double)w[((size_t)h * (Dn + Dv) + i) * Rkv + j] * q[((size_t)r * NH + h) * (Dn + Dr) + i];
                    ref[((size_t)r * NH + h) * Rkv + j] = (float)a;
                }
        int rc = cu_head_check(&W, q, T, NH, Dn, Dr, Dv, 0, 1, y, &err);
        CHECK_MSG(rc == 0, "cu_head_check: %s", err.msg);
        double e = rc ? 1 : test_rel_l2(y, ref, (size_t)T * NH * Rkv);
        CHECK_MSG(e < 1e-5, "W_UK from kv_b (%d heads, Dn %d, Rkv %d, %d rows): rel err %.3g", NH, Dn, Rkv, T, e);
        free(q), free(y), free(ref), free(w), free(d), free(sc);
    }
}

/* a prompt's head products (past 8 rows: the tiled GEMM a head), W_UK^T q_nope and W_UV lat, on
 * tensor cores and by f32 fma, each against a double sum over kv_b's dequantized rows: 1e-5 */
TEST(cuda, head_products) {
    if (!need_gpu()) return;
    const int shapes[][6] = {{4, 32, 8, 24, 96, 9}, {64, 128, 64, 128, 512, 70}, {3, 40, 16, 8, 288, 150}, {2, 24, 8, 200, 96, 33}};
    const pt_qtype fmts[] = {PT_Q8_G32, PT_F32, PT_BF16};
    petrel_error err = {0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
        for (int uv = 0; uv < 2; uv++) {
            int NH = shapes[k][0], Dn = shapes[k][1], Dr = shapes[k][2], Dv = shapes[k][3], Rkv = shapes[k][4], T = shapes[k][5];
            uint8_t *d;
            void *sc;
            pt_wview W = rand_weight(fmts[(k + uv) % 3], (int64_t)NH * (Dn + Dv), Rkv, PT_F32, &d, &sc);
            const int xw = uv ? Rkv : Dn + Dr, yw = uv ? Dv : Rkv;
            float *x = malloc(sizeof(float) * (size_t)T * NH * xw), *y = malloc(sizeof(float) * (size_t)T * NH * yw);
            float *ref = malloc(sizeof(float) * (size_t)T * NH * yw), *w = malloc(sizeof(float) * (size_t)NH * (Dn + Dv) * Rkv);
            for (size_t i = 0; i < (size_t)T * NH * xw; i++) x[i] = frand();
            for (int64_t r = 0; r < W.rows; r++) pt_dequant_row(&W, r, w + r * Rkv);
            for (int r = 0; r < T; r++)
                for (int h = 0; h < NH; h++)
                    for (int j = 0; j < yw; j++) {
                        double a = 0;
                        const float *xr = x + ((size_t)r * NH + h) * xw;
                        if (uv)
                            for (int i = 0; i < Rkv; i++) a += (double)w[((size_t)h * (Dn + Dv) + Dn + j) * Rkv + i] * xr[i];
                        else
                            for (int i = 0; i < Dn; i++) a += (double)w[((size_t)h * (Dn + Dv) + i) * Rkv + j] * xr[i];
                        ref[((size_t)r * NH + h) * yw + j] = (float)a;
                    }
            for (int tc = 0; tc < 2; tc++) {
                int rc = cu_head_check(&W, x, T, NH, Dn, Dr, Dv, uv, tc, y, &err);
                CHECK_MSG(rc == 0, "cu_head_check: %s", err.msg);
                double e = rc ? 1 : test_rel_l2(y, ref, (size_t)T * NH * yw);
                CHECK_MSG(e < 1e-5, "%s %s (%s kv_b, %d heads, Dn %d, Dv %d, Rkv %d, %d rows): rel err %.3g", uv ? "W_UV" : "W_UK",
                          tc ? "tensor cores" : "fma", pt_qtype_name(W.qtype), NH, Dn, Dv, Rkv, T, e);
            }
            free(x), free(y), free(ref), free(w), free(d), free(sc);
        }
}

/* the attention core against a double reference: the one-pass form and the three-kernel form */
TEST(cuda, attention_forms) {
    if (!need_gpu()) return;
    /* T, NH, Dn, Dr, Rkv, cap, then seln of each row */
    const int shapes[][20] = {{1, 64, 128, 64, 512, 2100, 2048},
                              {3, 20, 16, 32, 96, 400, 1, 33, 300},
                              {8, 32, 128, 64, 512, 2100, 2048, 1, 700, 31, 32, 33, 2000, 64},
                              {2, 5, 8, 6, 100, 90, 90, 17},
                              {2, 20, 8, 7, 97, 300, 300, 45}, /* Rkv not whole 16-byte chunks: the flash form's scalar q copies and partial-sum stores */
                              {1, 3, 4, 8, 100, 50, 45},
                              {2, 16, 8, 32, 64, 300, 300, 77},
                              {3, 4, 8, 8, 20, 40, 40, 1, 9},
                              {12, 16, 8, 32, 64, 300, 300, 1, 17, 64, 65, 128, 200, 299, 33, 5, 250, 100},
                              /* rows past 2048 keys: the softmax's block form (a warp a row and head up to 2048) */
                              {9, 4, 8, 8, 32, 2200, 2100, 1, 2049, 2200, 5, 700, 33, 64, 2048}};
    petrel_error err = {0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int *sh = shapes[k];
        int T = sh[0], NH = sh[1], Dn = sh[2], Dr = sh[3], Rkv = sh[4], cap = sh[5], D = Rkv + Dr, ld = cap;
        const int *seln = sh + 6;
        float scale = 0.3f;
        float *q = malloc(sizeof(float) * (size_t)T * NH * (Dn + Dr)), *qt = malloc(sizeof(float) * (size_t)T * NH * Rkv);
        float *kv = malloc(sizeof(float) * (size_t)cap * D), *ref = malloc(sizeof(float) * (size_t)T * NH * Rkv);
        float *y0 = malloc(sizeof(float) * (size_t)T * NH * Rkv), *y1 = malloc(sizeof(float) * (size_t)T * NH * Rkv);
        int32_t *sel = malloc(sizeof(int32_t) * (size_t)T * ld);
        double *p = malloc(sizeof(double) * cap);
        for (size_t i = 0; i < (size_t)T * NH * (Dn + Dr); i++) q[i] = frand();
        for (size_t i = 0; i < (size_t)T * NH * Rkv; i++) qt[i] = frand();
        for (size_t i = 0; i < (size_t)cap * D; i++) kv[i] = frand();
        for (int r = 0; r < T; r++) { /* seln[r] distinct keys ascending: every key, then every other one kept while too many */
            int n = 0;
            for (int i = 0; i < cap && n < seln[r]; i++)
                if (cap - i <= seln[r] - n || ((i * 7 + r) % 3)) sel[(size_t)r * ld + n++] = i;
        }
        for (int r = 0; r < T; r++)
            for (int h = 0; h < NH; h++) {
                const float *a = qt + ((size_t)r * NH + h) * Rkv, *b = q + ((size_t)r * NH + h) * (Dn + Dr) + Dn;
                double mx = -1e300, sum = 0;
                for (int i = 0; i < seln[r]; i++) {
                    const float *key = kv + (size_t)sel[(size_t)r * ld + i] * D;
                    double d = 0;
                    for (int j = 0; j < Rkv; j++) d += (double)a[j] * key[j];
                    for (int j = 0; j < Dr; j++) d += (double)b[j] * key[Rkv + j];
                    p[i] = scale * d;
                    mx = p[i] > mx ? p[i] : mx;
                }
                for (int i = 0; i < seln[r]; i++) sum += (p[i] = exp(p[i] - mx));
                for (int j = 0; j < Rkv; j++) {
                    double o = 0;
                    for (int i = 0; i < seln[r]; i++) o += p[i] * kv[(size_t)sel[(size_t)r * ld + i] * D + j];
                    ref[((size_t)r * NH + h) * Rkv + j] = (float)(o / sum);
                }
            }
        size_t n = (size_t)T * NH * Rkv;
        int rc0 = cu_attn_check(q, qt, kv, cap, sel, ld, seln, T, NH, Dn, Dr, Rkv, scale, 0, y0, &err);
        CHECK_MSG(rc0 == 0, "cu_attn_check: %s", err.msg);
        double e0 = rc0 ? 1 : test_rel_l2(y0, ref, n);
        CHECK_MSG(e0 < 1e-5, "attention, three kernels (%d rows, %d heads, Rkv %d): rel err %.3g", T, NH, Rkv, e0);
        int rc3 = cu_attn_check(q, qt, kv, cap, sel, ld, seln, T, NH, Dn, Dr, Rkv, scale, 3, y1, &err);
        CHECK_MSG(rc3 == 0, "cu_attn_check: %s", err.msg);
        double e3 = rc3 ? 1 : test_rel_l2(y1, ref, n);
        CHECK_MSG(e3 < 1e-5, "attention, three kernels on tensor cores (%d rows, %d heads, Rkv %d): rel err %.3g", T, NH, Rkv, e3);
        for (int form = 1; form <= 2; form++) { /* the one pass on f32 fma, then on tensor cores */
            int rc1 = cu_attn_check(q, qt, kv, cap, sel, ld, seln, T, NH, Dn, Dr, Rkv, scale, form, y1, &err);
            if ((Rkv + Dr) % 4 || T > 8) { /* the one pass takes decode's up to 8 rows of whole 16-byte chunks */
                CHECK_MSG(rc1 == PETREL_EUNSUPPORTED, "one-pass attention form %d took %d rows, Rkv %d + Dr %d: rc %d", form, T, Rkv, Dr, rc1);
                continue;
            }
            CHECK_MSG(rc1 == 0, "cu_attn_check: %s", err.msg);
            double e1 = rc1 ? 1 : test_rel_l2(y1, ref, n);
            CHECK_MSG(e1 < 1e-5, "attention, one pass form %d (%d rows, %d heads, Rkv %d): rel err %.3g", form, T, NH, Rkv, e1);
            if (getenv("PETREL_TEST_VERBOSE"))
                fprintf(stderr, "  attention %d rows %d heads: three kernels %.3g, one pass form %d %.3g\n", T, NH, e0, form, e1);
        }
        free(q), free(qt), free(kv), free(ref), free(y0), free(y1), free(sel), free(p);
    }
}

/* k_nt_wg (A B^T on warpgroup MMA in tf32) against a double sum, odd shapes included; on a
 * mismatch, where it lies (a wrong descriptor shows as rows or columns out of place) */
TEST(cuda, nt_wgmma) {
    if (!need_gpu()) return;
    const int shapes[][3] = {{64, 128, 32}, {64, 128, 8}, {1, 1, 1}, {70, 129, 33}, {100, 300, 200}, {256, 64, 512}};
    petrel_error err = {0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int M = shapes[k][0], N = shapes[k][1], K = shapes[k][2];
        float *A = malloc(sizeof(float) * (size_t)M * K), *B = malloc(sizeof(float) * (size_t)N * K);
        float *D = malloc(sizeof(float) * (size_t)M * N), *ref = malloc(sizeof(float) * (size_t)M * N);
        for (size_t i = 0; i < (size_t)M * K; i++) A[i] = frand();
        for (size_t i = 0; i < (size_t)N * K; i++) B[i] = frand();
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double a = 0;
                for (int j = 0; j < K; j++) a += (double)A[(size_t)m * K + j] * B[(size_t)n * K + j];
                ref[(size_t)m * N + n] = (float)a;
            }
        int rc = cu_nt_check(A, M, B, N, K, D, &err);
        CHECK_MSG(rc == 0, "cu_nt_check: %s", err.msg);
        double e = rc ? 1 : test_rel_l2(D, ref, (size_t)M * N);
        CHECK_MSG(e < 1e-5, "A B^T on wgmma [%d x %d] x [%d x %d]^T: rel err %.3g", M, K, N, K, e);
        if (e >= 1e-5 || getenv("PETREL_TEST_VERBOSE")) {
            int shown = 0;
            fprintf(stderr, "  A B^T on wgmma %d x %d x %d: rel err %.3g\n", M, N, K, e);
            for (int m = 0; m < M && shown < 8 && e >= 1e-5; m++)
                for (int n = 0; n < N && shown < 8; n++) {
                    const float d = D[(size_t)m * N + n], r = ref[(size_t)m * N + n];
                    if (fabsf(d - r) > 1e-4f * (1.f + fabsf(r))) fprintf(stderr, "    D[%d][%d] = %g, want %g\n", m, n, d, r), shown++;
                }
        }
        free(A), free(B), free(D), free(ref);
    }
}

/* the expanded prompt attention (one session's rows over the prefix of their keys) against a
 * double reference of softmax(scale [q_nope W_UK c | q_pe k_pe]) W_UV c, and rows split over two
 * calls bitwise equal to one call */
TEST(cuda, attention_expanded) {
    if (!need_gpu()) return;
    /* NH, Dn, Dr, Dv, Rkv, pos0, T */
    const int shapes[][7] = {{16, 128, 64, 256, 512, 40, 100}, {3, 40, 16, 24, 96, 0, 9},   {5, 8, 6, 12, 100, 30, 70},
                             {4, 16, 8, 32, 64, 200, 130},     {2, 8, 8, 8, 32, 2100, 20}, {64, 16, 8, 16, 64, 0, 65},
                             {4, 64, 32, 128, 128, 10, 50},    {3, 100, 20, 150, 96, 5, 40}}; /* the last two: V padded to 128 and 192 in form 3 */
    petrel_error err = {0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int NH = shapes[k][0], Dn = shapes[k][1], Dr = shapes[k][2], Dv = shapes[k][3], Rkv = shapes[k][4], pos0 = shapes[k][5], T = shapes[k][6];
        const int D = Rkv + Dr, nk = pos0 + T, Dq = Dn + Dr;
        const float scale = 0.2f;
        uint8_t *d;
        void *sc;
        pt_wview W = rand_weight(Rkv % 32 ? PT_F32 : PT_Q8_G32, (int64_t)NH * (Dn + Dv), Rkv, PT_F32, &d, &sc);
        float *w = malloc(sizeof(float) * (size_t)NH * (Dn + Dv) * Rkv), *q = malloc(sizeof(float) * (size_t)T * NH * Dq);
        float *kv = malloc(sizeof(float) * (size_t)nk * D), *o = malloc(sizeof(float) * (size_t)T * NH * Dv);
        float *o2 = malloc(sizeof(float) * (size_t)T * NH * Dv), *ref = malloc(sizeof(float) * (size_t)T * NH * Dv), *refb = malloc(sizeof(float) * (size_t)T * NH * Dv);
        double *kx = malloc(sizeof(double) * (size_t)nk * Dn), *vx = malloc(sizeof(double) * (size_t)nk * Dv), *p = malloc(sizeof(double) * nk);
        for (int64_t r = 0; r < W.rows; r++) pt_dequant_row(&W, r, w + r * Rkv);
        for (size_t i = 0; i < (size_t)T * NH * Dq; i++) q[i] = frand();
        for (size_t i = 0; i < (size_t)nk * D; i++) kv[i] = frand();
        /* form 3's keys and values: from one bf16 GEMM of the keys where kv_b is q8 of whole 64
         * columns (yb [nk][NH (Dn + Dv)]), else the f32 expansion's (kx, vx) */
        const int gemm = W.qtype == PT_Q8_G32 && Rkv % 64 == 0;
        float *yb = NULL;
        if (gemm) {
            float *c = malloc(sizeof(float) * (size_t)nk * Rkv);
            yb = malloc(sizeof(float) * (size_t)nk * W.rows);
            for (int i = 0; i < nk; i++) memcpy(c + (size_t)i * Rkv, kv + (size_t)i * D, sizeof(float) * Rkv);
            ref_gemm_bf16(&W, c, nk, yb);
            free(c);
        }
#define kxb(h, i, j) (gemm ? yb[(size_t)(i) * W.rows + (size_t)(h) * (Dn + Dv) + (j)] : (j) < Dn ? (float)kx[(size_t)(i) * Dn + (j)] : (float)vx[(size_t)(i) * Dv + (j) - Dn])
        for (int h = 0; h < NH; h++) {
            for (int i = 0; i < nk; i++) { /* head h's expanded key and value of key i */
                for (int j = 0; j < Dn + Dv; j++) {
                    double a = 0;
                    for (int c = 0; c < Rkv; c++) a += (double)w[((size_t)h * (Dn + Dv) + j) * Rkv + c] * kv[(size_t)i * D + c];
                    if (j < Dn) kx[(size_t)i * Dn + j] = a;
                    else vx[(size_t)i * Dv + j - Dn] = a;
                }
            }
            for (int b = 0; b < 2; b++) /* exact, then q, K and V rounded to bf16 first (form 3's inputs) */
                for (int r = 0; r < T; r++) {
                    const float *qr = q + ((size_t)r * NH + h) * Dq;
                    const int n = pos0 + r + 1;
                    double mx = -1e300, sum = 0;
                    for (int i = 0; i < n; i++) {
                        double a = 0;
                        for (int j = 0; j < Dn; j++) a += b ? (double)bf16_rn(qr[j]) * bf16_rn(kxb(h, i, j)) : qr[j] * kx[(size_t)i * Dn + j];
                        for (int j = 0; j < Dr; j++) a += b ? (double)bf16_rn(qr[Dn + j]) * bf16_rn(kv[(size_t)i * D + Rkv + j]) : (double)qr[Dn + j] * kv[(size_t)i * D + Rkv + j];
                        p[i] = scale * a;
                        mx = p[i] > mx ? p[i] : mx;
                    }
                    for (int i = 0; i < n; i++) sum += (p[i] = exp(p[i] - mx));
                    for (int j = 0; j < Dv; j++) {
                        double a = 0;
                        for (int i = 0; i < n; i++) a += p[i] * (b ? bf16_rn(kxb(h, i, Dn + j)) : vx[(size_t)i * Dv + j]);
                        (b ? refb : ref)[((size_t)r * NH + h) * Dv + j] = (float)(a / sum);
                    }
                }
        }
        const size_t no = (size_t)T * NH * Dv;
        static const char *fname[] = {"", "mma.sync", "wgmma", "bf16 one pass"};
        for (int form = 1; form <= 3; form++) { /* mma.sync tiles, warpgroup MMA, the bf16 one pass */
            int rc = cu_attn_expanded_check(&W, q, kv, pos0, T, NH, Dn, Dr, Dv, scale, form, o, &err);
            CHECK_MSG(rc == 0, "cu_attn_expanded_check: %s", err.msg);
            double e = rc ? 1 : test_rel_l2(o, ref, no), eb = rc ? 1 : test_rel_l2(o, refb, no);
            /* past 2048 keys these random scores are near uniform: the outputs average ~2100 values
             * ~46x their size, each an f32 product of the expansion (measured 1.33e-5 on an H100,
             * the other shapes 1e-6 .. 7.6e-6). The bf16 pass: its inputs' rounding against the
             * exact sums, and what is left (P in bf16, f32 sums) against the sums of the same
             * rounded inputs */
            const double tol = form == 3 ? 2e-2 : nk > 2048 ? 2e-5 : 1e-5;
            CHECK_MSG(e < tol, "expanded attention, %s (%d heads, Dn %d, Dr %d, Dv %d, Rkv %d, rows %d at %d): rel err %.3g", fname[form], NH, Dn, Dr, Dv,
                      Rkv, T, pos0, e);
            if (form == 3) CHECK_MSG(eb < 2e-3, "expanded attention, bf16 one pass (%d heads, rows %d at %d): rel err %.3g against bf16 inputs' sums", NH, T, pos0, eb);
            if (getenv("PETREL_TEST_VERBOSE"))
                fprintf(stderr, "  expanded attention, %s, %d heads, %d rows at %d: rel err %.3g (bf16 inputs' sums %.3g)\n", fname[form], NH, T, pos0, e, eb);
            /* the same rows in two calls (the first's keys end where its rows do) */
            const int T1 = T / 3 + 1;
            int rc1 = cu_attn_expanded_check(&W, q, kv, pos0, T1, NH, Dn, Dr, Dv, scale, form, o2, &err);
            int rc2 = rc1 ? rc1 : cu_attn_expanded_check(&W, q + (size_t)T1 * NH * Dq, kv, pos0 + T1, T - T1, NH, Dn, Dr, Dv, scale, form, o2 + (size_t)T1 * NH * Dv, &err);
            CHECK_MSG(rc2 == 0, "cu_attn_expanded_check: %s", err.msg);
            size_t bad = 0;
            for (size_t i = 0; !rc && !rc2 && i < no; i++) bad += memcmp(&o[i], &o2[i], 4) != 0;
            CHECK_MSG(bad == 0, "expanded attention, %s: %zu of %zu outputs differ between one call and %d + %d rows", fname[form], bad, no, T1, T - T1);
        }
        /* form 3 with kv_b's product of the keys on the TMA GEMM (the forward's way for long
         * chunks): the same bits as form 3's wgmma GEMM (o still holds form 3's outputs); a kv_b
         * that GEMM does not take is refused */
        if (gemm) {
            int rc = cu_attn_expanded_check(&W, q, kv, pos0, T, NH, Dn, Dr, Dv, scale, 4, o2, &err);
            CHECK_MSG(rc == 0, "cu_attn_expanded_check (form 4): %s", err.msg);
            size_t bad = 0;
            for (size_t i = 0; !rc && i < no; i++) bad += memcmp(&o[i], &o2[i], 4) != 0;
            CHECK_MSG(bad == 0, "expanded attention, kv_b on the TMA GEMM: %zu of %zu outputs differ from the wgmma GEMM's", bad, no);
        } else {
            CHECK(cu_attn_expanded_check(&W, q, kv, pos0, T, NH, Dn, Dr, Dv, scale, 4, o2, &err) == PETREL_EINVAL);
        }
        /* an unknown form is refused, not run */
        CHECK(cu_attn_expanded_check(&W, q, kv, pos0, T, NH, Dn, Dr, Dv, scale, 5, o, &err) != 0);
#undef kxb
        free(w), free(q), free(kv), free(o), free(o2), free(ref), free(refb), free(kx), free(vx), free(p), free(d), free(sc), free(yb);
    }
}

/* the router's two forms choose alike (bitwise, NaN rows included) and as moe_route does */
TEST(cuda, route_forms) {
    if (!need_gpu()) return;
    /* E, K, n_group, topk_group */
    const int cases[][4] = {{256, 8, 1, 1}, {256, 8, 8, 4}, {64, 6, 1, 1}, {160, 8, 8, 3}, {200, 7, 1, 1}};
    petrel_error err = {0};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int E = cases[c][0], K = cases[c][1], T = 12;
        petrel_config cfg = {0};
        cfg.n_routed_experts = E, cfg.num_experts_per_tok = K, cfg.n_group = cases[c][2], cfg.topk_group = cases[c][3];
        cfg.norm_topk_prob = (int)(c & 1) ^ 1, cfg.routed_scaling_factor = 2.5f;
        float *lg = malloc(sizeof(float) * (size_t)T * E), *bias = malloc(sizeof(float) * E), *w0 = malloc(sizeof(float) * T * K);
        float *w1 = malloc(sizeof(float) * T * K), *wc = malloc(sizeof(float) * K), *scr = malloc(sizeof(float) * 2 * E);
        int32_t *i0 = malloc(sizeof(int32_t) * T * K), *i1 = malloc(sizeof(int32_t) * T * K), *ic = malloc(sizeof(int32_t) * K);
        for (int e = 0; e < E; e++) bias[e] = 0.1f * frand();
        for (int r = 0; r < T; r++)
            for (int e = 0; e < E; e++) { /* row 3: ties (a few values); row 7: NaN and inf logits */
                float v = 4 * frand();
                if (r == 3) v = (float)((e * 5) % 4);
                if (r == 7 && e % 17 == 3) v = e % 2 ? NAN : INFINITY;
                lg[(size_t)r * E + e] = v;
            }
        if (c == 0)
            for (int e = 0; e < E; e++) bias[e] = 0; /* exact ties in the choice values too */
        int rc1 = cu_route_check(lg, bias, T, E, K, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, 1, i1, w1, &err);
        int rc0 = cu_route_check(lg, bias, T, E, K, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, 0, i0, w0, &err);
        CHECK_MSG(rc0 == 0 && rc1 == 0, "cu_route_check: %s", err.msg);
        if (rc0 || rc1) goto next;
        CHECK_MSG(!memcmp(i0, i1, sizeof(int32_t) * T * K) && !memcmp(w0, w1, sizeof(float) * T * K),
                  "router %d experts top-%d: the register and shared-memory forms differ", E, K);
        for (int r = 0; r < T; r++) {
            if (r == 7) continue; /* NaN: the two GPU forms agree (above); the CPU's order of NaN compares is its own */
            moe_route(&cfg, lg + (size_t)r * E, bias, ic, wc, scr);
            int same = !memcmp(ic, i1 + (size_t)r * K, sizeof(int32_t) * K);
            double e = 0;
            for (int k = 0; k < K; k++) e = fmax(e, fabs(wc[k] - w1[(size_t)r * K + k]) / (fabs(wc[k]) + 1e-30));
            CHECK_MSG(same && e < 1e-5, "router %d experts top-%d row %d: GPU vs moe_route (ids %s, weights rel err %.3g)", E, K, r, same ? "equal" : "differ", e);
        }
    next:
        free(lg), free(bias), free(w0), free(w1), free(wc), free(scr), free(i0), free(i1), free(ic);
    }
}

TEST(cuda, topk_ties) {
    if (!need_gpu()) return;
    petrel_error err = {0};
    const int cases[][2] = {{10, 3}, {100, 100}, {2049, 2048}, {5000, 2048}, {70000, 2048}, {3000, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int n = cases[c][0], k = cases[c][1];
        float *v = malloc(sizeof(float) * n);
        int32_t *a = malloc(sizeof(int32_t) * n), *b = malloc(sizeof(int32_t) * n), *tmp = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) { /* mostly exact ties (ReLU'd zeros), some -0, NaN, -inf, repeats */
            float r = frand();
            v[i] = r < -0.5f ? 0.0f : r < -0.4f ? -0.0f : r < -0.38f ? NAN : r < -0.36f ? -INFINITY : r < 0 ? 0.25f : r;
        }
        op_topk(v, n, k, a, tmp);
        int rc = cu_topk_check(v, n, k, b, &err);
        CHECK_MSG(rc == 0, "cu_topk_check: %s", err.msg);
        CHECK_MSG(rc || !memcmp(a, b, sizeof(int32_t) * k), "top-%d of %d: the GPU's selection differs from op_topk", k, n);
        free(v), free(a), free(b), free(tmp);
    }
}

/* the DSA indexer's scores: the GPU's are kn_ref_dsa_scores' bits (one fma chain a head over
 * the dimension, the ReLU'd products in h order into 16 lanes, the fixed tree), for the
 * vector (Di % 4 == 0) and scalar forms, head counts below 16, past one chunk of 64, rows of a
 * batch and one key; many heads' dot products negative (the ReLU's zeros) */
TEST(cuda, dsa_scores) {
    if (!need_gpu()) return;
    petrel_error err = {0};
    const int cases[][4] = {{1, 32, 128, 2049}, {3, 5, 7, 100}, {2, 70, 64, 33}, {1, 16, 12, 1}, {8, 32, 128, 300}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c][0], Hi = cases[c][1], Di = cases[c][2], n = cases[c][3], Hp = kn_dsa_heads(Hi);
        float *q = malloc(sizeof(float) * T * Hi * Di), *w = malloc(sizeof(float) * T * Hi), *k = malloc(sizeof(float) * (size_t)n * Di);
        float *got = malloc(sizeof(float) * (size_t)T * n), *want = malloc(sizeof(float) * n);
        float *qt = calloc((size_t)Di * Hp, sizeof(float)), *wp = calloc((size_t)Hp, sizeof(float));
        for (int i = 0; i < T * Hi * Di; i++) q[i] = frand();
        for (int i = 0; i < T * Hi; i++) w[i] = frand();
        for (int64_t i = 0; i < (int64_t)n * Di; i++) k[i] = frand();
        int rc = cu_dsa_scores_check(q, w, k, T, Hi, Di, n, got, &err);
        CHECK_MSG(rc == 0, "cu_dsa_scores_check: %s", err.msg);
        for (int r = 0; !rc && r < T; r++) {
            for (int h = 0; h < Hi; h++) {
                wp[h] = w[r * Hi + h];
                for (int d = 0; d < Di; d++) qt[(size_t)d * Hp + h] = q[((size_t)r * Hi + h) * Di + d];
            }
            kn_dsa a = {.Hp = Hp, .Di = Di, .qt = qt, .w = wp, .k = k, .k_stride = Di, .n = n, .score = want};
            kn_ref_dsa_scores(&a);
            int bad = -1;
            for (int t = 0; t < n && bad < 0; t++)
                if (memcmp(&got[(size_t)r * n + t], &want[t], sizeof(float)) && !(got[(size_t)r * n + t] == 0.f && want[t] == 0.f)) bad = t;
            CHECK_MSG(bad < 0, "DSA scores T %d Hi %d Di %d n %d: row %d key %d: GPU %.9g, reference %.9g", T, Hi, Di, n, r, bad,
                      got[(size_t)r * n + (bad < 0 ? 0 : bad)], want[bad < 0 ? 0 : bad]);
        }
        free(q), free(w), free(k), free(got), free(want), free(qt), free(wp);
    }
    float one = 1.f, sc;
    CHECK(cu_dsa_scores_check(&one, &one, &one, 1, 1, 1, 0, &sc, &err) == PETREL_EINVAL);   /* no keys: refused */
    CHECK(cu_dsa_scores_check(&one, &one, &one, 1, 1, 513, 1, &sc, &err) == PETREL_EINVAL); /* past the shared-memory bound: refused before any read */
}

/* the tensor-core products' tf32 split (hi by integer rounding) against the two-cvt.rna form it
 * replaced: the same hi and lo bits for every finite value (ties, subnormals, the largest ones
 * that round up to inf), and for inf and NaN (any payload, either sign) a NaN lo, so products
 * through the three MMAs stay NaN */
TEST(cuda, tf32_split) {
    if (!need_gpu()) return;
    petrel_error err = {0};
    enum { N = 4096 };
    float *x = malloc(sizeof(float) * N);
    uint32_t *o = malloc(sizeof(uint32_t) * 4 * N);
    const uint32_t special[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x80001000u, 0x00001000u, 0x00003000u, 0x007fffffu,
                                0x3f801000u, 0xbf801000u, 0x3f803000u, 0x3f800fffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7ff000u,
                                0x7f7fefffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7fffffffu, 0xffffffffu,
                                0x7f800001u, 0x7ffff000u};
    const int ns = (int)(sizeof special / sizeof special[0]);
    for (int i = 0; i < N; i++) {
        uint32_t b;
        if (i < ns) b = special[i];
        else {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            b = (uint32_t)(rng >> 32);
            if (i % 4 == 1) b = (b & 0xffffe000u) | 0x1000u; /* a tie */
        }
        memcpy(&x[i], &b, 4);
    }
    int rc = cu_tf32_split_check(x, N, o, &err);
    CHECK_MSG(rc == 0, "cu_tf32_split_check: %s", err.msg);
    int bad = -1, nonfinite = 0;
    for (int i = 0; !rc && i < N && bad < 0; i++) {
        float lo;
        memcpy(&lo, &o[4 * i + 1], 4);
        if (isfinite(x[i])) {
            if (o[4 * i] != o[4 * i + 2] || o[4 * i + 1] != o[4 * i + 3]) bad = i;
        } else {
            nonfinite++;
            if (!isnan(lo)) bad = i;
        }
    }
    uint32_t xb = 0;
    if (bad >= 0) memcpy(&xb, &x[bad], 4);
    CHECK_MSG(bad < 0, "tf32 split of 0x%08x: hi 0x%08x lo 0x%08x, cvt.rna: hi 0x%08x lo 0x%08x", xb, o[4 * (bad < 0 ? 0 : bad)],
              o[4 * (bad < 0 ? 0 : bad) + 1], o[4 * (bad < 0 ? 0 : bad) + 2], o[4 * (bad < 0 ? 0 : bad) + 3]);
    CHECK(rc || nonfinite >= 10);
    CHECK(cu_tf32_split_check(x, 0, o, &err) == PETREL_EINVAL);
    free(x), free(o);
}

/* the prompt's down input in one pass: cuk_swiglu_bf16g's bits (the routed experts' order) and
 * cuk_swiglu_bf16g8's (the q8 products') are those of k_silu_mul then the conversion of that
 * order, over ordinary values and ones whose exp overflows */
TEST(cuda, swiglu_bf16) {
    if (!need_gpu()) return;
    petrel_error err = {0};
    const int n = 37, cols = 2048;
    const size_t e = (size_t)n * cols;
    float *g = malloc(sizeof(float) * e), *u = malloc(sizeof(float) * e);
    uint16_t *a = malloc(sizeof(uint16_t) * e), *b = malloc(sizeof(uint16_t) * e), *r = malloc(sizeof(uint16_t) * e);
    for (size_t i = 0; i < e; i++) g[i] = frand() * (i % 97 == 0 ? 200.0f : 6.0f), u[i] = frand() * 3.0f;
    int rc = cu_swiglu_bf16_check(g, u, n, cols, 4, a, b, r, &err);
    CHECK_MSG(rc == 0, "cu_swiglu_bf16_check: %s", err.msg);
    size_t bad = 0, badr = 0;
    for (size_t i = 0; !rc && i < e; i++) bad += a[i] != b[i], badr += r[i] != a[(size_t)(n - 1 - (int)(i / cols)) * cols + i % cols];
    CHECK_MSG(bad == 0, "swiglu bf16: %zu of %zu values differ from k_silu_mul + k_xbf16g", bad, e);
    CHECK_MSG(badr == 0, "swiglu bf16 gathered by rows n-1 .. 0: %zu of %zu values differ from the plain pass's reversed", badr, e);
    rc = cu_swiglu_bf16_check(g, u, n, cols, 8, a, b, NULL, &err);
    CHECK_MSG(rc == 0, "cu_swiglu_bf16_check (q8 order): %s", err.msg);
    bad = 0;
    for (size_t i = 0; !rc && i < e; i++) bad += a[i] != b[i];
    CHECK_MSG(bad == 0, "swiglu bf16 in the q8 order: %zu of %zu values differ from k_silu_mul + k_xbf16g8", bad, e);
    CHECK(cu_swiglu_bf16_check(g, u, n, 100, 4, a, b, r, &err) == PETREL_EINVAL); /* not whole 64 columns: refused */
    CHECK(cu_swiglu_bf16_check(g, u, n, cols, 6, a, b, r, &err) == PETREL_EINVAL); /* no such order */
    free(g), free(u), free(a), free(b), free(r);
}

/* the experts' counting sort: the list and tiles of a stable sort on the host, for even,
 * skewed and one-expert choices, experts past the 32 warps' shared counts (1024) and odd tm */
TEST(cuda, moe_sort) {
    if (!need_gpu()) return;
    petrel_error err = {0};
    const int cases[][5] = {{2048, 8, 256, 128, 0}, {2048, 8, 256, 64, 1}, {3001, 8, 256, 96, 2}, {700, 6, 1024, 128, 0}, {5, 8, 300, 7, 1}, {1, 1, 1, 1, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c][0], K = cases[c][1], E = cases[c][2], tm = cases[c][3], mode = cases[c][4], n = T * K, mt = E + n / tm + 1;
        int32_t *idx = malloc(sizeof(int32_t) * n), *list = malloc(sizeof(int32_t) * n), *ref = malloc(sizeof(int32_t) * n);
        int32_t *tiles = malloc(sizeof(int32_t) * 3 * mt), *rt = malloc(sizeof(int32_t) * 3 * mt), *cnt = calloc((size_t)E + 1, sizeof(int32_t));
        for (int i = 0; i < n; i++) { /* even; skewed (half the slots on experts 0..3); all on the last expert */
            const int r = (int)((frand() + 1.0f) * 0.5f * (float)E) % E;
            idx[i] = mode == 0 ? r : mode == 1 ? (i % 2 ? r : r % 4) : E - 1;
        }
        for (int i = 0; i < n; i++) cnt[idx[i] + 1]++;
        for (int e = 0; e < E; e++) cnt[e + 1] += cnt[e];
        int nt = 0;
        for (int e = 0; e < E; e++)
            for (int j = 0; j < cnt[e + 1] - cnt[e]; j += tm, nt++)
                rt[3 * nt] = e, rt[3 * nt + 1] = cnt[e] + j, rt[3 * nt + 2] = cnt[e + 1] - cnt[e] - j < tm ? cnt[e + 1] - cnt[e] - j : tm;
        for (int i = 0; i < n; i++) ref[cnt[idx[i]]++] = i;
        int got = -1, rc = cu_moe_sort_check(idx, T, K, E, tm, list, tiles, &got, &err);
        CHECK_MSG(rc == 0, "cu_moe_sort_check: %s", err.msg);
        CHECK_MSG(rc || got == nt, "moe sort (%d x %d, %d experts, tm %d): %d tiles, the host %d", T, K, E, tm, got, nt);
        CHECK_MSG(rc || got != nt || !memcmp(tiles, rt, sizeof(int32_t) * 3 * nt), "moe sort (%d x %d, %d experts, tm %d): tiles differ", T, K, E, tm);
        CHECK_MSG(rc || !memcmp(list, ref, sizeof(int32_t) * n), "moe sort (%d x %d, %d experts, tm %d): the list differs from a stable sort", T, K, E, tm);
        free(idx), free(list), free(ref), free(tiles), free(rt), free(cnt);
    }
    int32_t bad = 5, l, t[6], nt;
    CHECK(cu_moe_sort_check(&bad, 1, 1, 4, 8, &l, t, &nt, &err) == PETREL_EINVAL); /* an id past E is refused */
}

static petrel_engine *open_dev(const char *model, const char *device, int exact) {
    petrel_open_opts o = {0};
    o.device = device;
    if (exact) o.act_quant = -1, o.relayout = -1;
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(model, &o, &e, &err)) test_fail(__FILE__, __LINE__, "open %s on %s: %s", model, device ? device : "cpu", err.msg);
    return e;
}

/* prefill (all logits) or decode of prompt ids on an engine */
static int run_logits(petrel_engine *e, const int32_t *ids, int T, int decode, float *lg) {
    petrel_session *s;
    petrel_error err = {0};
    int V = e->cfg.vocab_size, rc = petrel_session_create(e, T, &s, &err);
    if (!rc && decode)
        for (int t = 0; t < T && !rc; t++) rc = petrel_session_forward(s, ids + t, 1, lg + (size_t)t * V, 0, &err);
    else if (!rc) rc = petrel_session_forward(s, ids, T, lg, 1, &err);
    if (rc) test_fail(__FILE__, __LINE__, "forward: %s", err.msg);
    petrel_session_free(s);
    return rc;
}

/* a prompt longer than the CPU's chunk (512 rows) goes to the GPU in the GPU's chunks: the
 * engine takes more rows a chunk than the CPU's, and a 900-token prompt in one call gives the
 * bits of the same prompt fed as 512 + 388 */
TEST(cuda, prompt_chunks) {
    if (!need_gpu()) return;
    const char *pk = test_pack_of("trained", CVQ_Q4);
    if (!pk) return;
    petrel_engine *g = open_dev(pk, "cuda", 0);
    if (!g) return;
    int V = g->cfg.vocab_size, T = 900;
    CHECK_MSG(cu_model_chunk_rows(g->cu) > 512, "the GPU takes %d rows a chunk, no more than the CPU's 512", cu_model_chunk_rows(g->cu));
    int32_t *ids = malloc(sizeof(int32_t) * T);
    for (int i = 0; i < T; i++) ids[i] = (i * 197 + 11) % V;
    float *la = malloc(sizeof(float) * (size_t)T * V), *lb = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *a = NULL, *b = NULL;
    petrel_error err = {0};
    if (!petrel_session_create(g, T, &a, &err) && !petrel_session_create(g, T, &b, &err) && !petrel_session_forward(a, ids, T, la, 1, &err) &&
        !petrel_session_forward(b, ids, 512, lb, 1, &err) && !petrel_session_forward(b, ids + 512, T - 512, lb + (size_t)512 * V, 1, &err)) {
        size_t bad = 0;
        for (size_t i = 0; i < (size_t)T * V; i++) bad += memcmp(&la[i], &lb[i], 4) != 0;
        CHECK_MSG(bad == 0, "a %d-token prompt in one call: %zu logits differ from 512 + %d", T, bad, T - 512);
    } else {
        test_fail(__FILE__, __LINE__, "prompt_chunks: %s", err.msg);
    }
    petrel_session_free(a);
    petrel_session_free(b);
    free(ids), free(la), free(lb);
    petrel_engine_close(g);
}

/* every golden prompt in prefill and decode: GPU vs reference (1e-4) and vs the CPU (1e-5);
 * xattn: prompts in the expanded attention where they take it (returns the layers that did) */
static unsigned long long check_fixture_form(const char *name, int xattn) {
    if (!need_gpu()) return 0;
    unsigned long long xruns = 0;
    petrel_engine *g = open_dev(test_data(name), "cuda", 0), *c = open_dev(test_data(name), NULL, 1);
    if (g) cu_model_use_expanded_attn(g->cu, xattn);
    st_set *gold = NULL;
    petrel_error err = {0};
    char p[512];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data(name));
    CHECK(st_open(p, &gold, &err) == 0);
    if (!g || !c || !gold) goto done;
    int V = g->cfg.vocab_size, np = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(gold, pi, "ids"), *ref = test_gold(gold, pi, "logits");
        if (!ids || !ref) break;
        np++;
        int T = (int)ids->shape[0];
        float *lg = malloc(sizeof(float) * (size_t)T * V), *lc = malloc(sizeof(float) * (size_t)T * V);
        for (int decode = 0; decode <= 1; decode++) {
            if (run_logits(g, (const int32_t *)ids->data, T, decode, lg) || run_logits(c, (const int32_t *)ids->data, T, decode, lc)) break;
            double er = test_rel_l2(lg, (const float *)ref->data, (size_t)T * V), ec = test_rel_l2(lg, lc, (size_t)T * V);
            CHECK_MSG(er < 1e-4, "%s prompt %d %s: GPU vs reference rel err %.3g", name, pi, decode ? "decode" : "prefill", er);
            CHECK_MSG(ec < 1e-5, "%s prompt %d %s: GPU vs CPU rel err %.3g", name, pi, decode ? "decode" : "prefill", ec);
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  %s prompt %d T=%d %s: vs ref %.3g, vs cpu %.3g\n", name, pi, T, decode ? "decode" : "prefill", er, ec);
        }
        free(lg), free(lc);
    }
    CHECK(np > 0);
    xruns = cu_model_expanded_count(g->cu);
done:
    st_close(gold);
    petrel_engine_close(g);
    petrel_engine_close(c);
    return xruns;
}
static void check_fixture(const char *name) { check_fixture_form(name, 0); }
TEST(cuda, golden_tiny) { check_fixture("tiny"); }
TEST(cuda, golden_fp8) { check_fixture("tiny-fp8"); }
TEST(cuda, golden_odd) { check_fixture("odd"); }
TEST(cuda, golden_odd2) { check_fixture("odd2"); }
TEST(cuda, golden_odd3) { check_fixture("odd3"); }
TEST(cuda, golden_trained) { check_fixture("trained"); }
/* the fixtures with prompts of 9 to index_topk tokens (odd3's 17, trained's 30) in the expanded
 * attention */
TEST(cuda, golden_expanded) {
    if (!need_gpu()) return;
    const char *names[] = {"odd3", "trained"};
    for (int i = 0; i < 2; i++)
        for (int form = 1; form <= 2; form++) { /* mma.sync tiles, warpgroup MMA */
            unsigned long long n = check_fixture_form(names[i], form);
            CHECK_MSG(n > 0, "%s: no prompt took the expanded attention (form %d)", names[i], form);
        }
}

/* DSA past index_topk with ties: the trained fixture's prompt 0 scored even where every key fits
 * (dsa_always_score), GPU vs CPU */
TEST(cuda, always_score) {
    if (!need_gpu()) return;
    petrel_engine *g = open_dev(test_data("trained"), "cuda", 0), *c = open_dev(test_data("trained"), NULL, 1);
    if (!g || !c) goto done;
    {
        int V = g->cfg.vocab_size, T = 200;
        int32_t *ids = malloc(sizeof(int32_t) * T);
        for (int i = 0; i < T; i++) ids[i] = (i * 37 + 11) % V;
        float *lg = malloc(sizeof(float) * (size_t)T * V), *lc = malloc(sizeof(float) * (size_t)T * V);
        petrel_session *sg, *sc;
        petrel_error err = {0};
        CHECK(petrel_session_create(g, T, &sg, &err) == 0 && petrel_session_create(c, T, &sc, &err) == 0);
        sg->dsa_always_score = sc->dsa_always_score = 1;
        CHECK(petrel_session_forward(sg, ids, T, lg, 1, &err) == 0);
        CHECK(petrel_session_forward(sc, ids, T, lc, 1, &err) == 0);
        double e = test_rel_l2(lg, lc, (size_t)T * V);
        CHECK_MSG(e < 1e-5, "always-scored DSA: GPU vs CPU rel err %.3g", e);
        petrel_session_free(sg), petrel_session_free(sc);
        free(ids), free(lg), free(lc);
    }
done:
    petrel_engine_close(g);
    petrel_engine_close(c);
}

/* greedy continuation of the trained fixture: the same tokens as the CPU */
TEST(cuda, greedy_trained) {
    if (!need_gpu()) return;
    petrel_engine *g = open_dev(test_data("trained"), "cuda", 0), *c = open_dev(test_data("trained"), NULL, 1);
    if (!g || !c) goto done;
    {
        int V = g->cfg.vocab_size, T = 12, G = 48;
        int32_t ids[12];
        for (int i = 0; i < T; i++) ids[i] = (i * 131 + 7) % V;
        petrel_engine *es[2] = {g, c};
        int32_t out[2][48];
        float *lg = malloc(sizeof(float) * V);
        for (int k = 0; k < 2; k++) {
            petrel_session *s;
            petrel_error err = {0};
            CHECK(petrel_session_create(es[k], T + G, &s, &err) == 0);
            CHECK(petrel_session_forward(s, ids, T, lg, 0, &err) == 0);
            for (int t = 0; t < G; t++) {
                int32_t best = 0;
                for (int v = 1; v < V; v++) if (lg[v] > lg[best]) best = v;
                out[k][t] = best;
                CHECK(petrel_session_forward(s, &best, 1, lg, 0, &err) == 0);
            }
            petrel_session_free(s);
        }
        CHECK_MSG(!memcmp(out[0], out[1], sizeof out[0]), "greedy continuations differ between GPU and CPU");
        free(lg);
    }
done:
    petrel_engine_close(g);
    petrel_engine_close(c);
}

/* a batch of rows of three sessions at different positions (a decode row, a 5-row window, a
 * prompt chunk) against each session run alone on the GPU */
TEST(cuda, batch_sessions) {
    if (!need_gpu()) return;
    petrel_engine *g = open_dev(test_data("trained"), "cuda", 0);
    if (!g) return;
    int V = g->cfg.vocab_size;
    const int pre[3] = {40, 7, 0}, add[3] = {1, 5, 30};
    petrel_session *a[3], *b[3];
    petrel_error err = {0};
    int32_t ids[3][80];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 80; i++) ids[k][i] = (i * (17 + k) + 3 * k) % V;
    float *lg = malloc(sizeof(float) * V);
    for (int k = 0; k < 3; k++) {
        CHECK(petrel_session_create(g, 80, &a[k], &err) == 0 && petrel_session_create(g, 80, &b[k], &err) == 0);
        if (pre[k]) CHECK(petrel_session_forward(a[k], ids[k], pre[k], lg, 0, &err) == 0 && petrel_session_forward(b[k], ids[k], pre[k], lg, 0, &err) == 0);
    }
    petrel_batch *bt;
    CHECK(petrel_batch_create(g, 64, &bt, &err) == 0);
    petrel_row rows[36];
    int n = 0;
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < add[k]; i++) rows[n++] = (petrel_row){a[k], ids[k][pre[k] + i], 1};
    float *lb = malloc(sizeof(float) * (size_t)n * V), *la = malloc(sizeof(float) * 30 * (size_t)V);
    CHECK_MSG(petrel_batch_forward(bt, rows, n, lb, &err) == 0, "batch: %s", err.msg);
    for (int k = 0, r = 0; k < 3; k++) {
        const unsigned long long x0 = cu_model_expanded_count(g->cu);
        CHECK(petrel_session_forward(b[k], ids[k] + pre[k], add[k], la, 1, &err) == 0);
        /* a prompt chunk alone takes the expanded attention (the default), the same rows among
         * other sessions' the absorbed form: the two agree to ~1e-6 of each output */
        const int expanded = cu_model_expanded_count(g->cu) > x0;
        double e = test_rel_l2(lb + (size_t)r * V, la, (size_t)add[k] * V);
        CHECK_MSG(e < (expanded ? 1e-5 : 1e-6), "session %d: batched vs alone (%s) rel err %.3g", k, expanded ? "expanded" : "absorbed", e);
        if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  session %d: %d rows, alone %s, rel err %.3g\n", k, add[k], expanded ? "expanded" : "absorbed", e);
        CHECK_EQ_INT(petrel_session_len(a[k]), pre[k] + add[k]);
        r += add[k];
    }
    petrel_batch_free(bt);
    for (int k = 0; k < 3; k++) petrel_session_free(a[k]), petrel_session_free(b[k]);
    free(lg), free(lb), free(la);
    petrel_engine_close(g);
}

/* a q4 pack of the trained fixture: the GPU's exact mode (act_quant -1: f32 products) against the
 * CPU's exact-activation path on a plain-layout pack (1e-5); by default (prefill on tensor cores)
 * the row-interleaved pack gives the GPU the same bits as the plain one, and its KL to the
 * reference stays within 10 % of the CPU default's */
TEST(cuda, q4_pack_quality) {
    if (!need_gpu()) return;
    const char *pk = test_pack_of("trained", CVQ_Q4);
    char plain[600];
    snprintf(plain, sizeof plain, "%s/trained-q4-plain.pack", test_tmpdir());
    convert_opts co;
    memset(&co, 0, sizeof co);
    co.quant = CVQ_Q4;
    co.expert_plain = 1;
    convert_result res;
    petrel_error err = {0};
    CHECK_MSG(convert_hf(test_data("trained"), plain, &co, &res, &err) == 0, "convert: %s", err.msg);
    if (!pk) return;
    petrel_engine *g = open_dev(pk, "cuda", 0), *gp = open_dev(plain, "cuda", 0), *ge = open_dev(plain, "cuda", 1), *c = open_dev(plain, NULL, 1),
                  *d = open_dev(pk, NULL, 0);
    st_set *gold = NULL;
    char p[512];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("trained"));
    CHECK(st_open(p, &gold, &err) == 0);
    if (!g || !gp || !ge || !c || !d || !gold) goto done;
    {
        const st_tensor *ids = test_gold(gold, 0, "ids"), *ref = test_gold(gold, 0, "logits");
        int T = (int)ids->shape[0], V = g->cfg.vocab_size;
        size_t n = (size_t)T * V;
        float *lg = malloc(sizeof(float) * n), *lp = malloc(sizeof(float) * n), *lc = malloc(sizeof(float) * n), *ld = malloc(sizeof(float) * n);
        float *le = malloc(sizeof(float) * n);
        const int32_t *id = (const int32_t *)ids->data;
        if (!run_logits(g, id, T, 0, lg) && !run_logits(gp, id, T, 0, lp) && !run_logits(ge, id, T, 0, le) && !run_logits(c, id, T, 0, lc) &&
            !run_logits(d, id, T, 0, ld)) {
            double e = test_rel_l2(le, lc, n);
            double kg = test_kl_rows((const float *)ref->data, lg, T, V) / T, kd = test_kl_rows((const float *)ref->data, ld, T, V) / T;
            CHECK_MSG(e < 1e-5, "q4 plain pack: GPU vs CPU (exact activations) rel err %.3g", e);
            CHECK_MSG(!memcmp(lg, lp, sizeof(float) * n), "q4: the GPU's logits differ between the r16 and the plain pack");
            CHECK_MSG(kg <= 1.1 * kd, "q4 pack: GPU KL %.4g vs the CPU default's %.4g", kg, kd);
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  q4 pack: vs cpu %.3g, KL gpu %.4g cpu %.4g\n", e, kg, kd);
        }
        free(lg), free(lp), free(lc), free(ld), free(le);
        /* a prompt that sees every key (9 .. index_topk tokens: the golden's 30-token one) takes
         * the default expanded attention (its one bf16 pass: q8 kv_b); its KL on 30 rows is noisy:
         * within 1.5x the CPU default's (a broken pass is far off) */
        const st_tensor *i3 = test_gold(gold, 3, "ids"), *r3 = test_gold(gold, 3, "logits");
        int T3 = (int)i3->shape[0];
        CHECK_MSG(T3 > 8 && T3 <= g->cfg.index_topk, "the golden's prompt 3 has %d tokens, not 9 .. index_topk", T3);
        float *l3 = malloc(sizeof(float) * (size_t)T3 * V), *d3 = malloc(sizeof(float) * (size_t)T3 * V);
        unsigned long long x0 = cu_model_expanded_count(g->cu);
        if (!run_logits(g, (const int32_t *)i3->data, T3, 0, l3) && !run_logits(d, (const int32_t *)i3->data, T3, 0, d3)) {
            CHECK_MSG(cu_model_expanded_count(g->cu) > x0, "q4 pack: the %d-token prompt did not take the expanded attention", T3);
            double kg = test_kl_rows((const float *)r3->data, l3, T3, V) / T3, kd = test_kl_rows((const float *)r3->data, d3, T3, V) / T3;
            CHECK_MSG(kg <= 1.5 * kd, "q4 pack, the %d-token prompt: GPU KL %.4g vs the CPU default's %.4g", T3, kg, kd);
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  q4 pack, %d-token prompt expanded: KL gpu %.4g cpu %.4g\n", T3, kg, kd);
        }
        free(l3), free(d3);
    }
done:
    st_close(gold);
    petrel_engine_close(g);
    petrel_engine_close(gp);
    petrel_engine_close(ge);
    petrel_engine_close(c);
    petrel_engine_close(d);
}

/* the routed experts a forward runs (bench's bytes per step): one session's decode rows (K
 * distinct experts a MoE layer, counted on the host) as the CPU counts them; two sessions'
 * rows in one forward (their union, counted on the device) between K and 2 K a MoE layer */
static uint64_t count_experts(petrel_engine *e, int rows, const int32_t *ids, int steps) {
    petrel_session *s[2] = {NULL, NULL};
    petrel_batch *bt = NULL;
    petrel_error err = {0};
    uint64_t n = 0;
    float *lg = malloc(sizeof(float) * 2 * (size_t)e->cfg.vocab_size);
    if (lg && !petrel_session_create(e, steps, &s[0], &err) && !petrel_session_create(e, steps, &s[1], &err) && !petrel_batch_create(e, 8, &bt, &err)) {
        int t = 0;
        for (; t < steps; t++) {
            petrel_row r[2] = {{s[0], ids[t], 1}, {s[1], ids[steps - 1 - t], 1}};
            if (petrel_batch_forward(bt, r, rows, lg, &err)) break;
        }
        if (t == steps) n = batch_stats(bt)->experts_run;
    }
    if (!n) test_fail(__FILE__, __LINE__, "count_experts: %s", err.msg[0] ? err.msg : "out of memory");
    petrel_batch_free(bt);
    petrel_session_free(s[0]);
    petrel_session_free(s[1]);
    free(lg);
    return n;
}
TEST(cuda, experts_counted) {
    if (!need_gpu()) return;
    const char *pk = test_pack_of("trained", CVQ_Q4);
    if (!pk) return;
    petrel_engine *g = open_dev(pk, "cuda", 0), *c = open_dev(pk, NULL, 0);
    if (g && c) {
        int32_t ids[12];
        for (int i = 0; i < 12; i++) ids[i] = (i * 977 + 3) % g->cfg.vocab_size;
        uint64_t K = (uint64_t)g->cfg.num_experts_per_tok, moe = 0;
        for (int l = 0; l < g->cfg.num_hidden_layers; l++) moe += g->w.layers[l].is_moe;
        uint64_t g1 = count_experts(g, 1, ids, 12), c1 = count_experts(c, 1, ids, 12), g2 = count_experts(g, 2, ids, 12);
        CHECK_MSG(g1 == c1 && g1 == 12 * K * moe, "one row a forward: GPU counted %llu experts, the CPU %llu (12 x %llu x %llu)", (unsigned long long)g1,
                  (unsigned long long)c1, (unsigned long long)K, (unsigned long long)moe);
        CHECK_MSG(g2 >= 12 * K * moe && g2 <= 24 * K * moe, "two rows a forward: GPU counted %llu experts, not within %llu..%llu", (unsigned long long)g2,
                  (unsigned long long)(12 * K * moe), (unsigned long long)(24 * K * moe));
    }
    petrel_engine_close(g);
    petrel_engine_close(c);
}

/* decode on int8 activations (a q4 pack: q8_g32 attention weights): one session's rows one at
 * a time, each layer's products of x (q_a, kv_a, the indexer's wk and weights_proj) and of the
 * normed q_a (q_b, wq_b) as one GEMV over their stack, against the same with each product
 * alone (bitwise: the stacks keep each product's column parts) and against the same rows
 * batched with another session's (1e-6: the attention's key splits follow the batch's rows);
 * on the golden prompt, the decode's KL to the reference within 10 % of the CPU default's (the
 * GPU also quantizes x for q8 weights, the CPU's r16 kernels their own way: not bitwise); graph
 * and direct launches, kernels launched as programmatic dependents and not (decode and a
 * prompt's forward), and a step's kernels on two streams and on one, bitwise */
TEST(cuda, decode_int8_rows) {
    if (!need_gpu()) return;
    const char *pk = test_pack_of("trained", CVQ_Q4);
    if (!pk) return;
    petrel_engine *g = open_dev(pk, "cuda", 0), *c = open_dev(pk, NULL, 0);
    st_set *gold = NULL;
    petrel_error err = {0};
    char p[512];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("trained"));
    CHECK(st_open(p, &gold, &err) == 0);
    if (!g || !c || !gold) goto done;
    {
        CHECK_MSG(cu_model_stacks(g->cu) > 0, "the q4 pack's layers stacked no products of one x");
        int V = g->cfg.vocab_size, T = 20;
        int32_t ids[20], other[20];
        for (int i = 0; i < T; i++) ids[i] = (i * 131 + 7) % V, other[i] = (i * 71 + 5) % V;
        float *l1 = malloc(sizeof(float) * (size_t)T * V), *l0 = malloc(sizeof(float) * (size_t)T * V), *lb = malloc(sizeof(float) * 2 * (size_t)V);
        float *la = malloc(sizeof(float) * (size_t)T * V);
        petrel_session *a = NULL, *b = NULL;
        petrel_batch *bt = NULL;
        cu_model_use_stacks(g->cu, 0);
        int rc0 = run_logits(g, ids, T, 1, l0);
        cu_model_use_stacks(g->cu, 1);
        if (!rc0 && !run_logits(g, ids, T, 1, l1)) {
            size_t bad = 0;
            for (size_t i = 0; i < (size_t)T * V; i++) bad += memcmp(&l0[i], &l1[i], 4) != 0;
            CHECK_MSG(bad == 0, "int8 decode: %zu logits differ between stacked and lone products", bad);
            CHECK_MSG(cu_model_graph_count(g->cu) > 0, "int8 decode: no decode step ran as a CUDA graph");
            cu_model_use_graphs(g->cu, 0); /* the decode steps' kernels launched one by one instead of replayed as graphs */
            int rc2 = run_logits(g, ids, T, 1, l0);
            cu_model_use_graphs(g->cu, 1);
            bad = 0;
            for (size_t i = 0; !rc2 && i < (size_t)T * V; i++) bad += memcmp(&l0[i], &l1[i], 4) != 0;
            CHECK_MSG(!rc2 && bad == 0, "int8 decode: %zu logits differ between graph and direct launches", bad);
            CHECK_MSG(cu_model_fork_count(g->cu) > 0, "int8 decode: no part of a step ran on the second stream");
            cu_model_use_fork(g->cu, 0); /* every kernel on one stream: the shared experts and the DSA top-k in line */
            int rc7 = run_logits(g, ids, T, 1, l0);
            cu_model_use_fork(g->cu, 1);
            bad = 0;
            for (size_t i = 0; !rc7 && i < (size_t)T * V; i++) bad += memcmp(&l0[i], &l1[i], 4) != 0;
            CHECK_MSG(!rc7 && bad == 0, "int8 decode: %zu logits differ between one stream and two", bad);
            cu_model_use_mapped_logits(g->cu, 0); /* the head's rows in HBM, then copied down */
            int rc8 = run_logits(g, ids, T, 1, l0);
            cu_model_use_mapped_logits(g->cu, 1);
            bad = 0;
            for (size_t i = 0; !rc8 && i < (size_t)T * V; i++) bad += memcmp(&l0[i], &l1[i], 4) != 0;
            CHECK_MSG(!rc8 && bad == 0, "int8 decode: %zu logits differ between the head writing to mapped host memory and a copy", bad);
            cu_model_use_pdl(g->cu, 0); /* each kernel launched after its predecessor's end instead of as its dependent */
            int rc4 = run_logits(g, ids, T, 1, l0);
            bad = 0;
            for (size_t i = 0; !rc4 && i < (size_t)T * V; i++) bad += memcmp(&l0[i], &l1[i], 4) != 0;
            CHECK_MSG(!rc4 && bad == 0, "int8 decode: %zu logits differ between dependent and ordinary launches", bad);
            int rc5 = run_logits(g, ids, T, 0, l0); /* the prompt in one forward (the GEMM kernels), both ways */
            cu_model_use_pdl(g->cu, 1);
            int rc6 = rc5 ? rc5 : run_logits(g, ids, T, 0, la);
            bad = 0;
            for (size_t i = 0; !rc5 && !rc6 && i < (size_t)T * V; i++) bad += memcmp(&l0[i], &la[i], 4) != 0;
            CHECK_MSG(!rc5 && !rc6 && bad == 0, "int8 prompt: %zu logits differ between dependent and ordinary launches", bad);
            CHECK(petrel_session_create(g, T, &a, &err) == 0 && petrel_session_create(g, T, &b, &err) == 0 && petrel_batch_create(g, 8, &bt, &err) == 0);
            int done_rows = 0;
            for (int t = 0; t < T && bt; t++, done_rows++) {
                petrel_row rows[2] = {{b, other[t], 1}, {a, ids[t], 1}};
                if (petrel_batch_forward(bt, rows, 2, lb, &err)) {
                    test_fail(__FILE__, __LINE__, "batch: %s", err.msg);
                    break;
                }
                memcpy(la + (size_t)t * V, lb + V, sizeof(float) * V);
            }
            if (done_rows == T) {
                double eb = test_rel_l2(la, l1, (size_t)T * V);
                CHECK_MSG(eb < 1e-6, "int8 decode: batched vs alone rel err %.3g", eb);
            }
        }
        petrel_batch_free(bt);
        petrel_session_free(a);
        petrel_session_free(b);
        free(l1), free(l0), free(lb), free(la);
        const st_tensor *gi = test_gold(gold, 0, "ids"), *ref = test_gold(gold, 0, "logits");
        int TG = (int)gi->shape[0];
        float *lg = malloc(sizeof(float) * (size_t)TG * V), *lc = malloc(sizeof(float) * (size_t)TG * V);
        if (!run_logits(g, (const int32_t *)gi->data, TG, 1, lg) && !run_logits(c, (const int32_t *)gi->data, TG, 1, lc)) {
            double kg = test_kl_rows((const float *)ref->data, lg, TG, V) / TG, kc = test_kl_rows((const float *)ref->data, lc, TG, V) / TG;
            CHECK_MSG(kg <= 1.1 * kc, "int8 decode: GPU KL %.4g vs the CPU default's %.4g", kg, kc);
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  int8 decode KL: gpu %.4g cpu %.4g\n", kg, kc);
        }
        free(lg), free(lc);
    }
done:
    st_close(gold);
    petrel_engine_close(g);
    petrel_engine_close(c);
}

/* ---- the expert tiers (src/cuda/tiers.cu) ---- */

static petrel_engine *open_tiers(const char *model, int vram_slots, int host_slots, int host_experts) {
    petrel_open_opts o = {0};
    o.device = "cuda";
    o.vram_expert_slots = vram_slots;
    o.expert_slots = host_slots;
    o.host_experts = host_experts;
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(model, &o, &e, &err)) test_fail(__FILE__, __LINE__, "open %s with %d HBM / %d RAM slots: %s", model, vram_slots, host_slots, err.msg);
    return e;
}

/* a prompt in one pass (every row's logits), then decode steps one row at a time */
static int run_mixed(petrel_engine *e, const int32_t *ids, int T, int steps, float *lg) {
    petrel_session *s;
    petrel_error err = {0};
    int V = e->cfg.vocab_size, rc = petrel_session_create(e, T + steps, &s, &err);
    if (!rc) rc = petrel_session_forward(s, ids, T, lg, 1, &err);
    for (int i = 0; i < steps && !rc; i++) rc = petrel_session_forward(s, ids + (i * 7) % T, 1, lg + (size_t)(T + i) * V, 0, &err);
    if (rc) test_fail(__FILE__, __LINE__, "forward: %s", err.msg);
    petrel_session_free(s);
    return rc;
}

/* tiered logits against the fully resident GPU path of the same model: bitwise, for HBM slots
 * fewer than a token's choices (waves in decode), fewer than a prompt's (waves in prefill) and
 * nearly all; host_slots > 0 streams the host side too (the expert store: RAM slots over the
 * pack); the counters add up. host_tol > 0: misses may run on the host CPU (host_experts), whose
 * results match within that relative error instead of bitwise, and some did. */
static void check_tiers(const char *model, const int *vslots, int nv, int host_slots, double host_tol) {
    petrel_engine *r = open_dev(model, "cuda", 0);
    if (!r) return;
    cu_tier_stats ts;
    cu_model_tier_stats(r->cu, &ts);
    CHECK_MSG(ts.slots == 0, "%s: resident on the GPU, yet tiered with %d slots", model, ts.slots);
    int V = r->cfg.vocab_size, T = 40, steps = 12;
    int32_t ids[40];
    for (int i = 0; i < T; i++) ids[i] = (i * 37 + 11) % V;
    float *lr = malloc(sizeof(float) * (size_t)(T + steps) * V), *lt = malloc(sizeof(float) * (size_t)(T + steps) * V);
    if (!run_mixed(r, ids, T, steps, lr))
        for (int k = 0; k < nv; k++) {
            petrel_engine *t = open_tiers(model, vslots[k], host_slots, host_tol > 0);
            if (!t) continue;
            memset(lt, 0, sizeof(float) * (size_t)(T + steps) * V);
            if (!run_mixed(t, ids, T, steps, lt)) {
                size_t bad = 0;
                for (size_t i = 0; i < (size_t)(T + steps) * V; i++) bad += memcmp(&lr[i], &lt[i], 4) != 0;
                double rel = test_rel_l2(lt, lr, (size_t)(T + steps) * V);
                if (host_tol > 0) CHECK_MSG(rel < host_tol, "%s, %d HBM slots, host experts: rel err %.3g vs the resident GPU path", model, vslots[k], rel);
                else CHECK_MSG(bad == 0, "%s, %d HBM slots, %d RAM slots: %zu logits differ from the resident GPU path (rel err %.3g)", model, vslots[k],
                               host_slots, bad, rel);
                cu_model_tier_stats(t->cu, &ts);
                CHECK_EQ_INT(ts.slots, vslots[k] < t->cfg.n_routed_experts ? vslots[k] : t->cfg.n_routed_experts);
                CHECK_MSG(ts.uses == ts.hits + ts.copies + ts.host && ts.copies > 0 && ts.bytes > 0, "%s: uses %llu, hits %llu, copies %llu, host %llu",
                          model, (unsigned long long)ts.uses, (unsigned long long)ts.hits, (unsigned long long)ts.copies, (unsigned long long)ts.host);
                CHECK_MSG((host_tol > 0) == (ts.host > 0), "%s: %llu misses ran on the host (host experts %s)", model, (unsigned long long)ts.host,
                          host_tol > 0 ? "on" : "off");
                if (vslots[k] < t->cfg.num_experts_per_tok) CHECK_MSG(ts.waves > 0, "%s: %d slots, no waves", model, vslots[k]);
                if (getenv("PETREL_TEST_VERBOSE"))
                    fprintf(stderr, "  %s %d/%d slots: uses %llu hits %llu copies %llu host %llu waves %llu, %.1f MB, rel err %.3g\n", model, vslots[k],
                            host_slots, (unsigned long long)ts.uses, (unsigned long long)ts.hits, (unsigned long long)ts.copies,
                            (unsigned long long)ts.host, (unsigned long long)ts.waves, ts.bytes / 1e6, rel);
            }
            petrel_engine_close(t);
        }
    free(lr), free(lt);
    petrel_engine_close(r);
}

TEST(cuda, tiers_bitwise) {
    if (!need_gpu()) return;
    const int vs[] = {1, 3, 12, 31};
    check_tiers(test_data("trained"), vs, 4, 0, 0);
    const int vf[] = {2, 9};
    check_tiers(test_data("tiny-fp8"), vf, 2, 0, 0); /* FP8 experts: expanded on the host */
}

/* misses computed on the host CPU (host_experts): bf16 experts take the host's exact f32 path,
 * within float rounding of the GPU; a q4 pack's row-interleaved experts its int8-activation
 * kernel, within quantization noise; streamed from the store as well */
TEST(cuda, tiers_host_experts) {
    if (!need_gpu()) return;
    const int vs[] = {4, 12};
    check_tiers(test_data("trained"), vs, 2, 0, 1e-5);
    const char *pk = test_pack_of("trained", CVQ_Q4);
    if (!pk) return;
    check_tiers(pk, vs, 2, 0, 0.05);
    check_tiers(pk, vs + 1, 1, 3, 0.05);
}

/* three tiers: a q4 pack (row-interleaved experts, unpacked on the GPU) whose host side
 * streams through the expert store (2 RAM slots per layer over the pack) */
TEST(cuda, tiers_streamed) {
    if (!need_gpu()) return;
    const char *pk = test_pack_of("trained", CVQ_Q4);
    if (!pk) return;
    const int vs[] = {2, 6, 20};
    check_tiers(pk, vs, 3, 2, 0);
    check_tiers(pk, vs + 1, 1, 0, 0);
}

/* trace-driven routing on the GPU (benchmarks' --route-trace): the trace's choices replace the
 * routers' as on the CPU (within 1e-5 of the CPU's exact path), tiered equal to resident bitwise,
 * and the trace changes the logits (it is applied) */
TEST(cuda, route_trace) {
    if (!need_gpu()) return;
    const char *tp = test_tmp("gpu-route.txt");
    FILE *fp = fopen(tp, "w");
    CHECK(fp != NULL);
    if (!fp) return;
    int L = 3, E = 32, K = 4, N = 64;
    fprintf(fp, "# petrel-trace v1 layers=%d experts=%d topk=%d tokens=%d\n", L, E, K, N);
    for (int t = 0; t < N; t++)
        for (int l = 0; l < L; l++) {
            fprintf(fp, "%d %d", t, l);
            int base = (t * 7 + l * 5) % E; /* K distinct experts, skewed towards low ids */
            for (int k = 0; k < K; k++) fprintf(fp, " %d", (base * (k + 1) + k * 3) % 8 + 8 * k);
            fprintf(fp, "\n");
        }
    fclose(fp);
    petrel_engine *e[4] = {NULL, NULL, NULL, NULL}; /* cpu exact, gpu, gpu tiered, gpu without the trace */
    petrel_error err = {0};
    for (int k = 0; k < 4; k++) {
        petrel_open_opts o = {0};
        o.device = k ? "cuda" : NULL;
        if (k == 0) o.act_quant = -1, o.relayout = -1;
        if (k == 2) o.vram_expert_slots = 6;
        if (k < 3) o.route_trace = tp;
        CHECK_MSG(petrel_engine_open(test_data("trained"), &o, &e[k], &err) == 0, "open %d: %s", k, err.msg);
    }
    if (e[0] && e[1] && e[2] && e[3]) {
        int V = e[0]->cfg.vocab_size, T = 40, steps = 12;
        size_t n = (size_t)(T + steps) * V;
        int32_t ids[40];
        for (int i = 0; i < T; i++) ids[i] = (i * 37 + 11) % V;
        float *lg[4];
        for (int k = 0; k < 4; k++) lg[k] = malloc(sizeof(float) * n);
        int ok = 1;
        for (int k = 0; k < 4 && ok; k++) ok = !run_mixed(e[k], ids, T, steps, lg[k]);
        if (ok) {
            double ec = test_rel_l2(lg[1], lg[0], n), en = test_rel_l2(lg[3], lg[1], n);
            CHECK_MSG(ec < 1e-5, "trace-driven routing: GPU vs CPU rel err %.3g", ec);
            CHECK_MSG(!memcmp(lg[1], lg[2], sizeof(float) * n), "trace-driven routing: tiered differs from resident (rel err %.3g)",
                      test_rel_l2(lg[2], lg[1], n));
            CHECK_MSG(en > 1e-3, "the trace changed nothing on the GPU (rel diff %.3g)", en);
        }
        for (int k = 0; k < 4; k++) free(lg[k]);
    }
    for (int k = 0; k < 4; k++) petrel_engine_close(e[k]);
}

/* what the GPU path refuses, and bad device names: one line, nothing opened (runs everywhere) */
TEST(cuda, refusals) {
    petrel_open_opts o = {0};
    petrel_engine *e = NULL;
    petrel_error err = {0};
    const char *bad[] = {"gpu", "cuda:", "cuda:x", "cuda:-1", "cudax"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        o.device = bad[i];
        CHECK_EQ_INT(petrel_engine_open(test_data("tiny"), &o, &e, &err), PETREL_EINVAL);
        CHECK(e == NULL && strstr(err.msg, "device") && !strchr(err.msg, '\n'));
    }
    o.device = "cuda";
    o.kv_type = "int8";
    CHECK_EQ_INT(petrel_engine_open(test_data("tiny"), &o, &e, &err), PETREL_EUNSUPPORTED);
    CHECK(e == NULL && strstr(err.msg, "KV"));
    o.kv_type = NULL;
    o.device = "cuda:1000";
    int rc = petrel_engine_open(test_data("tiny"), &o, &e, &err);
    CHECK(rc < 0 && e == NULL && !strchr(err.msg, '\n'));
    if (!cu_built()) CHECK(strstr(err.msg, "without CUDA") != NULL);
    o.device = "cpu";
    CHECK(petrel_engine_open(test_data("tiny"), &o, &e, &err) == 0 && e && !strcmp(petrel_engine_device(e), "cpu"));
    petrel_engine_close(e);
    e = NULL;
    /* the GPU's options without the GPU: refused, not ignored */
    for (int k = 0; k < 3; k++) {
        petrel_open_opts c = {0};
        if (k == 0) c.vram_budget = 1ull << 30;
        if (k == 1) c.vram_expert_slots = 8;
        if (k == 2) c.host_experts = 1;
        CHECK_EQ_INT(petrel_engine_open(test_data("tiny"), &c, &e, &err), PETREL_EINVAL);
        CHECK(e == NULL && strstr(err.msg, "--device cuda") && !strchr(err.msg, '\n'));
    }
}

/* on the GPU: what sessions cannot do there yet says so; a session's capacity holds */
TEST(cuda, session_limits) {
    if (!need_gpu()) return;
    petrel_engine *g = open_dev(test_data("trained"), "cuda", 0);
    if (!g) return;
    petrel_session *s;
    petrel_error err = {0};
    CHECK(petrel_session_create(g, 8, &s, &err) == 0);
    int32_t ids[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    CHECK_EQ_INT(petrel_session_forward(s, ids, 9, NULL, 0, &err), PETREL_ERANGE);
    CHECK(petrel_session_forward(s, ids, 4, NULL, 0, &err) == 0);
    CHECK_EQ_INT(petrel_session_save(s, test_tmp("cu.sess"), &err), PETREL_EUNSUPPORTED);
    CHECK(strstr(err.msg, "GPU") != NULL);
    /* a fork carries the GPU cache: both continue alike */
    petrel_session *f = NULL;
    CHECK(petrel_session_fork(s, &f, &err) == 0);
    int V = g->cfg.vocab_size;
    float *l1 = malloc(sizeof(float) * V), *l2 = malloc(sizeof(float) * V);
    CHECK(f && petrel_session_forward(s, ids + 4, 1, l1, 0, &err) == 0 && petrel_session_forward(f, ids + 4, 1, l2, 0, &err) == 0);
    CHECK_MSG(!memcmp(l1, l2, sizeof(float) * V), "a forked GPU session continues differently");
    petrel_session_free(f);
    free(l1), free(l2);
    CHECK(petrel_session_truncate(s, 2, &err) == 0);
    CHECK_EQ_INT(petrel_session_len(s), 2);
    CHECK(strstr(petrel_engine_device(g), "cuda:0") != NULL);
    petrel_session_free(s);
    petrel_engine_close(g);
}

/* the CLI's --device / --vram-budget: bad values fail with one line and exit 1 before loading;
 * a binary without CUDA says so (PETREL_BIN, as the cli group) */
TEST(cuda, cli_device) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset (make test sets it)"); return; }
    const char *bad[] = {"--device gpu", "--device cuda:", "--device cuda:1x", "--vram-budget 1.5G", "--vram-budget 0", "--device",
                         "--vram-expert-slots 0", "--vram-expert-slots x", "--vram-expert-slots", "--host-experts on"};
    char cmd[1024], out[4096], er[4096];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2 -n 2 %s", b, test_data("tiny"), bad[i]);
        CHECK_MSG(test_sh(cmd, out, sizeof out, er, sizeof er) == 1 && test_count_lines(er) == 1, "%s: want exit 1 and one line, got: %s", bad[i], er);
    }
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2 -n 2 --device cuda:999", b, test_data("tiny"));
    CHECK_MSG(test_sh(cmd, out, sizeof out, er, sizeof er) == 1 && test_count_lines(er) == 1, "cuda:999: %s", er);
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2 -n 2 --device cpu", b, test_data("tiny"));
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, er, sizeof er), 0);
}
