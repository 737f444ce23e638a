/* colibri.c: the colibri artifact reader (see colibri.h for the format mapping).
 *
 * Nothing about an artifact is trusted: shard names and numbering, dtypes, byte counts and
 * scale counts are checked before a view is made, and every refusal names the tensor and what
 * was seen. Zero-copy views point into the shard maps; the few formats petrel's kernels lack are
 * converted exactly (the values q * s are unchanged) into memory owned by the colibri object. */
#include "io/colibri.h"

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/err.h"
#include "io/convert.h"
#include "quant/quant.h"

static const int k_group_sizes[] = {16, 32, 48, 64, 96, 128, 192, 256};
#define N_GS ((int)(sizeof k_group_sizes / sizeof k_group_sizes[0]))

const char *coli_fmt_name(coli_fmt f) {
    static const char *n[] = {"float", "int8 per row", "int4 per row", "int4 per group"};
    return (unsigned)f < COLI_FMT_COUNT ? n[f] : "?";
}

/* ---- shard discovery ---- */

enum { SH_MAIN, SH_MTP, SH_IDX, SH_KINDS };
static const char *const k_prefix[SH_KINDS] = {"out-", "out-mtp-", "out-idx-"};

typedef struct { char *name; int kind; long num; } shard;

/* Classifies "out-00001.safetensors" / "out-mtp-00001..." / "out-idx-00001..."; -1 otherwise. */
static int shard_kind(const char *n, long *num) {
    size_t l = strlen(n);
    if (l < 12 || strcmp(n + l - 12, ".safetensors")) return -1;
    for (int k = SH_KINDS - 1; k >= 0; k--) {
        size_t pl = strlen(k_prefix[k]);
        if (strncmp(n, k_prefix[k], pl)) continue;
        const char *d = n + pl, *end = n + l - 12;
        if (d == end || end - d > 9) return -1;
        long v = 0;
        for (const char *p = d; p < end; p++) {
            if (*p < '0' || *p > '9') return -1;
            v = v * 10 + (*p - '0');
        }
        *num = v;
        return k;
    }
    return -1;
}

static int shard_cmp(const void *a, const void *b) {
    const shard *x = a, *y = b;
    if (x->kind != y->kind) return x->kind - y->kind;
    return x->num < y->num ? -1 : x->num > y->num;
}

static int is_file(const char *dir, const char *name) {
    char p[4608];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

int colibri_detect(const char *dir) {
    if (is_file(dir, "model.safetensors.index.json")) return 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    int found = 0;
    struct dirent *e;
    long num;
    while (!found && (e = readdir(d))) found = shard_kind(e->d_name, &num) == SH_MAIN;
    closedir(d);
    return found;
}

static int list_shards(const char *dir, shard **out, int *n_out, petrel_error *err) {
    DIR *d = opendir(dir);
    if (!d) return pt_err(err, PETREL_EIO, "cannot list colibri folder %s", dir);
    shard *v = NULL;
    int n = 0, cap = 0, rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        long num;
        int k = shard_kind(e->d_name, &num);
        if (k < 0) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            shard *t = realloc(v, sizeof *v * (size_t)cap);
            if (!t) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); break; }
            v = t;
        }
        v[n].name = strdup(e->d_name);
        v[n].kind = k;
        v[n].num = num;
        if (!v[n++].name) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); break; }
    }
    closedir(d);
    if (rc == 0) qsort(v, (size_t)n, sizeof *v, shard_cmp);
    /* Numbering per kind must be consecutive: a gap is a shard lost in a download. */
    for (int i = 0; rc == 0 && i < n; i++) {
        if (i == 0 || v[i].kind != v[i - 1].kind) {
            if (v[i].num > 1)
                rc = pt_err(err, PETREL_EFORMAT, "colibri folder %s: the first %sNNNNN shard is %s; the shards numbered below %ld are missing",
                             dir, k_prefix[v[i].kind], v[i].name, v[i].num);
            continue;
        }
        if (v[i].num == v[i - 1].num)
            rc = pt_err(err, PETREL_EFORMAT, "colibri folder %s: %s and %s have the same shard number", dir, v[i - 1].name, v[i].name);
        else if (v[i].num != v[i - 1].num + 1)
            rc = pt_err(err, PETREL_EFORMAT, "colibri folder %s: shard %s%05ld.safetensors is missing (found %s, then %s)", dir,
                         k_prefix[v[i].kind], v[i - 1].num + 1, v[i - 1].name, v[i].name);
    }
    if (rc < 0) {
        for (int i = 0; i < n; i++) free(v[i].name);
        free(v);
        return rc;
    }
    *out = v;
    *n_out = n;
    return 0;
}

