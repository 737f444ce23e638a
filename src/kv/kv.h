/* kv.h: the latent KV cache (issue 13): a page pool, per-session page tables, storage schemes,
 * copy-on-write forks, rollback, a prefix cache, and session files. Standalone: it knows the
 * cache's shapes (kv_shape), not the model; src/model wires it into mla.c / dsa.c.
 *
 * ---- Design (for whoever wires it into the layer loop) ----
 *
 * What is cached, per position p and layer l in 0..n_layers-1 (the MTP layer is the last one,
 * kv_shape.mtp_layer): c [kv_lora_rank] (the rms-normed latent), k_pe [qk_rope_head_dim] (after
 * RoPE) and, on layers with has_index[l], the indexer key [index_head_dim] (after LayerNorm and
 * RoPE). The token id of each position is kept too (prefix cache, session files).
 *
 * Pages. A page holds PAGE positions (kv_pool_opts.page_positions, default 64) of EVERY layer,
 * laid out layer-major inside the page: for layer l, c rows [PAGE][Rkv], then (int8) the c
 * scales [PAGE], k_pe rows [PAGE][Dr], then on indexer layers idx rows [PAGE][Di] and (int8) their
 * scales [PAGE]; every array starts 64-byte aligned. So within one page a layer's keys are ONE
 * contiguous run: attention gets (pointer, count) per page, and a context of T positions is
 * ceil(T / PAGE) runs per layer. One page for all layers means one refcount, one table entry
 * and one copy per position range, whatever the layer count: forks, rollback, the prefix cache
 * and files work on positions, and the MTP layer's cache comes along without a second table.
 * Why 64: a run of 64 keys is 128 KiB of f32 c (L2-sized) so per-run overhead in a kernel is
 * small; a 200k context is ~3k table entries; the partial last page wastes < 64 positions; the
 * cost is copy-on-write granularity (a fork's first write into a shared page copies up to 64
 * positions of all layers: 12 MiB f32 / 3.3 MiB int8 for GLM-5.2, a millisecond) and prefix
 * cache granularity (64 tokens, nothing next to a 2k system prompt). Tests use smaller pages.
 *
 * Schemes (kv_scheme, one per pool; the pool's page size depends on it):
 *   KV_F32   c, k_pe, idx f32: bitwise the values written (the paged == contiguous oracle).
 *   KV_BF16  c, k_pe, idx bf16, round to nearest even: |x - x'| <= 2^-9 |x| per value.
 *   KV_INT8  c and idx int8, symmetric, one f32 scale per position and layer for each:
 *            s = max|x| / 127, q = round_half_even(x / s): |x - x'| <= s / 2 = max|x| / 254.
 *            k_pe bf16 (kv_pool_opts.pe_f32 = 1 keeps it f32): it is 64 of 644 bytes per
 *            position-layer, it carries the position (RoPE-rotated, so one outlier pair cannot
 *            be scaled away per token), and the FP8 MLA caches of FlashMLA / vLLM keep the
 *            rope part in bf16 for the same reason. The KL measurement on the trained fixture
 *            (issue 13) decides whether pe_f32 should become the default.
 * Inputs must be finite (attention's rmsnorm / rope outputs are).
 *
 * Writing (during a forward of rows at positions [a, b) of a session):
 *   1. kv_seq_reserve(seq, a, b) BEFORE the layer loop: allocates the pages past the table and
 *      copies shared pages in [a, b) (copy-on-write). It is the only call that takes pages, so
 *      a forward that cannot fit fails here, up front, with PETREL_ERANGE and how many positions
 *      fit, and nothing changed. (The MTP layer writes at its own positions: reserve
 *      [mtp_len, mtp_len + n) before fwd_mtp too; it is usually a no-op.)
 *   2. kv_write(seq, l, pos, c, k_pe) in attention and kv_write_index(seq, l, pos, ki) in the
 *      indexer, per row and layer (encode into the scheme). They never allocate; they refuse
 *      (PETREL_EINVAL) a position that was not reserved or a page that is shared.
 *   3. kv_seq_append(seq, ids, n) after the forward succeeded (len += n, token ids recorded);
 *      kv_seq_mtp_advance(seq, n) after fwd_mtp. A failed forward appends nothing: it leaves
 *      written-but-not-appended rows past len, which the next forward overwrites.
 * Reading (attention: rows of layer l at positions [a, b), including the rows being written):
 *   f32 pools: kv_run(seq, l, a, b, &r) gives a view of one page's run (r.n positions from
 *     r.pos, r.c / r.pe / r.idx contiguous [r.n][width]); loop a += r.n. No copy.
 *   any scheme: kv_decode(seq, l, a, b, c, pe, idx) decodes [a, b) into caller buffers
 *     ([b-a][width] f32; NULL skips a part); kv_gather(seq, l, pos, n, ...) the same for a DSA
 *     selection (n positions in any order). What attention calls until the kernels read the
 *     schemes directly (kv_run gives them the encoded run and its scales).
 *   Reads are allowed at any reserved position (< kv_seq_reserved), not only < len, because a
 *   forward reads the keys of its own rows before they are appended.
 *
 * Forks, rollback, prefixes:
 *   kv_seq_fork: a new session sharing every page (refcounts); the first write into a shared
 *     page copies it (step 1). n samples of one prompt, or a verify window tried on a copy.
 *   kv_seq_truncate(seq, n): drops positions >= n; releases only the pages wholly past the cut.
 *   kv_prefix_put(seq): registers the session's full pages in the pool's prefix cache (keyed by
 *     a chained hash of the token ids up to each page boundary; entries hold page refs).
 *     kv_prefix_get(seq, ids, n): an empty session takes the longest cached prefix of ids
 *     (whole pages) and returns its length; the caller prefills only the rest. Pass n - 1 for a
 *     prompt whose last row must run to give logits. Cached pages are shared copy-on-write.
 *     When the pool is short of pages, entries only the cache holds are evicted, least
 *     recently used first (deeper pages of a prefix count as older than shallower ones).
 *
 * Session files (kv_save / kv_load): header (magic, format version, the caller's model identity
 * hash, scheme, token count, layer count and shapes) with its own checksum, the indexer flags,
 * the token ids, the payload (per layer, per array, the valid positions in order: the page size
 * is not part of the format), and an xxh3 checksum of everything. Written whole-or-nothing
 * (base/outfile.h). A truncated, corrupt, other-model, other-scheme or future-version file is
 * refused with one line, and the session is left as it was.
 *
 * Threads: the pool's page accounting and prefix cache are behind one mutex, so sessions of one
 * pool may be driven from different threads; one session is driven by one thread at a time.
 * Memory: one mapping of the pool's bytes at creation (and the prefix cache's table, one slot a
 * page), page tables at session creation. reserve, the writes and reads, append, truncate and
 * the prefix cache allocate nothing; create, fork, save and load do. Pages are zeroed when
 * taken from the free list (no stale rows of another session are ever readable).
 *
 * Bitwise note for the wiring: a product per key (q~ . c_t, k_pe scores, indexer scores, the
 * kv_b_proj expansion) can run run by run with results identical to one contiguous call; a
 * reduction OVER keys (lat = sum_t p_t c_t in kn_matmul_t) summed run by run changes the f32
 * order. Until the kernels accumulate across runs in key order, decode the keys into one
 * contiguous scratch (kv_decode / kv_gather: a memcpy per run for f32) and call today's code. */
