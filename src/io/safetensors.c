/* safetensors.c: safetensors header parsing (untrusted input), mmap'd file sets, sharded
 * checkpoints through model.safetensors.index.json, and a small writer for tests/converters.
 *
 * Invariant after st_open succeeds: every tensor's [data, data + (end-begin)) lies inside its
 * file's map, byte counts equal numel x dtype size, and no two tensors of a file overlap. */
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/err.h"
#include "base/outfile.h"

#define ST_MAX_HEADER (256u << 20)

static const struct { const char *name; int size; } dtype_info[ST_DTYPE_COUNT] = {
    [ST_F64] = {"F64", 8},   [ST_F32] = {"F32", 4},     [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2}, [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
    [ST_I64] = {"I64", 8},   [ST_I32] = {"I32", 4},     [ST_I16] = {"I16", 2},
    [ST_I8] = {"I8", 1},     [ST_U8] = {"U8", 1},       [ST_BOOL] = {"BOOL", 1},
};

const char *st_dtype_name(st_dtype t) { return (unsigned)t < ST_DTYPE_COUNT ? dtype_info[t].name : "?"; }
int st_dtype_size(st_dtype t) { return (unsigned)t < ST_DTYPE_COUNT ? dtype_info[t].size : 0; }

int64_t st_numel(const st_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static int get_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || d != (double)(uint64_t)d) return -1;
    *out = (uint64_t)d;
    return 0;
}

typedef struct { uint64_t begin, end; int idx; } range;
static int range_cmp(const void *a, const void *b) {
    const range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

int st_parse(const uint8_t *buf, size_t size, const char *where, int file_index,
             st_tensor **tensors, int *n_tensors, petrel_error *err) {
    if (size < 8) return pt_err(err, PETREL_EFORMAT, "%s: file is %zu bytes, too short for a safetensors header", where, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | buf[i];
    if (hlen > size - 8)
        return pt_err(err, PETREL_EFORMAT, "%s: header length %llu runs past the end of the file (%zu bytes)", where,
                      (unsigned long long)hlen, size);
    if (hlen > ST_MAX_HEADER)
        return pt_err(err, PETREL_EFORMAT, "%s: header length %llu is over the %u-byte limit", where,
                      (unsigned long long)hlen, ST_MAX_HEADER);
    uint64_t data_size = size - 8 - hlen;
    cJSON *root = cJSON_ParseWithLength((const char *)buf + 8, (size_t)hlen);
    if (!root) return pt_err(err, PETREL_EFORMAT, "%s: header is not valid JSON", where);
    int rc = 0, start = *n_tensors;
    if (!cJSON_IsObject(root)) {
        rc = pt_err(err, PETREL_EFORMAT, "%s: header is not a JSON object", where);
        goto done;
    }
    int count = 0;
    for (cJSON *it = root->child; it; it = it->next) count++;
    st_tensor *ts = realloc(*tensors, sizeof(st_tensor) * (size_t)(start + count + 1));
    if (!ts) { rc = pt_err(err, PETREL_ENOMEM, "%s: out of memory reading the header", where); goto done; }
    *tensors = ts;
    for (cJSON *it = root->child; it; it = it->next) {
        const char *name = it->string ? it->string : "";
        if (!strcmp(name, "__metadata__")) continue;
        if (!cJSON_IsObject(it)) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": entry is not an object", where, name); goto done; }
        st_tensor t;
        memset(&t, 0, sizeof t);
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *of = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        if (!cJSON_IsString(dt)) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": missing dtype", where, name); goto done; }
        int found = -1;
        for (int d = 0; d < ST_DTYPE_COUNT; d++)
            if (!strcmp(dt->valuestring, dtype_info[d].name)) found = d;
        if (found < 0) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": unknown dtype \"%.32s\"", where, name, dt->valuestring); goto done; }
        t.dtype = (st_dtype)found;
        if (!cJSON_IsArray(sh)) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": missing shape", where, name); goto done; }
        int nd = cJSON_GetArraySize(sh);
        if (nd > ST_MAX_DIMS) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": %d dimensions (max %d)", where, name, nd, ST_MAX_DIMS); goto done; }
        t.ndim = nd;
        uint64_t numel = 1;
        int di = 0;
        for (const cJSON *d = sh->child; d; d = d->next, di++) {
            uint64_t v;
            if (get_u64(d, &v) || v > (1ull << 48)) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": bad shape entry", where, name); goto done; }
            t.shape[di] = (int64_t)v;
            if (v && numel > (1ull << 62) / v) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": shape too large", where, name); goto done; }
            numel *= v;
        }
        if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2 || get_u64(of->child, &t.begin) || get_u64(of->child->next, &t.end)) {
            rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": data_offsets must be [begin, end]", where, name);
            goto done;
        }
        if (t.begin > t.end) { rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": data_offsets begin %llu > end %llu", where, name, (unsigned long long)t.begin, (unsigned long long)t.end); goto done; }
        uint64_t want = numel * (uint64_t)dtype_info[t.dtype].size;
        if (t.end - t.begin != want) {
            rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": %llu bytes stored but dtype %s x shape needs %llu", where, name,
                        (unsigned long long)(t.end - t.begin), dtype_info[t.dtype].name, (unsigned long long)want);
            goto done;
        }
        if (t.end > data_size) {
            rc = pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\": data [%llu, %llu) runs past the end of the file (data section %llu bytes)",
                        where, name, (unsigned long long)t.begin, (unsigned long long)t.end, (unsigned long long)data_size);
            goto done;
        }
        t.data = buf + 8 + hlen + t.begin;
        t.file = file_index;
        t.name = strdup(name);
        if (!t.name) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); goto done; }
        (*tensors)[(*n_tensors)++] = t;
    }
    /* Overlap check over this file's tensors. */
    int nt = *n_tensors - start;
    if (nt > 1) {
        range *rs = malloc(sizeof(range) * (size_t)nt);
        if (!rs) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); goto done; }
        for (int i = 0; i < nt; i++) rs[i] = (range){(*tensors)[start + i].begin, (*tensors)[start + i].end, start + i};
        qsort(rs, (size_t)nt, sizeof *rs, range_cmp);
        for (int i = 1; i < nt; i++) {
            if (rs[i].begin < rs[i - 1].end && rs[i].begin != rs[i].end && rs[i - 1].begin != rs[i - 1].end) {
                rc = pt_err(err, PETREL_EFORMAT, "%s: tensors \"%s\" and \"%s\" overlap in the file", where,
                            (*tensors)[rs[i - 1].idx].name, (*tensors)[rs[i].idx].name);
                break;
            }
        }
        free(rs);
    }
