/* layout.c: the KV storage schemes (f32 / bf16 / int8 rows, their encode and decode) and the
 * byte layout of a page (kv.h says where each array sits and why). Pure functions: no pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "kv/kv_internal.h"
#include "model/config.h"
#include "quant/qtypes.h"

static const char *const scheme_names[KV_SCHEME_COUNT] = {"f32", "bf16", "int8"};

const char *kv_scheme_name(kv_scheme s) { return s >= 0 && s < KV_SCHEME_COUNT ? scheme_names[s] : "?"; }

int kv_scheme_parse(const char *s, kv_scheme *out, petrel_error *err) {
    if (s && !strcmp(s, "auto")) return *out = KV_BF16, 0;
    for (int i = 0; s && i < KV_SCHEME_COUNT; i++)
        if (!strcmp(s, scheme_names[i])) return *out = (kv_scheme)i, 0;
    return pt_err(err, PETREL_EINVAL, "unknown KV type \"%s\" (choose f32, bf16, int8 or auto)", s ? s : "");
}

void kv_shape_from_config(const petrel_config *cfg, int with_mtp, kv_shape *out) {
    out->n_layers = cfg->num_hidden_layers + (with_mtp ? 1 : 0);
    out->kv_lora_rank = cfg->kv_lora_rank;
    out->qk_rope_head_dim = cfg->qk_rope_head_dim;
    out->index_head_dim = cfg->index_head_dim;
    out->has_index = cfg->layer_indexer_full; /* [num_hidden_layers + 1]; entry L is the MTP layer's */
    out->mtp_layer = with_mtp ? cfg->num_hidden_layers : -1;
}

static int elem_bytes(kv_scheme s) { return s == KV_F32 ? 4 : s == KV_BF16 ? 2 : 1; }
static int pe_elem_bytes(kv_scheme s, int pe_f32) { return s == KV_F32 || pe_f32 ? 4 : 2; }

size_t kv_bytes_per_token_opts(const kv_shape *sh, const kv_pool_opts *o) {
    kv_scheme scheme = o->scheme;
    size_t eb = (size_t)elem_bytes(scheme), sc = scheme == KV_INT8 ? 4 : 0, t = 0;
    size_t ib = o->idx_f32 ? 4 : eb, isc = ib == 1 ? 4 : 0;
    for (int l = 0; l < sh->n_layers; l++) {
        t += (size_t)sh->kv_lora_rank * eb + sc + (size_t)sh->qk_rope_head_dim * (size_t)pe_elem_bytes(scheme, o->pe_f32);
        if (sh->has_index && sh->has_index[l]) t += (size_t)sh->index_head_dim * ib + isc;
    }
    return t;
}

kv_pool_opts kv_engine_opts(kv_scheme scheme, int page_positions) {
    kv_pool_opts o = {.scheme = scheme, .page_positions = page_positions, .pe_f32 = scheme == KV_INT8, .idx_f32 = scheme != KV_F32};
    return o;
}

size_t kv_bytes_per_token(const kv_shape *sh, kv_scheme scheme, int pe_f32) {
    kv_pool_opts o = {.scheme = scheme, .pe_f32 = pe_f32};
    return kv_bytes_per_token_opts(sh, &o);
}

static int64_t al64(int64_t x) { return (x + 63) & ~(int64_t)63; }

