/* prefix.c: the prefix cache. Entries map a token prefix ending at a page boundary to the page
 * holding its last P positions (all layers), so a new session whose prompt starts with a cached
 * prefix takes those pages (shared, copy-on-write) instead of running their prefill.
 *
 * Keys: h_k = XXH3_64(ids of positions [k P, (k+1) P), seed h_{k-1}), h_{-1} = KV_PREFIX_SEED.
 * A lookup walks k = 0, 1, ... and stops at the first page not found, so it returns the longest
 * cached prefix in whole pages. A match also compares the stored parent hash and the page's ids.
 * Recency: every put / get touches the pages of the prefix deepest-first, so of one prefix the
 * deeper pages are always older; LRU eviction then shortens cached prefixes from their end and
 * never leaves a page unreachable behind an evicted parent for long.
 * Eviction (kv_evict_one_locked) only takes entries whose page the cache alone holds (ref 1):
 * evicting one a session still uses frees nothing. Finding the oldest is a scan of the entries
 * (as many as the pool has pages), done only when the pool is short of pages.
 * Everything here runs under the pool's mutex. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "kv/kv_internal.h"

#define KV_PREFIX_SEED 0x70657472656c6b76ull /* "petrelkv" */

int kv_prefix_init(kv_pool *p) {
    int nb = 16;
    while (nb < p->n_pages && nb < (1 << 30)) nb <<= 1;
    p->pc_nb = nb;
    p->pc = malloc(sizeof *p->pc * (size_t)p->n_pages);
    p->pc_tokens = malloc(sizeof *p->pc_tokens * (size_t)p->n_pages * (size_t)p->lay.P);
    p->pc_bucket = malloc(sizeof *p->pc_bucket * (size_t)nb);
    if (!p->pc || !p->pc_tokens || !p->pc_bucket) return -1;
    for (int i = 0; i < p->n_pages; i++) p->pc[i].page = -1;
    for (int i = 0; i < nb; i++) p->pc_bucket[i] = -1;
    return 0;
}

void kv_prefix_deinit(kv_pool *p) {
    free(p->pc);
    free(p->pc_tokens);
    free(p->pc_bucket);
    p->pc = NULL, p->pc_tokens = NULL, p->pc_bucket = NULL;
}

static uint64_t page_hash(const int32_t *ids, int P, uint64_t parent) { return XXH3_64bits_withSeed(ids, sizeof *ids * (size_t)P, parent); }

static int find_locked(const kv_pool *p, uint64_t h, uint64_t parent, const int32_t *ids) {
    for (int i = p->pc_bucket[h & (uint64_t)(p->pc_nb - 1)]; i >= 0; i = p->pc[i].next) {
        const kv_pentry *e = &p->pc[i];
        if (e->hash == h && e->parent == parent && !memcmp(p->pc_tokens + (size_t)i * p->lay.P, ids, sizeof *ids * (size_t)p->lay.P)) return i;
    }
    return -1;
}

static void remove_locked(kv_pool *p, int slot) {
    kv_pentry *e = &p->pc[slot];
    int32_t *at = &p->pc_bucket[e->hash & (uint64_t)(p->pc_nb - 1)];
    while (*at != slot) at = &p->pc[*at].next;
    *at = e->next;
    kv_unref_locked(p, e->page);
    e->page = -1;
    p->pc_n--;
}

int kv_evictable_locked(const kv_pool *p) {
    int n = 0;
    for (int i = 0; i < p->n_pages && p->pc_n; i++) n += p->pc[i].page >= 0 && p->ref[p->pc[i].page] == 1;
    return n;
}

int kv_evict_one_locked(kv_pool *p) {
    int best = -1;
    for (int i = 0; i < p->n_pages && p->pc_n; i++) {
        const kv_pentry *e = &p->pc[i];
        if (e->page >= 0 && p->ref[e->page] == 1 && (best < 0 || e->tick < p->pc[best].tick)) best = i;
    }
    if (best < 0) return -1;
    remove_locked(p, best);
    p->pc_evictions++;
    return 0;
}

