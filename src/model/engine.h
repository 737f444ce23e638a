/* engine.h: the internal layout of petrel_engine and petrel_session, shared by the model code
 * (forward, mla, dsa, moe) and by tests that check intermediate results.
 *
 * A forward call runs a batch of T rows (consecutive positions of one session) through every
 * layer. Scratch comes from the session's arena, sized at create for `max_batch` rows and the
 * session's capacity, so the token loop never allocates. */
#ifndef PETREL_MODEL_ENGINE_H
#define PETREL_MODEL_ENGINE_H
#include <stddef.h>

#include "base/clock.h"
#include "io/safetensors.h"
#include "kernels/kernels.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/weights.h"

struct petrel_engine {
    petrel_config cfg;
    kn_table kt;        /* the kernels this engine runs (open options isa, act_quant, relayout) */
    st_set *src;        /* owned: the checkpoint maps */
    st_wsource st_src;  /* the weight source over src */
    model_w w;
    char path[4096];
    /* colibri artifacts (src/io/colibri.h); src is NULL then. */
    struct colibri *coli; /* owned, NULL unless the model is a colibri folder */
    int no_indexer;       /* 1: full indexer layers have no DSA indexer weights (colibri build
                             without out-idx shards): only contexts up to index_topk keys are
                             exact; longer ones must fail (forward checks this) */
    /* petrel packs (src/io/pack.h); src is NULL then. Weights are views into the pack's map. */
    struct pack *pack;    /* owned, NULL unless the model is a pack file */
    /* Expert streaming (src/model/stream.c): with a budget, routed experts come from the store
     * instead of the map. moe_index[l] is layer l's MoE index (store layer) or -1. */
    struct xs_store *xs;  /* owned, NULL when every expert is resident */
    int *moe_index;       /* owned [L + 1] (the MTP layer last) */
    int *moe_layer;       /* owned [L + 1]: MoE index -> checkpoint layer (messages name layers so) */
    char plan_text[1024]; /* the memory plan, printed at open when verbose */
    int n_moe;            /* MoE layers with routed experts (store / trace layers) */
    /* (Lookahead guesses and their precision by rank are the expert store's: xs_la_*.) */
    /* Routing trace recording (--trace-out): rows of one forward batch are buffered
     * [row][moe layer][K] and appended in token order when the batch ends. Like the lookahead
     * statistics above, this assumes one session runs at a time on the engine. */
    struct xs_trace *trace;  /* owned, NULL when not recording */
    int32_t *trace_buf;      /* owned [chunk][n_moe][K] */
    /* Rows per forward chunk (prefill): PT_CHUNK_RESIDENT; with a memory budget the largest of
     * 256..2048 whose scratch takes at most 1/10 of the budget (stream.c). Prefill runs the
     * routed experts expert-major per chunk, so a bigger chunk reads/streams each expert's
     * weights fewer times per prompt. */
    int chunk;
    /* Streaming prefill runs up to pf_rows prompt rows layer-major (a span of fwd_rows): every
     * layer's attention chunk by chunk, then its MoE once over all of them, so each expert is
     * read once per pf_rows rows instead of once per chunk. 0: off (chunk by chunk). */
    int pf_rows;
    char trace_out[4096];
    struct kv_pool *kv;      /* owned: the sessions' latent KV pages (src/kv) */
    uint64_t identity;       /* the model's identity in session files (engine.c) */
    int kv_scheme;           /* kv_scheme (src/kv/kv.h) of the pool, from the open option kv_type */
    /* Trace-driven routing (open option route_trace): the trace and, per MoE index, its layer. */
    struct xs_trace *route;  /* owned, NULL when the routers choose */
    int *route_layer;        /* owned [n_moe] */
    /* LoRA adapters (src/model/lora.h): loaded at open; lora_default is the set new sessions
     * start with (every adapter at its scale, or none under lora_select). lora_merged: baked
     * into the weights at open (sessions then carry no set). */
    lora_adapter *lora[LORA_SET_MAX]; /* owned */
    float lora_scale[LORA_SET_MAX];
    int n_lora, lora_merged, lora_max_rank;
    lora_set lora_default;
    uint64_t lora_bytes;     /* the adapters' arrays and merged copies (in the memory plan) */
    /* The CUDA backend (src/cuda/cu.h, open option device "cuda[:N]"): the weights in HBM; every
     * forward of the engine's sessions runs there. NULL: the CPU runs them. */
    struct cu_model *cu;
};