done:
    if (rc < 0) {
        for (int i = start; i < *n_tensors; i++) free((*tensors)[i].name);
        *n_tensors = start;
    }
    cJSON_Delete(root);
    return rc;
}

static uint32_t name_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

static int build_index(st_set *s, petrel_error *err) {
    int cap = 16;
    while (cap < s->n_tensors * 2) cap *= 2;
    s->hash = malloc(sizeof(int32_t) * (size_t)cap);
    if (!s->hash) return pt_err(err, PETREL_ENOMEM, "out of memory");
    s->hash_cap = cap;
    for (int i = 0; i < cap; i++) s->hash[i] = -1;
    for (int i = 0; i < s->n_tensors; i++) {
        uint32_t h = name_hash(s->tensors[i].name) & (uint32_t)(cap - 1);
        while (s->hash[h] >= 0) {
            const st_tensor *o = &s->tensors[s->hash[h]];
            if (!strcmp(o->name, s->tensors[i].name))
                return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" appears twice (%s and %s)", o->name,
                              s->paths[o->file], s->paths[s->tensors[i].file]);
            h = (h + 1) & (uint32_t)(cap - 1);
        }
        s->hash[h] = i;
    }
    return 0;
}

const st_tensor *st_find(const st_set *s, const char *name) {
    if (!s || !s->hash) return NULL;
    uint32_t h = name_hash(name) & (uint32_t)(s->hash_cap - 1);
    while (s->hash[h] >= 0) {
        const st_tensor *t = &s->tensors[s->hash[h]];
        if (!strcmp(t->name, name)) return t;
        h = (h + 1) & (uint32_t)(s->hash_cap - 1);
    }
    return NULL;
}

