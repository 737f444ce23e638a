/* test_kernels.c: every kernel against its scalar reference, at every ISA level this machine
 * has, on fresh random inputs: odd sizes and tails, NaN-poisoned outputs, unaligned pointers,
 * batches n in {1,2,3,5,8,17}, bitwise row independence (batch and thread count), the thread
 * pool, and the vector helpers. Seeds come from the clock and are printed on failure. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/pool.h"
#include "kernels/kernels.h"
#include "kernels/kn_internal.h"
#include "quant/quant.h"
#include "test.h"

static uint64_t rng_state;
static uint64_t rng_seed(void) {
    rng_state = ((uint64_t)time(NULL) ^ (uint64_t)clock() << 20) * 0x9E3779B97F4A7C15ull | 1;
    return rng_state;
}
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}
static float frand(void) { return (float)rnd() / 4294967296.0f * 2.f - 1.f; }

static const char *ISAS[] = {"scalar", "avx2", "avx512"};
#define NISA 3

/* A random weight in some format, held in malloc'd buffers at deliberately odd offsets. */
typedef struct {
    pt_wview v;
    void *data_alloc, *scale_alloc;
} tw;

static void tw_free(tw *t) { free(t->data_alloc); free(t->scale_alloc); }

static tw tw_make(pt_qtype q, int64_t rows, int64_t cols, int scale_dt, int fp8_br, int fp8_bc) {
    tw t;
    memset(&t, 0, sizeof t);
    int64_t rb = pt_qtype_row_bytes(q, cols);
    /* misalign: by one element (4 bytes for f32, 2 for 16-bit, 1 for byte formats) */
    int64_t off = q == PT_F32 ? 4 : (q == PT_BF16 || q == PT_F16) ? 2 : 1;
    t.data_alloc = malloc((size_t)(rb * rows + off + 64));
    uint8_t *d = (uint8_t *)t.data_alloc + off;
    int sdt_bytes = scale_dt == PT_F32 ? 4 : 2;
    float *wrow = malloc((size_t)(cols > 0 ? cols : 1) * 4);
    if (q == PT_FP8_E4M3) {
        for (int64_t i = 0; i < rb * rows; i++) {
            uint8_t b = (uint8_t)rnd();
            if ((b & 0x7f) == 0x7f) b = 0x10; /* the NaN pattern decodes differently (doc'd) */
            d[i] = b;
        }
        int64_t sr = (rows + fp8_br - 1) / fp8_br, scols = (cols + fp8_bc - 1) / fp8_bc;
        t.scale_alloc = malloc((size_t)(sr * scols + 1) * (size_t)sdt_bytes);
        for (int64_t i = 0; i < sr * scols; i++) {
            float s = (0.5f + frand() * 0.4f) * 0.01f;
            if (scale_dt == PT_BF16) ((uint16_t *)t.scale_alloc)[i + 1] = pt_f32_to_bf16(s);
            else ((float *)t.scale_alloc)[i + 1] = s;
        }
        t.v.qtype = q; t.v.rows = rows; t.v.cols = cols; t.v.data = d; t.v.row_bytes = rb;
        t.v.scale = (uint8_t *)t.scale_alloc + sdt_bytes;
        t.v.scale_dtype = scale_dt;
        t.v.block_rows = fp8_br; t.v.block_cols = fp8_bc; t.v.scale_cols = scols;
    } else {
        int64_t spr = pt_qtype_scales_per_row(q, cols);
        t.scale_alloc = malloc((size_t)(spr * rows + 1) * (size_t)sdt_bytes);
        void *sc = (uint8_t *)t.scale_alloc + sdt_bytes;
        for (int64_t r = 0; r < rows; r++) {
            float amp = 0.2f + (float)(rnd() % 8);
            for (int64_t j = 0; j < cols; j++) wrow[j] = frand() * amp;
            pt_quant_row(q, wrow, cols, d + r * rb,
                         spr ? (uint8_t *)sc + r * spr * sdt_bytes : NULL, scale_dt);
        }
        t.v = pt_wview_make(q, rows, cols, d, spr ? sc : NULL, scale_dt);
    }
    free(wrow);
    return t;
}

/* x[n][cols] at an odd float offset. */
static float *xalloc(int n, int64_t cols, float **base) {
    *base = malloc((size_t)(n * cols + 3) * 4);
    float *x = *base + 1;
    for (int64_t i = 0; i < n * cols; i++) x[i] = frand() * 2.f;
    return x;
}
static float *yalloc(int n, int64_t rows, float **base) {
    *base = malloc((size_t)(n * rows + 3) * 4);
    float *y = *base + 3;
    for (int64_t i = 0; i < n * rows; i++) y[i] = NAN; /* poison */
    return y;
}

/* Compares kn_matmul at the current ISA to the reference: |y - ref| <= 1e-5 * sum_j |w_j x_j|
 * (+ 1e-6 |ref|): reordering a sum of m terms in f32 moves it by a few ulps of the sum of
 * magnitudes. Returns the number of bad elements. */
static int compare_mm(const pt_wview *W, const float *x, int n, const float *y) {
    float *yr = malloc((size_t)(n * W->rows) * 4), *row = malloc((size_t)(W->cols + 1) * 4);
    kn_ref_matmul(W, x, n, yr);
    int bad = 0;
    for (int64_t r = 0; r < W->rows; r++) {
        pt_dequant_row(W, r, row);
        for (int i = 0; i < n; i++) {
            double mag = 0;
            for (int64_t j = 0; j < W->cols; j++) mag += fabs((double)row[j] * x[i * W->cols + j]);
            float a = y[i * W->rows + r], b = yr[i * W->rows + r];
            double tol = 1e-5 * mag + 1e-6 * fabs(b) + 1e-30;
            if (!(fabs((double)a - b) <= tol)) {
                if (bad < 3)
                    fprintf(stderr, "  %s r=%lld i=%d: %.9g vs ref %.9g (tol %g)\n",
                            pt_qtype_name(W->qtype), (long long)r, i, a, b, tol);
                bad++;
            }
        }
    }
    free(yr); free(row);
    return bad;
}

typedef struct { pt_qtype q; int sdt, br, bc; } fmt_case;
static const fmt_case FMTS[] = {
    {PT_F32, 0, 0, 0},          {PT_BF16, 0, 0, 0},          {PT_F16, 0, 0, 0},
    {PT_FP8_E4M3, PT_F32, 128, 128}, {PT_FP8_E4M3, PT_BF16, 3, 32},
    {PT_Q8_ROW, PT_F32, 0, 0},  {PT_Q8_ROW, PT_BF16, 0, 0},
    {PT_Q8_G32, PT_BF16, 0, 0}, {PT_Q8_G32, PT_F16, 0, 0},
    {PT_Q4_G64, PT_BF16, 0, 0}, {PT_Q4_G64, PT_F32, 0, 0},  {PT_Q4_G64, PT_F16, 0, 0},
};
#define NFMT (int)(sizeof FMTS / sizeof FMTS[0])
static const int64_t COLS[] = {1, 7, 31, 33, 63, 65, 127, 129, 1000, 6144};
static const int64_t ROWS[] = {1, 3, 17, 256};
static const int NS[] = {1, 2, 3, 5, 8, 17};

TEST(kernels, force_isa) {
    CHECK(kn_force_isa("scalar") == 0);
    CHECK(!strcmp(kn_isa_name(), "scalar"));
    CHECK(kn_force_isa("bogus") < 0);
    CHECK((kn_force_isa("amx") == 0) == kn_amx_available()); /* tests/test_amx.c */
    CHECK(kn_force_isa("scalar") == 0);
    int have512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    CHECK((kn_force_isa("avx512") == 0) == have512);
    CHECK(kn_force_isa("auto") == 0);
    CHECK(kn_threads() >= 1);
}

TEST(kernels, matmul_vs_ref) {
    uint64_t seed = rng_seed();
    int k = 0;
    int aq_saved = kn_act_quant();
    kn_set_act_quant(0); /* exact f32 activations: compared to the f32 reference */
    for (int isa = 0; isa < NISA; isa++) {
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (int f = 0; f < NFMT; f++)
            for (int ci = 0; ci < 10; ci++)
                for (int ri = 0; ri < 4; ri++, k++) {
                    int64_t cols = COLS[ci], rows = ROWS[ri];
                    int n = NS[k % 6];
                    while (n > 1 && rows * cols * n > 300000) n = n > 2 ? 2 : 1; /* keep it quick */
                    if (rows * cols > 300000) rows = 17;
                    tw t = tw_make(FMTS[f].q, rows, cols, FMTS[f].sdt ? FMTS[f].sdt : PT_F32,
                                   FMTS[f].br, FMTS[f].bc);
                    float *xb, *yb, *x = xalloc(n, cols, &xb), *y = yalloc(n, rows, &yb);
                    kn_matmul(&t.v, x, n, y);
                    int bad = compare_mm(&t.v, x, n, y);
                    CHECK_MSG(bad == 0, "%s %s sdt %d rows %lld cols %lld n %d: %d bad (seed %llu)",
                              ISAS[isa], pt_qtype_name(FMTS[f].q), FMTS[f].sdt, (long long)rows,
                              (long long)cols, n, bad, (unsigned long long)seed);
                    free(xb); free(yb); tw_free(&t);
                }
    }
    kn_force_isa("auto");
    kn_set_act_quant(aq_saved);
}

/* Row i of a batch of 17 equals the same row computed alone, bitwise; and the thread count
 * does not change anything either. */
