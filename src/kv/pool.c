/* pool.c: the KV page pool and the sessions' page tables: taking and releasing refcounted
 * pages, reserve (the only place pages are taken for writing, copy-on-write included),
 * per-row writes, reads of runs, forks and rollback. The layout of a page is layout.c's; the
 * prefix cache (prefix.c) shares the pool's mutex and page refs.
 *
 * Invariants: see kv_internal.h. A session's table entries [0, n_pages) are valid page ids;
 * positions < n_pages * P are "reserved"; len <= reserved, mtp_len <= len. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/err.h"
#include "kv/kv_internal.h"

int kv_pool_create(const kv_shape *shape, const kv_pool_opts *o, uint64_t bytes, kv_pool **out, petrel_error *err) {
    *out = NULL;
    kv_pool *p = calloc(1, sizeof *p);
    if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory for the KV pool");
    int rc = kv_layout_init(&p->lay, shape, o, err);
    if (rc) {
        free(p);
        return rc;
    }
    uint64_t n = bytes / p->lay.page_bytes;
    if (n < 1) {
        rc = pt_err(err, PETREL_ERANGE, "a KV pool of %llu bytes holds no page (one page of %d positions is %zu bytes with %s KV)",
                    (unsigned long long)bytes, p->lay.P, p->lay.page_bytes, kv_scheme_name(p->lay.scheme));
        kv_layout_deinit(&p->lay);
        free(p);
        return rc;
    }
    if (n > (1u << 30)) n = 1u << 30;
    p->n_pages = (int)n;
    p->mem_bytes = (size_t)n * p->lay.page_bytes;
    void *m = mmap(NULL, p->mem_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    p->mem = m == MAP_FAILED ? NULL : m;
#ifdef MADV_HUGEPAGE
    /* huge pages where the kernel gives them: a DSA selection reads 2048 rows scattered over the
     * pages, and with 4 KiB pages nearly every row is a TLB miss */
    if (p->mem) madvise(p->mem, p->mem_bytes, MADV_HUGEPAGE);
#endif
    p->ref = calloc((size_t)n, sizeof *p->ref);
    p->freel = malloc(sizeof *p->freel * (size_t)n);
    if (!p->mem || !p->ref || !p->freel || kv_prefix_init(p) || pthread_mutex_init(&p->mu, NULL)) {
        rc = pt_err(err, PETREL_ENOMEM, "out of memory for a KV pool of %llu pages (%zu bytes)", (unsigned long long)n, p->mem_bytes);
        if (p->mem) munmap(p->mem, p->mem_bytes);
        free(p->ref);
        free(p->freel);
        kv_prefix_deinit(p);
        kv_layout_deinit(&p->lay);
        free(p);
        return rc;
    }
    /* the free list hands out low page ids first (a stack: push in reverse) */
    for (int i = 0; i < p->n_pages; i++) p->freel[i] = p->n_pages - 1 - i;
    p->n_free = p->n_pages;
    *out = p;
    return 0;
}

void kv_pool_free(kv_pool *p) {
    if (!p) return;
    kv_prefix_clear(p);
    kv_prefix_deinit(p);
    pthread_mutex_destroy(&p->mu);
    munmap(p->mem, p->mem_bytes);
    free(p->ref);
    free(p->freel);
    kv_layout_deinit(&p->lay);
    free(p);
}

const kv_layout *kv_pool_layout(const kv_pool *p) { return &p->lay; }

void kv_pool_get_stats(kv_pool *p, kv_pool_stats *st) {
    pthread_mutex_lock(&p->mu);
    st->pages = p->n_pages;
    st->pages_free = p->n_free;
    st->prefix_entries = p->pc_n;
    st->prefix_only = kv_evictable_locked(p);
    st->prefix_hits = p->pc_hits;
    st->prefix_misses = p->pc_misses;
    st->prefix_evictions = p->pc_evictions;
    pthread_mutex_unlock(&p->mu);
}

