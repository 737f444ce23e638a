/* test_tiles.c (named so that the Makefile does not build it with the *_amx ISA flags): the AMX kernels (src/kernels/r16_amx.c) against the AVX-512 VNNI ones, bitwise.
 * R16 products (q8_g32 / q4_g64, bf16 / f16 / f32 scales) on random shapes: block counts odd and
 * even, group counts across the kernel's K chunks, row counts 1..200 (every one on AMX
 * hardware), tails of the 16-row tiles, one row alone vs the batch, mixed kn_matmul_many calls
 * where some jobs are under the AMX row threshold; whole forwards of q4 / q8 packs with isa amx
 * vs avx512 (logits bitwise). The same kernel source is also built with its tile instructions
 * emulated ("amx-emu", r16_amxemu_avx512.c), so every CPU with AVX-512 VNNI checks the kernel's
 * logic; the tests that need the real tile units skip (with the count the runner prints) on
 * CPUs without AMX. The AMX-BF16 option is checked against the f32 reference with a tolerance
 * (it is not exact). */
#include <stdlib.h>
#include <string.h>

#include "io/convert.h"
#include "io/safetensors.h"
#include "kernels/kernels.h"
#include "kernels/kn_internal.h"
#include "model/engine.h"
#include "quant/quant.h"
#include "test.h"

static uint64_t rs = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 32);
}
static float frand(void) { return (float)rnd() / 4294967296.0f * 2.f - 1.f; }

typedef struct { pt_wview v; void *d, *s; } mat;

/* Random R16 weights (data one byte off alignment on purpose), scales of dtype sdt. */
static mat mk(pt_qtype q, int64_t rows, int64_t cols, int sdt) {
    mat m;
    int g = q == PT_Q4_G64 ? 64 : 32;
    int64_t rb = q == PT_Q4_G64 ? cols / 2 : cols, ns = rows * (cols / g);
    m.d = malloc((size_t)(rows * rb) + 1);
    size_t es = sdt == PT_F32 ? 4 : 2;
    m.s = malloc((size_t)ns * es);
    uint8_t *d = (uint8_t *)m.d + 1;
    for (int64_t i = 0; i < rows * rb; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < ns; i++) {
        float s = (0.5f + 0.5f * (float)(rnd() % 1000) / 1000.f) * 0.02f;
        if (sdt == PT_F32) ((float *)m.s)[i] = s;
        else if (sdt == PT_F16) ((uint16_t *)m.s)[i] = pt_f32_to_f16(s);
        else ((uint16_t *)m.s)[i] = pt_f32_to_bf16(s);
    }
    m.v = pt_wview_make(q, rows, cols, d, m.s, sdt);
    if (kn_r16_repack(&m.v)) test_fail(__FILE__, __LINE__, "repack failed");
    return m;
}
static void mfree(mat *m) { free(m->d); free(m->s); }

static float *mkx(int n, int64_t cols) {
    float *x = malloc(sizeof(float) * (size_t)n * (size_t)cols);
    for (int64_t i = 0; i < n * cols; i++) x[i] = frand() * (1.f + (float)(i % 7));
    if (cols >= 64) for (int j = 0; j < 32; j++) x[j] = 0.f; /* a zero group in row 0 */
    return x;
}

/* y under isa (AMX threshold 1) vs under avx512, bitwise; returns 1 if equal. */
static int same(const char *isa, const pt_wview *W, const float *x, int n) {
    size_t yb = sizeof(float) * (size_t)n * (size_t)W->rows;
    float *a = malloc(yb), *b = malloc(yb);
    memset(a, 0x7f, yb);
    memset(b, 0x3f, yb);
    kn_force_isa("avx512");
    kn_matmul(W, x, n, a);
    kn_force_isa(isa);
    kn_set_amx_min_rows(1);
    kn_matmul(W, x, n, b);
    kn_set_amx_min_rows(KN_AMX_MIN_ROWS);
    kn_force_isa("auto");
    int ok = !memcmp(a, b, yb);
    if (!ok)
        for (size_t i = 0; i < yb / 4; i++)
            if (memcmp(a + i, b + i, 4)) {
                fprintf(stderr, "  %s %s [%lld x %lld] n %d: first difference at row %zu col %zu: %.9g vs avx512 %.9g\n", isa,
                        pt_qtype_name(W->qtype), (long long)W->rows, (long long)W->cols, n, i / (size_t)W->rows, i % (size_t)W->rows, b[i], a[i]);
                break;
            }
    free(a);
    free(b);
    return ok;
}

