/* store.c: the expert store: per-layer slot banks, expert -> slot map, eviction by the layer's
 * xs_pol, acquire/release with references, prefetch hints, statistics, usage persistence.
 *
 * Invariants (all under s->mu):
 *   - map[layer][e] == slot  <=>  slots[layer][slot].expert == e and state is LOADING or READY.
 *     A failed read removes the mapping at once; the slot becomes FREE when its last reference
 *     drops (immediately for an unreferenced prefetch), so no stale mapping survives a fault.
 *   - A slot with refs > 0 or in state LOADING is never chosen as a victim (the I/O thread may
 *     be writing it, or compute is reading it).
 *   - Slot memory is one posix_memalign(4096) block made at create; nothing is allocated by
 *     acquire/release/prefetch.
 * Statistics count per expert request: a hit is any request whose expert was mapped (ready or
 * still loading from a prefetch); prefetch_used counts prefetched experts later acquired. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/mem.h"
#include "base/outfile.h"
#include "experts/xs_io.h"

enum { SL_FREE = 0, SL_LOADING = 1, SL_READY = 2, SL_FAILED = 3 };

typedef struct xs_slot {
    int expert;           /* -1 when FREE */
    int state, refs;
    int prefetched;       /* loaded by a prefetch and not acquired since */
    uint64_t seq;         /* order in which its read was queued */
    xs_ioreq req;
    pt_wview gate, up, down;
    int layer, index;
} xs_slot;

struct xs_store {
    xs_source src;        /* copied; path/ctx borrowed */
    xs_plan plan;
    xs_store_opts opts;
    int L, E, S;
    uint64_t slot_bytes;
    uint64_t next_seq;
    uint8_t *mem;         /* owned [L][S][slot_bytes], 4096-aligned */
    xs_slot *slots;       /* owned [L][S] */
    int32_t *map;         /* owned [L][E]: slot or -1 */
    uint64_t *rec_off, *rec_bytes, *rec_xxh; /* owned [L][E] */
    xs_pol *pol;          /* owned [L] */
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* broadcast on every completion */
    int inflight;
    xs_io *io;            /* owned */
    xs_stats st;
    /* Lookahead (lookahead.c): la_pred [L][E] rank + 1 of each guess made for a layer (0:
     * none), la_prec [L][K] running precision of each rank of guesses (starts at 1). Written by
     * the one forward running at a time (like the slots' use marks), read by statistics. */
    int K;
    uint8_t *la_pred;     /* owned */
    uint8_t *acc_open;    /* owned [L]: an access of the layer is open (xs_access_begin): acquires
                             within it count as one access of the policy, as the replay does */
    double *la_prec;      /* owned */
};

static xs_slot *slot_at(xs_store *s, int layer, int i) { return &s->slots[(size_t)layer * s->S + i]; }
static int32_t *map_at(xs_store *s, int layer) { return &s->map[(size_t)layer * s->E]; }