/* A model given as a regular file that is not a pack: 0 if it may be a safetensors file (st_open
 * judges it), else PETREL_EFORMAT with a line saying what it is not (or that it is a pack whose
 * magic is damaged). */
int engine_check_model_file(const char *path, petrel_error *err);

/* Expert streaming glue (stream.c). */
int stream_open(petrel_engine *e, const petrel_open_opts *opts, petrel_error *err);
void stream_close(petrel_engine *e);
/* Load progress on stderr ("loading weights: 40% of 2.68 GB"), for pack_load_resident and
 * xs_load_all: in steps of 10 %, only once the load has run a second unless verbose. */
typedef struct load_pg {
    const char *what, *note; /* "weights"; appended to each line, or NULL */
    int verbose, shown, last;
    uint64_t t0;
} load_pg;
void load_pg_fn(uint64_t done, uint64_t total, void *ud);
/* A pack opened with every expert resident: reads every record into the pack's copy when it
 * holds them, else only checks them (o->no_verify: skips the checksums, and the check-only
 * pass entirely), through the expert I/O pool. */
int stream_load_experts(petrel_engine *e, const petrel_open_opts *o, petrel_error *err);
/* Trace recording: note one MoE layer's routing of a batch; flush the batch in token order. The
 * recorder (trace, trace_buf) is written through the engine's pointers: one forward at a time
 * records (petrel_batch_forward refuses mixed-session batches while recording). */
void stream_trace_note(const petrel_engine *e, int layer, const int32_t *idx, int T, int K);
int stream_trace_flush(const petrel_engine *e, int T, petrel_error *err);
#define PT_CHUNK_RESIDENT 512
/* lookahead: a rank of guesses is read from the SSD while at least this share of it is right */
#define PT_LOOKAHEAD_GATE 0.8
#define PT_CHUNK_MIN 256
#define PT_CHUNK_MAX 2048
#define PT_CHUNK_BUDGET_DIV 10 /* a budgeted chunk's scratch stays within budget / this */
#define PT_PF_BUDGET_DIV 16    /* the layer-major prefill rows (pf_rows) within budget / this */
/* Arena bytes a session of ctx tokens with forward chunks of `chunk` rows takes (memory plans):
 * plan_session_arena (src/model/scratch.h). */
size_t session_scratch_estimate(const petrel_config *c, int ctx, int chunk);
/* The forward chunk and layer-major prefill span for a budget (0: none) and planned context
 * (stream.c), with the span's bytes. */
void stream_chunk_plan(const petrel_config *c, int ctx, uint64_t budget, int *chunk, int *pf_rows, size_t *pf_bytes);
/* Bytes per row of a session's layer-major prefill state (petrel_session.pf; pf_carve). */
size_t session_prefill_row_bytes(const petrel_config *c, int ctx);

/* Test hook: AUTO and ABSORBED both run the absorbed form (every row, row independence);
 * RECONSTRUCTED forces its slower twin. */
typedef enum { MLA_AUTO = 0, MLA_ABSORBED = 1, MLA_RECONSTRUCTED = 2 } mla_mode;

/* Optional capture of intermediate results for tests (all borrowed, may be NULL). */
typedef struct fwd_trace {
    float *hidden;      /* [L + 1][T][H]: embeddings, each layer's output; last is final-normed */
    int32_t **topk;     /* [L] -> [T][topk_stride] selections of full layers (sorted, -1 padded) */
    int topk_stride;
} fwd_trace;