void st_close(st_set *s) {
    if (!s) return;
    for (int i = 0; i < s->n_files; i++) {
        if (s->maps && s->maps[i] && s->maps[i] != MAP_FAILED && s->map_sizes[i]) munmap(s->maps[i], s->map_sizes[i]);
        if (s->paths) free(s->paths[i]);
    }
    for (int i = 0; i < s->n_tensors; i++) free(s->tensors[i].name);
    free(s->paths);
    free(s->maps);
    free(s->map_sizes);
    free(s->tensors);
    free(s->hash);
    free(s);
}

int st_open_files(const char *const *paths, int n, st_set **out, petrel_error *err) {
    *out = NULL;
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "no safetensors files given");
    st_set *s = calloc(1, sizeof *s);
    if (!s) return pt_err(err, PETREL_ENOMEM, "out of memory");
    s->paths = calloc((size_t)n, sizeof(char *));
    s->maps = calloc((size_t)n, sizeof(void *));
    s->map_sizes = calloc((size_t)n, sizeof(size_t));
    if (!s->paths || !s->maps || !s->map_sizes) { st_close(s); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
    s->n_files = n;
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        s->paths[i] = strdup(paths[i]);
        int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        if (fd < 0) { rc = pt_err(err, PETREL_EIO, "cannot open %s: %s", paths[i], strerror(errno)); break; }
        struct stat st;
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            close(fd);
            rc = pt_err(err, PETREL_EIO, "%s is not a regular file", paths[i]);
            break;
        }
        size_t size = (size_t)st.st_size;
        void *map = NULL;
        if (size > 0) {
            map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
            if (map == MAP_FAILED) {
                close(fd);
                rc = pt_err(err, PETREL_EIO, "cannot map %s: %s", paths[i], strerror(errno));
                break;
            }
        }
        close(fd);
        s->maps[i] = map;
        s->map_sizes[i] = size;
        rc = st_parse(map ? map : (const uint8_t *)"", size, paths[i], i, &s->tensors, &s->n_tensors, err);
    }
    if (rc == 0) rc = build_index(s, err);
    if (rc < 0) { st_close(s); return rc; }
    *out = s;
    return 0;
}

static int str_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* Sharded checkpoint: every file named in weight_map is opened; every listed tensor must be
 * found in the file the map names. */
static int open_index(const char *dir, const char *index_path, st_set **out, petrel_error *err) {
    FILE *f = fopen(index_path, "rb");
    if (!f) return pt_err(err, PETREL_EIO, "cannot open %s: %s", index_path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (len < 0 || len > (64L << 20)) { fclose(f); return pt_err(err, PETREL_EFORMAT, "%s: unreasonable size", index_path); }
    char *txt = malloc((size_t)len + 1);
    if (!txt) { fclose(f); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
    size_t got = fread(txt, 1, (size_t)len, f);
    fclose(f);
    txt[got] = 0;
    cJSON *root = cJSON_ParseWithLength(txt, got);
    free(txt);
    if (!root) return pt_err(err, PETREL_EFORMAT, "%s: not valid JSON", index_path);
    int rc = 0;
    char **files = NULL;
    int nf = 0;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) { rc = pt_err(err, PETREL_EFORMAT, "%s: missing \"weight_map\" object", index_path); goto out; }
    int cap = cJSON_GetArraySize(wm) + 1;
    files = calloc((size_t)cap, sizeof(char *));
    if (!files) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); goto out; }
    for (const cJSON *it = wm->child; it; it = it->next) {
        if (!cJSON_IsString(it) || strchr(it->valuestring, '/') || !strcmp(it->valuestring, "..")) {
            rc = pt_err(err, PETREL_EFORMAT, "%s: weight_map entry \"%s\" is not a file name in the folder", index_path, it->string);
            goto out;
        }
        int seen = 0;
        for (int i = 0; i < nf && !seen; i++) seen = !strcmp(files[i], it->valuestring);
        if (!seen) files[nf++] = it->valuestring;
    }
    qsort(files, (size_t)nf, sizeof(char *), str_cmp);
    char **full = calloc((size_t)nf + 1, sizeof(char *));
    if (!full) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); goto out; }
    for (int i = 0; i < nf; i++) full[i] = path_join(dir, files[i]);
    rc = st_open_files((const char *const *)full, nf, out, err);
    if (rc == 0) {
        for (const cJSON *it = wm->child; it; it = it->next) {
            const st_tensor *t = st_find(*out, it->string);
            const char *want = it->valuestring;
            if (!t) { rc = pt_err(err, PETREL_EFORMAT, "%s lists tensor \"%s\" in %s, but that file does not hold it", index_path, it->string, want); break; }
            const char *base = strrchr((*out)->paths[t->file], '/');
            base = base ? base + 1 : (*out)->paths[t->file];
            if (strcmp(base, want)) { rc = pt_err(err, PETREL_EFORMAT, "%s puts tensor \"%s\" in %s, but it is in %s", index_path, it->string, want, base); break; }
        }
        if (rc < 0) { st_close(*out); *out = NULL; }
    }
    for (int i = 0; i < nf; i++) free(full[i]);
    free(full);