TEST(kernels, row_independence) {
    uint64_t seed = rng_seed();
    const int64_t shapes[][2] = {{37, 1000}, {40, 129}, {5, 6144}};
    int aq_saved = kn_act_quant();
    for (int aq = 0; aq <= 2; aq += 2)
    for (int isa = 0; isa < NISA; isa++) {
        kn_set_act_quant(aq);
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (int f = 0; f < NFMT; f++)
            for (int si = 0; si < 3; si++) {
                int64_t rows = shapes[si][0], cols = shapes[si][1];
                const int n = 17;
                tw t = tw_make(FMTS[f].q, rows, cols, FMTS[f].sdt ? FMTS[f].sdt : PT_F32,
                               FMTS[f].br, FMTS[f].bc);
                float *xb, *yb, *y1b, *x = xalloc(n, cols, &xb), *y = yalloc(n, rows, &yb);
                float *y1 = yalloc(1, rows, &y1b);
                kn_matmul(&t.v, x, n, y);
                int bad = 0;
                for (int i = 0; i < n; i += 3) {
                    kn_matmul(&t.v, x + i * cols, 1, y1);
                    bad += memcmp(y1, y + i * rows, (size_t)rows * 4) != 0;
                    if (i == 6) { /* batch of 2 starting mid-way */
                        float *y2b, *y2 = yalloc(2, rows, &y2b);
                        kn_matmul(&t.v, x + i * cols, 2, y2);
                        bad += memcmp(y2, y + i * rows, (size_t)rows * 8) != 0;
                        free(y2b);
                    }
                }
                CHECK_MSG(bad == 0, "%s %s rows %lld cols %lld: %d rows differ (seed %llu)",
                          ISAS[isa], pt_qtype_name(FMTS[f].q), (long long)rows, (long long)cols,
                          bad, (unsigned long long)seed);
                free(xb); free(yb); free(y1b); tw_free(&t);
            }
    }
    kn_set_act_quant(2);
    /* thread count: 1 vs 3 threads, a shape with many tasks (int8 and f32 activations) */
    tw t = tw_make(PT_Q4_G64, 515, 1000, PT_BF16, 0, 0);
    float *xb, *yb, *y3b, *x = xalloc(5, 1000, &xb), *y = yalloc(5, 515, &yb),
          *y3 = yalloc(5, 515, &y3b);
    kn_force_isa("auto");
    int before = kn_threads();
    kn_init(1);
    kn_matmul(&t.v, x, 5, y);
    kn_init(3);
    kn_matmul(&t.v, x, 5, y3);
    CHECK(memcmp(y, y3, 515 * 5 * 4) == 0);
    kn_set_act_quant(0);
    kn_init(1);
    kn_matmul(&t.v, x, 5, y);
    kn_init(3);
    kn_matmul(&t.v, x, 5, y3);
    CHECK(memcmp(y, y3, 515 * 5 * 4) == 0);
    kn_set_act_quant(aq_saved);
    kn_init(before);
    free(xb); free(yb); free(y3b); tw_free(&t);
}

/* ---- thread pool ---- */
typedef struct { _Atomic int *hits; int n_threads; _Atomic int bad; pt_pool *p; } pool_ctx;
static void pool_fn(void *c, int task, int thread) {
    pool_ctx *pc = c;
    if (thread < 0 || thread >= pc->n_threads) atomic_fetch_add(&pc->bad, 1);
    atomic_fetch_add(&pc->hits[task], 1);
}
static void nested_fn(void *c, int task, int thread) {
    pool_ctx *pc = c;
    (void)thread;
    if (task == 0) { /* a nested run goes inline */
        _Atomic int h[4] = {0, 0, 0, 0};
        pool_ctx inner = {h, pc->n_threads, 0, pc->p};
        pool_run(pc->p, 4, pool_fn, &inner);
        for (int i = 0; i < 4; i++) if (h[i] != 1) atomic_fetch_add(&pc->bad, 1);
    }
    atomic_fetch_add(&pc->hits[task], 1);
}
static void *pool_thread(void *arg) {
    pool_ctx *pc = arg;
    for (int rep = 0; rep < 200; rep++) {
        _Atomic int h[7] = {0};
        pool_ctx c = {h, pc->n_threads, 0, pc->p};
        pool_run(pc->p, 7, pool_fn, &c);
        for (int i = 0; i < 7; i++) if (h[i] != 1) atomic_fetch_add(&pc->bad, 1);
        if (c.bad) atomic_fetch_add(&pc->bad, 1);
    }
    return NULL;
}

/* A prompt chunk's activations are prepared by the pool in row ranges when a product is large
 * (dispatch.c, PREP_SPLIT_MIN values): every row's result bitwise the row run alone (which is
 * prepared whole on the calling thread), for the R16 kernels (q8, q4), the int8-activation kernel
 * of plain q4 and the emulated AMX kernel, at row counts that split unevenly. */
TEST(kernels, prep_split_invisible) {
    if (kn_threads() < 2) { test_skip("one thread: the preparation is never split"); return; }
    const char *isas[] = {"auto", "amx-emu"};
    const int ns[] = {48, 37, 200};
    int ran = 0;
    for (int ii = 0; ii < 2; ii++) {
        kn_table t;
        if (kn_table_init(&t, isas[ii], 0, 0) < 0) continue;
        t.amx_min_rows = 1;
        for (int f = 0; f < 3; f++) {
            pt_qtype q = f == 0 ? PT_Q8_G32 : PT_Q4_G64;
            tw w = tw_make(q, 48, 4096, PT_BF16, 0, 0);
            if (f < 2 && kt_r16_available(&t)) CHECK(kn_r16_repack(&w.v) == 0); /* f == 2: plain q4, int8 activations */
            for (int k = 0; k < 3; k++) {
                int n = ns[k];
                float *xb, *yb, *y1b, *x = xalloc(n, 4096, &xb), *y = yalloc(n, 48, &yb), *y1 = yalloc(1, 48, &y1b);
                kt_matmul(&t, &w.v, x, n, y);
                int bad = 0;
                for (int i = 0; i < n; i++) {
                    kt_matmul(&t, &w.v, x + (int64_t)i * 4096, 1, y1);
                    bad += memcmp(y1, y + (int64_t)i * 48, 48 * 4) != 0;
                }
                CHECK_MSG(bad == 0, "%s %s (%s) n=%d: %d rows differ from the row alone", isas[ii], pt_qtype_name(q),
                          w.v.layout == PT_LAYOUT_R16 ? "r16" : "plain", n, bad);
                ran++;
                free(xb), free(yb), free(y1b);
            }
            tw_free(&w);
        }
    }
    CHECK(ran >= 9);
    /* a set of experts: many small parts (16 rows each), together over the split threshold */
    kn_table t;
    CHECK_EQ_INT(kn_table_init(&t, NULL, 0, 0), 0);
    enum { NJ = 12, NR = 16 };
    tw w[NJ];
    kn_job jobs[NJ];
    float *xb[NJ], *yb[NJ];
    for (int j = 0; j < NJ; j++) {
        w[j] = tw_make(j % 2 ? PT_Q4_G64 : PT_Q8_G32, 32, 2048, PT_BF16, 0, 0);
        if (kt_r16_available(&t) && j % 3) CHECK(kn_r16_repack(&w[j].v) == 0);
        jobs[j] = (kn_job){&w[j].v, xalloc(NR, 2048, &xb[j]), NR, yalloc(NR, 32, &yb[j])};
    }
    kt_matmul_many(&t, jobs, NJ);
    int bad = 0;
    for (int j = 0; j < NJ; j++) {
        float *y1b, *y1 = yalloc(NR, 32, &y1b);
        kt_matmul(&t, &w[j].v, jobs[j].x, NR, y1);
        bad += memcmp(y1, jobs[j].y, sizeof(float) * NR * 32) != 0;
        free(y1b), free(xb[j]), free(yb[j]);
        tw_free(&w[j]);
    }
    CHECK_MSG(bad == 0, "%d of %d jobs of a set differ from the job alone", bad, NJ);
}

TEST(kernels, pool) {
    for (int nt = 1; nt <= 4; nt++) {
        pt_pool *p = pool_create(nt);
        CHECK(p != NULL);
        CHECK_EQ_INT(pool_threads(p), nt);
        _Atomic int hits[1000];
        for (int rep = 0; rep < 300; rep++) {
            int nt_tasks = 1 + rep % 37 + (rep == 7 ? 900 : 0);
            for (int i = 0; i < nt_tasks; i++) hits[i] = 0;
            pool_ctx c = {hits, nt, 0, p};
            pool_run(p, nt_tasks, pool_fn, &c);
            int bad = c.bad;
            for (int i = 0; i < nt_tasks; i++) bad += hits[i] != 1;
            CHECK_EQ_INT(bad, 0);
        }
        _Atomic int h2[8] = {0};
        pool_ctx c2 = {h2, nt, 0, p};
        pool_run(p, 8, nested_fn, &c2);
        CHECK_EQ_INT(c2.bad, 0);
        for (int i = 0; i < 8; i++) CHECK_EQ_INT(h2[i], 1);
        /* two application threads sharing the pool */
        pool_ctx shared = {NULL, nt, 0, p};
        pthread_t th;
        pthread_create(&th, NULL, pool_thread, &shared);
        pool_thread(&shared);
        pthread_join(th, NULL);
        CHECK_EQ_INT(shared.bad, 0);
        pool_destroy(p);
    }
    pool_run(NULL, 3, pool_fn, &(pool_ctx){(_Atomic int[3]){0, 0, 0}, 1, 0, NULL});
}

/* ---- vector helpers ---- */
static const int64_t HN[] = {1, 7, 15, 16, 17, 31, 33, 100, 1000, 6144};