/* The shape sweep: formats x scale dtypes x block counts x group counts (across the 1 KB K
 * chunks) x row counts with tile tails. */
static void sweep(const char *isa, const int *ns, int nn) {
    static const pt_qtype Q[] = {PT_Q8_G32, PT_Q4_G64};
    static const int SD[] = {PT_BF16, PT_F16, PT_F32};
    static const int64_t RB[] = {1, 2, 3, 5};   /* 16-row blocks */
    static const int64_t G[] = {1, 3, 17, 33};  /* groups per row */
    int k = 0, bad = 0, runs = 0;
    for (int qi = 0; qi < 2; qi++)
        for (int bi = 0; bi < 4; bi++)
            for (int gi = 0; gi < 4; gi++, k++) {
                int g = Q[qi] == PT_Q4_G64 ? 64 : 32;
                mat m = mk(Q[qi], RB[bi] * 16, G[gi] * g, SD[k % 3]);
                for (int t = 0; t < nn; t++) {
                    int n = ns[(t + k) % nn];
                    if (t >= 3) break; /* three row counts per shape */
                    float *x = mkx(n, m.v.cols);
                    bad += !same(isa, &m.v, x, n);
                    runs++;
                    free(x);
                }
                mfree(&m);
            }
    CHECK_MSG(bad == 0, "%s: %d of %d products differ from avx512", isa, bad, runs);
}

static const int NS[] = {1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 64, 100, 129, 200};
#define NNS (int)(sizeof NS / sizeof NS[0])

TEST(amx, emu_bitwise) {
    kn_table t;
    if (kn_table_init(&t, "amx-emu", 0, 0) < 0) { test_skip("no AVX-512 VNNI: neither kernel runs here"); return; }
    sweep("amx-emu", NS, NNS);
}

TEST(amx, bitwise) {
    if (!kn_amx_available()) { test_skip("this CPU (or OS) has no AMX-INT8; amx.emu_bitwise ran the kernel emulated"); return; }
    sweep("amx", NS, NNS);
    /* every row count 1..200 on two shapes (odd block count, groups across chunks) */
    mat a = mk(PT_Q8_G32, 48, 33 * 32, PT_BF16), b = mk(PT_Q4_G64, 80, 17 * 64, PT_BF16);
    float *x = mkx(200, 33 * 32);
    int bad = 0;
    for (int n = 1; n <= 200; n++) bad += !same("amx", &a.v, x, n) + !same("amx", &b.v, x, n);
    CHECK_MSG(bad == 0, "amx: %d of 400 row counts differ from avx512", bad);
    free(x);
    mfree(&a);
    mfree(&b);
}

/* Row i of a batch is row i alone; kn_matmul_many mixing AMX-sized and small jobs on one x (the
 * threshold at its default) gives each job what kn_matmul gives. */
static void rows_and_many(const char *isa) {
    mat m = mk(PT_Q4_G64, 64, 5 * 64, PT_BF16), m8 = mk(PT_Q8_G32, 32, 9 * 32, PT_F32);
    int n = 37;
    float *x = mkx(n, 5 * 64), *x8 = mkx(n, 9 * 32);
    float *y = malloc(sizeof(float) * 64 * n), *y1 = malloc(sizeof(float) * 64);
    kn_force_isa(isa);
    kn_set_amx_min_rows(1);
    kn_matmul(&m.v, x, n, y);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        kn_matmul(&m.v, x + i * 5 * 64, 1, y1);
        bad += memcmp(y1, y + i * 64, sizeof(float) * 64) != 0;
    }
    CHECK_MSG(bad == 0, "%s: %d rows differ alone vs in a batch of %d", isa, bad, n);
    kn_set_amx_min_rows(KN_AMX_MIN_ROWS);
    float *j0 = malloc(sizeof(float) * 64 * n), *j1 = malloc(sizeof(float) * 64 * 8), *j2 = malloc(sizeof(float) * 32 * n),
          *r1 = malloc(sizeof(float) * 64 * 8), *r2 = malloc(sizeof(float) * 32 * n);
    kn_job jobs[3] = {{&m.v, x, n, j0}, {&m.v, x, 8, j1}, {&m8.v, x8, n, j2}};
    kn_matmul_many(jobs, 3);
    kn_matmul(&m.v, x, 8, r1);
    kn_matmul(&m8.v, x8, n, r2);
    CHECK(!memcmp(j0, y, sizeof(float) * 64 * n));
    CHECK(!memcmp(j1, r1, sizeof(float) * 64 * 8) && !memcmp(j1, y, sizeof(float) * 64 * 8));
    CHECK(!memcmp(j2, r2, sizeof(float) * 32 * n));
    CHECK(same(isa, &m8.v, x8, n));
    kn_force_isa("auto");
    free(x); free(x8); free(y); free(y1); free(j0); free(j1); free(j2); free(r1); free(r2);
    mfree(&m);
    mfree(&m8);
}

