/* io.c: the expert store's I/O pool. One thread drives an io_uring (at most `depth` whole-expert
 * reads in flight, default 2, so reads finish roughly in queue order and what is still queued
 * can be cancelled; each read goes as up to 8 concurrent pieces, xs_io.h) and hands
 * each completed read to `threads` checker threads (XXH64 of a 19 MB GLM-5.2 expert takes ~2 ms,
 * as long as the read itself at 8 GB/s: checked serially on the ring's thread it became the
 * bottleneck); where io_uring cannot be set up, `threads` threads each pread and check.
 * O_DIRECT is used when the file system accepts it (probed at open with one aligned read), else
 * the page cache is used.
 *
 * The fault seam: every completed read attempt, from either backend, goes through
 * read_finished(), which consults xs_io_fault_hook (tests inject errors, short reads, delays).
 * A failed or short attempt is retried up to `retries` times, then the request fails with
 * "layer L expert E: ..." in its msg (L: the request's layer_id, the number `petrel info` uses). Every successful read is checked with XXH64 (unless verify is
 * off); a mismatch fails the request as "layer L expert E: checksum mismatch" (not retried: the bytes
 * on disk are wrong). done() is called exactly once per request. */
#include "experts/xs_io.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/file.h"

xs_fault_fn xs_io_fault_hook;
void *xs_io_fault_ctx;

#define QD 64

struct xs_io {
    int fd, own_fd, direct, uring;
    int retries, verify;
    xs_io_done_fn done;
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    xs_ioreq *head, *tail;   /* pending, FIFO */
    int stop;
    int n_threads;            /* pread threads, or 1 (the ring's) */
    int depth;                /* uring: requests in flight at most */
    int active;               /* reads in progress (under mu) */
    uint64_t busy_since, busy_ns; /* time with at least one read in progress */
    pthread_t th[XS_IO_MAX_THREADS];
    struct io_uring ring;
    /* uring only: reads done, checksum pending, FIFO; checker threads drain it */
    xs_ioreq *chead, *ctail;
    int cstop, n_checkers;
    pthread_cond_t ccv;
    pthread_t cth[XS_IO_MAX_THREADS];
};

/* Busy accounting: d = +1 when a read starts, -1 when it ends. Caller holds mu. */
static void busy_locked(xs_io *io, int d) {
    int was = io->active;
    io->active += d;
    if (!was && io->active) io->busy_since = pt_now_ns();
    if (was && !io->active) io->busy_ns += pt_now_ns() - io->busy_since;
}

static void busy(xs_io *io, int d) {
    pthread_mutex_lock(&io->mu);
    busy_locked(io, d);
    pthread_mutex_unlock(&io->mu);
}

uint64_t xs_io_busy_ns(xs_io *io) {
    pthread_mutex_lock(&io->mu);
    uint64_t t = io->busy_ns + (io->active ? pt_now_ns() - io->busy_since : 0);
    pthread_mutex_unlock(&io->mu);
    return t;
}

int xs_io_direct(const xs_io *io) { return io->direct; }
int xs_io_uring(const xs_io *io) { return io->uring; }

/* 1: retry the request; 0: failed, done() called; 2: read complete, the checksum is next. */
static int read_finished(xs_io *io, xs_ioreq *r, int64_t res) {
    xs_fault f = {0};
    if (xs_io_fault_hook) xs_io_fault_hook(xs_io_fault_ctx, r->layer, r->expert, r->attempt, &f);
    if (f.delay_ns) {
        struct timespec ts = {(time_t)(f.delay_ns / 1000000000u), (long)(f.delay_ns % 1000000000u)};
        while (nanosleep(&ts, &ts) && errno == EINTR) {}
    }
    if (f.kind == XS_FAULT_ERROR) res = -(f.err_no ? f.err_no : EIO);
    else if (f.kind == XS_FAULT_SHORT && res > (int64_t)f.short_bytes) res = (int64_t)f.short_bytes;
    if (res < 0 || (uint64_t)res < r->bytes) {
        if (r->attempt < io->retries) {
            r->attempt++;
            return 1;
        }
        r->status = PETREL_EIO;
        if (res < 0)
            snprintf(r->msg, sizeof r->msg, "layer %d expert %d: read failed at offset %llu (%llu bytes, %d attempts): %s",
                     r->layer_id, r->expert, (unsigned long long)r->off, (unsigned long long)r->bytes, r->attempt + 1,
                     strerror((int)-res));
        else
            snprintf(r->msg, sizeof r->msg, "layer %d expert %d: short read at offset %llu: %lld of %llu bytes (%d attempts)",
                     r->layer_id, r->expert, (unsigned long long)r->off, (long long)res, (unsigned long long)r->bytes,
                     r->attempt + 1);
    } else {
        return 2;
    }
    io->done(io->ctx, r);
    return 0;
}

