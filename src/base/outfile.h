/* outfile.h: output files that appear whole or not at all, and the write seam.
 *
 * An output is written to a temporary name beside its target ("TARGET.<pid>.<n>.tmp", same
 * folder, so the final rename stays inside one file system), synced, and renamed onto the target
 * only when every byte was written; a failure removes the temporary, so a failed command leaves
 * neither a partial nor an empty file at the target (and an existing target is kept as it was).
 *
 * pt_out_check refuses targets that must not be replaced: an existing path that is not a
 * regular file (symbolic link, FIFO, device, socket, folder), a target whose folder does not
 * exist, and a target that is the input (the same file, or a model file -- config, tokenizer,
 * template, safetensors -- inside the input model folder).
 *
 * The write seam: every write and sync of an output (these files and the converter's pack) goes
 * through pt_pwrite / pt_fsync, which consult pt_write_fault_hook. Tests set it to inject short
 * writes, ENOSPC and EIO; it is NULL in normal runs. */
#ifndef PETREL_BASE_OUTFILE_H
#define PETREL_BASE_OUTFILE_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "petrel.h"

/* ---- the write seam ---- */
enum { PT_WOP_WRITE = 0, PT_WOP_SYNC = 1 };
/* Called before each write (op PT_WOP_WRITE: *n bytes at off; lower *n to make the write short,
 * 0 for a write that makes no progress) and each sync (op PT_WOP_SYNC, n NULL). Returns 0 to go
 * on, or an errno value (ENOSPC, EIO, ...) that the operation then fails with. */
typedef int (*pt_write_fault_fn)(void *ctx, int op, int fd, uint64_t off, size_t *n);
extern pt_write_fault_fn pt_write_fault_hook;
extern void *pt_write_fault_ctx;
/* pwrite(2) / fdatasync(2) through the seam (same results and errno). */
ssize_t pt_pwrite(int fd, const void *buf, size_t n, uint64_t off);
int pt_fsync(int fd);
/* Writes all n bytes at off (retrying short writes); PETREL_EIO naming `what` on failure. */
int pt_pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *what, petrel_error *err);

/* ---- target checks ---- */
/* 0 if path may be written (created, or an existing regular file replaced); else PETREL_EINVAL
 * (or PETREL_EIO when its folder is missing) with one line saying why. input (may be NULL) is
 * the command's input, a file or a model folder. */
int pt_out_check(const char *path, const char *input, petrel_error *err);

/* ---- whole-or-nothing output files ---- */
typedef struct pt_outfile {
    int fd;                 /* the temporary, -1 when closed */
    uint64_t off;           /* bytes written so far */
    char *path;             /* owned: the target */
    char *tmp;              /* owned: the temporary beside it */
    char *buf;              /* owned: pt_out_printf's buffer */
    size_t bn;              /* bytes held in buf */
    int failed;             /* a write failed: commit refuses (first error in e) */
    petrel_error e;
} pt_outfile;

/* Checks the target (pt_out_check) and creates its temporary. On failure o needs no abort. */
int pt_out_open(pt_outfile *o, const char *path, const char *input, petrel_error *err);
/* Appends bytes; errors are sticky (reported here and again by commit). */
int pt_out_write(pt_outfile *o, const void *buf, size_t n, petrel_error *err);
int pt_out_printf(pt_outfile *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Flushes, syncs and renames the temporary onto the target (then syncs the folder). On any
 * failure the temporary is removed and the target left as it was. Frees o either way. */
int pt_out_commit(pt_outfile *o, petrel_error *err);
/* Removes the temporary and frees o (safe on a closed or zeroed pt_outfile). */
void pt_out_abort(pt_outfile *o);

/* Syncs the folder holding path (after a rename into it); best effort, errors ignored. */
void pt_sync_parent(const char *path);
#endif