TEST(amx, rows_and_many_emu) {
    kn_table t;
    if (kn_table_init(&t, "amx-emu", 0, 0) < 0) { test_skip("no AVX-512 VNNI"); return; }
    rows_and_many("amx-emu");
}

TEST(amx, rows_and_many) {
    if (!kn_amx_available()) { test_skip("this CPU (or OS) has no AMX-INT8"); return; }
    rows_and_many("amx");
}

/* Dispatch: "amx" only where the CPU and OS have it (never silently replaced), "avx512" forbids
 * it, "auto" takes it where available; an engine asked for amx on a CPU without says so. */
TEST(amx, dispatch) {
    kn_table t;
    int have = kn_amx_available();
    CHECK_EQ_INT(kn_table_init(&t, "amx", 0, 0) == 0, have);
    if (have) CHECK(t.amx == 1 && !t.amx_bf16 && !strcmp(kt_isa_name(&t), "amx") && t.amx_min_rows == KN_AMX_MIN_ROWS);
    CHECK_EQ_INT(kn_table_init(&t, "amx-bf16", 0, 0) == 0, kn_amx_bf16_available());
    if (kn_table_init(&t, "avx512", 0, 0) == 0) CHECK(t.amx == 0 && t.amx_bf16 == 0 && !strcmp(kt_isa_name(&t), "avx512"));
    CHECK(kn_table_init(&t, "auto", 0, 0) == 0);
    CHECK_EQ_INT(t.amx, have);
    CHECK(t.amx_bf16 == 0); /* never by default: not exact */
    CHECK_EQ_INT(kn_force_isa("amx") == 0, have);
    kn_force_isa("auto");
    if (!have) {
        petrel_engine *e = NULL;
        petrel_error err = {0};
        petrel_open_opts o = {0};
        o.isa = "amx";
        CHECK(petrel_engine_open(test_data("tiny"), &o, &e, &err) != 0 && !e);
        CHECK_MSG(strstr(err.msg, "AMX") != NULL, "error: %s", err.msg);
        char out[4096], er[4096], cmd[1024];
        const char *b = getenv("PETREL_BIN");
        if (b) {
            snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2 -n 2 --isa amx", b, test_data("tiny"));
            CHECK_EQ_INT(test_sh(cmd, out, sizeof out, er, sizeof er), 1);
            CHECK_MSG(strstr(er, "AMX") != NULL, "stderr: %s", er);
        }
    }
}

/* Whole forwards: a q4 and a q8 pack, one pass over the golden prompts, isa X vs avx512
 * (threshold 1, so every product of the forward runs on tiles): logits bitwise equal. */