/* kn_argmax against the scalar rule on values built to tie: few distinct levels (so the maximum
 * repeats, within and across 16-lane vectors), -0 beside +0, infinities, NaNs in front, behind
 * and everywhere; every length 1..70 plus a vocabulary's; every table the same index. */
TEST(kernels, argmax_vs_ref) {
    static const float lv[] = {-1.5f, 0.f, -0.f, 2.f, 2.f, INFINITY, -INFINITY, NAN, 3.25f, -7.f};
    const int64_t big = 154880;
    float *x = malloc(sizeof(float) * (size_t)big);
    for (int isa = 0; isa < NISA; isa++) {
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (int trial = 0; trial < 400; trial++) {
            int64_t n = trial < 350 ? 1 + trial % 70 : big;
            int mode = trial % 7, levels = 2 + trial % 9;
            for (int64_t j = 0; j < n; j++) {
                x[j] = mode == 0 ? frand() : lv[(uint32_t)(frand() * 1e6f + 1e6f) % (uint32_t)levels];
                if (mode == 1 && j < n / 2) x[j] = NAN;                          /* NaNs first */
                if (mode == 2) x[j] = NAN;                                       /* all NaN */
                if (mode == 3 && j == n - 1) x[j] = 9.f;                         /* the last wins */
                if (mode == 4) x[j] = j % 2 ? -0.f : 0.f;                        /* signed zeros */
                if (mode == 5) x[j] = -INFINITY;                                 /* only -inf */
            }
            int64_t want = kn_ref_argmax(x, n), got = kn_argmax(x, n);
            if (got != want) fprintf(stderr, "  argmax %s n=%lld mode %d: %lld, want %lld\n", ISAS[isa], (long long)n, mode, (long long)got, (long long)want);
            CHECK_EQ_INT(got, want);
        }
    }
    x[0] = NAN, x[1] = 1.f, x[2] = NAN, x[3] = 1.f;
    CHECK_EQ_INT(kn_ref_argmax(x, 4), 1); /* the rule itself: NaN loses, ties go to the lower index */
    x[0] = x[1] = NAN;
    CHECK_EQ_INT(kn_ref_argmax(x, 2), 1);
    free(x);
    kn_force_isa("auto");
}

TEST(kernels, helpers_vs_ref) {
    uint64_t seed = rng_seed();
    for (int isa = 0; isa < NISA; isa++) {
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (int hi = 0; hi < 10; hi++) {
            int64_t n = HN[hi];
            float *ab = malloc((size_t)(n + 2) * 4), *bb = malloc((size_t)(n + 2) * 4);
            float *cb = malloc((size_t)(n + 2) * 4), *db = malloc((size_t)(n + 2) * 4);
            float *a = ab + 1, *b = bb + 1, *c = cb + 1, *d = db + 1;
            double mag = 0;
            for (int64_t j = 0; j < n; j++) {
                a[j] = frand() * 4; b[j] = frand() * 4;
                mag += fabs((double)a[j] * b[j]);
            }
            CHECK_NEAR(kn_dot(a, b, n), kn_ref_dot(a, b, n), 1e-5 * mag + 1e-30);
            memcpy(c, b, (size_t)n * 4); memcpy(d, b, (size_t)n * 4);
            kn_axpy(c, 0.37f, a, n); kn_ref_axpy(d, 0.37f, a, n);
            for (int64_t j = 0; j < n; j++) CHECK_NEAR(c[j], d[j], 1e-6 * (fabs(d[j]) + 1));
            for (int wi = 0; wi < 2; wi++) {
                for (int64_t j = 0; j < n; j++) c[j] = NAN;
                kn_rmsnorm(c, a, wi ? b : NULL, n, 1e-6f);
                kn_ref_rmsnorm(d, a, wi ? b : NULL, n, 1e-6f);
                for (int64_t j = 0; j < n; j++) CHECK_NEAR(c[j], d[j], 1e-5 * (fabs(d[j]) + 1e-3));
            }
            memcpy(c, a, (size_t)n * 4); memcpy(d, a, (size_t)n * 4);
            c[n / 2] = d[n / 2] = -INFINITY;
            if (n > 1) { kn_softmax(c, n); kn_ref_softmax(d, n); }
            /* 1e-5: the reference sums n terms sequentially in f32 (relative error up to ~n eps/2
             * = 4e-4 worst case, ~1e-6 typical at n = 6144); the SIMD sum is 16 lanes */
            for (int64_t j = 0; j < n && n > 1; j++) CHECK_NEAR(c[j], d[j], 1e-5 * fabs(d[j]) + 1e-9);
            for (int64_t j = 0; j < n; j++) c[j] = NAN;
            kn_silu_mul(c, a, b, n); kn_ref_silu_mul(d, a, b, n);
            for (int64_t j = 0; j < n; j++) CHECK_NEAR(c[j], d[j], 1e-5 * (fabs(d[j]) + 1e-3));
            free(ab); free(bb); free(cb); free(db);
        }
    }
    (void)seed;
    float all_inf[3] = {-INFINITY, -INFINITY, -INFINITY};
    kn_softmax(all_inf, 3);
    CHECK(all_inf[0] == 0.f && all_inf[2] == 0.f);
    float one = 5.f;
    kn_softmax(&one, 1);
    CHECK(one == 1.f);
    kn_force_isa("auto");
}

TEST(kernels, topk) {
    rng_seed();
    for (int rep = 0; rep < 50; rep++) {
        int n = 1 + (int)(rnd() % 300), k = (int)(rnd() % (n + 3));
        float *v = malloc((size_t)n * 4);
        for (int i = 0; i < n; i++) v[i] = (float)(rnd() % 20) - 10.f; /* many ties */
        if (rep % 5 == 0) v[rnd() % n] = NAN;
        int32_t *idx = malloc((size_t)(n + 3) * 4);
        int got = kn_topk(v, n, k, idx);
        CHECK_EQ_INT(got, k < n ? k : n);
        /* naive: repeatedly take the best remaining (largest value, then lowest index) */
        char *used = calloc((size_t)n, 1);
        for (int t = 0; t < got; t++) {
            int best = -1;
            for (int i = 0; i < n; i++) {
                if (used[i]) continue;
                if (best < 0) { best = i; continue; }
                int bn = isnan(v[best]), in = isnan(v[i]);
                if (bn && !in) best = i;
                else if (!bn && !in && v[i] > v[best]) best = i;
            }
            used[best] = 1;
            CHECK_EQ_INT(idx[t], best);
        }
        free(v); free(idx); free(used);
    }
    float v[5] = {1, 3, 3, 2, 3};
    int32_t idx[5];
    CHECK_EQ_INT(kn_topk(v, 5, 2, idx), 2);
    CHECK_EQ_INT(idx[0], 1);
    CHECK_EQ_INT(idx[1], 2);
    CHECK_EQ_INT(kn_topk(v, 5, 0, idx), 0);
}

/* kn_matmul from a short-lived thread (its activation buffer is freed at thread exit: LSan). */
static void *mm_thread(void *arg) {
    tw *t = arg;
    float *xb, *yb, *x = xalloc(2, t->v.cols, &xb), *y = yalloc(2, t->v.rows, &yb);
    kn_matmul(&t->v, x, 2, y);
    int bad = compare_mm(&t->v, x, 2, y);
    free(xb); free(yb);
    return (void *)(intptr_t)bad;
}
TEST(kernels, matmul_from_threads) {
    rng_seed();
    tw t = tw_make(PT_BF16, 33, 129, PT_F32, 0, 0);
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, mm_thread, &t);
    for (int i = 0; i < 3; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        CHECK_EQ_INT((intptr_t)ret, 0);
    }
    tw_free(&t);
}

/* ---- int8 activations ---- */
/* kn_matmul with int8 activations vs its scalar oracle (tight: only f32 rounding of the group
 * sums differs), and vs the exact f32 reference within the documented bound
 * sum_j |w_j| max|x_g(j)| / 254. Also reports the typical relative error. */
