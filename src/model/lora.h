/* lora.h: LoRA adapters as PEFT writes them (adapter_config.json + adapter_model.safetensors),
 * applied on top of the base weights, whatever their format.
 *
 * An adapter is a set of low-rank deltas dW = scale * B A on the model's linears, scale =
 * lora_alpha / r (or lora_alpha / sqrt(r) with use_rslora; alpha_pattern / rank_pattern per
 * module). Unmerged, a row's product becomes y = W x + sum over its adapters of s * B (A x): the
 * base product once for all rows of a batch, each row's low-rank terms its own, in a fixed order
 * (the set's order), so a row's result never depends on the batch (row independence). Merged
 * (--lora-merge), W' = W + s B A is computed once at open into owned f32 copies.
 *
 * What an adapter may target: every dense linear (q_a_proj, q_b_proj, kv_a_proj_with_mqa,
 * kv_b_proj, o_proj; the indexer's wq_b, wk, weights_proj; dense MLP and shared-expert gate /
 * up / down; the MTP layer's eh_proj; lm_head) and routed experts, as per-expert modules
 * (mlp.experts.E.gate_proj) or as PEFT's parameter wrappers of the fused 3-D expert tensors
 * (target_parameters gate_up_proj / down_proj: lora_A [E*r, in] with expert e's rows e*r ..
 * e*r+r-1, lora_B [out, r*E] with expert e's column k at k*E + e; gate_up's first
 * moe_intermediate_size outputs are the gate). */
#ifndef PETREL_MODEL_LORA_H
#define PETREL_MODEL_LORA_H
#include <stdint.h>

#include "kernels/kernels.h"
#include "model/config.h"
#include "model/weights.h"
#include "petrel.h"

typedef enum {
    LT_Q_A, LT_Q_B, LT_KV_A, LT_KV_B, LT_O,        /* attention */
    LT_IDX_Q_B, LT_IDX_K, LT_IDX_W,                /* the DSA indexer */
    LT_GATE, LT_UP, LT_DOWN,                       /* dense MLP */
    LT_SH_GATE, LT_SH_UP, LT_SH_DOWN,              /* shared experts */
    LT_EXP_GATE, LT_EXP_UP, LT_EXP_DOWN,           /* routed experts (per expert) */
    LT_EH, LT_HEAD,                                /* the MTP layer's eh_proj; lm_head (layer 0) */
    LT_COUNT
} lora_target;
extern const char *const lora_target_names[LT_COUNT];

#define LORA_MAX_RANK 1024
#define LORA_SET_MAX 8

/* One delta: out x in, rank r. A [r][in]; Bt [r][ldb], B transposed (output o of rank k at
 * Bt[k * ldb + o]), so a row's B (A x) is r axpys over contiguous outputs. */
typedef struct lora_mat {
    int r, in, out, ldb;
    float scale;          /* alpha / r (or / sqrt(r)) */
    const float *A, *Bt;  /* into the adapter's own arrays */
} lora_mat;

typedef struct lora_adapter lora_adapter;

/* The adapters a row applies, in order, each with its user scale (--lora DIR=SCALE). id: a hash
 * of the adapters and scales (0 for the empty set), for the prefix cache and session files. */
typedef struct lora_set {
    int n;
    const lora_adapter *a[LORA_SET_MAX];
    float scale[LORA_SET_MAX];
    uint64_t id;
} lora_set;

/* Reads and checks an adapter folder against the model: one clear line and nothing loaded on an
 * adapter for another architecture or other shapes, a target the model does not have, a rank
 * mismatch, a truncated or corrupt file. name: how messages and /v1/models call it. */
int lora_load(const char *dir, const char *name, const petrel_config *c, lora_adapter **out, petrel_error *err);
void lora_free(lora_adapter *a);
const char *lora_name(const lora_adapter *a);
uint64_t lora_bytes(const lora_adapter *a);
uint64_t lora_hash(const lora_adapter *a);
int lora_max_rank(const lora_adapter *a);
/* The delta on (layer, target, expert) or NULL; layer L is the MTP layer, lm_head is layer 0. */
const lora_mat *lora_get(const lora_adapter *a, int layer, lora_target t, int expert);
/* 1 if any adapter of the set has a delta on (layer, target) (any expert for LT_EXP_*). */
int lora_set_has(const lora_set *s, int layer, lora_target t);
void lora_set_finish(lora_set *s); /* computes s->id */

/* y[i][o0 .. o0+on) += the set's delta rows [o0, o0+on) times x[i] for n rows (ldx, ldy: row
 * strides). Each row alone, in a fixed order: bitwise the same for any n. */
void lora_add(const kn_table *kt, const lora_set *s, int layer, lora_target t, int expert, const float *x, int ldx, int n, float *y,
              int ldy, int o0, int on);
/* The transposed form: y[i] (in wide) += sum of s A^T (Bt[:, o0 .. o0+on) x[i]) (x on wide):
 * MLA's absorbed q~ = W_UK^T q_nope with the delta on kv_b_proj. */
void lora_add_t(const kn_table *kt, const lora_set *s, int layer, lora_target t, const float *x, int ldx, int n, float *y, int ldy,
                int o0, int on);
/* lora_add over rows whose sets differ: sets[i] is row i's (NULL or empty: nothing); runs of equal
 * sets go together. */
void lora_add_rows(const kn_table *kt, const lora_set *const *sets, int layer, lora_target t, int expert, const float *x, int ldx, int n,
                   float *y, int ldy);

/* Merged: W += scale * B A for every delta of the set into owned f32 copies of the targeted
 * matrices of w (f32 or bf16 bases only, a bf16 one promoted so the sum stays exact; routed
 * experts only when resident); kv_b_proj's head
 * views are rebuilt. PETREL_EUNSUPPORTED naming the tensor for other formats. owned bytes in
 * *bytes. */
int lora_merge(const lora_set *s, model_w *w, const petrel_config *c, int experts_streamed, uint64_t *bytes, petrel_error *err);
#endif
