/* file.h: reading a whole file or stream into memory, the one place that does it. */
#ifndef PETREL_BASE_FILE_H
#define PETREL_BASE_FILE_H
#include <stddef.h>
#include <stdio.h>

#include "petrel.h"

/* Reads all of f into a NUL-terminated malloc'd buffer (the NUL not counted in *len; len may be
 * NULL). More than max bytes is PETREL_ERANGE. `what` names the source in messages. */
int pt_read_stream(FILE *f, const char *what, size_t max, char **out, size_t *len, petrel_error *err);
/* The same for the file at path ("-" reads stdin). */
int pt_read_file(const char *path, size_t max, char **out, size_t *len, petrel_error *err);
/* A second descriptor of the file already open as fd, with its own flags (O_DIRECT for reads that
 * bypass the page cache): through /proc/self/fd/fd where /proc is mounted, else by path, kept only
 * if it is the same file (device and inode) as fd, so a file replaced under the same name is
 * never read. fd < 0: path alone. O_CLOEXEC is added. -1 with errno set when it cannot (ESTALE:
 * path now names another file). */
int pt_reopen(int fd, const char *path, int flags);
#endif