/* The read succeeded: check it and finish the request. */
static void check_finish(xs_io *io, xs_ioreq *r) {
    r->status = 0;
    if (io->verify && XXH64(r->buf, (size_t)r->bytes, 0) != r->xxh) {
        r->status = PETREL_EFORMAT;
        r->checksum_bad = 1;
        snprintf(r->msg, sizeof r->msg, "layer %d expert %d: checksum mismatch (bytes %llu..%llu): the file is corrupted",
                 r->layer_id, r->expert, (unsigned long long)r->off, (unsigned long long)(r->off + r->bytes));
    }
    io->done(io->ctx, r);
}

static void *checker_thread(void *arg) {
    xs_io *io = arg;
    for (;;) {
        pthread_mutex_lock(&io->mu);
        while (!io->chead && !io->cstop) pthread_cond_wait(&io->ccv, &io->mu);
        xs_ioreq *r = io->chead;
        if (r) {
            io->chead = r->next;
            if (!io->chead) io->ctail = NULL;
            r->next = NULL;
        }
        pthread_mutex_unlock(&io->mu);
        if (!r) return NULL; /* stopped with an empty queue */
        check_finish(io, r);
    }
}

/* uring: a successful read goes to a checker (or is checked here when there is none). */
static void hand_to_checker(xs_io *io, xs_ioreq *r) {
    if (!io->n_checkers) {
        check_finish(io, r);
        return;
    }
    pthread_mutex_lock(&io->mu);
    r->next = NULL;
    if (io->ctail) io->ctail->next = r;
    else io->chead = r;
    io->ctail = r;
    pthread_cond_signal(&io->ccv);
    pthread_mutex_unlock(&io->mu);
}

/* pread until len bytes, EOF or an error (a pread may legally return less than asked). */
static int64_t pread_all(int fd, uint8_t *buf, uint64_t len, uint64_t off) {
    uint64_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, buf + got, (size_t)(len - got), (off_t)(off + got));
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) break;
        got += (uint64_t)n;
    }
    return (int64_t)got;
}

static xs_ioreq *pop_locked(xs_io *io) {
    xs_ioreq *r = io->head;
    if (r) {
        io->head = r->next;
        if (!io->head) io->tail = NULL;
        r->next = NULL;
    }
    return r;
}

static void *pread_thread(void *arg) {
    xs_io *io = arg;
    for (;;) {
        pthread_mutex_lock(&io->mu);
        while (!io->head && !io->stop) pthread_cond_wait(&io->cv, &io->mu);
        xs_ioreq *r = pop_locked(io);
        pthread_mutex_unlock(&io->mu);
        if (!r) return NULL; /* stop with an empty queue */
        int rc;
        do {
            busy(io, 1);
            int64_t res = pread_all(io->fd, r->buf, r->len, r->off);
            busy(io, -1);
            rc = read_finished(io, r, res);
        } while (rc == 1);
        if (rc == 2) check_finish(io, r);
    }
}

