/* moe.c: the MLPs. Dense SwiGLU for the leading layers; MoE elsewhere:
 *   s = sigmoid(gate . x) (f32); choice = s + e_score_correction_bias (bias only chooses);
 *   group limit: a group's score is the sum of its top-2 choice values, the topk_group best
 *   groups stay, the others are masked to 0.0 (as the HF reference does, not -inf);
 *   top-k by choice; weights = s[idx], normalised (sum + 1e-20) when norm_topk_prob, times
 *   routed_scaling_factor; y = sum_j w_j Expert_j(x) + SharedExpert(x).
 * Experts run expert-major: every row is routed first, then each chosen expert runs once over
 * the rows that chose it. Each row accumulates its experts in ascending expert id, so a row's
 * result does not depend on the other rows of the batch. */
#include <math.h>
#include <string.h>

#include "base/err.h"
#include "experts/xs.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/ops.h"

/* rank order: larger value first, then lower index */
static int better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

void moe_route(const petrel_config *cfg, const float *logits, const float *bias, int32_t *idx, float *wts, float *scratch) {
    int E = cfg->n_routed_experts, K = cfg->num_experts_per_tok;
    float *s = scratch, *ch = scratch + E;
    for (int e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + expf(-logits[e]));
        ch[e] = s[e] + bias[e];
    }
    if (cfg->n_group > 1 && cfg->topk_group < cfg->n_group) {
        int G = cfg->n_group, gs = E / G;
        float gscore[256];
        unsigned char keep[256];
        float *gsc = G <= 256 ? gscore : NULL;
        if (gsc) {
            for (int g = 0; g < G; g++) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int e = g * gs; e < (g + 1) * gs; e++) {
                    if (ch[e] > b1) { b2 = b1; b1 = ch[e]; }
                    else if (ch[e] > b2) b2 = ch[e];
                }
                gsc[g] = gs >= 2 ? b1 + b2 : b1;
                keep[g] = 0;
            }
            for (int k = 0; k < cfg->topk_group; k++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || better(gsc[g], g, gsc[best], best))) best = g;
                keep[best] = 1;
            }
            for (int g = 0; g < G; g++)
                if (!keep[g])
                    for (int e = g * gs; e < (g + 1) * gs; e++) ch[e] = 0.0f;
        }
    }
    /* top-K by choice value (K is small: selection by repeated scan of a candidate list) */
    for (int k = 0; k < K; k++) idx[k] = -1;
    for (int e = 0; e < E; e++) {
        if (idx[K - 1] >= 0 && !better(ch[e], e, ch[idx[K - 1]], idx[K - 1])) continue;
        int p = K - 1;
        while (p > 0 && (idx[p - 1] < 0 || better(ch[e], e, ch[idx[p - 1]], idx[p - 1]))) {
            idx[p] = idx[p - 1];
            p--;
        }
        idx[p] = e;
    }
    double sum = 0;
    for (int k = 0; k < K; k++) sum += s[idx[k]];
    for (int k = 0; k < K; k++) {
        float w = s[idx[k]];
        if (cfg->norm_topk_prob) w = (float)(w / (sum + 1e-20));
        wts[k] = w * cfg->routed_scaling_factor;
    }
}

static int swiglu(petrel_session *s, const pt_wview *g, const pt_wview *u, const pt_wview *d, const float *x, int T,
                  float *out, petrel_error *err) {
    size_t mark = s->ar.used;
    float *gb = ar_alloc(&s->ar, sizeof(float) * (size_t)T * (size_t)g->rows);
    float *ub = ar_alloc(&s->ar, sizeof(float) * (size_t)T * (size_t)u->rows);
    if (!gb || !ub) return pt_err(err, PETREL_ENOMEM, "MLP scratch exhausted");
    kn_job gu[2] = {{g, x, T, gb}, {u, x, T, ub}}; /* one dispatch, x prepared once */
    kn_matmul_many(gu, 2);
    kn_silu_mul(gb, gb, ub, (int64_t)T * g->rows);
    kn_matmul(d, gb, T, out);
    s->ar.used = mark;
    return 0;
}