void kv_prefix_clear(kv_pool *p) {
    if (!p->pc) return;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->n_pages; i++)
        if (p->pc[i].page >= 0) remove_locked(p, i);
    pthread_mutex_unlock(&p->mu);
}

/* Ticks the entries of the first m pages of ids deepest-first (each found again by its key). */
static void touch_locked(kv_pool *p, const int32_t *ids, int m, uint64_t salt) {
    int P = p->lay.P;
    uint64_t h = KV_PREFIX_SEED ^ salt, t0 = p->pc_tick;
    for (int k = 0; k < m; k++) {
        uint64_t hk = page_hash(ids + (size_t)k * P, P, h);
        int i = find_locked(p, hk, h, ids + (size_t)k * P);
        if (i >= 0) p->pc[i].tick = t0 + (uint64_t)(m - k);
        h = hk;
    }
    p->pc_tick = t0 + (uint64_t)m;
}

int kv_prefix_put(kv_seq *s, petrel_error *err) {
    kv_pool *p = s->pool;
    int P = s->P, full = s->len / P, added = 0, k = 0;
    (void)err;
    pthread_mutex_lock(&p->mu);
    uint64_t h = KV_PREFIX_SEED ^ s->salt;
    for (; k < full; k++) {
        const int32_t *ids = s->tokens + (size_t)k * P;
        uint64_t hk = page_hash(ids, P, h);
        int mtp_ok = p->lay.mtp_layer < 0 || s->mtp_len >= (k + 1) * P;
        int i = find_locked(p, hk, h, ids);
        if (i >= 0) {
            kv_pentry *e = &p->pc[i];
            if (!e->mtp_ok && mtp_ok && e->page != s->pages[k]) { /* ours also holds the MTP rows: keep ours */
                kv_unref_locked(p, e->page);
                e->page = s->pages[k];
                p->ref[e->page]++;
                e->mtp_ok = 1;
            }
        } else {
            for (i = 0; i < p->n_pages && p->pc[i].page >= 0; i++) {}
            if (i == p->n_pages) break; /* cannot happen: an entry holds a distinct page */
            kv_pentry *e = &p->pc[i];
            e->hash = hk, e->parent = h, e->page = s->pages[k], e->mtp_ok = mtp_ok;
            memcpy(p->pc_tokens + (size_t)i * P, ids, sizeof *ids * (size_t)P);
            int32_t *b = &p->pc_bucket[hk & (uint64_t)(p->pc_nb - 1)];
            e->next = *b;
            *b = i;
            p->ref[e->page]++;
            p->pc_n++;
            added++;
        }
        h = hk;
    }
    touch_locked(p, s->tokens, k, s->salt);
    pthread_mutex_unlock(&p->mu);
    return added;
}

int kv_prefix_get(kv_seq *s, const int32_t *ids, int n, petrel_error *err) {
    if (s->len || s->n_pages) return pt_err(err, PETREL_EINVAL, "KV prefix lookup into a session that is not empty (%d positions)", s->len);
    if (n < 0) return pt_err(err, PETREL_EINVAL, "KV prefix lookup of %d tokens", n);
    kv_pool *p = s->pool;
    int P = s->P, m = 0, mtp = 0, maxk = (n < s->cap ? n : s->cap) / P;
    pthread_mutex_lock(&p->mu);
    uint64_t h = KV_PREFIX_SEED ^ s->salt;
    for (; m < maxk; m++) {
        uint64_t hk = page_hash(ids + (size_t)m * P, P, h);
        int i = find_locked(p, hk, h, ids + (size_t)m * P);
        if (i < 0) break;
        s->pages[m] = p->pc[i].page;
        p->ref[p->pc[i].page]++;
        if (mtp == m && p->pc[i].mtp_ok) mtp++;
        h = hk;
    }
    touch_locked(p, ids, m, s->salt);
    p->pc_hits += (uint64_t)m;
    if (m < maxk) p->pc_misses++;
    pthread_mutex_unlock(&p->mu);
    s->n_pages = m;
    s->len = m * P;
    if (m) memcpy(s->tokens, ids, sizeof *ids * (size_t)m * P);
    s->mtp_len = p->lay.mtp_layer < 0 ? 0 : mtp * P;
    return m * P;
}
