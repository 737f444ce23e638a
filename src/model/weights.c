/* weights.c: binds checkpoint tensors to the model's typed views and validates every dtype and
 * shape against the config. Errors name the tensor and say what was expected. */
#include "model/weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "kernels/kernels.h"

const char *const weight_kind_names[WK_COUNT] = {"embed_tokens", "lm_head", "norms", "attention (MLA)", "indexer (DSA)",
                                                 "dense MLP", "router", "routed experts", "shared experts", "MTP layer"};

typedef struct {
    model_w *w;
    const petrel_config *cfg;
    const wsource *src;
    petrel_error *err;
    weight_kind kind;
} binder;

static int keep(model_w *w, void *p, petrel_error *err) {
    if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory binding weights");
    if (w->n_owned == w->cap_owned) {
        int cap = w->cap_owned ? w->cap_owned * 2 : 64;
        void **t = realloc(w->owned, sizeof(void *) * (size_t)cap);
        if (!t) { free(p); return pt_err(err, PETREL_ENOMEM, "out of memory binding weights"); }
        w->owned = t;
        w->cap_owned = cap;
    }
    w->owned[w->n_owned++] = p;
    return 0;
}

static void shape_str(const st_tensor *t, char *buf, size_t n) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->ndim && o < n; i++) o += (size_t)snprintf(buf + o, n - o, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

/* ---- safetensors source ---- */

static int st_matrix(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err) {
    const st_wsource *src = ctx;
    const st_tensor *t = st_find(src->set, name);
    if (!t) return pt_err(err, PETREL_EFORMAT, "missing tensor \"%s\" (expected shape [%lld, %lld])", name, (long long)rows, (long long)cols);
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        char s[128];
        shape_str(t, s, sizeof s);
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has shape %s, expected [%lld, %lld]", name, s, (long long)rows, (long long)cols);
    }
    memset(out, 0, sizeof *out);
    out->rows = rows;
    out->cols = cols;
    out->data = t->data;
    switch (t->dtype) {
    case ST_F32: out->qtype = PT_F32; out->row_bytes = cols * 4; break;
    case ST_BF16: out->qtype = PT_BF16; out->row_bytes = cols * 2; break;
    case ST_F16: out->qtype = PT_F16; out->row_bytes = cols * 2; break;
    case ST_F8_E4M3: {
        int br = src->cfg->fp8_block_rows, bc = src->cfg->fp8_block_cols;
        if (!br) return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" is F8_E4M3 but config.json has no quantization_config.weight_block_size", name);
        char sname[512];
        size_t nl = strlen(name);
        if (nl > 7 && !strcmp(name + nl - 7, ".weight")) snprintf(sname, sizeof sname, "%s_scale_inv", name);
        else snprintf(sname, sizeof sname, "%s.weight_scale_inv", name);
        const st_tensor *s = st_find(src->set, sname);
        int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
        if (!s) return pt_err(err, PETREL_EFORMAT, "missing tensor \"%s\" (FP8 block scales of \"%s\", expected [%lld, %lld])", sname, name, (long long)sr, (long long)sc);
        if (s->ndim != 2 || s->shape[0] != sr || s->shape[1] != sc || (s->dtype != ST_F32 && s->dtype != ST_BF16)) {
            char sh[128];
            shape_str(s, sh, sizeof sh);
            return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" is %s %s, expected F32 [%lld, %lld] for %dx%d blocks", sname,
                          st_dtype_name(s->dtype), sh, (long long)sr, (long long)sc, br, bc);
        }
        out->qtype = PT_FP8_E4M3;
        out->row_bytes = cols;
        out->scale = s->data;
        out->scale_dtype = s->dtype == ST_F32 ? PT_F32 : PT_BF16;
        out->block_rows = br;
        out->block_cols = bc;
        out->scale_cols = sc;
        break;
    }
    default:
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has dtype %s; expected BF16, F16, F32 or F8_E4M3", name, st_dtype_name(t->dtype));
    }
    return 0;
}

