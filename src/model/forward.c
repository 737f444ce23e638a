/* forward.c: engine open/close, sessions, and the layer loop.
 *
 * fwd_batch runs T consecutive positions of one session as one batch of rows:
 *   embed -> for each layer: RMSNorm, MLA (+ DSA selection), residual, RMSNorm, MLP/MoE,
 *   residual -> final norm -> lm_head on the rows that want logits.
 * The cache is written before attention reads it, so row r sees keys 0..P+r. If a call fails,
 * the session's length is left where it was (the rows written past it are ignored). */
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/err.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/ops.h"

void *ar_alloc(arena *a, size_t bytes) {
    size_t off = (a->used + 63) & ~(size_t)63;
    if (off + bytes > a->cap) return NULL;
    a->used = off + bytes;
    return a->base + off;
}

int petrel_engine_open(const char *path, const petrel_open_opts *opts, petrel_engine **out, petrel_error *err) {
    *out = NULL;
    if (!path || !*path) return pt_err(err, PETREL_EINVAL, "no model path given");
    struct stat st;
    if (stat(path, &st) < 0) return pt_err(err, PETREL_EIO, "cannot open model %s: no such file or folder", path);
    petrel_engine *e = calloc(1, sizeof *e);
    if (!e) return pt_err(err, PETREL_ENOMEM, "out of memory");
    snprintf(e->path, sizeof e->path, "%s", path);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    if (!S_ISDIR(st.st_mode)) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", path);
        snprintf(dir, sizeof dir, "%s", dirname(tmp));
    }
    int rc = config_load_dir(dir, &e->cfg, err);
    if (rc == 0) rc = st_open(path, &e->src, err);
    if (rc == 0) {
        wsource ws;
        wsource_safetensors(&ws, &e->st_src, e->src, &e->cfg);
        rc = weights_bind(&e->w, &e->cfg, &ws, err);
        if (rc < 0) pt_err_ctx(err, "%s", path);
    }
    if (rc < 0) {
        petrel_engine_close(e);
        return rc;
    }
    kn_init(opts ? opts->n_threads : 0);
    *out = e;
    return 0;
}

void petrel_engine_close(petrel_engine *e) {
    if (!e) return;
    weights_deinit(&e->w, &e->cfg);
    st_close(e->src);
    config_deinit(&e->cfg);
    free(e);
}

const petrel_config *petrel_engine_config(const petrel_engine *e) { return &e->cfg; }
int petrel_engine_vocab_size(const petrel_engine *e) { return e->cfg.vocab_size; }

/* Scratch bytes for a chunk of T rows with up to N keys: every buffer fwd_batch and the layer
 * pieces take, summed (not overlapped), plus alignment slack. */
static size_t scratch_bytes(const petrel_config *c, size_t T, size_t N) {
    size_t H = c->hidden_size, NH = c->num_attention_heads, Dqk = c->qk_head_dim, Dv = c->v_head_dim;
    size_t Rq = c->q_lora_rank, Rkv = c->kv_lora_rank, Dr = c->qk_rope_head_dim, Dn = c->qk_nope_head_dim;
    size_t Hi = c->index_n_heads, Di = c->index_head_dim, E = c->n_routed_experts, K = c->num_experts_per_tok;
    size_t I = c->moe_intermediate_size * (size_t)(c->n_shared_experts > 1 ? c->n_shared_experts : 1);
    size_t kmax = (size_t)c->index_topk < N ? (size_t)c->index_topk : N;
    size_t f = 0;
    f += 4 * T * H + T * Rq + T * NH * Dqk + T * (Rkv + Dr) + T * NH * Dv + T * Dr + T * kmax + T;
    f += T * Hi * Di + T * Di + T * Hi + 2 * N;                                       /* indexer */
    size_t abs_ = T * Dn + 2 * T * Rkv + Rkv, rec = N * (Dn + Dv);
    f += N + T * Dv + (abs_ > rec ? abs_ : rec);                                      /* attention */
    size_t dense = 2 * T * (size_t)c->intermediate_size;
    size_t moe = T * E + 2 * E + 2 * T * K + 2 * T + 2 * T * H + 2 * T * I;
    f += dense > moe ? dense : moe;                                                   /* MLP */
    f += T * H;                                                                       /* final norm */
    return f * 4 + 64 * 64 + 4096;
}