static void *uring_thread(void *arg) {
    xs_io *io = arg;
    xs_ioreq *local = NULL, *ltail = NULL; /* taken from the queue, not yet submitted (or retries) */
    int inflight = 0, sqes = 0;                /* requests and pieces in flight */
    for (;;) {
        pthread_mutex_lock(&io->mu);
        while (!io->head && !local && !inflight && !io->stop) pthread_cond_wait(&io->cv, &io->mu);
        if (io->stop && !io->head && !local && !inflight) {
            pthread_mutex_unlock(&io->mu);
            return NULL;
        }
        /* Take pending requests only up to `depth` in flight: reads then finish in queue order,
         * one after another at full speed, instead of all together at the end (a 19 MB read is
         * already split into many device requests by the kernel). What stays queued can still
         * be cancelled or overtaken. */
        int nl = 0;
        for (xs_ioreq *r = local; r; r = r->next) nl++;
        while (io->head && inflight + nl < io->depth) {
            xs_ioreq *r = pop_locked(io);
            if (ltail) ltail->next = r;
            else local = r;
            ltail = r;
            nl++;
        }
        pthread_mutex_unlock(&io->mu);
        int queued = 0;
        while (local && sqes + XS_IO_PARTS <= QD && io_uring_sq_space_left(&io->ring) >= XS_IO_PARTS) {
            xs_ioreq *r = local;
            local = r->next;
            if (!local) ltail = NULL;
            r->next = NULL;
            /* pieces: at least 1 MiB each, 4 KiB-aligned (O_DIRECT), at most XS_IO_PARTS */
            uint64_t np = (r->len + (1u << 20) - 1) >> 20;
            if (np > XS_IO_PARTS) np = XS_IO_PARTS;
            if (np < 1) np = 1;
            uint64_t chunk = ((r->len + np - 1) / np + XS_ALIGN - 1) / XS_ALIGN * XS_ALIGN;
            r->parts = 0;
            r->part_err = 0;
            for (uint64_t o = 0; o < r->len; o += chunk) {
                xs_iopart *pt = &r->part[r->parts++];
                pt->r = r;
                pt->off = o;
                pt->len = r->len - o < chunk ? r->len - o : chunk;
                pt->got = 0;
                struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring); /* space checked above */
                io_uring_prep_read(sqe, io->fd, r->buf + o, (unsigned)pt->len, r->off + o);
                io_uring_sqe_set_data(sqe, pt);
                sqes++;
            }
            r->parts_left = r->parts;
            inflight++;
            queued++;
        }
        if (queued) busy(io, queued);
        /* a failed submit (EAGAIN/EBUSY) leaves the SQEs queued; the next submit retries them */
        if (queued) (void)io_uring_submit(&io->ring);
        if (!inflight) continue;
        /* Wait briefly so new requests queued meanwhile are picked up soon. */
        struct io_uring_cqe *cqe;
        struct __kernel_timespec ts = {0, 1000000};
        int rc = io_uring_wait_cqe_timeout(&io->ring, &cqe, &ts);
        if (rc < 0 && rc != -ETIME && rc != -EINTR) continue;
        unsigned head, n = 0;
        io_uring_for_each_cqe(&io->ring, head, cqe) {
            xs_iopart *pt = io_uring_cqe_get_data(cqe);
            xs_ioreq *r = pt->r;
            int64_t res = cqe->res;
            n++;
            sqes--;
            if (res < 0) {
                if (!r->part_err) r->part_err = res;
            } else {
                pt->got = (uint64_t)res;
                /* a short read of a regular file before EOF: finish the piece with pread (rare) */
                if (pt->got < pt->len && r->off + pt->off + pt->got < r->off + r->bytes) {
                    int64_t more = pread_all(io->fd, r->buf + pt->off + pt->got, pt->len - pt->got, r->off + pt->off + pt->got);
                    if (more < 0 && !r->part_err) r->part_err = more;
                    else if (more > 0) pt->got += (uint64_t)more;
                }
            }
            if (--r->parts_left) continue;
            /* the whole read: an error, or the bytes read contiguously from the start */
            inflight--;
            busy(io, -1);
            if (r->part_err) res = r->part_err;
            else {
                res = 0;
                for (int i = 0; i < r->parts; i++) {
                    res += (int64_t)r->part[i].got;
                    if (r->part[i].got < r->part[i].len) break;
                }
            }
            int rc2 = read_finished(io, r, res);
            if (rc2 == 1) { /* retry: back to the local queue's front */
                r->next = local;
                local = r;
                if (!ltail) ltail = r;
            } else if (rc2 == 2) {
                hand_to_checker(io, r);
            }
        }
        io_uring_cq_advance(&io->ring, n);
    }
}

#define REPLACED_MSG "the path names another file than the one opened (replaced since?)"

