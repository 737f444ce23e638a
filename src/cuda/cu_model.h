/* cu_model.h: the CUDA backend's host-side state, shared by model.cu (upload, caches, the
 * forward's schedule) and tiers.cu (the expert tiers). Private to src/cuda; C++ (nvcc) only. */
#ifndef PETREL_CUDA_CU_MODEL_H
#define PETREL_CUDA_CU_MODEL_H
#include <cuda_runtime.h>
#include <pthread.h>

extern "C" {
#include "base/err.h"
#include "model/engine.h"
}
#include "cuda/cu.h"
#include "cuda/cu_kernels.h"

#define CU_ROWS 256      /* the fewest rows per chunk of a forward (m->rows: more where the VRAM left allows) */
#define CU_ROWS_MAX 2048 /* the most a chunk takes (each chunk reads, or copies, its experts once) */
#define CU_EXP_GEMV 64   /* routed choices per chunk up to which experts take the GEMV form */
#define CU_TMA_ROWS 512  /* chunk rows from which q8 products unpack their weights once, for the TMA GEMM (cu_model.w8 2) */
#define PIN_ROW_BYTES 64 /* pinned staging per chunk row: its id, flag, row info */
#define CU_PIN_LOGITS 8  /* rows of logits staged in pinned memory (decode steps, batched rows) */
#define CU_GRAPHS 8      /* decode graphs kept (buckets of 256 keys: a context's recent ones) */

enum { P_EMBED, P_ATTN_PROJ, P_INDEXER, P_HEADS, P_ATTN_CORE, P_O_PROJ, P_DENSE, P_ROUTER, P_EXPERTS, P_EXPERTS_DOWN, P_COMBINE, P_SHARED, P_HEAD,
       P_COPY, PROF_PARTS };
#define PROF_EVENTS 1024

/* weights that read one x, stacked by rows in one allocation (up_products): all the whole
 * stack, end[i] the rows of members 0..i; n 0 when they were uploaded apart or a prefix would
 * split its columns differently from a member (then each runs alone) */
struct cu_stack {
    dw all;
    int64_t end[4];
    int n;
};

struct cu_layer {
    float *in_norm, *post_norm, *q_a_norm, *kv_a_norm;
    dw q_a, q_b, kv_a, kv_b, o;
    dw uk_t; /* [NH][Rkv][Dn] f32: W_UK^T per head, for the GEMV form of q~ (decode) */
    int has_idx;
    dw iq, ik, iwp;
    float *ik_w, *ik_b;
    int is_moe;
    dw gate, up, down, router;
    float *bias;
    dw eg, eu, ed;
    int has_shared;
    dw sg, su, sd;
    cu_stack on_x;  /* q_a, kv_a, ik, iwp */
    cu_stack on_qa; /* q_b, iq */
};

