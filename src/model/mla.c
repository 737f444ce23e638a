/* mla.c: Multi-head Latent Attention over the latent cache, in two forms that agree in exact
 * arithmetic (tests hold them to each other):
 *   absorbed       q~ = W_UK^T q_nope (kv_lora_rank wide); scores = q~ . c_t + q_pe . k_pe_t over
 *                  the row's selected keys; lat = P C; o = W_UV lat. THE form: every row runs it,
 *                  alone or in any window, so a row's result never depends on the batch (row
 *                  independence, bitwise). Rows whose selection is a prefix 0..n-1 (every causal
 *                  key: prompts up to index_topk) share their products per head in blocks of
 *                  rows (abp_head): each element is computed by the same kernel arithmetic as
 *                  the one-row path (kn_attn_core: every score and latent element one fma chain
 *                  in a fixed order whatever the query count; the zeros padding shorter rows add
 *                  exactly nothing), so the blocked and the one-row results are bitwise equal
 *                  (tests/test_rows.c).
 *   reconstructed  per head, expand K = [W_UK c | k_pe] and V^T = W_UV C^T for the window's keys,
 *                  then S = Q K^T, masked softmax, O = S V. The slower twin for tests
 *                  (MLA_RECONSTRUCTED); differs from absorbed by float rounding (~1e-6).
 * Both attend over each row's selected keys (sel, ascending; sel NULL: every causal key, the
 * MTP layer's dense attention), scale 1/sqrt(qk_head_dim). The absorbed form's cache products
 * (scores, softmax, P C) are one kn_attn_core call (exact f32, threaded, keys as row pointers
 * into the cache); the head products W_UK^T q / W_UV lat go through kn_matmul_t / kn_matmul, and
 * the reconstructed twin's products through kn_matmul with f32 views of cache buffers. Input q is [T][NH][nope + rope] with RoPE applied; the current rows' c / k_pe are
 * already in the cache. Output: [T][NH * v_head_dim]. */
#include <math.h>
#include <string.h>

#include "base/err.h"
#include "base/pool.h"
#include "kernels/kernels.h"
#include "kv/kv.h"
#include "model/engine.h"
#include "model/lora.h"
#include "model/scratch.h"

static pt_wview f32_view(const float *data, int64_t rows, int64_t cols) {
    pt_wview v;
    memset(&v, 0, sizeof v);
    v.qtype = PT_F32;
    v.rows = rows;
    v.cols = cols;
    v.data = (const uint8_t *)data;
    v.row_bytes = cols * 4;
    return v;
}

/* The form is never chosen by the batch: absorbed unless a test forces the reconstructed twin. */
static int use_absorbed(const petrel_session *s) { return s->mla != MLA_RECONSTRUCTED; }

/* ---- absorbed ---- */

typedef struct {
    const kn_table *tb;   /* the engine's kernels */
    const layer_w *lw;
    const float *q;       /* [NH][Dqk] of one row */
    float *qt;            /* [NH][Rkv] out */
    int Dqk, Rkv;
    const lora_set *ls;   /* LoRA on kv_b_proj (NULL: none) of layer l; Dn, Dv the head's parts */
    int l, Dn, Dv;
} uk_job;

/* q~[h] = W_UK[h]^T q_nope[h]: the transposed product, one pass over the head's rows. */
static void uk_task(void *ctx, int h, int thread) {
    (void)thread;
    const uk_job *j = ctx;
    kt_matmul_t(j->tb, &j->lw->w_uk[h], j->q + (size_t)h * j->Dqk, 1, j->qt + (size_t)h * j->Rkv);
    if (j->ls)
        lora_add_t(j->tb, j->ls, j->l, LT_KV_B, j->q + (size_t)h * j->Dqk, j->Dqk, 1, j->qt + (size_t)h * j->Rkv, j->Rkv, h * (j->Dn + j->Dv), j->Dn);
}

typedef struct {
    const kn_table *tb;   /* the engine's kernels */
    const layer_w *lw;
    const float *lat;     /* [NH][Rkv] */
    float *out;           /* [NH][Dv] */
    int Rkv, Dv;
    const lora_set *ls;
    int l, Dn;
} uv_job;