/* Time spent per part of the forward pass (nanoseconds, summed over calls), for `petrel bench`. */
typedef enum { FS_ATTN, FS_INDEXER, FS_DENSE, FS_ROUTER, FS_EXPERTS, FS_SHARED, FS_HEAD, FS_OTHER, FS_COUNT } fwd_part;
extern const char *const fwd_part_names[FS_COUNT];
typedef struct fwd_stats {
    uint64_t ns[FS_COUNT];
    uint64_t rows;      /* rows (tokens) run */
    uint64_t experts_run; /* routed experts run, summed over MoE layers and forwards: a batch's
                             union of its rows' choices counts each expert once per layer */
    uint64_t io_ns;     /* part of FS_EXPERTS spent waiting for expert reads */
} fwd_stats;

typedef struct arena {
    uint8_t *base;      /* owned */
    size_t cap, used;
} arena;

struct petrel_session {
    petrel_engine *eng; /* borrowed */
    int cap;            /* positions the cache holds */
    int len;            /* positions filled */
    int max_batch;      /* rows per forward chunk */
    int n_layers;       /* layers with a cache: num_hidden_layers, + 1 for the MTP layer */
    int mtp_len;        /* positions of the MTP layer's cache filled (fwd_mtp) */
    /* The latent KV cache: per position and layer c [kv_lora_rank], k_pe [qk_rope_head_dim],
     * indexer keys [index_head_dim] on full layers, in pages of the engine's pool (src/kv). */
    struct kv_seq *kv;  /* owned: the session's page table */
    arena ar;
    mla_mode mla;       /* test hook: force a form */
    int dsa_always_score; /* test hook: score and top-k even when every causal key fits */
    int route_offset;   /* trace-driven routing: rows take trace token (position + this) */
    fwd_trace *trace;   /* test hook */
    fwd_stats stats;    /* accumulated timings; reset by the caller */
    petrel_progress_fn progress; /* optional, with progress_user (petrel_session_set_progress) */
    void *progress_user;
    long long pg_done, pg_total; /* units of the running forward call done before this batch / in all */
    /* Layer-major prefill state for up to pf.rows rows (engine pf_rows; block NULL when off):
     * one block laid out by pf_carve (src/model/scratch.h): the rows' residual, MoE input and
     * output, routing, DSA selections (stride sel_stride) and RoPE tables. */
    struct {
        uint8_t *block; /* owned */
        int rows, sel_stride;
    } pf;
    lora_set lora;      /* the adapters this session's rows apply (empty: the base model) */
    /* While a forward runs on this session as scratch: row r's adapter set (its segment's
     * session's; NULL entries: none), or row_lora NULL when no row has one. */
    const lora_set **row_lora;
    const lora_set **row_lora_buf; /* owned [row_lora_cap] */
    int row_lora_cap;
    struct cu_kv *cu;   /* owned: the latent cache in HBM when the engine runs on the GPU */
};

void *ar_alloc(arena *a, size_t bytes);

/* A batch's rows, grouped: segment g is rows [r0, r0 + n) of session s, at positions
 * s->len .. s->len + n - 1. */
typedef struct fwd_seg {
    petrel_session *s; /* borrowed */
    int r0, n;
} fwd_seg;
/* LoRA rows (engine.c): session_lora_alloc makes room for `rows` row sets; session_lora_rows
 * points scr->row_lora at each row's set for a forward over seg (NULL when no row has one). */
int session_lora_alloc(petrel_session *s, int rows);
int session_lora_rows(petrel_session *scr, const fwd_seg *seg, int nseg, int T, petrel_error *err);

#define FWD_ROWS_GROUP 16 /* one-row segments whose attention shares its head products */
/* THE layer loop: runs rows ids[0..T) of the segments through every layer. Scratch for the
 * rows comes from scr's arena (scr is one of the sessions, or a batch's cache-less scratch
 * session); each segment's DSA selection and attention run over its own session's cache with
 * that session's arena. logits: [nlog][V] for rows lrows[0..nlog) (ascending; lrows NULL: the
 * last nlog rows), or NULL.
 * Appends every row to its session (len += n) on success; on failure no length changes. */
