/* forward.c: the layer loop.
 *
 * fwd_rows runs a batch of rows (segments of consecutive positions of one or more sessions):
 *   embed -> for each layer: RMSNorm, MLA (+ DSA selection), residual, RMSNorm, MLP/MoE,
 *   residual -> final norm -> lm_head on the rows that want logits.
 * A streaming prompt longer than a batch runs through the same loop as a span: each layer's
 * attention in the chunks a batch would take, then the layer's MoE once over the whole span,
 * so the expert store reads each expert once per span.
 * The cache is written before attention reads it, so row r sees keys 0..P+r. If a call fails,
 * the session's length is left where it was (the rows written past it are ignored). */
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/err.h"
#include "cuda/cu.h"
#include "io/pack.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/lora.h"
#include "model/ops.h"
#include "model/scratch.h"
#include "kv/kv.h"

const char *const fwd_part_names[FS_COUNT] = {"attention", "indexer", "dense mlp", "router", "routed experts", "shared expert", "head", "other"};

/* Each segment's LoRA terms on target t: y[r] (width on) += delta x[r] for its rows. */
static void seg_lora(const kn_table *kt, const fwd_seg *seg, int nseg, int l, lora_target t, const float *x, int ldx, float *y, int ldy, int on) {
    for (int g = 0; g < nseg; g++)
        if (seg[g].s->lora.n && lora_set_has(&seg[g].s->lora, l, t))
            lora_add(kt, &seg[g].s->lora, l, t, -1, x + (size_t)seg[g].r0 * ldx, ldx, seg[g].n, y + (size_t)seg[g].r0 * ldy, ldy, 0, on);
}