static void uv_task(void *ctx, int h, int thread) {
    (void)thread;
    const uv_job *j = ctx;
    kt_matmul(j->tb, &j->lw->w_uv[h], j->lat + (size_t)h * j->Rkv, 1, j->out + (size_t)h * j->Dv);
    if (j->ls)
        lora_add(j->tb, j->ls, j->l, LT_KV_B, -1, j->lat + (size_t)h * j->Rkv, j->Rkv, 1, j->out + (size_t)h * j->Dv, j->Dv, h * (j->Dn + j->Dv) + j->Dn,
                 j->Dv);
}

/* ---- absorbed, blocked over rows with a prefix selection ---- */

#define ABP_ROWS 64 /* rows per block: scores [ABP_ROWS][keys] per head stay in L2 */

typedef struct {
    const kn_table *tb;   /* the engine's kernels */
    const layer_w *lw;
    const float *q;            /* [T][NH][Dqk] */
    const int32_t *rows;       /* the rows run here (ascending) */
    const int *sel_n;          /* keys of row r: 0 .. sel_n[r]-1 */
    const float *const *kc, *const *kp; /* row pointers of the keys 0 .. nmax-1 */
    int m, NH, Dn, Dr, Dv, Dqk, Rkv, nmax;
    float scale;
    float *out;                /* [T][NH][Dv] */
    float *scr;                /* per thread: abp_floats() floats */
    size_t per;
    const lora_set *ls;        /* LoRA on kv_b_proj of layer l, or NULL */
    int l;
} abp_job;

static size_t abp_floats(int nmax, int Dn, int Dr, int Dv, int Rkv) {
#define A16(x) (((size_t)(x) + 15) / 16 * 16)
    return A16((size_t)ABP_ROWS * Dn) + 2 * A16((size_t)ABP_ROWS * Rkv) + A16((size_t)ABP_ROWS * Dr) +
           A16(kn_attn_scratch_floats(ABP_ROWS, nmax, Rkv, Dr)) + A16((size_t)ABP_ROWS * Dv);
}

/* Head h over the job's rows, ABP_ROWS at a time. Per row the arithmetic is the one-row path's:
 * q~ = W_UK^T q_nope (kn_matmul_t, rows independent), the attention core over the keys
 * 0..Nc-1 of the block with the row's own n (kn_attn_core: every element one chain in a fixed
 * order, lat's chain past n adds p = 0 exactly), o = W_UV lat. */
static void abp_head(const abp_job *j, int h, float *scr) {
    const int Dn = j->Dn, Dr = j->Dr, Dv = j->Dv, Dqk = j->Dqk, Rkv = j->Rkv, NH = j->NH;
    float *qn = scr, *qt = qn + A16((size_t)ABP_ROWS * Dn), *qp = qt + A16((size_t)ABP_ROWS * Rkv);
    float *ascr = qp + A16((size_t)ABP_ROWS * Dr);
    float *lat = ascr + A16(kn_attn_scratch_floats(ABP_ROWS, j->nmax, Rkv, Dr)), *oh = lat + A16((size_t)ABP_ROWS * Rkv);
    int nk[ABP_ROWS];
#undef A16
    for (int b0 = 0; b0 < j->m; b0 += ABP_ROWS) {
        int nb = j->m - b0 < ABP_ROWS ? j->m - b0 : ABP_ROWS, Nc = 0;
        for (int i = 0; i < nb; i++) {
            int r = j->rows[b0 + i];
            const float *qr = j->q + ((size_t)r * NH + h) * Dqk;
            memcpy(qn + (size_t)i * Dn, qr, sizeof(float) * (size_t)Dn);
            memcpy(qp + (size_t)i * Dr, qr + Dn, sizeof(float) * (size_t)Dr);
            nk[i] = j->sel_n[r];
            if (nk[i] > Nc) Nc = nk[i];
        }
        kt_matmul_t(j->tb, &j->lw->w_uk[h], qn, nb, qt); /* q~ [nb][Rkv] */
        if (j->ls) lora_add_t(j->tb, j->ls, j->l, LT_KV_B, qn, Dn, nb, qt, Rkv, h * (Dn + Dv), Dn);
        kn_attn a = {nb, Rkv, Dr, Nc, qt, Rkv, qp, Dr, j->kc, j->kp, nk, j->scale, lat, Rkv};
        kt_attn_core(j->tb, &a, ascr);                       /* lat [nb][Rkv] */
        kt_matmul(j->tb, &j->lw->w_uv[h], lat, nb, oh);      /* o [nb][Dv] */
        if (j->ls) lora_add(j->tb, j->ls, j->l, LT_KV_B, -1, lat, Rkv, nb, oh, Dv, h * (Dn + Dv) + Dn, Dv);
        for (int i = 0; i < nb; i++)
            memcpy(j->out + ((size_t)j->rows[b0 + i] * NH + h) * Dv, oh + (size_t)i * Dv, sizeof(float) * (size_t)Dv);
    }
}

