/* attn_avx512.c: the exact f32 attention core (kernels.h: kn_attn) with AVX-512, bitwise equal
 * to kn_ref_attn (ref.c). Built with -mavx512* (Makefile, by file name); dispatch.c calls it
 * only where the CPU has AVX-512.
 *
 * Shape of the work. Queries go in blocks of KN_ATTN_MB = 32, one query per lane of two 16-lane
 * vectors, so no element ever needs a horizontal sum:
 *   0. q^T per block: [(D + Dr)][32] (zero lanes past M), nk per lane.
 *   1. scores, tasks (block, chunk of keys): a tile of 12 keys x 32 queries keeps 24 accumulators
 *      in registers; per k it loads two q^T vectors and broadcasts one value of each key row
 *      (the cache is read in its own row layout, through row pointers: no copy, no transpose),
 *      24 FMAs per 14 loads; the chain runs k ascending over c then k_pe. s = scale * acc is
 *      stored as S^T [t][32].
 *   2. softmax, tasks (block, vector of 16 queries): lane-wise max, kn_exp, sum in t order,
 *      times 1/sum; lanes past nk get 0 (masks, so the sum adds exactly the ref's terms).
 *   3. latent sum, tasks (block, 64 columns): a tile of 6 queries x 64 columns (24 accumulators)
 *      walks t ascending, per t four loads of c_t and six broadcasts of p, 24 FMAs; a strip of
 *      64 columns (256 B per key) stays in L2 for all the block's tiles. The strip of key t + 8
 *      is prefetched into L1: the keys' rows lie at a stride (2304 B in a GLM-5 cache) that the
 *      hardware prefetchers take late on a cold cache (decode: the cache comes from memory).
 * Every output element is one chain in the order kernels.h defines, whatever its tile, lane or
 * task: results do not depend on M, the blocking or the threads (tests/test_kernels.c). */
#include <immintrin.h>

#include "kernels/exp512.h"
#include <math.h>
#include <string.h>

#include "base/pool.h"
#include "kernels/kn_internal.h"

#define AI static inline __attribute__((always_inline))
#define MB KN_ATTN_MB

typedef struct {
    const kn_attn *a;
    float *base;   /* block b's scratch: base + b * per */
    size_t per;
    int nmb, nkc, ncc;
    int64_t kchunk;
} at_job;

static inline float *blk_qt(const at_job *j, int b) { return j->base + (size_t)b * j->per; }
static inline float *blk_s(const at_job *j, int b) { return blk_qt(j, b) + (size_t)(j->a->D + j->a->Dr) * MB; }
static inline int *blk_nk(const at_job *j, int b) { return (int *)(blk_s(j, b) + (size_t)j->a->N * MB); }
static inline int blk_m(const at_job *j, int b) { int m = j->a->M - b * MB; return m < MB ? m : MB; }


/* ---- 0. q^T ---- */
static void prep_one(const at_job *j, int b) {
    const kn_attn *a = j->a;
    float *qt = blk_qt(j, b);
    int *nk = blk_nk(j, b), mc = blk_m(j, b), W = a->D + a->Dr;
    memset(qt, 0, sizeof(float) * (size_t)W * MB);
    for (int i = 0; i < mc; i++) {
        const float *q = a->q + (int64_t)(b * MB + i) * a->q_stride, *qp = a->qpe + (int64_t)(b * MB + i) * a->qpe_stride;
        for (int k = 0; k < a->D; k++) qt[(size_t)k * MB + i] = q[k];
        for (int k = 0; k < a->Dr; k++) qt[(size_t)(a->D + k) * MB + i] = qp[k];
    }
    for (int i = 0; i < MB; i++) nk[i] = i < mc ? (a->nk ? (int)a->nk[b * MB + i] : (int)a->N) : 0;
}