out:
    free(files);
    cJSON_Delete(root);
    return rc;
}

int st_open(const char *path, st_set **out, petrel_error *err) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) < 0) return pt_err(err, PETREL_EIO, "cannot open %s: %s", path, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return st_open_files(&path, 1, out, err);
    char *idx = path_join(path, "model.safetensors.index.json");
    if (!idx) return pt_err(err, PETREL_ENOMEM, "out of memory");
    if (access(idx, R_OK) == 0) {
        int rc = open_index(path, idx, out, err);
        free(idx);
        return rc;
    }
    free(idx);
    DIR *d = opendir(path);
    if (!d) return pt_err(err, PETREL_EIO, "cannot list %s: %s", path, strerror(errno));
    char **names = NULL;
    int n = 0, cap = 0, rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 12 || strcmp(e->d_name + l - 12, ".safetensors")) continue;
        if (!strncmp(e->d_name, "golden", 6)) continue; /* reference outputs beside fixtures */
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            char **t = realloc(names, sizeof(char *) * (size_t)cap);
            if (!t) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); break; }
            names = t;
        }
        names[n++] = path_join(path, e->d_name);
    }
    closedir(d);
    if (rc == 0 && n == 0) rc = pt_err(err, PETREL_EIO, "%s holds no .safetensors files", path);
    if (rc == 0) {
        qsort(names, (size_t)n, sizeof(char *), str_cmp);
        rc = st_open_files((const char *const *)names, n, out, err);
    }
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    return rc;
}

int st_write(const char *path, const st_write_tensor *ts, int n, petrel_error *err) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return pt_err(err, PETREL_ENOMEM, "out of memory");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        cJSON *o = cJSON_AddObjectToObject(root, ts[i].name);
        cJSON_AddStringToObject(o, "dtype", st_dtype_name(ts[i].dtype));
        cJSON *sh = cJSON_AddArrayToObject(o, "shape");
        uint64_t numel = 1;
        for (int d = 0; d < ts[i].ndim; d++) {
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)ts[i].shape[d]));
            numel *= (uint64_t)ts[i].shape[d];
        }
        uint64_t bytes = numel * (uint64_t)st_dtype_size(ts[i].dtype);
        cJSON *of = cJSON_AddArrayToObject(o, "data_offsets");
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(off + bytes)));
        off += bytes;
    }
    char *hdr = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!hdr) return pt_err(err, PETREL_ENOMEM, "out of memory");
    size_t hl = strlen(hdr), pad = (8 - hl % 8) % 8;
    /* whole or nothing: a temporary beside the target, renamed onto it at the end */
    pt_outfile o;
    int rc = pt_out_open(&o, path, NULL, err);
    if (rc) { free(hdr); return rc; }
    uint64_t total = hl + pad;
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(total >> (8 * i));
    static const char spaces[8] = "        ";
    rc = pt_out_write(&o, le, 8, err);
    if (!rc) rc = pt_out_write(&o, hdr, hl, err);
    if (!rc) rc = pt_out_write(&o, spaces, pad, err);
    free(hdr);
    for (int i = 0; i < n && !rc; i++) {
        uint64_t numel = 1;
        for (int d = 0; d < ts[i].ndim; d++) numel *= (uint64_t)ts[i].shape[d];
        size_t bytes = (size_t)(numel * (uint64_t)st_dtype_size(ts[i].dtype));
        if (bytes) rc = pt_out_write(&o, ts[i].data, bytes, err);
    }
    if (rc) {
        pt_out_abort(&o);
        return rc;
    }
    return pt_out_commit(&o, err);
}