/* One head per task; its products run single-threaded inside (a nested pool_run is inline). */
static void abp_task(void *ctx, int h, int thread) {
    const abp_job *j = ctx;
    abp_head(j, h, j->scr + (size_t)thread * j->per);
}

/* ---- scratch: each path's buffers carved by one function, which mla_scratch_bytes runs on a
 * sizing arena (src/model/scratch.h), so the plan cannot drift from the allocations ---- */

typedef struct {
    const float **kc, **kp;   /* [n] key row pointers */
    float *cb, *pb;           /* [n][Rkv], [n][Dr] decoded keys (dec: bf16 / int8 pages) */
    float *scr;               /* the attention core's scratch */
} keys_scr;
static int keys_carve(arena *a, const petrel_config *c, int M, int n, int dec, int core, keys_scr *k) {
    size_t nn = (size_t)(n > 0 ? n : 1);
    k->cb = k->pb = k->scr = NULL;
    int ok = (k->kc = ar_alloc(a, sizeof(float *) * nn)) && (k->kp = ar_alloc(a, sizeof(float *) * nn));
    if (ok && dec) ok = (k->cb = ar_alloc(a, sizeof(float) * nn * c->kv_lora_rank)) && (k->pb = ar_alloc(a, sizeof(float) * nn * c->qk_rope_head_dim));
    if (ok && core) ok = (k->scr = ar_alloc(a, sizeof(float) * kn_attn_scratch_floats(M, n, c->kv_lora_rank, c->qk_rope_head_dim))) != NULL;
    return ok ? 0 : -1;
}

/* the blocked prefix: the keys 0..pmax-1 and every thread's head buffers */
static int block_carve(arena *a, const petrel_config *c, int pmax, int dec, int nt, keys_scr *k, float **hs) {
    size_t per = abp_floats(pmax, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim, c->kv_lora_rank);
    return !keys_carve(a, c, 0, pmax, dec, 0, k) && (*hs = ar_alloc(a, sizeof(float) * per * (size_t)nt)) ? 0 : -1;
}

/* the one-row path: q~ and lat of a row */
static int one_carve(arena *a, const petrel_config *c, float **qt, float **lat) {
    size_t f = sizeof(float) * (size_t)c->num_attention_heads * c->kv_lora_rank;
    return (*qt = ar_alloc(a, f)) && (*lat = ar_alloc(a, f)) ? 0 : -1;
}

/* decode rows of several sessions: their q~, lat and per-thread head buffers */
static int rows_carve_mla(arena *a, const petrel_config *c, int m, int nt, float **QT, float **LAT, float **scr) {
    size_t f = sizeof(float) * (size_t)m * c->num_attention_heads * c->kv_lora_rank;
    return (*QT = ar_alloc(a, f)) && (*LAT = ar_alloc(a, f)) &&
                   (*scr = ar_alloc(a, sizeof(float) * (size_t)m * (c->qk_nope_head_dim + c->kv_lora_rank + c->v_head_dim) * (size_t)nt))
               ? 0
               : -1;
}

/* ---- absorbed, one row at a time (rows with a DSA selection, or alone) ---- */

/* The part of one row between its two head products: given q~ (qt [NH][Rkv]) and the row's
 * q_pe (in qr), the attention core over its selected keys of session s's cache (row pointers
 * into the cache, no gather): lat[h] = sum_i p[h][i] c_i. Scratch from s's arena (released on
 * return). */