/* ---- 1. scores: KB keys x MV vectors of 16 queries ---- */
AI void sc_tile(const int MV, const int KB, const kn_attn *a, const float *qt, int64_t t0, float *S) {
    __m512 acc[12][2];
    const float *p[12];
#pragma GCC unroll 12
    for (int j = 0; j < KB; j++) {
        acc[j][0] = acc[j][1] = _mm512_setzero_ps();
        p[j] = a->kc[t0 + j];
    }
    /* the next tile's latent rows (the next KB keys), a line of each per 16 columns of this one:
     * a cold cache's rows lie at a stride that the prefetchers follow late for 12 streams */
    const int64_t tn = t0 + KB, nn = a->N - tn < KB ? a->N - tn : KB;
    for (int k0 = 0; k0 < a->D; k0 += 16) {
        for (int64_t j = 0; j < nn; j++) _mm_prefetch((const char *)(a->kc[tn + j] + k0), _MM_HINT_T0);
        const int k1 = k0 + 16 < a->D ? k0 + 16 : a->D;
        for (int k = k0; k < k1; k++) {
            __m512 q0 = _mm512_loadu_ps(qt + (size_t)k * MB), q1 = MV > 1 ? _mm512_loadu_ps(qt + (size_t)k * MB + 16) : q0;
#pragma GCC unroll 12
            for (int j = 0; j < KB; j++) {
                __m512 w = _mm512_set1_ps(p[j][k]);
                acc[j][0] = _mm512_fmadd_ps(q0, w, acc[j][0]);
                if (MV > 1) acc[j][1] = _mm512_fmadd_ps(q1, w, acc[j][1]);
            }
        }
    }
    for (int64_t j = 0; j < nn; j++) /* and their rope rows */
        for (int k0 = 0; k0 < a->Dr; k0 += 16) _mm_prefetch((const char *)(a->kp[tn + j] + k0), _MM_HINT_T0);
#pragma GCC unroll 12
    for (int j = 0; j < KB; j++) p[j] = a->kp[t0 + j];
    const float *qr = qt + (size_t)a->D * MB;
    for (int k = 0; k < a->Dr; k++) {
        __m512 q0 = _mm512_loadu_ps(qr + (size_t)k * MB), q1 = MV > 1 ? _mm512_loadu_ps(qr + (size_t)k * MB + 16) : q0;
#pragma GCC unroll 12
        for (int j = 0; j < KB; j++) {
            __m512 w = _mm512_set1_ps(p[j][k]);
            acc[j][0] = _mm512_fmadd_ps(q0, w, acc[j][0]);
            if (MV > 1) acc[j][1] = _mm512_fmadd_ps(q1, w, acc[j][1]);
        }
    }
    const __m512 sc = _mm512_set1_ps(a->scale);
#pragma GCC unroll 12
    for (int j = 0; j < KB; j++) {
        _mm512_storeu_ps(S + (size_t)(t0 + j) * MB, _mm512_mul_ps(acc[j][0], sc));
        if (MV > 1) _mm512_storeu_ps(S + (size_t)(t0 + j) * MB + 16, _mm512_mul_ps(acc[j][1], sc));
    }
}

AI void sc_range(const int MV, const kn_attn *a, const float *qt, int64_t t0, int64_t t1, float *S) {
    int64_t t = t0;
    for (; t + 12 <= t1; t += 12) sc_tile(MV, 12, a, qt, t, S);
    for (; t + 4 <= t1; t += 4) sc_tile(MV, 4, a, qt, t, S);
    for (; t < t1; t++) sc_tile(MV, 1, a, qt, t, S);
}

static void score_one(const at_job *j, int task) {
    int b = task / j->nkc, c = task % j->nkc;
    int64_t t0 = (int64_t)c * j->kchunk, t1 = t0 + j->kchunk < j->a->N ? t0 + j->kchunk : j->a->N;
    if (blk_m(j, b) > 16) sc_range(2, j->a, blk_qt(j, b), t0, t1, blk_s(j, b));
    else sc_range(1, j->a, blk_qt(j, b), t0, t1, blk_s(j, b));
}

/* ---- 2. softmax over t, 16 queries per vector ---- */
static void softmax_one(const at_job *j, int task) {
    int b = task / 2, v = task % 2;
    if (v * 16 >= blk_m(j, b)) return;
    float *S = blk_s(j, b) + v * 16;
    const __m512i nk = _mm512_loadu_si512(blk_nk(j, b) + v * 16);
    const int64_t N = j->a->N;
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < N; t++) {
        __mmask16 ok = _mm512_cmpgt_epi32_mask(nk, _mm512_set1_epi32((int)t));
        mx = _mm512_mask_max_ps(mx, ok, mx, _mm512_loadu_ps(S + t * MB));
    }
    for (int64_t t = 0; t < N; t++) {
        __mmask16 ok = _mm512_cmpgt_epi32_mask(nk, _mm512_set1_epi32((int)t));
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(S + t * MB), mx));
        sum = _mm512_mask_add_ps(sum, ok, sum, e);
        _mm512_storeu_ps(S + t * MB, e);
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), sum);
    for (int64_t t = 0; t < N; t++) {
        __mmask16 ok = _mm512_cmpgt_epi32_mask(nk, _mm512_set1_epi32((int)t));
        _mm512_storeu_ps(S + t * MB, _mm512_maskz_mul_ps(ok, _mm512_loadu_ps(S + t * MB), inv));
    }
}