int mlp_dense(petrel_session *s, const layer_w *lw, const float *x, int T, float *out, petrel_error *err) {
    return swiglu(s, &lw->gate_proj, &lw->up_proj, &lw->down_proj, x, T, out, err);
}

typedef struct { const pt_wview *g, *u, *d; } expert_views;

/* Copies the rows that chose expert e to xs (consecutive) and their (row, choice) index to
 * slot; returns how many. */
static int gather_rows(int e, const int32_t *idx, int T, int K, const float *x, int H, float *xs, int32_t *slot) {
    int m = 0;
    for (int r = 0; r < T; r++)
        for (int k = 0; k < K; k++)
            if (idx[(size_t)r * K + k] == e) {
                slot[m] = r * K + k;
                memcpy(xs + (size_t)m * H, x + (size_t)r * H, sizeof(float) * (size_t)H);
                m++;
            }
    return m;
}

/* Runs experts ids[0..n) (views v[i]) over the rows that chose them; row r's output from its
 * k-th choice lands unscaled in yk[r][k]. */
static int run_experts(petrel_session *s, const int32_t *ids, int n, const expert_views *v, const int32_t *idx, const float *x,
                       int T, float *yk, float *xs, float *ys, int32_t *slot, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    int K = c->num_experts_per_tok, H = c->hidden_size;
    if (T == 1 && n > 1 && n <= 32) { /* decode: all experts in two pool dispatches */
        int64_t I = v[0].g->rows;
        size_t mark = s->ar.used;
        float *gb = ar_alloc(&s->ar, sizeof(float) * (size_t)(n * I)), *ub = ar_alloc(&s->ar, sizeof(float) * (size_t)(n * I));
        float *yo = ar_alloc(&s->ar, sizeof(float) * (size_t)n * H);
        int ok = gb && ub && yo;
        for (int i = 0; i < n && ok; i++) ok = v[i].g->rows == I && v[i].u->rows == I && v[i].d->cols == I;
        if (ok) {
            kn_job jobs[64];
            for (int i = 0; i < n; i++) {
                jobs[2 * i] = (kn_job){v[i].g, x, 1, gb + (size_t)i * I};
                jobs[2 * i + 1] = (kn_job){v[i].u, x, 1, ub + (size_t)i * I};
            }
            kn_matmul_many(jobs, 2 * n);
            kn_silu_mul(gb, gb, ub, (int64_t)n * I);
            for (int i = 0; i < n; i++) jobs[i] = (kn_job){v[i].d, gb + (size_t)i * I, 1, yo + (size_t)i * H};
            kn_matmul_many(jobs, n);
            for (int i = 0; i < n; i++) /* each expert appears once among a row's K choices */
                for (int k = 0; k < K; k++)
                    if (idx[k] == ids[i]) memcpy(yk + (size_t)k * H, yo + (size_t)i * H, sizeof(float) * (size_t)H);
            s->ar.used = mark;
            return 0;
        }
        s->ar.used = mark;
    }
    /* Rows of several experts: batches of up to EB experts whose rows fit xs (T rows; an expert
     * has at most T), gathered expert after expert; gate+up of the batch in one pool dispatch,
     * down in another, so the threads balance over the batch instead of meeting at a barrier
     * after every expert's ~0.3 ms product. Each expert's rows see the same kernel as alone. */
    enum { EB = 32 };
    int64_t I = v[0].g->rows;
    int same = 1;
    for (int i = 0; i < n && same; i++) same = v[i].g->rows == I && v[i].u->rows == I && v[i].d->cols == I;
    size_t mark = s->ar.used;
    float *gb = same ? ar_alloc(&s->ar, sizeof(float) * (size_t)T * (size_t)I) : NULL;
    float *ub = same ? ar_alloc(&s->ar, sizeof(float) * (size_t)T * (size_t)I) : NULL;
    if (!gb || !ub) { /* one expert at a time */
        s->ar.used = mark;
        for (int i = 0; i < n; i++) {
            int m = gather_rows(ids[i], idx, T, K, x, H, xs, slot);
            if (!m) continue;
            PT_TRY(swiglu(s, v[i].g, v[i].u, v[i].d, xs, m, ys, err));
            for (int j = 0; j < m; j++) memcpy(yk + (size_t)slot[j] * H, ys + (size_t)j * H, sizeof(float) * (size_t)H);
        }
        return 0;
    }
    kn_job jobs[2 * EB];
    int start[EB], cnt[EB], bi[EB];
    for (int i = 0; i < n;) {
        int ne = 0, m = 0;
        while (i < n && ne < EB) {
            int e = ids[i], c0 = 0;
            for (int q = 0; q < T * K; q++) c0 += idx[q] == e;
            if (m + c0 > T) break; /* the next batch takes it */
            start[ne] = m;
            m += gather_rows(e, idx, T, K, x, H, xs + (size_t)m * H, slot + m);
            cnt[ne] = m - start[ne];
            bi[ne] = i;
            if (cnt[ne]) ne++;
            i++;
        }
        if (!ne) continue;
        for (int b = 0; b < ne; b++) {
            const float *xb = xs + (size_t)start[b] * H;
            jobs[2 * b] = (kn_job){v[bi[b]].g, xb, cnt[b], gb + (size_t)start[b] * I};
            jobs[2 * b + 1] = (kn_job){v[bi[b]].u, xb, cnt[b], ub + (size_t)start[b] * I};
        }
        kn_matmul_many(jobs, 2 * ne);
        kn_silu_mul(gb, gb, ub, (int64_t)m * I);
        for (int b = 0; b < ne; b++)
            jobs[b] = (kn_job){v[bi[b]].d, gb + (size_t)start[b] * I, cnt[b], ys + (size_t)start[b] * H};
        kn_matmul_many(jobs, ne);
        for (int j = 0; j < m; j++) memcpy(yk + (size_t)slot[j] * H, ys + (size_t)j * H, sizeof(float) * (size_t)H);
    }
    s->ar.used = mark;
    return 0;
}

