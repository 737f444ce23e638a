/* sbuf.h: a growable NUL-terminated byte string (chat replies, HTTP bodies, metrics text). A
 * failed allocation sets oom and drops the rest, so a caller checks once at the end. */
#ifndef PETREL_BASE_SBUF_H
#define PETREL_BASE_SBUF_H
#include <stddef.h>

typedef struct sbuf {
    char *p;        /* owned (free it), NULL while empty */
    size_t n, cap;
    int oom;
} sbuf;
void sb_add(sbuf *b, const char *s, size_t n);
/* Appends printf output (at most 511 bytes a call). */
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#endif