int kv_layout_init(kv_layout *lay, const kv_shape *sh, const kv_pool_opts *o, petrel_error *err) {
    memset(lay, 0, sizeof *lay);
    kv_scheme sc = o ? o->scheme : KV_F32;
    int P = o && o->page_positions ? o->page_positions : KV_PAGE_DEFAULT;
    if (sc < 0 || sc >= KV_SCHEME_COUNT) return pt_err(err, PETREL_EINVAL, "KV scheme %d is not f32, bf16 or int8", (int)sc);
    if (P < 1 || P > 4096) return pt_err(err, PETREL_EINVAL, "KV page of %d positions (1..4096)", P);
    if (sh->n_layers < 1 || sh->n_layers > 65536 || sh->kv_lora_rank < 1 || sh->kv_lora_rank > 65536 || sh->qk_rope_head_dim < 0 ||
        sh->qk_rope_head_dim > 65536 || sh->index_head_dim < 0 || sh->index_head_dim > 65536 || sh->mtp_layer < -1 ||
        sh->mtp_layer >= sh->n_layers)
        return pt_err(err, PETREL_EINVAL, "KV shape out of range: %d layers, kv_lora_rank %d, qk_rope_head_dim %d, index_head_dim %d, MTP layer %d",
                      sh->n_layers, sh->kv_lora_rank, sh->qk_rope_head_dim, sh->index_head_dim, sh->mtp_layer);
    lay->n_layers = sh->n_layers, lay->Rkv = sh->kv_lora_rank, lay->Dr = sh->qk_rope_head_dim, lay->Di = sh->index_head_dim;
    lay->mtp_layer = sh->mtp_layer, lay->P = P, lay->scheme = sc;
    lay->c_bytes = elem_bytes(sc);
    lay->pe_bytes = pe_elem_bytes(sc, o ? o->pe_f32 : 0);
    lay->idx_bytes = o && o->idx_f32 ? 4 : lay->c_bytes;
    lay->has_index = calloc((size_t)sh->n_layers, 1);
    lay->off = calloc((size_t)sh->n_layers, sizeof *lay->off);
    if (!lay->has_index || !lay->off) {
        kv_layout_deinit(lay);
        return pt_err(err, PETREL_ENOMEM, "out of memory for the KV layout");
    }
    int64_t at = 0;
    for (int l = 0; l < sh->n_layers; l++) {
        int hi = sh->has_index && sh->has_index[l] && sh->index_head_dim > 0;
        lay->has_index[l] = (uint8_t)hi;
        kv_layer_off *f = &lay->off[l];
        f->c = at, at = al64(at + (int64_t)P * lay->Rkv * lay->c_bytes);
        f->c_scale = -1, f->idx = -1, f->idx_scale = -1;
        if (sc == KV_INT8) f->c_scale = at, at = al64(at + (int64_t)P * 4);
        f->pe = at, at = al64(at + (int64_t)P * lay->Dr * lay->pe_bytes);
        if (hi) {
            f->idx = at, at = al64(at + (int64_t)P * lay->Di * lay->idx_bytes);
            if (lay->idx_bytes == 1) f->idx_scale = at, at = al64(at + (int64_t)P * 4);
        }
    }
    lay->page_bytes = (size_t)at;
    kv_shape s2 = *sh;
    s2.has_index = lay->has_index;
    kv_pool_opts o2 = {.scheme = sc, .pe_f32 = o ? o->pe_f32 : 0, .idx_f32 = o ? o->idx_f32 : 0};
    lay->bytes_per_token = kv_bytes_per_token_opts(&s2, &o2);
    return 0;
}

void kv_layout_deinit(kv_layout *lay) {
    free(lay->has_index);
    free(lay->off);
    lay->has_index = NULL;
    lay->off = NULL;
}

int64_t kv_layout_max_positions(const kv_layout *lay, uint64_t bytes) {
    return lay->page_bytes ? (int64_t)(bytes / lay->page_bytes) * lay->P : 0;
}

void kv_encode_row(int bytes, const float *x, int w, void *dst, float *scale) {
    if (bytes == 4) {
        memcpy(dst, x, sizeof(float) * (size_t)w);
    } else if (bytes == 2) {
        uint16_t *d = dst;
        for (int i = 0; i < w; i++) d[i] = pt_f32_to_bf16(x[i]);
    } else {
        float m = 0;
        for (int i = 0; i < w; i++) m = fmaxf(m, fabsf(x[i]));
        float s = m / 127.0f;
        int8_t *d = dst;
        if (s > 0) {
            float inv = 1.0f / s;
            for (int i = 0; i < w; i++) {
                float q = nearbyintf(x[i] * inv); /* round half to even (default rounding mode) */
                d[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
            }
        } else {
            memset(d, 0, (size_t)w);
        }
        *scale = s;
    }
}

void kv_decode_row(int bytes, const void *src, float scale, int w, float *out) {
    if (bytes == 4) {
        memcpy(out, src, sizeof(float) * (size_t)w);
    } else if (bytes == 2) {
        const uint16_t *s = src;
        for (int i = 0; i < w; i++) out[i] = pt_bf16_to_f32(s[i]);
    } else {
        const int8_t *s = src;
        for (int i = 0; i < w; i++) out[i] = (float)s[i] * scale;
    }
}