/* ---- opening ---- */

int colibri_open(const char *dir, const petrel_config *cfg, colibri **out, petrel_error *err) {
    *out = NULL;
    colibri *c = calloc(1, sizeof *c);
    if (!c) return pt_err(err, PETREL_ENOMEM, "out of memory");
    snprintf(c->dir, sizeof c->dir, "%s", dir);
    shard *sh = NULL;
    int n = 0;
    int rc = list_shards(dir, &sh, &n, err);
    if (rc < 0) { free(c); return rc; }
    for (int i = 0; i < n; i++) {
        if (sh[i].kind == SH_MAIN) c->n_main++;
        else if (sh[i].kind == SH_MTP) c->n_mtp++;
        else c->n_idx++;
    }
    char **paths = calloc((size_t)n + 1, sizeof(char *));
    if (!c->n_main) rc = pt_err(err, PETREL_EFORMAT, "colibri folder %s holds no out-NNNNN.safetensors shard", dir);
    else if (!paths) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int i = 0; rc == 0 && i < n; i++) {
        size_t l = strlen(dir) + strlen(sh[i].name) + 2;
        if (!(paths[i] = malloc(l))) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
        else snprintf(paths[i], l, "%s/%s", dir, sh[i].name);
    }
    if (rc == 0) rc = st_open_files((const char *const *)paths, n, &c->set, err);
    for (int i = 0; i < n; i++) {
        if (paths) free(paths[i]);
        free(sh[i].name);
    }
    free(paths);
    free(sh);
    if (rc < 0) { colibri_close(c); return rc; }
    /* Indexer weights: present when any full indexer layer has them (a partial set is caught
     * by the binder, which names the first missing tensor). */
    c->has_indexer = 1;
    if (cfg) {
        int nfull = 0, found = 0;
        char name[256];
        for (int l = 0; l < cfg->num_hidden_layers; l++) {
            if (!cfg->layer_indexer_full[l]) continue;
            nfull++;
            snprintf(name, sizeof name, "model.layers.%d.self_attn.indexer.wk.weight", l);
            found += st_find(c->set, name) != NULL;
        }
        c->has_indexer = nfull == 0 || found > 0;
    }
    *out = c;
    return 0;
}

void colibri_close(colibri *c) {
    if (!c) return;
    st_close(c->set);
    for (int i = 0; i < c->n_owned; i++) free(c->owned[i]);
    free(c->owned);
    free(c);
}

static void *own(colibri *c, size_t bytes, petrel_error *err) {
    if (c->n_owned == c->cap_owned) {
        int cap = c->cap_owned ? c->cap_owned * 2 : 32;
        void **t = realloc(c->owned, sizeof(void *) * (size_t)cap);
        if (!t) { pt_err(err, PETREL_ENOMEM, "out of memory converting colibri tensors"); return NULL; }
        c->owned = t;
        c->cap_owned = cap;
    }
    void *p = malloc(bytes ? bytes : 1);
    if (!p) { pt_err(err, PETREL_ENOMEM, "out of memory converting colibri tensors (%zu bytes)", bytes); return NULL; }
    c->owned[c->n_owned++] = p;
    c->owned_bytes += bytes;
    return p;
}

/* ---- format inference ---- */