/* O_DIRECT works if the open and one aligned read succeed (of_fd >= 0: the same file as it). */
static int probe_direct(int of_fd, const char *path) {
    int fd = pt_reopen(of_fd, path, O_RDONLY | O_DIRECT);
    if (fd < 0) return -1;
    void *buf = NULL;
    if (posix_memalign(&buf, XS_ALIGN, XS_ALIGN)) {
        close(fd);
        return -1;
    }
    ssize_t n = pread(fd, buf, XS_ALIGN, 0);
    free(buf);
    if (n < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int xs_io_open(xs_io **out, const char *path, int fd, int mode, int backend, int threads, int depth, int retries,
               int verify, xs_io_done_fn done, void *ctx, petrel_error *err) {
    *out = NULL;
    xs_io *io = calloc(1, sizeof *io);
    if (!io) return pt_err(err, PETREL_ENOMEM, "expert I/O: out of memory");
    io->retries = retries < 0 ? 0 : retries;
    io->depth = depth <= 0 ? XS_IO_DEFAULT_DEPTH : depth > QD ? QD : depth;
    io->verify = verify;
    io->done = done;
    io->ctx = ctx;
    io->fd = -1;
    if (path) {
        if (mode != XS_IO_BUFFERED) {
            io->fd = probe_direct(fd, path);
            if (io->fd >= 0) io->direct = 1;
            else if (mode == XS_IO_DIRECT) {
                int e = errno;
                free(io);
                if (e == ESTALE) return pt_err(err, PETREL_EIO, "expert file %s: %s", path, REPLACED_MSG);
                return pt_err(err, PETREL_EUNSUPPORTED, "expert file %s: O_DIRECT not supported here: %s", path, strerror(e));
            }
        }
        if (io->fd < 0) io->fd = pt_reopen(fd, path, O_RDONLY);
        if (io->fd < 0) {
            int e = errno;
            free(io);
            return pt_err(err, PETREL_EIO, "cannot open expert file %s: %s", path,
                          e == ESTALE ? REPLACED_MSG : strerror(e));
        }
        io->own_fd = 1;
    } else {
        if (mode == XS_IO_DIRECT) {
            free(io);
            return pt_err(err, PETREL_EINVAL, "expert I/O: O_DIRECT needs a path (the store opens its own fd)");
        }
        io->fd = fd;
    }
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->cv, NULL);
    pthread_cond_init(&io->ccv, NULL);
    if (backend != XS_BACKEND_PREAD && io_uring_queue_init(QD, &io->ring, 0) == 0) io->uring = 1;
    else if (backend == XS_BACKEND_URING) {
        xs_io_close(io);
        return pt_err(err, PETREL_EUNSUPPORTED, "expert I/O: io_uring could not be set up");
    }
    if (threads <= 0) threads = XS_IO_DEFAULT_THREADS;
    if (threads > XS_IO_MAX_THREADS) threads = XS_IO_MAX_THREADS;
    io->n_threads = io->uring ? 1 : threads;
    int n_checkers = io->uring && verify ? threads : 0;
    for (int i = 0; i < n_checkers; i++) {
        if (pthread_create(&io->cth[i], NULL, checker_thread, io)) {
            xs_io_close(io);
            return pt_err(err, PETREL_ENOMEM, "expert I/O: cannot start a thread");
        }
        io->n_checkers = i + 1;
    }
    for (int i = 0; i < io->n_threads; i++)
        if (pthread_create(&io->th[i], NULL, io->uring ? uring_thread : pread_thread, io)) {
            io->n_threads = i;
            xs_io_close(io);
            return pt_err(err, PETREL_ENOMEM, "expert I/O: cannot start a thread");
        }
    *out = io;
    return 0;
}

void xs_io_submit(xs_io *io, xs_ioreq **reqs, int n) {
    if (n <= 0) return;
    pthread_mutex_lock(&io->mu);
    for (int i = 0; i < n; i++) {
        xs_ioreq *r = reqs[i];
        r->next = NULL;
        r->attempt = 0;
        r->status = 0;
        r->checksum_bad = 0;
        r->msg[0] = 0;
        if (io->tail) io->tail->next = r;
        else io->head = r;
        io->tail = r;
    }
    pthread_cond_broadcast(&io->cv);
    pthread_mutex_unlock(&io->mu);
}

int xs_io_cancel(xs_io *io, xs_ioreq *r) {
    int found = 0;
    pthread_mutex_lock(&io->mu);
    for (xs_ioreq *p = NULL, *q = io->head; q; p = q, q = q->next)
        if (q == r) {
            if (p) p->next = q->next;
            else io->head = q->next;
            if (io->tail == q) io->tail = p;
            q->next = NULL;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&io->mu);
    return found;
}

void xs_io_close(xs_io *io) {
    if (!io) return;
    pthread_mutex_lock(&io->mu);
    io->stop = 1;
    pthread_cond_broadcast(&io->cv);
    pthread_mutex_unlock(&io->mu);
    for (int i = 0; i < io->n_threads; i++) pthread_join(io->th[i], NULL);
    /* the ring's thread has finished every read; the checkers drain what is left, then stop */
    pthread_mutex_lock(&io->mu);
    io->cstop = 1;
    pthread_cond_broadcast(&io->ccv);
    pthread_mutex_unlock(&io->mu);
    for (int i = 0; i < io->n_checkers; i++) pthread_join(io->cth[i], NULL);
    if (io->uring) io_uring_queue_exit(&io->ring);
    if (io->own_fd) close(io->fd);
    pthread_mutex_destroy(&io->mu);
    pthread_cond_destroy(&io->cv);
    pthread_cond_destroy(&io->ccv);
    free(io);
}