static int row_core(petrel_session *s, int l, const float *qr, const float *qt, const int32_t *sr, int n, float *lat, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    int NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Rkv = c->kv_lora_rank, Dqk = c->qk_head_dim;
    const float scale = (float)(1.0 / sqrt((double)Dqk));
    size_t mark = s->ar.used;
    keys_scr k; /* bf16 / int8 pages: the selected rows decoded; f32: pointers into the pages */
    if (keys_carve(&s->ar, c, NH, n, !kv_is_f32(s->kv), 1, &k)) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
    PT_TRY(kv_rows(s->kv, l, sr, n, k.kc, k.kp, k.cb, k.pb, err)); /* sr NULL: dense, keys 0..n-1 */
    kn_attn a = {NH, Rkv, Dr, n, qt, Rkv, qr + Dn, Dqk, k.kc, k.kp, NULL, scale, lat, Rkv};
    kt_attn_core(&s->eng->kt, &a, k.scr);
    s->ar.used = mark;
    return 0;
}

static int absorbed(petrel_session *s, int l, const layer_w *lw, const float *q, int T, const int32_t *sel, const int *sel_n,
                    int sel_stride, float *out, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    const kn_table *tb = &s->eng->kt;
    int NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    int Rkv = c->kv_lora_rank, Dqk = c->qk_head_dim;
    const float scale = (float)(1.0 / sqrt((double)Dqk));
    const lora_set *ls = lora_set_has(&s->lora, l, LT_KV_B) ? &s->lora : NULL;
    /* rows whose selection is the prefix 0..n-1 (sorted, distinct: the last is n-1) go blocked
     * when there are several of them; the others one by one */
    int32_t *rows = ar_alloc(&s->ar, sizeof(int32_t) * (size_t)T);
    if (!rows) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
    int m = 0, pmax = 0;
    for (int r = 0; r < T; r++) {
        int n = sel_n[r];
        if (n > 0 && (!sel || sel[(size_t)r * sel_stride + n - 1] == n - 1)) {
            rows[m++] = r;
            if (n > pmax) pmax = n;
        }
    }
    if (m > 1) {
        keys_scr k;
        float *hs = NULL;
        size_t per = abp_floats(pmax, Dn, Dr, Dv, Rkv);
        if (block_carve(&s->ar, c, pmax, !kv_is_f32(s->kv), pool_threads(kn_pool()), &k, &hs))
            return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
        PT_TRY(kv_rows(s->kv, l, NULL, pmax, k.kc, k.kp, k.cb, k.pb, err)); /* keys 0..pmax-1 of the rows */
        abp_job j = {tb, lw, q, rows, sel_n, k.kc, k.kp, m, NH, Dn, Dr, Dv, Dqk, Rkv, pmax, scale, out, hs, per, ls, l};
        pool_run(kn_pool(), NH, abp_task, &j);
    }
    if (m > 1 && m == T) return 0;
    if (T == 1) { /* one row: its head products over the heads in parallel */
        float *qt, *lat;
        if (one_carve(&s->ar, c, &qt, &lat)) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
        uk_job uj = {tb, lw, q, qt, Dqk, Rkv, ls, l, Dn, Dv};
        pool_run(kn_pool(), NH, uk_task, &uj);
        PT_TRY(row_core(s, l, q, qt, sel, sel_n[0], lat, err));
        uv_job vj = {tb, lw, lat, out, Rkv, Dv, ls, l, Dn};
        pool_run(kn_pool(), NH, uv_task, &vj);
        return 0;
    }
    /* the other rows (their own DSA selections) FWD_ROWS_GROUP at a time: each head's W_UK / W_UV
     * read once for the group, the attention core row by row (bitwise the one-row path) */
    petrel_session *gs[FWD_ROWS_GROUP];
    int32_t gr[FWD_ROWS_GROUP];
    int ng = 0;
    for (int r = 0, k = 0; r < T; r++) {
        if (m > 1 && k < m && rows[k] == r) { k++; continue; } /* done above */
        gs[ng] = s, gr[ng++] = r;
        if (ng == FWD_ROWS_GROUP) {
            PT_TRY(mla_attention_rows(s, l, lw, gs, gr, ng, q, sel, sel_n, sel_stride, out, err));
            ng = 0;
        }
    }
    if (ng) PT_TRY(mla_attention_rows(s, l, lw, gs, gr, ng, q, sel, sel_n, sel_stride, out, err));
    return 0;
}

