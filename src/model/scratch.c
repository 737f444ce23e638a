/* scratch.c: the forward's scratch buffers, carved by phase, and the memory plan that sizes the
 * arenas by running the same carves on a sizing arena (scratch.h says which phase is where). */
#include <stdint.h>
#include <string.h>

#include "model/scratch.h"
#include "kernels/kernels.h"
#include "kv/kv.h"

#define SIZING_BASE ((uintptr_t)1 << 12) /* placeholders start here: never NULL */

void *ar_alloc(arena *a, size_t bytes) {
    size_t off = (a->used + 63) & ~(size_t)63;
    if (off + bytes > a->cap || off + bytes < off) return NULL;
    a->used = off + bytes;
    if (!a->base) return (void *)(SIZING_BASE + off); /* a sizing arena: never touched */
    return a->base + off;
}

arena ar_sizing(void) { return (arena){NULL, SIZE_MAX / 2, 0}; }

#define TAKE(p, bytes) ((int)(((p) = ar_alloc(a, (bytes))) != NULL)) /* an int: the carves & them (no short cut) */

int attn_carve(arena *a, const petrel_config *c, int T, attn_bufs *b) {
    size_t t = (size_t)T, H = (size_t)c->hidden_size, NH = (size_t)c->num_attention_heads;
    int ok = TAKE(b->x, 4 * t * H) & TAKE(b->y, 4 * t * H) & TAKE(b->qa, 4 * t * (size_t)c->q_lora_rank) &
             TAKE(b->q, 4 * t * NH * (size_t)c->qk_head_dim) & TAKE(b->kva, 4 * t * (size_t)(c->kv_lora_rank + c->qk_rope_head_dim)) &
             TAKE(b->o, 4 * t * NH * (size_t)c->v_head_dim);
    return ok ? 0 : -1;
}

int rows_carve(arena *a, const petrel_config *c, int T, int kst, rows_scr *r, attn_bufs *b) {
    size_t t = (size_t)T, H = (size_t)c->hidden_size, K = (size_t)c->num_experts_per_tok, Dr2 = (size_t)c->qk_rope_head_dim / 2;
    memset(r, 0, sizeof *r);
    if (attn_carve(a, c, T, b)) return -1;
    r->xm = b->x; /* one chunk: its buffers hold the MoE input and output */
    r->out = b->y;
    r->kst = kst;
    int ok = TAKE(r->h, 4 * t * H) & TAKE(r->rope.cos_, 4 * t * Dr2) & TAKE(r->rope.sin_, 4 * t * Dr2) & TAKE(r->sel, 4 * t * (size_t)kst) &
             TAKE(r->sel_n, 4 * t) & TAKE(r->idx, 4 * t * K) & TAKE(r->rl, 4 * t * K) & TAKE(r->wts, 4 * t * K) & TAKE(r->route_pos, 4 * t);
    return ok ? 0 : -1;
}

size_t pf_carve(uint8_t *base, const petrel_config *c, int M, int kst, rows_scr *r) {
    arena a0 = base ? (arena){base, SIZE_MAX / 2, 0} : ar_sizing(), *a = &a0;
    size_t m = (size_t)M, H = (size_t)c->hidden_size, K = (size_t)c->num_experts_per_tok, Dr2 = (size_t)c->qk_rope_head_dim / 2;
    rows_scr tmp, *p = r ? r : &tmp;
    memset(p, 0, sizeof *p);
    p->kst = kst;
    (void)(TAKE(p->h, 4 * m * H) & TAKE(p->xm, 4 * m * H) & TAKE(p->out, 4 * m * H) & TAKE(p->wts, 4 * m * K) & TAKE(p->rope.cos_, 4 * m * Dr2) &
           TAKE(p->rope.sin_, 4 * m * Dr2) & TAKE(p->idx, 4 * m * K) & TAKE(p->rl, 4 * m * K) & TAKE(p->sel_n, 4 * m) &
           TAKE(p->sel, 4 * m * (size_t)kst) & TAKE(p->route_pos, 4 * m));
    return a0.used;
}