int32_t kv_take_locked(kv_pool *p) {
    if (!p->n_free) return -1;
    int32_t pg = p->freel[--p->n_free];
    p->ref[pg] = 1;
    /* zeroed: no stale rows of another session are ever visible, and files are deterministic */
    memset(kv_page_ptr(p, pg), 0, p->lay.page_bytes);
    return pg;
}

void kv_unref_locked(kv_pool *p, int32_t pg) {
    if (--p->ref[pg] == 0) p->freel[p->n_free++] = pg;
}

int32_t kv_obtain_locked(kv_pool *p) {
    while (!p->n_free)
        if (kv_evict_one_locked(p)) return -1;
    return kv_take_locked(p);
}

/* ---- sessions ---- */

int kv_seq_create(kv_pool *p, int cap, kv_seq **out, petrel_error *err) {
    *out = NULL;
    if (cap < 1) return pt_err(err, PETREL_EINVAL, "KV session capacity must be at least 1 position (got %d)", cap);
    kv_seq *s = calloc(1, sizeof *s);
    if (!s) return pt_err(err, PETREL_ENOMEM, "out of memory for a KV session");
    s->pool = p;
    s->cap = cap;
    s->P = p->lay.P;
    s->max_pages = (int)(((int64_t)cap + s->P - 1) / s->P);
    s->pages = malloc(sizeof *s->pages * (size_t)s->max_pages);
    s->tokens = malloc(sizeof *s->tokens * (size_t)cap);
    if (!s->pages || !s->tokens) {
        kv_seq_free(s);
        return pt_err(err, PETREL_ENOMEM, "out of memory for a KV session of %d positions", cap);
    }
    *out = s;
    return 0;
}

static void release_from(kv_seq *s, int k) {
    if (k >= s->n_pages) return;
    pthread_mutex_lock(&s->pool->mu);
    for (int i = k; i < s->n_pages; i++) kv_unref_locked(s->pool, s->pages[i]);
    pthread_mutex_unlock(&s->pool->mu);
    s->n_pages = k;
}

void kv_seq_free(kv_seq *s) {
    if (!s) return;
    if (s->pages) release_from(s, 0);
    free(s->pages);
    free(s->tokens);
    free(s);
}

/* Pages that making [a, b) writable costs: copies of shared pages in range, new pages past the table. */
static int reserve_cost_locked(const kv_seq *s, int a, int b) {
    const kv_pool *p = s->pool;
    int k0 = a / s->P, k1 = (b - 1) / s->P, need = 0;
    for (int k = k0; k <= k1; k++) need += k >= s->n_pages || p->ref[s->pages[k]] > 1;
    return need;
}

/* Positions from a that `avail` pages make writable (capped at cap). */
static int fit_from_locked(const kv_seq *s, int a, int avail) {
    const kv_pool *p = s->pool;
    int covered = a;
    for (int k = a / s->P; k < s->max_pages; k++) {
        int cost = k >= s->n_pages || p->ref[s->pages[k]] > 1;
        if (cost > avail) break;
        avail -= cost;
        int end = (k + 1) * s->P;
        covered = end < s->cap ? end : s->cap;
    }
    return covered - a;
}

int kv_seq_reserve(kv_seq *s, int a, int b, petrel_error *err) {
    if (a < 0 || a > b || a > kv_seq_reserved(s))
        return pt_err(err, PETREL_EINVAL, "KV reserve of positions [%d, %d) with %d reserved", a, b, kv_seq_reserved(s));
    if (b > s->cap)
        return pt_err(err, PETREL_ERANGE, "KV session holds %d positions: [%d, %d) does not fit (%d more fit)", s->cap, a, b, s->cap - a);
    if (a == b) return 0;
    kv_pool *p = s->pool;
    pthread_mutex_lock(&p->mu);
    int need = reserve_cost_locked(s, a, b);
    int avail = need <= p->n_free ? p->n_free : kv_avail_locked(p); /* the scan of the cache only when short */
    if (need > avail) {
        int fit = fit_from_locked(s, a, avail);
        int fr = p->n_free;
        pthread_mutex_unlock(&p->mu);
        return pt_err(err, PETREL_ERANGE,
                      "KV pool full: positions [%d, %d) need %d more pages, %d obtainable (%d free, %d held only by the prefix cache, of %d); %d positions fit from position %d",
                      a, b, need, avail, fr, avail - fr, p->n_pages, fit, a);
    }
    int k0 = a / s->P, k1 = (b - 1) / s->P;
    for (int k = k0; k <= k1; k++) {
        if (k < s->n_pages && p->ref[s->pages[k]] == 1) continue;
        int32_t pg = kv_obtain_locked(p); /* cannot fail: need <= avail */
        if (k < s->n_pages) { /* copy-on-write */
            memcpy(kv_page_ptr(p, pg), kv_page_ptr(p, s->pages[k]), p->lay.page_bytes);
            kv_unref_locked(p, s->pages[k]);
        } else {
            s->n_pages = k + 1;
        }
        s->pages[k] = pg;
    }
    pthread_mutex_unlock(&p->mu);
    return 0;
}

