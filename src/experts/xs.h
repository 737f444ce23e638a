/* xs.h: the expert store ("xs_"). Routed experts live on disk as one contiguous, 4 KiB-aligned
 * record per (MoE layer, expert) with an xxh64 checksum; the store keeps a fixed number of them
 * in RAM slots per layer and reads the rest on demand.
 *
 *   plan     budget arithmetic: resident + KV + scratch + layers x slots x slot_bytes <= budget
 *   source   where records are (file + per-record offset/bytes/checksum + a views callback); the
 *            store knows nothing about pack formats, so it is tested with synthetic files
 *   store    per-layer slot banks, expert -> slot map, policy (adaptive decayed-frequency/LRU + pins
 *            learned from usage history), acquire/release with refcounts, prefetch hints,
 *            statistics; all slot memory allocated once at create (4096-aligned, O_DIRECT-able)
 *   io       one I/O thread on io_uring (or pread threads), O_DIRECT when the file system
 *            allows it, one read per expert, checksum on every read, and one fault seam
 *            (xs_io_fault_hook) that every completed read passes through
 *   load     xs_load_all: every record read once through the same pool and checks (a model
 *            whose experts are all resident)
 *   trace    routing traces (text, `# petrel-trace v1 ...`), replay of a policy against the
 *            offline optimum (Belady/MIN) at equal capacity
 *
 * Layer indices here are MoE-layer indices 0..n_layers-1 (the caller maps model layers).
 * Threading: one compute thread drives acquire/release/prefetch (calls are serialised by the
 * store's mutex anyway); the I/O threads only fill slots and signal completions. */
#ifndef PETREL_EXPERTS_XS_H
#define PETREL_EXPERTS_XS_H
#include <stddef.h>
#include <stdint.h>

#include "petrel.h"
#include "quant/qtypes.h"

#define XS_ALIGN 4096u
#define XS_MAX_EXPERTS 1024 /* routed experts per layer the store takes */

/* ---------------------------------------------------------------- plan */
typedef struct xs_plan_in {
    uint64_t budget;          /* whole-process bytes; 0 = unlimited */
    int expert_slots;         /* explicit slots per layer; 0 = derive from the budget */
    uint64_t resident_bytes;  /* non-expert weights kept in RAM */
    uint64_t kv_bytes;        /* KV caches at their planned size */
    uint64_t scratch_bytes;   /* activations, arenas, I/O queues, everything else */
    uint64_t record_bytes;    /* the largest expert record (slot size before rounding) */
    int n_layers;             /* MoE layers */
    int n_experts;            /* routed experts per layer */
    int min_slots;            /* fewest slots per layer that can run (top-k); 0 means 1 */
} xs_plan_in;

typedef struct xs_plan {
    xs_plan_in in;
    uint64_t slot_bytes;      /* record_bytes rounded up to XS_ALIGN */
    int slots_per_layer;      /* in [max(1,min_slots), n_experts] */
    uint64_t expert_bytes;    /* n_layers * slots_per_layer * slot_bytes */
    uint64_t total_bytes;     /* resident + kv + scratch + expert_bytes */
    int all_resident;         /* slots_per_layer == n_experts: no eviction ever */
} xs_plan;

/* Computes the slots per layer. With a budget and no explicit slots: as many as fit (capped at
 * n_experts). With explicit slots: checks them against the budget (if any). Refuses with
 * PETREL_ENOMEM and a message naming the shortfall when resident + KV + scratch alone exceed
 * the budget or fewer than min_slots per layer fit. */
int xs_plan_make(const xs_plan_in *in, xs_plan *out, petrel_error *err);
/* Printable plan, one item per line ("resident weights   9.81 GiB\n..."); returns length. */
int xs_plan_format(const xs_plan *p, char *buf, size_t n);