/* ---- absorbed, one row each of several sessions (a batch's decode rows) ----
 * W_UK^T q and W_UV lat run per head over all the rows at once (each head's weights read once
 * for them, rows independent in kn_matmul_t / kn_matmul), the scores over each row's own
 * session's keys in between (row_core, that session's arena): bitwise the one-row path. */

typedef struct {
    const kn_table *tb;   /* the engine's kernels */
    const layer_w *lw;
    const float *q;           /* [T][NH][Dqk] of the batch */
    const int32_t *rows;      /* the m rows */
    int m, NH, Dn, Dqk, Dv, Rkv;
    float *QT, *LAT;          /* [m][NH][Rkv] */
    float *out;               /* [T][NH][Dv] */
    float *scr;               /* per thread: m * (Dn + Rkv + Dv) floats */
    petrel_session *const *sess; /* row i's session (its LoRA set); l the layer */
    int l, lora;              /* lora: some row's set adapts kv_b_proj */
} abr_job;

static void abr_uk_task(void *ctx, int h, int thread) {
    const abr_job *j = ctx;
    float *qn = j->scr + (size_t)thread * j->m * (j->Dn + j->Rkv + j->Dv), *qt = qn + (size_t)j->m * j->Dn;
    for (int i = 0; i < j->m; i++) memcpy(qn + (size_t)i * j->Dn, j->q + ((size_t)j->rows[i] * j->NH + h) * j->Dqk, sizeof(float) * (size_t)j->Dn);
    kt_matmul_t(j->tb, &j->lw->w_uk[h], qn, j->m, qt);
    for (int i = 0; i < j->m && j->lora; i++)
        lora_add_t(j->tb, &j->sess[i]->lora, j->l, LT_KV_B, qn + (size_t)i * j->Dn, j->Dn, 1, qt + (size_t)i * j->Rkv, j->Rkv, h * (j->Dn + j->Dv), j->Dn);
    for (int i = 0; i < j->m; i++) memcpy(j->QT + ((size_t)i * j->NH + h) * j->Rkv, qt + (size_t)i * j->Rkv, sizeof(float) * (size_t)j->Rkv);
}

static void abr_uv_task(void *ctx, int h, int thread) {
    const abr_job *j = ctx;
    float *lt = j->scr + (size_t)thread * j->m * (j->Dn + j->Rkv + j->Dv), *oh = lt + (size_t)j->m * j->Rkv;
    for (int i = 0; i < j->m; i++) memcpy(lt + (size_t)i * j->Rkv, j->LAT + ((size_t)i * j->NH + h) * j->Rkv, sizeof(float) * (size_t)j->Rkv);
    kt_matmul(j->tb, &j->lw->w_uv[h], lt, j->m, oh);
    for (int i = 0; i < j->m && j->lora; i++)
        lora_add(j->tb, &j->sess[i]->lora, j->l, LT_KV_B, -1, lt + (size_t)i * j->Rkv, j->Rkv, 1, oh + (size_t)i * j->Dv, j->Dv,
                 h * (j->Dn + j->Dv) + j->Dn, j->Dv);
    for (int i = 0; i < j->m; i++) memcpy(j->out + ((size_t)j->rows[i] * j->NH + h) * j->Dv, oh + (size_t)i * j->Dv, sizeof(float) * (size_t)j->Dv);
}

