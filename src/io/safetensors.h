/* safetensors.h: reading safetensors checkpoints, single files and sharded folders.
 *
 * Files are mmap'd read-only; tensors are views into the maps. The header is untrusted input:
 * st_parse_header checks the length prefix, the JSON, every dtype/shape/offset, that byte counts
 * agree with dtype x shape, that data ranges stay inside the file and do not overlap. */
#ifndef PETREL_IO_SAFETENSORS_H
#define PETREL_IO_SAFETENSORS_H
#include <stddef.h>
#include <stdint.h>

#include "petrel.h"

typedef enum st_dtype {
    ST_F64, ST_F32, ST_F16, ST_BF16, ST_F8_E4M3, ST_F8_E5M2,
    ST_I64, ST_I32, ST_I16, ST_I8, ST_U8, ST_BOOL, ST_DTYPE_COUNT
} st_dtype;

#define ST_MAX_DIMS 8

typedef struct st_tensor {
    char *name;                /* owned */
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;       /* byte range within the data section */
    const uint8_t *data;       /* view into the file map (NULL when parsed from a bare header) */
    int file;                  /* index into st_set.paths */
} st_tensor;

typedef struct st_set {
    int n_files;
    char **paths;              /* owned, [n_files] */
    void **maps;               /* owned mmaps, [n_files] */
    size_t *map_sizes;
    int n_tensors;
    st_tensor *tensors;        /* owned, [n_tensors] */
    int32_t *hash;             /* owned open-addressing index into tensors, [hash_cap] */
    int hash_cap;
} st_set;

const char *st_dtype_name(st_dtype t);
int st_dtype_size(st_dtype t);

/* Parses the header of a safetensors file held in memory (buf[0..size) is the whole file, or at
 * least its header when data_size_known is 0). Appends the tensors to *tensors (realloc'd) and
 * sets their data pointers into buf. `where` names the file in messages. */
int st_parse(const uint8_t *buf, size_t size, const char *where, int file_index,
             st_tensor **tensors, int *n_tensors, petrel_error *err);

/* Opens a .safetensors file, or a folder holding model.safetensors.index.json, model.safetensors,
 * or a set of *.safetensors shards (matching `pattern` if non-NULL, e.g. "out-"). */
int st_open(const char *path, st_set **out, petrel_error *err);
/* Opens exactly the given files as one set. */
int st_open_files(const char *const *paths, int n, st_set **out, petrel_error *err);
void st_close(st_set *s);

const st_tensor *st_find(const st_set *s, const char *name);
int64_t st_numel(const st_tensor *t);

/* Writes a safetensors file (bench's references, tests), whole or nothing: a temporary beside
 * path, renamed onto it at the end (pt_outfile; a symlink, FIFO or device target refused).
 * names/dtypes/shapes/data per tensor. */
typedef struct st_write_tensor {
    const char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
} st_write_tensor;
int st_write(const char *path, const st_write_tensor *ts, int n, petrel_error *err);
#endif