int petrel_session_create(petrel_engine *e, int max_tokens, petrel_session **out, petrel_error *err) {
    *out = NULL;
    const petrel_config *c = &e->cfg;
    if (max_tokens <= 0) return pt_err(err, PETREL_EINVAL, "session capacity must be at least 1 token (got %d)", max_tokens);
    if (max_tokens > c->max_position_embeddings)
        return pt_err(err, PETREL_ERANGE, "session capacity %d exceeds the model's max_position_embeddings %d", max_tokens, c->max_position_embeddings);
    petrel_session *s = calloc(1, sizeof *s);
    if (!s) return pt_err(err, PETREL_ENOMEM, "out of memory");
    s->eng = e;
    s->cap = max_tokens;
    s->max_batch = max_tokens < 256 ? max_tokens : 256;
    int L = c->num_hidden_layers;
    s->kv_c = calloc((size_t)L, sizeof(float *));
    s->kv_pe = calloc((size_t)L, sizeof(float *));
    s->idx_k = calloc((size_t)L, sizeof(float *));
    int ok = s->kv_c && s->kv_pe && s->idx_k;
    for (int l = 0; ok && l < L; l++) {
        s->kv_c[l] = malloc(sizeof(float) * (size_t)max_tokens * c->kv_lora_rank);
        s->kv_pe[l] = malloc(sizeof(float) * (size_t)max_tokens * c->qk_rope_head_dim);
        ok = s->kv_c[l] && s->kv_pe[l];
        if (ok && c->layer_indexer_full[l]) ok = (s->idx_k[l] = malloc(sizeof(float) * (size_t)max_tokens * c->index_head_dim)) != NULL;
    }
    if (ok) {
        s->ar.cap = scratch_bytes(c, (size_t)s->max_batch, (size_t)max_tokens);
        ok = (s->ar.base = malloc(s->ar.cap)) != NULL;
    }
    if (!ok) {
        petrel_session_free(s);
        return pt_err(err, PETREL_ENOMEM, "out of memory for a session of %d tokens", max_tokens);
    }
    *out = s;
    return 0;
}

void petrel_session_free(petrel_session *s) {
    if (!s) return;
    int L = s->eng->cfg.num_hidden_layers;
    for (int l = 0; l < L; l++) {
        if (s->kv_c) free(s->kv_c[l]);
        if (s->kv_pe) free(s->kv_pe[l]);
        if (s->idx_k) free(s->idx_k[l]);
    }
    free(s->kv_c);
    free(s->kv_pe);
    free(s->idx_k);
    free(s->ar.base);
    free(s);
}

int petrel_session_len(const petrel_session *s) { return s->len; }

int petrel_session_truncate(petrel_session *s, int n_past, petrel_error *err) {
    if (n_past < 0 || n_past > s->len) return pt_err(err, PETREL_EINVAL, "cannot truncate a %d-token session to %d", s->len, n_past);
    s->len = n_past;
    return 0;
}