static int st_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    const st_wsource *src = ctx;
    const st_tensor *t = st_find(src->set, name);
    if (!t) return pt_err(err, PETREL_EFORMAT, "missing tensor \"%s\" (expected shape [%lld])", name, (long long)n);
    if (t->ndim != 1 || t->shape[0] != n) {
        char s[128];
        shape_str(t, s, sizeof s);
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has shape %s, expected [%lld]", name, s, (long long)n);
    }
    if (t->dtype != ST_F32 && t->dtype != ST_BF16 && t->dtype != ST_F16)
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has dtype %s; expected F32, BF16 or F16", name, st_dtype_name(t->dtype));
    pt_wview tmp = {.qtype = t->dtype == ST_F32 ? PT_F32 : t->dtype == ST_BF16 ? PT_BF16 : PT_F16, .rows = 1, .cols = n, .data = t->data};
    tmp.row_bytes = n * (t->dtype == ST_F32 ? 4 : 2);
    pt_dequant_row(&tmp, 0, out);
    return 0;
}

static int st_has(void *ctx, const char *name) { return st_find(((const st_wsource *)ctx)->set, name) != NULL; }

void wsource_safetensors(wsource *ws, st_wsource *st, const st_set *set, const petrel_config *cfg) {
    st->set = set;
    st->cfg = cfg;
    ws->ctx = st;
    ws->matrix = st_matrix;
    ws->vector = st_vector;
    ws->has = st_has;
}

/* ---- binding ---- */

static int bind_matrix(binder *b, const char *name, int64_t rows, int64_t cols, pt_wview *out) {
    PT_TRY(b->src->matrix(b->src->ctx, name, rows, cols, out, b->err));
    b->w->kind_bytes[b->kind] += pt_wview_bytes(out);
    b->w->kind_count[b->kind]++;
    return 0;
}

static int bind_vector(binder *b, const char *name, int64_t n, float **out) {
    float *v = malloc(sizeof(float) * (size_t)n);
    PT_TRY(keep(b->w, v, b->err));
    PT_TRY(b->src->vector(b->src->ctx, name, n, v, b->err));
    *out = v;
    weight_kind k = b->kind == WK_MTP ? WK_MTP : WK_NORM;
    b->w->kind_bytes[k] += (uint64_t)n * 4;
    b->w->kind_count[k]++;
    return 0;
}

int weights_row_view(model_w *w, const pt_wview *W, int64_t r0, int64_t nr, pt_wview *out, petrel_error *err) {
    *out = *W;
    out->rows = nr;
    out->data = W->data + r0 * W->row_bytes;
    switch (W->qtype) {
    case PT_FP8_E4M3: {
        if (r0 % W->block_rows == 0) {
            size_t es = W->scale_dtype == PT_F32 ? 4 : 2;
            out->scale = (const uint8_t *)W->scale + (size_t)(r0 / W->block_rows) * (size_t)W->scale_cols * es;
            break;
        }
        float *s = malloc(sizeof(float) * (size_t)(nr * W->scale_cols));
        PT_TRY(keep(w, s, err));
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < W->scale_cols; c++) {
                int64_t i = ((r0 + r) / W->block_rows) * W->scale_cols + c;
                s[r * W->scale_cols + c] = W->scale_dtype == PT_F32 ? ((const float *)W->scale)[i]
                                                                    : pt_bf16_to_f32(((const uint16_t *)W->scale)[i]);
            }
        out->scale = s;
        out->scale_dtype = PT_F32;
        out->block_rows = 1;
        break;
    }
    case PT_Q8_ROW: out->scale = (const float *)W->scale + r0; break;
    case PT_Q8_G32: case PT_Q4_G64: {
        size_t es = W->scale_dtype == PT_F32 ? 4 : 2;
        out->scale = (const uint8_t *)W->scale + (size_t)r0 * (size_t)W->scale_cols * es;
        break;
    }
    default: break;
    }
    return 0;
}