int attn_segs(petrel_session *scr, int l, const layer_w *lw, float *h, const float *x, int T, const fwd_seg *seg, int nseg,
              const rope_rows *rope, int32_t *sel, int *sel_n, int sel_stride, const attn_bufs *b, petrel_error *err) {
    const petrel_engine *e = scr->eng;
    const petrel_config *c = &e->cfg;
    int H = c->hidden_size, NH = c->num_attention_heads, Dqk = c->qk_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    int Rq = c->q_lora_rank, Rkv = c->kv_lora_rank;
    uint64_t *ns = scr->stats.ns, t0 = pt_now_ns(), t1;
    float *qa = b->qa, *q = b->q, *kva = b->kva, *o = b->o, *y = b->y;
    /* the projections over every row at once (weights read once per batch) */
    kn_job a[2] = {{&lw->q_a_proj, x, T, qa}, {&lw->kv_a_proj_with_mqa, x, T, kva}}; /* one dispatch */
    kt_matmul_many(&e->kt, a, 2);
    seg_lora(&e->kt, seg, nseg, l, LT_Q_A, x, H, qa, Rq, Rq);
    seg_lora(&e->kt, seg, nseg, l, LT_KV_A, x, H, kva, Rkv + Dr, Rkv + Dr);
    for (int r = 0; r < T; r++) op_rmsnorm(qa + (size_t)r * Rq, qa + (size_t)r * Rq, lw->q_a_layernorm, Rq, 1e-6);
    kt_matmul(&e->kt, &lw->q_b_proj, qa, T, q);
    seg_lora(&e->kt, seg, nseg, l, LT_Q_B, qa, Rq, q, NH * Dqk, NH * Dqk);
    for (int g = 0; g < nseg; g++) { /* RoPE; each row's latent KV into its session's cache */
        petrel_session *s = seg[g].s;
        for (int i = 0; i < seg[g].n; i++) {
            int r = seg[g].r0 + i, pos = s->len + i;
            const float *cs = rope->cos_ + (size_t)r * (Dr / 2), *sn = rope->sin_ + (size_t)r * (Dr / 2);
            for (int hh = 0; hh < NH; hh++) op_rope(q + ((size_t)r * NH + hh) * Dqk + c->qk_nope_head_dim, cs, sn, Dr, c->rope_interleave);
            float *kv = kva + (size_t)r * (Rkv + Dr);
            op_rmsnorm(kv, kv, lw->kv_a_layernorm, Rkv, 1e-6);
            op_rope(kv + Rkv, cs, sn, Dr, c->rope_interleave);
            PT_TRY(kv_write(s->kv, l, pos, kv, kv + Rkv, err)); /* encoded in the pool's scheme */
        }
    }
    t1 = pt_now_ns(), ns[FS_ATTN] += t1 - t0, t0 = t1;
    /* selection and attention per segment, over its own session's cache (its arena for scratch);
     * the MTP layer (l == L) attends densely: every causal key, no selection list */
    fwd_trace *tr = scr->trace;
    if (l == c->num_hidden_layers) {
        for (int g = 0; g < nseg; g++)
            for (int i = 0; i < seg[g].n; i++) sel_n[seg[g].r0 + i] = seg[g].s->len + i + 1;
        sel = NULL;
    }
    for (int g = 0; g < nseg && c->layer_indexer_full[l]; g++) {
        petrel_session *s = seg[g].s;
        int r0 = seg[g].r0, n = seg[g].n;
        rope_rows rs = {rope->cos_ + (size_t)r0 * (Dr / 2), rope->sin_ + (size_t)r0 * (Dr / 2)};
        int32_t *sg = sel + (size_t)r0 * sel_stride;
        int *sgn = sel_n + r0;
        t0 = pt_now_ns();
        PT_TRY(dsa_select(s, l, lw, x + (size_t)r0 * H, qa + (size_t)r0 * Rq, n, &rs, sg, sgn, sel_stride, err));
        if (tr && tr->topk && tr->topk[l])
            for (int r = 0; r < n; r++)
                for (int i = 0; i < tr->topk_stride; i++)
                    tr->topk[l][(size_t)(r0 + r) * tr->topk_stride + i] = i < sgn[r] ? sg[(size_t)r * sel_stride + i] : -1;
        ns[FS_INDEXER] += pt_now_ns() - t0;
    }
    t0 = pt_now_ns();
    /* one-row segments (a batch's decode rows) share the head products, FWD_ROWS_GROUP at a
     * time; longer segments (prompt chunks, windows) run alone */
    petrel_session *gs[FWD_ROWS_GROUP];
    int32_t gr[FWD_ROWS_GROUP];
    int ng = 0;
    for (int g = 0; g <= nseg; g++) {
        int one = g < nseg && seg[g].n == 1 && seg[g].s->mla != MLA_RECONSTRUCTED && nseg > 1;
        if (one) {
            gs[ng] = seg[g].s;
            gr[ng++] = seg[g].r0;
        }
        if (ng && (ng == FWD_ROWS_GROUP || g == nseg || (!one && g < nseg))) {
            if (ng == 1) PT_TRY(mla_attention(gs[0], l, lw, q + (size_t)gr[0] * NH * Dqk, 1, sel ? sel + (size_t)gr[0] * sel_stride : NULL, sel_n + gr[0],
                                              sel_stride, o + (size_t)gr[0] * NH * Dv, err));
            else PT_TRY(mla_attention_rows(scr, l, lw, gs, gr, ng, q, sel, sel_n, sel_stride, o, err));
            ng = 0;
        }
        if (g == nseg || one) continue;
        int r0 = seg[g].r0, n = seg[g].n;
        PT_TRY(mla_attention(seg[g].s, l, lw, q + (size_t)r0 * NH * Dqk, n, sel ? sel + (size_t)r0 * sel_stride : NULL, sel_n + r0, sel_stride,
                             o + (size_t)r0 * NH * Dv, err));
    }
    ns[FS_ATTN] += pt_now_ns() - t0;
    t0 = pt_now_ns();
    kt_matmul(&e->kt, &lw->o_proj, o, T, y);
    seg_lora(&e->kt, seg, nseg, l, LT_O, o, NH * Dv, y, H, H);
    for (int i = 0; i < T * H; i++) h[i] += y[i];
    ns[FS_ATTN] += pt_now_ns() - t0;
    return 0;
}

