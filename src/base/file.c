/* file.c: whole-file reads with a size cap and clear errors (see file.h). */
#include "base/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/err.h"

int pt_read_stream(FILE *f, const char *what, size_t max, char **out, size_t *len, petrel_error *err) {
    size_t cap = 65536, n = 0;
    char *b = malloc(cap + 1);
    if (!b) return pt_err(err, PETREL_ENOMEM, "out of memory reading %s", what);
    for (;;) {
        if (n == cap) {
            if (cap >= max) { free(b); return pt_err(err, PETREL_ERANGE, "%s is larger than %zu bytes", what, max); }
            char *nb = realloc(b, cap * 2 + 1);
            if (!nb) { free(b); return pt_err(err, PETREL_ENOMEM, "out of memory reading %s", what); }
            b = nb;
            cap *= 2;
        }
        size_t k = fread(b + n, 1, cap - n, f);
        n += k;
        if (k == 0) break;
    }
    if (ferror(f)) { free(b); return pt_err(err, PETREL_EIO, "read error on %s", what); }
    if (n > max) { free(b); return pt_err(err, PETREL_ERANGE, "%s is larger than %zu bytes", what, max); }
    b[n] = 0;
    *out = b;
    if (len) *len = n;
    return 0;
}

int pt_read_file(const char *path, size_t max, char **out, size_t *len, petrel_error *err) {
    if (!strcmp(path, "-")) return pt_read_stream(stdin, "stdin", max, out, len, err);
    FILE *f = fopen(path, "rb");
    if (!f) return pt_err(err, PETREL_EIO, "cannot open %s: %s", path, strerror(errno));
    int rc = pt_read_stream(f, path, max, out, len, err);
    fclose(f);
    return rc;
}

int pt_reopen(int fd, const char *path, int flags) {
    flags |= O_CLOEXEC;
    if (fd < 0) return path ? open(path, flags) : (errno = EBADF, -1);
    struct stat a, b;
    if (fstat(fd, &a)) return -1;
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    int nfd = open(proc, flags);
    if (nfd < 0 && path) nfd = open(path, flags);
    if (nfd < 0) return -1;
    if (fstat(nfd, &b) || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        close(nfd);
        errno = ESTALE;
        return -1;
    }
    return nfd;
}