int kv_seq_room(kv_seq *s) {
    pthread_mutex_lock(&s->pool->mu);
    int fit = s->len >= s->cap ? 0 : fit_from_locked(s, s->len, kv_avail_locked(s->pool));
    pthread_mutex_unlock(&s->pool->mu);
    return fit;
}

/* The page holding pos of a write: reserved and private. */
static uint8_t *write_page(kv_seq *s, int l, int pos, petrel_error *err) {
    if (l < 0 || l >= s->pool->lay.n_layers || pos < 0 || pos >= kv_seq_reserved(s)) {
        pt_err(err, PETREL_EINVAL, "KV write of layer %d position %d outside the reserved %d positions of %d layers", l, pos,
               kv_seq_reserved(s), s->pool->lay.n_layers);
        return NULL;
    }
    int32_t pg = s->pages[pos / s->P];
    if (__atomic_load_n(&s->pool->ref[pg], __ATOMIC_RELAXED) != 1) {
        pt_err(err, PETREL_EINVAL, "KV write of position %d into a shared page (reserve it first)", pos);
        return NULL;
    }
    return kv_page_ptr(s->pool, pg);
}

int kv_write(kv_seq *s, int l, int pos, const float *c, const float *k_pe, petrel_error *err) {
    uint8_t *pg = write_page(s, l, pos, err);
    if (!pg) return PETREL_EINVAL;
    const kv_layout *y = &s->pool->lay;
    const kv_layer_off *f = &y->off[l];
    int i = pos % s->P;
    float *cs = f->c_scale >= 0 ? (float *)(pg + f->c_scale) + i : NULL;
    if (c) kv_encode_row(y->c_bytes, c, y->Rkv, pg + f->c + (size_t)i * y->Rkv * y->c_bytes, cs);
    if (k_pe) kv_encode_row(y->pe_bytes, k_pe, y->Dr, pg + f->pe + (size_t)i * y->Dr * y->pe_bytes, NULL);
    return 0;
}

int kv_write_index(kv_seq *s, int l, int pos, const float *ki, petrel_error *err) {
    uint8_t *pg = write_page(s, l, pos, err);
    if (!pg) return PETREL_EINVAL;
    const kv_layout *y = &s->pool->lay;
    const kv_layer_off *f = &y->off[l];
    if (f->idx < 0) return pt_err(err, PETREL_EINVAL, "KV layer %d keeps no indexer keys", l);
    int i = pos % s->P;
    float *sc = f->idx_scale >= 0 ? (float *)(pg + f->idx_scale) + i : NULL;
    kv_encode_row(y->idx_bytes, ki, y->Di, pg + f->idx + (size_t)i * y->Di * y->idx_bytes, sc);
    return 0;
}

int kv_seq_append(kv_seq *s, const int32_t *ids, int n, petrel_error *err) {
    if (n < 0 || s->len + n > kv_seq_reserved(s))
        return pt_err(err, PETREL_EINVAL, "KV append of %d positions at %d with %d reserved", n, s->len, kv_seq_reserved(s));
    if (n) memcpy(s->tokens + s->len, ids, sizeof *ids * (size_t)n);
    s->len += n;
    return 0;
}