int mla_attention_rows(petrel_session *scr, int l, const layer_w *lw, petrel_session *const *sess, const int32_t *rows, int m,
                       const float *q, const int32_t *sel, const int *sel_n, int sel_stride, float *out, petrel_error *err) {
    const petrel_config *c = &scr->eng->cfg;
    const kn_table *tb = &scr->eng->kt;
    int NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dv = c->v_head_dim, Rkv = c->kv_lora_rank, Dqk = c->qk_head_dim;
    size_t mark = scr->ar.used;
    int nt = pool_threads(kn_pool());
    abr_job j = {tb, lw, q, rows, m, NH, Dn, Dqk, Dv, Rkv, NULL, NULL, out, NULL, sess, l, 0};
    for (int i = 0; i < m && !j.lora; i++) j.lora = lora_set_has(&sess[i]->lora, l, LT_KV_B);
    if (rows_carve_mla(&scr->ar, c, m, nt, &j.QT, &j.LAT, &j.scr)) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
    pool_run(kn_pool(), NH, abr_uk_task, &j);
    /* the attention cores: rows of distinct sessions together (kt_attn_core_many: one dispatch
     * per phase for all of them, each row's scratch in its own session's arena); a session's
     * second row starts a new group, so no arena holds two rows' keys at once */
    const float scale = (float)(1.0 / sqrt((double)Dqk));
    kn_attn a[FWD_ROWS_GROUP];
    float *ascr[FWD_ROWS_GROUP];
    size_t smark[FWD_ROWS_GROUP];
    int Dr = c->qk_rope_head_dim;
    for (int i0 = 0; i0 < m;) {
        int g = 0, rc = 0;
        for (; i0 + g < m && g < FWD_ROWS_GROUP && !rc; g++) {
            int i = i0 + g, dup = 0;
            for (int k = i0; k < i && !dup; k++) dup = sess[k] == sess[i];
            if (dup) break;
            petrel_session *s = sess[i];
            const int32_t *sr = sel ? sel + (size_t)rows[i] * sel_stride : NULL;
            int n = sel_n[rows[i]];
            const float *qr = q + (size_t)rows[i] * NH * Dqk;
            keys_scr k;
            smark[g] = s->ar.used;
            if (keys_carve(&s->ar, c, NH, n, !kv_is_f32(s->kv), 1, &k)) rc = pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
            else rc = kv_rows(s->kv, l, sr, n, k.kc, k.kp, k.cb, k.pb, err); /* sr NULL: dense, keys 0..n-1 */
            a[g] = (kn_attn){NH, Rkv, Dr, n, j.QT + (size_t)i * NH * Rkv, Rkv, qr + Dn, Dqk, k.kc, k.kp, NULL, scale, j.LAT + (size_t)i * NH * Rkv, Rkv};
            ascr[g] = k.scr;
        }
        if (!rc) kt_attn_core_many(tb, a, g, ascr);
        for (int k = g - 1; k >= 0; k--) sess[i0 + k]->ar.used = smark[k];
        if (rc) return rc;
        i0 += g;
    }
    pool_run(kn_pool(), NH, abr_uv_task, &j);
    scr->ar.used = mark;
    return 0;
}

size_t mla_rows_scratch_bytes(const petrel_config *c, int m) {
    arena a = ar_sizing();
    float *QT, *LAT, *scr;
    rows_carve_mla(&a, c, m, pool_threads(kn_pool()), &QT, &LAT, &scr);
    return a.used;
}

/* ---- reconstructed ---- */

typedef struct {
    const kn_table *tb;   /* the engine's kernels */
    const layer_w *lw;
    const float *q, *C, *PE;   /* q [T][NH][Dqk]; the layer's latent cache and rope keys */
    const int32_t *sel;
    const int *sel_n;
    int sel_stride, T, P, N, NH, Dn, Dr, Dv, Dqk;
    float scale;
    float *out;                /* [T][NH][Dv] */
    float *scr;                /* per thread: rec_floats() floats */
    size_t per;
    const lora_set *ls;        /* LoRA on kv_b_proj of layer l, or NULL */
    int l, Rkv;
} rec_job;

/* Scratch of one head, in floats, each piece 64-byte aligned. */
static size_t rec_floats(int T, int N, int Dn, int Dqk, int Dv) {
#define A16(x) (((size_t)(x) + 15) / 16 * 16)
    return A16((size_t)N * Dn) + A16((size_t)N * Dqk) + 2 * A16((size_t)Dv * N) + A16((size_t)T * Dqk) + A16((size_t)T * N) +
           A16((size_t)T * Dv) + A16(N / 4 + 1);
}

