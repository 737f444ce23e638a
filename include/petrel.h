/* petrel.h: the public C API of petrel, an inference engine for the GLM-5 family
 * (Hugging Face model_type "glm_moe_dsa").
 *
 * Two objects:
 *   petrel_engine   immutable after open: config, weights, kernels. Shared by sessions.
 *   petrel_session  one timeline: the latent KV cache (c, k_pe per token and layer, indexer keys
 *                   on full layers). Not thread-safe; one thread drives one session.
 *
 * Errors: every fallible call returns 0 on success or a negative PETREL_E* code, and fills the
 * caller-owned petrel_error with one line saying what is wrong and where. Library code never
 * exits or aborts on bad input. */
#ifndef PETREL_H
#define PETREL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    PETREL_OK = 0,
    PETREL_EINVAL = -1,      /* bad argument or input (token id out of range, empty prompt) */
    PETREL_EIO = -2,         /* a file could not be opened or read */
    PETREL_EFORMAT = -3,     /* a file is malformed (safetensors header, config.json, pack) */
    PETREL_ENOMEM = -4,      /* an allocation failed or a budget cannot be met */
    PETREL_EUNSUPPORTED = -5,/* valid input that petrel does not handle (yet) */
    PETREL_ERANGE = -6,      /* a context or capacity limit was reached */
};

typedef struct petrel_error {
    int code;        /* last error code, 0 if none */
    char msg[1024];  /* one line, no trailing newline */
} petrel_error;

typedef struct petrel_engine petrel_engine;
typedef struct petrel_session petrel_session;
typedef struct petrel_config petrel_config; /* defined in src/model/config.h */

/* A LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors in one folder). */
typedef struct petrel_lora_spec {
    const char *path;       /* the adapter folder */
    const char *name;       /* how /v1/models and messages call it; NULL: the folder */
    float scale;            /* multiplies the adapter's lora_alpha / r; 0 = 1 */
} petrel_lora_spec;

