/* config.h: the model configuration (config.json + generation_config.json) in one validated
 * struct. Field names are Hugging Face's. Per-layer schedules (indexer full/shared, dense/MoE)
 * are resolved here once, so the layer loop only reads flags. */
#ifndef PETREL_MODEL_CONFIG_H
#define PETREL_MODEL_CONFIG_H
#include <stdint.h>

#include "base/file.h"
#include "petrel.h"

#define PT_MAX_EOS 16

struct petrel_config {
    char model_type[64];
    int vocab_size;
    int hidden_size;
    int intermediate_size;
    int moe_intermediate_size;
    int num_hidden_layers;
    int num_attention_heads;
    int q_lora_rank;
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int qk_head_dim;          /* derived: nope + rope */
    int v_head_dim;
    int n_routed_experts;
    int n_shared_experts;
    int num_experts_per_tok;
    int n_group;
    int topk_group;
    float routed_scaling_factor;
    int norm_topk_prob;
    int first_k_dense_replace;
    int moe_layer_freq;
    double rms_norm_eps;
    double rope_theta;
    int rope_interleave;          /* main attention: pairs (2i, 2i+1) when 1, (i, i+d/2) when 0 */
    int indexer_rope_interleave;
    int max_position_embeddings;
    int index_topk;
    int index_head_dim;
    int index_n_heads;
    int num_nextn_predict_layers;
    int tie_word_embeddings;
    int n_eos;
    int32_t eos_token_id[PT_MAX_EOS];
    int bos_token_id;             /* -1 if absent */
    int pad_token_id;             /* -1 if absent */
    /* FP8 checkpoints: quantization_config.weight_block_size, 0 when not FP8. */
    int fp8_block_rows, fp8_block_cols;
    /* Per-layer schedules, [num_hidden_layers + 1] (owned by the struct, fixed capacity); entry
     * num_hidden_layers is the MTP layer's (MoE, no indexer of its own: dense attention). */
    uint8_t *layer_is_moe;        /* owned */
    uint8_t *layer_indexer_full;  /* owned: 1 = runs its own indexer, 0 = reuses the last full */
};

/* Parses config.json text. `where` names the file for messages. */
int config_parse(const char *json, size_t len, const char *where, petrel_config *cfg, petrel_error *err);
/* Reads DIR/config.json and, if present, DIR/generation_config.json (its eos ids join). */
int config_load_dir(const char *dir, petrel_config *cfg, petrel_error *err);
void config_deinit(petrel_config *cfg);
int config_is_eos(const petrel_config *cfg, int32_t id);

#endif
