/* config.c: config.json parsing and validation. Every error names the field. Unknown fields
 * are ignored; fields the math needs are required unless the HF class has a default that all
 * GLM-5 releases rely on (then that default is used, as transformers does). */
#include "model/config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"


typedef struct { const cJSON *root; const char *where; petrel_error *err; } ctx;

/* Integer field: required when dflt == INT_MIN-ish sentinel. */
#define REQUIRED (-2147483647)
static int get_int(ctx *c, const char *name, int dflt, int lo, int hi, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, name);
    if (!v || cJSON_IsNull(v)) {
        if (dflt == REQUIRED) return pt_err(c->err, PETREL_EFORMAT, "%s: missing field \"%s\"", c->where, name);
        *out = dflt;
        return 0;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return pt_err(c->err, PETREL_EFORMAT, "%s: field \"%s\" must be an integer", c->where, name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return pt_err(c->err, PETREL_EFORMAT, "%s: field \"%s\" = %g is outside %d..%d", c->where, name, v->valuedouble, lo, hi);
    *out = (int)v->valuedouble;
    return 0;
}

static int get_num(ctx *c, const cJSON *obj, const char *name, double dflt, int required, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!v || cJSON_IsNull(v)) {
        if (required) return pt_err(c->err, PETREL_EFORMAT, "%s: missing field \"%s\"", c->where, name);
        *out = dflt;
        return 0;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return pt_err(c->err, PETREL_EFORMAT, "%s: field \"%s\" must be a number", c->where, name);
    *out = v->valuedouble;
    return 0;
}

static int get_bool(ctx *c, const char *name, int dflt, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, name);
    if (!v || cJSON_IsNull(v)) { *out = dflt; return 0; }
    if (!cJSON_IsBool(v)) return pt_err(c->err, PETREL_EFORMAT, "%s: field \"%s\" must be true or false", c->where, name);
    *out = cJSON_IsTrue(v);
    return 0;
}

static int add_eos(petrel_config *cfg, const cJSON *v, const char *where, const char *field, petrel_error *err) {
    if (!v || cJSON_IsNull(v)) return 0;
    const cJSON *items = cJSON_IsArray(v) ? v->child : v;
    for (const cJSON *it = items; it; it = cJSON_IsArray(v) ? it->next : NULL) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble != floor(it->valuedouble) || it->valuedouble > 2147483647.0)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"%s\" must be a token id or a list of ids", where, field);
        int32_t id = (int32_t)it->valuedouble;
        if (!config_is_eos(cfg, id)) {
            if (cfg->n_eos >= PT_MAX_EOS) return pt_err(err, PETREL_EFORMAT, "%s: too many eos ids in \"%s\"", where, field);
            cfg->eos_token_id[cfg->n_eos++] = id;
        }
        if (!cJSON_IsArray(v)) break;
    }
    return 0;
}

int config_is_eos(const petrel_config *cfg, int32_t id) {
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_token_id[i] == id) return 1;
    return 0;
}

void config_deinit(petrel_config *cfg) {
    free(cfg->layer_is_moe);
    free(cfg->layer_indexer_full);
    cfg->layer_is_moe = cfg->layer_indexer_full = NULL;
}