static void engine_same(const char *isa) {
    static const struct { const char *fx; int q; } P[] = {{"tiny", CVQ_Q4}, {"odd", CVQ_Q8}, {"trained", CVQ_Q4}};
    for (int p = 0; p < 3; p++) {
        const char *pk = test_pack_of(P[p].fx, P[p].q);
        if (!pk) return;
        petrel_error err = {0};
        petrel_open_opts oa = {0}, ob = {0};
        oa.isa = "avx512";
        ob.isa = isa;
        petrel_engine *a = NULL, *b = NULL;
        CHECK(petrel_engine_open(pk, &oa, &a, &err) == 0 && petrel_engine_open(pk, &ob, &b, &err) == 0);
        if (!a || !b) { petrel_engine_close(a); petrel_engine_close(b); return; }
        b->kt.amx_min_rows = 1;
        char gp[600];
        snprintf(gp, sizeof gp, "%s/golden.safetensors", test_data(P[p].fx));
        st_set *g;
        if (st_open(gp, &g, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
        int V = a->cfg.vocab_size, checked = 0;
        for (int pi = 0; pi < 3; pi++) {
            const st_tensor *t = test_gold(g, pi, "ids");
            if (!t) break;
            int T = (int)t->shape[0];
            float *la = malloc(sizeof(float) * (size_t)T * V), *lb = malloc(sizeof(float) * (size_t)T * V);
            petrel_session *sa = NULL, *sb = NULL;
            CHECK(petrel_session_create(a, T, &sa, &err) == 0 && petrel_session_create(b, T, &sb, &err) == 0);
            if (sa && sb) {
                CHECK(petrel_session_forward(sa, (const int32_t *)t->data, T, la, 1, &err) == 0);
                CHECK(petrel_session_forward(sb, (const int32_t *)t->data, T, lb, 1, &err) == 0);
                CHECK_MSG(!memcmp(la, lb, sizeof(float) * (size_t)T * V), "%s pack %s prompt %d (T=%d): %s logits differ from avx512", P[p].fx,
                          P[p].q == CVQ_Q4 ? "q4" : "q8", pi, T, isa);
                checked++;
            }
            petrel_session_free(sa);
            petrel_session_free(sb);
            free(la);
            free(lb);
        }
        CHECK(checked > 0);
        st_close(g);
        petrel_engine_close(a);
        petrel_engine_close(b);
    }
}

TEST(amx, engine_bitwise_emu) {
    kn_table t;
    if (kn_table_init(&t, "amx-emu", 0, 0) < 0) { test_skip("no AVX-512 VNNI"); return; }
    engine_same("amx-emu");
}

TEST(amx, engine_bitwise) {
    if (!kn_amx_available()) { test_skip("this CPU (or OS) has no AMX-INT8"); return; }
    engine_same("amx");
}

/* AMX-BF16 (an option, not exact): bf16 weights against bf16-rounded activations, within the
 * bound of that rounding: |y - y_f32| <= 2^-8 sum |w x| (+ the f32 sums' own error). */
static void bf16_close(const char *isa) {
    static const int64_t R[] = {16, 40, 3}, C[] = {32, 100, 7};
    static const int N[] = {1, 17, 40};
    int bad = 0;
    for (int k = 0; k < 9; k++) {
        int64_t rows = R[k % 3], cols = C[k / 3];
        int n = N[(k + 1) % 3];
        uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(rows * cols));
        for (int64_t i = 0; i < rows * cols; i++) w[i] = pt_f32_to_bf16(frand());
        pt_wview W = pt_wview_make(PT_BF16, rows, cols, (const uint8_t *)w, NULL, 0);
        float *x = mkx(n, cols), *y = malloc(sizeof(float) * (size_t)(n * rows)), *yr = malloc(sizeof(float) * (size_t)(n * rows));
        kn_force_isa(isa);
        kn_set_amx_min_rows(1);
        kn_matmul(&W, x, n, y);
        kn_set_amx_min_rows(KN_AMX_MIN_ROWS);
        kn_force_isa("auto");
        kn_ref_matmul(&W, x, n, yr);
        for (int i = 0; i < n; i++)
            for (int64_t r = 0; r < rows; r++) {
                double mag = 0;
                for (int64_t c = 0; c < cols; c++) mag += fabs((double)pt_bf16_to_f32(w[r * cols + c]) * x[i * cols + c]);
                if (!(fabs((double)y[i * rows + r] - yr[i * rows + r]) <= mag / 256 + 1e-6)) bad++;
            }
        free(w); free(x); free(y); free(yr);
    }
    CHECK_MSG(bad == 0, "%s: %d bf16 outputs off the f32 reference by more than the bf16 rounding allows", isa, bad);
}

TEST(amx, bf16_emu) {
    kn_table t;
    if (kn_table_init(&t, "amx-emu", 0, 0) < 0) { test_skip("no AVX-512 VNNI"); return; }
    bf16_close("amx-emu");
}

TEST(amx, bf16) {
    if (!kn_amx_bf16_available()) { test_skip("this CPU (or OS) has no AMX-BF16"); return; }
    bf16_close("amx-bf16");
}