int coli_infer_format(const char *name, int64_t O, int64_t I, uint64_t payload_bytes, uint64_t n_scales,
                      coli_fmt *fmt, int *gs, petrel_error *err) {
    if (O <= 0 || I <= 0 || O > (1ll << 31) || I > (1ll << 31))
        return pt_err(err, PETREL_EINVAL, "tensor \"%s\": bad logical shape [%lld, %lld]", name, (long long)O, (long long)I);
    uint64_t o = (uint64_t)O, i = (uint64_t)I, half = (i + 1) / 2;
    if (payload_bytes == o * i && n_scales == o) {
        *fmt = COLI_I8_ROW;
        *gs = (int)I;
        return 0;
    }
    if (payload_bytes == o * half) {
        if (n_scales == o) {
            *fmt = COLI_I4_ROW;
            *gs = (int)I;
            return 0;
        }
        if (n_scales % o == 0) {
            uint64_t G = n_scales / o;
            int cand[N_GS], nc = 0, pick = 0;
            for (int k = 0; k < N_GS; k++)
                if ((i + (uint64_t)k_group_sizes[k] - 1) / (uint64_t)k_group_sizes[k] == G) cand[nc++] = k_group_sizes[k];
            /* Several sizes can give the same count (I = 96, 2 groups: 48 or 64). Current colibri
             * builds use 64, so it wins; then a size that divides I exactly. */
            for (int k = 0; k < nc && !pick; k++) if (cand[k] == 64) pick = 64;
            for (int k = 0; k < nc && !pick; k++) if ((uint64_t)cand[k] * G == i) pick = cand[k];
            if (!pick && nc == 1) pick = cand[0];
            if (pick) {
                *fmt = COLI_I4_GROUP;
                *gs = pick;
                return 0;
            }
            if (nc > 1)
                return pt_err(err, PETREL_EUNSUPPORTED,
                              "tensor \"%s\" [%lld, %lld]: int4 payload with %llu scales per row is ambiguous (group size %d or %d, neither divides %lld)",
                              name, (long long)O, (long long)I, (unsigned long long)G, cand[0], cand[1], (long long)I);
        }
    }
    return pt_err(err, PETREL_EUNSUPPORTED,
                  "tensor \"%s\" [%lld, %lld]: payload of %llu bytes with %llu scales matches no format petrel reads "
                  "(int8 per row: %llu bytes + %llu scales; int4: %llu bytes + %llu scales per row or per group of 16..256); "
                  "colibri's int3/int2/FP8/MXFP4/E8 formats are not supported",
                  name, (long long)O, (long long)I, (unsigned long long)payload_bytes, (unsigned long long)n_scales,
                  (unsigned long long)(o * i), (unsigned long long)o, (unsigned long long)(o * half), (unsigned long long)o);
}

/* ---- the weight source ---- */

static void shape_str(const st_tensor *t, char *buf, size_t n) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < t->ndim && o < n; d++) o += (size_t)snprintf(buf + o, n - o, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

/* f32 data at p, copied into owned memory if it is not 4-byte aligned (kernels read floats). */
static const float *aligned_f32(colibri *c, const uint8_t *p, uint64_t n, int *copied, petrel_error *err) {
    if (((uintptr_t)p & 3) == 0) return (const float *)p;
    float *q = own(c, n * 4, err);
    if (q) memcpy(q, p, n * 4);
    *copied = 1;
    return q;
}

static int float_matrix(colibri *c, const char *name, const st_tensor *t, int64_t O, int64_t I, pt_wview *out, petrel_error *err) {
    int ok2 = t->ndim == 2 && t->shape[0] == O && t->shape[1] == I;
    int ok1 = t->ndim == 1 && t->shape[0] == O * I;
    if (!ok2 && !ok1) {
        char s[128];
        shape_str(t, s, sizeof s);
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" is %s %s, expected [%lld, %lld]", name, st_dtype_name(t->dtype), s,
                      (long long)O, (long long)I);
    }
    pt_qtype q = t->dtype == ST_F32 ? PT_F32 : t->dtype == ST_BF16 ? PT_BF16 : PT_F16;
    int es = q == PT_F32 ? 4 : 2, copied = 0;
    const uint8_t *d = t->data;
    if (((uintptr_t)d & (uintptr_t)(es - 1)) != 0) {
        uint8_t *p = own(c, (size_t)(O * I * es), err);
        if (!p) return PETREL_ENOMEM;
        memcpy(p, d, (size_t)(O * I * es));
        d = p;
        copied = 1;
    }
    *out = pt_wview_make(q, O, I, d, NULL, PT_F32);
    c->n_fmt[COLI_FLOAT]++;
    if (copied) c->n_converted++;
    else c->n_zero_copy++;
    return 0;
}

