/* xs_io.h: the expert store's I/O pool (internal). One request = one whole expert record read
 * into its slot, checked against its xxh64. Requests are owned by the caller (embedded in slots)
 * and must stay alive until `done` is called for them; done runs on an I/O thread with no I/O
 * lock held and is called exactly once per submitted request. */
#ifndef PETREL_EXPERTS_XS_IO_H
#define PETREL_EXPERTS_XS_IO_H
#include "experts/xs.h"

/* io_uring reads one record as up to XS_IO_PARTS concurrent pieces of at least 1 MiB: one 19 MB
 * read alone in flight got about half of what four concurrent ones do on the dev box's disk
 * (2 GB/s then); with 8 pieces and 2 records in flight (below) the device sees the same 16
 * requests as with 4 x 4, and each record lands in half the time. */
#define XS_IO_PARTS 8

struct xs_ioreq;
typedef struct xs_iopart {
    struct xs_ioreq *r;
    uint64_t off, len, got;  /* within the request */
} xs_iopart;

typedef struct xs_ioreq {
    struct xs_ioreq *next;   /* queue link (I/O internal) */
    int layer, expert;
    int layer_id;            /* the layer number messages name (xs_source.layer_ids) */
    uint8_t *buf;            /* view: the slot, XS_ALIGN-aligned, >= len bytes */
    uint64_t off, bytes, len;/* file offset, record bytes, bytes to read (aligned for O_DIRECT) */
    uint64_t xxh;            /* expected checksum */
    int attempt;             /* 0 for the first read */
    int status;              /* 0 ok, PETREL_EIO / PETREL_EFORMAT (checksum) on failure */
    int checksum_bad;
    char msg[256];           /* the failure, one line */
    void *user;              /* caller's (the slot) */
    /* I/O internal (io_uring): the pieces of the current attempt */
    int parts, parts_left;
    int64_t part_err;        /* first error of the attempt (< 0), else 0 */
    xs_iopart part[XS_IO_PARTS];
} xs_ioreq;

/* threads: pread threads (pread backend) or checksum threads beside the ring's one (io_uring).
 * 4 measured best on a 2-core machine streaming GLM-5.2 experts (bench/RESULTS.md). */
#define XS_IO_MAX_THREADS 8
#define XS_IO_DEFAULT_THREADS 4
/* io_uring: whole-expert reads in flight at once (0 = this default). 2 records of 8 pieces: a
 * layer's first miss is ready sooner (the others keep the disk busy meanwhile) and more of
 * what is queued stays cancellable. Dev box (AMD, 2 cores, disk 5-7 GB/s), 1-dense + 6-MoE
 * GLM-5.2 slice under 6 GiB, 6 paired rounds: decode 1-26 % faster than 4 records of 4 in
 * every round, prefill the same; 8 records of 4 were 10-30 % slower (reads finished together,
 * not in order); bench/RESULTS.md, 2026-12-04 23:40. */
#define XS_IO_DEFAULT_DEPTH 2

typedef struct xs_io xs_io;
typedef void (*xs_io_done_fn)(void *ctx, xs_ioreq *r);

/* path: opened here (O_DIRECT probed per mode); path NULL: fd borrowed as is. */
int xs_io_open(xs_io **out, const char *path, int fd, int mode, int backend, int threads, int depth, int retries,
               int verify, xs_io_done_fn done, void *ctx, petrel_error *err);
/* Removes r from the queue if no read of it has started: returns 1 and done() is never called
 * for it; 0 if it was already taken (it completes as usual). */
int xs_io_cancel(xs_io *io, xs_ioreq *r);
/* Nanoseconds so far with at least one read in progress (the disk's busy time as we see it). */
uint64_t xs_io_busy_ns(xs_io *io);
void xs_io_close(xs_io *io);
/* Queues n requests (any order of completion). Never blocks on I/O. */
void xs_io_submit(xs_io *io, xs_ioreq **reqs, int n);
int xs_io_direct(const xs_io *io);
int xs_io_uring(const xs_io *io);
#endif
