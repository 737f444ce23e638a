/* file.c: session files: a session's cache and token ids saved to disk and loaded back.
 *
 * Format (version 1, little-endian, every integer at a fixed offset of the 96-byte header):
 *    0  magic "PETRELKV"            8  u32 format version      12  u32 header bytes (96)
 *   16  u64 model identity (caller's hash of config and tensor checksums)
 *   24  u32 scheme (kv_scheme)     28  u32 bytes per k_pe value (4 or 2)
 *   32  u32 layers                 36  u32 kv_lora_rank       40  u32 qk_rope_head_dim
 *   44  u32 index_head_dim         48  i32 MTP layer (-1 none)
 *   52  u32 token count n          56  u32 MTP positions m (<= n)   60 u32 0
 *   64  u64 payload bytes          72  u64 0, 80 u64 0 (reserved; a reader of version 1 needs 0)
 *   88  u64 XXH3_64 of bytes [0, 88)
 * then u8 has_index[layers] (zero-padded to a multiple of 8), i32 token ids [n], the payload,
 * and u64 XXH3_64 of every byte before it. Payload: for each layer, for each of its arrays in
 * page order (c, c scales (int8), k_pe, indexer keys, their scales (int8)), the rows of
 * positions [0, n) (the MTP layer: [0, m)) exactly as a page stores them. The page size is not
 * part of the format: a file loads into a pool of any page size with the same scheme.
 * The version is read before the header checksum, so a future version that changes the header
 * is reported as such, not as corruption.
 *
 * Loading reads into fresh pages and swaps them in only after the checksum matched, so a
 * refused file leaves the session as it was (to make room it may have evicted prefix-cache
 * entries that only the cache held). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/outfile.h"
#include "kv/kv_internal.h"

#define HDR 96
static const char MAGIC[8] = {'P', 'E', 'T', 'R', 'E', 'L', 'K', 'V'};

static void put32(uint8_t *b, int at, uint32_t v) { memcpy(b + at, &v, 4); }
static void put64(uint8_t *b, int at, uint64_t v) { memcpy(b + at, &v, 8); }
static uint32_t get32(const uint8_t *b, int at) { uint32_t v; memcpy(&v, b + at, 4); return v; }
static uint64_t get64(const uint8_t *b, int at) { uint64_t v; memcpy(&v, b + at, 8); return v; }

/* The arrays of layer l in file order: page offsets and bytes per position. */
static int fields_of(const kv_layout *y, int l, int64_t off[5], size_t rb[5]) {
    const kv_layer_off *f = &y->off[l];
    int n = 0;
    off[n] = f->c, rb[n++] = (size_t)y->Rkv * (size_t)y->c_bytes;
    if (f->c_scale >= 0) off[n] = f->c_scale, rb[n++] = 4;
    off[n] = f->pe, rb[n++] = (size_t)y->Dr * (size_t)y->pe_bytes;
    if (f->idx >= 0) off[n] = f->idx, rb[n++] = (size_t)y->Di * (size_t)y->idx_bytes;
    if (f->idx_scale >= 0) off[n] = f->idx_scale, rb[n++] = 4;
    return n;
}

/* Header field 28: k_pe's bytes a value, and the indexer keys' in the next byte when they are
 * not the scheme's own (0 there: as the scheme). */
static uint32_t elem_code(const kv_layout *y) {
    return (uint32_t)y->pe_bytes | (y->idx_bytes != y->c_bytes ? (uint32_t)y->idx_bytes << 8 : 0u);
}

static int valid_of(const kv_layout *y, int l, int n, int m) { return l == y->mtp_layer ? m : n; }

static uint64_t payload_bytes(const kv_layout *y, int n, int m) {
    uint64_t t = 0;
    for (int l = 0; l < y->n_layers; l++) {
        int64_t off[5];
        size_t rb[5];
        int nf = fields_of(y, l, off, rb);
        for (int i = 0; i < nf; i++) t += (uint64_t)rb[i] * (uint64_t)valid_of(y, l, n, m);
    }
    return t;
}

static size_t flags_bytes(int n_layers) { return ((size_t)n_layers + 7) & ~(size_t)7; }

