/* fuzz_lora.c: libFuzzer target for the LoRA adapter loader (src/model/lora.c): the input is an
 * adapter folder, split into adapter_config.json and adapter_model.safetensors (the first two
 * bytes give the JSON's length), written to a private temporary folder and read against the
 * tiny fixture's config. lora_load must refuse bad input with one line and no leak, never crash;
 * an adapter it accepts is applied to a row and must stay finite. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/config.h"
#include "model/lora.h"

static const char CONFIG[] = "{\"attention_bias\": false, \"attention_dropout\": 0.0, \"bos_token_id\": 0, \"eos_token_id\": 1, \"first_k_dense_replace\": 1, \"head_dim\": 8, \"hidden_act\": \"silu\", \"hidden_size\": 64, \"index_head_dim\": 16, \"index_n_heads\": 16, \"index_topk\": 8, \"indexer_types\": [\"full\", \"full\", \"shared\", \"full\", \"shared\", \"shared\"], \"initializer_range\": 0.02, \"intermediate_size\": 128, \"kv_lora_rank\": 32, \"layer_types\": [\"deepseek_sparse_attention\", \"deepseek_sparse_attention\", \"deepseek_sparse_attention\", \"deepseek_sparse_attention\", \"deepseek_sparse_attention\", \"deepseek_sparse_attention\"], \"max_position_embeddings\": 512, \"mlp_bias\": false, \"mlp_layer_types\": [\"dense\", \"sparse\", \"sparse\", \"sparse\", \"sparse\", \"sparse\"], \"model_type\": \"glm_moe_dsa\", \"moe_intermediate_size\": 32, \"n_group\": 4, \"n_routed_experts\": 16, \"n_shared_experts\": 1, \"norm_topk_prob\": true, \"num_attention_heads\": 4, \"num_experts_per_tok\": 4, \"num_hidden_layers\": 6, \"num_key_value_heads\": 4, \"num_nextn_predict_layers\": 1, \"pad_token_id\": null, \"q_lora_rank\": 48, \"qk_head_dim\": 24, \"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8, \"rms_norm_eps\": 1e-05, \"rope_parameters\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}, \"routed_scaling_factor\": 2.5, \"tie_word_embeddings\": false, \"topk_group\": 2, \"transformers_version\": \"5.17.0\", \"use_cache\": true, \"v_head_dim\": 16, \"vocab_size\": 1024}";
static petrel_config cfg;
static char dir[64];

static void put(const char *name, const uint8_t *b, size_t n) {
    char p[128];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) abort();
    if (n && fwrite(b, 1, n, f) != n) abort();
    fclose(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *b, size_t n) {
    if (!dir[0]) {
        petrel_error err;
        if (config_parse(CONFIG, sizeof CONFIG - 1, "fuzz", &cfg, &err)) abort();
        char t[64];
        snprintf(t, sizeof t, "/tmp/petrel-fuzz-lora-XXXXXX");
        if (!mkdtemp(t)) abort();
        snprintf(dir, sizeof dir, "%s", t);
    }
    if (n < 2) return 0;
    size_t jl = (size_t)b[0] | (size_t)b[1] << 8;
    if (jl > n - 2) jl = n - 2;
    put("adapter_config.json", b + 2, jl);
    put("adapter_model.safetensors", b + 2 + jl, n - 2 - jl);
    lora_adapter *a = NULL;
    petrel_error err = {0};
    if (lora_load(dir, "fuzz", &cfg, &a, &err) == 0) {
        lora_set s = {1, {a}, {1.0f}, 0};
        lora_set_finish(&s);
        float x[4096] = {0}, y[4096] = {0};
        for (int i = 0; i < cfg.hidden_size; i++) x[i] = (float)(i % 7) - 3.0f;
        lora_add(kn_default(), &s, 0, LT_Q_A, -1, x, cfg.hidden_size, 1, y, cfg.q_lora_rank, 0, cfg.q_lora_rank);
        lora_free(a);
    } else if (!err.msg[0] || strchr(err.msg, 10)) {
        fprintf(stderr, "bad message: [%s]\n", err.msg);
        abort();
    }
    return 0;
}