static int parse_fields(ctx *c, petrel_config *cfg) {
    const cJSON *root = c->root;
    petrel_error *err = c->err;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) return pt_err(err, PETREL_EFORMAT, "%s: missing field \"model_type\"", c->where);
    if (strcmp(mt->valuestring, "glm_moe_dsa"))
        return pt_err(err, PETREL_EUNSUPPORTED, "%s: model_type \"%.40s\" is not supported (petrel runs \"glm_moe_dsa\": GLM-5, 5.1, 5.2)",
                      c->where, mt->valuestring);
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", mt->valuestring);
    const int BIG = 1 << 30;
    PT_TRY(get_int(c, "vocab_size", REQUIRED, 1, BIG, &cfg->vocab_size));
    PT_TRY(get_int(c, "hidden_size", REQUIRED, 1, 1 << 20, &cfg->hidden_size));
    PT_TRY(get_int(c, "intermediate_size", REQUIRED, 1, 1 << 22, &cfg->intermediate_size));
    PT_TRY(get_int(c, "moe_intermediate_size", REQUIRED, 1, 1 << 22, &cfg->moe_intermediate_size));
    PT_TRY(get_int(c, "num_hidden_layers", REQUIRED, 1, 4096, &cfg->num_hidden_layers));
    PT_TRY(get_int(c, "num_attention_heads", REQUIRED, 1, 4096, &cfg->num_attention_heads));
    const cJSON *ql = cJSON_GetObjectItemCaseSensitive(root, "q_lora_rank");
    if (ql && cJSON_IsNull(ql))
        return pt_err(err, PETREL_EUNSUPPORTED, "%s: field \"q_lora_rank\" is null (a model without query compression is not supported)", c->where);
    PT_TRY(get_int(c, "q_lora_rank", REQUIRED, 1, 1 << 20, &cfg->q_lora_rank));
    PT_TRY(get_int(c, "kv_lora_rank", REQUIRED, 1, 1 << 20, &cfg->kv_lora_rank));
    PT_TRY(get_int(c, "qk_nope_head_dim", REQUIRED, 1, 1 << 16, &cfg->qk_nope_head_dim));
    PT_TRY(get_int(c, "qk_rope_head_dim", REQUIRED, 2, 1 << 16, &cfg->qk_rope_head_dim));
    PT_TRY(get_int(c, "v_head_dim", REQUIRED, 1, 1 << 16, &cfg->v_head_dim));
    cfg->qk_head_dim = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
    int qkh;
    PT_TRY(get_int(c, "qk_head_dim", cfg->qk_head_dim, 1, 1 << 17, &qkh));
    if (qkh != cfg->qk_head_dim)
        return pt_err(err, PETREL_EFORMAT, "%s: field \"qk_head_dim\" = %d but qk_nope_head_dim + qk_rope_head_dim = %d", c->where, qkh, cfg->qk_head_dim);
    if (cfg->qk_rope_head_dim % 2) return pt_err(err, PETREL_EFORMAT, "%s: field \"qk_rope_head_dim\" must be even", c->where);
    PT_TRY(get_int(c, "n_routed_experts", REQUIRED, 1, 1 << 16, &cfg->n_routed_experts));
    PT_TRY(get_int(c, "n_shared_experts", 0, 0, 64, &cfg->n_shared_experts));
    PT_TRY(get_int(c, "num_experts_per_tok", REQUIRED, 1, 1 << 16, &cfg->num_experts_per_tok));
    if (cfg->num_experts_per_tok > cfg->n_routed_experts)
        return pt_err(err, PETREL_EFORMAT, "%s: field \"num_experts_per_tok\" = %d exceeds n_routed_experts = %d", c->where, cfg->num_experts_per_tok, cfg->n_routed_experts);
    PT_TRY(get_int(c, "n_group", 1, 1, 1 << 16, &cfg->n_group));
    PT_TRY(get_int(c, "topk_group", 1, 1, 1 << 16, &cfg->topk_group));
    if (cfg->n_routed_experts % cfg->n_group)
        return pt_err(err, PETREL_EFORMAT, "%s: field \"n_group\" = %d does not divide n_routed_experts = %d", c->where, cfg->n_group, cfg->n_routed_experts);
    if (cfg->topk_group > cfg->n_group)
        return pt_err(err, PETREL_EFORMAT, "%s: field \"topk_group\" = %d exceeds n_group = %d", c->where, cfg->topk_group, cfg->n_group);
    if (cfg->topk_group * (cfg->n_routed_experts / cfg->n_group) < cfg->num_experts_per_tok)
        return pt_err(err, PETREL_EFORMAT, "%s: fields \"topk_group\" x group size (%d) < num_experts_per_tok (%d)", c->where,
                      cfg->topk_group * (cfg->n_routed_experts / cfg->n_group), cfg->num_experts_per_tok);
    double d;
    PT_TRY(get_num(c, root, "routed_scaling_factor", 1.0, 0, &d));
    cfg->routed_scaling_factor = (float)d;
    PT_TRY(get_bool(c, "norm_topk_prob", 1, &cfg->norm_topk_prob));
    const cJSON *sf = cJSON_GetObjectItemCaseSensitive(root, "scoring_func");
    if (sf && !(cJSON_IsString(sf) && !strcmp(sf->valuestring, "sigmoid")))
        return pt_err(err, PETREL_EUNSUPPORTED, "%s: field \"scoring_func\" must be \"sigmoid\"", c->where);
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(root, "topk_method");
    if (tm && !(cJSON_IsString(tm) && !strcmp(tm->valuestring, "noaux_tc")))
        return pt_err(err, PETREL_EUNSUPPORTED, "%s: field \"topk_method\" must be \"noaux_tc\"", c->where);
    PT_TRY(get_int(c, "first_k_dense_replace", 0, 0, 4096, &cfg->first_k_dense_replace));
    PT_TRY(get_int(c, "moe_layer_freq", 1, 1, 4096, &cfg->moe_layer_freq));
    PT_TRY(get_num(c, root, "rms_norm_eps", 1e-6, 0, &cfg->rms_norm_eps));
    if (!(cfg->rms_norm_eps > 0 && cfg->rms_norm_eps < 1)) return pt_err(err, PETREL_EFORMAT, "%s: field \"rms_norm_eps\" must be in (0, 1)", c->where);
    /* RoPE: rope_parameters (current HF), else rope_scaling, else top-level rope_theta. */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (!cJSON_IsObject(rp)) rp = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    cfg->rope_theta = 10000.0;
    PT_TRY(get_num(c, root, "rope_theta", 10000.0, 0, &cfg->rope_theta));
    if (cJSON_IsObject(rp)) {
        PT_TRY(get_num(c, rp, "rope_theta", cfg->rope_theta, 0, &cfg->rope_theta));
        const cJSON *rt = cJSON_GetObjectItemCaseSensitive(rp, "rope_type");
        if (!rt) rt = cJSON_GetObjectItemCaseSensitive(rp, "type");
        if (rt && !(cJSON_IsString(rt) && !strcmp(rt->valuestring, "default")))
            return pt_err(err, PETREL_EUNSUPPORTED, "%s: field \"rope_parameters.rope_type\" must be \"default\" (no GLM-5 release uses RoPE scaling)", c->where);
    }
    if (!(cfg->rope_theta > 1)) return pt_err(err, PETREL_EFORMAT, "%s: field \"rope_theta\" must be > 1", c->where);
    PT_TRY(get_bool(c, "rope_interleave", 1, &cfg->rope_interleave));
    PT_TRY(get_bool(c, "indexer_rope_interleave", 1, &cfg->indexer_rope_interleave));
    PT_TRY(get_int(c, "max_position_embeddings", 202752, 1, 1 << 30, &cfg->max_position_embeddings));
    PT_TRY(get_int(c, "index_topk", 2048, 1, 1 << 24, &cfg->index_topk));
    PT_TRY(get_int(c, "index_head_dim", 128, 1, 1 << 16, &cfg->index_head_dim));
    PT_TRY(get_int(c, "index_n_heads", 64, 1, 4096, &cfg->index_n_heads));
    if (cfg->index_head_dim < cfg->qk_rope_head_dim)
        return pt_err(err, PETREL_EFORMAT, "%s: field \"index_head_dim\" = %d is smaller than qk_rope_head_dim = %d", c->where, cfg->index_head_dim, cfg->qk_rope_head_dim);
    PT_TRY(get_int(c, "num_nextn_predict_layers", 0, 0, 16, &cfg->num_nextn_predict_layers));
    PT_TRY(get_bool(c, "tie_word_embeddings", 0, &cfg->tie_word_embeddings));
    PT_TRY(get_int(c, "bos_token_id", -1, 0, 1 << 30, &cfg->bos_token_id));
    PT_TRY(get_int(c, "pad_token_id", -1, 0, 1 << 30, &cfg->pad_token_id));
    PT_TRY(add_eos(cfg, cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"), c->where, "eos_token_id", err));
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_token_id[i] >= cfg->vocab_size)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"eos_token_id\" %d is not below vocab_size %d", c->where, cfg->eos_token_id[i], cfg->vocab_size);
    /* FP8 */
    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
    if (qc && !cJSON_IsNull(qc)) {
        const cJSON *qm = cJSON_GetObjectItemCaseSensitive(qc, "quant_method");
        if (!cJSON_IsString(qm) || strcmp(qm->valuestring, "fp8"))
            return pt_err(err, PETREL_EUNSUPPORTED, "%s: field \"quantization_config.quant_method\" must be \"fp8\"", c->where);
        const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(qc, "fmt");
        if (fmt && !(cJSON_IsString(fmt) && !strcmp(fmt->valuestring, "e4m3")))
            return pt_err(err, PETREL_EUNSUPPORTED, "%s: field \"quantization_config.fmt\" must be \"e4m3\"", c->where);
        const cJSON *bs = cJSON_GetObjectItemCaseSensitive(qc, "weight_block_size");
        if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2 || !cJSON_IsNumber(bs->child) || !cJSON_IsNumber(bs->child->next) ||
            bs->child->valuedouble < 1 || bs->child->next->valuedouble < 1 || bs->child->valuedouble > 65536 || bs->child->next->valuedouble > 65536)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"quantization_config.weight_block_size\" must be [rows, cols]", c->where);
        cfg->fp8_block_rows = (int)bs->child->valuedouble;
        cfg->fp8_block_cols = (int)bs->child->next->valuedouble;
    }
    return 0;
}