#ifndef PETREL_KV_KV_H
#define PETREL_KV_KV_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "petrel.h"

typedef enum kv_scheme { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_SCHEME_COUNT } kv_scheme;
const char *kv_scheme_name(kv_scheme s);
/* "f32" | "bf16" | "int8" | "auto" (= bf16) -> *out; PETREL_EINVAL naming the choices. */
int kv_scheme_parse(const char *s, kv_scheme *out, petrel_error *err);

#define KV_PAGE_DEFAULT 64
#define KV_FILE_VERSION 1u

/* The cache's shapes. has_index is borrowed for the call that takes it (copied). */
typedef struct kv_shape {
    int n_layers;          /* layers with a cache, MTP included */
    int kv_lora_rank;      /* Rkv: c per position and layer */
    int qk_rope_head_dim;  /* Dr: k_pe */
    int index_head_dim;    /* Di: indexer key, on layers with has_index[l] */
    const uint8_t *has_index; /* [n_layers], borrowed */
    int mtp_layer;         /* the MTP layer's index (its own fill length), or -1 */
} kv_shape;
struct petrel_config;
/* The shape of a model's cache: num_hidden_layers layers (+ the MTP layer when with_mtp), the
 * indexer flags from cfg->layer_indexer_full (borrowed: cfg must outlive the use of out). */