uint64_t kv_file_bytes(const kv_layout *y, int n, int m) {
    return HDR + flags_bytes(y->n_layers) + 4ull * (uint64_t)n + payload_bytes(y, n, m) + 8;
}

/* ---- save ---- */

typedef struct wctx {
    pt_outfile o;
    XXH3_state_t *h;
} wctx;

static int wput(wctx *w, const void *b, size_t n, petrel_error *err) {
    XXH3_64bits_update(w->h, b, n);
    return pt_out_write(&w->o, b, n, err);
}

int kv_save(const kv_seq *s, const char *path, uint64_t model_id, petrel_error *err) {
    const kv_layout *y = &s->pool->lay;
    int n = s->len, m = y->mtp_layer < 0 ? 0 : s->mtp_len;
    uint8_t h[HDR] = {0};
    memcpy(h, MAGIC, 8);
    put32(h, 8, KV_FILE_VERSION);
    put32(h, 12, HDR);
    put64(h, 16, model_id);
    put32(h, 24, (uint32_t)y->scheme);
    put32(h, 28, elem_code(y));
    put32(h, 32, (uint32_t)y->n_layers);
    put32(h, 36, (uint32_t)y->Rkv);
    put32(h, 40, (uint32_t)y->Dr);
    put32(h, 44, (uint32_t)y->Di);
    put32(h, 48, (uint32_t)y->mtp_layer);
    put32(h, 52, (uint32_t)n);
    put32(h, 56, (uint32_t)m);
    put64(h, 64, payload_bytes(y, n, m));
    put64(h, 88, XXH3_64bits(h, 88));
    uint8_t *flags = calloc(flags_bytes(y->n_layers), 1);
    wctx w = {0};
    w.h = XXH3_createState();
    if (!flags || !w.h) {
        free(flags);
        XXH3_freeState(w.h);
        return pt_err(err, PETREL_ENOMEM, "out of memory saving a session to %s", path);
    }
    memcpy(flags, y->has_index, (size_t)y->n_layers);
    XXH3_64bits_reset(w.h);
    int rc = pt_out_open(&w.o, path, NULL, err);
    if (rc) goto out;
    rc = wput(&w, h, HDR, err);
    if (!rc) rc = wput(&w, flags, flags_bytes(y->n_layers), err);
    if (!rc && n) rc = wput(&w, s->tokens, 4 * (size_t)n, err);
    for (int l = 0; !rc && l < y->n_layers; l++) {
        int64_t off[5];
        size_t rb[5];
        int nf = fields_of(y, l, off, rb), v = valid_of(y, l, n, m);
        for (int i = 0; !rc && i < nf; i++)
            for (int a = 0; !rc && a < v; a += s->P) {
                int k = v - a < s->P ? v - a : s->P;
                rc = wput(&w, kv_page_ptr(s->pool, s->pages[a / s->P]) + off[i], rb[i] * (size_t)k, err);
            }
    }
    if (!rc) {
        uint64_t sum = XXH3_64bits_digest(w.h);
        rc = pt_out_write(&w.o, &sum, 8, err);
    }
    if (!rc) rc = pt_out_commit(&w.o, err);
    else pt_out_abort(&w.o);
out:
    free(flags);
    XXH3_freeState(w.h);
    return rc;
}

/* ---- load ---- */

typedef struct rctx {
    FILE *f;
    const char *what;
    XXH3_state_t *h;
    uint64_t at, total; /* bytes read so far, bytes the header promises */
} rctx;

static int rget(rctx *r, void *b, size_t n, petrel_error *err) {
    size_t got = n ? fread(b, 1, n, r->f) : 0;
    r->at += got;
    if (got < n) {
        if (ferror(r->f)) return pt_err(err, PETREL_EIO, "%s: read failed: %s", r->what, strerror(errno));
        return pt_err(err, PETREL_EFORMAT, "%s: truncated session file: it ends at byte %llu of %llu", r->what, (unsigned long long)r->at,
                      (unsigned long long)r->total);
    }
    XXH3_64bits_update(r->h, b, n);
    return 0;
}

