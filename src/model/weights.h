/* weights.h: the model's tensors bound by name once at open, as typed views (no lookups in the
 * token loop). Matrices are pt_wview views into the checkpoint maps; small vectors (norms,
 * biases) are converted to owned f32 arrays. Shapes are validated against the config. */
#ifndef PETREL_MODEL_WEIGHTS_H
#define PETREL_MODEL_WEIGHTS_H
#include "io/safetensors.h"
#include "model/config.h"
#include "quant/qtypes.h"

typedef struct layer_w {
    float *input_layernorm;          /* owned [H] */
    float *post_attention_layernorm; /* owned [H] */
    /* MLA */
    pt_wview q_a_proj;               /* [q_lora_rank, H] */
    float *q_a_layernorm;            /* owned [q_lora_rank] */
    pt_wview q_b_proj;               /* [NH * qk_head_dim, q_lora_rank] */
    pt_wview kv_a_proj_with_mqa;     /* [kv_lora_rank + rope, H] */
    float *kv_a_layernorm;           /* owned [kv_lora_rank] */
    pt_wview kv_b_proj;              /* [NH * (nope + v), kv_lora_rank] */
    pt_wview *w_uk, *w_uv;           /* owned arrays [NH] of row views into kv_b_proj */
    pt_wview o_proj;                 /* [H, NH * v_head_dim] */
    /* DSA indexer (full layers; has_indexer = 0 on shared layers) */
    int has_indexer;
    pt_wview idx_wq_b;               /* [index_n_heads * index_head_dim, q_lora_rank] */
    pt_wview idx_wk;                 /* [index_head_dim, H] */
    float *idx_k_norm_w, *idx_k_norm_b; /* owned [index_head_dim] */
    pt_wview idx_weights_proj;       /* [index_n_heads, H] */
    /* MLP */
    int is_moe;
    pt_wview gate_proj, up_proj, down_proj; /* dense: [inter, H], [inter, H], [H, inter] */
    pt_wview router;                 /* mlp.gate: [E, H] */
    float *e_score_correction_bias;  /* owned [E] */
    pt_wview *exp_gate, *exp_up, *exp_down; /* owned arrays [E] */
    int has_shared;
    pt_wview sh_gate, sh_up, sh_down; /* [I*ns, H], [I*ns, H], [H, I*ns] */
} layer_w;

typedef enum { WK_EMBED, WK_HEAD, WK_NORM, WK_ATTN, WK_INDEXER, WK_DENSE, WK_ROUTER, WK_EXPERTS, WK_SHARED, WK_MTP, WK_COUNT } weight_kind;
extern const char *const weight_kind_names[WK_COUNT];

typedef struct model_w {
    pt_wview embed_tokens;           /* [V, H] */
    pt_wview lm_head;                /* [V, H] */
    float *norm;                     /* owned [H] */
    layer_w *layers;                 /* owned [L] */
    /* MTP (layer index L in the checkpoint); has_mtp = 0 when absent. */
    int has_mtp;
    layer_w mtp;
    int no_indexer;                  /* full layers exist but the source has no indexer weights */
    float *enorm, *hnorm, *shared_head_norm; /* owned [H] */
    pt_wview eh_proj;                /* [H, 2H] */
    /* Inventory: bytes and tensor count per kind, for `petrel info`. */
    uint64_t kind_bytes[WK_COUNT];
    int kind_count[WK_COUNT];
    /* Owned scale arrays made for row views of FP8 block-scaled weights. */
    void **owned;
    int n_owned, cap_owned;
} model_w;

/* Where tensors come from: a Hugging Face checkpoint, a petrel pack, a colibri artifact. Names
 * are always the Hugging Face names; shapes are the logical [rows, cols] the config implies.
 *   matrix: fills a view of the 2-D weight; a missing tensor is PETREL_EFORMAT "missing tensor".
 *   vector: converts a 1-D tensor to f32 into out[n].
 *   has:    1 if the source holds a tensor of that name. */
typedef struct wsource {
    void *ctx;
    int (*matrix)(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err);
    int (*vector)(void *ctx, const char *name, int64_t n, float *out, petrel_error *err);
    int (*has)(void *ctx, const char *name);
} wsource;

/* The safetensors source; `cfg` gives the FP8 block shape. ctx storage is `st`. */
typedef struct st_wsource { const st_set *set; const petrel_config *cfg; } st_wsource;
void wsource_safetensors(wsource *ws, st_wsource *st, const st_set *set, const petrel_config *cfg);

int weights_bind(model_w *w, const petrel_config *cfg, const wsource *src, petrel_error *err);
void weights_deinit(model_w *w, const petrel_config *cfg);
/* A view of rows [r0, r0 + nr) of W. FP8 block scales are re-expanded to one scale row per row
 * when r0 is not block-aligned (the new array is appended to w->owned). */
/* Lays matrices that only kn_matmul / kn_matmul_many read out in the row-interleaved
 * int8-activation layout (kernels.h: kn_r16_repack), in place, where format and shape allow and
 * both data and scales lie in [lo, hi) (writable memory the caller owns; lo == NULL: anywhere).
 * Not kv_b_proj as a whole (MLA reads W_UK's rows transposed; W_UV's rows, used by kn_matmul
 * only, are laid out head by head when they start at a multiple of 16 rows), not the embedding (row lookups) or a
 * head that shares its bytes, not the router (kept as stored), not routed experts: streamed
 * records arrive in the stored layout and resident experts must compute bitwise what streamed
 * ones do. */
void weights_relayout_r16(model_w *w, const petrel_config *c, const uint8_t *lo, const uint8_t *hi);
int weights_row_view(model_w *w, const pt_wview *W, int64_t r0, int64_t nr, pt_wview *out, petrel_error *err);
#endif