static int co_matrix(void *ctx, const char *name, int64_t O, int64_t I, pt_wview *out, petrel_error *err) {
    colibri *c = ctx;
    const st_tensor *t = st_find(c->set, name);
    if (!t) return pt_err(err, PETREL_EFORMAT, "missing tensor \"%s\" (expected [%lld, %lld]) in colibri folder %s", name, (long long)O, (long long)I, c->dir);
    memset(out, 0, sizeof *out);
    if (t->dtype == ST_F32 || t->dtype == ST_BF16 || t->dtype == ST_F16) return float_matrix(c, name, t, O, I, out, err);
    if (t->dtype != ST_U8 && t->dtype != ST_I8)
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has dtype %s; a colibri weight is a U8 payload (with \"%s.qs\" scales) or F32/BF16/F16",
                      name, st_dtype_name(t->dtype), name);
    char qn[600];
    snprintf(qn, sizeof qn, "%s.qs", name);
    const st_tensor *qs = st_find(c->set, qn);
    uint64_t pbytes = (uint64_t)st_numel(t);
    if (!qs)
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" is a quantized payload (%llu bytes, logical [%lld, %lld]) but its scales \"%s\" are missing",
                      name, (unsigned long long)pbytes, (long long)O, (long long)I, qn);
    if (qs->dtype != ST_F32)
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has dtype %s; colibri scales are F32", qn, st_dtype_name(qs->dtype));
    uint64_t ns = (uint64_t)st_numel(qs);
    coli_fmt fmt;
    int gs;
    PT_TRY(coli_infer_format(name, O, I, pbytes, ns, &fmt, &gs, err));
    int copied = 0;
    const float *s = aligned_f32(c, qs->data, ns, &copied, err);
    if (!s) return PETREL_ENOMEM;
    c->n_fmt[fmt]++;
    const uint8_t *p = t->data;
    int64_t half = (I + 1) / 2;
    if (fmt == COLI_I8_ROW) {
        *out = pt_wview_make(PT_Q8_ROW, O, I, p, s, PT_F32);
    } else if (fmt == COLI_I4_ROW || gs % 64 == 0) {
        /* Every 64-column group lies inside one colibri group: Q4_G64 with each colibri scale
         * repeated over its 64-groups (the payload layout is identical). */
        int64_t G = (fmt == COLI_I4_ROW) ? 1 : (I + gs - 1) / gs, G64 = (I + 63) / 64;
        if (G != G64) {
            float *s64 = own(c, sizeof(float) * (size_t)(O * G64), err);
            if (!s64) return PETREL_ENOMEM;
            int64_t span = (fmt == COLI_I4_ROW) ? I : gs;
            for (int64_t o = 0; o < O; o++)
                for (int64_t k = 0; k < G64; k++) s64[o * G64 + k] = s[o * G + (k * 64) / span];
            s = s64;
            copied = 1;
        }
        *out = pt_wview_make(PT_Q4_G64, O, I, p, s, PT_F32);
    } else if (gs % 32 == 0) {
        /* gs 32 or 96: widen to int8, one scale per 32 columns (each 32-group within one gs). */
        int64_t G = (I + gs - 1) / gs, G32 = (I + 31) / 32;
        int8_t *q8 = own(c, (size_t)(O * I), err);
        float *s32 = q8 ? own(c, sizeof(float) * (size_t)(O * G32), err) : NULL;
        if (!s32) return PETREL_ENOMEM;
        for (int64_t o = 0; o < O; o++) {
            const uint8_t *row = p + o * half;
            for (int64_t j = 0; j < I; j++) q8[o * I + j] = (int8_t)(((row[j >> 1] >> ((j & 1) * 4)) & 0xf) - 8);
            for (int64_t k = 0; k < G32; k++) s32[o * G32 + k] = s[o * G + (k * 32) / gs];
        }
        *out = pt_wview_make(PT_Q8_G32, O, I, q8, s32, PT_F32);
        copied = 1;
    } else {
        /* gs 16 or 48: no petrel format holds these groups; dequantize (exact: (q) * s). */
        int64_t G = (I + gs - 1) / gs;
        float *w = own(c, sizeof(float) * (size_t)(O * I), err);
        if (!w) return PETREL_ENOMEM;
        for (int64_t o = 0; o < O; o++) {
            const uint8_t *row = p + o * half;
            for (int64_t j = 0; j < I; j++)
                w[o * I + j] = (float)((int)((row[j >> 1] >> ((j & 1) * 4)) & 0xf) - 8) * s[o * G + j / gs];
        }
        *out = pt_wview_make(PT_F32, O, I, w, NULL, PT_F32);
        copied = 1;
    }
    if (copied) c->n_converted++;
    else c->n_zero_copy++;
    return 0;
}

