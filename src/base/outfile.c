/* outfile.c: whole-or-nothing output files, target checks and the write seam (outfile.h).
 * Invariant: the target path is only ever touched by rename(2) of a complete, synced temporary;
 * nothing is written through a name that exists as anything but a regular file. */
#include "base/outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/err.h"

pt_write_fault_fn pt_write_fault_hook;
void *pt_write_fault_ctx;

#define OUT_BUF (64u << 10)

ssize_t pt_pwrite(int fd, const void *buf, size_t n, uint64_t off) {
    if (pt_write_fault_hook) {
        int e = pt_write_fault_hook(pt_write_fault_ctx, PT_WOP_WRITE, fd, off, &n);
        if (e) { errno = e; return -1; }
        if (n == 0) return 0;
    }
    return pwrite(fd, buf, n, (off_t)off);
}

int pt_fsync(int fd) {
    if (pt_write_fault_hook) {
        int e = pt_write_fault_hook(pt_write_fault_ctx, PT_WOP_SYNC, fd, 0, NULL);
        if (e) { errno = e; return -1; }
    }
    return fdatasync(fd);
}

int pt_pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *what, petrel_error *err) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = pt_pwrite(fd, p, n, off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return pt_err(err, PETREL_EIO, "write of %s failed: %s", what, w < 0 ? strerror(errno) : "no progress (disk full?)");
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

/* Names a model reads from its folder (config, tokenizer, template, weights, shard index). */
static int is_model_file(const char *base) {
    static const char *const suffixes[] = {".safetensors", ".json", ".jinja", ".qs"};
    size_t bl = strlen(base);
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        size_t sl = strlen(suffixes[i]);
        if (bl >= sl && !strcmp(base + bl - sl, suffixes[i])) return 1;
    }
    return 0;
}