int fwd_batch(petrel_session *s, const int32_t *ids, int T, float *logits, int logits_from, petrel_error *err) {
    const petrel_engine *e = s->eng;
    const petrel_config *c = &e->cfg;
    const model_w *w = &e->w;
    int H = c->hidden_size, NH = c->num_attention_heads, Dqk = c->qk_head_dim, Dr = c->qk_rope_head_dim;
    int Rq = c->q_lora_rank, Rkv = c->kv_lora_rank, Dv = c->v_head_dim, L = c->num_hidden_layers;
    int P = s->len;
    int kmax = c->index_topk < P + T ? c->index_topk : P + T;
    s->ar.used = 0;
    float *h = ar_alloc(&s->ar, sizeof(float) * (size_t)T * H);
    float *x = ar_alloc(&s->ar, sizeof(float) * (size_t)T * H);
    float *y = ar_alloc(&s->ar, sizeof(float) * (size_t)T * H);
    float *qa = ar_alloc(&s->ar, sizeof(float) * (size_t)T * Rq);
    float *q = ar_alloc(&s->ar, sizeof(float) * (size_t)T * NH * Dqk);
    float *kva = ar_alloc(&s->ar, sizeof(float) * (size_t)T * (Rkv + Dr));
    float *o = ar_alloc(&s->ar, sizeof(float) * (size_t)T * NH * Dv);
    rope_rows rope = {ar_alloc(&s->ar, sizeof(float) * (size_t)T * (Dr / 2)), ar_alloc(&s->ar, sizeof(float) * (size_t)T * (Dr / 2))};
    int32_t *sel = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)T * kmax);
    int *sel_n = ar_alloc(&s->ar, sizeof(int) * (size_t)T);
    if (!h || !x || !y || !qa || !q || !kva || !o || !rope.cos_ || !rope.sin_ || !sel || !sel_n)
        return pt_err(err, PETREL_ENOMEM, "forward scratch exhausted");
    for (int r = 0; r < T; r++) {
        pt_dequant_row(&w->embed_tokens, ids[r], h + (size_t)r * H);
        op_rope_table(c->rope_theta, Dr, P + r, rope.cos_ + (size_t)r * (Dr / 2), rope.sin_ + (size_t)r * (Dr / 2));
    }
    fwd_trace *tr = s->trace;
    if (tr && tr->hidden) memcpy(tr->hidden, h, sizeof(float) * (size_t)T * H);
    for (int l = 0; l < L; l++) {
        const layer_w *lw = &w->layers[l];
        for (int r = 0; r < T; r++) op_rmsnorm(x + (size_t)r * H, h + (size_t)r * H, lw->input_layernorm, H, c->rms_norm_eps);
        kn_matmul(&lw->q_a_proj, x, T, qa);
        for (int r = 0; r < T; r++) op_rmsnorm(qa + (size_t)r * Rq, qa + (size_t)r * Rq, lw->q_a_layernorm, Rq, 1e-6);
        kn_matmul(&lw->q_b_proj, qa, T, q);
        kn_matmul(&lw->kv_a_proj_with_mqa, x, T, kva);
        for (int r = 0; r < T; r++) {
            const float *cs = rope.cos_ + (size_t)r * (Dr / 2), *sn = rope.sin_ + (size_t)r * (Dr / 2);
            for (int hh = 0; hh < NH; hh++) op_rope(q + ((size_t)r * NH + hh) * Dqk + c->qk_nope_head_dim, cs, sn, Dr, c->rope_interleave);
            float *kv = kva + (size_t)r * (Rkv + Dr);
            op_rmsnorm(s->kv_c[l] + (size_t)(P + r) * Rkv, kv, lw->kv_a_layernorm, Rkv, 1e-6);
            float *pe = s->kv_pe[l] + (size_t)(P + r) * Dr;
            memcpy(pe, kv + Rkv, sizeof(float) * (size_t)Dr);
            op_rope(pe, cs, sn, Dr, c->rope_interleave);
        }
        if (c->layer_indexer_full[l]) {
            PT_TRY(dsa_select(s, l, lw, x, qa, T, &rope, sel, sel_n, kmax, err));
            if (tr && tr->topk && tr->topk[l])
                for (int r = 0; r < T; r++)
                    for (int i = 0; i < tr->topk_stride; i++)
                        tr->topk[l][(size_t)r * tr->topk_stride + i] = i < sel_n[r] ? sel[(size_t)r * kmax + i] : -1;
        }
        PT_TRY(mla_attention(s, l, lw, x, qa, q, T, sel, sel_n, kmax, o, err));
        kn_matmul(&lw->o_proj, o, T, y);
        for (int i = 0; i < T * H; i++) h[i] += y[i];
        for (int r = 0; r < T; r++) op_rmsnorm(x + (size_t)r * H, h + (size_t)r * H, lw->post_attention_layernorm, H, c->rms_norm_eps);
        if (lw->is_moe) PT_TRY(moe_forward(s, lw, x, T, y, err));
        else PT_TRY(mlp_dense(s, lw, x, T, y, err));
        for (int i = 0; i < T * H; i++) h[i] += y[i];
        if (tr && tr->hidden && l < L - 1) memcpy(tr->hidden + (size_t)(l + 1) * T * H, h, sizeof(float) * (size_t)T * H);
    }
    for (int r = 0; r < T; r++) op_rmsnorm(x + (size_t)r * H, h + (size_t)r * H, w->norm, H, c->rms_norm_eps);
    if (tr && tr->hidden) memcpy(tr->hidden + (size_t)L * T * H, x, sizeof(float) * (size_t)T * H);
    if (logits && logits_from < T) kn_matmul(&w->lm_head, x + (size_t)logits_from * H, T - logits_from, logits);
    s->len = P + T;
    return 0;
}

int petrel_session_forward(petrel_session *s, const int32_t *ids, int n, float *logits, int all_logits, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "empty prompt: nothing to run");
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size)
            return pt_err(err, PETREL_EINVAL, "token id %d at position %d is out of range (vocab_size %d)", ids[i], i, c->vocab_size);
    if (s->len + n > s->cap)
        return pt_err(err, PETREL_ERANGE, "context full: %d cached + %d new tokens exceed the session's %d", s->len, n, s->cap);
    if (s->trace && n > s->max_batch) return pt_err(err, PETREL_EINVAL, "traced forward must fit one batch");
    int start = s->len;
    for (int done = 0; done < n;) {
        int T = n - done < s->max_batch ? n - done : s->max_batch;
        int last = done + T == n;
        float *lg = NULL;
        int from = T;
        if (logits && all_logits) { lg = logits + (size_t)done * c->vocab_size; from = 0; }
        else if (logits && last) { lg = logits; from = T - 1; }
        int rc = fwd_batch(s, ids + done, T, lg, from, err);
        if (rc < 0) {
            s->len = start;
            return rc;
        }
        done += T;
    }
    return 0;
}