/* ---- 3. latent sum: IB queries x 4 vectors of columns ---- */
AI void lat_tile(const int IB, const kn_attn *a, const float *P, const int *nk, int m0, int c0, float *lat) {
    __mmask16 mk[4];
    __m512 acc[6][4];
    int64_t tn = 0;
#pragma GCC unroll 6
    for (int i = 0; i < IB; i++) tn = nk[m0 + i] > tn ? nk[m0 + i] : tn;
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) {
        int left = a->D - (c0 + u * 16);
        mk[u] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 6
        for (int i = 0; i < IB; i++) acc[i][u] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < tn; t++) {
        const float *c = a->kc[t] + c0, *p = P + t * MB + m0;
        if (t + 8 < tn) { /* the strip of key t + 8: rows at a stride the prefetchers take late */
            const char *nx = (const char *)(a->kc[t + 8] + c0);
            _mm_prefetch(nx, _MM_HINT_T0), _mm_prefetch(nx + 64, _MM_HINT_T0), _mm_prefetch(nx + 128, _MM_HINT_T0), _mm_prefetch(nx + 192, _MM_HINT_T0);
        }
        __m512 w[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) w[u] = _mm512_maskz_loadu_ps(mk[u], c + u * 16);
#pragma GCC unroll 6
        for (int i = 0; i < IB; i++) {
            __m512 pb = _mm512_set1_ps(p[i]);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) acc[i][u] = _mm512_fmadd_ps(pb, w[u], acc[i][u]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < IB; i++)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(lat + (int64_t)(m0 + i) * a->lat_stride + c0 + u * 16, mk[u], acc[i][u]);
}

static void lat_one(const at_job *j, int task) {
    const kn_attn *a = j->a;
    int b = task / j->ncc, c0 = (task % j->ncc) * 64, mc = blk_m(j, b);
    const float *P = blk_s(j, b);
    const int *nk = blk_nk(j, b);
    float *lat = a->lat + (int64_t)b * MB * a->lat_stride;
    for (int m0 = 0; m0 < mc; m0 += 6) {
        switch (mc - m0 < 6 ? mc - m0 : 6) {
        case 6: lat_tile(6, a, P, nk, m0, c0, lat); break;
        case 5: lat_tile(5, a, P, nk, m0, c0, lat); break;
        case 4: lat_tile(4, a, P, nk, m0, c0, lat); break;
        case 3: lat_tile(3, a, P, nk, m0, c0, lat); break;
        case 2: lat_tile(2, a, P, nk, m0, c0, lat); break;
        default: lat_tile(1, a, P, nk, m0, c0, lat); break;
        }
    }
}

/* Several problems (each its own queries, keys and scratch) phase by phase: every phase's tasks
 * of all problems in one pool dispatch (a batch's decode rows: 4 dispatches instead of 4 per row),
 * or, where the problems are a whole number a thread and of about the same work, each problem's
 * tasks in order on one thread (whole_task: one dispatch); each task the one it would be alone,
 * so the results are those of the problems one by one. */
#define MANY_MAX 64
typedef struct {
    at_job j[MANY_MAX];
    int n, t0[4][MANY_MAX + 1]; /* per phase: task offsets of the problems */
} at_many;