static void rec_head(const rec_job *j, int h, float *scr) {
    const int T = j->T, P = j->P, N = j->N, Dn = j->Dn, Dr = j->Dr, Dv = j->Dv, Dqk = j->Dqk, NH = j->NH;
    float *kn = scr, *kh = kn + A16((size_t)N * Dn), *vt = kh + A16((size_t)N * Dqk), *vn = vt + A16((size_t)Dv * N);
    float *qh = vn + A16((size_t)Dv * N), *S = qh + A16((size_t)T * Dqk), *oh = S + A16((size_t)T * N);
    uint8_t *keep = (uint8_t *)(oh + A16((size_t)T * Dv));
#undef A16
    kt_matmul(j->tb, &j->lw->w_uk[h], j->C, N, kn); /* k_nope [N][Dn] */
    if (j->ls) lora_add(j->tb, j->ls, j->l, LT_KV_B, -1, j->C, j->Rkv, N, kn, Dn, h * (Dn + Dv), Dn);
    for (int t = 0; t < N; t++) {
        memcpy(kh + (size_t)t * Dqk, kn + (size_t)t * Dn, sizeof(float) * (size_t)Dn);
        memcpy(kh + (size_t)t * Dqk + Dn, j->PE + (size_t)t * Dr, sizeof(float) * (size_t)Dr);
    }
    kt_matmul(j->tb, &j->lw->w_uv[h], j->C, N, vn); /* V [N][Dv] = C W_UV^T, the same product as decode's */
    if (j->ls) lora_add(j->tb, j->ls, j->l, LT_KV_B, -1, j->C, j->Rkv, N, vn, Dv, h * (Dn + Dv) + Dn, Dv);
    for (int t0 = 0; t0 < N; t0 += 16) /* V^T [Dv][N], in 16 x 16 tiles */
        for (int d0 = 0; d0 < Dv; d0 += 16)
            for (int t = t0; t < t0 + 16 && t < N; t++)
                for (int d = d0; d < d0 + 16 && d < Dv; d++) vt[(size_t)d * N + t] = vn[(size_t)t * Dv + d];
    for (int r = 0; r < T; r++) memcpy(qh + (size_t)r * Dqk, j->q + ((size_t)r * NH + h) * Dqk, sizeof(float) * (size_t)Dqk);
    /* Causal: rows [r0, r1) see keys < P + r1 at most, so S and O run over that prefix (rounded
     * up to 16 keys; the rest of a row would only be masked). */
    for (int r0 = 0; r0 < T; r0 += 64) {
        int r1 = r0 + 64 < T ? r0 + 64 : T, Nc = (P + r1 + 15) / 16 * 16;
        if (Nc > N) Nc = N;
        float *Sc = S + (size_t)r0 * N; /* [r1 - r0][Nc] */
        pt_wview vk = f32_view(kh, Nc, Dqk);
        kt_matmul(j->tb, &vk, qh + (size_t)r0 * Dqk, r1 - r0, Sc);
        for (int r = r0; r < r1; r++) {
            float *row = Sc + (size_t)(r - r0) * Nc;
            const int32_t *sr = j->sel ? j->sel + (size_t)r * j->sel_stride : NULL;
            int n = j->sel_n[r];
            if (n == P + r + 1) { /* every causal key */
                for (int t = 0; t < n; t++) row[t] *= j->scale;
                for (int t = n; t < Nc; t++) row[t] = -INFINITY;
            } else {
                memset(keep, 0, (size_t)Nc);
                for (int i = 0; i < n; i++) keep[sr[i]] = 1;
                for (int t = 0; t < Nc; t++) row[t] = keep[t] ? row[t] * j->scale : -INFINITY;
            }
            kt_softmax(j->tb, row, Nc);
        }
        pt_wview vv = f32_view(vt, Dv, Nc);
        vv.row_bytes = (int64_t)N * 4; /* the first Nc keys of each V^T row */
        kt_matmul(j->tb, &vv, Sc, r1 - r0, oh + (size_t)r0 * Dv); /* O [T][Dv] */
    }
    for (int r = 0; r < T; r++) memcpy(j->out + ((size_t)r * NH + h) * Dv, oh + (size_t)r * Dv, sizeof(float) * (size_t)Dv);
}

/* One head per task: its products run single-threaded inside (a nested pool_run is inline),
 * so the pool meets once per layer instead of five times per head. */