/* ---------------------------------------------------------------- source */
typedef struct xs_source {
    void *ctx;                /* borrowed, passed to the callbacks */
    const char *path;         /* the record file: the store opens it itself (O_DIRECT probe);
                                 NULL: use fd as is (buffered) */
    int fd;                   /* borrowed; used only when path is NULL */
    int n_layers, n_experts;
    int top_k;                /* experts a row chooses (the lookahead keeps a precision per rank) */
    /* Where record (layer, expert) lies; offset must be XS_ALIGN-aligned for O_DIRECT. */
    int (*record)(void *ctx, int layer, int expert, uint64_t *offset, uint64_t *bytes,
                  uint64_t *xxh64, petrel_error *err);
    /* Views of gate/up/down inside a loaded record (rec: the slot, XS_ALIGN-aligned). May be
     * NULL (views are then zeroed; tests use the raw bytes). */
    int (*views)(void *ctx, int layer, int expert, const uint8_t *rec, pt_wview *gate,
                 pt_wview *up, pt_wview *down, petrel_error *err);
    /* Borrowed [n_layers] or NULL: the number messages give layer l ("layer 2 expert 5", the
     * checkpoint layer, as `petrel info` and the pack's own messages count); NULL names it l. */
    const int *layer_ids;
} xs_source;

/* ---------------------------------------------------------------- policy */
enum { XS_POL_LRU = 0, XS_POL_FREQ = 1, XS_POL_ADAPT = 2 };
#define XS_POL_NSHADOW 6      /* XS_POL_ADAPT: candidate half-lives 16, 32, ... 512 */
typedef struct xs_policy_params {
    int kind;                 /* XS_POL_ADAPT (default): XS_POL_FREQ with the half-life picked
                                 online by shadow banks (policy.c, bench/POLICY.md);
                                 XS_POL_FREQ: evict the lowest decayed use count, ties to the
                                 least recent; XS_POL_LRU: least recent */
    double halflife;          /* XS_POL_FREQ: uses halve in weight after this many accesses of
                                 the layer (acquire calls); XS_POL_ADAPT: the starting choice;
                                 default 64 */
    double pin_frac;          /* fraction of slots pinned to the most used experts (history
                                 counts); default 0.10 */
    int repin_every;          /* recompute pins every N accesses of a layer; default 64 */
    double adapt_window;      /* XS_POL_ADAPT: half-life (accesses) of the shadow hit scores
                                 that pick the half-life; default 512 (0 = default) */
} xs_policy_params;
void xs_policy_defaults(xs_policy_params *p);

/* Per-layer policy state, shared by the store and the replay (no I/O). */
typedef struct xs_pol {
    xs_policy_params prm;
    int n_experts, cap, n_pins;
    double *score;            /* owned [E]: decayed use count (in units of the growing inc) */
    uint64_t *uses;           /* owned [E]: lifetime use count (history + this run) */
    uint64_t *last;           /* owned [E]: clock of the last use, 0 = never */
    uint8_t *pinned;          /* owned [E] */
    uint64_t clock;           /* accesses of this layer so far */
    double inc;               /* current weight of one use (grows instead of decaying all) */
    int since_repin;
    /* XS_POL_ADAPT only (NULL otherwise) */
    double *sh_score;         /* owned [NSHADOW][E]: decayed counts, one half-life per shadow */
    uint8_t *sh_res;          /* owned [NSHADOW][E]: resident in that shadow bank */
    int *sh_slot;             /* owned [NSHADOW][cap]: the shadow banks' contents */
    int *tok;                 /* owned [E]: distinct experts of the current access */
    uint8_t *in_tok;          /* owned [E] */
    double sh_inc[XS_POL_NSHADOW], sh_hits[XS_POL_NSHADOW];
    int sh_n[XS_POL_NSHADOW], sh_best, n_tok;
} xs_pol;
int xs_pol_init(xs_pol *p, int n_experts, int cap, const xs_policy_params *prm);
void xs_pol_deinit(xs_pol *p);
void xs_pol_begin(xs_pol *p);        /* one access of the layer begins (a token / a batch) */
void xs_pol_use(xs_pol *p, int e);   /* expert e is used in this access */
/* 1 if a should be evicted before b (both resident, neither in use). */
int xs_pol_evict_before(const xs_pol *p, int a, int b);
/* The half-life the eviction order currently uses (XS_POL_ADAPT: the best shadow's). */
double xs_pol_halflife(const xs_pol *p);
void xs_pol_repin(xs_pol *p);        /* pins the n_pins most used experts */