int fwd_rows(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *ids, int T, float *logits,
             const int32_t *lrows, int nlog, petrel_error *err);
/* fwd_rows that also writes every row's final-normed hidden state into hidden [T][H] (NULL:
 * none): the MTP head's input for speculative decoding (src/runtime/spec.c). */
int fwd_rows_h(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *ids, int T, float *logits,
               const int32_t *lrows, int nlog, float *hidden, petrel_error *err);
/* petrel_session_forward that writes each chunk's final-normed hidden states into hidden
 * [session_span_rows][H] and then calls fn(user, hidden, done, T) with the chunk's first id's
 * index and its row count (a failure from fn fails the call, truncating the session back). */
int session_forward_h(petrel_session *s, const int32_t *ids, int n, float *logits, int all_logits, float *hidden,
                      int (*fn)(void *user, const float *hidden, int done, int T, petrel_error *err), void *user, petrel_error *err);
int session_span_rows(const petrel_session *s);
/* Timings accumulated by a batch's forwards (petrel bench --batch). */
const fwd_stats *batch_stats(const petrel_batch *b);
/* The MTP (NextN) head over rows of segments through the same attention and MoE code as the
 * main layers (layer index num_hidden_layers; dense attention over the MTP cache): row r is
 * eh_proj(concat(enorm(embed(next[r])), hnorm(hidden[r]))) at MTP position s->mtp_len + i,
 * where hidden is the main model's final-normed state of the same position; then the decoder
 * layer, shared_head.norm and lm_head into logits [T][V]. Appends to the MTP caches. */
int fwd_mtp(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *next, const float *hidden, int T, float *logits,
            petrel_error *err);
/* fwd_mtp with logits only for rows lrows[0..nlog) (ascending; lrows NULL: every row) into
 * logits [nlog][V], and the decoder layer's output before shared_head.norm of every row into
 * hout [T][H] (NULL: none), which a chained draft takes as its hidden input. */
int fwd_mtp_h(petrel_session *scr, const fwd_seg *seg, int nseg, const int32_t *next, const float *hidden, int T, float *logits,
              const int32_t *lrows, int nlog, float *hout, petrel_error *err);
/* The MTP cache for speculative decoding (engine.c): session_mtp_truncate drops MTP rows >= n
 * (drafted rows whose hidden was the MTP's own); session_mtp_skip fills rows mtp_len..n-1 whose
 * main hidden state is not at hand (drafting was off) with zero latents, so that later rows
 * attend to them as keys of score 0 and value 0, and sets mtp_len = n (n <= s->len + 1). */
void session_mtp_truncate(petrel_session *s, int n);
int session_mtp_skip(petrel_session *s, int n, petrel_error *err);
/* petrel_batch_forward that also writes every row's final-normed hidden state into hidden
 * [n][H] (NULL: none); batch_mtp runs the MTP head over rows of many sessions with the batch's
 * scratch: row r is (session, next token t[i+1], want_logits) at the session's next MTP position,
 * hidden [n][H] its main hidden state; logits [rows with want_logits][V], hout [n][H] (or NULL). */
int batch_forward_h(petrel_batch *b, const petrel_row *rows, int n, float *logits, float *hidden, petrel_error *err);
int batch_mtp(petrel_batch *b, const petrel_row *rows, int n, const float *hidden, float *logits, float *hout, petrel_error *err);
/* One session's rows ids[0..T) at positions s->len.. (the one-segment fwd_rows); logits [T][V]
 * for rows from logits_from on (or NULL). T <= max_batch, or up to pf.rows (a span). */
int fwd_batch(petrel_session *s, const int32_t *ids, int T, float *logits, int logits_from, petrel_error *err);

/* Per-layer pieces (forward.c drives them). */
typedef struct rope_rows {
    float *cos_, *sin_;  /* [T][rope_dim/2] */
} rope_rows;