static int resolve_layers(ctx *c, petrel_config *cfg) {
    int L = cfg->num_hidden_layers;
    petrel_error *err = c->err;
    /* L + 1 entries: index L is the MTP layer (a MoE decoder layer, dense attention, no indexer) */
    cfg->layer_is_moe = calloc((size_t)L + 1, 1);
    cfg->layer_indexer_full = calloc((size_t)L + 1, 1);
    if (!cfg->layer_is_moe || !cfg->layer_indexer_full) return pt_err(err, PETREL_ENOMEM, "out of memory");
    cfg->layer_is_moe[L] = 1;
    const cJSON *mlt = cJSON_GetObjectItemCaseSensitive(c->root, "mlp_layer_types");
    if (mlt && !cJSON_IsNull(mlt)) {
        if (!cJSON_IsArray(mlt) || cJSON_GetArraySize(mlt) != L)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"mlp_layer_types\" must list %d entries", c->where, L);
        int i = 0;
        for (const cJSON *it = mlt->child; it; it = it->next, i++) {
            if (cJSON_IsString(it) && !strcmp(it->valuestring, "dense")) cfg->layer_is_moe[i] = 0;
            else if (cJSON_IsString(it) && !strcmp(it->valuestring, "sparse")) cfg->layer_is_moe[i] = 1;
            else return pt_err(err, PETREL_EFORMAT, "%s: field \"mlp_layer_types\"[%d] must be \"dense\" or \"sparse\"", c->where, i);
        }
        /* both given: they must describe the same layers (the list wins at run time, so a
         * disagreement means one of them is wrong, and which one is not ours to guess) */
        int lead = 0;
        while (lead < L && !cfg->layer_is_moe[lead]) lead++;
        if (cJSON_GetObjectItemCaseSensitive(c->root, "first_k_dense_replace") && lead != cfg->first_k_dense_replace)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"first_k_dense_replace\" (%d) disagrees with \"mlp_layer_types\" (%d leading \"dense\" layers)",
                          c->where, cfg->first_k_dense_replace, lead);
    } else {
        for (int i = 0; i < L; i++) cfg->layer_is_moe[i] = i >= cfg->first_k_dense_replace && i % cfg->moe_layer_freq == 0;
    }
    const cJSON *it_types = cJSON_GetObjectItemCaseSensitive(c->root, "indexer_types");
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(c->root, "index_topk_pattern");
    if (it_types && !cJSON_IsNull(it_types)) {
        if (!cJSON_IsArray(it_types) || cJSON_GetArraySize(it_types) != L)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"indexer_types\" must list %d entries", c->where, L);
        int i = 0;
        for (const cJSON *it = it_types->child; it; it = it->next, i++) {
            if (cJSON_IsString(it) && !strcmp(it->valuestring, "full")) cfg->layer_indexer_full[i] = 1;
            else if (cJSON_IsString(it) && !strcmp(it->valuestring, "shared")) cfg->layer_indexer_full[i] = 0;
            else return pt_err(err, PETREL_EFORMAT, "%s: field \"indexer_types\"[%d] must be \"full\" or \"shared\"", c->where, i);
        }
    } else if (pat && !cJSON_IsNull(pat)) {
        if (!cJSON_IsString(pat) || (int)strlen(pat->valuestring) != L)
            return pt_err(err, PETREL_EFORMAT, "%s: field \"index_topk_pattern\" must be a string of %d letters F/S", c->where, L);
        for (int i = 0; i < L; i++) {
            char ch = pat->valuestring[i];
            if (ch != 'F' && ch != 'S') return pt_err(err, PETREL_EFORMAT, "%s: field \"index_topk_pattern\"[%d] must be F or S", c->where, i);
            cfg->layer_indexer_full[i] = ch == 'F';
        }
    } else {
        int freq, offset;
        PT_TRY(get_int(c, "index_topk_freq", 1, 1, 1 << 16, &freq));
        PT_TRY(get_int(c, "index_skip_topk_offset", 2, 0, 1 << 16, &offset));
        for (int i = 0; i < L; i++) {
            int v = i - offset + 1;
            if (v < 0) v = 0;
            cfg->layer_indexer_full[i] = v % freq == 0;
        }
    }
    if (!cfg->layer_indexer_full[0])
        return pt_err(err, PETREL_EFORMAT, "%s: layer 0 must run its own indexer (\"full\"): a shared layer has no earlier selection to reuse", c->where);
    return 0;
}

