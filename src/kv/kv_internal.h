/* kv_internal.h: the pool's private state, shared by the files of src/kv (pool.c, prefix.c,
 * file.c, layout.c). Nothing outside src/kv includes it.
 *
 * Invariants (under mu): ref[p] == 0 exactly for the pages on the free list; every table entry
 * of a live session and every prefix entry holds one ref of its page; a page with ref > 1 is
 * never written (kv_write checks, kv_seq_reserve copies first). */
#ifndef PETREL_KV_INTERNAL_H
#define PETREL_KV_INTERNAL_H
#include <pthread.h>

#include "kv/kv.h"

/* One prefix-cache entry: page k of some token prefix. hash chains the ids of positions
 * [0, (k+1) P) (hash of page k's ids seeded with the entry of page k-1's hash); parent is that
 * seed, and tokens (P ids at kv_pool.pc_tokens + slot * P) are checked on a match, so a false
 * hit needs a 64-bit collision of the chain AND equal ids of the page. */
typedef struct kv_pentry {
    uint64_t hash, parent, tick;
    int32_t page;      /* -1: free slot */
    int32_t next;      /* next slot in the bucket, -1 */
    int mtp_ok;        /* the page's MTP-layer rows are filled too */
} kv_pentry;

struct kv_pool {
    kv_layout lay;
    uint8_t *mem;      /* owned mapping: [n_pages][page_bytes] */
    size_t mem_bytes;
    int n_pages;
    int32_t *ref;      /* owned [n_pages] */
    int32_t *freel;    /* owned [n_pages]: free page ids, n_free of them */
    int n_free;
    pthread_mutex_t mu;
    /* prefix cache: n_pages slots (an entry holds a distinct page), chained buckets */
    kv_pentry *pc;     /* owned [n_pages] */
    int32_t *pc_tokens;/* owned [n_pages][P] */
    int32_t *pc_bucket;/* owned [pc_nb] heads */
    int pc_nb;         /* power of two */
    int pc_n;          /* live entries */
    uint64_t pc_tick, pc_hits, pc_misses, pc_evictions;
};

static inline uint8_t *kv_page_ptr(const kv_pool *p, int32_t page) { return p->mem + (size_t)page * p->lay.page_bytes; }

/* Under mu: */
int32_t kv_take_locked(kv_pool *p);               /* a zeroed page (ref 1), or -1 */
void kv_unref_locked(kv_pool *p, int32_t page);
int kv_evictable_locked(const kv_pool *p);        /* entries whose page only the cache holds */
int kv_evict_one_locked(kv_pool *p);              /* frees one such page: 0, or -1 if none */
/* Pages obtainable now: free + evictable. */
static inline int kv_avail_locked(const kv_pool *p) { return p->n_free + kv_evictable_locked(p); }
/* A page for a caller that checked kv_avail_locked: from the free list, else by eviction. */
int32_t kv_obtain_locked(kv_pool *p);

int kv_prefix_init(kv_pool *p);
void kv_prefix_deinit(kv_pool *p);

/* Encode / decode one row of w values in the scheme's element type (c_bytes: 4 f32, 2 bf16,
 * 1 int8 with *scale). */
void kv_encode_row(int bytes, const float *x, int w, void *dst, float *scale);
void kv_decode_row(int bytes, const void *src, float scale, int w, float *out);
#endif