static const char *kind_name(mode_t m) {
    if (S_ISLNK(m)) return "a symbolic link";
    if (S_ISDIR(m)) return "a folder";
    if (S_ISFIFO(m)) return "a FIFO (named pipe)";
    if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

int pt_out_check(const char *path, const char *input, petrel_error *err) {
    if (!path || !*path) return pt_err(err, PETREL_EINVAL, "no output file named");
    size_t pl = strlen(path);
    if (pl > 3800) return pt_err(err, PETREL_EINVAL, "output path too long (%zu bytes)", pl);
    struct stat st, ds;
    int exists = lstat(path, &st) == 0;
    if (!exists && errno != ENOENT) return pt_err(err, PETREL_EIO, "cannot write %s: %s", path, strerror(errno));
    if (exists && !S_ISREG(st.st_mode))
        return pt_err(err, PETREL_EINVAL, "refusing to write %s: it is %s, not a regular file (give the path of a new or regular file)", path,
                      kind_name(st.st_mode));
    char d1[4096], b1[4096];
    snprintf(d1, sizeof d1, "%s", path);
    snprintf(b1, sizeof b1, "%s", path);
    const char *dir = dirname(d1), *base = basename(b1);
    if (path[pl - 1] == '/') return pt_err(err, PETREL_EINVAL, "refusing to write %s: it names a folder, not a file", path);
    if (stat(dir, &ds) < 0 || !S_ISDIR(ds.st_mode)) return pt_err(err, PETREL_EIO, "cannot write %s: the folder %s does not exist", path, dir);
    if (access(dir, W_OK | X_OK) < 0) return pt_err(err, PETREL_EIO, "cannot write %s: the folder %s is not writable (%s)", path, dir, strerror(errno));
    struct stat is;
    if (input && *input && stat(input, &is) == 0) {
        if (exists && st.st_dev == is.st_dev && st.st_ino == is.st_ino)
            return pt_err(err, PETREL_EINVAL, "refusing to write %s: it is the input %s (write the output elsewhere)", path, input);
        struct stat ms;
        int have_mdir = 0;
        if (S_ISDIR(is.st_mode)) { ms = is; have_mdir = 1; }
        else {
            size_t il = strlen(input);
            if (il > 12 && !strcmp(input + il - 12, ".safetensors")) { /* a single file: its folder holds config.json */
                char d2[4096];
                snprintf(d2, sizeof d2, "%s", input);
                have_mdir = stat(dirname(d2), &ms) == 0;
            }
        }
        if (have_mdir && ms.st_dev == ds.st_dev && ms.st_ino == ds.st_ino && is_model_file(base))
            return pt_err(err, PETREL_EINVAL, "refusing to write %s: it is a file of the input model folder %s (write the output elsewhere)", path,
                          input);
    }
    return 0;
}

void pt_sync_parent(const char *path) {
    char d[4096];
    snprintf(d, sizeof d, "%s", path);
    int fd = open(dirname(d), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    (void)fsync(fd);
    close(fd);
}

static void out_free(pt_outfile *o) {
    if (o->tmp && o->fd >= 0) close(o->fd);
    free(o->path);
    free(o->tmp);
    free(o->buf);
    memset(o, 0, sizeof *o);
    o->fd = -1;
}

int pt_out_open(pt_outfile *o, const char *path, const char *input, petrel_error *err) {
    memset(o, 0, sizeof *o);
    o->fd = -1;
    PT_TRY(pt_out_check(path, input, err));
    size_t n = strlen(path) + 64;
    o->path = strdup(path);
    o->tmp = malloc(n);
    o->buf = malloc(OUT_BUF);
    if (!o->path || !o->tmp || !o->buf) {
        out_free(o);
        return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    static unsigned counter;
    for (int tries = 0; tries < 100; tries++) {
        snprintf(o->tmp, n, "%s.%ld.%u.tmp", path, (long)getpid(), __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
        o->fd = open(o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (o->fd >= 0 || errno != EEXIST) break;
    }
    if (o->fd < 0) {
        int e = errno;
        pt_err(err, PETREL_EIO, "cannot create %s: %s", o->tmp, strerror(e));
        out_free(o);
        return PETREL_EIO;
    }
    return 0;
}

static int out_fail(pt_outfile *o, petrel_error *err, int e) {
    if (!o->failed) {
        o->failed = 1;
        pt_err(&o->e, PETREL_EIO, "write to %s failed: %s", o->path, strerror(e));
    }
    if (err) *err = o->e;
    return PETREL_EIO;
}

/* n bytes at the output's offset through the seam, retrying short writes */
static int out_put(pt_outfile *o, const char *p, size_t n, petrel_error *err) {
    while (n) {
        ssize_t w = pt_pwrite(o->fd, p, n, o->off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return out_fail(o, err, w < 0 ? errno : ENOSPC);
        p += w;
        n -= (size_t)w;
        o->off += (uint64_t)w;
    }
    return 0;
}

static int out_flush(pt_outfile *o, petrel_error *err) {
    if (o->failed) return out_fail(o, err, EIO);
    size_t n = o->bn;
    o->bn = 0;
    return out_put(o, o->buf, n, err);
}

int pt_out_write(pt_outfile *o, const void *buf, size_t n, petrel_error *err) {
    if (!o->tmp) return pt_err(err, PETREL_EINVAL, "write to an output that is not open");
    if (o->failed) return out_fail(o, err, EIO);
    const char *p = buf;
    while (n) {
        if (o->bn == 0 && n >= OUT_BUF) return out_put(o, p, n, err); /* large writes go straight through */
        size_t k = OUT_BUF - o->bn < n ? OUT_BUF - o->bn : n;
        memcpy(o->buf + o->bn, p, k);
        o->bn += k;
        p += k;
        n -= k;
        if (o->bn == OUT_BUF) PT_TRY(out_flush(o, err));
    }
    return 0;
}

int pt_out_printf(pt_outfile *o, const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (k < 0) return out_fail(o, NULL, EINVAL);
    if ((size_t)k < sizeof line) return pt_out_write(o, line, (size_t)k, NULL);
    char *big = malloc((size_t)k + 1);
    if (!big) return out_fail(o, NULL, ENOMEM);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)k + 1, fmt, ap);
    va_end(ap);
    int rc = pt_out_write(o, big, (size_t)k, NULL);
    free(big);
    return rc;
}

void pt_out_abort(pt_outfile *o) {
    if (!o->tmp) return;
    if (o->fd >= 0) close(o->fd);
    o->fd = -1;
    unlink(o->tmp);
    out_free(o);
}

int pt_out_commit(pt_outfile *o, petrel_error *err) {
    if (!o->tmp) return pt_err(err, PETREL_EINVAL, "commit of an output that is not open");
    int rc = o->bn ? out_flush(o, err) : (o->failed ? out_fail(o, err, EIO) : 0);
    if (rc == 0 && pt_fsync(o->fd) < 0) rc = pt_err(err, PETREL_EIO, "write to %s failed: sync: %s", o->path, strerror(errno));
    if (rc == 0) {
        int fd = o->fd;
        o->fd = -1;
        if (close(fd) < 0) rc = pt_err(err, PETREL_EIO, "write to %s failed: close: %s", o->path, strerror(errno));
    }
    /* the target may have changed since open (a FIFO or link made meanwhile): check again */
    struct stat st;
    if (rc == 0 && lstat(o->path, &st) == 0 && !S_ISREG(st.st_mode))
        rc = pt_err(err, PETREL_EINVAL, "refusing to replace %s: it is %s, not a regular file", o->path, kind_name(st.st_mode));
    if (rc == 0 && rename(o->tmp, o->path) < 0) rc = pt_err(err, PETREL_EIO, "cannot rename %s to %s: %s", o->tmp, o->path, strerror(errno));
    if (rc < 0) {
        pt_out_abort(o);
        return rc;
    }
    pt_sync_parent(o->path);
    out_free(o);
    return 0;
}