int fwd_rows(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *ids, int T, float *logits,
             const int32_t *lrows, int nlog, petrel_error *err) {
    return fwd_rows_h(scr, seg, nseg, ids, T, logits, lrows, nlog, NULL, err);
}

/* The same rows on the GPU (src/cuda): each segment's cache is its session's in HBM; the host
 * page table still records the positions and tokens (reserve, append), so truncation, the
 * token list and the context checks work as on the CPU. */
static int fwd_rows_cuda(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *ids, int T, float *logits, const int32_t *lrows,
                         int nlog, float *hidden, petrel_error *err) {
    const petrel_engine *e = scr->eng;
    if (scr->trace) return pt_err(err, PETREL_EUNSUPPORTED, "intermediate-result traces are not taken on the GPU");
    scr->ar.used = 0;
    cu_seg *cs = ar_alloc(&scr->ar, sizeof(cu_seg) * (size_t)nseg);
    if (!cs) return pt_err(err, PETREL_ENOMEM, "forward scratch exhausted");
    for (int g = 0; g < nseg; g++) {
        petrel_session *s = seg[g].s;
        PT_TRY(kv_seq_reserve(s->kv, s->len, s->len + seg[g].n, err));
        cs[g] = (cu_seg){s->cu, s->len, seg[g].r0, seg[g].n, s->dsa_always_score, s->route_offset};
    }
    uint64_t t0 = pt_now_ns();
    PT_TRY(cu_forward(e->cu, cs, nseg, ids, T, logits, lrows, nlog, hidden, &scr->stats.experts_run, err));
    scr->stats.ns[FS_OTHER] += pt_now_ns() - t0;
    scr->stats.rows += (uint64_t)T;
    for (int g = 0; g < nseg; g++) {
        PT_TRY(kv_seq_append(seg[g].s->kv, ids + seg[g].r0, seg[g].n, err));
        seg[g].s->len += seg[g].n;
    }
    return 0;
}