int kv_seq_mtp_advance(kv_seq *s, int n, petrel_error *err) {
    if (s->pool->lay.mtp_layer < 0) return pt_err(err, PETREL_EINVAL, "KV session has no MTP layer");
    if (n < 0 || s->mtp_len + n > kv_seq_reserved(s)) /* drafts run ahead of len, within the reserve */
        return pt_err(err, PETREL_EINVAL, "KV MTP advance of %d positions at %d past the session's %d reserved", n, s->mtp_len,
                      kv_seq_reserved(s));
    s->mtp_len += n;
    return 0;
}

int kv_seq_truncate(kv_seq *s, int n, petrel_error *err) {
    if (n < 0 || n > s->len) return pt_err(err, PETREL_EINVAL, "KV truncate to %d positions of %d", n, s->len);
    s->len = n;
    if (s->mtp_len > n) s->mtp_len = n;
    release_from(s, (n + s->P - 1) / s->P);
    return 0;
}

int kv_seq_fork(const kv_seq *src, int cap, kv_seq **out, petrel_error *err) {
    *out = NULL;
    if (cap == 0) cap = src->cap;
    if (cap < src->len || cap < 1)
        return pt_err(err, PETREL_EINVAL, "KV fork of a %d-position session into a capacity of %d", src->len, cap);
    kv_seq *d;
    PT_TRY(kv_seq_create(src->pool, cap, &d, err));
    /* share the pages holding [0, len) (a reserved page past len has nothing to share) */
    int np = (src->len + src->P - 1) / src->P;
    pthread_mutex_lock(&src->pool->mu);
    for (int k = 0; k < np; k++) {
        d->pages[k] = src->pages[k];
        src->pool->ref[src->pages[k]]++;
    }
    pthread_mutex_unlock(&src->pool->mu);
    d->n_pages = np;
    if (src->len) memcpy(d->tokens, src->tokens, sizeof *d->tokens * (size_t)src->len);
    d->len = src->len;
    d->mtp_len = src->mtp_len;
    d->salt = src->salt;
    *out = d;
    return 0;
}

/* ---- reading ---- */

static int check_read(const kv_seq *s, int l, int a, int b, petrel_error *err) {
    if (l < 0 || l >= s->pool->lay.n_layers || a < 0 || a > b || b > kv_seq_reserved(s))
        return pt_err(err, PETREL_EINVAL, "KV read of layer %d positions [%d, %d) outside the reserved %d positions of %d layers", l, a, b,
                      kv_seq_reserved(s), s->pool->lay.n_layers);
    return 0;
}

static void run_of(const kv_seq *s, int l, int a, int n, kv_run *r) {
    const kv_layout *y = &s->pool->lay;
    const kv_layer_off *f = &y->off[l];
    const uint8_t *pg = kv_page_ptr(s->pool, s->pages[a / s->P]);
    int i = a % s->P;
    r->pos = a;
    r->n = n;
    r->c = pg + f->c + (size_t)i * y->Rkv * y->c_bytes;
    r->pe = pg + f->pe + (size_t)i * y->Dr * y->pe_bytes;
    r->idx = f->idx >= 0 ? pg + f->idx + (size_t)i * y->Di * y->idx_bytes : NULL;
    r->c_scale = f->c_scale >= 0 ? (const float *)(pg + f->c_scale) + i : NULL;
    r->idx_scale = f->idx_scale >= 0 ? (const float *)(pg + f->idx_scale) + i : NULL;
}

int kv_run_at(const kv_seq *s, int l, int a, int b, kv_run *r, petrel_error *err) {
    PT_TRY(check_read(s, l, a, b, err));
    if (a == b) return pt_err(err, PETREL_EINVAL, "KV run of no positions (at %d)", a);
    int end = (a / s->P + 1) * s->P;
    run_of(s, l, a, (end < b ? end : b) - a, r);
    return r->n;
}