/* ---------------------------------------------------------------- store */
typedef struct xs_expert_ref {
    int expert, slot;
    const uint8_t *data;      /* view: the record in its slot, valid until released */
    uint64_t bytes;
    pt_wview gate, up, down;  /* views into data (from the source's views callback) */
} xs_expert_ref;

typedef struct xs_stats {
    uint64_t accesses;        /* experts requested through acquire */
    uint64_t hits, misses;    /* hits include experts loaded by a prefetch (ready or in flight) */
    uint64_t prefetch_issued, prefetch_used, prefetch_wasted; /* wasted: read, never used (evicted
                                                   unused, or proved wrong by the routing) */
    uint64_t prefetch_cancelled; /* dropped from the queue before their read started */
    uint64_t reads, bytes_read, read_retries, read_failures, checksum_failures;
    uint64_t io_wait_ns;      /* time acquire waited for reads */
    uint64_t io_busy_ns;      /* time with at least one read in progress */
    uint64_t evictions;
    uint64_t tokens;          /* advanced by xs_store_note_tokens, for per-token figures */
} xs_stats;

enum { XS_IO_AUTO = 0, XS_IO_DIRECT = 1, XS_IO_BUFFERED = 2 };
enum { XS_BACKEND_AUTO = 0, XS_BACKEND_URING = 1, XS_BACKEND_PREAD = 2 };
typedef struct xs_store_opts {
    int io_mode;              /* XS_IO_AUTO: O_DIRECT if the probe works, else buffered */
    int backend;              /* XS_BACKEND_AUTO: io_uring if it initialises, else pread */
    int io_threads;           /* pread threads, or checksum threads beside io_uring's (1-8; 0 = 4) */
    int io_depth;             /* io_uring: whole-expert reads in flight (0 = XS_IO_DEFAULT_DEPTH, 2) */
    int retries;              /* extra attempts after a failed or short read; default 1 */
    int verify;               /* checksum every read (default 1; -1 = off) */
    xs_policy_params policy;  /* zero = defaults */
} xs_store_opts;

typedef struct xs_store xs_store;
/* Allocates every slot (one aligned block), opens the file, starts the I/O thread(s). */
int xs_store_create(const xs_source *src, const xs_plan *plan, const xs_store_opts *opts,
                    xs_store **out, petrel_error *err);
void xs_store_free(xs_store *s);
/* Ensures experts[0..n) (distinct ids) of `layer` are in slots, reading every miss at once and
 * waiting; fills out[n] and takes one reference per expert (slots with references are never
 * evicted). n must not exceed the slots the layer has free or evictable (else PETREL_ERANGE;
 * the caller acquires in chunks of at most xs_store_slots()). On any failure nothing stays
 * referenced, the failed slots go back to the free list, and the store remains usable. */
int xs_acquire(xs_store *s, int layer, const int32_t *experts, int n, xs_expert_ref *out,
               petrel_error *err);
/* One access of a layer (a token's or a batch's experts) made of several acquires: between
 * begin and end they count as one access of the policy (its clock and half-life), as a trace
 * replay counts them; outside, each acquire is an access. */
void xs_access_begin(xs_store *s, int layer);
void xs_access_end(xs_store *s, int layer);
/* Drops the references taken by one acquire (same refs, same n). */
void xs_release(xs_store *s, int layer, const xs_expert_ref *refs, int n);
/* Asynchronous hint: starts reading the experts not resident, evicting only what the policy
 * would; never waits, never fails (a failed prefetch just frees its slot). Returns reads issued. */
