/* plan.h: the memory plan of a model at a budget, computed without creating the expert store
 * (stream_plan: the arithmetic stream_open runs before it allocates), and what `petrel plan`
 * builds on it: the expected hit rate of the slots (from the model's usage history or a routing
 * trace), this machine's speeds (measured probes, cached), and a prediction of decode and prefill
 * speed from them.
 *
 * Invariants: stream_plan allocates nothing and reads no weights (it runs on an engine opened
 * with inspect_only); the plan stream_open uses is the one stream_plan returns for the same
 * options, so `petrel plan` prints what an open would do. Library code: nothing here prints,
 * exits or reads the environment; cache paths are given by the caller. */
#ifndef PETREL_MODEL_PLAN_H
#define PETREL_MODEL_PLAN_H
#include <stddef.h>
#include <stdint.h>

#include "experts/xs.h"
#include "model/weights.h"
#include "petrel.h"

typedef struct pt_mem_plan {
    uint64_t budget;          /* whole-process bytes; 0 = none */
    int ctx;                  /* planned context (KV, scratch) after clamping */
    int chunk, pf_rows;       /* forward chunk, layer-major prefill span (stream_chunk_plan) */
    uint64_t pf_bytes;        /* the span's state */
    int streaming;            /* routed experts come from the store (budget or explicit slots
                                 on a model with routed experts) */
    int needs_pack;           /* streaming was asked of a model that is not a pack (stream_open
                                 refuses it; the plan's figures use the checkpoint's formats) */
    int n_store_layers;       /* layers with a slot bank: MoE layers (+ the MTP layer's when its
                                 experts stream) */
    int n_moe_main;           /* MoE layers of the main model */
    uint64_t kind_bytes[WK_COUNT]; /* the model's bytes by class (weights.h) */
    uint64_t resident_bytes;  /* weights kept in memory: all of them, or without the routed
                                 experts (and the embedding left in the pack) when streaming */
    uint64_t embed_on_disk;   /* embed_tokens bytes read a row at a time from the pack */
    uint64_t kv_token;        /* latent KV bytes per token (the engine's scheme, every layer with a cache) */
    uint64_t kv_bytes;        /* kv_token * ctx */
    uint64_t scratch_bytes;   /* a session's arena (+ span + 64 MiB slack when streaming) */
    uint64_t record_bytes;    /* the largest routed-expert record */
    uint64_t total_bytes;     /* everything planned */
    xs_plan xs;               /* when streaming: the slots */
    char text[1024];          /* what petrel_engine_plan prints */
} pt_mem_plan;

/* One multi-threaded streaming read of buf[n] (AVX-512 loads and a 4 KiB-ahead prefetch where the
 * CPU has them, as the kernels read weights): GB/s. kind 0 prefetches every other 64-byte line
 * (the hardware's adjacent-line prefetch takes the rest), 1 every line, 2 every line with each
 * thread's range read as two interleaved streams, as the R16 kernels read a block pair. The
 * memory probe of plan and bench, which take the best of passes of all kinds, so the floor is
 * the fastest read: every line read 2-8 % faster than every other on the AMD dev box, two
 * streams another ~4 % there (2026-12-05), and on an Intel host the one-stream probe read less
 * than the kernels did at 2 threads. */
double plan_bw_pass(const uint64_t *buf, size_t n, int threads, int kind);
/* The sum of the words one thread of a pass of that kind reads over buf[n / 64 * 64] (tests:
 * every counted byte is read, whatever the kind). */
uint64_t plan_bw_checksum(const uint64_t *buf, size_t n, int kind);
/* GB/s reading random routed-expert records of a pack through the expert store's own I/O pool
 * (xs_read_probe: io_uring, O_DIRECT, whole records in flight as the store keeps them), ~limit
 * bytes or secs seconds; 0 when the model is not a pack. The SSD probe of plan and bench
 * (threads: unused, the pool's own). */
struct petrel_engine;
double plan_ssd_probe(const struct petrel_engine *e, int threads, uint64_t limit, double secs);

struct petrel_engine;
/* The plan for `budget` / `expert_slots` (0: none) and `ctx` tokens (0: 4096; clamped to the
 * model's max positions). PETREL_ENOMEM with the shortfall when the budget cannot be met,
 * PETREL_EFORMAT when a pack lacks an MoE layer's records. */