/* I/O thread: a read finished (ok, failed or corrupt). */
static void on_done(void *ctx, xs_ioreq *r) {
    xs_store *s = ctx;
    xs_slot *sl = r->user;
    pthread_mutex_lock(&s->mu);
    s->st.read_retries += (uint64_t)r->attempt;
    if (r->status == 0 && s->src.views) {
        petrel_error e = {0};
        if (s->src.views(s->src.ctx, r->layer, r->expert, r->buf, &sl->gate, &sl->up, &sl->down, &e)) {
            r->status = e.code ? e.code : PETREL_EFORMAT;
            snprintf(r->msg, sizeof r->msg, "layer %d expert %d: %.200s", r->layer_id, r->expert, e.msg);
        }
    }
    if (r->status == 0) {
        sl->state = SL_READY;
        s->st.reads++;
        s->st.bytes_read += r->len;
    } else {
        s->st.read_failures++;
        if (r->checksum_bad) s->st.checksum_failures++;
        int32_t *m = map_at(s, sl->layer);
        if (m[sl->expert] == sl->index) m[sl->expert] = -1;
        sl->state = SL_FAILED;
        if (sl->refs == 0) { /* an unreferenced prefetch: nobody will look, free it now */
            sl->state = SL_FREE;
            sl->expert = -1;
            sl->prefetched = 0;
        }
    }
    s->inflight--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

int xs_store_create(const xs_source *src, const xs_plan *plan, const xs_store_opts *opts, xs_store **out,
                    petrel_error *err) {
    *out = NULL;
    if (!src || !plan || !src->record || src->n_layers <= 0 || src->n_experts <= 0)
        return pt_err(err, PETREL_EINVAL, "expert store: source needs n_layers, n_experts and a record callback");
    if (src->n_experts > XS_MAX_EXPERTS)
        return pt_err(err, PETREL_EUNSUPPORTED, "expert store: %d experts per layer (at most %d)", src->n_experts, XS_MAX_EXPERTS);
    if (plan->in.n_layers != src->n_layers || plan->in.n_experts != src->n_experts || plan->slots_per_layer < 1)
        return pt_err(err, PETREL_EINVAL, "expert store: plan (%d layers x %d experts) does not match the source (%d x %d)",
                      plan->in.n_layers, plan->in.n_experts, src->n_layers, src->n_experts);
    xs_store *s = calloc(1, sizeof *s);
    if (!s) return pt_err(err, PETREL_ENOMEM, "expert store: out of memory");
    s->src = *src;
    s->plan = *plan;
    if (opts) s->opts = *opts;
    if (!s->opts.policy.halflife && !s->opts.policy.repin_every && !s->opts.policy.pin_frac && !s->opts.policy.kind)
        xs_policy_defaults(&s->opts.policy);
    if (s->opts.retries == 0) s->opts.retries = 1;
    if (s->opts.retries < 0) s->opts.retries = 0;
    int verify = s->opts.verify >= 0;
    s->L = src->n_layers;
    s->E = src->n_experts;
    s->S = plan->slots_per_layer;
    s->slot_bytes = plan->slot_bytes;
    size_t LE = (size_t)s->L * s->E, LS = (size_t)s->L * s->S;
    int rc = 0;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    void *mem = pt_alloc_big(LS * s->slot_bytes, XS_ALIGN);
    if (!mem) {
        free(s);
        return pt_err(err, PETREL_ENOMEM, "expert store: cannot allocate %zu slots of %llu bytes", LS,
                      (unsigned long long)plan->slot_bytes);
    }
    s->mem = mem;
    /* Fault the slots in now (in huge pages where the kernel gives them: pt_alloc_big): an
     * O_DIRECT read into never-touched memory makes the kernel fault and pin page by page inside
     * the read, which measured ~5x slower than into touched memory (a prefill's first pass over
     * a large bank). */
    for (size_t o = 0; o < LS * s->slot_bytes; o += 4096) ((volatile uint8_t *)mem)[o] = 0;
    s->slots = calloc(LS, sizeof *s->slots);
    s->map = malloc(LE * sizeof *s->map);
    s->rec_off = malloc(LE * sizeof(uint64_t));
    s->rec_bytes = malloc(LE * sizeof(uint64_t));
    s->rec_xxh = malloc(LE * sizeof(uint64_t));
    s->pol = calloc((size_t)s->L, sizeof *s->pol);
    s->K = src->top_k > 0 ? src->top_k : 1;
    s->la_pred = calloc(LE, 1);
    s->acc_open = calloc((size_t)s->L, 1);
    s->la_prec = malloc(sizeof(double) * (size_t)s->L * (size_t)s->K);
    if (s->la_prec)
        for (size_t i = 0; i < (size_t)s->L * (size_t)s->K; i++) s->la_prec[i] = 1.0;
    if (!s->slots || !s->map || !s->rec_off || !s->rec_bytes || !s->rec_xxh || !s->pol || !s->la_pred || !s->la_prec || !s->acc_open) {
        rc = pt_err(err, PETREL_ENOMEM, "expert store: out of memory");
        goto fail;
    }
    int aligned = 1;
    for (int l = 0; l < s->L; l++) {
        if (xs_pol_init(&s->pol[l], s->E, s->S, &s->opts.policy)) {
            rc = pt_err(err, PETREL_ENOMEM, "expert store: out of memory");
            goto fail;
        }
        for (int e = 0; e < s->E; e++) {
            size_t i = (size_t)l * s->E + e;
            s->map[i] = -1;
            petrel_error e2 = {0};
            if (src->record(src->ctx, l, e, &s->rec_off[i], &s->rec_bytes[i], &s->rec_xxh[i], &e2)) {
                rc = pt_err(err, e2.code ? e2.code : PETREL_EFORMAT, "layer %d expert %d: %s", src->layer_ids ? src->layer_ids[l] : l, e, e2.msg);
                goto fail;
            }
            if (s->rec_bytes[i] == 0 || s->rec_bytes[i] > s->slot_bytes) {
                rc = pt_err(err, PETREL_EFORMAT, "layer %d expert %d: record of %llu bytes does not fit a %llu-byte slot",
                            src->layer_ids ? src->layer_ids[l] : l, e, (unsigned long long)s->rec_bytes[i], (unsigned long long)s->slot_bytes);
                goto fail;
            }
            if (s->rec_off[i] % XS_ALIGN) aligned = 0;
        }
        for (int i = 0; i < s->S; i++) {
            xs_slot *sl = slot_at(s, l, i);
            sl->expert = -1;
            sl->layer = l;
            sl->index = i;
            sl->req.user = sl;
            sl->req.buf = s->mem + ((size_t)l * s->S + i) * s->slot_bytes;
        }
    }
    int mode = s->opts.io_mode;
    if (!aligned) {
        if (mode == XS_IO_DIRECT) {
            rc = pt_err(err, PETREL_EUNSUPPORTED, "expert store: records are not %u-aligned, O_DIRECT impossible",
                        XS_ALIGN);
            goto fail;
        }
        mode = XS_IO_BUFFERED;
    }
    if ((rc = xs_io_open(&s->io, src->path, src->fd, mode, s->opts.backend, s->opts.io_threads, s->opts.io_depth, s->opts.retries,
                         verify, on_done, s, err)))
        goto fail;
    *out = s;
    return 0;
fail:
    xs_store_free(s);
    return rc;
}

void xs_store_drain(xs_store *s) {
    pthread_mutex_lock(&s->mu);
    while (s->inflight) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

void xs_store_free(xs_store *s) {
    if (!s) return;
    if (s->io) {
        xs_store_drain(s);
        xs_io_close(s->io);
    }
    if (s->pol)
        for (int l = 0; l < s->L; l++) xs_pol_deinit(&s->pol[l]);
    free(s->pol);
    free(s->slots);
    free(s->map);
    free(s->rec_off);
    free(s->rec_bytes);
    free(s->rec_xxh);
    free(s->la_pred);
    free(s->acc_open);
    free(s->la_prec);
    free(s->mem);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* A slot for a new expert: a FREE one, else the policy's victim among READY unreferenced slots
 * (pinned ones only when allow_pinned). A prefetched expert not yet used is taken only when
 * nothing else is left: it was read because it is about to be needed, and the policy, which
 * has not seen it used, would rank it coldest (a prefill chunk that needs more experts than
 * slots would evict its own reads before using them). Returns -1 if none. Caller holds mu. */
/* A free slot, else the best victim: a ready unreferenced expert, not pinned unless
 * allow_pinned, an ordinary one before a pending prefetch (one not yet used nor resolved by its
 * layer's routing), which only allow_pending may take. */
static int take_slot(xs_store *s, int layer, int allow_pinned, int allow_pending) {
    xs_pol *p = &s->pol[layer];
    int victim = -1;
    for (int i = 0; i < s->S; i++) {
        xs_slot *sl = slot_at(s, layer, i);
        if (sl->state == SL_FREE) return i;
        if (sl->state != SL_READY || sl->refs) continue;
        if (!allow_pinned && p->pinned[sl->expert]) continue;
        if (!allow_pending && sl->prefetched) continue;
        if (victim >= 0) {
            int vp = slot_at(s, layer, victim)->prefetched;
            if (sl->prefetched > vp) continue;
            if (sl->prefetched == vp && !xs_pol_evict_before(p, sl->expert, slot_at(s, layer, victim)->expert)) continue;
        }
        victim = i;
    }
    if (victim >= 0) {
        xs_slot *sl = slot_at(s, layer, victim);
        map_at(s, layer)[sl->expert] = -1;
        if (sl->prefetched) s->st.prefetch_wasted++;
        s->st.evictions++;
        sl->expert = -1;
        sl->state = SL_FREE;
        sl->prefetched = 0;
    }
    return victim;
}

/* Starts loading expert e into slot i (caller holds mu); adds the request to batch. */
static void start_load(xs_store *s, int layer, int i, int e, xs_ioreq **batch, int *nb) {
    xs_slot *sl = slot_at(s, layer, i);
    size_t ri = (size_t)layer * s->E + e;
    sl->expert = e;
    sl->state = SL_LOADING;
    sl->seq = s->next_seq++;
    memset(&sl->gate, 0, sizeof sl->gate);
    memset(&sl->up, 0, sizeof sl->up);
    memset(&sl->down, 0, sizeof sl->down);
    sl->req.layer = layer;
    sl->req.layer_id = s->src.layer_ids ? s->src.layer_ids[layer] : layer;
    sl->req.expert = e;
    sl->req.off = s->rec_off[ri];
    sl->req.bytes = s->rec_bytes[ri];
    sl->req.xxh = s->rec_xxh[ri];
    uint64_t len = sl->req.bytes;
    if (xs_io_direct(s->io)) len = (len + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN; /* <= slot_bytes */
    sl->req.len = len;
    map_at(s, layer)[e] = i;
    s->inflight++;
    batch[(*nb)++] = &sl->req;
}

static void unref(xs_store *s, int layer, int i) {
    xs_slot *sl = slot_at(s, layer, i);
    if (sl->refs > 0) sl->refs--;
    if (sl->refs == 0 && sl->state == SL_FAILED) {
        sl->state = SL_FREE;
        sl->expert = -1;
        sl->prefetched = 0;
    }
}

int xs_acquire(xs_store *s, int layer, const int32_t *experts, int n, xs_expert_ref *out, petrel_error *err) {
    if (layer < 0 || layer >= s->L || n < 0) return pt_err(err, PETREL_EINVAL, "expert store: layer %d out of range", layer);
    for (int i = 0; i < n; i++)
        if (experts[i] < 0 || experts[i] >= s->E)
            return pt_err(err, PETREL_EINVAL, "expert store: expert %d out of range in layer %d", experts[i], layer);
    xs_ioreq *batch[256];
    int nb = 0, rc = 0;
    pthread_mutex_lock(&s->mu);
    xs_pol *p = &s->pol[layer];
    int32_t *m = map_at(s, layer);
    if (!s->acc_open[layer]) xs_pol_begin(p); /* else xs_access_begin began it */
    /* pass 1: reference every hit first, so no miss below can evict it */
    for (int i = 0; i < n; i++) {
        int e = experts[i];
        xs_pol_use(p, e);
        out[i].expert = e;
        out[i].slot = m[e];
        s->st.accesses++;
        if (m[e] >= 0) {
            xs_slot *sl = slot_at(s, layer, m[e]);
            sl->refs++;
            s->st.hits++;
            if (sl->prefetched) {
                s->st.prefetch_used++;
                sl->prefetched = 0;
            }
        }
    }
    /* pass 2: a slot per miss (a repeated id maps on its first miss and is a hit after) */
    for (int i = 0; i < n; i++) {
        if (out[i].slot >= 0) continue;
        int e = experts[i];
        if (m[e] >= 0) { /* repeated id loaded earlier in this pass */
            out[i].slot = m[e];
            slot_at(s, layer, m[e])->refs++;
            s->st.hits++;
            continue;
        }
        int sl;
        for (;;) {
            sl = take_slot(s, layer, 0, 1);
            if (sl < 0) sl = take_slot(s, layer, 1, 1);
            if (sl >= 0) break;
            /* a prefetch still in flight holds the slot: it becomes evictable when it lands */
            int pending = 0;
            for (int j = 0; j < s->S; j++)
                pending |= slot_at(s, layer, j)->state == SL_LOADING && slot_at(s, layer, j)->refs == 0;
            if (!pending) break;
            pthread_cond_wait(&s->cv, &s->mu);
        }
        if (sl < 0) {
            int used = 0;
            for (int j = 0; j < s->S; j++) used += slot_at(s, layer, j)->refs > 0 || slot_at(s, layer, j)->state == SL_LOADING;
            rc = pt_err(err, PETREL_ERANGE,
                        "expert store: layer %d has %d slots, %d busy; cannot hold %d experts at once (acquire in "
                        "chunks of at most %d)",
                        s->src.layer_ids ? s->src.layer_ids[layer] : layer, s->S, used, n, s->S);
            break;
        }
        s->st.misses++;
        start_load(s, layer, sl, e, batch, &nb);
        slot_at(s, layer, sl)->refs = 1;
        out[i].slot = sl;
        if (nb == (int)(sizeof batch / sizeof batch[0])) {
            xs_io_submit(s->io, batch, nb);
            nb = 0;
        }
    }
    xs_io_submit(s->io, batch, nb); /* every miss at once */
    /* wait for our loads (also those started by an earlier prefetch) */
    uint64_t t0 = pt_now_ns();
    int waited = 0;
    for (;;) {
        int loading = 0;
        for (int i = 0; i < n; i++)
            if (out[i].slot >= 0 && slot_at(s, layer, out[i].slot)->state == SL_LOADING) loading = 1;
        if (!loading) break;
        waited = 1;
        pthread_cond_wait(&s->cv, &s->mu);
    }
    if (waited) s->st.io_wait_ns += pt_now_ns() - t0;
    if (!rc)
        for (int i = 0; i < n; i++) {
            xs_slot *sl = slot_at(s, layer, out[i].slot);
            if (sl->state == SL_FAILED) {
                if (s->src.path) rc = pt_err(err, sl->req.status ? sl->req.status : PETREL_EIO, "%s: %s", s->src.path, sl->req.msg);
                else rc = pt_err(err, sl->req.status ? sl->req.status : PETREL_EIO, "%s", sl->req.msg);
                break;
            }
        }
    if (rc) {
        /* drop every reference this call took: exactly the entries with a slot */
        for (int i = 0; i < n; i++)
            if (out[i].slot >= 0) unref(s, layer, out[i].slot);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    for (int i = 0; i < n; i++) {
        xs_slot *sl = slot_at(s, layer, out[i].slot);
        out[i].data = sl->req.buf;
        out[i].bytes = sl->req.bytes;
        out[i].gate = sl->gate;
        out[i].up = sl->up;
        out[i].down = sl->down;
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void xs_release(xs_store *s, int layer, const xs_expert_ref *refs, int n) {
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n; i++)
        if (refs[i].slot >= 0 && refs[i].slot < s->S) unref(s, layer, refs[i].slot);
    pthread_mutex_unlock(&s->mu);
}

int xs_prefetch(xs_store *s, int layer, const int32_t *experts, int n) {
    if (layer < 0 || layer >= s->L) return 0;
    xs_ioreq *batch[256];
    int nb = 0, issued = 0;
    pthread_mutex_lock(&s->mu);
    int32_t *m = map_at(s, layer);
    for (int i = 0; i < n; i++) {
        int e = experts[i];
        if (e < 0 || e >= s->E || m[e] >= 0) continue;
        int sl = take_slot(s, layer, 0, 0); /* a hint never evicts a pinned expert, nor a hint still pending */
        if (sl < 0) break;
        start_load(s, layer, sl, e, batch, &nb);
        slot_at(s, layer, sl)->prefetched = 1;
        s->st.prefetch_issued++;
        issued++;
        if (nb == (int)(sizeof batch / sizeof batch[0])) {
            xs_io_submit(s->io, batch, nb);
            nb = 0;
        }
    }
    xs_io_submit(s->io, batch, nb);
    pthread_mutex_unlock(&s->mu);
    return issued;
}

int xs_store_warm_pins(xs_store *s, petrel_error *err) {
    (void)err;
    int32_t ids[1024];
    for (int l = 0; l < s->L; l++) {
        int n = 0;
        xs_pol *p = &s->pol[l];
        for (int e = 0; e < s->E && n < 1024; e++)
            if (p->pinned[e]) ids[n++] = e;
        xs_prefetch(s, l, ids, n);
    }
    xs_store_drain(s);
    return 0;
}

int xs_store_slots(const xs_store *s) { return s->S; }
void xs_store_memory(const xs_store *s, uint8_t **base, size_t *bytes) {
    *base = s->mem;
    *bytes = (size_t)s->L * s->S * s->slot_bytes;
}
int xs_store_direct(const xs_store *s) { return xs_io_direct(s->io); }
int xs_store_uring(const xs_store *s) { return xs_io_uring(s->io); }

void xs_store_stats(const xs_store *s, xs_stats *out) {
    xs_store *m = (xs_store *)s;
    pthread_mutex_lock(&m->mu);
    *out = s->st;
    pthread_mutex_unlock(&m->mu);
    if (m->io) out->io_busy_ns = xs_io_busy_ns(m->io);
}

void xs_store_note_tokens(xs_store *s, uint64_t n) {
    pthread_mutex_lock(&s->mu);
    s->st.tokens += n;
    pthread_mutex_unlock(&s->mu);
}

int xs_stats_format(const xs_stats *st, char *buf, size_t n) {
    double tok = st->tokens ? (double)st->tokens : 1.0, acc = st->accesses ? (double)st->accesses : 1.0;
    return snprintf(buf, n,
                    "experts: hit %.1f%% (%llu/%llu), per token %.2f demand misses %.2f reads %.2f MiB read %.3f ms I/O wait; "
                    "prefetch %llu issued %llu used %llu wasted; %llu retries %llu failed reads %llu checksum errors",
                    100.0 * (double)st->hits / acc, (unsigned long long)st->hits, (unsigned long long)st->accesses,
                    (double)st->misses / tok, (double)st->reads / tok, (double)st->bytes_read / tok / 1048576.0,
                    (double)st->io_wait_ns / tok / 1e6,
                    (unsigned long long)st->prefetch_issued, (unsigned long long)st->prefetch_used,
                    (unsigned long long)st->prefetch_wasted, (unsigned long long)st->read_retries,
                    (unsigned long long)st->read_failures, (unsigned long long)st->checksum_failures);
}

int xs_store_slot_of(const xs_store *s, int layer, int expert) {
    xs_store *m = (xs_store *)s;
    pthread_mutex_lock(&m->mu);
    int r = m->map[(size_t)layer * s->E + expert];
    pthread_mutex_unlock(&m->mu);
    return r;
}

int xs_store_state(const xs_store *s, int layer, int expert, uint64_t *seq) {
    xs_store *m = (xs_store *)s;
    pthread_mutex_lock(&m->mu);
    int i = m->map[(size_t)layer * s->E + expert], st = XS_ABSENT;
    if (i >= 0) {
        xs_slot *sl = slot_at(m, layer, i);
        st = sl->state == SL_READY ? XS_READY : sl->state == SL_LOADING ? XS_LOADING : XS_ABSENT;
        if (seq) *seq = sl->seq;
    }
    pthread_mutex_unlock(&m->mu);
    return st;
}

int xs_cancel_prefetches(xs_store *s, int layer, const uint8_t *keep) {
    if (layer < 0 || layer >= s->L) return 0;
    int n = 0;
    pthread_mutex_lock(&s->mu);
    int32_t *m = map_at(s, layer);
    for (int i = 0; i < s->S; i++) {
        xs_slot *sl = slot_at(s, layer, i);
        if (!sl->prefetched || sl->refs || keep[sl->expert] || (sl->state != SL_LOADING && sl->state != SL_READY)) continue;
        if (sl->state == SL_READY || !xs_io_cancel(s->io, &sl->req)) {
            /* read (or reading): it stays cached, but as an ordinary expert that was not used,
             * no longer protected as a pending prefetch */
            sl->prefetched = 0;
            s->st.prefetch_wasted++;
            continue;
        }
        if (m[sl->expert] == i) m[sl->expert] = -1;
        sl->state = SL_FREE;
        sl->expert = -1;
        sl->prefetched = 0;
        s->inflight--;
        s->st.prefetch_cancelled++;
        n++;
    }
    if (n) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return n;
}

int xs_store_pinned(const xs_store *s, int layer, int expert) { return s->pol[layer].pinned[expert]; }
xs_pol *xs_store_policy(xs_store *s, int layer) { return &s->pol[layer]; }

/* ---------------------------------------------------------------- usage history */
void xs_usage_path(const char *model_path, char *buf, size_t n) {
    size_t l = strlen(model_path);
    while (l > 1 && model_path[l - 1] == '/') l--; /* a folder: the file goes beside it */
    snprintf(buf, n, "%.*s.petrel-usage", (int)l, model_path);
}

int xs_usage_save(const xs_store *s, const char *path, petrel_error *err) {
    pt_outfile f; /* whole or nothing, never through a link (base/outfile.h) */
    if (pt_out_open(&f, path, NULL, err) < 0) return pt_err_ctx(err, "usage file");
    xs_store *m = (xs_store *)s;
    pthread_mutex_lock(&m->mu);
    pt_out_printf(&f, "# petrel-usage v1 layers=%d experts=%d\n", s->L, s->E);
    for (int l = 0; l < s->L; l++) {
        pt_out_printf(&f, "%d", l);
        for (int e = 0; e < s->E; e++) pt_out_printf(&f, " %llu", (unsigned long long)s->pol[l].uses[e]);
        pt_out_write(&f, "\n", 1, NULL);
    }
    pthread_mutex_unlock(&m->mu);
    if (pt_out_commit(&f, err) < 0) return pt_err_ctx(err, "usage file");
    return 0;
}

int xs_usage_load(xs_store *s, const char *path, int *loaded, petrel_error *err) {
    if (loaded) *loaded = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) return 0;
        return pt_err(err, PETREL_EIO, "cannot read usage file %s: %s", path, strerror(errno));
    }
    int L = 0, E = 0;
    if (fscanf(f, "# petrel-usage v1 layers=%d experts=%d", &L, &E) != 2 || L != s->L || E != s->E) {
        fclose(f);
        return pt_err(err, PETREL_EFORMAT, "usage file %s: not a petrel-usage v1 file for %d layers x %d experts", path,
                      s->L, s->E);
    }
    uint64_t *c = malloc(sizeof(uint64_t) * (size_t)L * E);
    if (!c) {
        fclose(f);
        return pt_err(err, PETREL_ENOMEM, "usage file: out of memory");
    }
    for (int l = 0; l < L; l++) {
        int li;
        if (fscanf(f, "%d", &li) != 1 || li != l) goto bad;
        for (int e = 0; e < E; e++) {
            unsigned long long v;
            if (fscanf(f, "%llu", &v) != 1) goto bad;
            c[(size_t)l * E + e] = v;
        }
    }
    fclose(f);
    pthread_mutex_lock(&s->mu);
    for (int l = 0; l < L; l++) {
        for (int e = 0; e < E; e++) s->pol[l].uses[e] += c[(size_t)l * E + e];
        xs_pol_repin(&s->pol[l]);
    }
    pthread_mutex_unlock(&s->mu);
    free(c);
    if (loaded) *loaded = 1;
    return 0;
bad:
    fclose(f);
    free(c);
    return pt_err(err, PETREL_EFORMAT, "usage file %s: malformed (expected '<layer> <count> x %d' lines)", path, E);
}

int xs_store_experts(const xs_store *s) { return s->E; }
int xs_store_layers(const xs_store *s) { return s->L; }
void xs_access_begin(xs_store *s, int layer) {
    if (layer < 0 || layer >= s->L) return;
    pthread_mutex_lock(&s->mu);
    xs_pol_begin(&s->pol[layer]);
    s->acc_open[layer] = 1;
    pthread_mutex_unlock(&s->mu);
}

void xs_access_end(xs_store *s, int layer) {
    if (layer < 0 || layer >= s->L) return;
    pthread_mutex_lock(&s->mu);
    s->acc_open[layer] = 0;
    pthread_mutex_unlock(&s->mu);
}

void xs_store_lock(xs_store *s) { pthread_mutex_lock(&s->mu); }
void xs_store_unlock(xs_store *s) { pthread_mutex_unlock(&s->mu); }
uint8_t *xs_la_guesses(xs_store *s, int layer) { return s->la_pred + (size_t)layer * s->E; }
double *xs_la_precision(xs_store *s, int layer) { return s->la_prec + (size_t)layer * s->K; }