struct cu_model {
    const petrel_engine *e;
    const petrel_config *c;
    int dev;
    cudaStream_t st;
    pthread_mutex_t mu;
    cu_layer *L;
    dw embed, head;
    float *norm;
    void **allocs;
    int n_allocs, cap_allocs;
    uint64_t budget, used, wbytes;
    float *rope_cos, *rope_sin; /* [rope_cap][Dr/2] */
    int32_t *heads;             /* [8 * NH]: i % NH (the head products' GEMV slots, up to 8 rows) */
    int rope_cap;
    uint8_t *scr;               /* the forward's scratch (grown on demand) */
    int no_stacks;              /* run the layers' stacked products each alone (cu_model_use_stacks) */
    int no_pdl;                 /* launch each kernel after its predecessor's end (cu_model_use_pdl) */
    int no_fork;                /* run every kernel of a step on one stream (cu_model_use_fork) */
    int w4;                     /* prompts' routed experts on a bf16 GEMM (1 mma.sync, 2 wgmma, 3 wgmma with TMA loads), not the int8 one (cu_model_use_bf16_experts) */
    int w8;                     /* prompts' q8 products on the bf16 wgmma GEMM, not the int8 one; 2 (the default): chunks of CU_TMA_ROWS or more rows on the TMA GEMM over weights unpacked once (cu_model_use_bf16_dense) */
    __nv_bfloat16 *wb;          /* the TMA GEMM's weights in bf16: the largest q8 product the prompts run (wb_cap values; NULL: none fits) */
    int64_t wb_cap;
    int kvb_gemm;               /* every layer's kv_b is a q8 the bf16 GEMM takes (form 3 then makes its keys and values by one GEMM: no f32 V) */
    int kvb_quant;              /* every layer's kv_b is q8 / q4 (form 3 takes the chunk; a mixed pack keeps form 1 in every layer) */
    int xattn;                  /* one session's prompt chunks of at most index_topk keys take the expanded attention: 1 on mma.sync tiles, 2 on wgmma, 3 one bf16 pass (quantized models; cu_model_use_expanded_attn) */
    unsigned long long forks;   /* parts launched (or captured) on the side stream since open */
    unsigned long long xruns;   /* layers of prompt chunks run in the expanded attention since open */
    /* the side stream of up to 8 rows' forwards: a MoE layer's shared expert beside its router
     * and routed experts, and a selecting layer's DSA keys and top-k beside the MLA queries'
     * rope and W_UK products; fork / join: the events that order the two streams */
    cudaStream_t side;
    cudaEvent_t fork, join;
    size_t scr_cap;
    char desc[256];
    /* the profile (cu_model_profile): events between the parts of a forward, and their sums */
    int tc; /* products of more than 8 rows on tensor cores (bf16 operands) for q4/q8/bf16 weights:
               the engine's act_quant is not -1 (exact f32 activations) */
    int prof, n_ev;
    cudaEvent_t ev[PROF_EVENTS];
    int ev_part[PROF_EVENTS];
    double prof_ms[PROF_PARTS];
    /* rows per chunk of a forward: CU_ROWS up to CU_ROWS_MAX, by the VRAM left at open (cu_chunk_rows) */
    int rows;
    /* pinned staging for the rows' small arrays [rows * PIN_ROW_BYTES]; the host's per-chunk row
     * arrays (ids, flags, logits rows, call rows: 4 x rows; row info; pieces) */
    uint8_t *pin;
    /* pinned staging for up to CU_PIN_LOGITS rows of logits (a device-to-host copy into pageable
     * memory goes through the driver's own staging at a fraction of the link's speed);
     * pin_logits_dev: the same memory as the device addresses it (the head's product writes
     * there unless no_mapped_logits: cu_model_use_mapped_logits), NULL where it is not mapped */
    float *pin_logits, *pin_logits_dev;
    int no_mapped_logits;
    int32_t *hrow;
    cu_rowinfo *hri;
    void *pieces;
    struct cu_tiers *tiers; /* the expert tiers (tiers.cu), NULL when every expert is in HBM */
    /* decode steps' kernels as graphs (chunk_forward), one per bucket of launch sizes, the least
     * recently used replaced; use_graphs 0: launch directly (cu_model_use_graphs, or a stream
     * that could not be captured) */
    int use_graphs;
    struct {
        int key[4];
        cudaGraphExec_t ex;
        unsigned long long used;
    } graphs[CU_GRAPHS];
    unsigned long long graph_tick;
    int16_t *route;         /* trace-driven routing: the trace [n_tokens][n_layers][K] in HBM, or NULL */
    int route_tokens, route_layers;
};

struct cu_kv {
    cu_model *m;
    float *kv, *ix;
    int cap;
};