void kv_shape_from_config(const struct petrel_config *cfg, int with_mtp, kv_shape *out);

typedef struct kv_pool_opts {
    kv_scheme scheme;
    int page_positions;    /* positions per page; 0 = KV_PAGE_DEFAULT; 1..4096 */
    int pe_f32;            /* KV_INT8 / KV_BF16: keep k_pe f32 (default: bf16) */
    int idx_f32;           /* KV_INT8 / KV_BF16: keep the indexer keys f32 (default: the scheme) */
} kv_pool_opts;

/* Where each array of a layer sits in a page (bytes from the page start), -1 when absent. */
typedef struct kv_layer_off {
    int64_t c, c_scale, pe, idx, idx_scale;
} kv_layer_off;

/* A pool's layout: derived from the shape and options, fixed for the pool's life. */
typedef struct kv_layout {
    int n_layers, Rkv, Dr, Di, mtp_layer, P;
    kv_scheme scheme;
    int c_bytes, pe_bytes;   /* bytes of one value: c (4/2/1), k_pe (4/2) */
    int idx_bytes;           /* bytes of one indexer-key value (4/2/1) */
    uint8_t *has_index;      /* owned [n_layers] */
    kv_layer_off *off;       /* owned [n_layers] */
    size_t page_bytes;       /* one page, a multiple of 64 */
    size_t bytes_per_token;  /* payload per position, all layers, without page padding (= the
                                file's bytes per token) */
} kv_layout;
int kv_layout_init(kv_layout *lay, const kv_shape *shape, const kv_pool_opts *o, petrel_error *err);
void kv_layout_deinit(kv_layout *lay);
/* Positions a pool of `bytes` holds with this layout (whole pages): the longest context. */
int64_t kv_layout_max_positions(const kv_layout *lay, uint64_t bytes);
/* Payload bytes per position for a shape and scheme (pe_f32 as in kv_pool_opts): for the plan
 * to print next to the other schemes' without building layouts. */
size_t kv_bytes_per_token(const kv_shape *shape, kv_scheme scheme, int pe_f32);
size_t kv_bytes_per_token_opts(const kv_shape *shape, const kv_pool_opts *o);
/* The options an engine uses for a scheme (measured on the trained fixture, bench/RESULTS.md):
 * the DSA indexer keys stay f32 in bf16 and int8 pools (a flipped selection costs more than the
 * keys' bytes: int8's KL over the goldens 3.4e-3 -> 1.8e-3), and int8 keeps k_pe f32. */
kv_pool_opts kv_engine_opts(kv_scheme scheme, int page_positions);

