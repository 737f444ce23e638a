/* pack.c: opening, validating and reading petrel packs (format in pack.h), and the wsource that
 * binds an engine's weights to a pack. The header is untrusted: every field is type-checked,
 * every byte count must equal what qtype x shape implies, every range must lie inside the file
 * and past the header. pack_open checks no data checksum (a 400 GB pack must open in
 * milliseconds, and an inspect-only open reads no weights); whoever reads data checks it:
 * pack_load_resident the tensors it copies (or serves from the map), the engine every expert
 * record of a fully resident load (stream_load_experts), the expert store every streamed read,
 * pack_read_file a side file. */
#include "io/pack.h"
#include "kernels/kernels.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH64_state_t on the stack (the parallel checksums below) */
#include <xxhash.h>

#include "base/err.h"
#include "base/file.h"
#include "base/pool.h"
#include "quant/quant.h"

static const char *const qkeys[PT_QTYPE_COUNT] = {"f32", "bf16", "f16", "fp8_e4m3", "q8_row", "q8_g32", "q4_g64"};

const char *pack_qtype_key(pt_qtype q) { return (unsigned)q < PT_QTYPE_COUNT ? qkeys[q] : "?"; }
int pack_qtype_from_key(const char *s) {
    for (int i = 0; i < PT_QTYPE_COUNT; i++)
        if (!strcmp(s, qkeys[i])) return i;
    return -1;
}

static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

int pack_tensor_sizes(pt_qtype q, int64_t rows, int64_t cols, int scale_dtype, int block_rows, int block_cols,
                      uint64_t *bytes, uint64_t *scale_bytes) {
    if (rows < 1 || cols < 1 || rows > ((int64_t)1 << 40) || cols > ((int64_t)1 << 32)) return -1;
    if ((unsigned)q >= PT_QTYPE_COUNT) return -1;
    int es = pt_scale_dtype_bytes(scale_dtype);
    *bytes = (uint64_t)rows * (uint64_t)pt_qtype_row_bytes(q, cols);
    *scale_bytes = 0;
    if (q == PT_FP8_E4M3) {
        if (block_rows < 1 || block_cols < 1 || (scale_dtype != PT_F32 && scale_dtype != PT_BF16)) return -1;
        *scale_bytes = (uint64_t)((rows + block_rows - 1) / block_rows) * (uint64_t)((cols + block_cols - 1) / block_cols) * (uint64_t)es;
    } else if (q == PT_Q8_ROW) {
        if (scale_dtype != PT_F32) return -1; /* weights_row_view and kernels read f32 row scales */
        *scale_bytes = (uint64_t)rows * 4;
    } else if (q == PT_Q8_G32 || q == PT_Q4_G64) {
        if (!es) return -1;
        *scale_bytes = (uint64_t)rows * (uint64_t)pt_qtype_scales_per_row(q, cols) * (uint64_t)es;
    }
    return 0;
}

void pack_tensor_view(const pack_tensor *t, const uint8_t *base, pt_wview *out) {
    const uint8_t *sc = t->scale_bytes ? base + t->scale_offset : NULL;
    if (t->qtype == PT_FP8_E4M3) {
        memset(out, 0, sizeof *out);
        out->qtype = PT_FP8_E4M3;
        out->rows = t->rows;
        out->cols = t->cols;
        out->data = base + t->offset;
        out->row_bytes = t->cols;
        out->scale = sc;
        out->scale_dtype = t->scale_dtype;
        out->block_rows = t->block_rows;
        out->block_cols = t->block_cols;
        out->scale_cols = (t->cols + t->block_cols - 1) / t->block_cols;
        return;
    }
    *out = pt_wview_make(t->qtype, t->rows, t->cols, base + t->offset, sc, t->scale_dtype);
    out->layout = t->layout;
}

/* ---- header parsing ---- */

typedef struct { const char *where; petrel_error *err; } pctx;

static int get_u64(pctx *c, const cJSON *o, const char *k, const char *ctx, uint64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9007199254740992.0 || v->valuedouble != (double)(uint64_t)v->valuedouble)
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: field \"%s\" must be a non-negative integer", c->where, ctx, k);
    *out = (uint64_t)v->valuedouble;
    return 0;
}
static int get_hex(pctx *c, const cJSON *v, const char *ctx, uint64_t *out) {
    if (!cJSON_IsString(v) || strlen(v->valuestring) != 16)
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: checksum must be 16 hex digits", c->where, ctx);
    char *end;
    *out = strtoull(v->valuestring, &end, 16);
    if (*end) return pt_err(c->err, PETREL_EFORMAT, "%s: %s: checksum must be 16 hex digits", c->where, ctx);
    return 0;
}