int xs_prefetch(xs_store *s, int layer, const int32_t *experts, int n);

/* ---------------------------------------------------------------- lookahead (lookahead.c)
 * The next MoE layer's experts guessed from the current layer's input: xs_la_guess takes rows'
 * routing by the next layer's router (ranked [T][K], best first), records each guessed expert's
 * rank, and prefetches the guesses of the ranks whose running precision is at least gate, best
 * rank first, at most half the bank. xs_la_score compares a layer's guesses with what it then
 * chose (chosen [E] 0/1) and updates each rank's precision (0.9 old + 0.1 new). The state is
 * the store's; xs_la_guesses / xs_la_precision expose it ([E] ranks + 1, [K] precisions). */
void xs_la_guess(xs_store *s, int layer, const int32_t *ranked, int T, int K, double gate, int32_t *scratch);
/* Whether guesses for `layer` are worth computing: a store (s may be NULL: no) that streams. */
int xs_la_wanted(const xs_store *s, int layer);
void xs_la_score(xs_store *s, int layer, const uint8_t *chosen);
uint8_t *xs_la_guesses(xs_store *s, int layer);
/* The store's mutex, for lookahead.c's updates of that state (not held across other xs_ calls). */
void xs_store_lock(xs_store *s);
void xs_store_unlock(xs_store *s);
double *xs_la_precision(xs_store *s, int layer);
/* ---------------------------------------------------------------- run (run.c)
 * The expert schedule of one MoE layer over one batch. The model hands over the batch's routing
 * (chosen [E] 0/1) and takes the experts back chunk by chunk, in the order to run them, with
 * their weight views; each chunk goes back at the next call (or xs_run_release). The order and
 * the reads are decided here:
 *   no store (every expert resident): the chosen experts in ascending id, one chunk, views from
 *     the layer's tables;
 *   XS_RUN_READY (streamed batches): the guesses made for this layer are scored and the wrong
 *     ones not yet reading dropped; the experts already in slots come first (one chunk, pinned,
 *     no wait), then those still reading (queue order), then the misses one at a time, each
 *     computing while the later ones read. Every miss's read starts with the first chunk, then
 *     the lookahead callback runs (the model guesses the next layer's experts: xs_la_guess);
 *     the idle callback runs once, before the first chunk that may wait for a read (the model
 *     computes its shared expert there), and only then (never in the other kinds of run);
 *   XS_RUN_ASCENDING (layer-major spans, many rows): ascending id, one expert at a time, reads
 *     ahead as far as the bank allows (hints never evict pending hints).
 * xs_run_ascending: the experts come in ascending id (a caller may then accumulate their
 * outputs directly; in a READY run it buffers them and sums in ascending id at the end). The
 * callbacks may be NULL; a failing idle callback fails the run. */
enum { XS_RUN_READY = 0, XS_RUN_ASCENDING = 1 };
typedef struct xs_run_views {
    const pt_wview *gate, *up, *down; /* borrowed [E]: the layer's resident experts */
} xs_run_views;
typedef struct xs_run_args {
    xs_store *st;             /* NULL: every expert resident (views from resident) */
    int layer, mode;          /* store layer; XS_RUN_* */
    const uint8_t *chosen;    /* [n_experts] */
    int n_experts;
    xs_run_views resident;
    int32_t *order;           /* caller's scratch [n_experts] */
    xs_expert_ref *refs;      /* caller's scratch [n_experts] */
    void (*lookahead)(void *ctx);
    int (*idle)(void *ctx, petrel_error *err);
    void *cb_ctx;
} xs_run_args;
typedef struct xs_run {
    xs_store *st;
    int layer, mode, n, pos, n_hit, held, la_done, idle_done;
    int32_t *order;
    xs_expert_ref *refs;
    xs_run_views res;
    void (*lookahead)(void *ctx);
    int (*idle)(void *ctx, petrel_error *err);
    void *cb_ctx;
    uint64_t io_ns;           /* time acquire waited for reads */
} xs_run;
/* Returns the number of experts the run will hand out. */
int xs_run_begin(xs_run *r, const xs_run_args *a);
/* Releases the previous chunk, then acquires the next: returns its size (views in (*out)[i]),
 * 0 when every expert has been handed out, or a negative error (nothing stays held). */