static int co_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    colibri *c = ctx;
    const st_tensor *t = st_find(c->set, name);
    if (!t) return pt_err(err, PETREL_EFORMAT, "missing tensor \"%s\" (expected [%lld]) in colibri folder %s", name, (long long)n, c->dir);
    if (t->dtype != ST_F32 && t->dtype != ST_BF16 && t->dtype != ST_F16) {
        char qn[600];
        snprintf(qn, sizeof qn, "%s.qs", name);
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has dtype %s%s; colibri stores 1-D tensors as F32", name, st_dtype_name(t->dtype),
                      st_find(c->set, qn) ? " (quantized)" : "");
    }
    if (t->ndim != 1 || t->shape[0] != n) {
        char s[128];
        shape_str(t, s, sizeof s);
        return pt_err(err, PETREL_EFORMAT, "tensor \"%s\" has shape %s, expected [%lld]", name, s, (long long)n);
    }
    if (t->dtype == ST_F32) {
        memcpy(out, t->data, sizeof(float) * (size_t)n); /* memcpy: the map may be unaligned */
        return 0;
    }
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, t->data + 2 * i, 2);
        out[i] = t->dtype == ST_BF16 ? pt_bf16_to_f32(h) : pt_f16_to_f32(h);
    }
    return 0;
}

static int co_has(void *ctx, const char *name) { return st_find(((colibri *)ctx)->set, name) != NULL; }

void colibri_wsource(colibri *c, wsource *ws) {
    memset(ws, 0, sizeof *ws);
    ws->ctx = c;
    ws->matrix = co_matrix;
    ws->vector = co_vector;
    ws->has = co_has;
}

/* ---- conversion to a pack ---- */

int colibri_convert(const char *dir, const char *out_path, const convert_opts *o, convert_result *res, petrel_error *err) {
    convert_configs cc;
    PT_TRY(convert_configs_load(dir, &cc, err));
    colibri *c = NULL;
    int rc = colibri_open(dir, &cc.cfg, &c, err);
    if (rc == 0) {
        wsource ws;
        colibri_wsource(c, &ws);
        convert_src src = {cc.config_json, cc.generation_config_json, &cc.cfg, &ws, NULL, NULL, cc.files, cc.n_files};
        rc = convert_from_wsource(&src, out_path, o, res, err);
        colibri_close(c);
    }
    convert_configs_free(&cc);
    return rc;
}