/* Parses one tensor entry; limit: offsets must satisfy lo <= off and off + n <= hi. */
static int parse_tensor(pctx *c, const cJSON *o, const char *ctx, uint64_t lo, uint64_t hi, int want_name, pack_tensor *t) {
    if (!cJSON_IsObject(o)) return pt_err(c->err, PETREL_EFORMAT, "%s: %s is not an object", c->where, ctx);
    if (want_name) {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(o, "name");
        if (!cJSON_IsString(n) || !*n->valuestring || strlen(n->valuestring) > 400)
            return pt_err(c->err, PETREL_EFORMAT, "%s: %s: missing or bad \"name\"", c->where, ctx);
        if (!(t->name = strdup(n->valuestring))) return pt_err(c->err, PETREL_ENOMEM, "out of memory");
        ctx = t->name;
    }
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(o, "qtype");
    int qt = cJSON_IsString(q) ? pack_qtype_from_key(q->valuestring) : -1;
    if (qt < 0) return pt_err(c->err, PETREL_EFORMAT, "%s: %s: unknown qtype", c->where, ctx);
    t->qtype = (pt_qtype)qt;
    uint64_t rows, cols, br = 0, bc = 0, grp = 0;
    PT_TRY(get_u64(c, o, "rows", ctx, &rows));
    PT_TRY(get_u64(c, o, "cols", ctx, &cols));
    PT_TRY(get_u64(c, o, "offset", ctx, &t->offset));
    PT_TRY(get_u64(c, o, "bytes", ctx, &t->bytes));
    PT_TRY(get_u64(c, o, "scale_offset", ctx, &t->scale_offset));
    PT_TRY(get_u64(c, o, "scale_bytes", ctx, &t->scale_bytes));
    PT_TRY(get_u64(c, o, "group", ctx, &grp));
    const cJSON *sd = cJSON_GetObjectItemCaseSensitive(o, "scale_dtype");
    int sdt = cJSON_IsString(sd) ? pack_qtype_from_key(sd->valuestring) : -1;
    if (sdt != PT_F32 && sdt != PT_BF16 && sdt != PT_F16) return pt_err(c->err, PETREL_EFORMAT, "%s: %s: bad scale_dtype", c->where, ctx);
    t->scale_dtype = sdt;
    if (t->qtype == PT_FP8_E4M3) {
        PT_TRY(get_u64(c, o, "block_rows", ctx, &br));
        PT_TRY(get_u64(c, o, "block_cols", ctx, &bc));
        if (br < 1 || bc < 1 || br > 65536 || bc > 65536) return pt_err(c->err, PETREL_EFORMAT, "%s: %s: bad FP8 block shape", c->where, ctx);
    }
    t->block_rows = (int)br;
    t->block_cols = (int)bc;
    const cJSON *vec = cJSON_GetObjectItemCaseSensitive(o, "vector");
    t->vector = cJSON_IsTrue(vec);
    const cJSON *lay = cJSON_GetObjectItemCaseSensitive(o, "layout");
    t->layout = PT_LAYOUT_PLAIN;
    if (lay) {
        if (cJSON_IsString(lay) && !strcmp(lay->valuestring, "r16")) t->layout = PT_LAYOUT_R16;
        else if (!cJSON_IsString(lay) || strcmp(lay->valuestring, "plain")) return pt_err(c->err, PETREL_EFORMAT, "%s: %s: unknown layout", c->where, ctx);
    }
    uint64_t want_b, want_s;
    if (rows > ((uint64_t)1 << 40) || cols > ((uint64_t)1 << 32) ||
        pack_tensor_sizes(t->qtype, (int64_t)rows, (int64_t)cols, t->scale_dtype, t->block_rows, t->block_cols, &want_b, &want_s) < 0)
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: bad shape or scale type for %s", c->where, ctx, pack_qtype_key(t->qtype));
    t->rows = (int64_t)rows;
    t->cols = (int64_t)cols;
    t->group = (int64_t)grp;
    if (t->vector && (t->qtype != PT_F32 || rows != 1)) return pt_err(c->err, PETREL_EFORMAT, "%s: %s: a vector must be f32 with rows = 1", c->where, ctx);
    if (t->bytes != want_b || t->scale_bytes != want_s)
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: byte counts %" PRIu64 "/%" PRIu64 " do not match %s [%" PRIu64 ", %" PRIu64 "] (%" PRIu64 "/%" PRIu64 ")",
                      c->where, ctx, t->bytes, t->scale_bytes, pack_qtype_key(t->qtype), rows, cols, want_b, want_s);
    if ((t->qtype == PT_Q8_G32 || t->qtype == PT_Q4_G64) && (int64_t)grp != pt_qtype_group(t->qtype, t->cols))
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: group %" PRIu64 " does not match %s", c->where, ctx, grp, pack_qtype_key(t->qtype));
    if (t->layout == PT_LAYOUT_R16 && !pack_r16_ok(t->qtype, t->rows, t->cols, t->scale_dtype))
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: layout r16 needs q8_g32/q4_g64 with rows a multiple of 16 and whole groups", c->where, ctx);
    if (t->offset < lo || t->offset > hi || t->bytes > hi - t->offset)
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: data range out of bounds", c->where, ctx);
    if (t->scale_bytes && (t->scale_offset < lo || t->scale_offset > hi || t->scale_bytes > hi - t->scale_offset))
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: scale range out of bounds", c->where, ctx);
    if (t->offset % PACK_TALIGN || (t->scale_bytes && t->scale_offset % PACK_TALIGN))
        return pt_err(c->err, PETREL_EFORMAT, "%s: %s: misaligned data", c->where, ctx);
    return 0;
}

int pack_has_r16(const pack *p) {
    for (int i = 0; i < p->n_elayers; i++)
        for (int k = 0; k < 3; k++)
            if (p->elayers[i].part[k].layout == PT_LAYOUT_R16) return 1;
    return 0;
}

int pack_r16_ok(pt_qtype q, int64_t rows, int64_t cols, int scale_dtype) {
    static const uint16_t dummy[1];
    pt_wview v = pt_wview_make(q, rows, cols, dummy, dummy, scale_dtype);
    return (q == PT_Q8_G32 || q == PT_Q4_G64) && kn_r16_supported(&v);
}

static int cmp_tensor(const void *a, const void *b) { return strcmp(((const pack_tensor *)a)->name, ((const pack_tensor *)b)->name); }