/* Attention buffers for T rows (attn_segs' scratch; attn_carve). */
typedef struct attn_bufs {
    float *x, *y, *qa, *q, *kva, *o; /* [T][H], [T][H], [T][q_lora_rank], [T][heads*qk_head_dim], [T][kv_lora_rank+rope], [T][heads*v_head_dim] */
} attn_bufs;
/* Layer l's attention for the T rows of segments seg (segment g's rows at positions
 * seg[g].s->len ..): x is the rows' input-normed h; projections over all T rows with scr's
 * scratch; writes each row's latent KV (and indexer keys on full layers) into its session's
 * cache, selection and attention per segment, then h += attention output. On a full indexer
 * layer it fills sel/sel_n (stride sel_stride), which the shared layers after it reuse. */
int attn_segs(petrel_session *scr, int l, const layer_w *lw, float *h, const float *x, int T, const fwd_seg *seg, int nseg,
              const rope_rows *rope, int32_t *sel, int *sel_n, int sel_stride, const attn_bufs *b, petrel_error *err);
int mla_attention(petrel_session *s, int l, const layer_w *lw, const float *q, int T, const int32_t *sel, const int *sel_n,
                  int sel_stride, float *out, petrel_error *err);
size_t mla_scratch_bytes(const petrel_config *c, int T, int N);
/* Attention of m rows of m different sessions (sess[i]'s next row is batch row rows[i]; a
 * batch's decode rows): the head products over all m rows at once, scratch from scr's arena
 * (mla_rows_scratch_bytes), each row's scores from its own session's arena. */
int mla_attention_rows(petrel_session *scr, int l, const layer_w *lw, petrel_session *const *sess, const int32_t *rows, int m,
                       const float *q, const int32_t *sel, const int *sel_n, int sel_stride, float *out, petrel_error *err);
size_t mla_rows_scratch_bytes(const petrel_config *c, int m);
int dsa_select(petrel_session *s, int l, const layer_w *lw, const float *x, const float *qr, int T,
               const rope_rows *rope, int32_t *sel, int *sel_n, int sel_stride, petrel_error *err);
/* Layer l's MoE over T rows: x [T][H] normed; routes into idx/wts [T][K] (caller's), sorts
 * the choices by expert (into rl [T][K], or arena scratch when NULL), lets the expert store
 * (src/experts/run.c) hand the chosen experts back in the order to run them, and writes
 * out [T][H] = routed sum (ascending expert id per row, whatever order the experts ran in) +
 * shared expert. T > max_batch (a span) runs each expert once, ascending. route_pos [T]: the
 * rows' trace tokens under trace-driven routing (engine route), else ignored. next_l: the next
 * MoE layer (its router guesses the experts a store should read early), or -1. */
int moe_forward(petrel_session *s, int l, const layer_w *lw, int next_l, const float *x, int T, int32_t *idx, float *wts,
                int32_t *rl, const int32_t *route_pos, float *out, petrel_error *err);
/* The next MoE layer's guesses from x [T][H], for a store that wants them (else nothing). */
void moe_prefetch_next(petrel_session *s, int next_l, const float *x, int T);
/* The dense MLP of layer l over T rows (rs: the rows' LoRA sets, or NULL). */
int mlp_dense(petrel_session *s, int l, const layer_w *lw, const lora_set *const *rs, const float *x, int T, float *out, petrel_error *err);
/* Routing for one row (exposed for tests): writes K expert ids (ascending selection order not
 * guaranteed) and their final weights. scratch needs 2 * E floats. */
void moe_route(const petrel_config *cfg, const float *logits, const float *bias, int32_t *idx, float *wts, float *scratch);
/* The weights of given choices idx[K] (trace-driven routing): the router's sigmoid scores of
 * those experts, normalised and scaled as moe_route does. */
void moe_route_given(const petrel_config *cfg, const float *logits, const int32_t *idx, float *wts);
#endif