typedef struct petrel_open_opts {
    int n_threads;          /* compute threads; 0 = all cores */
    int verbose;            /* print the load plan on stderr */
    uint64_t mem_budget;    /* whole-process budget in bytes; 0 = unlimited */
    int expert_slots;       /* per-layer expert slots; 0 = derive from the budget / resident */
    int plan_context;       /* tokens of KV the memory plan reserves; 0 = 4096 */
    const char *trace_out;  /* write the routing trace (layer, token, expert ids) here at
                               petrel_engine_finish (or close); checked at open */
    int inspect_only;       /* weights stay mapped from the file (no copy into memory, no
                               relayout): for reading the model's description, not for speed */
    int load_progress;      /* print the load's progress on stderr (weights copied, expert records
                               read and checked) once it has run a second, even when not verbose;
                               the CLI sets it when stderr is a terminal */
    int no_verify;          /* packs opened with every expert resident: skip the checksums of the
                               routed-expert records read at open (resident tensors and experts
                               streamed under a budget are still checked) */
    /* Kernel choices: the engine's own kernel table, filled at open (two engines in one process
     * may differ; nothing process-wide changes). 0/NULL take the defaults:
     *   act_quant  1 int8 activations for q4 weights (the default), 2 also q8, -1 off (exact f32
     *              activations for plain-layout weights; r16-laid weights always use int8)
     *   relayout   1 lay q8/q4 matrices out 16 rows interleaved at open where the CPU has
     *              AVX-512 VNNI (the default), -1 keep the stored layout
     *   isa        "auto" (the default: the best this CPU has, AMX-INT8 included), "scalar",
     *              "avx2", "avx512" (AVX-512 VNNI, no AMX), "amx" (AMX-INT8 tiles for products
     *              of many rows: bitwise the avx512 results; refused without AMX), "amx-bf16"
     *              (amx + AMX-BF16 for bf16-weight products: faster, not exact) */
    int act_quant;
    int relayout;
    const char *isa;
    /* The R16 kernels' software prefetch (speed only, never the results): prefetch 0 = the
     * default (4096 bytes ahead: none did better on the Intel host; on the AMD box a sweep
     * stayed within its noise), -1 = none, else bytes ahead of the weight stream (64 .. 65536);
     * prefetch_level 0 = default (L1), 1 = L1, 2 = L2; prefetch_lines 0 = default (every 64-byte
     * line: on both CPU kinds products of several rows read 15-40 % faster than with every other
     * line), 1 = every other line, 2 = every line. */
    int prefetch;
    int prefetch_level;
    int prefetch_lines;
    /* Benchmarks: every main MoE layer's routed choices come from this recorded routing trace
     * (`# petrel-trace v1`, text or .gz: the trace's layers spread evenly over the model's MoE
     * layers; a row at position p takes the trace's token (p + petrel_session_route_offset) mod
     * its token count); the weights are the router's own scores of those experts, normalised as
     * usual. The trace must have the model's expert count and top-k. NULL: the routers choose. */
    const char *route_trace;
    /* The latent KV cache: one page pool per engine (src/kv). kv_type "f32" (the default: exact),
     * "bf16" (the indexer keys f32), "int8" (c int8 with a scale per token and layer, k_pe and the
     * indexer keys f32), or
     * "auto" (= bf16); NULL = f32. kv_bytes: the pool's size; 0 = with mem_budget the plan's KV
     * (plan_context tokens), else room for 16 sessions of plan_context (at least 4096) tokens,
     * at most half the machine's memory (pages are touched only when used). A forward that
     * does not fit in the pool fails with PETREL_ERANGE saying how many positions fit. */
    const char *kv_type;
    uint64_t kv_bytes;
    int kv_page_positions;  /* positions per KV page, 1..4096; 0 = 64 (tests use others: one page larger
                               than any context is the contiguous cache) */
    /* LoRA adapters, read and checked at open (an adapter for other shapes, a target the model
     * lacks, a rank mismatch, a bad file: one line, the open fails). Unmerged (the default)
     * they apply on top of any weight format, y = W x + scale B (A x), each session with its
     * own set: new sessions start with every adapter at its scale, or with none when
     * lora_select is set (a server picks one per request: petrel_session_set_lora).
     * lora_merge: W + scale B A computed once into f32 / bf16 copies of the targeted weights
     * (f32 / bf16 bases, resident experts): every session runs the adapted model. */
    const petrel_lora_spec *lora;
    int n_lora;             /* at most 8 */
    int lora_merge;
    int lora_select;
    /* Where the forward runs: NULL or "cpu" (the default), "cuda" or "cuda:N" (GPU N of a
     * binary built with `make cuda`: every weight resident in HBM, each session's latent cache
     * there too; see src/cuda/cu.h for what the GPU path does not run yet). vram_budget: bytes
     * of GPU memory the weights, caches and scratch may take; 0 = the GPU's free memory less
     * 1 GiB. Routed experts that do not fit it (or that the host streams under mem_budget)
     * live in tiers: vram_expert_slots per MoE layer in HBM (0: as many as the budget leaves)
     * over the host's RAM over the SSD. host_experts 1: a decode step's misses are split
     * between copies to the GPU and the host CPU computing them (a measured cost model; the
     * host's results agree with the GPU's to float rounding, not bitwise); 0 (default): copied. */
    const char *device;
    uint64_t vram_budget;
    int vram_expert_slots;
    int host_experts;
} petrel_open_opts;

/* Opens a model folder (Hugging Face checkpoint) or file. */
int petrel_engine_open(const char *path, const petrel_open_opts *opts, petrel_engine **out,
                       petrel_error *err);
void petrel_engine_close(petrel_engine *eng);
/* Writes what the engine owes at the end of a run (the routing trace of trace_out) and reports
 * whether that worked; close then writes nothing more. Without it, close writes the trace but
 * cannot report a failure. */
int petrel_engine_finish(petrel_engine *eng, petrel_error *err);
const petrel_config *petrel_engine_config(const petrel_engine *eng);
int petrel_engine_vocab_size(const petrel_engine *eng);
/* The longest context the model was trained for (config.json's max_position_embeddings). */
int petrel_engine_max_positions(const petrel_engine *eng);
/* 1 when token is one of the model's end-of-sequence ids (config.json and
 * generation_config.json's eos_token_id), else 0. */
int petrel_engine_is_eos(const petrel_engine *eng, int32_t token);
/* Greedy choice over logits[n] (n >= 1): the lowest index of the largest value that is not NaN;
 * n - 1 when every value is NaN. The same index on every CPU and kernel set. */
int32_t petrel_argmax(const float *logits, int n);
/* The memory plan made at open (resident weights, KV, scratch, expert slots), one item per line;
 * "" when every expert is resident. */
const char *petrel_engine_plan(const petrel_engine *eng);
/* Where the engine's forwards run, one line: "cpu", or the GPU and what it holds ("NVIDIA H200
 * (cuda:0, 139.8 GiB), weights 2.31 GB in HBM"). */
const char *petrel_engine_device(const petrel_engine *eng);
/* What the user of this open should be told about how it will run, one line without a trailing
 * newline, to follow the model's name; "" when nothing. Today: a pack whose experts are laid out
 * for AVX-512 VNNI kernels opened where the kernel set has none. */