static int parse_json(pctx *c, const cJSON *root, uint64_t file_size, pack *p) {
    petrel_error *err = c->err;
    if (!cJSON_IsObject(root)) return pt_err(err, PETREL_EFORMAT, "%s: header is not a JSON object", c->where);
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, "format");
    if (!cJSON_IsString(f) || strcmp(f->valuestring, "petrel-pack")) return pt_err(err, PETREL_EFORMAT, "%s: header \"format\" is not \"petrel-pack\"", c->where);
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(root, "config");
    if (!cJSON_IsString(cfg)) return pt_err(err, PETREL_EFORMAT, "%s: header has no \"config\" text", c->where);
    if (!(p->config_json = strdup(cfg->valuestring))) return pt_err(err, PETREL_ENOMEM, "out of memory");
    const cJSON *gc = cJSON_GetObjectItemCaseSensitive(root, "generation_config");
    if (cJSON_IsString(gc) && !(p->generation_config_json = strdup(gc->valuestring))) return pt_err(err, PETREL_ENOMEM, "out of memory");
    const cJSON *fs = cJSON_GetObjectItemCaseSensitive(root, "files");
    if (fs && !cJSON_IsArray(fs)) return pt_err(err, PETREL_EFORMAT, "%s: header \"files\" is not a list", c->where);
    for (const cJSON *o = fs ? fs->child : NULL; o; o = o->next) {
        char ctx[64];
        snprintf(ctx, sizeof ctx, "side file %d", p->n_files);
        if (p->n_files == PACK_MAX_FILES) return pt_err(err, PETREL_EFORMAT, "%s: more than %d side files", c->where, PACK_MAX_FILES);
        pack_file *pf = &p->files[p->n_files];
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(o, "name");
        if (!cJSON_IsObject(o) || !cJSON_IsString(nm) || !nm->valuestring[0] || strlen(nm->valuestring) >= sizeof pf->name || strchr(nm->valuestring, '/'))
            return pt_err(err, PETREL_EFORMAT, "%s: %s needs a \"name\" (a file name of 1-63 bytes, no folder)", c->where, ctx);
        snprintf(pf->name, sizeof pf->name, "%s", nm->valuestring);
        PT_TRY(get_u64(c, o, "offset", pf->name, &pf->offset));
        PT_TRY(get_u64(c, o, "bytes", pf->name, &pf->bytes));
        PT_TRY(get_hex(c, cJSON_GetObjectItemCaseSensitive(o, "xxh64"), pf->name, &pf->xxh64));
        if (pf->bytes > PACK_FILE_MAX_BYTES || pf->offset < p->data_start || pf->offset > file_size || pf->bytes > file_size - pf->offset)
            return pt_err(err, PETREL_EFORMAT, "%s: side file \"%s\": range out of bounds", c->where, pf->name);
        if (pack_find_file(p, pf->name)) return pt_err(err, PETREL_EFORMAT, "%s: side file \"%s\" is listed twice", c->where, pf->name);
        p->n_files++;
    }
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(root, "tensors");
    if (!cJSON_IsArray(ts)) return pt_err(err, PETREL_EFORMAT, "%s: header has no \"tensors\" list", c->where);
    int n = cJSON_GetArraySize(ts);
    p->tensors = calloc((size_t)(n ? n : 1), sizeof(pack_tensor));
    if (!p->tensors) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int i = 0;
    for (const cJSON *o = ts->child; o; o = o->next, i++) {
        char ctx[64];
        snprintf(ctx, sizeof ctx, "tensor %d", i);
        p->n_tensors = i + 1;
        PT_TRY(parse_tensor(c, o, ctx, p->data_start, file_size, 1, &p->tensors[i]));
        PT_TRY(get_hex(c, cJSON_GetObjectItemCaseSensitive(o, "xxh64"), p->tensors[i].name, &p->tensors[i].xxh64));
    }
    qsort(p->tensors, (size_t)p->n_tensors, sizeof(pack_tensor), cmp_tensor);
    for (i = 1; i < p->n_tensors; i++)
        if (!strcmp(p->tensors[i].name, p->tensors[i - 1].name))
            return pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\" is listed twice", c->where, p->tensors[i].name);
    const cJSON *ex = cJSON_GetObjectItemCaseSensitive(root, "experts");
    if (!cJSON_IsArray(ex)) return pt_err(err, PETREL_EFORMAT, "%s: header has no \"experts\" list", c->where);
    n = cJSON_GetArraySize(ex);
    p->elayers = calloc((size_t)(n ? n : 1), sizeof(pack_expert_layer));
    if (!p->elayers) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int maxl = -1;
    i = 0;
    for (const cJSON *o = ex->child; o; o = o->next, i++) {
        pack_expert_layer *el = &p->elayers[i];
        p->n_elayers = i + 1;
        char ctx[96];
        snprintf(ctx, sizeof ctx, "expert layer entry %d", i);
        if (!cJSON_IsObject(o)) return pt_err(err, PETREL_EFORMAT, "%s: %s is not an object", c->where, ctx);
        uint64_t layer, ne;
        PT_TRY(get_u64(c, o, "layer", ctx, &layer));
        PT_TRY(get_u64(c, o, "n_experts", ctx, &ne));
        PT_TRY(get_u64(c, o, "first_offset", ctx, &el->first_offset));
        PT_TRY(get_u64(c, o, "record_bytes", ctx, &el->record_bytes));
        if (layer > 4096 || ne < 1 || ne > 65536) return pt_err(err, PETREL_EFORMAT, "%s: %s: bad layer or n_experts", c->where, ctx);
        if ((int)layer <= maxl) return pt_err(err, PETREL_EFORMAT, "%s: %s: layers must be listed in ascending order", c->where, ctx);
        maxl = (int)layer;
        el->layer = (int)layer;
        el->n_experts = (int)ne;
        if (el->record_bytes == 0 || el->record_bytes % PACK_ALIGN || el->first_offset % PACK_ALIGN || el->first_offset < p->data_start ||
            el->first_offset > file_size || el->record_bytes > (file_size - el->first_offset) / ne)
            return pt_err(err, PETREL_EFORMAT, "%s: layer %d expert records out of bounds or misaligned", c->where, el->layer);
        const cJSON *parts = cJSON_GetObjectItemCaseSensitive(o, "parts");
        if (!cJSON_IsArray(parts) || cJSON_GetArraySize(parts) != 3) return pt_err(err, PETREL_EFORMAT, "%s: layer %d: \"parts\" must list gate, up, down", c->where, el->layer);
        int k = 0;
        for (const cJSON *q = parts->child; q; q = q->next, k++) {
            snprintf(ctx, sizeof ctx, "layer %d expert part %d", el->layer, k);
            PT_TRY(parse_tensor(c, q, ctx, 0, el->record_bytes, 0, &el->part[k]));
        }
        const cJSON *hs = cJSON_GetObjectItemCaseSensitive(o, "xxh64");
        if (!cJSON_IsArray(hs) || cJSON_GetArraySize(hs) != (int)ne) return pt_err(err, PETREL_EFORMAT, "%s: layer %d: \"xxh64\" must list %d checksums", c->where, el->layer, el->n_experts);
        if (!(el->xxh64 = malloc(sizeof(uint64_t) * ne))) return pt_err(err, PETREL_ENOMEM, "out of memory");
        k = 0;
        for (const cJSON *h = hs->child; h; h = h->next, k++) PT_TRY(get_hex(c, h, ctx, &el->xxh64[k]));
    }
    p->n_layer_index = maxl + 1;
    p->layer_index = malloc(sizeof(int) * (size_t)(maxl + 2));
    if (!p->layer_index) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (i = 0; i < maxl + 1; i++) p->layer_index[i] = -1;
    for (i = 0; i < p->n_elayers; i++) p->layer_index[p->elayers[i].layer] = i;
    return 0;
}