int config_parse(const char *json, size_t len, const char *where, petrel_config *cfg, petrel_error *err) {
    memset(cfg, 0, sizeof *cfg);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) return pt_err(err, PETREL_EFORMAT, "%s: not valid JSON", where);
    int rc;
    if (!cJSON_IsObject(root)) rc = pt_err(err, PETREL_EFORMAT, "%s: not a JSON object", where);
    else {
        ctx c = {root, where, err};
        rc = parse_fields(&c, cfg);
        if (rc == 0) rc = resolve_layers(&c, cfg);
    }
    cJSON_Delete(root);
    if (rc < 0) config_deinit(cfg);
    return rc;
}

int config_load_dir(const char *dir, petrel_config *cfg, petrel_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *txt;
    size_t len;
    PT_TRY(pt_read_file(path, 16u << 20, &txt, &len, err));
    int rc = config_parse(txt, len, path, cfg, err);
    free(txt);
    if (rc < 0) return rc;
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (pt_read_file(path, 16u << 20, &txt, &len, NULL) == 0) {
        cJSON *g = cJSON_ParseWithLength(txt, len);
        free(txt);
        if (!g) { config_deinit(cfg); return pt_err(err, PETREL_EFORMAT, "%s: not valid JSON", path); }
        rc = add_eos(cfg, cJSON_GetObjectItemCaseSensitive(g, "eos_token_id"), path, "eos_token_id", err);
        cJSON_Delete(g);
        for (int i = 0; rc == 0 && i < cfg->n_eos; i++)
            if (cfg->eos_token_id[i] >= cfg->vocab_size)
                rc = pt_err(err, PETREL_EFORMAT, "%s: eos id %d is not below vocab_size %d", path, cfg->eos_token_id[i], cfg->vocab_size);
        if (rc < 0) { config_deinit(cfg); return rc; }
    }
    return 0;
}