int moe_forward_all(petrel_session *s, int l, const layer_w *lw, const float *x, int M, int32_t *idx, float *wts, int32_t *rl,
                    float *out, petrel_error *err) {
    const petrel_engine *eng = s->eng;
    const petrel_config *c = &eng->cfg;
    int E = c->n_routed_experts, K = c->num_experts_per_tok, H = c->hidden_size, C = s->max_batch;
    xs_store *xst = eng->xs;
    int ml = xst ? eng->moe_index[l] : -1;
    size_t mark = s->ar.used;
    float *lg = ar_alloc(&s->ar, sizeof(float) * (size_t)C * E), *scratch = ar_alloc(&s->ar, sizeof(float) * 2 * (size_t)E);
    int32_t *start = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)(E + 1)), *pos = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)E);
    int32_t *ids = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)E);
    float *xs = ar_alloc(&s->ar, sizeof(float) * (size_t)C * H), *ys = ar_alloc(&s->ar, sizeof(float) * (size_t)C * H);
    if (!lg || !scratch || !start || !pos || !ids || !xs || !ys) return pt_err(err, PETREL_ENOMEM, "MoE scratch exhausted");
    uint64_t *ns = s->stats.ns, t0 = pt_now_ns(), t1;
    for (int r0 = 0; r0 < M; r0 += C) {
        int T = M - r0 < C ? M - r0 : C;
        kn_matmul(&lw->router, x + (size_t)r0 * H, T, lg);
        for (int r = 0; r < T; r++)
            moe_route(c, lg + (size_t)r * E, lw->e_score_correction_bias, idx + (size_t)(r0 + r) * K, wts + (size_t)(r0 + r) * K, scratch);
    }
    /* the choices by expert (counting sort; rows ascending within an expert) */
    memset(start, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int i = 0; i < M * K; i++) start[idx[i] + 1]++;
    int n = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1]) ids[n++] = e;
        start[e + 1] += start[e];
        pos[e] = start[e];
    }
    for (int i = 0; i < M * K; i++) rl[pos[idx[i]]++] = i;
    t1 = pt_now_ns();
    ns[FS_ROUTER] += t1 - t0;
    t0 = t1;
    /* Experts in ascending id: each row then adds its experts' outputs in ascending id, the order
     * moe_forward sums them in, with no per-choice buffer. Reads run as far ahead as the bank
     * allows (the experts already run are the ones a hint may replace; it never replaces a hint
     * not yet used). */
    memset(out, 0, sizeof(float) * (size_t)M * H);
    uint64_t io = 0;
    for (int i = 0; i < n; i++) {
        int e = ids[i];
        xs_expert_ref ref;
        const pt_wview *g = &lw->exp_gate[e], *u = &lw->exp_up[e], *d = &lw->exp_down[e];
        if (ml >= 0) {
            int ahead = n - i, room = xs_store_slots(xst) - 1; /* as far as the bank allows: hints stop at pending hints */
            if (ahead > room) ahead = room;
            if (ahead > 0) xs_prefetch(xst, ml, ids + i, ahead);
            uint64_t w0 = pt_now_ns();
            PT_TRY(xs_acquire(xst, ml, &e, 1, &ref, err));
            io += pt_now_ns() - w0;
            g = &ref.gate, u = &ref.up, d = &ref.down;
        }
        int rc = 0;
        for (int j0 = start[e]; j0 < start[e + 1] && !rc; j0 += C) {
            int m = start[e + 1] - j0 < C ? start[e + 1] - j0 : C;
            for (int j = 0; j < m; j++) memcpy(xs + (size_t)j * H, x + (size_t)(rl[j0 + j] / K) * H, sizeof(float) * (size_t)H);
            rc = swiglu(s, g, u, d, xs, m, ys, err);
            for (int j = 0; j < m && !rc; j++)
                kn_axpy(out + (size_t)(rl[j0 + j] / K) * H, wts[rl[j0 + j]], ys + (size_t)j * H, H);
        }
        if (ml >= 0) xs_release(xst, ml, &ref, 1);
        if (rc) return rc;
    }
    s->stats.io_ns += io;
    t1 = pt_now_ns();
    ns[FS_EXPERTS] += t1 - t0;
    t0 = t1;
    if (lw->has_shared)
        for (int r0 = 0; r0 < M; r0 += C) {
            int T = M - r0 < C ? M - r0 : C;
            PT_TRY(swiglu(s, &lw->sh_gate, &lw->sh_up, &lw->sh_down, x + (size_t)r0 * H, T, ys, err));
            float *o = out + (size_t)r0 * H;
            for (int i = 0; i < T * H; i++) o[i] += ys[i];
        }
    ns[FS_SHARED] += pt_now_ns() - t0;
    s->ar.used = mark;
    return 0;
}