int pack_parse(const uint8_t *buf, size_t len, uint64_t file_size, const char *where, pack *p, petrel_error *err) {
    memset(p, 0, sizeof *p);
    p->fd = -1;
    if (len < PACK_PREFIX || file_size < PACK_PREFIX) return pt_err(err, PETREL_EFORMAT, "%s: truncated: %zu bytes is too short for a petrel pack", where, len);
    if (memcmp(buf, PACK_MAGIC, 8)) return pt_err(err, PETREL_EFORMAT, "%s: bad magic: not a petrel pack", where);
    p->version = rd32(buf + 8);
    if (p->version < PACK_VERSION_MIN || p->version > PACK_VERSION)
        return pt_err(err, PETREL_EUNSUPPORTED, "%s: pack format version %u is not supported (this petrel reads versions %u to %u; reconvert)", where,
                      p->version, PACK_VERSION_MIN, PACK_VERSION);
    uint64_t hl = rd64(buf + 16), fsz = rd64(buf + 24), hh = rd64(buf + 32);
    if (fsz != file_size)
        return pt_err(err, PETREL_EFORMAT, "%s: truncated or extended: file has %" PRIu64 " bytes, the pack header says %" PRIu64, where, file_size, fsz);
    if (hl == 0 || hl > (1ull << 31) || hl > file_size - PACK_PREFIX || hl > len - PACK_PREFIX)
        return pt_err(err, PETREL_EFORMAT, "%s: header length %" PRIu64 " out of bounds", where, hl);
    p->header_len = hl;
    p->data_start = (PACK_PREFIX + hl + PACK_ALIGN - 1) / PACK_ALIGN * PACK_ALIGN;
    if (XXH64(buf + PACK_PREFIX, (size_t)hl, 0) != hh) return pt_err(err, PETREL_EFORMAT, "%s: header checksum mismatch (corrupted header)", where);
    cJSON *root = cJSON_ParseWithLength((const char *)buf + PACK_PREFIX, (size_t)hl);
    if (!root) return pt_err(err, PETREL_EFORMAT, "%s: header is not valid JSON", where);
    pctx c = {where, err};
    int rc = parse_json(&c, root, file_size, p);
    cJSON_Delete(root);
    if (rc < 0) pack_deinit(p);
    return rc;
}

void pack_deinit(pack *p) {
    for (int i = 0; i < p->n_tensors; i++) free(p->tensors[i].name);
    free(p->tensors);
    for (int i = 0; i < p->n_elayers; i++) free(p->elayers[i].xxh64);
    free(p->elayers);
    free(p->layer_index);
    free(p->config_json);
    free(p->generation_config_json);
    int fd = p->fd;
    memset(p, 0, sizeof *p);
    p->fd = fd;
}

int pack_is_pack(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not block the probe */
    if (fd < 0) return 0;
    char m[8];
    struct stat st;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && pread(fd, m, 8, 0) == 8 && !memcmp(m, PACK_MAGIC, 8);
    close(fd);
    return ok;
}

int pack_open(const char *path, pack **out, petrel_error *err) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pt_err(err, PETREL_EIO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) { close(fd); return pt_err(err, PETREL_EIO, "%s is not a regular file", path); }
    uint64_t size = (uint64_t)st.st_size;
    if (size < PACK_PREFIX) { close(fd); return pt_err(err, PETREL_EFORMAT, "%s: truncated: %" PRIu64 " bytes is too short for a petrel pack", path, size); }
    void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { close(fd); return pt_err(err, PETREL_EIO, "cannot map %s: %s", path, strerror(errno)); }
    pack *p = malloc(sizeof *p);
    if (!p) { munmap(m, (size_t)size); close(fd); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
    int rc = pack_parse(m, (size_t)size, size, path, p, err);
    if (rc < 0) { free(p); munmap(m, (size_t)size); close(fd); return rc; }
    p->fd = fd;
    p->map = m;
    p->file_size = size;
    snprintf(p->path, sizeof p->path, "%s", path);
    *out = p;
    return 0;
}