/* The decoder layer at checkpoint index `li` (the MTP layer is li = L). */
static int bind_layer(binder *b, int li, layer_w *lw, int is_moe, int want_indexer, int is_mtp) {
    const petrel_config *c = b->cfg;
    char n[512];
    int64_t H = c->hidden_size, NH = c->num_attention_heads;
#define NM(fmt, ...) (snprintf(n, sizeof n, "model.layers.%d." fmt, li, ##__VA_ARGS__), n)
    weight_kind base = is_mtp ? WK_MTP : WK_NORM;
    b->kind = base;
    PT_TRY(bind_vector(b, NM("input_layernorm.weight"), H, &lw->input_layernorm));
    PT_TRY(bind_vector(b, NM("post_attention_layernorm.weight"), H, &lw->post_attention_layernorm));
    PT_TRY(bind_vector(b, NM("self_attn.q_a_layernorm.weight"), c->q_lora_rank, &lw->q_a_layernorm));
    PT_TRY(bind_vector(b, NM("self_attn.kv_a_layernorm.weight"), c->kv_lora_rank, &lw->kv_a_layernorm));
    b->kind = is_mtp ? WK_MTP : WK_ATTN;
    PT_TRY(bind_matrix(b, NM("self_attn.q_a_proj.weight"), c->q_lora_rank, H, &lw->q_a_proj));
    PT_TRY(bind_matrix(b, NM("self_attn.q_b_proj.weight"), NH * c->qk_head_dim, c->q_lora_rank, &lw->q_b_proj));
    PT_TRY(bind_matrix(b, NM("self_attn.kv_a_proj_with_mqa.weight"), c->kv_lora_rank + c->qk_rope_head_dim, H, &lw->kv_a_proj_with_mqa));
    PT_TRY(bind_matrix(b, NM("self_attn.kv_b_proj.weight"), NH * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank, &lw->kv_b_proj));
    PT_TRY(bind_matrix(b, NM("self_attn.o_proj.weight"), H, NH * c->v_head_dim, &lw->o_proj));
    lw->w_uk = calloc((size_t)NH, sizeof(pt_wview));
    lw->w_uv = calloc((size_t)NH, sizeof(pt_wview));
    if (!lw->w_uk || !lw->w_uv) return pt_err(b->err, PETREL_ENOMEM, "out of memory");
    int64_t per = c->qk_nope_head_dim + c->v_head_dim;
    for (int h = 0; h < NH; h++) {
        PT_TRY(weights_row_view(b->w, &lw->kv_b_proj, h * per, c->qk_nope_head_dim, &lw->w_uk[h], b->err));
        PT_TRY(weights_row_view(b->w, &lw->kv_b_proj, h * per + c->qk_nope_head_dim, c->v_head_dim, &lw->w_uv[h], b->err));
    }
    /* Indexer: required on full layers; the MTP layer uses it when present. */
    const char *probe = NM("self_attn.indexer.wk.weight");
    int present = b->src->has(b->src->ctx, probe);
    if (want_indexer && !present && !is_mtp)
        return pt_err(b->err, PETREL_EFORMAT, "missing tensor \"%s\": layer %d is a full indexer layer (config indexer_types)", probe, li);
    if ((want_indexer || is_mtp) && present) {
        lw->has_indexer = 1;
        b->kind = is_mtp ? WK_MTP : WK_INDEXER;
        int64_t Hi = c->index_n_heads, Di = c->index_head_dim;
        PT_TRY(bind_matrix(b, NM("self_attn.indexer.wq_b.weight"), Hi * Di, c->q_lora_rank, &lw->idx_wq_b));
        PT_TRY(bind_matrix(b, NM("self_attn.indexer.wk.weight"), Di, H, &lw->idx_wk));
        PT_TRY(bind_matrix(b, NM("self_attn.indexer.weights_proj.weight"), Hi, H, &lw->idx_weights_proj));
        b->kind = base;
        PT_TRY(bind_vector(b, NM("self_attn.indexer.k_norm.weight"), Di, &lw->idx_k_norm_w));
        PT_TRY(bind_vector(b, NM("self_attn.indexer.k_norm.bias"), Di, &lw->idx_k_norm_b));
    }
    lw->is_moe = is_moe;
    if (!is_moe) {
        b->kind = is_mtp ? WK_MTP : WK_DENSE;
        PT_TRY(bind_matrix(b, NM("mlp.gate_proj.weight"), c->intermediate_size, H, &lw->gate_proj));
        PT_TRY(bind_matrix(b, NM("mlp.up_proj.weight"), c->intermediate_size, H, &lw->up_proj));
        PT_TRY(bind_matrix(b, NM("mlp.down_proj.weight"), H, c->intermediate_size, &lw->down_proj));
        return 0;
    }
    int64_t E = c->n_routed_experts, I = c->moe_intermediate_size;
    b->kind = is_mtp ? WK_MTP : WK_ROUTER;
    PT_TRY(bind_matrix(b, NM("mlp.gate.weight"), E, H, &lw->router));
    b->kind = base;
    PT_TRY(bind_vector(b, NM("mlp.gate.e_score_correction_bias"), E, &lw->e_score_correction_bias));
    lw->exp_gate = calloc((size_t)E, sizeof(pt_wview));
    lw->exp_up = calloc((size_t)E, sizeof(pt_wview));
    lw->exp_down = calloc((size_t)E, sizeof(pt_wview));
    if (!lw->exp_gate || !lw->exp_up || !lw->exp_down) return pt_err(b->err, PETREL_ENOMEM, "out of memory");
    b->kind = is_mtp ? WK_MTP : WK_EXPERTS;
    for (int e = 0; e < E; e++) {
        PT_TRY(bind_matrix(b, NM("mlp.experts.%d.gate_proj.weight", e), I, H, &lw->exp_gate[e]));
        PT_TRY(bind_matrix(b, NM("mlp.experts.%d.up_proj.weight", e), I, H, &lw->exp_up[e]));
        PT_TRY(bind_matrix(b, NM("mlp.experts.%d.down_proj.weight", e), H, I, &lw->exp_down[e]));
    }
    if (c->n_shared_experts > 0) {
        lw->has_shared = 1;
        int64_t Is = I * c->n_shared_experts;
        b->kind = is_mtp ? WK_MTP : WK_SHARED;
        PT_TRY(bind_matrix(b, NM("mlp.shared_experts.gate_proj.weight"), Is, H, &lw->sh_gate));
        PT_TRY(bind_matrix(b, NM("mlp.shared_experts.up_proj.weight"), Is, H, &lw->sh_up));
        PT_TRY(bind_matrix(b, NM("mlp.shared_experts.down_proj.weight"), H, Is, &lw->sh_down));
    }
#undef NM
    return 0;
}