TEST(kernels, matmul_actq) {
    uint64_t seed = rng_seed();
    int aq_saved = kn_act_quant();
    kn_set_act_quant(2);
    static const fmt_case AF[] = {{PT_Q8_ROW, PT_F32, 0, 0}, {PT_Q8_ROW, PT_BF16, 0, 0},
                                  {PT_Q8_G32, PT_BF16, 0, 0}, {PT_Q8_G32, PT_F16, 0, 0},
                                  {PT_Q4_G64, PT_BF16, 0, 0}, {PT_Q4_G64, PT_F32, 0, 0}};
    double err2 = 0, ref2 = 0;
    int k = 0, active = 0;
    for (int f = 0; f < 6; f++)
        for (int ci = 0; ci < 10; ci++)
            for (int ri = 0; ri < 4; ri++, k++) {
                int64_t cols = COLS[ci], rows = ROWS[ri];
                int n = NS[k % 6];
                while (n > 1 && rows * cols * n > 300000) n = n > 2 ? 2 : 1;
                if (rows * cols > 300000) rows = 17;
                tw t = tw_make(AF[f].q, rows, cols, AF[f].sdt, 0, 0);
                float *xb, *yb, *x = xalloc(n, cols, &xb), *y = yalloc(n, rows, &yb);
                if (k % 7 == 3) for (int64_t j = 0; j < cols; j += 5) x[j] = 0.f; /* sparse */
                if (k % 11 == 5) for (int64_t j = 0; j < cols * n; j++) x[j] *= 1e-3f;
                active += kn_act_quant_active(&t.v);
                kn_matmul(&t.v, x, n, y);
                float *yq = malloc((size_t)(n * rows) * 4), *ye = malloc((size_t)(n * rows) * 4);
                float *row = malloc((size_t)cols * 4);
                kn_ref_matmul_actq(&t.v, x, n, yq);
                kn_ref_matmul(&t.v, x, n, ye);
                int bad = 0, bad_bound = 0;
                for (int64_t r = 0; r < rows; r++) {
                    pt_dequant_row(&t.v, r, row);
                    for (int i = 0; i < n; i++) {
                        const float *xi = x + i * cols;
                        double mag = 0, bound = 0;
                        int g = t.v.qtype == PT_Q4_G64 ? 64 : 32;
                        for (int64_t j0 = 0; j0 < cols; j0 += g) {
                            double amax = 0, wsum = 0;
                            for (int64_t j = j0; j < cols && j < j0 + g; j++) {
                                amax = fmax(amax, fabs(xi[j]));
                                wsum += fabs(row[j]);
                                mag += fabs((double)row[j] * xi[j]);
                            }
                            bound += wsum * amax / 254.0;
                        }
                        float a = y[i * rows + r], b = yq[i * rows + r], e = ye[i * rows + r];
                        if (kn_act_quant_active(&t.v)) {
                            /* vs the oracle: f32 rounding of ~cols/32 scaled group sums */
                            if (!(fabs((double)a - b) <= 1e-5 * (mag + bound) + 1e-30)) {
                                if (bad < 3)
                                    fprintf(stderr, "  %s r=%lld i=%d: %.9g vs actq ref %.9g\n",
                                            pt_qtype_name(t.v.qtype), (long long)r, i, a, b);
                                bad++;
                            }
                        }
                        if (!(fabs((double)a - e) <= bound * 1.001 + 1e-5 * mag + 1e-30)) bad_bound++;
                        err2 += ((double)a - e) * ((double)a - e);
                        ref2 += (double)e * e;
                    }
                }
                CHECK_MSG(bad == 0 && bad_bound == 0,
                          "%s rows %lld cols %lld n %d: %d bad vs oracle, %d past bound (seed %llu)",
                          pt_qtype_name(AF[f].q), (long long)rows, (long long)cols, n, bad,
                          bad_bound, (unsigned long long)seed);
                free(yq); free(ye); free(row); free(xb); free(yb); tw_free(&t);
            }
    if (getenv("KN_VERBOSE"))
        fprintf(stderr, "  actq: %d/%d active, rms error / rms y = %.3g\n", active, k,
                sqrt(err2 / (ref2 + 1e-30)));
    CHECK(sqrt(err2 / (ref2 + 1e-30)) < 1e-2);
    /* the AVX-512 activation preparation is bit-identical to the scalar one */
    if (kn_force_isa("avx512") == 0) {
        for (int kind = KN_ACTQ_Q8; kind <= KN_ACTQ_Q4; kind++)
            for (int ci = 0; ci < 10; ci++) {
                int64_t cols = COLS[ci];
                int n = 3;
                float *xb, *x = xalloc(n, cols, &xb);
                x[0] = 0.f;
                if (cols > 40) for (int64_t j = 0; j < 32; j++) x[j] = 0.f; /* an all-zero group */
                if (cols > 5) x[cols + 5] = 1e-30f;
                size_t bytes = (size_t)(kn_actq_row_bytes(kind, cols) * n);
                uint8_t *a = aligned_alloc(64, bytes), *b = aligned_alloc(64, bytes);
                kn_actq_prep(kind, x, n, cols, a);
                kn_actq_prep_avx512(kind, x, n, cols, b);
                CHECK_MSG(memcmp(a, b, bytes) == 0, "actq prep kind %d cols %lld differs", kind,
                          (long long)cols);
                free(a); free(b); free(xb);
            }
        kn_force_isa("auto");
    }
    /* a NaN activation gives NaN outputs, not finite numbers */
    tw t = tw_make(PT_Q4_G64, 4, 128, PT_BF16, 0, 0);
    float x[128], y[4];
    for (int j = 0; j < 128; j++) x[j] = frand();
    x[70] = NAN;
    kn_matmul(&t.v, x, 1, y);
    for (int r = 0; r < 4; r++) CHECK(isnan(y[r]));
    tw_free(&t);
    /* mode 1: q4 only */
    tw t8 = tw_make(PT_Q8_G32, 4, 128, PT_BF16, 0, 0);
    kn_set_act_quant(1);
    CHECK(!kn_act_quant_active(&t8.v));
    kn_set_act_quant(0);
    CHECK(!kn_act_quant_active(&t8.v));
    tw_free(&t8);
    kn_set_act_quant(aq_saved);
}

/* ---- kn_matmul_many ---- */
TEST(kernels, matmul_many) {
    uint64_t seed = rng_seed();
    int aq_saved = kn_act_quant();
    for (int aq = 0; aq <= 2; aq += 2) {
        kn_set_act_quant(aq);
        enum { NJ = 7 };
        tw t[NJ];
        kn_job jobs[NJ];
        float *xb[NJ], *yb[NJ], *yrb[NJ];
        const pt_qtype q[NJ] = {PT_Q4_G64, PT_Q4_G64, PT_Q8_G32, PT_BF16, PT_Q4_G64, PT_F32, PT_Q8_ROW};
        const int64_t rows[NJ] = {64, 33, 100, 17, 1, 48, 300}, cols[NJ] = {256, 256, 129, 64, 1000, 7, 512};
        const int ns[NJ] = {1, 1, 3, 2, 1, 5, 1};
        for (int k = 0; k < NJ; k++) {
            t[k] = tw_make(q[k], rows[k], cols[k], PT_BF16, 0, 0);
            const float *x = k == 1 ? jobs[0].x : xalloc(ns[k], cols[k], &xb[k]);
            if (k == 1) xb[k] = NULL; /* job 1 shares job 0's x (same cols, n) */
            jobs[k] = (kn_job){&t[k].v, x, ns[k], yalloc(ns[k], rows[k], &yb[k])};
            yalloc(ns[k], rows[k], &yrb[k]);
        }
        kn_matmul_many(jobs, NJ);
        int bad = 0;
        for (int k = 0; k < NJ; k++) {
            float *yr = yrb[k] + 3;
            kn_matmul(jobs[k].W, jobs[k].x, jobs[k].n, yr);
            bad += memcmp(yr, jobs[k].y, (size_t)(rows[k] * ns[k]) * 4) != 0;
        }
        CHECK_MSG(bad == 0, "act_quant %d: %d jobs differ from kn_matmul (seed %llu)", aq, bad,
                  (unsigned long long)seed);
        kn_matmul_many(jobs, 0);
        for (int k = 0; k < NJ; k++) { free(xb[k]); free(yb[k]); free(yrb[k]); tw_free(&t[k]); }
    }
    kn_set_act_quant(aq_saved);
}

/* kn_set_profile: each top-level dispatch lands in the row of its key with its calls and weight
 * bytes; products run inside a pool task are not seen; the pool counts its dispatches; off
 * (NULL) records nothing. */
typedef struct { const pt_wview *W; const float *x; float *y; } prof_nest;
static void prof_nested_fn(void *ctx, int task, int thread) {
    (void)task, (void)thread;
    const prof_nest *c = ctx;
    kn_matmul(c->W, c->x, 1, c->y);
}
TEST(kernels, profile) {
    tw a = tw_make(PT_Q8_G32, 64, 256, PT_BF16, 0, 0), b = tw_make(PT_Q8_G32, 32, 256, PT_BF16, 0, 0), c = tw_make(PT_F32, 48, 64, PT_F32, 0, 0);
    float *xb, *yb, *tb;
    const float *x = xalloc(2, 256, &xb);
    float *y = yalloc(2, 64 + 32, &yb), *yt = yalloc(1, 64, &tb);
    static kn_prof p;
    memset(&p, 0xab, sizeof p); /* the caller zeroes it: n_rows */
    p.n_rows = 0;
    unsigned long long j0, w0, j1, w1;
    pool_stats(kn_pool(), &j0, &w0);
    kn_set_profile(&p);
    for (int r = 0; r < 3; r++) kn_matmul(&a.v, x, 1, y);
    kn_job jobs[2] = {{&a.v, x, 2, y}, {&b.v, x, 2, y + 2 * 64}};
    kn_matmul_many(jobs, 2);
    kn_matmul_t(&c.v, x, 1, yt); /* [1][48] . [48][64] */
    prof_nest nest = {&b.v, x, y};
    pool_run(kn_pool(), 4, prof_nested_fn, &nest); /* inside tasks: not recorded */
    kn_set_profile(NULL);
    kn_matmul(&a.v, x, 1, y); /* off: not recorded */
    pool_stats(kn_pool(), &j1, &w1);
    CHECK_EQ_INT(p.n_rows, 3);
    int seen = 0;
    for (int i = 0; i < p.n_rows; i++) {
        const kn_prof_row *r = &p.row[i];
        if (r->rows == 64 && r->n == 1 && r->jobs == 1 && r->kind == KN_PROF_MATMUL) {
            seen |= 1;
            CHECK_EQ_INT((int)r->calls, 3);
            CHECK(r->wbytes == 3 * pt_wview_bytes(&a.v));
            CHECK(r->data == a.v.data && r->rows2 == 0);
        } else if (r->rows == 64 && r->n == 2 && r->jobs == 2) {
            seen |= 2;
            CHECK_EQ_INT((int)r->calls, 1);
            CHECK(r->wbytes == pt_wview_bytes(&a.v) + pt_wview_bytes(&b.v));
            CHECK(r->rows2 == 32 && r->data2 == b.v.data);
        } else if (r->rows == 48 && r->kind == KN_PROF_MATMUL_T) {
            seen |= 4;
            CHECK_EQ_INT((int)r->calls, 1);
            CHECK(r->wbytes == 48ull * 64 * 4);
        }
        CHECK(r->run_ns > 0);
    }
    CHECK_EQ_INT(seen, 7);
    CHECK(pt_wview_bytes(&a.v) == 64ull * 256 + 64ull * 8 * 2); /* payload + bf16 scale per group of 32 */
    if (kn_threads() > 1) CHECK_MSG(j1 >= j0 + 1, "pool dispatches %llu -> %llu (the 4-task job counts)", j0, j1); /* one-task jobs run inline, uncounted */
    free(xb), free(yb), free(tb);
    tw_free(&a), tw_free(&b), tw_free(&c);
}