void pack_close(pack *p) {
    if (!p) return;
    if (p->map) munmap((void *)p->map, (size_t)p->file_size);
    if (p->copy) munmap(p->copy, (size_t)p->file_size);
    if (p->fd >= 0) close(p->fd);
    pack_deinit(p);
    free(p);
}

/* MemAvailable from /proc/meminfo in bytes, or 0 when unknown. */
static uint64_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb << 10;
}

/* (pack.h) O_DIRECT for the resident load: straight from the disk into the huge-page copy, no
 * page-cache copy, and nothing of the rest of the model evicted from the cache: 1d1m's 2.68 GB
 * of tensors in 0.6 s instead of 1.2-2.5 s (bench/RESULTS.md, 2026-12-05 06:20-06:55). */
static int range_cmp(const void *x, const void *y) {
    const pack_range *r = x, *q = y;
    return r->a < q->a ? -1 : r->a > q->a;
}

int pack_read_ranges(const pack *p, uint8_t *dst, pack_range *rg, int n, int direct, void (*progress)(uint64_t, uint64_t, void *), void *ud,
                     petrel_error *err) {
    const uint64_t pg = 4096, chunk = 64u << 20, end = (p->file_size + pg - 1) / pg * pg;
    for (int i = 0; i < n; i++) {
        rg[i].a &= ~(pg - 1);
        rg[i].b = (rg[i].b + pg - 1) & ~(pg - 1);
        if (rg[i].b > end) rg[i].b = end;
    }
    qsort(rg, (size_t)n, sizeof *rg, range_cmp);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (rg[i].b <= rg[i].a) continue;
        if (m && rg[i].a <= rg[m - 1].b) {
            if (rg[i].b > rg[m - 1].b) rg[m - 1].b = rg[i].b;
        } else
            rg[m++] = rg[i];
    }
    uint64_t total = 0, done = 0;
    for (int i = 0; i < m; i++) total += rg[i].b - rg[i].a;
    /* -1: buffered reads through p->fd (also where the path now names another file) */
    int dfd = direct ? pt_reopen(p->fd, p->path, O_RDONLY | O_DIRECT) : -1;
    int rc = 0;
    for (int i = 0; i < m && !rc; i++)
        for (uint64_t o = rg[i].a; o < rg[i].b && o < p->file_size;) {
            size_t len = rg[i].b - o > chunk ? (size_t)chunk : (size_t)(rg[i].b - o);
            ssize_t r = pread(dfd >= 0 ? dfd : p->fd, dst + o, len, (off_t)o);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && dfd >= 0 && errno == EINVAL) { /* alignment the device will not take: buffered from here on */
                close(dfd);
                dfd = -1;
                continue;
            }
            if (r <= 0) {
                rc = pt_err(err, PETREL_EIO, "%s: read failed at byte %" PRIu64 ": %s", p->path, o, r < 0 ? strerror(errno) : "end of file");
                break;
            }
            if (dfd >= 0 && (uint64_t)r % pg && o + (uint64_t)r < p->file_size) { /* a short direct read mid-file: buffered from here on */
                close(dfd);
                dfd = -1;
            }
            o += (uint64_t)r;
            done += (uint64_t)r;
            if (progress) progress(done < total ? done : total, total, ud);
        }
    if (dfd >= 0) close(dfd);
    return rc;
}

static void release_range(const pack *p, uint64_t off, uint64_t n) {
    uint64_t pg = 4096, a = off & ~(pg - 1), b = (off + n + pg - 1) & ~(pg - 1);
    if (b > p->file_size) b = p->file_size;
    if (n && b > a) madvise((void *)(p->map + a), (size_t)(b - a), MADV_DONTNEED);
}

void pack_release_on_disk(const pack *p) {
    if (!p->on_disk || !p->map) return;
    release_range(p, p->on_disk->offset, p->on_disk->bytes);
    release_range(p, p->on_disk->scale_offset, p->on_disk->scale_bytes);
}

static const pack_tensor *embed_to_skip(const pack *p) {
    return pack_find(p, "lm_head.weight") ? pack_find(p, "model.embed_tokens.weight") : NULL;
}

uint64_t pack_embed_on_disk_bytes(const pack *p) {
    const pack_tensor *t = embed_to_skip(p);
    return t ? t->bytes + t->scale_bytes : 0;
}

/* XXH64 of a tensor read through the map, 64 MiB at a time, each step's pages dropped after. */
static uint64_t hash_from_map(const pack *p, const pack_tensor *t, int *oom) {
    XXH64_state_t *st = XXH64_createState();
    if (!st) { *oom = 1; return 0; }
    XXH64_reset(st, 0);
    uint64_t step = 64u << 20, offs[2] = {t->offset, t->scale_offset}, lens[2] = {t->bytes, t->scale_bytes};
    for (int part = 0; part < 2; part++)
        for (uint64_t k = 0; k < lens[part]; k += step) {
            uint64_t n = lens[part] - k < step ? lens[part] - k : step;
            XXH64_update(st, p->map + offs[part] + k, (size_t)n);
            release_range(p, offs[part] + k, n);
        }
    uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
}