int stream_plan(const struct petrel_engine *e, uint64_t budget, int expert_slots, int ctx, pt_mem_plan *out,
                petrel_error *err);
/* The smallest budget (to 1 MiB) whose plan works at ctx: at least one slot per store layer. */
int plan_min_budget(const struct petrel_engine *e, int ctx, uint64_t *min, petrel_error *err);

/* ---- expected hit rate ---- */
/* From a usage history (`<model>.petrel-usage`, xs_usage_save's format): per layer, the share
 * of accesses that went to its `slots` most used experts (what a store pinning them hits),
 * weighted by accesses. *found = 0 (returns 0) when the file is missing; PETREL_EFORMAT when it
 * is malformed or its shape is not (n_layers, n_experts). */
int plan_usage_hit_rate(const char *path, int n_layers, int n_experts, int slots, double *rate, uint64_t *accesses,
                        int *found, petrel_error *err);

/* ---- this machine ---- */
typedef struct pt_machine {
    char cpu[128];            /* /proc/cpuinfo model name */
    int threads;              /* compute threads the figures are for */
    double mem_gbs;           /* streaming memory read bandwidth, all threads */
    double ssd_gbs;           /* O_DIRECT random reads of expert records, 16 in flight */
    double int8_gops;         /* int8-activation q4 / q8 matmul throughput at prefill batch sizes */
    double f32_gflops;        /* f32 matmul throughput (plain layouts) */
    char ssd_file[512];       /* what the SSD figure was measured on */
    int64_t when;             /* unix time of the measurement */
} pt_machine;
void plan_cpu_model(char *out, size_t n);
/* The probes, a few seconds in all: memory (a buffer of mem_mib MiB read by `threads`
 * threads), SSD (O_DIRECT random reads of the pack's expert records; 0 when e has none),
 * kernels (kn_matmul over int8 and f32 matrices at a 256-row batch). */
int plan_measure(const struct petrel_engine *e, int threads, int mem_mib, pt_machine *m, petrel_error *err);
/* Cache: a JSON object keyed by CPU model ({"<cpu>": {...}, ...}). Load: *found = 0 when the file
 * or the entry is missing. Save merges the entry into the file (written whole). */
int plan_machine_load(const char *path, const char *cpu, pt_machine *m, int *found, petrel_error *err);
int plan_machine_save(const char *path, const pt_machine *m, petrel_error *err);

/* ---- prediction ---- */
#define PLAN_RESIDENT_RATIO 1.12 /* resident decode / memory floor, measured 1.05-1.2 (RESULTS.md) */
/* Streamed decode with every expert a hit still ran 1.15x the resident time on the 1d1m slice
 * (8 GiB, 256 slots: 7.04 vs 8.10 tok/s, RESULTS.md 2026-12-03 15:40): the store's acquires, the
 * embedding row read from the pack. Its compute parts are scaled by this on top. */
#define PLAN_STREAM_RATIO 1.15
typedef struct pt_predict {
    double head_bytes, pre_bytes;     /* lm_head; the layers before the first routing */
    double layer_bytes;               /* non-expert bytes of the MoE layers, all of them */
    double expert_bytes_tok;          /* routed expert bytes a token runs (top-k, every layer) */
    double kv_read_bytes;             /* latent KV read at the decode context */
    double misses_tok, disk_bytes_tok;/* expected routed-expert reads per token */
    double decode_ms, decode_tok_s;   /* predicted */
    double decode_serial_ms;          /* the part serial with the reads (head, first layers) */
    double decode_attn_ms;            /* the attention core's and the indexer's f32 arithmetic (in decode_ms) */
    double decode_io_ms;              /* disk time per token */
    double prefill_tok_s;             /* predicted, for a prompt of `prompt` tokens */
    double prefill_compute_s, prefill_io_s;
    double open_s;                    /* opening a pack: its resident bytes read at the SSD's rate
                                         (O_DIRECT, as the open reads them; 0 when not a pack or
                                         the SSD is not measured). The copy's pages are zeroed on
                                         top: the 1d2m slice opened in 3.6-4.4 s where this says
                                         3.1 (bench/RESULTS.md 2026-12-05) */
} pt_predict;
/* hit: the expected hit rate of a streamed plan (ignored when resident); at: decode context;
 * prompt: prefill length. */
void plan_predict(const struct petrel_engine *e, const pt_mem_plan *p, const pt_machine *m, double hit, int at,
                  int prompt, pt_predict *out);
#endif