/* The R16 kernels' software prefetch changes speed only: every distance and level gives the
 * default's bits, at the ends of a matrix too (prefetches past the last block); bad settings are
 * refused. */
TEST(kernels, r16_prefetch_invisible) {
    kn_table t;
    CHECK_EQ_INT(kn_table_init(&t, NULL, 0, 0), 0);
    CHECK(kn_table_prefetch(&t, 63, 0, 0) < 0 && kn_table_prefetch(&t, 65537, 0, 0) < 0 && kn_table_prefetch(&t, -2, 0, 0) < 0 &&
          kn_table_prefetch(&t, 0, 3, 0) < 0 && kn_table_prefetch(&t, 0, 0, 3) < 0 && kn_table_prefetch(&t, 0, 0, -1) < 0);
    CHECK(kn_table_prefetch(&t, -1, 0, 0) == 0 && t.pf_bytes == 0);
    CHECK(kn_table_prefetch(&t, 1000, 2, 2) == 0 && t.pf_bytes == 960 && t.pf_l2 == 1 && t.pf_all == 1);
    CHECK(kn_table_prefetch(&t, 0, 1, 1) == 0 && t.pf_bytes == 4096 && t.pf_l2 == 0 && t.pf_all == 0);
    if (!kt_r16_available(&t)) { test_skip("no AVX-512 VNNI: the R16 kernels run as the scalar reference"); return; }
    const pt_qtype q[2] = {PT_Q4_G64, PT_Q8_G32};
    const int pf[][3] = {{-1, 0, 0}, {64, 1, 1}, {4096, 1, 1}, {4096, 2, 1}, {65536, 2, 1}, {8192, 1, 1},
                         {64, 1, 2}, {4096, 1, 2}, {4096, 2, 2}, {65536, 1, 2}};
    for (int f = 0; f < 2; f++)
        for (int n = 1; n <= 9; n += 4) {
            tw w = tw_make(q[f], 96, 512, PT_BF16, 0, 0);
            CHECK(kn_r16_repack(&w.v) == 0);
            float *xb, *yb, *y2b, *x = xalloc(n, 512, &xb), *y = yalloc(n, 96, &yb), *y2 = yalloc(n, 96, &y2b);
            kn_table_prefetch(&t, 0, 0, 0);
            kt_matmul(&t, &w.v, x, n, y);
            for (size_t k = 0; k < sizeof pf / sizeof pf[0]; k++) {
                CHECK(kn_table_prefetch(&t, pf[k][0], pf[k][1], pf[k][2]) == 0);
                memset(y2, 0x7f, sizeof(float) * (size_t)n * 96);
                kt_matmul(&t, &w.v, x, n, y2);
                CHECK_MSG(!memcmp(y, y2, sizeof(float) * (size_t)n * 96), "%s n %d prefetch %d level %d lines %d differs", pt_qtype_name(q[f]), n,
                          pf[k][0], pf[k][1], pf[k][2]);
            }
            free(xb), free(yb), free(y2b);
            tw_free(&w);
        }
}

/* ---- kn_matmul_t ---- */
TEST(kernels, matmul_t) {
    uint64_t seed = rng_seed();
    const int64_t shapes[][2] = {{1, 1}, {3, 17}, {17, 64}, {40, 129}, {192, 512}, {5, 1000}};
    for (int isa = 0; isa < NISA; isa++) {
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (int f = 0; f < NFMT; f++)
            for (int si = 0; si < 6; si++) {
                int64_t rows = shapes[si][0], cols = shapes[si][1];
                int n = NS[(f + si) % 6];
                tw t = tw_make(FMTS[f].q, rows, cols, FMTS[f].sdt ? FMTS[f].sdt : PT_F32,
                               FMTS[f].br, FMTS[f].bc);
                float *xb, *yb, *y1b, *x = xalloc(n, rows, &xb), *y = yalloc(n, cols, &yb);
                float *yr = malloc((size_t)(n * cols) * 4), *y1 = yalloc(1, cols, &y1b);
                kn_matmul_t(&t.v, x, n, y);
                kn_ref_matmul_t(&t.v, x, n, yr);
                float *row = malloc((size_t)cols * 4);
                double *mag = calloc((size_t)(n * cols), sizeof(double));
                for (int64_t r = 0; r < rows; r++) {
                    pt_dequant_row(&t.v, r, row);
                    for (int i = 0; i < n; i++)
                        for (int64_t c = 0; c < cols; c++)
                            mag[i * cols + c] += fabs((double)x[i * rows + r] * row[c]);
                }
                int bad = 0;
                for (int64_t e = 0; e < n * cols; e++)
                    if (!(fabs((double)y[e] - yr[e]) <= 1e-5 * mag[e] + 1e-30)) bad++;
                kn_matmul_t(&t.v, x + (n - 1) * rows, 1, y1); /* last row alone: bitwise */
                bad += memcmp(y1, y + (n - 1) * cols, (size_t)cols * 4) != 0;
                CHECK_MSG(bad == 0, "%s %s rows %lld cols %lld n %d: %d bad (seed %llu)",
                          ISAS[isa], pt_qtype_name(FMTS[f].q), (long long)rows, (long long)cols,
                          n, bad, (unsigned long long)seed);
                free(row); free(mag); free(yr); free(xb); free(yb); free(y1b); tw_free(&t);
            }
    }
    kn_force_isa("auto");
}

/* The transposed product of several rows (the MLA absorption of a batch's decode rows: W_UK^T q
 * per head, q8_g32) gives every row the bits of that row alone, at 1-9 rows, whole and partial
 * 64-column tiles, and stays near the reference. */
TEST(kernels, matmul_t_rows_alone) {
    const int64_t shapes[][2] = {{192, 512}, {64, 96}, {33, 128}};
    for (int si = 0; si < 3; si++)
        for (int n = 1; n <= 9; n++) {
            int64_t rows = shapes[si][0], cols = shapes[si][1];
            tw t = tw_make(PT_Q8_G32, rows, cols, PT_BF16, 0, 0);
            float *wrow = malloc((size_t)cols * 4); /* every 32-column group its own scale */
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t j = 0; j < cols; j++) wrow[j] = frand() * (float)(1 + (j / 32 + r) % 7);
                pt_quant_row(PT_Q8_G32, wrow, cols, (uint8_t *)t.v.data + r * t.v.row_bytes, (uint8_t *)t.v.scale + r * t.v.scale_cols * 2, PT_BF16);
            }
            free(wrow);
            float *xb, *yb, *y1b, *x = xalloc(n, rows, &xb), *y = yalloc(n, cols, &yb), *y1 = yalloc(1, cols, &y1b);
            float *yr = malloc((size_t)(n * cols) * 4);
            kn_matmul_t(&t.v, x, n, y);
            kn_ref_matmul_t(&t.v, x, n, yr);
            int bad = 0, far = 0;
            for (int i = 0; i < n; i++) {
                kn_matmul_t(&t.v, x + (int64_t)i * rows, 1, y1);
                bad += memcmp(y1, y + (int64_t)i * cols, (size_t)cols * 4) != 0;
            }
            for (int64_t e = 0; e < n * cols; e++) far += !(fabs((double)y[e] - yr[e]) <= 1e-4 * (fabs((double)yr[e]) + 1.0));
            CHECK_MSG(bad == 0 && far == 0, "[%lld x %lld] n %d: %d rows differ from alone, %d outputs off the reference", (long long)rows,
                      (long long)cols, n, bad, far);
            free(xb), free(yb), free(y1b), free(yr);
            tw_free(&t);
        }
}

/* ---- row-interleaved layout (PT_LAYOUT_R16) ---- */
/* A copy of t's view in fresh buffers, repacked to R16. */
static tw tw_r16(const tw *t) {
    tw c;
    memset(&c, 0, sizeof c);
    size_t es = t->v.scale_dtype == PT_F32 ? 4 : 2, db = (size_t)(t->v.rows * t->v.row_bytes), sb = (size_t)(t->v.rows * t->v.scale_cols) * es;
    c.data_alloc = malloc(db + 1);
    c.scale_alloc = malloc(sb + es);
    memcpy((uint8_t *)c.data_alloc + 1, t->v.data, db); /* unaligned starts on purpose (scales: */
    memcpy((uint8_t *)c.scale_alloc + es, t->v.scale, sb); /* off by one element) */
    c.v = t->v;
    c.v.data = (uint8_t *)c.data_alloc + 1;
    c.v.scale = (uint8_t *)c.scale_alloc + es;
    return c;
}