/* Lookahead for streaming: applies the next MoE layer's router to x (this layer's normed input)
 * and starts reading the experts it predicts, so their reads overlap this layer's compute.
 * Every prediction is scored when the layer routes (moe_forward), per rank: a row's best guess
 * is right far more often than its 8th. Wrong guesses cost SSD time that demand reads then wait
 * for, and a slot, so only the ranks whose running precision reaches PT_LOOKAHEAD_GATE are read;
 * the others are still predicted and scored, so a rank starts reading once it has earned it. */
void moe_prefetch_next(petrel_session *s, const layer_w *next_lw, int next_l, const float *x, int T) {
    const petrel_engine *eng = s->eng;
    const petrel_config *c = &eng->cfg;
    int E = c->n_routed_experts, K = c->num_experts_per_tok;
    if (!eng->xs || !next_lw || eng->moe_index[next_l] < 0 || K > 64) return;
    int nm = eng->moe_index[next_l];
    size_t mark = s->ar.used;
    float *lg = ar_alloc(&s->ar, sizeof(float) * (size_t)T * E);
    float *scratch = ar_alloc(&s->ar, sizeof(float) * 2 * (size_t)E);
    int32_t *pids = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)E);
    int32_t *ranked = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)T * K);
    if (lg && scratch && pids && ranked) {
        kn_matmul(&next_lw->router, x, T, lg);
        float pw[64];
        for (int r = 0; r < T; r++) /* moe_route lists each row's experts best first */
            moe_route(c, lg + (size_t)r * E, next_lw->e_score_correction_bias, ranked + (size_t)r * K, pw, scratch);
        xs_la_guess(eng->xs, nm, ranked, T, K, PT_LOOKAHEAD_GATE, pids); /* the store decides what to read */
    }
    s->ar.used = mark; /* a hint: without scratch it is simply skipped */
}