int fwd_rows_h(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *ids, int T, float *logits,
               const int32_t *lrows, int nlog, float *hidden, petrel_error *err) {
    const petrel_engine *e = scr->eng;
    if (e->cu) return fwd_rows_cuda(scr, seg, nseg, ids, T, logits, lrows, nlog, hidden, err);
    const petrel_config *c = &e->cfg;
    const model_w *w = &e->w;
    int H = c->hidden_size, Dr = c->qk_rope_head_dim, L = c->num_hidden_layers, V = c->vocab_size;
    /* The schedule: a batch (T <= max_batch) runs every layer over all its rows at once. A span
     * (one session's prompt, max_batch < T <= pf.rows, streaming prefill) runs each layer's
     * attention in chunks of max_batch rows, at the positions the chunk would have alone, then
     * its MoE once over every row, so a streamed expert is read once per span; the results are
     * bitwise those of running the chunks one after another. */
    int C = scr->max_batch, span = T > C;
    if (span && (nseg != 1 || seg[0].s != scr || T > scr->pf.rows))
        return pt_err(err, PETREL_EINVAL, "a forward of %d rows exceeds the batch's %d (layer-major spans: one session, at most %d rows)", T, C,
                      scr->pf.rows);
    petrel_session *s0 = seg[0].s;
    int P0 = s0->len;
    rows_scr st;
    attn_bufs b = {0};
    scr->ar.used = 0;
    if (span) {
        pf_carve(scr->pf.block, c, scr->pf.rows, scr->pf.sel_stride, &st);
    } else {
        int kmax = 1;
        for (int g = 0; g < nseg; g++) {
            int n = seg[g].s->len + seg[g].n;
            if (n > kmax) kmax = n;
        }
        if (kmax > c->index_topk) kmax = c->index_topk;
        if (rows_carve(&scr->ar, c, T, kmax, &st, &b)) return pt_err(err, PETREL_ENOMEM, "forward scratch exhausted");
    }
    size_t mark = scr->ar.used;
    PT_TRY(session_lora_rows(scr, seg, nseg, T, err));
    float *h = st.h;
    for (int g = 0; g < nseg; g++)
        for (int i = 0; i < seg[g].n; i++) {
            int r = seg[g].r0 + i;
            pt_dequant_row(&w->embed_tokens, ids[r], h + (size_t)r * H);
            op_rope_table(c->rope_theta, Dr, seg[g].s->len + i, st.rope.cos_ + (size_t)r * (Dr / 2), st.rope.sin_ + (size_t)r * (Dr / 2));
            st.route_pos[r] = seg[g].s->len + i + seg[g].s->route_offset;
        }
    if (e->pack) pack_release_on_disk(e->pack); /* embedding rows read through the file map */
    for (int g = 0; g < nseg; g++) /* every page the rows write, up front: a forward that does not fit fails here */
        PT_TRY(kv_seq_reserve(seg[g].s->kv, seg[g].s->len, seg[g].s->len + seg[g].n, err));
    fwd_trace *tr = scr->trace;
    if (tr && tr->hidden) memcpy(tr->hidden, h, sizeof(float) * (size_t)T * H);
    uint64_t *ns = scr->stats.ns, t0, t1;
    int rc = 0;
#define LAP(part) (t1 = pt_now_ns(), ns[part] += t1 - t0, t0 = t1)
    for (int l = 0; l < L && !rc; l++) {
        const layer_w *lw = &w->layers[l];
        int nl = l + 1; /* the next MoE layer, whose experts a streaming store can start reading */
        while (nl < L && !c->layer_is_moe[nl]) nl++;
        if (nl >= L) nl = -1;
        for (int r0 = 0; r0 < T && !rc; r0 += C) { /* attention (and a dense MLP) chunk by chunk */
            int n = T - r0 < C ? T - r0 : C;
            float *hc = h + (size_t)r0 * H;
            if (span) {
                scr->ar.used = mark;
                if (attn_carve(&scr->ar, c, n, &b)) {
                    rc = pt_err(err, PETREL_ENOMEM, "forward scratch exhausted");
                    break;
                }
            }
            t0 = pt_now_ns();
            for (int r = 0; r < n; r++) op_rmsnorm(b.x + (size_t)r * H, hc + (size_t)r * H, lw->input_layernorm, H, c->rms_norm_eps);
            /* a dense layer reads no experts of its own: the next MoE layer's guesses start now */
            if (!lw->is_moe && !span && nl >= 0) moe_prefetch_next(scr, nl, b.x, n);
            LAP(FS_ATTN);
            fwd_seg cs = {s0, 0, n}; /* a span's chunk: its rows at the positions they would have alone */
            if (span) s0->len = P0 + r0;
            const fwd_seg *sg = span ? &cs : seg;
            rope_rows rr = {st.rope.cos_ + (size_t)r0 * (Dr / 2), st.rope.sin_ + (size_t)r0 * (Dr / 2)};
            rc = attn_segs(scr, l, lw, hc, b.x, n, sg, span ? 1 : nseg, &rr, st.sel + (size_t)r0 * st.kst, st.sel_n + r0, st.kst, &b, err);
            if (rc) break;
            t0 = pt_now_ns();
            float *xo = lw->is_moe ? st.xm + (size_t)r0 * H : b.x;
            for (int r = 0; r < n; r++) op_rmsnorm(xo + (size_t)r * H, hc + (size_t)r * H, lw->post_attention_layernorm, H, c->rms_norm_eps);
            LAP(FS_ATTN);
            if (!lw->is_moe) {
                if (!span && nl >= 0) moe_prefetch_next(scr, nl, b.x, n);
                rc = mlp_dense(scr, l, lw, scr->row_lora ? scr->row_lora + r0 : NULL, b.x, n, b.y, err);
                for (size_t i = 0; i < (size_t)n * H && !rc; i++) hc[i] += b.y[i];
                LAP(FS_DENSE);
            }
        }
        if (!rc && lw->is_moe) { /* the MoE once over every row (times its own parts) */
            scr->ar.used = mark;
            rc = moe_forward(scr, l, lw, nl, st.xm, T, st.idx, st.wts, st.rl, st.route_pos, st.out, err);
            for (size_t i = 0; i < (size_t)T * H && !rc; i++) h[i] += st.out[i];
        }
        if (!rc && tr && tr->hidden && l < L - 1) memcpy(tr->hidden + (size_t)(l + 1) * T * H, h, sizeof(float) * (size_t)T * H);
        if (!rc && span && scr->progress) scr->progress(scr->progress_user, scr->pg_done + (long long)T * (l + 1), scr->pg_total);
    }
    if (span) s0->len = P0;
    if (rc) {
        scr->row_lora = NULL;
        return rc;
    }
    scr->ar.used = mark;
    t0 = pt_now_ns();
    if (tr && tr->hidden)
        for (int r = 0; r < T; r++) op_rmsnorm(tr->hidden + ((size_t)L * T + r) * H, h + (size_t)r * H, w->norm, H, c->rms_norm_eps);
    if (hidden) /* every row's final-normed state (the MTP head's input; speculative decoding) */
        for (int r = 0; r < T; r++) op_rmsnorm(hidden + (size_t)r * H, h + (size_t)r * H, w->norm, H, c->rms_norm_eps);
    for (int i0 = 0; logits && i0 < nlog; i0 += C) { /* the head over the rows that want logits */
        int n = nlog - i0 < C ? nlog - i0 : C;
        float *xl;
        if (head_carve(&scr->ar, c, n, &xl)) return pt_err(err, PETREL_ENOMEM, "forward scratch exhausted");
        for (int i = 0; i < n; i++) {
            int r = lrows ? lrows[i0 + i] : T - nlog + i0 + i;
            op_rmsnorm(xl + (size_t)i * H, h + (size_t)r * H, w->norm, H, c->rms_norm_eps);
        }
        LAP(FS_OTHER);
        kt_matmul(&e->kt, &w->lm_head, xl, n, logits + (size_t)i0 * V);
        for (int i = 0; i < n && scr->row_lora; i++) {
            int r = lrows ? lrows[i0 + i] : T - nlog + i0 + i;
            lora_add(&e->kt, scr->row_lora[r], 0, LT_HEAD, -1, xl + (size_t)i * H, H, 1, logits + (size_t)(i0 + i) * V, V, 0, V);
        }
        LAP(FS_HEAD);
        scr->ar.used = mark;
    }
#undef LAP
    scr->row_lora = NULL;
    scr->stats.rows += (uint64_t)T;
    if (e->trace) PT_TRY(stream_trace_flush(e, T, err));
    for (int g = 0; g < nseg; g++) {
        PT_TRY(kv_seq_append(seg[g].s->kv, ids + seg[g].r0, seg[g].n, err));
        seg[g].s->len += seg[g].n;
    }
    return 0;
}