/* The header against this pool and session. */
static int check_header(const kv_seq *s, const uint8_t *h, const char *what, uint64_t model_id, petrel_error *err) {
    const kv_layout *y = &s->pool->lay;
    if (memcmp(h, MAGIC, 8)) return pt_err(err, PETREL_EFORMAT, "%s: not a petrel session file (bad magic)", what);
    uint32_t ver = get32(h, 8);
    if (ver > KV_FILE_VERSION)
        return pt_err(err, PETREL_EUNSUPPORTED, "%s: session file format version %u is newer than this build reads (up to %u)", what, ver,
                      KV_FILE_VERSION);
    if (ver == 0) return pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: format version 0", what);
    if (get64(h, 88) != XXH3_64bits(h, 88)) return pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: header checksum mismatch", what);
    if (get32(h, 12) != HDR || get32(h, 60) || get64(h, 72) || get64(h, 80))
        return pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: bad header size or reserved fields", what);
    uint64_t mid = get64(h, 16);
    if (mid != model_id)
        return pt_err(err, PETREL_EINVAL, "%s: session file was saved for another model (model id %016llx; this model is %016llx)", what,
                      (unsigned long long)mid, (unsigned long long)model_id);
    uint32_t sc = get32(h, 24), peb = get32(h, 28);
    if (sc != (uint32_t)y->scheme || peb != elem_code(y))
        return pt_err(err, PETREL_EINVAL, "%s: session file holds %s KV (k_pe %u, indexer keys %u bytes a value); this session uses %s (k_pe %d, indexer keys %d bytes)",
                      what, sc < KV_SCHEME_COUNT ? kv_scheme_name((kv_scheme)sc) : "unknown", peb & 255,
                      (peb >> 8) ? (peb >> 8) : sc == KV_INT8 ? 1u : sc == KV_BF16 ? 2u : 4u,
                      kv_scheme_name(y->scheme), y->pe_bytes, y->idx_bytes);
    if (get32(h, 32) != (uint32_t)y->n_layers || get32(h, 36) != (uint32_t)y->Rkv || get32(h, 40) != (uint32_t)y->Dr ||
        get32(h, 44) != (uint32_t)y->Di || (int32_t)get32(h, 48) != y->mtp_layer)
        return pt_err(err, PETREL_EINVAL,
                      "%s: session file shapes differ: %u layers (MTP %d), kv_lora_rank %u, qk_rope_head_dim %u, index_head_dim %u; this model: %d (MTP %d), %d, %d, %d",
                      what, get32(h, 32), (int32_t)get32(h, 48), get32(h, 36), get32(h, 40), get32(h, 44), y->n_layers, y->mtp_layer, y->Rkv, y->Dr,
                      y->Di);
    uint32_t n = get32(h, 52), m = get32(h, 56);
    if (m > n || (y->mtp_layer < 0 && m))
        return pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: %u MTP positions for %u tokens", what, m, n);
    if (n > (uint32_t)s->cap)
        return pt_err(err, PETREL_ERANGE, "%s: session file holds %u tokens; this session has room for %d", what, n, s->cap);
    if (get64(h, 64) != payload_bytes(y, (int)n, (int)m))
        return pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: payload of %llu bytes for %u tokens (expected %llu)", what,
                      (unsigned long long)get64(h, 64), n, (unsigned long long)payload_bytes(y, (int)n, (int)m));
    return 0;
}