const char *petrel_engine_note(const petrel_engine *eng);
/* A description of the open model for people (`petrel info`): the config, the layer schedule,
 * where the weights came from, the tensors by kind with their memory, the KV cache per token;
 * lines ending in '\n'. *out is malloc'd (free() it). */
int petrel_engine_describe(const petrel_engine *eng, char **out, petrel_error *err);

/* A model's side files, for front ends (no weights are read): `name` (tokenizer.json,
 * tokenizer_config.json, generation_config.json, chat_template.jinja) of the model at path:
 * MODEL/name for a folder (the folder of a .safetensors file), the copy stored inside a pack
 * (checked against its checksum). *out is malloc'd and NUL-terminated (free() it); *len is its
 * length without the NUL (len may be NULL). PETREL_EIO naming the model when it has no such
 * file. */
int petrel_model_file(const char *model, const char *name, char **out, size_t *len,
                      petrel_error *err);
/* 1 when the model has the side file `name` (found where petrel_model_file looks; a pack's copy
 * is not read), 0 when not; < 0 with a message when the model cannot be opened. */
int petrel_model_has_file(const char *model, const char *name, petrel_error *err);
/* 1 when path is a petrel pack file (by its magic), else 0. */
int petrel_model_is_pack(const char *path);
/* The model's chat template, from the same places: chat_template.jinja, else the
 * "chat_template" of tokenizer_config.json (a string, or a list of {name, template} from which
 * "default" is taken, else the first). Same ownership as petrel_model_file. */
int petrel_model_chat_template(const char *model, char **out, size_t *len, petrel_error *err);

/* A session with room for max_tokens positions (prompt plus generation). */
int petrel_session_create(petrel_engine *eng, int max_tokens, petrel_session **out,
                          petrel_error *err);
void petrel_session_free(petrel_session *s);
int petrel_session_len(const petrel_session *s);
/* Drops cached positions >= n_past (speculative rollback, prompt reuse). */
int petrel_session_truncate(petrel_session *s, int n_past, petrel_error *err);

/* The adapters loaded at open (petrel_open_opts.lora), by index. */
int petrel_engine_lora_count(const petrel_engine *eng);
const char *petrel_engine_lora_name(const petrel_engine *eng, int i);
/* The adapters this session's rows apply: idx[0..n) into the engine's, each at scale[i] (NULL:
 * the open option's scales); n = 0: none (the base model). Only before the session's first
 * position (a session's KV is made by one adapter set); refused when the adapters were merged.
 * The prefix cache and session files keep the set apart: a cached prefix of another set never
 * matches, a session file made under another set does not load. */
int petrel_session_set_lora(petrel_session *s, const int *idx, const float *scale, int n,
                            petrel_error *err);

/* Persistence: save writes the session's tokens and latent KV (the pool's scheme) to a file,
 * whole or not at all; load replaces an empty or used session's contents with a file's. A
 * file made for another model (its identity: config shapes and tensor checksums), another KV
 * scheme, a newer format, or truncated / corrupt, is refused with one line and changes nothing.
 * tokens: the ids of the cached positions (valid until the session changes). */
int petrel_session_save(const petrel_session *s, const char *path, petrel_error *err);
int petrel_session_load(petrel_session *s, const char *path, petrel_error *err);
int petrel_session_tokens(const petrel_session *s, const int32_t **ids);
/* A new session holding src's positions, sharing its pages copy-on-write (no copy until one of
 * them writes into a shared page): n samples of one prompt, a verify window on a copy. */
int petrel_session_fork(const petrel_session *src, petrel_session **out, petrel_error *err);
/* A snapshot: src's positions and tokens as they are now, sharing its pages copy-on-write (no
 * copy, no scratch), for writing a session file off the forward's thread while the session goes
 * on. Its file is the one petrel_session_save would have written at that moment. tokens: the
 * ids of its positions; id: what its file is made for (the model's identity and the session's
 * adapter set), e.g. to name files. PETREL_EUNSUPPORTED for a session on the GPU. */
typedef struct petrel_snapshot petrel_snapshot;
int petrel_session_snapshot(const petrel_session *src, petrel_snapshot **out, petrel_error *err);
int petrel_snapshot_tokens(const petrel_snapshot *k, const int32_t **ids);
uint64_t petrel_snapshot_id(const petrel_snapshot *k);
int petrel_snapshot_save(const petrel_snapshot *k, const char *path, petrel_error *err);
void petrel_snapshot_free(petrel_snapshot *k);
/* The engine's prefix cache: put registers the session's full pages under their token prefix;
 * get fills an EMPTY session with the longest cached prefix of ids[0..n) (whole pages) and
 * returns its length (0: none), so only the rest needs a prefill. Pass n - 1 for a prompt whose
 * last token must run for its logits. Entries only the cache holds are evicted (least recently
 * used first) when the pool runs short. */