static void rec_task(void *ctx, int h, int thread) {
    const rec_job *j = ctx;
    rec_head(j, h, j->scr + (size_t)thread * j->per);
}

/* the twin: the keys contiguous and per-thread head buffers */
static int rec_carve(arena *a, const petrel_config *c, int N, size_t per, int nt, float **C, float **PE, float **hs) {
    return (*C = ar_alloc(a, sizeof(float) * (size_t)N * c->kv_lora_rank)) && (*PE = ar_alloc(a, sizeof(float) * (size_t)N * c->qk_rope_head_dim)) &&
                   (*hs = ar_alloc(a, sizeof(float) * per * (size_t)nt))
               ? 0
               : -1;
}

static int reconstructed(petrel_session *s, int l, const layer_w *lw, const float *q, int T, const int32_t *sel, const int *sel_n,
                         int sel_stride, float *out, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    const kn_table *tb = &s->eng->kt;
    int N = s->len + T;
    float *C, *PE, *hs;
    size_t per = rec_floats(T, N, c->qk_nope_head_dim, c->qk_head_dim, c->v_head_dim);
    int nt = pool_threads(kn_pool());
    if (rec_carve(&s->ar, c, N, per, nt, &C, &PE, &hs)) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
    PT_TRY(kv_decode(s->kv, l, 0, N, C, PE, NULL, err)); /* the twin reads the keys contiguous */
    rec_job j = {tb, lw, q, C, PE, sel, sel_n, sel_stride, T, s->len, s->len + T, c->num_attention_heads,
                 c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim, c->qk_head_dim,
                 (float)(1.0 / sqrt((double)c->qk_head_dim)), out, NULL, 0, NULL, 0, 0};
    j.per = per;
    j.scr = hs;
    j.ls = lora_set_has(&s->lora, l, LT_KV_B) ? &s->lora : NULL;
    j.l = l;
    j.Rkv = c->kv_lora_rank;
    if (nt > 1) pool_run(kn_pool(), j.NH, rec_task, &j);
    else
        for (int h = 0; h < j.NH; h++) rec_head(&j, h, j.scr); /* one head at a time, each product threaded */
    return 0;
}

size_t mla_scratch_bytes(const petrel_config *c, int T, int N) {
    int nt = pool_threads(kn_pool()), NH = c->num_attention_heads;
    /* absorbed: the rows list, the blocked prefix's keys and head buffers, then a row's q~ /
     * lat and its keys (decoded: the larger case) with the core's scratch */
    arena a = ar_sizing();
    int32_t *rows = ar_alloc(&a, sizeof(int32_t) * (size_t)T); /* absorbed()'s rows list */
    (void)rows;
    keys_scr k;
    float *hs;
    block_carve(&a, c, N, 1, nt, &k, &hs);
    size_t after_block = a.used;
    float *qt, *lat; /* one row alone */
    one_carve(&a, c, &qt, &lat);
    keys_carve(&a, c, NH, N, 1, 1, &k);
    size_t abs_ = a.used;
    a.used = after_block; /* or a group of rows with their own selections */
    float *QT, *LAT, *rs;
    rows_carve_mla(&a, c, T < FWD_ROWS_GROUP ? T : FWD_ROWS_GROUP, nt, &QT, &LAT, &rs);
    keys_carve(&a, c, NH, N, 1, 1, &k);
    if (a.used > abs_) abs_ = a.used;
    /* the reconstructed twin */
    arena b = ar_sizing();
    float *C, *PE;
    rec_carve(&b, c, N, rec_floats(T, N, c->qk_nope_head_dim, c->qk_head_dim, c->v_head_dim), nt, &C, &PE, &hs);
    return abs_ > b.used ? abs_ : b.used;
}

int mla_attention(petrel_session *s, int l, const layer_w *lw, const float *q, int T, const int32_t *sel, const int *sel_n,
                  int sel_stride, float *out, petrel_error *err) {
    size_t mark = s->ar.used;
    int rc = use_absorbed(s) ? absorbed(s, l, lw, q, T, sel, sel_n, sel_stride, out, err)
                                            : reconstructed(s, l, lw, q, T, sel, sel_n, sel_stride, out, err);
    s->ar.used = mark;
    return rc;
}