int fwd_mtp(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *next, const float *hidden, int T, float *logits,
            petrel_error *err) {
    return fwd_mtp_h(scr, seg, nseg, next, hidden, T, logits, NULL, T, NULL, err);
}

int fwd_mtp_h(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *next, const float *hidden, int T, float *logits,
              const int32_t *lrows, int nlog, float *hout, petrel_error *err) {
    const petrel_engine *e = scr->eng;
    const petrel_config *c = &e->cfg;
    const model_w *w = &e->w;
    int H = c->hidden_size, Dr = c->qk_rope_head_dim, L = c->num_hidden_layers;
    if (!w->has_mtp) return pt_err(err, PETREL_EUNSUPPORTED, "this model has no MTP layer (layer %d: eh_proj, enorm, hnorm)", L);
    if (e->cu) return pt_err(err, PETREL_EUNSUPPORTED, "the MTP head does not run on the GPU yet (--device cuda: use --draft 0)");
    if (e->trace) return pt_err(err, PETREL_EUNSUPPORTED, "the MTP head does not run while a routing trace is recorded");
    for (int g = 0; g < nseg; g++) {
        petrel_session *s = seg[g].s;
        if (s->n_layers <= L) return pt_err(err, PETREL_EINVAL, "session has no MTP cache (created before the MTP layer was bound)");
        if (s->mtp_len + seg[g].n > s->cap) return pt_err(err, PETREL_ERANGE, "MTP cache full: %d + %d rows exceed %d", s->mtp_len, seg[g].n, s->cap);
    }
    for (int r = 0; r < T; r++)
        if (next[r] < 0 || next[r] >= c->vocab_size) return pt_err(err, PETREL_EINVAL, "MTP row %d: token id %d is out of range", r, next[r]);
    scr->ar.used = 0;
    mtp_scr m;
    if (mtp_carve(&scr->ar, c, T, nseg, &m)) return pt_err(err, PETREL_ENOMEM, "MTP scratch exhausted");
    float *h = m.h, *cat = m.cat;
    attn_bufs b = m.b;
    rope_rows rope = m.rope;
    int *sel_n = m.sel_n;
    for (int g = 0; g < nseg; g++)
        for (int i = 0; i < seg[g].n; i++) {
            int r = seg[g].r0 + i;
            float *cr = cat + (size_t)r * 2 * H;
            pt_dequant_row(&w->embed_tokens, next[r], b.y + (size_t)r * H);
            op_rmsnorm(cr, b.y + (size_t)r * H, w->enorm, H, c->rms_norm_eps);
            op_rmsnorm(cr + H, hidden + (size_t)r * H, w->hnorm, H, c->rms_norm_eps);
            op_rope_table(c->rope_theta, Dr, seg[g].s->mtp_len + i, rope.cos_ + (size_t)r * (Dr / 2), rope.sin_ + (size_t)r * (Dr / 2));
        }
    if (e->pack) pack_release_on_disk(e->pack);
    PT_TRY(session_lora_rows(scr, seg, nseg, T, err));
    kt_matmul(&e->kt, &w->eh_proj, cat, T, h);
    lora_add_rows(&e->kt, scr->row_lora, L, LT_EH, -1, cat, 2 * H, T, h, H);
    /* the decoder layer runs at the MTP cache's positions: the sessions' lengths stand in for it
     * while it runs (attn_segs and mla read s->len) */
    int rc = 0, *len = m.len;
    for (int g = 0; g < nseg; g++) {
        PT_TRY(kv_seq_reserve(seg[g].s->kv, seg[g].s->mtp_len, seg[g].s->mtp_len + seg[g].n, err)); /* drafts may run past len */
        len[g] = seg[g].s->len;
        seg[g].s->len = seg[g].s->mtp_len;
    }
    const layer_w *lw = &w->mtp;
    for (int r = 0; r < T; r++) op_rmsnorm(b.x + (size_t)r * H, h + (size_t)r * H, lw->input_layernorm, H, c->rms_norm_eps);
    rc = attn_segs(scr, L, lw, h, b.x, T, seg, nseg, &rope, NULL, sel_n, 0, &b, err);
    if (!rc) {
        for (int r = 0; r < T; r++) op_rmsnorm(b.x + (size_t)r * H, h + (size_t)r * H, lw->post_attention_layernorm, H, c->rms_norm_eps);
        rc = moe_forward(scr, L, lw, -1, b.x, T, m.idx, m.wts, NULL, NULL, b.y, err);
    }
    for (int g = 0; g < nseg; g++) {
        seg[g].s->len = len[g];
        if (!rc) {
            seg[g].s->mtp_len += seg[g].n;
            rc = kv_seq_mtp_advance(seg[g].s->kv, seg[g].n, err);
        }
    }
    if (rc) {
        scr->row_lora = NULL;
        return rc;
    }
    for (int i = 0; i < T * H; i++) h[i] += b.y[i];
    if (hout) memcpy(hout, h, sizeof(float) * (size_t)T * H); /* the layer's output before shared_head.norm: a chained draft's hidden */
    if (!lrows) nlog = T;
    for (int i = 0; i < nlog; i++) /* the rows that want logits, in order (lrows ascending; NULL: all) */
        op_rmsnorm(b.x + (size_t)i * H, h + (size_t)(lrows ? lrows[i] : i) * H, w->shared_head_norm, H, c->rms_norm_eps);
    if (logits && nlog > 0) kt_matmul(&e->kt, &w->lm_head, b.x, nlog, logits);
    for (int i = 0; logits && i < nlog && scr->row_lora; i++)
        lora_add(&e->kt, scr->row_lora[lrows ? lrows[i] : i], 0, LT_HEAD, -1, b.x + (size_t)i * H, H, 1, logits + (size_t)i * c->vocab_size,
                 c->vocab_size, 0, c->vocab_size);
    scr->row_lora = NULL;
    return 0;
}

