/* load.c: reading every expert record once (xs_load_all), for a model whose routed experts are
 * all resident: the same I/O pool, fault seam and checksum threads as the store's misses, so a
 * fully resident load checks each record exactly as a streamed read would, and tests inject
 * faults into it the same way.
 *
 * The calling thread keeps at most WINDOW_PER_THREAD reads per I/O thread queued (2 when only
 * checking, since each then holds a scratch buffer; in file order)
 * and reports progress as they finish; after the first failure it queues nothing more, waits
 * for what is in flight and returns the failure with the lowest (layer, expert). With base NULL
 * (check only), each read in flight has its own scratch buffer of the largest record. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/err.h"
#include "experts/xs_io.h"

#define WINDOW_PER_THREAD 4

typedef struct loader {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int inflight;
    uint64_t done_bytes;
    int failed;                 /* a request failed; fail_at / code / msg hold the first one */
    long fail_at;               /* its index (layer * E + expert) */
    int code;
    char msg[256];
    uint8_t **free_bufs;        /* check-only: scratch buffers not in use */
    int n_free;
} loader;

static void on_loaded(void *ctx, xs_ioreq *r) {
    loader *ld = ctx;
    pthread_mutex_lock(&ld->mu);
    ld->inflight--;
    ld->done_bytes += r->bytes;
    long at = (long)(intptr_t)r->user;
    if (r->status && (!ld->failed || at < ld->fail_at)) {
        ld->failed = 1;
        ld->fail_at = at;
        ld->code = r->status;
        snprintf(ld->msg, sizeof ld->msg, "%s", r->msg);
    }
    if (ld->free_bufs) ld->free_bufs[ld->n_free++] = r->buf;
    pthread_cond_broadcast(&ld->cv);
    pthread_mutex_unlock(&ld->mu);
}