/* Without a copy the tensors are served from the map: their checksums are still checked, through
 * it (a load that does not fit must not skip them). */
static int check_from_map(const pack *p, petrel_error *err) {
    for (int i = 0; i < p->n_tensors; i++) {
        const pack_tensor *t = &p->tensors[i];
        int oom = 0;
        uint64_t h = hash_from_map(p, t, &oom);
        if (oom) return pt_err(err, PETREL_ENOMEM, "out of memory");
        if (h != t->xxh64) return pt_err(err, PETREL_EFORMAT, "%s: checksum mismatch in tensor \"%s\": the pack is corrupted", p->path, t->name);
    }
    return 0;
}

/* The copied tensors' checksums on the kernels' pool (an open of the full model hashes ~19 GB of
 * them; one thread took ~0.1 s a GB), each task's hash state on its stack. */
typedef struct {
    const pack *p;
    const pack_tensor *skip;
    const int *order;
    uint64_t *h;
} hash_job;
static void hash_task(void *ctx, int k, int thread) {
    (void)thread;
    const hash_job *j = ctx;
    int i = j->order[k];
    const pack_tensor *t = &j->p->tensors[i];
    if (t == j->skip) return;
    XXH64_state_t st;
    XXH64_reset(&st, 0);
    XXH64_update(&st, j->p->copy + t->offset, (size_t)t->bytes);
    if (t->scale_bytes) XXH64_update(&st, j->p->copy + t->scale_offset, (size_t)t->scale_bytes);
    j->h[i] = XXH64_digest(&st);
}
static int tensor_bytes_desc(const void *a, const void *b, void *ctx) {
    const pack *p = ctx;
    uint64_t x = p->tensors[*(const int *)a].bytes, y = p->tensors[*(const int *)b].bytes;
    return x > y ? -1 : x < y;
}

int pack_cached(const pack *p) {
    long sz = sysconf(_SC_PAGESIZE); /* mincore's vector has an entry a page of this size */
    if (!p->map || sz <= 0) return 0;
    const uint64_t pg = (uint64_t)sz, step = 1ull << 30; /* a GB of the map a call */
    unsigned char *v = malloc((size_t)(step / pg));
    if (!v) return 0;
    uint64_t in = 0, all = (p->file_size + pg - 1) / pg;
    for (uint64_t o = 0; o < p->file_size; o += step) {
        uint64_t n = p->file_size - o < step ? p->file_size - o : step, np = (n + pg - 1) / pg;
        if (mincore((void *)(p->map + o), (size_t)n, v) < 0) {
            free(v);
            return 0;
        }
        for (uint64_t i = 0; i < np; i++) in += v[i] & 1;
    }
    free(v);
    return in * 10 >= all * 9;
}

int pack_load_resident(pack *p, int experts, int embed_on_disk, uint64_t *copied_bytes, void (*progress)(uint64_t, uint64_t, void *),
                       void *ud, petrel_error *err) {
    *copied_bytes = 0;
    if (!p->map || p->copy) return 0;
    const pack_tensor *skip = embed_on_disk ? embed_to_skip(p) : NULL;
    uint64_t res = 0, exp = 0;
    for (int i = 0; i < p->n_tensors; i++)
        if (&p->tensors[i] != skip) res += p->tensors[i].bytes + p->tensors[i].scale_bytes;
    for (int i = 0; i < p->n_elayers; i++) exp += (uint64_t)p->elayers[i].n_experts * p->elayers[i].record_bytes;
    uint64_t avail = mem_available(), room = avail - avail / 8; /* leave an eighth to everything else */
    if (avail && res > room) return check_from_map(p, err);     /* the map pages it in, slowly */
    if (avail && res + exp > room) experts = 0;
    void *m = mmap(NULL, (size_t)p->file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return check_from_map(p, err); /* no address space for a copy: keep serving from the map */
    madvise(m, (size_t)p->file_size, MADV_HUGEPAGE);
    p->copy = m;
    int rc = 0;
    pack_range *rg = malloc(sizeof *rg * (size_t)(2 * p->n_tensors + 1));
    int nr = 0;
    if (!rg) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int i = 0; i < p->n_tensors && !rc; i++) {
        const pack_tensor *t = &p->tensors[i];
        if (t == skip) continue;
        rg[nr++] = (pack_range){t->offset, t->offset + t->bytes};
        if (t->scale_bytes) rg[nr++] = (pack_range){t->scale_offset, t->scale_offset + t->scale_bytes};
    }
    if (!rc) rc = pack_read_ranges(p, p->copy, rg, nr, !pack_cached(p), progress, ud, err); /* from the page cache where it holds the file */
    free(rg);
    uint64_t *hs = rc ? NULL : malloc(sizeof *hs * (size_t)p->n_tensors);
    int *order = rc ? NULL : malloc(sizeof *order * (size_t)p->n_tensors);
    if (!rc && (!hs || !order)) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    if (!rc) { /* every copied tensor's checksum over the pool, the largest first */
        for (int i = 0; i < p->n_tensors; i++) order[i] = i;
        hash_job hj = {p, skip, order, hs};
        qsort_r(order, (size_t)p->n_tensors, sizeof *order, tensor_bytes_desc, (void *)p);
        pool_run(kn_pool(), p->n_tensors, hash_task, &hj);
    }
    for (int i = 0; i < p->n_tensors && !rc; i++) { /* the first mismatch in file order is the one named */
        const pack_tensor *t = &p->tensors[i];
        uint64_t h = hs[i];
        if (t == skip) { /* through the map in steps released as they go */
            int oom = 0;
            h = hash_from_map(p, t, &oom);
            if (oom) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); break; }
        }
        if (h != t->xxh64) rc = pt_err(err, PETREL_EFORMAT, "%s: checksum mismatch in tensor \"%s\": the pack is corrupted", p->path, t->name);
    }
    free(hs);
    free(order);
    if (rc) {
        munmap(p->copy, (size_t)p->file_size);
        p->copy = NULL;
        return rc;
    }
    p->copy_experts = experts;
    p->on_disk = skip;
    *copied_bytes = res + (experts ? exp : 0);
    return 0;
}