static void layer_deinit(layer_w *lw) {
    free(lw->w_uk);
    free(lw->w_uv);
    free(lw->exp_gate);
    free(lw->exp_up);
    free(lw->exp_down);
}

void weights_deinit(model_w *w, const petrel_config *cfg) {
    if (w->layers)
        for (int l = 0; l < cfg->num_hidden_layers; l++) layer_deinit(&w->layers[l]);
    layer_deinit(&w->mtp);
    free(w->layers);
    for (int i = 0; i < w->n_owned; i++) free(w->owned[i]);
    free(w->owned);
    memset(w, 0, sizeof *w);
}

int weights_bind(model_w *w, const petrel_config *cfg, const wsource *src, petrel_error *err) {
    memset(w, 0, sizeof *w);
    binder b = {w, cfg, src, err, WK_EMBED};
    int rc;
    int64_t V = cfg->vocab_size, H = cfg->hidden_size;
    if ((rc = bind_matrix(&b, "model.embed_tokens.weight", V, H, &w->embed_tokens)) < 0) goto fail;
    b.kind = WK_HEAD;
    if (cfg->tie_word_embeddings && !src->has(src->ctx, "lm_head.weight")) w->lm_head = w->embed_tokens;
    else if ((rc = bind_matrix(&b, "lm_head.weight", V, H, &w->lm_head)) < 0) goto fail;
    b.kind = WK_NORM;
    if ((rc = bind_vector(&b, "model.norm.weight", H, &w->norm)) < 0) goto fail;
    w->layers = calloc((size_t)cfg->num_hidden_layers, sizeof(layer_w));
    if (!w->layers) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); goto fail; }
    /* A source without any indexer weights (most colibri builds) still opens: it can run exact
     * attention up to index_topk keys (forward refuses more). A partial set is an error. */
    int any_idx = 0;
    for (int l = 0; l < cfg->num_hidden_layers && !any_idx; l++) {
        char n2[160];
        snprintf(n2, sizeof n2, "model.layers.%d.self_attn.indexer.wk.weight", l);
        any_idx = cfg->layer_indexer_full[l] && src->has(src->ctx, n2);
    }
    w->no_indexer = !any_idx;
    for (int l = 0; l < cfg->num_hidden_layers; l++)
        if ((rc = bind_layer(&b, l, &w->layers[l], cfg->layer_is_moe[l], cfg->layer_indexer_full[l] && !w->no_indexer, 0)) < 0) goto fail;
    /* MTP: recognized when its tensors are present; validated in full then. */
    char n[256];
    snprintf(n, sizeof n, "model.layers.%d.eh_proj.weight", cfg->num_hidden_layers);
    if (cfg->num_nextn_predict_layers > 0 && src->has(src->ctx, n)) {
        int L = cfg->num_hidden_layers;
        b.kind = WK_MTP;
        if ((rc = bind_matrix(&b, n, H, 2 * H, &w->eh_proj)) < 0) goto fail;
        snprintf(n, sizeof n, "model.layers.%d.enorm.weight", L);
        if ((rc = bind_vector(&b, n, H, &w->enorm)) < 0) goto fail;
        snprintf(n, sizeof n, "model.layers.%d.hnorm.weight", L);
        if ((rc = bind_vector(&b, n, H, &w->hnorm)) < 0) goto fail;
        snprintf(n, sizeof n, "model.layers.%d.shared_head.norm.weight", L);
        if ((rc = bind_vector(&b, n, H, &w->shared_head_norm)) < 0) goto fail;
        if ((rc = bind_layer(&b, L, &w->mtp, 1, 0, 1)) < 0) goto fail;
        w->has_mtp = 1;
    }
    return 0;