/* Rows of a and b (same shape) whose dequantized values differ bitwise. */
static int64_t rows_dequant_differ(const pt_wview *a, const pt_wview *b) {
    float *x = malloc((size_t)a->cols * 4), *y = malloc((size_t)a->cols * 4);
    int64_t bad = 0;
    for (int64_t r = 0; r < a->rows; r++) {
        pt_dequant_row(a, r, x);
        pt_dequant_row(b, r, y);
        bad += memcmp(x, y, (size_t)a->cols * 4) != 0;
    }
    free(x), free(y);
    return bad;
}

/* Repacking at open goes over the pool for large matrices: the same bytes as a repack run alone
 * (inside a pool task, where it is inline), and every row dequantizes as before. */
typedef struct { tw *r; int rc; } repack_in_task;
static void repack_task_fn(void *ctx, int task, int thread) {
    (void)task, (void)thread;
    repack_in_task *j = ctx;
    j->rc = kn_r16_repack(&j->r->v);
}
TEST(kernels, r16_repack_threaded) {
    static const pt_qtype Q[2] = {PT_Q8_G32, PT_Q4_G64};
    for (int f = 0; f < 2; f++) {
        const int64_t rows = 16 * 300, cols = f ? 192 : 96; /* 300 blocks: split over the pool */
        tw t = tw_make(Q[f], rows, cols, PT_BF16, 0, 0);
        tw a = tw_r16(&t), b = tw_r16(&t);
        CHECK(kn_r16_repack(&a.v) == 0 && a.v.layout == PT_LAYOUT_R16);
        repack_in_task j = {&b, -1};
        pool_run(kn_pool(), 1, repack_task_fn, &j); /* inline in the task: one block buffer, in order */
        CHECK(j.rc == 0 && b.v.layout == PT_LAYOUT_R16);
        size_t es = 2, db = (size_t)(rows * t.v.row_bytes), sb = (size_t)(rows * t.v.scale_cols) * es;
        CHECK(!memcmp(a.v.data, b.v.data, db) && !memcmp(a.v.scale, b.v.scale, sb));
        int64_t bad = rows_dequant_differ(&t.v, &a.v);
        CHECK_MSG(bad == 0, "%s: %lld of %lld rows dequantize differently after the threaded repack", pt_qtype_name(Q[f]), (long long)bad, (long long)rows);
        tw_free(&t), tw_free(&a), tw_free(&b);
    }
    if (pool_threads(kn_pool()) < 2) test_skip("one thread: the repack did not split (checked alone)");
}

/* A dispatch's row tasks cover every row once: a matrix large enough for many tasks at any thread
 * count, each of 1, 5 and 8 rows, equals the R16 kernel run over all rows in one call (no task
 * split), bitwise. */
TEST(kernels, matmul_tasks_cover_rows) {
    if (!kn_r16_available()) { test_skip("no AVX-512 VNNI: no R16 layout"); return; }
    const int64_t rows = 16384, cols = 256;
    tw t = tw_make(PT_Q8_G32, rows, cols, PT_BF16, 0, 0);
    tw r = tw_r16(&t);
    CHECK(kn_r16_repack(&r.v) == 0);
    const int ns[3] = {1, 5, 8};
    for (int k = 0; k < 3; k++) {
        int n = ns[k];
        int64_t xs = kn_r16_xs(&r.v);
        float *xb, *yb, *x = xalloc(n, cols, &xb), *y = yalloc(n, rows, &yb), *ys = malloc((size_t)(n * rows) * 4);
        uint8_t *xq = malloc((size_t)(xs * n));
        kn_matmul(&r.v, x, n, y);
        kn_r16_prep(&r.v, x, n, xq);
        kn_r16_rows_ref(&r.v, 0, rows, xq, xs, n, ys);
        int64_t bad = 0;
        for (int64_t i = 0; i < n * rows; i++) bad += memcmp(&y[i], &ys[i], 4) != 0;
        CHECK_MSG(bad == 0, "n %d: %lld of %lld outputs differ from one call over all rows", n, (long long)bad, (long long)(n * rows));
        free(xb), free(yb), free(ys), free(xq);
    }
    tw_free(&t), tw_free(&r);
}

TEST(kernels, r16_layout) {
    uint64_t seed = rng_seed();
    static const fmt_case RF[] = {{PT_Q8_G32, PT_BF16, 0, 0}, {PT_Q8_G32, PT_F16, 0, 0}, {PT_Q8_G32, PT_F32, 0, 0},
                                  {PT_Q4_G64, PT_BF16, 0, 0}, {PT_Q4_G64, PT_F32, 0, 0}};
    static const int64_t RR[] = {16, 48, 256}, RC[] = {1, 3, 32, 96};
    /* 1-8 activations in one pass over a block pair (above 4 in two halves per group), more in
     * passes of 8 */
    static const int RN[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17};
    int k = 0;
    for (int f = 0; f < 5; f++)
        for (int ri = 0; ri < 3; ri++)
            for (int ci = 0; ci < 4; ci++, k++) {
                int g = RF[f].q == PT_Q4_G64 ? 64 : 32;
                int64_t rows = RR[ri], cols = RC[ci] * g;
                int n = RN[k % 12];
                tw t = tw_make(RF[f].q, rows, cols, RF[f].sdt, 0, 0);
                tw r = tw_r16(&t);
                CHECK(kn_r16_supported(&r.v));
                CHECK(kn_r16_repack(&r.v) == 0 && r.v.layout == PT_LAYOUT_R16);
                CHECK(!kn_r16_supported(&r.v)); /* never twice */
                /* same weights: every row dequantizes bitwise as before */
                int64_t bad_rows = rows_dequant_differ(&t.v, &r.v);
                float *a = malloc((size_t)cols * 4); /* a row for the oracle below */
                CHECK_MSG(bad_rows == 0, "%s [%lld x %lld]: %lld rows dequantize differently after repacking",
                          pt_qtype_name(t.v.qtype), (long long)rows, (long long)cols, (long long)bad_rows);
                float *xb, *yb, *x = xalloc(n, cols, &xb), *y = yalloc(n, rows, &yb);
                if (k % 5 == 2) for (int64_t j = 0; j < g && j < cols; j++) x[j] = 0.f; /* a zero group */
                kn_matmul(&r.v, x, n, y);
                /* the scalar kernel is the same math, bit for bit */
                float *ys = malloc((size_t)(n * rows) * 4), *yo = malloc((size_t)(n * rows) * 4), *y1 = malloc((size_t)rows * 4);
                kn_force_isa("scalar");
                kn_matmul(&r.v, x, n, ys);
                kn_force_isa("auto");
                CHECK_MSG(memcmp(y, ys, (size_t)(n * rows) * 4) == 0, "%s [%lld x %lld] n %d: SIMD != scalar R16 (seed %llu)",
                          pt_qtype_name(t.v.qtype), (long long)rows, (long long)cols, n, (unsigned long long)seed);
                /* rows do not depend on the batch */
                int bad_batch = 0;
                for (int i = 0; i < n; i++) {
                    kn_matmul(&r.v, x + i * cols, 1, y1);
                    bad_batch += memcmp(y1, y + i * rows, (size_t)rows * 4) != 0;
                }
                CHECK_MSG(bad_batch == 0, "R16 rows change with the batch (%d of %d)", bad_batch, n);
                /* against the int8-activation oracle (exact integer group dots, double sums) */
                kn_ref_matmul_actq(&t.v, x, n, yo);
                int bad = 0;
                for (int64_t row = 0; row < rows; row++) {
                    pt_dequant_row(&t.v, row, a);
                    for (int i = 0; i < n; i++) {
                        double mag = 0;
                        for (int64_t j = 0; j < cols; j++) mag += fabs((double)a[j] * x[i * cols + j]);
                        double e = fabs((double)y[i * rows + row] - yo[i * rows + row]);
                        if (!(e <= 2e-6 * mag + 1e-30)) {
                            if (bad < 3) fprintf(stderr, "  r=%lld i=%d: %.9g vs oracle %.9g\n", (long long)row, i, y[i * rows + row], yo[i * rows + row]);
                            bad++;
                        }
                    }
                }
                CHECK_MSG(bad == 0, "%s [%lld x %lld] n %d: %d outputs off the int8-activation oracle (seed %llu)",
                          pt_qtype_name(t.v.qtype), (long long)rows, (long long)cols, n, bad, (unsigned long long)seed);
                /* kn_ref_matmul reads the layout: exact f32 activations on the same weights */
                kn_ref_matmul(&t.v, x, n, yo);
                kn_ref_matmul(&r.v, x, n, ys);
                CHECK(memcmp(yo, ys, (size_t)(n * rows) * 4) == 0);
                free(a); free(ys); free(yo); free(y1); free(xb); free(yb);
                tw_free(&t); tw_free(&r);
            }
    /* the AVX-512 activation preparation is bit-identical to the scalar one, special values too */
    if (kn_r16_available()) {
        for (int f = 0; f < 2; f++) {
            int g = f ? 64 : 32;
            int64_t cols = 12 * g;
            uint8_t d0[16] = {0}, s0[32] = {0};
            pt_wview v = pt_wview_make(f ? PT_Q4_G64 : PT_Q8_G32, 16, cols, d0, s0, PT_BF16);
            float *xb, *x = xalloc(3, cols, &xb);
            for (int64_t j = 0; j < g; j++) x[j] = 0.f;                       /* a zero group */
            for (int64_t j = g; j < 2 * g; j++) x[j] = (float)(j % 7) * 0.5f;  /* ties at .5 */
            x[2 * g + 3] = NAN;
            x[3 * g + 1] = INFINITY;
            x[4 * g + 2] = -INFINITY;
            x[5 * g + 5] = 1e-38f;
            for (int64_t j = 6 * g; j < 7 * g; j++) x[j] = 1e-30f * (float)(j - 6 * g);
            x[cols + 9] = -0.f;
            size_t bytes = (size_t)(kn_r16_xs(&v) * 3);
            uint8_t *a = aligned_alloc(64, bytes), *b = aligned_alloc(64, bytes);
            memset(a, 0x5a, bytes);
            memset(b, 0xa5, bytes);
            kn_r16_prep(&v, x, 3, a);
            kn_r16_prep_avx512(&v, x, 3, b);
            /* compare field by field (padding bytes are not written) */
            int64_t qb = (cols + 63) / 64 * 64, ng = cols / g, fb = (ng * 4 + 63) / 64 * 64;
            for (int i = 0; i < 3; i++) {
                const uint8_t *ra = a + i * kn_r16_xs(&v), *rb = b + i * kn_r16_xs(&v);
                CHECK_MSG(!memcmp(ra, rb, (size_t)qb), "r16 prep q differs (group %d, row %d)", g, i);
                CHECK_MSG(!memcmp(ra + qb, rb + qb, (size_t)ng * 4), "r16 prep d differs (group %d, row %d)", g, i);
                CHECK_MSG(!memcmp(ra + qb + fb, rb + qb + fb, (size_t)ng * 4), "r16 prep bias differs (group %d, row %d)", g, i);
            }
            free(a); free(b); free(xb);
        }
    }
    /* shapes and formats it does not take stay plain */
    tw u1 = tw_make(PT_Q8_G32, 17, 64, PT_BF16, 0, 0), u2 = tw_make(PT_Q8_G32, 16, 40, PT_BF16, 0, 0),
       u3 = tw_make(PT_Q8_ROW, 16, 64, PT_F32, 0, 0), u4 = tw_make(PT_BF16, 16, 64, 0, 0, 0);
    CHECK(kn_r16_repack(&u1.v) == -1 && u1.v.layout == PT_LAYOUT_PLAIN);
    CHECK(kn_r16_repack(&u2.v) == -1 && kn_r16_repack(&u3.v) == -1 && kn_r16_repack(&u4.v) == -1);
    tw_free(&u1); tw_free(&u2); tw_free(&u3); tw_free(&u4);
    /* a NaN activation gives NaN rows; kn_matmul_many mixes R16 and plain jobs on one x */
    tw q8 = tw_make(PT_Q8_G32, 32, 128, PT_BF16, 0, 0), q4 = tw_make(PT_Q4_G64, 48, 128, PT_BF16, 0, 0);
    tw q8r = tw_r16(&q8), q4r = tw_r16(&q4);
    CHECK(kn_r16_repack(&q8r.v) == 0 && kn_r16_repack(&q4r.v) == 0);
    float x[2 * 128], y8[2 * 32], y4[2 * 48], yp[2 * 32], m8[2 * 32], m4[2 * 48], mp[2 * 32];
    for (int j = 0; j < 256; j++) x[j] = frand();
    kn_matmul(&q8r.v, x, 2, y8);
    kn_matmul(&q4r.v, x, 2, y4);
    kn_matmul(&q8.v, x, 2, yp);
    kn_job jobs[3] = {{&q8r.v, x, 2, m8}, {&q8.v, x, 2, mp}, {&q4r.v, x, 2, m4}};
    kn_matmul_many(jobs, 3);
    CHECK(!memcmp(y8, m8, sizeof y8) && !memcmp(y4, m4, sizeof y4) && !memcmp(yp, mp, sizeof yp));
    x[70] = NAN;
    kn_matmul(&q8r.v, x, 1, y8);
    kn_matmul(&q4r.v, x, 1, y4);
    for (int r = 0; r < 32; r++) CHECK(isnan(y8[r]));
    for (int r = 0; r < 48; r++) CHECK(isnan(y4[r]));
    tw_free(&q8); tw_free(&q4); tw_free(&q8r); tw_free(&q4r);
}

