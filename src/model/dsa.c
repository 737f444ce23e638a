/* dsa.c: the DSA lightning indexer. On a full layer each row scores every causal key with
 *   I(s,t) = sum_h w_h(s) * ReLU(qi_h(s) . ki(t) / sqrt(Di)),   w = weights_proj(x) / sqrt(Hi)
 * and keeps the k = min(index_topk, s + 1) best; shared layers reuse the previous full layer's
 * selection (forward.c keeps it). When s + 1 <= index_topk the selection is every causal key,
 * so scoring is skipped (the keys are still cached for later rows). Scores: kn_dsa (kernels.h),
 * over the cached keys page by page, threaded over the pages of a row.
 * Selections are written sorted ascending so attention sums in a fixed order. */
#include <math.h>
#include <string.h>

#include "base/err.h"
#include "base/pool.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/lora.h"
#include "model/ops.h"
#include "model/scratch.h"
#include "kv/kv.h"

/* A row's scores over its n keys, runs [0, nruns) of the call's runs split into ntasks tasks
 * (each score is kn_dsa's arithmetic whichever task computes it). */
typedef struct {
    const kn_table *tb;
    kn_dsa base;           /* the row's query and weights */
    const dsa_run *runs;
    int nruns, n;          /* the last run ends at key n */
    float *score;
    int ntasks;
} ds_job;

static void ds_task(void *ctx, int task, int thread) {
    (void)thread;
    const ds_job *j = ctx;
    int r0 = (int)((int64_t)task * j->nruns / j->ntasks), r1 = (int)((int64_t)(task + 1) * j->nruns / j->ntasks);
    for (int i = r0; i < r1; i++) {
        kn_dsa a = j->base;
        a.k = j->runs[i].k;
        a.n = j->runs[i].a + j->runs[i].n < j->n ? j->runs[i].n : j->n - j->runs[i].a;
        a.score = j->score + j->runs[i].a;
        kt_dsa_scores(j->tb, &a);
    }
}

int dsa_select(petrel_session *s, int l, const layer_w *lw, const float *x, const float *qr, int T,
               const rope_rows *rope, int32_t *sel, int *sel_n, int sel_stride, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    int Hi = c->index_n_heads, Di = c->index_head_dim, Dr = c->qk_rope_head_dim, H = c->hidden_size;
    int P = s->len, topk = c->index_topk;
    if (!lw->has_indexer) { /* no indexer weights: exact only while every causal key fits */
        for (int r = 0; r < T; r++) {
            int n = P + r + 1;
            if (n > topk) return pt_err(err, PETREL_EUNSUPPORTED, "layer %d has no DSA indexer weights: cannot select %d of %d keys", l, topk, n);
            for (int t = 0; t < n; t++) sel[(size_t)r * sel_stride + t] = t;
            sel_n[r] = n;
        }
        return 0;
    }
    size_t mark = s->ar.used;
    dsa_scr d;
    if (dsa_carve(&s->ar, c, T, P + T, &d)) return pt_err(err, PETREL_ENOMEM, "indexer scratch exhausted (layer %d)", l);
    float *qi = d.qi, *ki = d.ki, *iw = d.iw, *score = d.score;
    int32_t *tmp = d.tmp;
    const kn_table *tb = &s->eng->kt;
    /* While every row's causal keys fit in index_topk, every key is selected: the query side
     * (wq_b, weights_proj, scoring) cannot change the result and is skipped; the keys are still
     * written for the rows that come later. */
    int need_q = s->dsa_always_score || P + T > topk;
    if (need_q) kt_matmul(tb, &lw->idx_wq_b, qr, T, qi);
    kt_matmul(tb, &lw->idx_wk, x, T, ki);
    if (need_q) kt_matmul(tb, &lw->idx_weights_proj, x, T, iw);
    if (s->lora.n) {
        if (need_q) lora_add(tb, &s->lora, l, LT_IDX_Q_B, -1, qr, c->q_lora_rank, T, qi, Hi * Di, 0, Hi * Di);
        lora_add(tb, &s->lora, l, LT_IDX_K, -1, x, H, T, ki, Di, 0, Di);
        if (need_q) lora_add(tb, &s->lora, l, LT_IDX_W, -1, x, H, T, iw, Hi, 0, Hi);
    }
    const float wscale = (float)(1.0 / sqrt((double)Hi) / sqrt((double)Di));
    for (int r = 0; r < T; r++) {
        const float *cs = rope->cos_ + (size_t)r * (Dr / 2), *sn = rope->sin_ + (size_t)r * (Dr / 2);
        for (int h = 0; h < Hi && need_q; h++) op_rope(qi + ((size_t)r * Hi + h) * Di, cs, sn, Dr, c->indexer_rope_interleave);
        float *k = ki + (size_t)r * Di;
        op_layernorm(k, k, lw->idx_k_norm_w, lw->idx_k_norm_b, Di, 1e-6);
        op_rope(k, cs, sn, Dr, c->indexer_rope_interleave);
        PT_TRY(kv_write_index(s->kv, l, P + r, k, err));
        for (int h = 0; h < Hi && need_q; h++) iw[(size_t)r * Hi + h] *= wscale;
    }
    /* the keys 0 .. P+T-1 as runs of f32 rows (page by page), once for every row of the call
     * (every KV scheme of the engine keeps the index keys f32: kv_engine_opts) */
    if (need_q && !kv_index_is_f32(s->kv))
        return pt_err(err, PETREL_EUNSUPPORTED, "the DSA indexer scores f32 index keys; this KV pool stores them below f32");
    int nruns = 0, Hp = kn_dsa_heads(Hi);
    for (int a = 0; a < P + T && need_q;) {
        kv_run run;
        int m = kv_run_at(s->kv, l, a, P + T, &run, err);
        if (m < 0) return m;
        d.runs[nruns++] = (dsa_run){(const float *)run.idx, a, m};
        a += m;
    }
    for (int r = 0; r < T; r++) {
        int n = P + r + 1;
        int32_t *out = sel + (size_t)r * sel_stride;
        if (n <= topk && !s->dsa_always_score) {
            for (int t = 0; t < n; t++) out[t] = t;
            sel_n[r] = n;
            continue;
        }
        /* the row's query transposed and its weights, heads padded with zeros (kn_dsa) */
        const float *q = qi + (size_t)r * Hi * Di, *w = iw + (size_t)r * Hi;
        memset(d.qt, 0, sizeof(float) * (size_t)Di * Hp);
        memset(d.wp, 0, sizeof(float) * (size_t)Hp);
        for (int h = 0; h < Hi; h++) {
            d.wp[h] = w[h];
            for (int e = 0; e < Di; e++) d.qt[(size_t)e * Hp + h] = q[(size_t)h * Di + e];
        }
        kn_dsa base = {Hp, Di, d.qt, d.wp, NULL, Di, 0, NULL};
        int nr = 0;
        while (nr < nruns && d.runs[nr].a < n) nr++;
        ds_job j = {tb, base, d.runs, nr, n, score, 1};
        int nt = pool_threads(kn_pool());
        j.ntasks = n >= 256 && nt > 1 ? (nr < 4 * nt ? nr : 4 * nt) : 1;
        if (j.ntasks > 1) pool_run(kn_pool(), j.ntasks, ds_task, &j);
        else ds_task(&j, 0, 0);
        int k = n < topk ? n : topk;
        op_topk(score, n, k, out, tmp);
        sel_n[r] = k;
    }
    s->ar.used = mark;
    return 0;
}