int xs_run_next(xs_run *r, const xs_expert_ref **out, petrel_error *err);
void xs_run_release(xs_run *r);
/* Releases what is held and closes the layer's access: every run ends with it. */
void xs_run_end(xs_run *r);
int xs_run_ascending(const xs_run *r);

/* Once a layer's routing is known: drops its queued prefetches whose expert is not in keep[E]
 * and whose read has not started (wrong guesses should not delay its misses), and demotes the
 * wrong ones already read to ordinary cached experts (prefetched experts are otherwise evicted
 * last). Returns how many reads were dropped. */
int xs_cancel_prefetches(xs_store *s, int layer, const uint8_t *keep);
/* Where (layer, expert) stands: not in a slot, its read queued or running, or ready; for the
 * last two *seq (if not NULL) tells the order in which reads were queued. */
enum { XS_ABSENT = 0, XS_LOADING = 1, XS_READY = 2 };
int xs_store_state(const xs_store *s, int layer, int expert, uint64_t *seq);
/* Waits for every read in flight (tests, shutdown, timing). */
void xs_store_drain(xs_store *s);
int xs_store_slots(const xs_store *s);
/* The one block every slot lives in (a GPU registers it for direct copies out of the slots). */
void xs_store_memory(const xs_store *s, uint8_t **base, size_t *bytes);
int xs_store_experts(const xs_store *s); /* experts per layer */
int xs_store_layers(const xs_store *s);
int xs_store_direct(const xs_store *s);   /* 1 if reads use O_DIRECT */
int xs_store_uring(const xs_store *s);    /* 1 if reads use io_uring */
/* Reads every pinned expert not yet resident (warm start after xs_usage_load). */
int xs_store_warm_pins(xs_store *s, petrel_error *err);
void xs_store_stats(const xs_store *s, xs_stats *out);
void xs_store_note_tokens(xs_store *s, uint64_t n);
/* One line: hit rate, per-token misses/bytes/wait, prefetch use. Returns length. */
int xs_stats_format(const xs_stats *st, char *buf, size_t n);
/* Test/introspection: slot holding (layer, expert) or -1; whether it is pinned. */
int xs_store_slot_of(const xs_store *s, int layer, int expert);
int xs_store_pinned(const xs_store *s, int layer, int expert);
xs_pol *xs_store_policy(xs_store *s, int layer);

/* Usage history: `<model>.petrel-usage`, text:
 *   # petrel-usage v1 layers=L experts=E
 *   <layer> <count e0> ... <count e(E-1)>      (one line per layer)
 * Load adds the counts to the policy's history and re-pins; a missing file is not an error
 * (returns 0, *loaded = 0); a malformed or mismatched one is PETREL_EFORMAT (caller may ignore). */
void xs_usage_path(const char *model_path, char *buf, size_t n);
int xs_usage_save(const xs_store *s, const char *path, petrel_error *err);
int xs_usage_load(xs_store *s, const char *path, int *loaded, petrel_error *err);

/* ---------------------------------------------------------------- bulk load */
/* Reads every record of src (n_layers x n_experts) once, through the I/O pool and its fault
 * seam (opts: io_mode, backend, io_threads, io_depth, retries, verify as for the store; NULL =
 * defaults, buffered): with base, into base + the record's file offset (memory laid out like the
 * file, e.g. a pack's resident copy; 4096-aligned); with base NULL, into a few scratch buffers,
 * only to check the records. Each record is checked against its xxh64 on the pool's threads
 * unless verify is -1. progress(done, total, ud) in bytes, on the calling thread, may be NULL.
 * At most a few reads per thread are in flight, so a failure stops the load soon; returns 0 or
 * that failure (PETREL_EIO, PETREL_EFORMAT for a checksum), its message naming the record. */