/* ---- attention core (kn_attn) ---- */
typedef struct {
    int M, D, Dr, N;
    float *q, *qpe, *lat, *cache, *pe, *scr;
    const float **kc, **kp;
    int *nk;
} at_case;

/* Random queries (q rows strided by D + 3, q_pe by Dr + 1), a cache of N + 7 keys whose rows
 * the case visits in a shuffled order (row pointers), nk per query in 1..N (or NULL). */
static at_case at_make(int M, int N, int D, int Dr, int with_nk) {
    at_case c = {M, D, Dr, N, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    c.q = malloc(sizeof(float) * (size_t)M * (D + 3) + 4);
    c.qpe = malloc(sizeof(float) * (size_t)M * (Dr + 1) + 4);
    c.lat = malloc(sizeof(float) * (size_t)M * (D + 5) + 4);
    c.cache = malloc(sizeof(float) * (size_t)(N + 7) * D + 4);
    c.pe = malloc(sizeof(float) * (size_t)(N + 7) * Dr + 4);
    c.kc = malloc(sizeof(float *) * (size_t)(N + 1));
    c.kp = malloc(sizeof(float *) * (size_t)(N + 1));
    c.nk = with_nk ? malloc(sizeof(int) * (size_t)M) : NULL;
    c.scr = malloc(sizeof(float) * kn_attn_scratch_floats(M, N, D, Dr) + 4);
    for (size_t i = 0; i < (size_t)M * (D + 3); i++) c.q[i] = frand();
    for (size_t i = 0; i < (size_t)M * (Dr + 1); i++) c.qpe[i] = frand();
    for (size_t i = 0; i < (size_t)(N + 7) * D; i++) c.cache[i] = frand();
    for (size_t i = 0; i < (size_t)(N + 7) * Dr; i++) c.pe[i] = frand();
    for (int t = 0; t < N; t++) {
        int r = (int)(rnd() % (unsigned)(N + 7));
        c.kc[t] = c.cache + (size_t)r * D;
        c.kp[t] = c.pe + (size_t)r * Dr;
    }
    if (c.nk)
        for (int m = 0; m < M; m++) c.nk[m] = N ? 1 + (int)(rnd() % (unsigned)N) : 0;
    return c;
}

static kn_attn at_args(const at_case *c, int m0, int M, float *lat) {
    kn_attn a = {M, c->D, c->Dr, c->N, c->q + (size_t)m0 * (c->D + 3), c->D + 3, c->qpe + (size_t)m0 * (c->Dr + 1), c->Dr + 1,
                 c->kc, c->kp, c->nk ? c->nk + m0 : NULL, 0.125f, lat, c->D + 5};
    return a;
}

static void at_free(at_case *c) {
    free(c->q); free(c->qpe); free(c->lat); free(c->cache); free(c->pe); free(c->kc); free(c->kp); free(c->nk); free(c->scr);
}

/* Oracle in double: softmax with exp(), no fixed order. */
static void at_oracle(const at_case *c, int m, double *lat) {
    const float *q = c->q + (size_t)m * (c->D + 3), *qp = c->qpe + (size_t)m * (c->Dr + 1);
    int n = c->nk ? c->nk[m] : c->N;
    double *s = malloc(sizeof(double) * (size_t)(n + 1)), mx = -1e300, sum = 0;
    for (int t = 0; t < n; t++) {
        double acc = 0;
        for (int k = 0; k < c->D; k++) acc += (double)q[k] * c->kc[t][k];
        for (int k = 0; k < c->Dr; k++) acc += (double)qp[k] * c->kp[t][k];
        s[t] = 0.125 * acc;
        if (s[t] > mx) mx = s[t];
    }
    for (int t = 0; t < n; t++) sum += (s[t] = exp(s[t] - mx));
    for (int j = 0; j < c->D; j++) {
        double acc = 0;
        for (int t = 0; t < n; t++) acc += s[t] / sum * c->kc[t][j];
        lat[j] = acc;
    }
    free(s);
}

TEST(kernels, attn_vs_ref) {
    uint64_t seed = rng_seed();
    static const int shapes[][4] = {{64, 512, 512, 64}, {1, 1, 16, 16}, {5, 13, 20, 8}, {17, 100, 24, 16}, {32, 37, 64, 16},
                                    {33, 600, 32, 16}, {70, 49, 80, 12}, {3, 0, 16, 16}, {64, 130, 512, 64}};
    for (int isa = 0; isa < NISA; isa++) {
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (int wn = 0; wn < 2; wn++) {
                const int *sh = shapes[si];
                at_case c = at_make(sh[0], sh[1], sh[2], sh[3], wn);
                float *ref = malloc(sizeof(float) * (size_t)c.M * (c.D + 5) + 4), *one = malloc(sizeof(float) * (size_t)(c.D + 5));
                float *rs = malloc(sizeof(float) * (size_t)(c.N + 1));
                double *orc = malloc(sizeof(double) * (size_t)c.D);
                for (size_t i = 0; i < (size_t)c.M * (c.D + 5); i++) c.lat[i] = ref[i] = NAN;
                kn_attn a = at_args(&c, 0, c.M, c.lat), r = at_args(&c, 0, c.M, ref);
                kn_attn_core(&a, c.scr);
                kn_ref_attn(&r, rs);
                int bad = 0, bad1 = 0;
                double worst = 0;
                for (int m = 0; m < c.M; m++) {
                    const float *y = c.lat + (size_t)m * (c.D + 5), *yr = ref + (size_t)m * (c.D + 5);
                    if (memcmp(y, yr, sizeof(float) * (size_t)c.D)) bad++;
                    /* the query alone (M = 1, its own offset in a fresh call) is bitwise the same */
                    kn_attn a1 = at_args(&c, m, 1, one);
                    kn_attn_core(&a1, c.scr);
                    if (memcmp(one, y, sizeof(float) * (size_t)c.D)) bad1++;
                    if (c.N == 0) continue;
                    at_oracle(&c, m, orc);
                    double e2 = 0, r2 = 0;
                    for (int j = 0; j < c.D; j++) {
                        e2 += (y[j] - orc[j]) * (y[j] - orc[j]);
                        r2 += orc[j] * orc[j];
                    }
                    double rel = sqrt(e2 / (r2 > 0 ? r2 : 1e-30));
                    if (rel > worst) worst = rel;
                }
                CHECK(bad == 0);
                CHECK(bad1 == 0);
                CHECK(worst < 2e-5);
                if (bad || bad1 || worst >= 2e-5)
                    printf("  attn %s M=%d N=%d D=%d Dr=%d nk=%d: %d differ from ref, %d alone, rel err %.2e (seed %llu)\n", ISAS[isa], c.M, c.N,
                           c.D, c.Dr, wn, bad, bad1, worst, (unsigned long long)seed);
                free(ref); free(one); free(rs); free(orc);
                at_free(&c);
            }
    }
    kn_force_isa("auto");
}

/* np problems of shapes {M, N, D, Dr} through kt_attn_core_many against each alone (kn_attn_core),
 * bitwise; what names the case in a failure */
#define MANY_MAX_P 8
static void many_vs_alone(const int (*shapes)[4], int np, const char *what, uint64_t seed) {
    CHECK_MSG(np >= 1 && np <= MANY_MAX_P, "many_vs_alone takes 1..%d problems, not %d", MANY_MAX_P, np);
    if (np < 1 || np > MANY_MAX_P) return;
    at_case c[MANY_MAX_P];
    kn_attn a[MANY_MAX_P];
    float *scr[MANY_MAX_P], *one[MANY_MAX_P];
    for (int i = 0; i < np; i++) {
        c[i] = at_make(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], i & 1);
        one[i] = malloc(sizeof(float) * (size_t)c[i].M * (c[i].D + 5) + 4);
        kn_attn a1 = at_args(&c[i], 0, c[i].M, one[i]);
        kn_attn_core(&a1, c[i].scr);
        for (size_t k = 0; k < (size_t)c[i].M * (c[i].D + 5); k++) c[i].lat[k] = NAN;
        a[i] = at_args(&c[i], 0, c[i].M, c[i].lat);
        scr[i] = c[i].scr;
    }
    kt_attn_core_many(kn_default(), a, np, scr);
    for (int i = 0; i < np; i++) {
        int bad = 0;
        for (int m = 0; m < c[i].M; m++) bad += memcmp(c[i].lat + (size_t)m * (c[i].D + 5), one[i] + (size_t)m * (c[i].D + 5), sizeof(float) * (size_t)c[i].D) != 0;
        CHECK_MSG(bad == 0, "%s, problem %d (M %d N %d): %d queries differ from the problem alone (seed %llu)", what, i, c[i].M, c[i].N, bad,
                  (unsigned long long)seed);
        free(one[i]);
        at_free(&c[i]);
    }
}