/* ---- the pool ---- */
typedef struct kv_pool kv_pool;
/* A pool of floor(bytes / page_bytes) pages (PETREL_ERANGE when that is 0). */
int kv_pool_create(const kv_shape *shape, const kv_pool_opts *o, uint64_t bytes, kv_pool **out, petrel_error *err);
void kv_pool_free(kv_pool *p); /* every session of the pool must be freed first */
const kv_layout *kv_pool_layout(const kv_pool *p);
typedef struct kv_pool_stats {
    int pages, pages_free;         /* total, on the free list */
    int prefix_entries, prefix_only; /* entries; of them pages held by the cache alone (evictable) */
    uint64_t prefix_hits, prefix_misses, prefix_evictions; /* pages matched / lookups ending
                                      on a miss / entries evicted */
} kv_pool_stats;
void kv_pool_get_stats(kv_pool *p, kv_pool_stats *st);

/* ---- sessions (page tables) ---- */
typedef struct kv_seq {
    kv_pool *pool;     /* borrowed */
    int32_t *pages;    /* owned [max_pages]: page ids of positions [k P, (k+1) P) */
    int32_t *tokens;   /* owned [cap]: token ids of positions < len */
    int cap;           /* positions this session may hold */
    int P;             /* positions per page (the pool's) */
    int max_pages;     /* ceil(cap / P) */
    int n_pages;       /* pages in the table (positions < n_pages P are reserved) */
    int len;           /* positions appended (main layers) */
    int mtp_len;       /* positions of the MTP layer appended (<= len); 0 without one */
    uint64_t salt;     /* mixed into the prefix cache's keys: what else made the KV (a LoRA
                          adapter set); 0 = none. Pages only match sessions of the same salt. */
} kv_seq;
/* A session of up to cap positions; no pages are taken until reserve. */
int kv_seq_create(kv_pool *p, int cap, kv_seq **out, petrel_error *err);
void kv_seq_free(kv_seq *s);   /* releases its page refs */
static inline int kv_seq_len(const kv_seq *s) { return s->len; }
static inline int kv_seq_reserved(const kv_seq *s) {
    int64_t r = (int64_t)s->n_pages * s->P;
    return r < s->cap ? (int)r : s->cap;
}
/* Makes positions [a, b) writable: pages past the table are taken (zeroed), shared pages in the
 * range are copied. a <= kv_seq_reserved (no holes), b <= cap. Out of pages (after evicting
 * what the prefix cache alone holds): PETREL_ERANGE saying how many positions from a fit, and
 * nothing changed (not even the prefix cache). */
int kv_seq_reserve(kv_seq *s, int a, int b, petrel_error *err);
/* Positions past len this session could reserve now (its cap, the free and evictable pages). */
int kv_seq_room(kv_seq *s);
/* Encodes one position's row of layer l: c [Rkv] and k_pe [Dr] / the indexer key [Di]. The
 * position must be reserved and its page private (kv_seq_reserve), else PETREL_EINVAL. */
int kv_write(kv_seq *s, int l, int pos, const float *c, const float *k_pe, petrel_error *err);
int kv_write_index(kv_seq *s, int l, int pos, const float *ki, petrel_error *err);
/* After a forward: ids of positions len..len+n-1 recorded, len += n (<= reserved). */
int kv_seq_append(kv_seq *s, const int32_t *ids, int n, petrel_error *err);
/* After the MTP layer ran n rows: mtp_len += n (<= reserved: drafts run ahead of len). */
int kv_seq_mtp_advance(kv_seq *s, int n, petrel_error *err);
/* Drops positions >= n (n <= len): len = n, mtp_len = min(mtp_len, n), pages wholly past n
 * released; the page holding n - 1 is not touched. */
int kv_seq_truncate(kv_seq *s, int n, petrel_error *err);
/* A new session (capacity cap, >= src->len; 0 = src's) sharing all of src's pages. */
int kv_seq_fork(const kv_seq *src, int cap, kv_seq **out, petrel_error *err);

/* ---- reading ---- */
/* One page's run of layer l: positions [pos, pos + n), arrays contiguous [n][width] in the
 * scheme's element type (c and idx: f32 / bf16 (uint16_t) / int8; pe: f32 or bf16 by
 * kv_layout.pe_bytes), scales [n] f32 for int8 (else NULL), idx NULL on layers without keys. */