static void decode_run(const kv_layout *y, const kv_run *r, float *c, float *pe, float *idx) {
    for (int i = 0; i < r->n; i++) {
        if (c) kv_decode_row(y->c_bytes, (const uint8_t *)r->c + (size_t)i * y->Rkv * y->c_bytes, r->c_scale ? r->c_scale[i] : 0, y->Rkv,
                             c + (size_t)i * y->Rkv);
        if (pe) kv_decode_row(y->pe_bytes, (const uint8_t *)r->pe + (size_t)i * y->Dr * y->pe_bytes, 0, y->Dr, pe + (size_t)i * y->Dr);
        if (idx) kv_decode_row(y->idx_bytes, (const uint8_t *)r->idx + (size_t)i * y->Di * y->idx_bytes, r->idx_scale ? r->idx_scale[i] : 0,
                               y->Di, idx + (size_t)i * y->Di);
    }
}

int kv_decode(const kv_seq *s, int l, int a, int b, float *c, float *pe, float *idx, petrel_error *err) {
    PT_TRY(check_read(s, l, a, b, err));
    const kv_layout *y = &s->pool->lay;
    if (idx && !y->has_index[l]) return pt_err(err, PETREL_EINVAL, "KV layer %d keeps no indexer keys", l);
    while (a < b) {
        kv_run r;
        int end = (a / s->P + 1) * s->P;
        run_of(s, l, a, (end < b ? end : b) - a, &r);
        decode_run(y, &r, c, pe, idx);
        if (c) c += (size_t)r.n * y->Rkv;
        if (pe) pe += (size_t)r.n * y->Dr;
        if (idx) idx += (size_t)r.n * y->Di;
        a += r.n;
    }
    return 0;
}

int kv_gather(const kv_seq *s, int l, const int32_t *pos, int n, float *c, float *pe, float *idx, petrel_error *err) {
    const kv_layout *y = &s->pool->lay;
    if (l < 0 || l >= y->n_layers || n < 0) return pt_err(err, PETREL_EINVAL, "KV gather of %d positions of layer %d", n, l);
    if (idx && !y->has_index[l]) return pt_err(err, PETREL_EINVAL, "KV layer %d keeps no indexer keys", l);
    int res = kv_seq_reserved(s);
    for (int i = 0; i < n; i++) {
        if (pos[i] < 0 || pos[i] >= res)
            return pt_err(err, PETREL_EINVAL, "KV gather of position %d outside the reserved %d", pos[i], res);
        kv_run r;
        run_of(s, l, pos[i], 1, &r);
        decode_run(y, &r, c ? c + (size_t)i * y->Rkv : NULL, pe ? pe + (size_t)i * y->Dr : NULL, idx ? idx + (size_t)i * y->Di : NULL);
    }
    return 0;
}

int kv_rows(const kv_seq *s, int l, const int32_t *pos, int n, const float **c, const float **pe, float *cbuf, float *pbuf, petrel_error *err) {
    const kv_layout *y = &s->pool->lay;
    int R = kv_seq_reserved(s);
    if (l < 0 || l >= y->n_layers) return pt_err(err, PETREL_EINVAL, "KV read of layer %d of %d", l, y->n_layers);
    int direct = y->c_bytes == 4 && y->pe_bytes == 4;
    for (int i = 0; i < n; i++) {
        int p = pos ? pos[i] : i;
        if (p < 0 || p >= R) return pt_err(err, PETREL_EINVAL, "KV read of position %d outside the reserved %d", p, R);
        kv_run r;
        run_of(s, l, p, 1, &r);
        if (direct) {
            c[i] = r.c;
            pe[i] = r.pe;
        } else {
            float *cd = cbuf + (size_t)i * y->Rkv, *pd = pbuf + (size_t)i * y->Dr;
            decode_run(y, &r, cd, pd, NULL);
            c[i] = cd;
            pe[i] = pd;
        }
    }
    return 0;
}

int kv_is_f32(const kv_seq *s) { return s->pool->lay.c_bytes == 4 && s->pool->lay.pe_bytes == 4 && s->pool->lay.idx_bytes == 4; }
int kv_index_is_f32(const kv_seq *s) { return s->pool->lay.idx_bytes == 4; }