int fwd_batch(petrel_session *s, const int32_t *ids, int T, float *logits, int logits_from, petrel_error *err) {
    fwd_seg one = {s, 0, T};
    return fwd_rows(s, &one, 1, ids, T, logits && logits_from < T ? logits : NULL, NULL, T - logits_from, err);
}

void petrel_session_set_progress(petrel_session *s, petrel_progress_fn fn, void *user) {
    s->progress = fn;
    s->progress_user = user;
}

int petrel_session_forward(petrel_session *s, const int32_t *ids, int n, float *logits, int all_logits, petrel_error *err) {
    return session_forward_h(s, ids, n, logits, all_logits, NULL, NULL, NULL, err);
}

int session_span_rows(const petrel_session *s) {
    /* on the GPU a prompt goes in the GPU's chunks (up to 2048 rows: each chunk reads the routed
     * experts it uses once), not the CPU's batch */
    int g = s->eng->cu ? cu_model_chunk_rows(s->eng->cu) : 0;
    if (g > s->cap) g = s->cap; /* callers size buffers by this */
    if (g > s->max_batch) return g;
    return s->pf.rows > s->max_batch && !s->trace && !s->eng->trace ? s->pf.rows : s->max_batch;
}

int session_forward_h(petrel_session *s, const int32_t *ids, int n, float *logits, int all_logits, float *hidden,
                      int (*fn)(void *user, const float *hidden, int done, int T, petrel_error *err), void *user, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "empty prompt: nothing to run");
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size)
            return pt_err(err, PETREL_EINVAL, "token id %d at position %d is out of range (vocab_size %d)", ids[i], i, c->vocab_size);
    if (s->len + n > s->cap)
        return pt_err(err, PETREL_ERANGE, "context full: %d cached + %d new tokens exceed the session's %d", s->len, n, s->cap);
    if (s->trace && n > s->max_batch) return pt_err(err, PETREL_EINVAL, "traced forward must fit one batch");
    if (s->eng->no_indexer && s->len + n > c->index_topk)
        return pt_err(err, PETREL_EUNSUPPORTED,
                      "a context of %d tokens needs the DSA indexer, but this model (%s) lacks its weights (a colibri artifact without "
                      "out-idx-*.safetensors shards): only contexts up to index_topk = %d tokens are exact",
                      s->len + n, s->eng->path, c->index_topk);
    int start = s->len;
    /* streaming prefill longer than a chunk: layer-major spans of up to pf.rows rows (not while
     * recording a trace, which follows the chunks) */
    int span = session_span_rows(s);
    s->pg_total = (long long)n * c->num_hidden_layers;
    s->pg_done = 0;
    for (int done = 0; done < n;) {
        int T = n - done < span ? n - done : span;
        int last = done + T == n;
        float *lg = NULL;
        int from = T;
        if (logits && all_logits) { lg = logits + (size_t)done * c->vocab_size; from = 0; }
        else if (logits && last) { lg = logits; from = T - 1; }
        fwd_seg one = {s, 0, T};
        int rc = fwd_rows_h(s, &one, 1, ids + done, T, lg && from < T ? lg : NULL, NULL, T - from, hidden, err);
        if (rc == 0 && fn) rc = fn(user, hidden, done, T, err);
        if (rc < 0) {
            s->len = start;
            return rc;
        }
        done += T;
        s->pg_done = (long long)done * c->num_hidden_layers;
        if (s->progress && n > 1) s->progress(s->progress_user, s->pg_done, s->pg_total);
    }
    return 0;
}