/* the scratch of one chunk, carved from m->scr (a sizing pass first: base NULL) */
struct fscr {
    int32_t *ids, *always, *sel, *seln, *idx, *slot_x, *list, *tiles, *ntiles, *mark;
    unsigned long long *count;
    cu_rowinfo *ri;
    float *h, *x, *y, *qa, *q, *kva, *o, *qt, *lat, *S, *partial, *qi, *ki, *iw, *sc, *lg, *wts, *gb, *ub, *yk, *mo, *xl, *logits;
    float *kx, *vx;      /* an expanded prompt's keys and values (cuk_mla_attn_expanded; carved for nkx keys) */
    __nv_bfloat16 *xb;   /* and their bf16 copies (its one-pass form 3) */
    float *on_x, *on_qa; /* one row's stacked products (cu_stack): q_a | kv_a | ik | iwp, q_b | iq */
    int64_t on_x_cap, on_qa_cap;
    int32_t *w_idx, *w_x, *w_pos; /* the expert tiers' waves (tiered models only) */
    float *w_y;
    int8_t *xq;          /* the quantized path's int8 x rows (cu_xq), xq_cap bytes */
    float *xqd;          /* their group scales */
    int32_t *xqs;        /* their sums of 32 values (q4) */
    int64_t xq_cap;
    __nv_bfloat16 *xh;   /* the bf16 GEMM's x rows (cuk_xbf16p), xq_cap values */
    /* the shared expert's own intermediates and int8 x while it runs on the side stream (up to
     * 8 rows; sxq_cap bytes) */
    float *sgb, *sub;
    int8_t *sxq;
    float *sxqd;
    int32_t *sxqs;
    int64_t sxq_cap;
    int t;               /* the chunk's rows (f.x) */
    int need_xl; /* the final norm is read (hidden states or logits) */
};

/* the profile's mark between parts of a forward (cu_model_profile) */
static inline void prof_mark(cu_model *m, int part) {
    if (m->prof && m->n_ev < PROF_EVENTS) cudaEventRecord(m->ev[m->n_ev], m->st), m->ev_part[m->n_ev++] = part;
}
int cu_fail(petrel_error *err, cudaError_t rc, const char *what);
/* device memory counted against the VRAM budget, freed at close */
void *dalloc(cu_model *m, size_t bytes, const char *what, petrel_error *err);

/* ---- the expert tiers (tiers.cu) ----
 * When the routed experts do not all fit the VRAM budget (or the host streams them under a
 * memory budget, or vram_expert_slots asks for fewer), each MoE layer keeps S of them in HBM
 * slots; the rest come from the host: the engine's resident experts in RAM or its expert store
 * (RAM slots over the pack on the SSD). Per MoE layer of a forward the routing comes back to
 * the host, the misses are copied over PCIe into slots chosen by the store's eviction policy
 * (converted to the plain layout with f32 scales on the GPU), and the experts run on their
 * slots: the same kernels over the same bytes, so the logits are bitwise those of the fully
 * resident GPU path. A chunk whose experts outnumber the slots runs in waves. */
typedef struct cu_tiers cu_tiers;
/* Decides the slots per layer (vram_slots: asked for, 0 = what the budget leaves after the
 * other weights and a reserve) and allocates them; *tiered 0: every expert fits, upload as
 * before (the layers' expert weights are not touched). host_experts: misses of small chunks
 * may run on the host CPU (the cost model of tiers.cu). */
int cut_open(cu_model *m, int vram_slots, int host_experts, int *tiered, petrel_error *err);
void cut_close(cu_model *m);
/* Layer l's routed experts of the chunk's t rows (routing in f.idx on the device; gemv: the
 * form the resident path would take): gate, up (SwiGLU) and down into yk [t*K][H]. */
int cut_experts(cu_model *m, int l, const struct fscr &f, int t, int gemv, petrel_error *err);
/* One line of statistics ("" when not tiered). */
void cut_describe(const cu_model *m, char *buf, size_t n);
/* device scratch a chunk of `rows` rows may need (prefill of a fresh chunk at a topk context,
 * every row's logits): for choosing a tiered model's chunk rows */
size_t cu_chunk_scratch_bytes(const petrel_config *c, int rows);
/* the rows per chunk a model takes: the most (a power of two down from CU_ROWS_MAX, above least)
 * whose scratch is at most a quarter of `left` bytes of VRAM, else least */
int cu_chunk_rows(const petrel_config *c, uint64_t left, int least);
/* the expert product of n choices (idx: slot per choice, xrow: x row per choice) into y [n][H];
 * the GEMM form's tiles from cuk_moe_sort over idx as (sort_t rows x sort_k, sort_e experts) */
void experts_compute(cu_model *m, const cu_layer &G, const struct fscr &f, const int32_t *idx, const int32_t *xrow, int n, int sort_t, int sort_k,
                     int sort_e, float *y, int gemv);
#endif