int kv_load_stream(kv_seq *s, FILE *f, const char *what, uint64_t model_id, int vocab_size, petrel_error *err) {
    kv_pool *p = s->pool;
    const kv_layout *y = &p->lay;
    uint8_t h[HDR];
    size_t got = fread(h, 1, HDR, f);
    if (got < HDR) {
        if (ferror(f)) return pt_err(err, PETREL_EIO, "%s: read failed: %s", what, strerror(errno));
        if (got < 8 || memcmp(h, MAGIC, 8)) return pt_err(err, PETREL_EFORMAT, "%s: not a petrel session file (%zu bytes)", what, got);
        return pt_err(err, PETREL_EFORMAT, "%s: truncated session file: %zu bytes, the header alone is %d", what, got, HDR);
    }
    PT_TRY(check_header(s, h, what, model_id, err));
    int n = (int)get32(h, 52), m = (int)get32(h, 56), P = s->P;
    int np = (n + P - 1) / P;
    rctx r = {f, what, XXH3_createState(), HDR, kv_file_bytes(y, n, m)};
    uint8_t *flags = malloc(flags_bytes(y->n_layers));
    int32_t *tok = malloc(sizeof *tok * (size_t)(n ? n : 1));
    int32_t *pages = malloc(sizeof *pages * (size_t)(np ? np : 1));
    int rc = 0, taken = 0;
    if (!r.h || !flags || !tok || !pages) {
        rc = pt_err(err, PETREL_ENOMEM, "out of memory loading %s", what);
        goto fail;
    }
    XXH3_64bits_reset(r.h);
    XXH3_64bits_update(r.h, h, HDR);
    if ((rc = rget(&r, flags, flags_bytes(y->n_layers), err))) goto fail;
    for (size_t i = 0; i < flags_bytes(y->n_layers); i++)
        if (flags[i] != (i < (size_t)y->n_layers ? y->has_index[i] : 0)) {
            rc = pt_err(err, PETREL_EINVAL, "%s: session file's indexer layers differ from this model's (layer %zu)", what, i);
            goto fail;
        }
    if (n && (rc = rget(&r, tok, 4 * (size_t)n, err))) goto fail;
    for (int i = 0; i < n; i++)
        if (tok[i] < 0 || (vocab_size > 0 && tok[i] >= vocab_size)) {
            rc = pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: token %d at position %d is out of range", what, tok[i], i);
            goto fail;
        }
    pthread_mutex_lock(&p->mu);
    int avail = np <= p->n_free ? p->n_free : kv_avail_locked(p);
    if (np > avail) {
        int fr = p->n_free;
        pthread_mutex_unlock(&p->mu);
        rc = pt_err(err, PETREL_ERANGE, "%s: the session's %d tokens need %d KV pages; the pool has %d obtainable (%d free, of %d): %d tokens fit",
                    what, n, np, avail, fr, p->n_pages, avail * P);
        goto fail;
    }
    for (; taken < np; taken++) pages[taken] = kv_obtain_locked(p);
    pthread_mutex_unlock(&p->mu);
    for (int l = 0; !rc && l < y->n_layers; l++) {
        int64_t off[5];
        size_t rb[5];
        int nf = fields_of(y, l, off, rb), v = valid_of(y, l, n, m);
        for (int i = 0; !rc && i < nf; i++)
            for (int a = 0; !rc && a < v; a += P) {
                int k = v - a < P ? v - a : P;
                rc = rget(&r, kv_page_ptr(p, pages[a / P]) + off[i], rb[i] * (size_t)k, err);
            }
    }
    if (rc) goto fail;
    uint64_t want = XXH3_64bits_digest(r.h), sum;
    if ((rc = rget(&r, &sum, 8, err))) goto fail;
    if (sum != want) {
        rc = pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: checksum mismatch", what);
        goto fail;
    }
    if (fgetc(f) != EOF) {
        rc = pt_err(err, PETREL_EFORMAT, "%s: corrupt session file: bytes after the checksum (at %llu)", what, (unsigned long long)r.at);
        goto fail;
    }
    /* all checked: swap the pages in */
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < s->n_pages; i++) kv_unref_locked(p, s->pages[i]);
    pthread_mutex_unlock(&p->mu);
    if (np) memcpy(s->pages, pages, sizeof *pages * (size_t)np);
    if (n) memcpy(s->tokens, tok, sizeof *tok * (size_t)n);
    s->n_pages = np;
    s->len = n;
    s->mtp_len = m;
    taken = 0;
fail:
    if (taken) {
        pthread_mutex_lock(&p->mu);
        for (int i = 0; i < taken; i++) kv_unref_locked(p, pages[i]);
        pthread_mutex_unlock(&p->mu);
    }
    XXH3_freeState(r.h);
    free(flags);
    free(tok);
    free(pages);
    return rc;
}

int kv_load(kv_seq *s, const char *path, uint64_t model_id, int vocab_size, petrel_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return pt_err(err, PETREL_EIO, "cannot open session file %s: %s", path, strerror(errno));
    int rc = kv_load_stream(s, f, path, model_id, vocab_size, err);
    fclose(f);
    return rc;
}