fail:
    weights_deinit(w, cfg);
    return rc;
}

static void relayout_view(pt_wview *W, const uint8_t *lo, const uint8_t *hi) {
    if (!W->data || !kn_r16_supported(W)) return;
    if (lo && (W->data < lo || W->data >= hi || (const uint8_t *)W->scale < lo || (const uint8_t *)W->scale >= hi)) return;
    kn_r16_repack(W);
}

void weights_relayout_r16(model_w *w, const petrel_config *c, const uint8_t *lo, const uint8_t *hi) {
    int L = c->num_hidden_layers;
    for (int l = 0; l <= L; l++) {
        layer_w *lw = l < L ? &w->layers[l] : w->has_mtp ? &w->mtp : NULL;
        if (!lw) continue;
        pt_wview *v[] = {&lw->q_a_proj, &lw->q_b_proj, &lw->kv_a_proj_with_mqa, &lw->o_proj, &lw->idx_wq_b, &lw->idx_wk,
                         &lw->gate_proj, &lw->up_proj, &lw->down_proj, &lw->sh_gate, &lw->sh_up, &lw->sh_down};
        for (size_t k = 0; k < sizeof v / sizeof *v; k++) relayout_view(v[k], lo, hi);
        /* W_UV's rows of kv_b_proj (per head, kn_matmul only; R16 blocks are self-contained,
         * so a view starting at a multiple of 16 rows can be laid out on its own) */
        if (lw->w_uv)
            for (int h = 0; h < c->num_attention_heads; h++)
                if (((lw->w_uv[h].data - lw->kv_b_proj.data) / (lw->kv_b_proj.row_bytes ? lw->kv_b_proj.row_bytes : 1)) % 16 == 0)
                    relayout_view(&lw->w_uv[h], lo, hi);
    }
    if (w->lm_head.data != w->embed_tokens.data) relayout_view(&w->lm_head, lo, hi);
}
