/* kernels_bench.c: standalone timing of kn_matmul against the machine's memory-read floor.
 * Not part of `make`; build by hand after `make BUILD=build-kern`:
 *   gcc -std=c11 -O2 -D_GNU_SOURCE -Iinclude -Isrc -mavx512f -pthread \
 *       bench/kernels_bench.c build-kern/libpetrel.a -lm -o build-kern/kernels_bench
 *   ./build-kern/kernels_bench [threads] [lm_head_rows]
 * Decode (n = BENCH_DROWS activation rows, default 1): GB/s of weight bytes (+ scales) streamed, cycling through enough copies of each
 * matrix (>= 768 MB in total) that nothing is served from cache, like a forward pass over many
 * layers. Floor: summing a 1 GB buffer with AVX-512 on the same threads (pool), with the same
 * software prefetch (4 KB ahead) the kernels use; best of 5.
 * Prefill (n = BENCH_N, default 512): GFLOP/s (2 * rows * cols * n per call), [6144 x 2048] and
 * [2048 x 6144]; BENCH_WIDE=1 adds [6144 x 16384] (GLM-5.2's o_proj).
 * Experts (BENCH_ONLY=experts): 64 cold q4 experts over BENCH_N rows each (default 16), 32 per
 * kn_matmul_many, as the engine's expert-major prefill runs them.
 * Dispatch: us per kn_matmul on a tiny matrix (pool fan-out + activation prep), and one token's
 * routed experts (8 x gate/up [2048 x 6144] then 8 x down [6144 x 2048], q4) as 24 kn_matmul
 * calls vs 2 kn_matmul_many calls.
 * BENCH_R16=1: weights repacked to the row-interleaved layout (PT_LAYOUT_R16) first (decode,
 * prefill, experts, dispatch and mla's W_UV: the engine's layout for them).
 * Attention (BENCH_ONLY=attn): the exact f32 attention core of one decode row (64 heads x
 * BENCH_N keys, default 512) against the kn_matmul products it replaced (BENCH_ROWS=R: also R such
 * rows as one batch's, kt_attn_core_many, against one call a row); BENCH_COLD=K: the core
 * over K caches in turn (32 at 512 keys is past the last-level cache, as in a decode step).
 * DSA (BENCH_ONLY=dsa): the lightning indexer's scores (kn_dsa) of one query row over BENCH_N cached
 * keys (default 4096; GLM-5.2's 32 heads x 128) on one thread, GMAC/s beside one core's f32 FMA
 * peak (24 independent fma chains).
 * MLA (BENCH_ONLY=mla): the absorbed form's per-head W_UK^T q and W_UV lat of one decode row over
 * GLM-5.2's kv_b_proj (q8_g32; W_UV per head in R16 with BENCH_R16=1, as the engine repacks it),
 * cold (BENCH_HOT=1: one copy, from cache), as GB/s against the floor.
 * BENCH_HUGE=1: every weight matrix on transparent huge pages (madvise), as the engine's resident copy.
 * AMX (BENCH_ONLY=amx, a CPU with AMX-INT8): the measured AMX int8 peak (TDPBSSD on register
 * tiles, one thread and all threads), then R16 products at BENCH_N rows (default 512) and the
 * routed-expert prefill (64 cold q4 experts, 32 per kn_matmul_many) at 4..64 rows per expert,
 * each as isa avx512 and isa amx in alternation, as GMAC/s and as a fraction of the all-thread
 * peak; the rows where amx overtakes avx512 give KN_AMX_MIN_ROWS. bf16 [2048 x 6144] under
 * amx-bf16 too (not exact). BENCH_AMX_EXPERTS=0 skips the routed-expert sweep.
 * Env: BENCH_ONLY=decode|prefill|dispatch|experts|attn|dsa|mla|amx, BENCH_ISA=avx2|scalar, BENCH_ACTQ=0|1 (int8
 * activations: 0 off, 1 q4, 2 q4+q8 (default here)), BENCH_Q=q4_g64,... (formats to run),
 * BENCH_PF=BYTES (-1: none) and BENCH_PFL=1|2 (into L1 / L2): the R16 kernels' software prefetch. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

#include "base/pool.h"
#include "kernels/kernels.h"
#include "kernels/kn_internal.h"
#include "quant/quant.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (uint32_t)(rs >> 32); }

/* ---- memory floor ---- */
typedef struct { const float *buf; size_t n; int tasks; double sum[64]; } sum_ctx;
__attribute__((target("avx512f"))) static void sum_task(void *c_, int task, int thread) {
    (void)thread;
    sum_ctx *c = c_;
    size_t per = c->n / (size_t)c->tasks, i0 = per * (size_t)task, i1 = i0 + per;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = i0; i < i1; i += 64) {
        _mm_prefetch((const char *)(c->buf + i) + 4096, _MM_HINT_T1);
        _mm_prefetch((const char *)(c->buf + i) + 4096 + 64, _MM_HINT_T1);
        _mm_prefetch((const char *)(c->buf + i) + 4096 + 128, _MM_HINT_T1);
        _mm_prefetch((const char *)(c->buf + i) + 4096 + 192, _MM_HINT_T1);
        a0 = _mm512_add_ps(a0, _mm512_load_ps(c->buf + i));
        a1 = _mm512_add_ps(a1, _mm512_load_ps(c->buf + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_load_ps(c->buf + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_load_ps(c->buf + i + 48));
    }
    c->sum[task] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

static double mem_floor(void) {
    size_t bytes = 1ull << 30, n = bytes / 4;
    float *b = aligned_alloc(64, bytes);
    /* distinct pages: a periodic fill makes every page identical, which a hypervisor's page
     * merging (KSM) can back with one physical page that then reads from cache (73 "GB/s") */
    for (size_t i = 0; i < n; i++) b[i] = (float)(uint32_t)(i * 2654435761u >> 12);
    sum_ctx c = {b, n, 2 * kn_threads(), {0}};
    double best = 0;
    for (int rep = 0; rep < 10; rep++) {
        double t0 = now();
        pool_run(kn_pool(), c.tasks, sum_task, &c);
        double gbs = (double)bytes / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    free(b);
    return best;
}

/* ---- weights ---- */
typedef struct { pt_wview v; void *data, *scale; size_t bytes; } mat;

static mat make_mat(pt_qtype q, int64_t rows, int64_t cols) {
    mat m;
    memset(&m, 0, sizeof m);
    int64_t rb = pt_qtype_row_bytes(q, cols), spr = pt_qtype_scales_per_row(q, cols);
    if (getenv("BENCH_HUGE")) { /* BENCH_HUGE=1: on transparent huge pages, as the engine's resident weights */
        size_t sz = (size_t)((rb * rows + (2 << 20) - 1) / (2 << 20) * (2 << 20));
        m.data = aligned_alloc(2 << 20, sz);
        madvise(m.data, sz, MADV_HUGEPAGE);
    } else m.data = aligned_alloc(64, (size_t)((rb * rows + 63) / 64 * 64));
    uint8_t *d = m.data;
    for (int64_t i = 0; i < rb * rows; i += 4) { uint32_t r = rnd(); memcpy(d + i, &r, rb * rows - i < 4 ? (size_t)(rb * rows - i) : 4); }
    if (q == PT_BF16) for (int64_t i = 0; i < rows * cols; i++) ((uint16_t *)d)[i] = (uint16_t)(0x3c00 + (rnd() & 0x1ff) - 0x100 + ((rnd() & 1) << 15));
    if (q == PT_FP8_E4M3) for (int64_t i = 0; i < rb * rows; i++) if ((d[i] & 0x7f) == 0x7f) d[i] = 0;
    if (q == PT_FP8_E4M3) {
        int64_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;
        m.scale = malloc((size_t)(sr * sc) * 4);
        for (int64_t i = 0; i < sr * sc; i++) ((float *)m.scale)[i] = 1e-3f;
        m.v.qtype = q; m.v.rows = rows; m.v.cols = cols; m.v.data = d; m.v.row_bytes = rb;
        m.v.scale = m.scale; m.v.scale_dtype = PT_F32; m.v.block_rows = 128; m.v.block_cols = 128;
        m.v.scale_cols = sc;
        m.bytes = (size_t)(rb * rows + sr * sc * 4);
    } else {
        if (spr) {
            m.scale = malloc((size_t)(spr * rows) * 2);
            for (int64_t i = 0; i < spr * rows; i++) ((uint16_t *)m.scale)[i] = pt_f32_to_bf16(0.01f);
        }
        m.v = pt_wview_make(q, rows, cols, d, m.scale, PT_BF16);
        m.bytes = (size_t)(rb * rows + spr * rows * 2);
    }
    return m;
}

/* Decode GB/s, best of 12 short rounds. With int8 activations available for the format the
 * rounds alternate on/off (interleaved, so both see the same machine load) and both are printed. */
static void bench_decode(pt_qtype q, int64_t rows, int64_t cols, double floor_gbs) {
    mat probe = make_mat(q, rows, cols);
    int copies = (int)((768ull << 20) / probe.bytes) + 1;
    if (copies > 64) copies = 64;
    mat *ms = malloc(sizeof(mat) * (size_t)copies);
    ms[0] = probe;
    for (int i = 1; i < copies; i++) ms[i] = make_mat(q, rows, cols);
    int n = getenv("BENCH_DROWS") ? atoi(getenv("BENCH_DROWS")) : 1; /* activation rows per call */
    if (n < 1) n = 1;
    float *x = malloc((size_t)(cols * n) * 4), *y = malloc((size_t)(rows * n) * 4);
    for (int64_t j = 0; j < cols * n; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
    int r16 = getenv("BENCH_R16") && kn_r16_available() && kn_r16_supported(&ms[0].v);
    if (r16) for (int i = 0; i < copies; i++) kn_r16_repack(&ms[i].v);
    for (int i = 0; i < copies; i++) kn_matmul(&ms[i].v, x, n, y); /* warm-up, page-in */
    int user = kn_act_quant(), ab = !r16 && user && kn_act_quant_active(&probe.v);
    /* BENCH_PF_B=BYTES (-1 none): R16 rounds alternate the prefetch set at start (BENCH_PF or the
     * default) with this one, into L1, every line; the second figure is printed as "pf B" */
    const char *pfb = r16 ? getenv("BENCH_PF_B") : NULL;
    int pfa = kn_default()->pf_bytes;
    if (pfb) ab = 1;
    double best[2] = {0, 0};
    for (int rep = 0; rep < 12; rep++)
        for (int m = 0; m <= ab; m++) {
            if (pfb) kn_set_prefetch(m ? atoi(pfb) : (pfa ? pfa : -1), 1, 0);
            else kn_set_act_quant(ab && m ? 0 : user); /* m = 0: int8 activations (if available) */
            int calls = 0;
            double t0 = now(), t;
            do {
                for (int i = 0; i < copies; i++) kn_matmul(&ms[i].v, x, n, y);
                calls += copies;
            } while ((t = now() - t0) < 0.1);
            double gbs = (double)probe.bytes * calls / t / 1e9;
            if (gbs > best[m]) best[m] = gbs;
        }
    kn_set_act_quant(user);
    printf("decode%-2d%-9s [%6lld x %5lld] %7.1f MB x%-3d  %6.2f GB/s  %6.1f us/call  %.2fx floor",
           n, pt_qtype_name(q), (long long)rows, (long long)cols, probe.bytes / 1e6, copies, best[0],
           probe.bytes / best[0] / 1e3, floor_gbs / best[0]);
    if (pfb) printf("   (pf %s: %6.2f GB/s %.2fx)", pfb, best[1], floor_gbs / best[1]);
    else if (ab) printf("   (f32 act: %6.2f GB/s %.2fx)", best[1], floor_gbs / best[1]);
    printf("%s\n", ab ? "  int8 act" : r16 ? "  r16 (int8 act)" : "");
    for (int i = 0; i < copies; i++) { free(ms[i].data); free(ms[i].scale); }
    free(ms); free(x); free(y);
}

static void bench_prefill(pt_qtype q, int64_t rows, int64_t cols, int n) {
    mat m = make_mat(q, rows, cols);
    float *x = malloc((size_t)(cols * n) * 4), *y = malloc((size_t)(rows * n) * 4);
    for (int64_t j = 0; j < cols * n; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
    int r16 = getenv("BENCH_R16") && kn_r16_available() && kn_r16_supported(&m.v);
    if (r16) kn_r16_repack(&m.v);
    kn_matmul(&m.v, x, n, y);
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        kn_matmul(&m.v, x, n, y);
        double t = now() - t0;
        if (t < best) best = t;
    }
    printf("prefill %-9s [%6lld x %5lld] n=%d  %7.1f GFLOP/s  (%.1f ms)%s\n", pt_qtype_name(q),
           (long long)rows, (long long)cols, n, 2.0 * rows * cols * n / best / 1e9, best * 1e3, r16 ? "  r16" : "");
    free(m.data); free(m.scale); free(x); free(y);
}

static void bench_dispatch(void) {
    mat t = make_mat(PT_Q4_G64, 16, 64);
    float x[6144], y[6144];
    for (int j = 0; j < 6144; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
    for (int i = 0; i < 1000; i++) kn_matmul(&t.v, x, 1, y);
    double t0 = now();
    int it = 0;
    while (now() - t0 < 0.3) { kn_matmul(&t.v, x, 1, y); it++; }
    printf("dispatch kn_matmul [16 x 64] q4: %.2f us/call\n", (now() - t0) / it * 1e6);
    /* one token's experts: 8 experts, gate+up then down; copies so that nothing is cached */
    enum { E = 8, SETS = 6 };
    mat *g = malloc(sizeof(mat) * E * SETS), *u = malloc(sizeof(mat) * E * SETS),
        *d = malloc(sizeof(mat) * E * SETS);
    for (int i = 0; i < E * SETS; i++) {
        g[i] = make_mat(PT_Q4_G64, 2048, 6144);
        u[i] = make_mat(PT_Q4_G64, 2048, 6144);
        d[i] = make_mat(PT_Q4_G64, 6144, 2048);
        if (getenv("BENCH_R16") && kn_r16_available()) { kn_r16_repack(&g[i].v); kn_r16_repack(&u[i].v); kn_r16_repack(&d[i].v); }
    }
    float *h = malloc(sizeof(float) * E * 2 * 2048), *o = malloc(sizeof(float) * E * 6144);
    double bytes = (double)E * (g[0].bytes + u[0].bytes + d[0].bytes);
    for (int mode = 0; mode < 2; mode++) {
        double best = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            double t1 = now();
            for (int sset = 0; sset < SETS; sset++) {
                mat *gs = g + sset * E, *us = u + sset * E, *ds = d + sset * E;
                if (mode == 0) {
                    for (int e = 0; e < E; e++) {
                        kn_matmul(&gs[e].v, x, 1, h + e * 4096);
                        kn_matmul(&us[e].v, x, 1, h + e * 4096 + 2048);
                    }
                    for (int e = 0; e < E; e++) kn_matmul(&ds[e].v, h + e * 4096, 1, o + e * 6144);
                } else {
                    kn_job jobs[2 * E];
                    for (int e = 0; e < E; e++) {
                        jobs[2 * e] = (kn_job){&gs[e].v, x, 1, h + e * 4096};
                        jobs[2 * e + 1] = (kn_job){&us[e].v, x, 1, h + e * 4096 + 2048};
                    }
                    kn_matmul_many(jobs, 2 * E);
                    for (int e = 0; e < E; e++) jobs[e] = (kn_job){&ds[e].v, h + e * 4096, 1, o + e * 6144};
                    kn_matmul_many(jobs, E);
                }
            }
            double tt = (now() - t1) / SETS;
            if (tt < best) best = tt;
        }
        printf("experts x8 (gate+up+down, q4, %.1f MB/token) %s: %.1f us/token  %.2f GB/s\n",
               bytes / 1e6, mode ? "kn_matmul_many x2 " : "kn_matmul x24     ", best * 1e6,
               bytes / best / 1e9);
    }
    for (int i = 0; i < E * SETS; i++) {
        free(g[i].data); free(g[i].scale); free(u[i].data); free(u[i].scale);
        free(d[i].data); free(d[i].scale);
    }
    free(g); free(u); free(d); free(h); free(o); free(t.data); free(t.scale);
}

/* One pass of the engine's expert-major prefill over NE experts: gate and up of eb experts in one
 * kn_matmul_many, then their down products in another (n rows each; eb <= 32). */
static void run_experts(const mat *g, const mat *u, const mat *d, int NE, int eb, const float *x, float *h, float *o, int n) {
    for (int b0 = 0; b0 < NE; b0 += eb) {
        kn_job jobs[64];
        for (int e = 0; e < eb; e++) {
            float *he = h + (size_t)e * n * 4096;
            jobs[2 * e] = (kn_job){&g[b0 + e].v, x + (size_t)e * n * 6144, n, he};
            jobs[2 * e + 1] = (kn_job){&u[b0 + e].v, x + (size_t)e * n * 6144, n, he + (size_t)n * 2048};
        }
        kn_matmul_many(jobs, 2 * eb);
        for (int e = 0; e < eb; e++) jobs[e] = (kn_job){&d[b0 + e].v, h + (size_t)e * n * 4096, n, o + (size_t)e * n * 6144};
        kn_matmul_many(jobs, eb);
    }
}

/* Prefill's routed experts: NE experts (q4 gate/up [2048 x 6144], down [6144 x 2048]; ~1.3 GB,
 * so weights come from memory) over n rows each, in batches of 32 experts per kn_matmul_many
 * (the engine's expert-major prefill). GFLOP/s = 6 * 2048 * 6144 * n * NE / time. */
static void bench_experts_prefill(int n) {
    enum { NE = 64, EB = 32 };
    mat *g = malloc(sizeof(mat) * NE), *u = malloc(sizeof(mat) * NE), *d = malloc(sizeof(mat) * NE);
    int r16 = getenv("BENCH_R16") != NULL;
    for (int i = 0; i < NE; i++) {
        g[i] = make_mat(PT_Q4_G64, 2048, 6144);
        u[i] = make_mat(PT_Q4_G64, 2048, 6144);
        d[i] = make_mat(PT_Q4_G64, 6144, 2048);
        if (r16 && kn_r16_available()) { kn_r16_repack(&g[i].v); kn_r16_repack(&u[i].v); kn_r16_repack(&d[i].v); }
    }
    float *x = malloc(sizeof(float) * (size_t)EB * n * 6144), *h = malloc(sizeof(float) * (size_t)EB * n * 2048 * 2),
          *o = malloc(sizeof(float) * (size_t)EB * n * 6144);
    for (int64_t j = 0; j < (int64_t)EB * n * 6144; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
    double best = 1e30;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = now();
        run_experts(g, u, d, NE, EB, x, h, o, n);
        double t = now() - t0;
        if (t < best) best = t;
    }
    printf("prefill experts x%d (q4%s, n=%d each): %.1f GFLOP/s, %.2f ms per expert, weights %.2f GB/s\n", NE,
           r16 ? " r16" : "", n, 6.0 * 2048 * 6144 * n * NE / best / 1e9, best / NE * 1e3,
           (double)NE * (g[0].bytes + u[0].bytes + d[0].bytes) / best / 1e9);
    for (int i = 0; i < NE; i++) {
        free(g[i].data); free(g[i].scale); free(u[i].data); free(u[i].scale); free(d[i].data); free(d[i].scale);
    }
    free(g); free(u); free(d); free(x); free(h); free(o);
}

/* ---- attention core (BENCH_ONLY=attn) ----
 * One decode row of GLM-5.2's absorbed MLA: 64 heads x N cached keys (BENCH_N, default 512),
 * kv_lora_rank 512, rope 64: kn_attn_core against the products it replaced (kn_matmul of q~
 * and of q_pe over f32 views of the cache, kn_softmax per head, kn_matmul_t of P over the cache),
 * alternating, best of 7 rounds of 20 calls each. GFLOP/s counts 2 * 64 * N * (512 + 64 + 512). */
static pt_wview f32v(const float *d, int64_t rows, int64_t cols) {
    pt_wview v;
    memset(&v, 0, sizeof v);
    v.qtype = PT_F32; v.rows = rows; v.cols = cols; v.data = (const uint8_t *)d; v.row_bytes = cols * 4;
    return v;
}

static void bench_attn(int N) {
    const int M = 64, D = 512, Dr = 64;
    float *q = malloc(sizeof(float) * M * D), *qp = malloc(sizeof(float) * M * Dr), *lat = malloc(sizeof(float) * M * D);
    /* BENCH_COLD=K: K separate caches used in turn (K x N x 2.3 KB; 32 at N = 512 is 38 MB, past
     * the last-level cache), as in a decode step, where every layer and session has its own */
    int K = getenv("BENCH_COLD") ? atoi(getenv("BENCH_COLD")) : 1;
    if (K < 1) K = 1;
    float *C = malloc(sizeof(float) * (size_t)N * D * K), *P = malloc(sizeof(float) * (size_t)N * Dr * K);
    float *sc = malloc(sizeof(float) * (size_t)M * N), *sp = malloc(sizeof(float) * (size_t)M * N);
    float *scr = malloc(sizeof(float) * kn_attn_scratch_floats(M, N, D, Dr));
    const float **kc = malloc(sizeof(float *) * (size_t)N * K), **kp = malloc(sizeof(float *) * (size_t)N * K);
    for (int i = 0; i < M * D; i++) q[i] = (float)rnd() / 4294967296.0f - 0.5f;
    for (int i = 0; i < M * Dr; i++) qp[i] = (float)rnd() / 4294967296.0f - 0.5f;
    for (size_t i = 0; i < (size_t)N * D * K; i++) C[i] = (float)rnd() / 4294967296.0f - 0.5f;
    for (size_t i = 0; i < (size_t)N * Dr * K; i++) P[i] = (float)rnd() / 4294967296.0f - 0.5f;
    for (size_t t = 0; t < (size_t)N * K; t++) { kc[t] = C + t * D; kp[t] = P + t * Dr; }
    kn_attn a = {M, D, Dr, N, q, D, qp, Dr, kc, kp, NULL, 0.07f, lat, D};
    pt_wview vc = f32v(C, N, D), vp = f32v(P, N, Dr);
    double best_new = 1e9, best_old = 1e9;
    for (int round = 0; round < 7; round++) {
        double t0 = now();
        for (int it = 0; it < 20; it++) {
            a.kc = kc + (size_t)(it % K) * N, a.kp = kp + (size_t)(it % K) * N;
            kn_attn_core(&a, scr);
        }
        double t1 = now();
        for (int it = 0; it < 20; it++) {
            kn_matmul(&vc, q, M, sc);
            kn_matmul(&vp, qp, M, sp);
            for (int h = 0; h < M; h++) {
                float *row = sc + (size_t)h * N;
                for (int i = 0; i < N; i++) row[i] = 0.07f * (row[i] + sp[(size_t)h * N + i]);
                kn_softmax(row, N);
            }
            kn_matmul_t(&vc, sc, M, lat);
        }
        double t2 = now();
        if ((t1 - t0) / 20 < best_new) best_new = (t1 - t0) / 20;
        if ((t2 - t1) / 20 < best_old) best_old = (t2 - t1) / 20;
    }
    double fl = 2.0 * M * N * (D + Dr + D);
    /* BENCH_ROWS=R: R such rows as one batch's (kt_attn_core_many, each row its own keys from
     * the K caches in turn, its own scratch), alternated with the R rows one call each */
    int R = getenv("BENCH_ROWS") ? atoi(getenv("BENCH_ROWS")) : 1;
    if (R > 1 && R <= 64) {
        kn_attn *as = malloc(sizeof(kn_attn) * (size_t)R);
        float **scrs = malloc(sizeof(float *) * (size_t)R), *lats = malloc(sizeof(float) * (size_t)M * D * R);
        for (int i = 0; i < R; i++) {
            as[i] = a, as[i].lat = lats + (size_t)i * M * D;
            scrs[i] = malloc(sizeof(float) * kn_attn_scratch_floats(M, N, D, Dr));
        }
        double best_many = 1e9, best_one = 1e9;
        int call = 0;
        for (int round = 0; round < 7; round++) {
            double t0 = now();
            for (int it = 0; it < 5; it++, call++) {
                for (int i = 0; i < R; i++) as[i].kc = kc + (size_t)((call * R + i) % K) * N, as[i].kp = kp + (size_t)((call * R + i) % K) * N;
                kt_attn_core_many(kn_default(), as, R, scrs);
            }
            double t1 = now();
            for (int it = 0; it < 5; it++, call++)
                for (int i = 0; i < R; i++) {
                    as[i].kc = kc + (size_t)((call * R + i) % K) * N, as[i].kp = kp + (size_t)((call * R + i) % K) * N;
                    kn_attn_core(&as[i], scrs[i]);
                }
            double t2 = now();
            if ((t1 - t0) / 5 < best_many) best_many = (t1 - t0) / 5;
            if ((t2 - t1) / 5 < best_one) best_one = (t2 - t1) / 5;
        }
        printf("attention core, %d rows of 64 heads x %d keys%s: together %.1f us a row (%.1f GFLOP/s), one call a row %.1f us a row (%.1f GFLOP/s)\n", R, N,
               K > 1 ? " (cold caches)" : "", best_many / R * 1e6, fl * R / best_many * 1e-9, best_one / R * 1e6, fl * R / best_one * 1e-9);
        for (int i = 0; i < R; i++) free(scrs[i]);
        free(as); free(scrs); free(lats);
    }
    printf("attention core%s, 64 heads x %d keys: kn_attn_core %.1f us (%.1f GFLOP/s), matmul products %.1f us (%.1f GFLOP/s): %.2fx\n", K > 1 ? " (cold caches; the products hot)" : "", N,
           best_new * 1e6, fl / best_new * 1e-9, best_old * 1e6, fl / best_old * 1e-9, best_old / best_new);
    free(q); free(qp); free(lat); free(C); free(P); free(sc); free(sp); free(scr); free(kc); free(kp);
}


/* ---- DSA indexer scores (BENCH_ONLY=dsa) ---- */
__attribute__((target("avx512f"))) static double fma_peak_1core(void) {
    __m512 a[24], m = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    for (int i = 0; i < 24; i++) a[i] = _mm512_set1_ps((float)i);
    const long it = 20000000;
    double t0 = now();
    for (long k = 0; k < it; k++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++) a[i] = _mm512_fmadd_ps(a[i], m, b);
        __asm__ volatile("" : "+v"(m));
    }
    double t = now() - t0;
    __m512 s = a[0];
    for (int i = 1; i < 24; i++) s = _mm512_add_ps(s, a[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return 16.0 * 24 * it / t; /* multiply-adds per second */
}

static void bench_dsa(int n) {
    const int Hi = 32, Di = 128, Hp = kn_dsa_heads(Hi);
    float *qt = calloc((size_t)Di * Hp, 4), *w = calloc((size_t)Hp, 4), *k = malloc(sizeof(float) * (size_t)n * Di), *sc = malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < Di * Hp; i++) qt[i] = (float)rnd() / 4294967296.0f - 0.5f;
    for (int h = 0; h < Hi; h++) w[h] = (float)rnd() / 4294967296.0f;
    for (size_t i = 0; i < (size_t)n * Di; i++) k[i] = (float)rnd() / 4294967296.0f - 0.5f;
    kn_dsa a = {Hp, Di, qt, w, k, Di, n, sc};
    kt_dsa_scores(kn_default(), &a);
    double best = 1e9;
    for (int round = 0; round < 30; round++) {
        double t0 = now();
        kt_dsa_scores(kn_default(), &a);
        double t = now() - t0;
        if (t < best) best = t;
    }
    double macs = (double)n * Hi * Di / best, peak = fma_peak_1core();
    printf("dsa scores, %d heads x %d over %d keys, one thread: %.3f ms = %.1f GMAC/s, %.0f %% of one core's f32 FMA peak (%.1f GMAC/s)\n", Hi, Di, n,
           best * 1e3, macs * 1e-9, 100.0 * macs / peak, peak * 1e-9);
    free(qt); free(w); free(k); free(sc);
}

/* ---- AMX (BENCH_ONLY=amx) ---- */
/* MAC/s: one thread and all pool threads' count at once (kn_amx_peak_macs: a thread each); best of 3. */
static void amx_peak(double *one, double *all) {
    *one = *all = 0;
    for (int rep = 0; rep < 3; rep++) {
        double a = kn_amx_peak_macs(1), b = kn_amx_peak_macs(kn_threads());
        if (a > *one) *one = a;
        if (b > *all) *all = b;
    }
}

/* best time of kn_matmul_many(jobs) under isa, over reps */
static double time_jobs(const char *isa, const kn_job *jobs, int nj, int reps) {
    kn_force_isa(isa);
    kn_matmul_many(jobs, nj);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        kn_matmul_many(jobs, nj);
        double t = now() - t0;
        if (t < best) best = t;
    }
    return best;
}

static void bench_amx(int n) {
    if (!kn_amx_available()) { printf("amx: this CPU (or OS) has no AMX-INT8\n"); return; }
    double one, all;
    amx_peak(&one, &all);
    printf("AMX int8 peak (TDPBSSD, register tiles): %.0f GMAC/s one thread, %.0f GMAC/s on %d threads (%.0f per thread)\n", one / 1e9,
           all / 1e9, kn_threads(), all / 1e9 / kn_threads());
    /* one thread, warm (L2-resident) weights and activations: the kernels' own compute rate */
    for (int q4 = 0; q4 < 2; q4++) {
        pt_qtype q = q4 ? PT_Q4_G64 : PT_Q8_G32;
        mat m = make_mat(q, 64, 2048);
        kn_r16_repack(&m.v);
        int nw = 64;
        float *x = malloc(sizeof(float) * 2048 * nw), *y = malloc(sizeof(float) * 64 * nw);
        for (int j = 0; j < 2048 * nw; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
        int64_t xs = kn_r16_xs(&m.v);
        uint8_t *xq = aligned_alloc(64, (size_t)(xs * nw));
        kn_r16_prep_avx512(&m.v, x, nw, xq);
        double best[2] = {1e30, 1e30};
        for (int rep = 0; rep < 5; rep++)
            for (int k = 0; k < 2; k++) {
                double t0 = now();
                for (int it = 0; it < 50; it++) {
                    if (k) kn_r16_rows_amx(&m.v, 0, 64, xq, xs, nw, y);
                    else kn_r16_rows_avx512(&m.v, 0, 64, xq, xs, nw, y, 4096, 0, 1);
                }
                double t = (now() - t0) / 50;
                if (t < best[k]) best[k] = t;
            }
        double macs = 64.0 * 2048 * nw;
        printf("one thread, warm, r16 %s [64 x 2048] n=%d: avx512 %.0f GMAC/s, amx %.0f GMAC/s = %.1f %% of the one-thread AMX peak (%.2fx)\n",
               pt_qtype_name(q), nw, macs / best[0] / 1e9, macs / best[1] / 1e9, 100 * macs / best[1] / one, best[0] / best[1]);
        free(x); free(y); free(xq); free(m.data); free(m.scale);
    }
    /* R16 products at n rows (the AMX column on the tile kernel whatever n: threshold 1) */
    kn_set_amx_min_rows(1);
    const pt_qtype Q[] = {PT_Q8_G32, PT_Q4_G64};
    const int64_t S[][2] = {{6144, 2048}, {2048, 6144}, {16384, 6144}};
    for (int qi = 0; qi < 2; qi++)
        for (int si = 0; si < 3; si++) {
            mat m = make_mat(Q[qi], S[si][0], S[si][1]);
            kn_r16_repack(&m.v);
            float *x = malloc((size_t)(S[si][1] * n) * 4), *y = malloc((size_t)(S[si][0] * n) * 4);
            for (int64_t j = 0; j < S[si][1] * n; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
            kn_job j = {&m.v, x, n, y};
            double macs = (double)S[si][0] * S[si][1] * n, ta = 1e30, tv = 1e30;
            for (int k = 0; k < 3; k++) {
                double a = time_jobs("avx512", &j, 1, 2), b = time_jobs("amx", &j, 1, 2);
                if (a < tv) tv = a;
                if (b < ta) ta = b;
            }
            printf("r16 %-7s [%5lld x %5lld] n=%d: avx512 %7.1f GMAC/s (%4.1f %% of AMX peak), amx %7.1f GMAC/s (%4.1f %%): %.2fx\n",
                   pt_qtype_name(Q[qi]), (long long)S[si][0], (long long)S[si][1], n, macs / tv / 1e9, 100 * macs / tv / all,
                   macs / ta / 1e9, 100 * macs / ta / all, tv / ta);
            free(x); free(y); free(m.data); free(m.scale);
        }
    /* bf16 weights: f32 activations (avx512, exact) vs amx-bf16 */
    if (kn_amx_bf16_available()) {
        mat m = make_mat(PT_BF16, 2048, 6144);
        float *x = malloc((size_t)6144 * n * 4), *y = malloc((size_t)2048 * n * 4);
        for (int64_t j = 0; j < 6144LL * n; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
        kn_job j = {&m.v, x, n, y};
        double macs = 2048.0 * 6144 * n, tv = time_jobs("avx512", &j, 1, 3), ta = time_jobs("amx-bf16", &j, 1, 3);
        printf("bf16    [ 2048 x  6144] n=%d: avx512 %7.1f GMAC/s, amx-bf16 %7.1f GMAC/s: %.2fx (not exact)\n", n, macs / tv / 1e9,
               macs / ta / 1e9, tv / ta);
        free(x); free(y); free(m.data); free(m.scale);
    }
    kn_set_amx_min_rows(KN_AMX_MIN_ROWS);
    if (getenv("BENCH_AMX_EXPERTS") && !atoi(getenv("BENCH_AMX_EXPERTS"))) return; /* BENCH_AMX_EXPERTS=0: skip the sweep below */
    /* routed experts of prefill: 64 cold q4 experts, rows per expert swept */
    enum { NE = 64, EB = 32 };
    mat *g = malloc(sizeof(mat) * NE), *u = malloc(sizeof(mat) * NE), *d = malloc(sizeof(mat) * NE);
    for (int i = 0; i < NE; i++) {
        g[i] = make_mat(PT_Q4_G64, 2048, 6144);
        u[i] = make_mat(PT_Q4_G64, 2048, 6144);
        d[i] = make_mat(PT_Q4_G64, 6144, 2048);
        kn_r16_repack(&g[i].v); kn_r16_repack(&u[i].v); kn_r16_repack(&d[i].v);
    }
    const int NR[] = {1, 2, 4, 8, 12, 16, 24, 32, 64};
    int maxn = 64;
    float *x = malloc(sizeof(float) * (size_t)EB * maxn * 6144), *h = malloc(sizeof(float) * (size_t)EB * maxn * 2048 * 2),
          *o = malloc(sizeof(float) * (size_t)EB * maxn * 6144);
    for (int64_t j = 0; j < (int64_t)EB * maxn * 6144; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
    for (int ni = 0; ni < (int)(sizeof NR / sizeof NR[0]); ni++) {
        int nn = NR[ni];
        double best[2] = {1e30, 1e30};
        for (int rep = 0; rep < 4; rep++)
            for (int mode = 0; mode < 2; mode++) {
                kn_force_isa(mode ? "amx" : "avx512");
                kn_set_amx_min_rows(1);
                double t0 = now();
                run_experts(g, u, d, NE, EB, x, h, o, nn);
                double t = now() - t0;
                if (t < best[mode]) best[mode] = t;
            }
        kn_set_amx_min_rows(KN_AMX_MIN_ROWS);
        double macs = 3.0 * 2048 * 6144 * nn * NE;
        printf("experts x%d q4 r16, %2d rows each: avx512 %7.1f GMAC/s (%4.1f %%), amx %7.1f GMAC/s (%4.1f %% of AMX peak): %.2fx  "
               "(weights %.1f / %.1f GB/s)\n", NE, nn, macs / best[0] / 1e9, 100 * macs / best[0] / all, macs / best[1] / 1e9,
               100 * macs / best[1] / all, best[0] / best[1], NE * (g[0].bytes + u[0].bytes + d[0].bytes) / best[0] / 1e9,
               NE * (g[0].bytes + u[0].bytes + d[0].bytes) / best[1] / 1e9);
    }
    kn_force_isa("auto");
    for (int i = 0; i < NE; i++) {
        free(g[i].data); free(g[i].scale); free(u[i].data); free(u[i].scale); free(d[i].data); free(d[i].scale);
    }
    free(g); free(u); free(d); free(x); free(h); free(o);
}

/* MLA's absorbed head products of one decode row (BENCH_ONLY=mla): GLM-5.2's kv_b_proj [64 x
 * (192 + 256) = 28672][512] in q8_g32, cycled through enough copies to be cold; per head, as the
 * engine's uk_task / uv_task, W_UK_h^T q (kn_matmul_t over the head's 192 rows) and W_UV_h lat
 * (kn_matmul over its 256; with BENCH_R16 each head's W_UV rows repacked to R16 in place, as the
 * engine's open does), the heads as pool tasks: GB/s of each part's weight bytes (BENCH_MROWS=R:
 * R rows a head, as a batch's). The bound line (one kn_matmul over every row) runs first, on the
 * plain layout. */
typedef struct { const pt_wview *uk, *uv; const float *x; float *y; int t, n; } mla_ctx;
static void mla_task(void *c_, int h, int thread) {
    (void)thread;
    const mla_ctx *c = c_;
    if (c->t) kn_matmul(&c->uv[h], c->x + (size_t)h * 512 * c->n, c->n, c->y + (size_t)h * 256 * c->n);
    else kn_matmul_t(&c->uk[h], c->x + (size_t)h * 192 * c->n, c->n, c->y + (size_t)h * 512 * c->n);
}
static void bench_mla(double floor_gbs) {
    mat probe = make_mat(PT_Q8_G32, 28672, 512);
    int copies = getenv("BENCH_HOT") ? 1 : (int)((768ull << 20) / probe.bytes) + 1; /* BENCH_HOT: one copy (from cache where it fits) */
    mat *ms = malloc(sizeof(mat) * (size_t)copies);
    ms[0] = probe;
    for (int i = 1; i < copies; i++) ms[i] = make_mat(PT_Q8_G32, 28672, 512);
    /* BENCH_MROWS=R: R rows a head (a batch's decode rows: each head's weights read once for them) */
    const int R = getenv("BENCH_MROWS") && atoi(getenv("BENCH_MROWS")) > 0 ? atoi(getenv("BENCH_MROWS")) : 1;
    float *x = malloc((size_t)64 * 512 * 4 * R), *y = malloc((size_t)64 * 512 * 4 * R);
    for (size_t j = 0; j < (size_t)64 * 512 * R; j++) x[j] = (float)(rnd() % 1000) / 1000.f - 0.5f;
    { /* the bound: one kn_matmul over every row of kv_b_proj (one input for all heads), plain layout */
        float *yy = malloc(28672 * 4);
        double best = 0;
        for (int rep = 0; rep < 12; rep++) {
            int calls = 0;
            double t0 = now(), dt;
            do {
                for (int i = 0; i < copies; i++) kn_matmul(&ms[i].v, x, 1, yy);
                calls += copies;
            } while ((dt = now() - t0) < 0.1);
            double gbs = (double)probe.bytes * calls / dt / 1e9;
            if (gbs > best) best = gbs;
        }
        printf("%-44s %6.2f MB  %6.2f GB/s  %6.1f us a layer  %.2fx floor\n", "one kn_matmul over all 28672 rows", probe.bytes / 1e6, best,
               probe.bytes / best / 1e3, floor_gbs / best);
        free(yy);
    }
    /* each copy's per-head views: W_UK plain, W_UV repacked to R16 where asked (in place) */
    pt_wview *uk = malloc(sizeof(pt_wview) * 64 * (size_t)copies), *uv = malloc(sizeof(pt_wview) * 64 * (size_t)copies);
    const int r16 = getenv("BENCH_R16") && kn_r16_available();
    for (int i = 0; i < copies; i++)
        for (int h = 0; h < 64; h++) {
            const pt_wview *W = &ms[i].v;
            int64_t spr = W->scale_cols, rk = (int64_t)h * 448, rv = rk + 192;
            uk[i * 64 + h] = pt_wview_make(W->qtype, 192, W->cols, W->data + rk * W->row_bytes, (const uint16_t *)W->scale + rk * spr, PT_BF16);
            uv[i * 64 + h] = pt_wview_make(W->qtype, 256, W->cols, W->data + rv * W->row_bytes, (const uint16_t *)W->scale + rv * spr, PT_BF16);
            if (r16 && kn_r16_supported(&uv[i * 64 + h])) kn_r16_repack(&uv[i * 64 + h]);
        }
    const char *nm[2] = {"W_UK^T q (kn_matmul_t, 64 x [192 x 512])", r16 ? "W_UV lat (kn_matmul, 64 x [256 x 512], r16)" : "W_UV lat (kn_matmul, 64 x [256 x 512])"};
    for (int t = 0; t < 2; t++) {
        double part = (double)probe.bytes * (t ? 256.0 : 192.0) / 448.0, best = 0;
        for (int rep = 0; rep < 12; rep++) {
            int calls = 0;
            double t0 = now(), dt;
            do {
                for (int i = 0; i < copies; i++) {
                    mla_ctx c = {uk + i * 64, uv + i * 64, x, y, t, R};
                    pool_run(kn_pool(), 64, mla_task, &c);
                }
                calls += copies;
            } while ((dt = now() - t0) < 0.1);
            double gbs = part * calls / dt / 1e9;
            if (gbs > best) best = gbs;
        }
        printf("%-44s %6.2f MB  %6.2f GB/s  %6.1f us a layer  %.2fx floor%s\n", nm[t], part / 1e6, best, part / best / 1e3, floor_gbs / best,
               R > 1 ? " (BENCH_MROWS rows)" : "");
    }
    for (int i = 0; i < copies; i++) { free(ms[i].data); free(ms[i].scale); }
    free(ms); free(x); free(y); free(uk); free(uv);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    int64_t head_rows = argc > 2 ? atoll(argv[2]) : 40960;
    if (getenv("BENCH_PF")) { /* the R16 kernels' prefetch: BYTES (-1 none) and BENCH_PFL 1 (L1) or 2 (L2) */
        const char *l = getenv("BENCH_PFL");
        const char *al = getenv("BENCH_PF_LINES");
        if (kn_set_prefetch(atoi(getenv("BENCH_PF")), l ? atoi(l) : 1, al ? atoi(al) : 0)) { fprintf(stderr, "bad BENCH_PF / BENCH_PFL / BENCH_PF_LINES\n"); return 1; }
    }
    const char *only = getenv("BENCH_ONLY"); /* "decode" or "prefill" */
    kn_init(threads);
    if (getenv("BENCH_ISA")) kn_force_isa(getenv("BENCH_ISA"));
    kn_set_act_quant(getenv("BENCH_ACTQ") ? atoi(getenv("BENCH_ACTQ")) : 2);
    const char *qsel = getenv("BENCH_Q");
    printf("isa %s, %d threads, int8 activations %s\n", kn_isa_name(), kn_threads(),
           kn_act_quant() ? "on" : "off");
    if (only && !strcmp(only, "dispatch")) { bench_dispatch(); return 0; }
    if (only && !strcmp(only, "attn")) {
        int n = getenv("BENCH_N") ? atoi(getenv("BENCH_N")) : 512;
        bench_attn(n);
        return 0;
    }
    if (only && !strcmp(only, "dsa")) {
        bench_dsa(getenv("BENCH_N") ? atoi(getenv("BENCH_N")) : 4096);
        return 0;
    }
    if (only && !strcmp(only, "amx")) {
        bench_amx(getenv("BENCH_N") ? atoi(getenv("BENCH_N")) : 512);
        return 0;
    }
    if (only && !strcmp(only, "experts")) {
        bench_experts_prefill(getenv("BENCH_N") ? atoi(getenv("BENCH_N")) : 16);
        return 0;
    }
    double fl = mem_floor();
    printf("memory floor (AVX-512 sum of 1 GB): %.2f GB/s\n", fl);
    if (only && !strcmp(only, "mla")) {
        bench_mla(fl);
        return 0;
    }
    const pt_qtype Q[] = {PT_BF16, PT_FP8_E4M3, PT_Q8_ROW, PT_Q8_G32, PT_Q4_G64};
    if (!only || !strcmp(only, "decode"))
        for (int qi = 0; qi < 5; qi++) {
            if (qsel && !strstr(qsel, pt_qtype_name(Q[qi]))) continue;
            bench_decode(Q[qi], 6144, 2048, fl);
            bench_decode(Q[qi], 2048, 6144, fl);
            bench_decode(Q[qi], head_rows, 6144, fl);
        }
    if (!only || !strcmp(only, "prefill"))
        for (int qi = 0; qi < 5; qi++)
            if (!qsel || strstr(qsel, pt_qtype_name(Q[qi]))) {
                int n = getenv("BENCH_N") ? atoi(getenv("BENCH_N")) : 512;
                bench_prefill(Q[qi], 6144, 2048, n);
                bench_prefill(Q[qi], 2048, 6144, n);
                if (getenv("BENCH_WIDE")) bench_prefill(Q[qi], 6144, 16384, n); /* GLM-5.2 o_proj */
            }
    if (!only) bench_dispatch();
    return 0;
}