int dsa_carve(arena *a, const petrel_config *c, int T, int N, dsa_scr *d) {
    size_t t = (size_t)T, Hi = (size_t)c->index_n_heads, Di = (size_t)c->index_head_dim;
    int ok = TAKE(d->qi, 4 * t * Hi * Di) & TAKE(d->ki, 4 * t * Di) & TAKE(d->iw, 4 * t * Hi) & TAKE(d->score, 4 * (size_t)N) &
             TAKE(d->tmp, 4 * (size_t)N) &
             TAKE(d->qt, 4 * Di * (size_t)kn_dsa_heads(c->index_n_heads)) & TAKE(d->wp, 4 * (size_t)kn_dsa_heads(c->index_n_heads)) &
             TAKE(d->runs, sizeof(dsa_run) * (size_t)(N > 0 ? N : 1));
    return ok ? 0 : -1;
}

int mlp_carve(arena *a, int T, int64_t I, mlp_scr *m) {
    int ok = TAKE(m->gb, 4 * (size_t)T * (size_t)I) & TAKE(m->ub, 4 * (size_t)T * (size_t)I);
    return ok ? 0 : -1;
}

int la_carve(arena *a, const petrel_config *c, int T, la_scr *l) {
    size_t E = (size_t)c->n_routed_experts;
    int ok = TAKE(l->lg, 4 * (size_t)T * E) & TAKE(l->scratch, 8 * E) & TAKE(l->pids, 4 * E) &
             TAKE(l->ranked, 4 * (size_t)T * (size_t)c->num_experts_per_tok);
    return ok ? 0 : -1;
}

/* Up to all the rows' choices, at most max(C, 64) rows: never fewer than the chunk (a prompt
 * chunk's experts gather as before), and non-decreasing in T, so the plan's largest T bounds it. */
int moe_gather_rows(int T, int C, int K) {
    long tk = (long)T * K, lim = C > 64 ? C : 64;
    return (int)(tk < lim ? tk : lim);
}

int moe_carve(arena *a, const petrel_config *c, int T, int C, int ready, int own_rl, moe_scr *m) {
    size_t E = (size_t)c->n_routed_experts, H = (size_t)c->hidden_size, K = (size_t)c->num_experts_per_tok;
    size_t I = (size_t)c->moe_intermediate_size;
    memset(m, 0, sizeof *m);
    m->cap = T < C ? T : C;
    m->gcap = moe_gather_rows(T, C, (int)K);
    m->wide = m->gcap > 32 ? m->gcap : 32;
    size_t cap = (size_t)m->cap, wide = (size_t)m->wide;
    int ok = TAKE(m->lg, 4 * cap * E) & TAKE(m->scratch, 8 * E) & TAKE(m->start, 4 * (E + 1)) & TAKE(m->pos, 4 * E) & TAKE(m->order, 4 * E) &
             TAKE(m->refs, sizeof(xs_expert_ref) * E) & TAKE(m->chosen, E) & TAKE(m->xs, 4 * (size_t)m->gcap * H) & TAKE(m->ys, 4 * wide * H) &
             TAKE(m->gb, 4 * wide * I) & TAKE(m->ub, 4 * wide * I) & TAKE(m->gset, sizeof(void *) * wide);
    if (ok && own_rl) ok = TAKE(m->rl, 4 * (size_t)T * K);
    if (ok && ready) ok = TAKE(m->yk, 4 * (size_t)T * K * H) & TAKE(m->ysh, 4 * (size_t)T * H);
    return ok ? 0 : -1;
}

int head_carve(arena *a, const petrel_config *c, int n, float **xl) { return TAKE(*xl, 4 * (size_t)n * (size_t)c->hidden_size) ? 0 : -1; }

int mtp_carve(arena *a, const petrel_config *c, int T, int nseg, mtp_scr *m) {
    size_t t = (size_t)T, H = (size_t)c->hidden_size, K = (size_t)c->num_experts_per_tok, Dr2 = (size_t)c->qk_rope_head_dim / 2;
    memset(m, 0, sizeof *m);
    int ok = TAKE(m->h, 4 * t * H) & TAKE(m->cat, 8 * t * H) & (attn_carve(a, c, T, &m->b) == 0) & TAKE(m->rope.cos_, 4 * t * Dr2) &
             TAKE(m->rope.sin_, 4 * t * Dr2) & TAKE(m->sel_n, 4 * t) & TAKE(m->idx, 4 * t * K) & TAKE(m->wts, 4 * t * K) &
             TAKE(m->len, 4 * (size_t)(nseg > 0 ? nseg : 1));
    return ok ? 0 : -1;
}