int xs_load_all(const xs_source *src, uint8_t *base, const xs_store_opts *opts,
                void (*progress)(uint64_t, uint64_t, void *), void *ud, petrel_error *err) {
    xs_store_opts o = opts ? *opts : (xs_store_opts){.io_mode = XS_IO_BUFFERED, .retries = 1};
    int L = src->n_layers, E = src->n_experts;
    long n = (long)L * E;
    if (n <= 0) return 0;
    int threads = o.io_threads > 0 ? o.io_threads : XS_IO_DEFAULT_THREADS;
    if (threads > XS_IO_MAX_THREADS) threads = XS_IO_MAX_THREADS;
    int window = threads * (base ? WINDOW_PER_THREAD : 2); /* check-only: each read in flight holds a scratch record */
    xs_ioreq *reqs = calloc((size_t)n, sizeof *reqs);
    if (!reqs) return pt_err(err, PETREL_ENOMEM, "out of memory for %ld expert reads", n);
    uint64_t total = 0, maxrec = 0;
    int rc = 0;
    for (int l = 0; l < L && !rc; l++)
        for (int e = 0; e < E && !rc; e++) {
            xs_ioreq *r = &reqs[(long)l * E + e];
            petrel_error e2 = {0};
            int lid = src->layer_ids ? src->layer_ids[l] : l;
            if (src->record(src->ctx, l, e, &r->off, &r->bytes, &r->xxh, &e2) < 0)
                rc = pt_err(err, e2.code ? e2.code : PETREL_EFORMAT, "layer %d expert %d: %s", lid, e, e2.msg);
            else if (!r->bytes || (base && (r->off % XS_ALIGN || ((uintptr_t)base) % XS_ALIGN)))
                rc = pt_err(err, PETREL_EFORMAT, "layer %d expert %d: record at byte %llu (%llu bytes) is empty or misaligned", lid, e,
                            (unsigned long long)r->off, (unsigned long long)r->bytes);
            r->layer = l;
            r->layer_id = lid;
            r->expert = e;
            r->len = r->bytes;
            r->buf = base ? base + r->off : NULL;
            r->user = (void *)(intptr_t)((long)l * E + e);
            total += r->bytes;
            if (r->bytes > maxrec) maxrec = r->bytes;
        }
    loader ld = {.fail_at = -1};
    pthread_mutex_init(&ld.mu, NULL);
    pthread_cond_init(&ld.cv, NULL);
    uint8_t *scratch = NULL;
    if (!rc && !base) {
        uint64_t slot = (maxrec + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN;
        ld.free_bufs = malloc(sizeof(uint8_t *) * (size_t)window);
        if (!ld.free_bufs || posix_memalign((void **)&scratch, XS_ALIGN, (size_t)(slot * (uint64_t)window)))
            rc = pt_err(err, PETREL_ENOMEM, "out of memory for %d expert read buffers", window);
        for (int i = 0; !rc && i < window; i++) ld.free_bufs[ld.n_free++] = scratch + (size_t)i * slot;
    }
    xs_io *io = NULL;
    if (!rc)
        rc = xs_io_open(&io, o.io_mode == XS_IO_BUFFERED ? NULL : src->path, src->fd, o.io_mode, o.backend, threads, o.io_depth,
                        o.retries, o.verify >= 0, on_loaded, &ld, err);
    if (!rc) {
        int direct = xs_io_direct(io);
        long next = 0;
        uint64_t shown = 0;
        pthread_mutex_lock(&ld.mu);
        for (;;) {
            while (next < n && !ld.failed && ld.inflight < window) {
                xs_ioreq *r = &reqs[next++];
                if (!base) r->buf = ld.free_bufs[--ld.n_free];
                if (direct) r->len = (r->bytes + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN; /* records are whole pages in packs */
                ld.inflight++;
                pthread_mutex_unlock(&ld.mu);
                xs_io_submit(io, &r, 1);
                pthread_mutex_lock(&ld.mu);
            }
            if (!ld.inflight && (next == n || ld.failed)) break;
            pthread_cond_wait(&ld.cv, &ld.mu);
            if (progress && ld.done_bytes != shown) {
                shown = ld.done_bytes;
                pthread_mutex_unlock(&ld.mu);
                progress(shown, total, ud);
                pthread_mutex_lock(&ld.mu);
            }
        }
        pthread_mutex_unlock(&ld.mu);
        xs_io_close(io);
        if (ld.failed && src->path) rc = pt_err(err, ld.code ? ld.code : PETREL_EIO, "%s: %s", src->path, ld.msg);
        else if (ld.failed) rc = pt_err(err, ld.code ? ld.code : PETREL_EIO, "%s", ld.msg);
        else if (progress && shown != total) progress(total, total, ud);
    }
    pthread_mutex_destroy(&ld.mu);
    pthread_cond_destroy(&ld.cv);
    free(scratch);
    free(ld.free_bufs);
    free(reqs);
    return rc;
}

/* ---- xs_read_probe: the disk as the store reads it ---- */

typedef struct prober {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int inflight, failed;
    uint64_t done_bytes;
    xs_ioreq **idle;            /* requests (each with its buffer) not in flight */
    int n_idle;
} prober;

static void on_probed(void *ctx, xs_ioreq *r) {
    prober *p = ctx;
    pthread_mutex_lock(&p->mu);
    p->inflight--;
    if (r->status) p->failed = 1;
    else p->done_bytes += r->bytes;
    p->idle[p->n_idle++] = r;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

double xs_read_probe(const char *path, const uint64_t *off, const uint64_t *bytes, int n, int depth, uint64_t limit, double secs) {
    if (!path || n <= 0) return 0;
    if (depth < 1) depth = XS_IO_DEFAULT_DEPTH;
    uint64_t maxrec = 0;
    for (int i = 0; i < n; i++)
        if (bytes[i] > maxrec) maxrec = bytes[i];
    uint64_t slot = (maxrec + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN;
    int window = 2 * depth; /* as the store queues behind its reads in flight */
    xs_ioreq *reqs = calloc((size_t)window, sizeof *reqs);
    xs_ioreq **idle = malloc(sizeof(xs_ioreq *) * (size_t)window);
    uint8_t *bufs = NULL;
    if (!reqs || !idle || posix_memalign((void **)&bufs, XS_ALIGN, (size_t)(slot * (uint64_t)window))) {
        free(reqs), free(idle), free(bufs);
        return 0;
    }
    memset(bufs, 0, (size_t)(slot * (uint64_t)window)); /* an O_DIRECT read into untouched pages is slower */
    prober p = {.idle = idle};
    for (int i = 0; i < window; i++) reqs[i].buf = bufs + (size_t)i * slot, idle[p.n_idle++] = &reqs[i];
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    xs_io *io = NULL;
    petrel_error err = {0};
    double gbs = 0;
    if (xs_io_open(&io, path, -1, XS_IO_AUTO, XS_BACKEND_AUTO, XS_IO_DEFAULT_THREADS, depth, 0, 0, on_probed, &p, &err) == 0) {
        int direct = xs_io_direct(io);
        uint64_t x = 0x9E3779B97F4A7C15ull, queued = 0, t0 = pt_now_ns(), tmax = (uint64_t)(secs * 1e9);
        pthread_mutex_lock(&p.mu);
        for (;;) {
            while (!p.failed && p.n_idle && queued < limit && pt_now_ns() - t0 < tmax) {
                xs_ioreq *r = p.idle[--p.n_idle];
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                int k = (int)(x % (uint64_t)n);
                uint8_t *buf = r->buf;
                memset(r, 0, sizeof *r);
                r->buf = buf, r->off = off[k], r->bytes = bytes[k], r->expert = k;
                r->len = direct ? (r->bytes + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN : r->bytes;
                queued += r->bytes;
                p.inflight++;
                pthread_mutex_unlock(&p.mu);
                xs_io_submit(io, &r, 1);
                pthread_mutex_lock(&p.mu);
            }
            if (!p.inflight) break;
            pthread_cond_wait(&p.cv, &p.mu);
        }
        uint64_t dt = pt_now_ns() - t0;
        if (!p.failed && dt) gbs = (double)p.done_bytes / (double)dt;
        pthread_mutex_unlock(&p.mu);
        xs_io_close(io);
    }
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    free(reqs), free(idle), free(bufs);
    return gbs;
}