/* Several problems at once (kt_attn_core_many: a batch's decode rows of different sessions)
 * give each problem's bits alone, whatever their shapes, on every ISA. */
TEST(kernels, attn_many_equals_one_by_one) {
    uint64_t seed = rng_seed();
    static const int shapes[][4] = {{64, 512, 512, 64}, {1, 1, 16, 16}, {5, 13, 20, 8}, {64, 130, 512, 64}, {3, 0, 16, 16}, {70, 49, 80, 12}};
    for (int isa = 0; isa < NISA; isa++)
        if (kn_force_isa(ISAS[isa]) == 0) many_vs_alone(shapes, (int)(sizeof shapes / sizeof shapes[0]), ISAS[isa], seed);
    kn_force_isa("auto");
}

/* A batch's decode rows of about the same work, a whole number a thread: kt_attn_core_many runs
 * each one whole on one thread (attn_avx512.c); still each problem's bits alone, with 2 and 3
 * threads (the form's condition met). */
TEST(kernels, attn_many_whole_rows) {
    uint64_t seed = rng_seed();
    static const int shapes[][4] = {{64, 300, 512, 64}, {64, 290, 512, 64}, {40, 310, 512, 64}, {64, 305, 512, 64}, {50, 280, 512, 64}, {64, 299, 512, 64}};
    const int before = kn_threads();
    for (int nt = 2; nt <= 3; nt++) {
        kn_init(nt);
        many_vs_alone(shapes, (int)(sizeof shapes / sizeof shapes[0]), nt == 2 ? "2 threads" : "3 threads", seed);
    }
    kn_init(before);
}

/* Zeros past a query's nk add nothing: the same query over N keys with nk = n equals it over
 * exactly n keys (the blocked prefill's padding), and 1 vs 3 threads give the same bits. */
TEST(kernels, attn_padding_threads) {
    uint64_t seed = rng_seed();
    at_case c = at_make(40, 300, 512, 64, 1);
    float *y = malloc(sizeof(float) * (size_t)c.M * (c.D + 5)), *y1 = malloc(sizeof(float) * (size_t)(c.D + 5));
    kn_attn a = at_args(&c, 0, c.M, y);
    kn_attn_core(&a, c.scr);
    int bad = 0;
    for (int m = 0; m < c.M; m++) {
        kn_attn b = at_args(&c, m, 1, y1);
        b.N = c.nk[m];
        b.nk = NULL;
        kn_attn_core(&b, c.scr);
        if (memcmp(y1, y + (size_t)m * (c.D + 5), sizeof(float) * (size_t)c.D)) bad++;
    }
    CHECK(bad == 0);
    int before = kn_threads();
    kn_init(1);
    kn_attn_core(&a, c.scr);
    memcpy(c.lat, y, sizeof(float) * (size_t)c.M * (c.D + 5));
    kn_init(3);
    kn_attn_core(&a, c.scr);
    kn_init(before);
    for (int m = 0; m < c.M; m++) CHECK(memcmp(c.lat + (size_t)m * (c.D + 5), y + (size_t)m * (c.D + 5), sizeof(float) * (size_t)c.D) == 0);
    if (bad) printf("  attn padding: %d queries differ (seed %llu)\n", bad, (unsigned long long)seed);
    free(y); free(y1);
    at_free(&c);
}

/* ---- DSA indexer scores (kn_dsa) ---- */
TEST(kernels, dsa_scores_vs_ref) {
    uint64_t seed = rng_seed();
    static const int shapes[][3] = {{32, 128, 300}, {8, 32, 37}, {1, 16, 5}, {20, 24, 13}, {40, 128, 70}, {64, 64, 25}, {70, 16, 9}, {32, 33, 1}};
    for (int isa = 0; isa < NISA; isa++) {
        if (kn_force_isa(ISAS[isa]) != 0) continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            int Hi = shapes[si][0], Di = shapes[si][1], n = shapes[si][2], Hp = kn_dsa_heads(Hi), ks = Di + 3;
            float *qt = calloc((size_t)Di * Hp, 4), *w = calloc((size_t)Hp, 4), *k = malloc(sizeof(float) * (size_t)n * ks);
            float *s = malloc(sizeof(float) * (size_t)n), *sr = malloc(sizeof(float) * (size_t)n), *s1 = malloc(sizeof(float) * 4);
            for (int h = 0; h < Hi; h++) {
                w[h] = frand();
                for (int d = 0; d < Di; d++) qt[(size_t)d * Hp + h] = frand();
            }
            for (int i = 0; i < n * ks; i++) k[i] = frand() * 3;
            if (n > 3) k[(size_t)2 * ks + 1] = NAN; /* a NaN key: its dot is NaN, which counts as not > 0 */
            kn_dsa a = {Hp, Di, qt, w, k, ks, n, s}, r = a;
            r.score = sr;
            kt_dsa_scores(kn_default(), &a);
            kn_ref_dsa_scores(&r);
            int bad = memcmp(s, sr, sizeof(float) * (size_t)n) != 0, bad1 = 0;
            for (int t = 0; t < n; t++) { /* a key alone, from another offset: the same bits */
                kn_dsa b = a;
                b.k = k + (size_t)t * ks, b.n = 1, b.score = s1;
                kt_dsa_scores(kn_default(), &b);
                bad1 += memcmp(s1, s + t, 4) != 0;
            }
            /* against a double-precision oracle of the definition (relu per head, weighted sum) */
            double worst = 0;
            for (int t = 0; t < n; t++) {
                double o = 0, mag = 0;
                int nan = 0;
                for (int h = 0; h < Hi; h++) { /* mag: the terms' size (a dot near 0 cancels, and may land either side of 0) */
                    double dd = 0, ad = 0;
                    for (int d = 0; d < Di; d++) {
                        double p = (double)qt[(size_t)d * Hp + h] * k[(size_t)t * ks + d];
                        dd += p, ad += fabs(p);
                    }
                    if (dd != dd) nan = 1;
                    if (dd > 0) o += w[h] * dd;
                    mag += fabs(w[h]) * ad;
                }
                if (nan) continue;
                double e = fabs(s[t] - o) / (mag > 0 ? mag : 1);
                if (e > worst) worst = e;
            }
            CHECK_MSG(!bad && !bad1 && worst < 1e-5, "%s Hi %d Di %d n %d: ref %d, alone %d, rel err %.2e (seed %llu)", ISAS[isa], Hi, Di, n, bad, bad1,
                      worst, (unsigned long long)seed);
            free(qt); free(w); free(k); free(s); free(sr); free(s1);
        }
    }
    kn_force_isa("auto");
}