int xs_load_all(const xs_source *src, uint8_t *base, const xs_store_opts *opts,
                void (*progress)(uint64_t done, uint64_t total, void *ud), void *ud,
                petrel_error *err);
/* The disk as the store reads it (benchmarks, `petrel plan --measure`): records (off[i],
 * bytes[i]) picked at random (a fixed seed) through the same I/O pool (io_uring where it
 * initialises, O_DIRECT where the file system allows, `depth` whole records in flight as the
 * store keeps them), no checksums, until `limit` bytes or `secs` seconds; GB/s of record bytes
 * over the wall time, 0 on any failure. */
double xs_read_probe(const char *path, const uint64_t *off, const uint64_t *bytes, int n, int depth, uint64_t limit, double secs);

/* ---------------------------------------------------------------- I/O fault seam */
enum { XS_FAULT_NONE = 0, XS_FAULT_ERROR = 1, XS_FAULT_SHORT = 2 };
typedef struct xs_fault {
    int kind;                 /* XS_FAULT_* */
    int err_no;               /* for XS_FAULT_ERROR (default EIO) */
    uint64_t short_bytes;     /* for XS_FAULT_SHORT: the read returns this many bytes */
    uint64_t delay_ns;        /* added before the read completes (any kind) */
} xs_fault;
/* Called for every completed read attempt (io_uring and pread alike) from the I/O thread;
 * attempt counts from 0. Fill *f to inject; NULL = no injection. Tests only. */
typedef void (*xs_fault_fn)(void *ctx, int layer, int expert, int attempt, xs_fault *f);
extern xs_fault_fn xs_io_fault_hook;
extern void *xs_io_fault_ctx;

/* ---------------------------------------------------------------- traces */
typedef struct xs_trace {
    int n_layers, n_experts, topk, n_tokens;
    int16_t *ids;             /* owned [n_tokens][n_layers][topk]; -1 = unused */
    int cap_tokens;
} xs_trace;
int xs_trace_init(xs_trace *t, int n_layers, int n_experts, int topk);
void xs_trace_deinit(xs_trace *t);
/* Records the experts of (token, layer); tokens must arrive in order (token <= n_tokens). */
int xs_trace_add(xs_trace *t, int token, int layer, const int32_t *ids, int k, petrel_error *err);
int xs_trace_write(const xs_trace *t, const char *path, petrel_error *err);
/* Reads the text format, plain or gzip-compressed (zlib). At most XS_TRACE_MAX_ENTRIES (layers x topk x
 * tokens, 512 MiB of ids; the shipped GLM-5-like trace holds 1.2 M): a header asking for more is
 * refused before anything is allocated. Lines come in token order (a token at most one past the
 * highest so far) and must reach the header's last token; storage grows with the lines read. */
#define XS_TRACE_MAX_ENTRIES (1 << 28)
int xs_trace_read(xs_trace *t, const char *path, petrel_error *err);

typedef struct xs_replay_stats {
    int capacity;
    uint64_t accesses;
    uint64_t policy_hits, lru_hits, belady_hits;
    double policy_rate, lru_rate, belady_rate;
    double policy_vs_belady;  /* policy_hits / belady_hits */
} xs_replay_stats;
/* Replays the trace through the policy (and plain LRU, and Belady/MIN) with `capacity` slots
 * per layer, demand-filled, the token's own experts never evicted. Cold start. */
int xs_trace_replay(const xs_trace *t, const xs_policy_params *prm, int capacity,
                    xs_replay_stats *st, petrel_error *err);
/* The same with the policy's usage history taken from hist's counts first (as a store does
 * from <model>.petrel-usage at open: lifetime counts, pins recomputed); hist NULL: cold. */
int xs_trace_replay_hist(const xs_trace *t, const xs_trace *hist, const xs_policy_params *prm, int capacity,
                         xs_replay_stats *st, petrel_error *err);
#endif