int moe_forward(petrel_session *s, int l, const layer_w *lw, const layer_w *next_lw, int next_l, const float *x, int T,
                float *out, petrel_error *err) {
    const petrel_engine *eng = s->eng;
    const petrel_config *c = &eng->cfg;
    int E = c->n_routed_experts, K = c->num_experts_per_tok, H = c->hidden_size;
    size_t mark = s->ar.used;
    float *logits = ar_alloc(&s->ar, sizeof(float) * (size_t)T * E);
    float *scratch = ar_alloc(&s->ar, sizeof(float) * 2 * (size_t)E);
    int32_t *idx = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)T * K);
    float *wts = ar_alloc(&s->ar, sizeof(float) * (size_t)T * K);
    int32_t *slot = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)T * K);
    float *xs = ar_alloc(&s->ar, sizeof(float) * (size_t)T * H);
    float *ys = ar_alloc(&s->ar, sizeof(float) * (size_t)T * H);
    float *yk = ar_alloc(&s->ar, sizeof(float) * (size_t)T * K * H);
    int32_t *order = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)E);
    expert_views *ev = ar_alloc(&s->ar, sizeof(expert_views) * (size_t)E);
    xs_expert_ref *refs = ar_alloc(&s->ar, sizeof(xs_expert_ref) * (size_t)E);
    uint8_t *chosen = ar_alloc(&s->ar, (size_t)E);
    if (!logits || !scratch || !idx || !wts || !slot || !xs || !ys || !yk || !order || !ev || !refs || !chosen)
        return pt_err(err, PETREL_ENOMEM, "MoE scratch exhausted");
    float *ysh = NULL;     /* the shared expert's output when it ran while misses loaded */
    uint64_t shared_ns = 0;
    uint64_t *ns = s->stats.ns, t0 = pt_now_ns(), t1;
    kn_matmul(&lw->router, x, T, logits);
    for (int r = 0; r < T; r++)
        moe_route(c, logits + (size_t)r * E, lw->e_score_correction_bias, idx + (size_t)r * K, wts + (size_t)r * K, scratch);
    memset(chosen, 0, (size_t)E);
    for (int i = 0; i < T * K; i++) chosen[idx[i]] = 1;
    if (eng->trace) stream_trace_note(eng, l, idx, T, K);
    xs_store *xst = eng->xs;
    int ml = xst ? eng->moe_index[l] : -1;
    if (ml >= 0) xs_la_score(xst, ml, chosen); /* the store scores the guesses made for this layer */
    /* Guesses for this layer that turned out wrong and have not started reading are dropped, so
     * they do not delay the misses queued behind them. */
    if (ml >= 0) xs_cancel_prefetches(xst, ml, chosen);
    /* Run order: experts whose bytes are in a slot first, then those still reading (a prefetch
     * in flight, in the order it was queued), then the misses, whose reads start as soon as the
     * first chunk is acquired and overlap the compute of the resident ones. Each expert's state
     * is read once: reads finish on other threads meanwhile, and a state read once per class
     * could put an expert in no class (its rows would keep stale outputs) or in two. */
    int U = 0, n_hit = 0;
    uint8_t *cls = ar_alloc(&s->ar, (size_t)E);
    uint64_t *seq = ar_alloc(&s->ar, sizeof(uint64_t) * (size_t)E);
    if (!cls || !seq) return pt_err(err, PETREL_ENOMEM, "MoE scratch exhausted");
    for (int e = 0; e < E; e++) {
        seq[e] = 0;
        cls[e] = !chosen[e] ? 255 : ml < 0 ? XS_READY : (uint8_t)xs_store_state(xst, ml, e, &seq[e]);
    }
    static const uint8_t pass_cls[3] = {XS_READY, XS_LOADING, XS_ABSENT};
    for (int pass = 0; pass < 3; pass++) {
        int u0 = U;
        for (int e = 0; e < E; e++) {
            if (cls[e] != pass_cls[pass]) continue;
            int j = U++; /* loading ones by queue order (insertion; a handful) */
            while (pass == 1 && j > u0 && seq[order[j - 1]] > seq[e]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = e;
        }
        if (pass == 0) n_hit = U;
    }
    s->stats.experts_run += (uint64_t)U;
    t1 = pt_now_ns();
    ns[FS_ROUTER] += t1 - t0;
    t0 = t1;
    if (ml < 0) {
        for (int i = 0; i < U; i++) ev[i] = (expert_views){&lw->exp_gate[order[i]], &lw->exp_up[order[i]], &lw->exp_down[order[i]]};
        PT_TRY(run_experts(s, order, U, ev, idx, x, T, yk, xs, ys, slot, err));
    } else {
        /* The experts already in slots are acquired first (that pins them, no wait), then every
         * miss's read starts, then the next layer's guesses queue behind them. The hits and the
         * shared expert compute while the misses load; the misses are then taken one at a time,
         * so each computes while the later ones are still reading. */
        int S = xs_store_slots(xst);
        if (n_hit == 0) {
            xs_prefetch(xst, ml, order, U);
            moe_prefetch_next(s, next_lw, next_l, x, T);
        }
        for (int c0 = 0; c0 < U;) {
            if (c0 == n_hit && lw->has_shared && !ysh) {
                uint64_t q0 = pt_now_ns();
                ysh = ar_alloc(&s->ar, sizeof(float) * (size_t)T * H);
                if (!ysh) return pt_err(err, PETREL_ENOMEM, "MoE scratch exhausted");
                PT_TRY(swiglu(s, &lw->sh_gate, &lw->sh_up, &lw->sh_down, x, T, ysh, err));
                shared_ns = pt_now_ns() - q0;
            }
            int n = c0 < n_hit ? n_hit - c0 : 1;
            if (n > S) n = S;
            uint64_t w0 = pt_now_ns();
            PT_TRY(xs_acquire(xst, ml, order + c0, n, refs, err));
            s->stats.io_ns += pt_now_ns() - w0;
            if (c0 == 0 && n_hit > 0) {
                xs_prefetch(xst, ml, order + n, U - n);           /* this layer's remaining misses */
                moe_prefetch_next(s, next_lw, next_l, x, T);     /* then the next layer's guesses */
            }
            for (int i = 0; i < n; i++) ev[i] = (expert_views){&refs[i].gate, &refs[i].up, &refs[i].down};
            int rc = run_experts(s, order + c0, n, ev, idx, x, T, yk, xs, ys, slot, err);
            xs_release(xst, ml, refs, n);
            if (rc < 0) return rc;
            c0 += n;
            /* keep the next misses reading: the first call above stops when every slot is
             * busy, and a prefill chunk may need more experts than there are slots */
            if (U - c0 > 0) xs_prefetch(xst, ml, order + c0, U - c0 < 16 ? U - c0 : 16);
        }
    }
    /* Sum per row in ascending expert id: the same order whatever order experts ran in, so
     * streamed and resident results are bitwise equal. */
    for (int r = 0; r < T; r++) {
        float *o = out + (size_t)r * H;
        const int32_t *ir = idx + (size_t)r * K;
        memset(o, 0, sizeof(float) * (size_t)H);
        for (int done = 0, prev = -1; done < K; done++) {
            int best = -1;
            for (int k = 0; k < K; k++)
                if (ir[k] > prev && (best < 0 || ir[k] < ir[best])) best = k;
            kn_axpy(o, wts[(size_t)r * K + best], yk + ((size_t)r * K + best) * H, H);
            prev = ir[best];
        }
    }
    t1 = pt_now_ns();
    ns[FS_EXPERTS] += t1 - t0 - shared_ns;
    ns[FS_SHARED] += shared_ns;
    t0 = t1;
    if (lw->has_shared) {
        if (!ysh) {
            PT_TRY(swiglu(s, &lw->sh_gate, &lw->sh_up, &lw->sh_down, x, T, ys, err));
            ysh = ys;
        }
        for (int i = 0; i < T * H; i++) out[i] += ysh[i];
    }
    ns[FS_SHARED] += pt_now_ns() - t0;
    s->ar.used = mark;
    return 0;
}
