/* synth.c: random-weight models (see synth.h). The weight source hands the binder "virtual"
 * views (f32, row_bytes 0, pointing at a static zero) so weights_bind can validate shapes and
 * list tensors without any memory; the converter then asks synth_row for each row. A row is a
 * pure function of (seed, tensor name, row), so rows can be generated on any thread. */
#include "model/synth.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "model/config.h"
#include "model/weights.h"

char *synth_glm52_config(int dense_layers, int moe_layers) {
    int L = dense_layers + moe_layers;
    if (dense_layers < 0 || moe_layers < 0 || L < 1 || L > 78) return NULL;
    size_t cap = 8192 + (size_t)L * 40;
    char *s = malloc(cap);
    if (!s) return NULL;
    size_t o = 0;
#define P(...) (o += (size_t)snprintf(s + o, cap - o, __VA_ARGS__))
    P("{\n  \"architectures\": [\"GlmMoeDsaForCausalLM\"],\n  \"model_type\": \"glm_moe_dsa\",\n");
    P("  \"vocab_size\": 154880,\n  \"hidden_size\": 6144,\n  \"intermediate_size\": 12288,\n  \"moe_intermediate_size\": 2048,\n");
    P("  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": 64,\n  \"num_key_value_heads\": 64,\n", L);
    P("  \"q_lora_rank\": 2048,\n  \"kv_lora_rank\": 512,\n  \"qk_nope_head_dim\": 192,\n  \"qk_rope_head_dim\": 64,\n  \"qk_head_dim\": 256,\n  \"v_head_dim\": 256,\n");
    P("  \"n_routed_experts\": 256,\n  \"n_shared_experts\": 1,\n  \"num_experts_per_tok\": 8,\n  \"n_group\": 1,\n  \"topk_group\": 1,\n");
    P("  \"routed_scaling_factor\": 2.5,\n  \"norm_topk_prob\": true,\n  \"scoring_func\": \"sigmoid\",\n  \"topk_method\": \"noaux_tc\",\n");
    P("  \"first_k_dense_replace\": %d,\n  \"moe_layer_freq\": 1,\n  \"rms_norm_eps\": 1e-05,\n", dense_layers);
    P("  \"rope_parameters\": {\"rope_theta\": 8000000.0, \"rope_type\": \"default\"},\n  \"rope_interleave\": true,\n  \"indexer_rope_interleave\": true,\n");
    P("  \"max_position_embeddings\": 1048576,\n  \"index_topk\": 2048,\n  \"index_head_dim\": 128,\n  \"index_n_heads\": 32,\n");
    P("  \"num_nextn_predict_layers\": 1,\n  \"tie_word_embeddings\": false,\n  \"eos_token_id\": [154820, 154827, 154829],\n  \"pad_token_id\": 154820,\n");
    P("  \"mlp_layer_types\": [");
    for (int i = 0; i < L; i++) P("%s\"%s\"", i ? ", " : "", i < dense_layers ? "dense" : "sparse");
    P("],\n  \"indexer_types\": [");
    /* GLM-5.2: full at layers 0, 1, 2 and every 4th from 2 (6, 10, ..., 74) */
    for (int i = 0; i < L; i++) P("%s\"%s\"", i ? ", " : "", i <= 2 || (i - 2) % 4 == 0 ? "full" : "shared");
    P("]\n}\n");
#undef P
    return s;
}

typedef struct synth {
    const petrel_config *cfg;
    uint64_t seed;
    int with_mtp;
} synth;

static const uint8_t zero_page[64];

static uint64_t name_seed(const synth *s, const char *name) { return XXH64(name, strlen(name), s->seed); }

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-a, a] (std a / sqrt 3), fast xorshift stream per row. */
static void fill_uniform(uint64_t seed, float a, float *out, int64_t n) {
    uint64_t st = seed;
    uint64_t x = splitmix(&st) | 1;
    const float k = a * (2.0f / 16777216.0f);
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out[i] = (float)(int32_t)((x >> 8) & 0xffffff) * k - a;
        out[i + 1] = (float)(int32_t)(x >> 40) * k - a;
    }
    if (i < n) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out[i] = (float)(int32_t)((x >> 8) & 0xffffff) * k - a;
    }
}

static void synth_row(void *ctx, const char *name, int64_t rows, int64_t cols, int64_t r, float *out) {
    (void)rows;
    const synth *s = ctx;
    float a = sqrtf(3.0f / (float)cols);
    if (strstr(name, "embed_tokens")) a = sqrtf(3.0f); /* embedding rows of unit rms */
    fill_uniform(name_seed(s, name) ^ ((uint64_t)r * 0x9e3779b97f4a7c15ull), a, out, cols);
}

static int sy_layer(const char *name) {
    int l = -1;
    if (sscanf(name, "model.layers.%d.", &l) != 1) return -1;
    return l;
}

static int sy_has(void *ctx, const char *name) {
    const synth *s = ctx;
    const petrel_config *c = s->cfg;
    int l = sy_layer(name);
    if (l >= c->num_hidden_layers) return s->with_mtp && c->num_nextn_predict_layers > 0 && l == c->num_hidden_layers;
    if (strstr(name, ".self_attn.indexer.")) return l >= 0 && c->layer_indexer_full[l];
    return 1;
}

static int sy_matrix(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err) {
    if (!sy_has(ctx, name)) return pt_err(err, PETREL_EFORMAT, "synth: no tensor \"%s\"", name);
    memset(out, 0, sizeof *out);
    out->qtype = PT_F32;
    out->rows = rows;
    out->cols = cols;
    out->data = zero_page; /* virtual: rows come from synth_row */
    out->row_bytes = 0;
    return 0;
}

static int sy_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    const synth *s = ctx;
    if (!sy_has(ctx, name)) return pt_err(err, PETREL_EFORMAT, "synth: no tensor \"%s\"", name);
    size_t len = strlen(name);
    int bias = len > 5 && !strcmp(name + len - 5, ".bias");
    fill_uniform(name_seed(s, name), bias ? 0.01f : 0.1f, out, n);
    if (!bias)
        for (int64_t i = 0; i < n; i++) out[i] += 1.0f;
    return 0;
}

int synth_write(const char *config_json, const char *out_path, const convert_opts *o, uint64_t seed, int with_mtp,
                convert_result *res, petrel_error *err) {
    petrel_config cfg;
    PT_TRY(config_parse(config_json, strlen(config_json), "synth config", &cfg, err));
    synth s = {&cfg, seed, with_mtp};
    wsource ws = {&s, sy_matrix, sy_vector, sy_has};
    convert_src src = {config_json, NULL, &cfg, &ws, synth_row, &s, NULL, 0};
    int rc = convert_from_wsource(&src, out_path, o, res, err);
    config_deinit(&cfg);
    return rc;
}