int petrel_session_prefix_put(petrel_session *s, petrel_error *err);
int petrel_session_prefix_get(petrel_session *s, const int32_t *ids, int n, petrel_error *err);

/* The engine's KV pool in positions: obtainable now (free pages and pages only the prefix cache
 * holds) and in all, and the page size; a session's reserved positions (whole pages). For
 * admission decisions (a server that would rather queue a request than fail it mid-way). Any
 * output may be NULL; asking for the page size alone takes no lock. */
void petrel_kv_usage(const petrel_engine *e, long long *free_positions, long long *total_positions, int *page_positions);
int petrel_session_kv_reserved(const petrel_session *s);

/* The expert store's counters since open (all zero when every routed expert is resident). */
typedef struct petrel_expert_stats {
    uint64_t accesses;      /* routed experts requested (hits + misses) */
    uint64_t hits;          /* served from memory (a prefetch counts as a hit) */
    uint64_t bytes_read;    /* expert bytes read from the model file */
    uint64_t read_failures; /* reads that failed after their retries */
} petrel_expert_stats;
void petrel_engine_expert_stats(const petrel_engine *e, petrel_expert_stats *out);

/* Runs n tokens at positions len..len+n-1 as one batch of rows and appends them to the cache.
 * logits: NULL, or [n, vocab] (all rows) when all_logits, else [vocab] for the last row. */
int petrel_session_forward(petrel_session *s, const int32_t *ids, int n, float *logits,
                           int all_logits, petrel_error *err);

/* 1 when the model has an MTP (next-token prediction) layer, the draft head of speculative
 * decoding. */
int petrel_engine_has_mtp(const petrel_engine *eng);
/* The MTP head's logits over a prompt: runs ids[0..n) through the empty session s (appending
 * them, as petrel_session_forward) and the MTP layer over them, writing logits [n - 1][vocab]:
 * row i from the main model's final-normed hidden state at position i and the embedding of
 * ids[i + 1] (its prediction for position i + 2). PETREL_EUNSUPPORTED without an MTP layer;
 * PETREL_EINVAL for n < 2 or a session that already holds tokens. */
int petrel_session_mtp_logits(petrel_session *s, const int32_t *ids, int n, float *logits,
                              petrel_error *err);
/* Batches: rows of many sessions in one forward pass. A row is (session, token, wants logits)
 * and takes its session's next position; a session may contribute several rows (a prompt chunk,
 * a verify window), which must be consecutive in the list and at most its chunk (the largest
 * petrel_session_forward would run at once: 512 rows resident, more under a budget). One call
 * runs every row through the model once (each weight read once for all rows) and appends each
 * row to its session's cache. A row's result never depends on which other rows share the
 * batch: its logits are bitwise those of the same row run alone. A failed call appends nothing.
 * The batch object holds the scratch for up to max_rows rows; sessions may be driven from
 * different threads between batches, one batch (or session call) at a time per engine. */
typedef struct petrel_row {
    petrel_session *session; /* borrowed; must belong to the batch's engine */
    int32_t token;
    int want_logits;         /* 1: this row's logits are written */
} petrel_row;
typedef struct petrel_batch petrel_batch;
int petrel_batch_create(petrel_engine *eng, int max_rows, petrel_batch **out, petrel_error *err);
void petrel_batch_free(petrel_batch *b);
/* logits: NULL, or [rows with want_logits][vocab] in row order. */
int petrel_batch_forward(petrel_batch *b, const petrel_row *rows, int n, float *logits,
                         petrel_error *err);
/* With petrel_open_opts.route_trace: this session's rows take trace tokens from offset on
 * (sessions of a batch benchmark then route like different tokens). */
void petrel_session_set_route_offset(petrel_session *s, int offset);
/* The largest number of rows one session may contribute to a batch. */
int petrel_session_chunk(const petrel_session *s);

/* Progress of long forward calls (prompts): fn(user, done, total) after each chunk or layer of
 * work, done rising to total within one petrel_session_forward call (units: rows x layers).
 * fn NULL: none. */
typedef void (*petrel_progress_fn)(void *user, long long done, long long total);
void petrel_session_set_progress(petrel_session *s, petrel_progress_fn fn, void *user);

#ifdef __cplusplus
}
#endif
#endif