int pack_drop_cache(pack *p, int expert_map) {
    if (!p->copy || !p->map || p->fd < 0 || expert_map) return 0;
    madvise((void *)p->map, (size_t)p->file_size, MADV_DONTNEED); /* a later read faults the page in again */
    posix_fadvise(p->fd, 0, 0, POSIX_FADV_DONTNEED);
    return 1;
}

int pack_fd(const pack *p) { return p->fd; }
const char *pack_path(const pack *p) { return p->path; }

const pack_tensor *pack_find(const pack *p, const char *name) {
    int lo = 0, hi = p->n_tensors - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(name, p->tensors[mid].name);
        if (!c) return &p->tensors[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

int pack_load_config(const pack *p, petrel_config *cfg, petrel_error *err) {
    char where[4200];
    snprintf(where, sizeof where, "%s (config)", p->path[0] ? p->path : "pack");
    PT_TRY(config_parse(p->config_json, strlen(p->config_json), where, cfg, err));
    if (!p->generation_config_json) return 0;
    cJSON *g = cJSON_Parse(p->generation_config_json);
    const cJSON *v = g ? cJSON_GetObjectItemCaseSensitive(g, "eos_token_id") : NULL;
    const cJSON *it = cJSON_IsArray(v) ? v->child : v;
    for (; it; it = cJSON_IsArray(v) ? it->next : NULL) {
        if (cJSON_IsNumber(it) && it->valuedouble >= 0 && it->valuedouble < cfg->vocab_size && !config_is_eos(cfg, (int32_t)it->valuedouble) &&
            cfg->n_eos < PT_MAX_EOS)
            cfg->eos_token_id[cfg->n_eos++] = (int32_t)it->valuedouble;
        if (!cJSON_IsArray(v)) break;
    }
    cJSON_Delete(g);
    return 0;
}

/* ---- experts ---- */

static const pack_expert_layer *elayer(const pack *p, int layer) {
    if (layer < 0 || layer >= p->n_layer_index || p->layer_index[layer] < 0) return NULL;
    return &p->elayers[p->layer_index[layer]];
}

int pack_expert_record(const pack *p, int layer, int expert, uint64_t *offset, uint64_t *bytes, uint64_t *xxh64) {
    const pack_expert_layer *el = elayer(p, layer);
    if (!el || expert < 0 || expert >= el->n_experts) return PETREL_EINVAL;
    if (offset) *offset = el->first_offset + (uint64_t)expert * el->record_bytes;
    if (bytes) *bytes = el->record_bytes;
    if (xxh64) *xxh64 = el->xxh64[expert];
    return 0;
}

int pack_expert_views(const pack *p, int layer, const uint8_t *record_buf, pt_wview *gate, pt_wview *up, pt_wview *down) {
    const pack_expert_layer *el = elayer(p, layer);
    if (!el) return PETREL_EINVAL;
    if (gate) pack_tensor_view(&el->part[0], record_buf, gate);
    if (up) pack_tensor_view(&el->part[1], record_buf, up);
    if (down) pack_tensor_view(&el->part[2], record_buf, down);
    return 0;
}

int pack_check_expert(const pack *p, int layer, int expert, const uint8_t *buf, petrel_error *err) {
    uint64_t off, n, h;
    if (pack_expert_record(p, layer, expert, &off, &n, &h) < 0)
        return pt_err(err, PETREL_EINVAL, "%s: no expert record for layer %d expert %d", p->path, layer, expert);
    uint64_t got = XXH64(buf, (size_t)n, 0);
    if (got != h)
        return pt_err(err, PETREL_EFORMAT, "%s: checksum mismatch in expert record layer %d expert %d (bytes %" PRIu64 "..%" PRIu64 "): the pack is corrupted",
                      p->path, layer, expert, off, off + n);
    return 0;
}

int pack_read_expert(const pack *p, int layer, int expert, uint8_t *buf, petrel_error *err) {
    uint64_t off, n;
    if (pack_expert_record(p, layer, expert, &off, &n, NULL) < 0)
        return pt_err(err, PETREL_EINVAL, "%s: no expert record for layer %d expert %d", p->path, layer, expert);
    for (uint64_t done = 0; done < n;) {
        ssize_t r = pread(p->fd, buf + done, (size_t)(n - done), (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return pt_err(err, PETREL_EIO, "%s: read of expert record layer %d expert %d failed: %s", p->path, layer, expert, r < 0 ? strerror(errno) : "end of file");
        done += (uint64_t)r;
    }
    return pack_check_expert(p, layer, expert, buf, err);
}

const pack_file *pack_find_file(const pack *p, const char *name) {
    for (int i = 0; i < p->n_files; i++)
        if (!strcmp(p->files[i].name, name)) return &p->files[i];
    return NULL;
}

int pack_read_file(const pack *p, const char *name, char **out, size_t *len, petrel_error *err) {
    *out = NULL;
    const pack_file *f = pack_find_file(p, name);
    if (!f && !strcmp(name, "generation_config.json") && p->generation_config_json) {
        if (!(*out = strdup(p->generation_config_json))) return pt_err(err, PETREL_ENOMEM, "out of memory");
        if (len) *len = strlen(*out);
        return 0;
    }
    if (!f) return pt_err(err, PETREL_EIO, "%s stores no %s", p->path[0] ? p->path : "the pack", name);
    char *b = malloc((size_t)f->bytes + 1);
    if (!b) return pt_err(err, PETREL_ENOMEM, "out of memory for %s (%" PRIu64 " bytes)", name, f->bytes);
    for (uint64_t done = 0; done < f->bytes;) {
        ssize_t r = p->fd >= 0 ? pread(p->fd, b + done, (size_t)(f->bytes - done), (off_t)(f->offset + done)) : -1;
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            free(b);
            return pt_err(err, PETREL_EIO, "%s: reading its %s failed: %s", p->path, name, r < 0 ? strerror(errno) : "end of file");
        }
        done += (uint64_t)r;
    }
    if (XXH64(b, (size_t)f->bytes, 0) != f->xxh64) {
        free(b);
        return pt_err(err, PETREL_EFORMAT, "%s: checksum mismatch in its %s: the pack is corrupted", p->path, name);
    }
    b[f->bytes] = 0;
    *out = b;
    if (len) *len = (size_t)f->bytes;
    return 0;
}

int pack_verify(const pack *p, petrel_error *err) {
    if (!p->map) return pt_err(err, PETREL_EINVAL, "pack_verify needs an opened pack");
    for (int i = 0; i < p->n_files; i++)
        if (XXH64(p->map + p->files[i].offset, (size_t)p->files[i].bytes, 0) != p->files[i].xxh64)
            return pt_err(err, PETREL_EFORMAT, "%s: checksum mismatch in its %s: the pack is corrupted", p->path, p->files[i].name);
    for (int i = 0; i < p->n_tensors; i++) {
        const pack_tensor *t = &p->tensors[i];
        XXH64_state_t *st = XXH64_createState();
        if (!st) return pt_err(err, PETREL_ENOMEM, "out of memory");
        XXH64_reset(st, 0);
        XXH64_update(st, p->map + t->offset, (size_t)t->bytes);
        if (t->scale_bytes) XXH64_update(st, p->map + t->scale_offset, (size_t)t->scale_bytes);
        uint64_t h = XXH64_digest(st);
        XXH64_freeState(st);
        if (h != t->xxh64) return pt_err(err, PETREL_EFORMAT, "%s: checksum mismatch in tensor \"%s\": the pack is corrupted", p->path, t->name);
    }
    for (int i = 0; i < p->n_elayers; i++) {
        const pack_expert_layer *el = &p->elayers[i];
        for (int e = 0; e < el->n_experts; e++)
            PT_TRY(pack_check_expert(p, el->layer, e, p->map + el->first_offset + (uint64_t)e * el->record_bytes, err));
    }
    return 0;
}

/* ---- weight source ---- */

/* "model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight" -> layer, expert, part; else -1. */
static int expert_name(const char *name, int *layer, int *expert) {
    int l, e, n = 0;
    char proj[8];
    if (sscanf(name, "model.layers.%d.mlp.experts.%d.%4[a-z]_proj.weight%n", &l, &e, proj, &n) != 3 || name[n]) return -1;
    *layer = l;
    *expert = e;
    if (!strcmp(proj, "gate")) return 0;
    if (!strcmp(proj, "up")) return 1;
    if (!strcmp(proj, "down")) return 2;
    return -1;
}

static int pk_matrix(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err) {
    const pack *p = ctx;
    int l, e, part = expert_name(name, &l, &e);
    const pack_tensor *t = NULL;
    const uint8_t *base = p->copy ? p->copy : p->map;
    if (part >= 0) {
        const pack_expert_layer *el = elayer(p, l);
        if (el && e >= 0 && e < el->n_experts) {
            t = &el->part[part];
            base = (p->copy_experts ? p->copy : p->map) + el->first_offset + (uint64_t)e * el->record_bytes;
        }
    } else if ((t = pack_find(p, name)) && t == p->on_disk) base = p->map;
    if (!t) return pt_err(err, PETREL_EFORMAT, "%s: missing tensor \"%s\" (expected shape [%lld, %lld])", p->path, name, (long long)rows, (long long)cols);
    if (t->vector || t->rows != rows || t->cols != cols)
        return pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\" has shape [%lld, %lld], expected [%lld, %lld]", p->path, name, (long long)t->rows,
                      (long long)t->cols, (long long)rows, (long long)cols);
    pack_tensor_view(t, base, out);
    return 0;
}

static int pk_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    const pack *p = ctx;
    const pack_tensor *t = pack_find(p, name);
    if (!t) return pt_err(err, PETREL_EFORMAT, "%s: missing tensor \"%s\" (expected shape [%lld])", p->path, name, (long long)n);
    if (!t->vector || t->cols != n) return pt_err(err, PETREL_EFORMAT, "%s: tensor \"%s\" is not a vector of %lld", p->path, name, (long long)n);
    memcpy(out, (p->copy ? p->copy : p->map) + t->offset, sizeof(float) * (size_t)n);
    return 0;
}

static int pk_has(void *ctx, const char *name) {
    const pack *p = ctx;
    int l, e;
    if (expert_name(name, &l, &e) >= 0) {
        const pack_expert_layer *el = elayer(p, l);
        return el && e >= 0 && e < el->n_experts;
    }
    return pack_find(p, name) != NULL;
}

void wsource_pack(wsource *ws, const pack *p) {
    ws->ctx = (void *)p;
    ws->matrix = pk_matrix;
    ws->vector = pk_vector;
    ws->has = pk_has;
}
