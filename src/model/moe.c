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
#include "model/lora.h"
#include "model/ops.h"
#include "model/route_group.h"
#include "model/scratch.h"


void moe_route(const petrel_config *cfg, const float *logits, const float *bias, int32_t *idx, float *wts, float *scratch) {
    int E = cfg->n_routed_experts, K = cfg->num_experts_per_tok;
    float *s = scratch, *ch = scratch + E;
    for (int e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + expf(-logits[e]));
        ch[e] = s[e] + bias[e];
    }
    route_group_limit(ch, E, cfg->n_group, cfg->topk_group);
    /* top-K by choice value (K is small: selection by repeated scan of a candidate list) */
    for (int k = 0; k < K; k++) idx[k] = -1;
    for (int e = 0; e < E; e++) {
        if (idx[K - 1] >= 0 && !route_better(ch[e], e, ch[idx[K - 1]], idx[K - 1])) continue;
        int p = K - 1;
        while (p > 0 && (idx[p - 1] < 0 || route_better(ch[e], e, ch[idx[p - 1]], idx[p - 1]))) {
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

void moe_route_given(const petrel_config *cfg, const float *logits, const int32_t *idx, float *wts) {
    int K = cfg->num_experts_per_tok;
    double sum = 0;
    for (int k = 0; k < K; k++) sum += wts[k] = 1.0f / (1.0f + expf(-logits[idx[k]]));
    for (int k = 0; k < K; k++) {
        float w = wts[k];
        if (cfg->norm_topk_prob) w = (float)(w / (sum + 1e-20));
        wts[k] = w * cfg->routed_scaling_factor;
    }
}

/* LoRA on an MLP's three products: row r's set rs[r] (rs NULL: none), targets tg, tg + 1, tg + 2
 * (gate, up, down) of layer l, expert e (-1: not a routed expert). */
typedef struct mlp_lora {
    const lora_set *const *rs;
    int l, tg, e;
} mlp_lora;

static int swiglu(petrel_session *s, const pt_wview *g, const pt_wview *u, const pt_wview *d, const float *x, int T,
                  const mlp_lora *lo, float *out, petrel_error *err) {
    size_t mark = s->ar.used;
    mlp_scr m;
    if (g->rows != u->rows || mlp_carve(&s->ar, T, g->rows, &m)) return pt_err(err, PETREL_ENOMEM, "MLP scratch exhausted");
    float *gb = m.gb, *ub = m.ub;
    kn_job gu[2] = {{g, x, T, gb}, {u, x, T, ub}}; /* one dispatch, x prepared once */
    const kn_table *tb = &s->eng->kt;
    kt_matmul_many(tb, gu, 2);
    int H = (int)g->cols, I = (int)g->rows;
    if (lo && lo->rs) {
        lora_add_rows(tb, lo->rs, lo->l, (lora_target)lo->tg, lo->e, x, H, T, gb, I);
        lora_add_rows(tb, lo->rs, lo->l, (lora_target)(lo->tg + 1), lo->e, x, H, T, ub, I);
    }
    kt_silu_mul(tb, gb, gb, ub, (int64_t)T * g->rows);
    kt_matmul(tb, d, gb, T, out);
    if (lo && lo->rs) lora_add_rows(tb, lo->rs, lo->l, (lora_target)(lo->tg + 2), lo->e, gb, I, T, out, (int)d->rows);
    s->ar.used = mark;
    return 0;
}

int mlp_dense(petrel_session *s, int l, const layer_w *lw, const lora_set *const *rs, const float *x, int T, float *out, petrel_error *err) {
    mlp_lora lo = {rs, l, LT_GATE, -1};
    return swiglu(s, &lw->gate_proj, &lw->up_proj, &lw->down_proj, x, T, &lo, out, err);
}

/* One MoE layer's rows, their choices by expert and where the experts' outputs go. */
typedef struct moe_rows {
    const kn_table *tb;     /* the engine's kernels */
    const float *x;         /* [T][H] normed input */
    int T, K, H, cap;       /* rows; choices per row; hidden; rows the gather buffers hold */
    const int32_t *start;   /* [E + 1]: choices of expert e are rl[start[e] .. start[e + 1]) */
    const int32_t *rl;      /* [T * K]: choice slots r * K + k, by expert, rows ascending */
    const float *wts;       /* [T][K] routing weights */
    float *yk;              /* [T][K][H]: each choice's output, summed at the end; NULL: added
                               to out as each expert finishes (experts then come ascending) */
    float *out;             /* [T][H] */
    float *xs, *ys, *gb, *ub; /* [cap][H], [max(cap,32)][H], [max(cap,32)][I] x 2 */
    /* LoRA on the routed experts: rs [T] each row's set (NULL: no row's set adapts this layer's
     * experts), gset [max(cap,32)] the gathered rows' sets; l the layer */
    const lora_set *const *rs;
    const lora_set **gset;
    int l;
} moe_rows;

/* The LoRA terms of expert e's gate / up (phase 0, input xb) or down (phase 1, input gb) over
 * n gathered rows whose sets are gs[0..n). */
static void expert_lora(const moe_rows *m, int e, int phase, const lora_set *const *gs, const float *xb, float *gb, float *ub, float *yb,
                        int n, int I) {
    if (phase == 0) {
        lora_add_rows(m->tb, gs, m->l, LT_EXP_GATE, e, xb, m->H, n, gb, I);
        lora_add_rows(m->tb, gs, m->l, LT_EXP_UP, e, xb, m->H, n, ub, I);
    } else lora_add_rows(m->tb, gs, m->l, LT_EXP_DOWN, e, gb, I, n, yb, m->H);
}

static void emit(const moe_rows *m, int32_t slot, const float *y) {
    if (m->yk) memcpy(m->yk + (size_t)slot * m->H, y, sizeof(float) * (size_t)m->H);
    else kt_axpy(m->tb, m->out + (size_t)(slot / m->K) * m->H, m->wts[slot], y, m->H);
}

/* Gate+up of a set of experts over their gathered rows in one pool dispatch, down in another,
 * so the threads balance over the set instead of meeting at a barrier after every expert's
 * ~0.3 ms product; each expert's rows see the same kernel as alone. Rows j of xb belong to
 * expert b for j in [st[b], st[b] + cnt[b]). */
static void run_set(const moe_rows *m, const xs_expert_ref *const *ev, const int *st, const int *cnt, int ne, int rows) {
    enum { EB = 32 };
    kn_job jobs[2 * EB] = {{0}};
    int64_t I = ev[0]->gate.rows;
    for (int b = 0; b < ne; b++) {
        const float *xb = m->xs + (size_t)st[b] * m->H;
        jobs[2 * b] = (kn_job){&ev[b]->gate, xb, cnt[b], m->gb + (size_t)st[b] * I};
        jobs[2 * b + 1] = (kn_job){&ev[b]->up, xb, cnt[b], m->ub + (size_t)st[b] * I};
    }
    kt_matmul_many(m->tb, jobs, 2 * ne);
    for (int b = 0; b < ne && m->rs; b++)
        expert_lora(m, ev[b]->expert, 0, m->gset + st[b], m->xs + (size_t)st[b] * m->H, m->gb + (size_t)st[b] * I, m->ub + (size_t)st[b] * I, NULL,
                    cnt[b], (int)I);
    kt_silu_mul(m->tb, m->gb, m->gb, m->ub, (int64_t)rows * I);
    for (int b = 0; b < ne; b++) jobs[b] = (kn_job){&ev[b]->down, m->gb + (size_t)st[b] * I, cnt[b], m->ys + (size_t)st[b] * m->H};
    kt_matmul_many(m->tb, jobs, ne);
    for (int b = 0; b < ne && m->rs; b++)
        expert_lora(m, ev[b]->expert, 1, m->gset + st[b], NULL, m->gb + (size_t)st[b] * I, NULL, m->ys + (size_t)st[b] * m->H, cnt[b], (int)I);
}

/* Runs experts ev[0..n) (in this order) over the rows that chose them, emitting every choice's
 * output expert by expert: sets of up to 32 experts whose rows fit the gather buffers run
 * together; an expert with more rows than that runs alone in pieces (rows are independent). */
static int run_experts(petrel_session *s, const moe_rows *m, const xs_expert_ref *ev, int n, petrel_error *err) {
    enum { EB = 32 };
    int H = m->H;
    int64_t I = ev[0].gate.rows;
    int same = 1;
    for (int i = 0; i < n && same; i++) same = ev[i].gate.rows == I && ev[i].up.rows == I && ev[i].down.cols == I;
    if (!same) { /* experts of different widths: one at a time */
        for (int i = 0; i < n; i++) {
            int e = ev[i].expert;
            for (int j0 = m->start[e]; j0 < m->start[e + 1]; j0 += m->cap) {
                int c = m->start[e + 1] - j0 < m->cap ? m->start[e + 1] - j0 : m->cap;
                for (int j = 0; j < c; j++) {
                    memcpy(m->xs + (size_t)j * H, m->x + (size_t)(m->rl[j0 + j] / m->K) * H, sizeof(float) * (size_t)H);
                    if (m->rs) m->gset[j] = m->rs[m->rl[j0 + j] / m->K];
                }
                mlp_lora lo = {m->rs ? (const lora_set *const *)m->gset : NULL, m->l, LT_EXP_GATE, e};
                PT_TRY(swiglu(s, &ev[i].gate, &ev[i].up, &ev[i].down, m->xs, c, &lo, m->ys, err));
                for (int j = 0; j < c; j++) emit(m, m->rl[j0 + j], m->ys + (size_t)j * H);
            }
        }
        return 0;
    }
    if (m->T == 1 && n > 1 && n <= EB) { /* decode: one row, every expert in two dispatches */
        kn_job jobs[2 * EB];
        for (int i = 0; i < n; i++) {
            jobs[2 * i] = (kn_job){&ev[i].gate, m->x, 1, m->gb + (size_t)i * I};
            jobs[2 * i + 1] = (kn_job){&ev[i].up, m->x, 1, m->ub + (size_t)i * I};
        }
        kt_matmul_many(m->tb, jobs, 2 * n);
        for (int i = 0; i < n && m->rs; i++) expert_lora(m, ev[i].expert, 0, m->rs, m->x, m->gb + (size_t)i * I, m->ub + (size_t)i * I, NULL, 1, (int)I);
        kt_silu_mul(m->tb, m->gb, m->gb, m->ub, (int64_t)n * I);
        for (int i = 0; i < n; i++) jobs[i] = (kn_job){&ev[i].down, m->gb + (size_t)i * I, 1, m->ys + (size_t)i * H};
        kt_matmul_many(m->tb, jobs, n);
        for (int i = 0; i < n && m->rs; i++) expert_lora(m, ev[i].expert, 1, m->rs, NULL, m->gb + (size_t)i * I, NULL, m->ys + (size_t)i * H, 1, (int)I);
        for (int i = 0; i < n; i++) emit(m, m->rl[m->start[ev[i].expert]], m->ys + (size_t)i * H);
        return 0;
    }
    const xs_expert_ref *set[EB];
    int st[EB], cnt[EB], ne = 0, rows = 0;
    for (int i = 0; i <= n; i++) {
        int e = i < n ? ev[i].expert : -1, c = i < n ? m->start[e + 1] - m->start[e] : 0;
        if (i < n && !c) continue;
        int flush = ne && (i == n || ne == EB || rows + c > m->cap);
        if (flush) { /* the set so far, then its outputs in expert order */
            run_set(m, set, st, cnt, ne, rows);
            for (int b = 0; b < ne; b++) {
                int eb = set[b]->expert;
                for (int j = 0; j < cnt[b]; j++) emit(m, m->rl[m->start[eb] + j], m->ys + (size_t)(st[b] + j) * H);
            }
            ne = rows = 0;
        }
        if (i == n) break;
        for (int j0 = 0; j0 < c; j0 += m->cap) { /* gather (in pieces when it has more rows than fit) */
            int p = c - j0 < m->cap ? c - j0 : m->cap;
            for (int j = 0; j < p; j++) {
                int r = m->rl[m->start[e] + j0 + j] / m->K;
                memcpy(m->xs + (size_t)(rows + j) * H, m->x + (size_t)r * H, sizeof(float) * (size_t)H);
                if (m->rs) m->gset[rows + j] = m->rs[r];
            }
            if (c <= m->cap) break;
            const xs_expert_ref *one = &ev[i];
            int z = 0;
            run_set(m, &one, &z, &p, 1, p);
            for (int j = 0; j < p; j++) emit(m, m->rl[m->start[e] + j0 + j], m->ys + (size_t)j * H);
        }
        if (c > m->cap) continue;
        set[ne] = &ev[i];
        st[ne] = rows;
        cnt[ne++] = c;
        rows += c;
    }
    return 0;
}

/* The next MoE layer's guesses for a streaming store: its router over x (this layer's normed
 * input) ranks each row's experts, and the store decides what to read early (xs_la_guess). A
 * hint: without scratch it is skipped. */
void moe_prefetch_next(petrel_session *s, int next_l, const float *x, int T) {
    const petrel_engine *eng = s->eng;
    const petrel_config *c = &eng->cfg;
    int E = c->n_routed_experts, K = c->num_experts_per_tok;
    int nm = next_l >= 0 && next_l <= c->num_hidden_layers ? eng->moe_index[next_l] : -1;
    if (nm < 0 || !xs_la_wanted(eng->xs, nm) || K > 64) return;
    const layer_w *next_lw = next_l < c->num_hidden_layers ? &eng->w.layers[next_l] : &eng->w.mtp;
    size_t mark = s->ar.used;
    la_scr la;
    if (!la_carve(&s->ar, c, T, &la)) {
        float *lg = la.lg, *scratch = la.scratch;
        int32_t *pids = la.pids, *ranked = la.ranked;
        kt_matmul(&eng->kt, &next_lw->router, x, T, lg);
        float pw[64];
        for (int r = 0; r < T; r++) /* moe_route lists each row's experts best first */
            moe_route(c, lg + (size_t)r * E, next_lw->e_score_correction_bias, ranked + (size_t)r * K, pw, scratch);
        xs_la_guess(eng->xs, nm, ranked, T, K, PT_LOOKAHEAD_GATE, pids);
    }
    s->ar.used = mark;
}

typedef struct moe_cb {
    petrel_session *s;
    const layer_w *lw;
    const float *x;
    int T, next_l, shared_done, l;
    float *ysh;             /* [T][H] the shared expert's output when it ran early */
    uint64_t shared_ns;
} moe_cb;

static void cb_lookahead(void *ctx) {
    moe_cb *c = ctx;
    moe_prefetch_next(c->s, c->next_l, c->x, c->T);
}

static int cb_idle(void *ctx, petrel_error *err) { /* the shared expert, while misses read */
    moe_cb *c = ctx;
    if (!c->lw->has_shared || !c->ysh) return 0;
    uint64_t t0 = pt_now_ns();
    mlp_lora lo = {c->s->row_lora, c->l, LT_SH_GATE, -1};
    PT_TRY(swiglu(c->s, &c->lw->sh_gate, &c->lw->sh_up, &c->lw->sh_down, c->x, c->T, &lo, c->ysh, err));
    c->shared_ns = pt_now_ns() - t0;
    c->shared_done = 1;
    return 0;
}

int moe_forward(petrel_session *s, int l, const layer_w *lw, int next_l, const float *x, int T, int32_t *idx, float *wts,
                int32_t *rl, const int32_t *route_pos, float *out, petrel_error *err) {
    const petrel_engine *eng = s->eng;
    const petrel_config *c = &eng->cfg;
    int E = c->n_routed_experts, K = c->num_experts_per_tok, H = c->hidden_size, C = s->max_batch;
    int mode = T > C ? XS_RUN_ASCENDING : XS_RUN_READY; /* spans: each expert once, ascending */
    size_t mark = s->ar.used;
    moe_scr ms;
    if (lw->exp_gate[0].rows != c->moe_intermediate_size || moe_carve(&s->ar, c, T, C, mode == XS_RUN_READY, rl == NULL, &ms))
        return pt_err(err, PETREL_ENOMEM, "MoE scratch exhausted");
    int cap = ms.cap; /* the router's pieces; the gathers take ms.gcap rows */
    float *lg = ms.lg, *scratch = ms.scratch;
    int32_t *start = ms.start, *pos = ms.pos, *order = ms.order;
    xs_expert_ref *refs = ms.refs;
    uint8_t *chosen = ms.chosen;
    if (!rl) rl = ms.rl;
    moe_rows m = {.tb = &eng->kt, .x = x, .T = T, .K = K, .H = H, .cap = ms.gcap, .start = start, .rl = rl, .wts = wts, .out = out,
                  .xs = ms.xs, .ys = ms.ys, .gb = ms.gb, .ub = ms.ub, .yk = ms.yk};
    moe_cb cb = {.s = s, .lw = lw, .x = x, .T = T, .next_l = next_l, .ysh = ms.ysh, .l = l};
    m.l = l;
    m.gset = ms.gset;
    for (int r = 0; r < T && s->row_lora && !m.rs; r++) /* any row's set adapting these experts */
        if (lora_set_has(s->row_lora[r], l, LT_EXP_GATE) || lora_set_has(s->row_lora[r], l, LT_EXP_UP) || lora_set_has(s->row_lora[r], l, LT_EXP_DOWN))
            m.rs = s->row_lora;
    uint64_t *ns = s->stats.ns, t0 = pt_now_ns(), t1;
    for (int r0 = 0; r0 < T; r0 += cap) { /* route every row (the router in pieces of cap rows) */
        int n = T - r0 < cap ? T - r0 : cap;
        kt_matmul(&eng->kt, &lw->router, x + (size_t)r0 * H, n, lg);
        for (int r = 0; r < n; r++)
            moe_route(c, lg + (size_t)r * E, lw->e_score_correction_bias, idx + (size_t)(r0 + r) * K, wts + (size_t)(r0 + r) * K, scratch);
        if (eng->route && route_pos && l < c->num_hidden_layers) /* trace-driven routing (benchmarks) */
            for (int r = 0; r < n; r++) {
                const xs_trace *t = eng->route;
                long tok = ((long)route_pos[r0 + r] % t->n_tokens + t->n_tokens) % t->n_tokens;
                const int16_t *te = t->ids + ((size_t)tok * t->n_layers + eng->route_layer[eng->moe_index[l]]) * t->topk;
                int32_t *ir = idx + (size_t)(r0 + r) * K;
                for (int k = 0; k < K; k++) ir[k] = te[k];
                moe_route_given(c, lg + (size_t)r * E, ir, wts + (size_t)(r0 + r) * K);
            }
    }
    if (eng->trace) stream_trace_note(eng, l, idx, T, K);
    /* the choices by expert (counting sort; rows ascending within an expert) */
    memset(start, 0, sizeof(int32_t) * (size_t)(E + 1));
    memset(chosen, 0, (size_t)E);
    for (int i = 0; i < T * K; i++) start[idx[i] + 1]++;
    for (int e = 0; e < E; e++) {
        chosen[e] = start[e + 1] > 0;
        start[e + 1] += start[e];
        pos[e] = start[e];
    }
    for (int i = 0; i < T * K; i++) rl[pos[idx[i]]++] = i;
    /* the schedule is the expert store's: it hands the experts back in the order to run them */
    xs_run run;
    xs_run_args ra = {.st = eng->xs, .layer = eng->moe_index[l], .mode = mode, .chosen = chosen, .n_experts = E,
                      .resident = {lw->exp_gate, lw->exp_up, lw->exp_down}, .order = order, .refs = refs,
                      .lookahead = cb_lookahead, .idle = cb_idle, .cb_ctx = &cb};
    s->stats.experts_run += (uint64_t)xs_run_begin(&run, &ra);
    t1 = pt_now_ns();
    ns[FS_ROUTER] += t1 - t0;
    t0 = t1;
    if (!m.yk) memset(out, 0, sizeof(float) * (size_t)T * H);
    const xs_expert_ref *ev;
    int n, rc = 0;
    while ((n = xs_run_next(&run, &ev, err)) > 0)
        if ((rc = run_experts(s, &m, ev, n, err)) < 0) break;
    xs_run_end(&run);
    s->stats.io_ns += run.io_ns;
    if (n < 0) return n;
    if (rc < 0) return rc;
    if (m.yk) /* a READY run's order is the store's: sum per row in ascending expert id, the
                 order an ascending run adds them in, so every run gives the same bits */
        for (int r = 0; r < T; r++) {
            float *o = out + (size_t)r * H;
            const int32_t *ir = idx + (size_t)r * K;
            memset(o, 0, sizeof(float) * (size_t)H);
            for (int done = 0, prev = -1; done < K; done++) {
                int best = -1;
                for (int k = 0; k < K; k++)
                    if (ir[k] > prev && (best < 0 || ir[k] < ir[best])) best = k;
                kt_axpy(&eng->kt, o, wts[(size_t)r * K + best], m.yk + ((size_t)r * K + best) * H, H);
                prev = ir[best];
            }
        }
    t1 = pt_now_ns();
    ns[FS_EXPERTS] += t1 - t0 - cb.shared_ns;
    ns[FS_SHARED] += cb.shared_ns;
    t0 = t1;
    if (lw->has_shared) {
        if (cb.shared_done) /* ran while the misses read */
            for (size_t i = 0; i < (size_t)T * H; i++) out[i] += cb.ysh[i];
        else
            for (int r0 = 0; r0 < T; r0 += cap) {
                int n1 = T - r0 < cap ? T - r0 : cap;
                mlp_lora lo = {s->row_lora ? s->row_lora + r0 : NULL, l, LT_SH_GATE, -1};
                PT_TRY(swiglu(s, &lw->sh_gate, &lw->sh_up, &lw->sh_down, x + (size_t)r0 * H, n1, &lo, m.ys, err));
                float *o = out + (size_t)r0 * H;
                for (size_t i = 0; i < (size_t)n1 * H; i++) o[i] += m.ys[i];
            }
    }
    ns[FS_SHARED] += pt_now_ns() - t0;
    s->ar.used = mark;
    return 0;
}