static void many_task(const at_many *m, int phase, int task) {
    int lo = 0, hi = m->n - 1; /* last problem with t0 <= task */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (m->t0[phase][mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    const at_job *j = &m->j[lo];
    int t = task - m->t0[phase][lo];
    if (phase == 0) prep_one(j, t);
    else if (phase == 1) score_one(j, t);
    else if (phase == 2) softmax_one(j, t);
    else lat_one(j, t);
}
/* Problem i whole on one thread (phase by phase, its tasks in order): its keys stay in that
 * core's caches from the scores to the latent sum. Phase by phase over both threads, each
 * phase's tasks of all the problems together, a row's keys were read by the two cores and, by the
 * latent sum, had left them (a batch of 8 decode rows at 512 keys: ~9.4 MB of keys a layer) */
static void whole_task(void *ctx, int i, int thread) {
    (void)thread;
    const at_many *m = ctx;
    const at_job *j = &m->j[i];
    for (int t = 0; t < j->nmb; t++) prep_one(j, t);
    for (int t = 0; t < j->nmb * j->nkc; t++) score_one(j, t);
    for (int t = 0; t < j->nmb * 2; t++) softmax_one(j, t);
    for (int t = 0; t < j->nmb * j->ncc; t++) lat_one(j, t);
}
static void prep_task(void *ctx, int task, int thread) { (void)thread; many_task(ctx, 0, task); }
static void score_task(void *ctx, int task, int thread) { (void)thread; many_task(ctx, 1, task); }
static void softmax_task(void *ctx, int task, int thread) { (void)thread; many_task(ctx, 2, task); }
static void lat_task(void *ctx, int task, int thread) { (void)thread; many_task(ctx, 3, task); }

void kn_attn_core_many_avx512(const kn_attn *a, int n, float *const *scr) {
    pt_pool *pool = kn_pool();
    int nt = pool_threads(pool);
    for (int i0 = 0; i0 < n; i0 += MANY_MAX) {
        at_many m;
        m.n = n - i0 < MANY_MAX ? n - i0 : MANY_MAX;
        int blocks = 0;
        for (int i = 0; i < m.n; i++) blocks += (a[i0 + i].M + MB - 1) / MB;
        for (int p = 0; p < 4; p++) m.t0[p][0] = 0;
        for (int i = 0; i < m.n; i++) {
            const kn_attn *ai = &a[i0 + i];
            at_job *j = &m.j[i];
            j->a = ai;
            j->base = (float *)(((uintptr_t)scr[i0 + i] + 63) & ~(uintptr_t)63);
            j->per = (size_t)MB * ((size_t)ai->D + (size_t)ai->Dr + (size_t)ai->N + 1);
            j->nmb = ai->M > 0 ? (ai->M + MB - 1) / MB : 0;
            /* about 4 score tasks per thread over all the problems, whole 12-key tiles, at least
             * 48 keys each (how the keys are split never changes a score) */
            int64_t want = ((int64_t)nt * 4 + blocks - 1) / (blocks > 0 ? blocks : 1);
            int64_t kc = (ai->N + want - 1) / (want > 0 ? want : 1);
            kc = (kc + 11) / 12 * 12;
            j->kchunk = kc < 48 ? 48 : kc;
            j->nkc = ai->N > 0 ? (int)((ai->N + j->kchunk - 1) / j->kchunk) : 0;
            j->ncc = (ai->D + 63) / 64;
            m.t0[0][i + 1] = m.t0[0][i] + j->nmb;
            m.t0[1][i + 1] = m.t0[1][i] + j->nmb * j->nkc;
            m.t0[2][i + 1] = m.t0[2][i] + j->nmb * 2;
            m.t0[3][i + 1] = m.t0[3][i] + j->nmb * j->ncc;
        }
        /* a whole number of problems a thread, of about the same work (a batch's decode rows at
         * similar contexts): one problem a task, whole; else each phase over the threads */
        int64_t wmin = INT64_MAX, wmax = 0;
        for (int i = 0; i < m.n; i++) {
            int64_t w = (int64_t)m.j[i].nmb * m.j[i].a->N;
            wmin = w < wmin ? w : wmin, wmax = w > wmax ? w : wmax;
        }
        int whole = nt > 1 && m.n % nt == 0 && wmax > 0 && 4 * wmax <= 5 * wmin;
        if (whole) {
            pool_run(pool, m.n, whole_task, &m);
            continue;
        }
        pool_run(pool, m.t0[0][m.n], prep_task, &m);
        if (m.t0[1][m.n]) pool_run(pool, m.t0[1][m.n], score_task, &m);
        pool_run(pool, m.t0[2][m.n], softmax_task, &m);
        pool_run(pool, m.t0[3][m.n], lat_task, &m);
    }
}