typedef struct kv_run {
    int pos, n;
    const void *c, *pe, *idx;
    const float *c_scale, *idx_scale;
} kv_run;
/* The run from a (a < b <= reserved) to the end of a's page or b; returns its n (> 0) or a
 * negative code. */
int kv_run_at(const kv_seq *s, int l, int a, int b, kv_run *r, petrel_error *err);
/* Decodes positions [a, b) of layer l to f32: c [b-a][Rkv], pe [b-a][Dr], idx [b-a][Di] (each
 * may be NULL; idx must be NULL on a layer without keys). */
int kv_decode(const kv_seq *s, int l, int a, int b, float *c, float *pe, float *idx, petrel_error *err);
/* The same for n positions pos[0..n) (a DSA selection), row i from pos[i]. */
int kv_gather(const kv_seq *s, int l, const int32_t *pos, int n, float *c, float *pe, float *idx, petrel_error *err);

/* Row pointers for attention: c[i] / pe[i] point at layer l's rows of positions pos[i] (pos
 * NULL: 0..n-1), each < reserved. f32 pools (kv_is_f32) point into the pages (no copy; cbuf /
 * pbuf unused, may be NULL); other schemes decode row i into cbuf + i Rkv / pbuf + i Dr. */
int kv_rows(const kv_seq *s, int l, const int32_t *pos, int n, const float **c, const float **pe, float *cbuf, float *pbuf, petrel_error *err);
int kv_is_f32(const kv_seq *s);
int kv_index_is_f32(const kv_seq *s); /* the indexer keys alone are f32 (kv_run gives them in place) */

/* ---- prefix cache ---- */
/* Registers the full pages of s (positions < floor(len / P) P) with their token prefix. A page
 * registered is shared from then on (a later write into it copies). Returns pages registered
 * anew. */
int kv_prefix_put(kv_seq *s, petrel_error *err);
/* s must be empty (len 0, no pages). Takes the longest cached prefix of ids[0..n) in whole
 * pages (at most s->cap), sets len (and mtp_len where the cached pages hold the MTP layer's
 * rows too) and returns the prefix length (0: a miss). */
int kv_prefix_get(kv_seq *s, const int32_t *ids, int n, petrel_error *err);
/* Drops every entry (their page refs; pages still used by sessions stay). */
void kv_prefix_clear(kv_pool *p);

/* ---- session files ---- */
/* Writes positions [0, len) of s (and its token ids) to path, whole or not at all. model_id
 * identifies the model (the caller hashes its config and tensor checksums). */
int kv_save(const kv_seq *s, const char *path, uint64_t model_id, petrel_error *err);
/* Replaces s's contents with the file's: refused (s unchanged) when the file is truncated,
 * corrupt, for another model (model_id), another scheme or shape, a newer format version, or
 * longer than s->cap, or when the pool lacks the pages (the file is read into new pages and
 * s's old ones are released only after the checksum matched, so a load needs room for both).
 * vocab_size > 0: token ids must be below it. `what` names the source in messages.
 * Codes: PETREL_EFORMAT truncated / corrupt / not a session file, PETREL_EUNSUPPORTED a newer
 * format version, PETREL_EINVAL another model / scheme / shape, PETREL_ERANGE too long for the
 * session or the pool, PETREL_EIO read errors. */
int kv_load_stream(kv_seq *s, FILE *f, const char *what, uint64_t model_id, int vocab_size, petrel_error *err);
int kv_load(kv_seq *s, const char *path, uint64_t model_id, int vocab_size, petrel_error *err);
/* Bytes of the file kv_save writes for n positions of this layout (mtp positions = mtp_n). */
uint64_t kv_file_bytes(const kv_layout *lay, int n, int mtp_n);
#endif