/* ---- the plan: the same carves on sizing arenas ---- */

static size_t max2(size_t a, size_t b) { return a > b ? a : b; }

/* Bytes above `base` that the MLP phases of T rows (chunk C) take: dense, or the MoE and what
 * runs above its buffers. ready: a streamed batch's order (outputs buffered). */
static size_t mlp_phases(const petrel_config *c, size_t base, int T, int C, int ready) {
    arena a = ar_sizing();
    int cap = T < C ? T : C;
    mlp_scr ms;
    la_scr ls;
    moe_scr mo;
    a.used = base;
    mlp_carve(&a, T, c->intermediate_size, &ms);
    size_t dense = a.used;
    a.used = base;
    la_carve(&a, c, T, &ls);
    size_t la = a.used;
    a.used = base;
    moe_carve(&a, c, T, C, ready, 1, &mo);
    size_t above = a.used, top = above;
    int64_t Ish = (int64_t)c->moe_intermediate_size * (c->n_shared_experts > 1 ? c->n_shared_experts : 1);
    a.used = above;
    mlp_carve(&a, ready ? T : cap, Ish, &ms); /* the shared expert: all rows early, or pieces after */
    top = max2(top, a.used);
    a.used = above;
    mlp_carve(&a, moe_gather_rows(T, C, c->num_experts_per_tok), c->moe_intermediate_size, &ms); /* an expert alone (unequal widths) */
    top = max2(top, a.used);
    a.used = above;
    la_carve(&a, c, T, &ls); /* the next layer's guesses, from inside the run */
    top = max2(top, a.used);
    return max2(max2(dense, la), top) - base;
}

/* What both arenas hold above the rows' state (rows bytes; phase: the largest phase so far):
 * the lookahead guesses, the MLP phases, the head; and the MTP head's own rows with its
 * attention (attn bytes) and MLP phases above them. */
static size_t rest_of_plan(const petrel_config *c, size_t rows, size_t phase, int T, int chunk, size_t attn) {
    arena a = ar_sizing();
    a.used = rows;
    la_scr ls;
    la_carve(&a, c, T, &ls);
    phase = max2(phase, a.used - rows);
    phase = max2(phase, mlp_phases(c, rows, T, chunk, 1));
    a.used = rows;
    float *xl;
    head_carve(&a, c, T, &xl);
    phase = max2(phase, a.used - rows);
    a = ar_sizing();
    mtp_scr m;
    mtp_carve(&a, c, T, T, &m);
    size_t mrows = a.used, mphase = max2(attn, mlp_phases(c, mrows, T, chunk, 1));
    return max2(rows + phase, mrows + mphase) + 4096;
}

size_t plan_session_arena(const petrel_config *c, int chunk, int ctx) {
    int T = chunk < ctx ? chunk : ctx, kst = c->index_topk < ctx ? c->index_topk : ctx;
    if (T < 1) T = 1;
    arena a = ar_sizing();
    rows_scr r;
    attn_bufs b;
    rows_carve(&a, c, T, kst, &r, &b);
    size_t rows = a.used, phase = 0;
    /* attention: a span's chunk buffers, then the indexer or the attention core */
    attn_carve(&a, c, T, &b);
    size_t att = a.used;
    dsa_scr d;
    dsa_carve(&a, c, T, ctx, &d);
    phase = max2(phase, a.used - rows);
    phase = max2(phase, att - rows + mla_scratch_bytes(c, T, ctx) + 64);
    return rest_of_plan(c, rows, phase, T, chunk, mla_scratch_bytes(c, T, ctx) + 64);
}

size_t plan_batch_arena(const petrel_config *c, int max_rows) {
    arena a = ar_sizing();
    rows_scr r;
    attn_bufs b;
    rows_carve(&a, c, max_rows, c->index_topk, &r, &b); /* a row's selection may reach index_topk keys */
    size_t rows = a.used, phase = 0;
    int m = max_rows < FWD_ROWS_GROUP ? max_rows : FWD_ROWS_GROUP;
    phase = max2(phase, mla_rows_scratch_bytes(c, m) + 64); /* decode rows sharing their head products */
    return rest_of_plan(c, rows, phase, max_rows, max_rows, mla_rows_scratch_bytes(c, m) + 64);
}
