/* tokenizer.c: encoding (added-token split, normalization, pre-tokenization, BPE), decoding and
 * the streaming detokenizer for byte-level BPE. Loading lives in tok_load.c.
 *
 * Encode pipeline, as in Hugging Face tokenizers:
 *   1. added tokens with normalized=false are cut out of the raw text (leftmost-longest);
 *   2. each gap is normalized, then added tokens with normalized=true are cut out of it;
 *   3. each remaining gap runs through the pre-tokenizer steps (regex splits) into words;
 *   4. each word's bytes are merged by BPE: a linked list of symbols and a binary heap of
 *      candidate pairs keyed by (rank, position), O(n log n) per word (short words use a plain
 *      scan, which is faster and gives the same result). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>
#include <xxhash.h>

#include "base/err.h"
#include "text/tok_internal.h"

/* ---- UTF-8 helpers ---------------------------------------------------------------------- */

long tok_utf8_invalid_at(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        if (i + 8 <= len) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ULL)) { i += 8; continue; }
        }
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t k;
        uint32_t cp, min;
        if (c >= 0xC2 && c <= 0xDF) { k = 2; cp = c & 0x1F; min = 0x80; }
        else if (c >= 0xE0 && c <= 0xEF) { k = 3; cp = c & 0x0F; min = 0x800; }
        else if (c >= 0xF0 && c <= 0xF4) { k = 4; cp = c & 0x07; min = 0x10000; }
        else return (long)i;
        if (i + k > len) return (long)i;
        for (size_t j = 1; j < k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return (long)i;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return (long)i;
        i += k;
    }
    return -1;
}

static inline size_t u8len(unsigned char c) {
    return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

static uint32_t u8get(const unsigned char *s, size_t *k) {
    unsigned c = s[0];
    *k = u8len((unsigned char)c);
    switch (*k) {
    case 1: return c;
    case 2: return ((c & 0x1Fu) << 6) | (s[1] & 0x3Fu);
    case 3: return ((c & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu);
    default: return ((c & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) | (s[3] & 0x3Fu);
    }
}

/* Rust's char::is_whitespace (Unicode White_Space). */
static int is_ws(uint32_t c) {
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

static int is_word_char(uint32_t c) {
    if (c == '_') return 1;
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
           (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
}

/* Code point of the character ending at s[end) (end > 0), and its start. */
static uint32_t u8prev(const unsigned char *s, size_t end, size_t *start) {
    size_t i = end - 1;
    while (i > 0 && end - i < 4 && (s[i] & 0xC0) == 0x80) i--;
    size_t k;
    uint32_t c = u8get(s + i, &k);
    *start = i;
    return c;
}

/* ---- normalization ---------------------------------------------------------------------- */

static int all_below(const char *s, size_t n, unsigned char lim) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n; i++)
        if (u[i] >= lim) return 0;
    return 1;
}

/* 1 if NFC leaves c alone and c can never be the second half of a composition, so a run of such
 * characters is unchanged by NFC whatever surrounds it (its last one may still compose with a
 * following mark: callers re-normalize it with the mark). Conservative: any decomposition or
 * mark, and Hangul vowel/trailing jamo, count as unsafe. */
static int nfc_inert(uint32_t c) {
    if (c < 0x300) return 1;
    if ((c >= 0x1160 && c <= 0x11FF) || (c >= 0xD7B0 && c <= 0xD7FF)) return 0;
    const utf8proc_property_t *p = utf8proc_get_property((utf8proc_int32_t)c);
    if (p->combining_class || p->decomp_seqindex != UINT16_MAX) return 0;
    return p->category != UTF8PROC_CATEGORY_MN && p->category != UTF8PROC_CATEGORY_MC &&
           p->category != UTF8PROC_CATEGORY_ME && p->category != UTF8PROC_CATEGORY_CN;
}

static int grow(char **b, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *p = realloc(*b, c);
    if (!p) return -1;
    *b = p;
    *cap = c;
    return 0;
}

/* NFC that only runs utf8proc on the stretches that may change: each maximal run of non-inert
 * characters together with the character before it. *out stays NULL if nothing changed. */
static int nfc_chunked(const char *s, size_t n, char **out, size_t *on, petrel_error *err) {
    const unsigned char *u = (const unsigned char *)s;
    char *o = NULL;
    size_t cap = 0, w = 0, copied = 0, i = 0, prev = 0, k;
    int changed = 0;
    while (i < n) {
        if (u[i] < 0xCC) { prev = i; i += u8len(u[i]); continue; }
        uint32_t c = u8get(u + i, &k);
        if (nfc_inert(c)) { prev = i; i += k; continue; }
        size_t start = i > copied ? (prev >= copied && prev < i ? prev : i) : i, j = i + k;
        while (j < n) {
            uint32_t d = u8get(u + j, &k);
            if (nfc_inert(d)) break;
            j += k;
        }
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t r = utf8proc_map(u + start, (utf8proc_ssize_t)(j - start), &dst,
                                          (utf8proc_option_t)(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
        if (r < 0 || grow(&o, &cap, w + (start - copied) + (size_t)r + 1) < 0) {
            free(dst);
            free(o);
            return pt_err(err, r == UTF8PROC_ERROR_NOMEM || r >= 0 ? PETREL_ENOMEM : PETREL_EINVAL,
                          "tokenizer: normalization failed: %s", r < 0 ? utf8proc_errmsg(r) : "out of memory");
        }
        memcpy(o + w, s + copied, start - copied);
        w += start - copied;
        memcpy(o + w, dst, (size_t)r);
        w += (size_t)r;
        changed |= (size_t)r != j - start || memcmp(dst, u + start, (size_t)r);
        free(dst);
        copied = j;
        prev = i = j;
    }
    if (!changed) {
        free(o);
        *out = NULL;
        return 0;
    }
    if (grow(&o, &cap, w + (n - copied) + 1) < 0) {
        free(o);
        return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    memcpy(o + w, s + copied, n - copied);
    *out = o;
    *on = w + (n - copied);
    return 0;
}

static int norm_step(const tok_norm *nm, const char *s, size_t n, char **out, size_t *on,
                     petrel_error *err) {
    *out = NULL;
    if (nm->kind == NORM_PREPEND) {
        if (!n) return 0;
        char *o = malloc(nm->str_len + n + 1);
        if (!o) return pt_err(err, PETREL_ENOMEM, "out of memory");
        memcpy(o, nm->str, nm->str_len);
        memcpy(o + nm->str_len, s, n);
        *out = o;
        *on = nm->str_len + n;
        return 0;
    }
    if (nm->kind == NORM_REPLACE) {
        pcre2_match_data *md = pcre2_match_data_create(1, NULL);
        if (!md) return pt_err(err, PETREL_ENOMEM, "out of memory");
        size_t cap = n + 16, o = 0, off = 0, last = 0;
        char *buf = malloc(cap);
        int rc = 0;
        while (buf && off <= n) {
            int r = pcre2_match(nm->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
            if (r < 0) {
                if (r != PCRE2_ERROR_NOMATCH) rc = pt_err(err, PETREL_EINVAL, "tokenizer: Replace normalizer regex failed (%d)", r);
                break;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            size_t ms = ov[0], me = ov[1];
            size_t need = o + (ms - last) + nm->str_len + (n - me) + 1;
            if (need > cap) {
                cap = need * 2;
                char *p = realloc(buf, cap);
                if (!p) { free(buf); buf = NULL; break; }
                buf = p;
            }
            memcpy(buf + o, s + last, ms - last); o += ms - last;
            memcpy(buf + o, nm->str, nm->str_len); o += nm->str_len;
            last = me;
            off = me > ms ? me : me + (me < n ? u8len((unsigned char)s[me]) : 1);
        }
        pcre2_match_data_free(md);
        if (!buf) return pt_err(err, PETREL_ENOMEM, "out of memory");
        if (rc < 0) { free(buf); return rc; }
        if (o + (n - last) + 1 > cap) {
            char *p = realloc(buf, o + (n - last) + 1);
            if (!p) { free(buf); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
            buf = p;
        }
        memcpy(buf + o, s + last, n - last);
        *out = buf;
        *on = o + (n - last);
        return 0;
    }
    if (nm->kind == NORM_LOWER) {
        if (all_below(s, n, 0x80)) {
            int upper = 0;
            for (size_t i = 0; i < n && !upper; i++) upper = s[i] >= 'A' && s[i] <= 'Z';
            if (!upper) return 0;
        }
        char *o = malloc(n * 2 + 4); /* a lowercase form is at most 4 bytes per 2-byte+ char */
        if (!o) return pt_err(err, PETREL_ENOMEM, "out of memory");
        size_t w = 0;
        const unsigned char *u = (const unsigned char *)s;
        for (size_t i = 0; i < n;) {
            size_t k;
            uint32_t c = u8get(u + i, &k);
            utf8proc_int32_t l = utf8proc_tolower((utf8proc_int32_t)c);
            utf8proc_uint8_t tmp[4];
            utf8proc_ssize_t m = utf8proc_encode_char(l, tmp);
            if (w + (size_t)m > n * 2 + 4) { free(o); return pt_err(err, PETREL_EINVAL, "tokenizer: Lowercase overflow"); }
            memcpy(o + w, tmp, (size_t)m);
            w += (size_t)m;
            i += k;
        }
        *out = o;
        *on = w;
        return 0;
    }
    /* Unicode normal forms; skip text that cannot change */
    int opt = UTF8PROC_STABLE;
    unsigned char lim;
    switch (nm->kind) {
    case NORM_NFC: opt |= UTF8PROC_COMPOSE; lim = 0xCC; break;   /* < U+0300 */
    case NORM_NFD: opt |= UTF8PROC_DECOMPOSE; lim = 0xC3; break; /* < U+00C0 */
    case NORM_NFKC: opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; lim = 0xC2; break;
    default: opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; lim = 0xC2; break;
    }
    if (all_below(s, n, lim)) return 0;
    if (nm->kind == NORM_NFC) return nfc_chunked(s, n, out, on, err);
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      (utf8proc_option_t)opt);
    if (r < 0) {
        free(dst);
        return pt_err(err, r == UTF8PROC_ERROR_NOMEM ? PETREL_ENOMEM : PETREL_EINVAL,
                      "tokenizer: normalization failed: %s", utf8proc_errmsg(r));
    }
    *out = (char *)dst;
    *on = (size_t)r;
    return 0;
}

int tok_normalize(const tokenizer *t, const char *s, size_t len, char **out, size_t *out_len,
                  int *owned, petrel_error *err) {
    char *cur = (char *)s;
    size_t cn = len;
    int own = 0;
    for (int i = 0; i < t->n_norm; i++) {
        char *o;
        size_t on;
        int rc = norm_step(&t->norm[i], cur, cn, &o, &on, err);
        if (rc < 0) {
            if (own) free(cur);
            return rc;
        }
        if (o) {
            if (own) free(cur);
            cur = o;
            cn = on;
            own = 1;
        }
    }
    *out = cur;
    *out_len = cn;
    *owned = own;
    return 0;
}

/* ---- encoder state ---------------------------------------------------------------------- */

typedef struct span { size_t a, b; int m; } span;
typedef struct sym { int32_t id, prev, next; } sym;

typedef struct enc {
    const tokenizer *t;
    petrel_error *err;
    int32_t *ids;
    size_t n, cap;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jstack;
    span *lv[TOK_MAX_STEPS];
    size_t lv_cap[TOK_MAX_STEPS];
    sym *sy;
    size_t sy_cap;
    uint64_t *heap;
    size_t heap_cap;
    /* word cache for long texts (per call, so the tokenizer stays immutable and thread-safe) */
    struct wslot { uint64_t h; uint32_t off, len, ids, nids; } *wc;
    uint32_t wc_mask, wc_used;
    char *wbytes;
    size_t wb_len, wb_cap;
    int32_t *wids;
    size_t wi_len, wi_cap;
} enc;

#define WC_SLOTS (1u << 15)
#define WC_MAX_WORD 48

static int bpe_uncached(enc *E, const unsigned char *s, size_t n);

/* BPE of one word through the cache: a hit copies the ids; a miss computes and remembers. */
static int bpe_cached(enc *E, const unsigned char *s, size_t n) {
    uint64_t h = XXH3_64bits(s, n);
    uint32_t i = (uint32_t)h & E->wc_mask;
    for (;;) {
        struct wslot *w = &E->wc[i];
        if (!w->len) break;
        if (w->h == h && w->len == n && !memcmp(E->wbytes + w->off, s, n)) {
            if (E->n + w->nids > E->cap) {
                size_t c = E->cap ? E->cap : 256;
                while (c < E->n + w->nids) c *= 2;
                int32_t *p = realloc(E->ids, c * sizeof *p);
                if (!p) return pt_err(E->err, PETREL_ENOMEM, "out of memory");
                E->ids = p;
                E->cap = c;
            }
            if (w->nids) memcpy(E->ids + E->n, E->wids + w->ids, w->nids * sizeof *E->wids); /* a word may encode to nothing */
            E->n += w->nids;
            return 0;
        }
        i = (i + 1) & E->wc_mask;
    }
    size_t n0 = E->n;
    PT_TRY(bpe_uncached(E, s, n));
    size_t k = E->n - n0;
    if (E->wc_used >= E->wc_mask / 4 * 3) return 0; /* full: stop remembering */
    if (E->wb_len + n > E->wb_cap) {
        size_t c = E->wb_cap ? E->wb_cap * 2 : 1 << 16;
        while (c < E->wb_len + n) c *= 2;
        char *p = realloc(E->wbytes, c);
        if (!p) return 0; /* the cache is optional */
        E->wbytes = p;
        E->wb_cap = c;
    }
    if (E->wi_len + k > E->wi_cap) {
        size_t c = E->wi_cap ? E->wi_cap * 2 : 1 << 14;
        while (c < E->wi_len + k) c *= 2;
        int32_t *p = realloc(E->wids, c * sizeof *p);
        if (!p) return 0;
        E->wids = p;
        E->wi_cap = c;
    }
    struct wslot *w = &E->wc[i];
    w->h = h;
    w->off = (uint32_t)E->wb_len;
    w->len = (uint32_t)n;
    w->ids = (uint32_t)E->wi_len;
    w->nids = (uint32_t)k;
    memcpy(E->wbytes + E->wb_len, s, n);
    E->wb_len += n;
    if (k) memcpy(E->wids + E->wi_len, E->ids + n0, k * sizeof *E->wids);
    E->wi_len += k;
    E->wc_used++;
    return 0;
}

static int push_id(enc *E, int32_t id) {
    if (E->n == E->cap) {
        size_t c = E->cap ? E->cap * 2 : 256;
        int32_t *p = realloc(E->ids, c * sizeof *p);
        if (!p) return pt_err(E->err, PETREL_ENOMEM, "out of memory");
        E->ids = p;
        E->cap = c;
    }
    E->ids[E->n++] = id;
    return 0;
}

static inline const tok_mslot *merge_get(const tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t k = key;
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL; k ^= k >> 33;
    uint64_t h = k & t->mmask;
    for (;;) {
        const tok_mslot *e = &t->mtab[h];
        if (e->id < 0) return NULL;
        if (e->key == key) return e;
        h = (h + 1) & t->mmask;
    }
}

/* ---- BPE -------------------------------------------------------------------------------- */

static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] < h[c]) c++;
        if (v <= h[c]) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = v;
    return top;
}

#define BPE_SCAN_MAX 24 /* words up to this many symbols use the plain scan */

static int bpe_word(enc *E, const unsigned char *s, size_t n) {
    const tokenizer *t = E->t;
    if (t->ignore_merges || n == 1) {
        int32_t id = n == 1 ? t->byte_id[s[0]] : tok_vocab_lookup(t, (const char *)s, n);
        if (id >= 0) return push_id(E, id);
        if (n == 1) return t->unk_id >= 0 ? push_id(E, t->unk_id) : 0;
    }
    if (E->wc && n <= WC_MAX_WORD) return bpe_cached(E, s, n);
    return bpe_uncached(E, s, n);
}

static int bpe_uncached(enc *E, const unsigned char *s, size_t n) {
    const tokenizer *t = E->t;
    if (n > E->sy_cap) {
        size_t c = n + 64;
        sym *p = realloc(E->sy, c * sizeof *p);
        if (!p) return pt_err(E->err, PETREL_ENOMEM, "out of memory");
        E->sy = p;
        E->sy_cap = c;
    }
    /* initial symbols: one per byte; bytes without a token become unk (fused if asked) or vanish */
    sym *sy = E->sy;
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[s[i]];
        if (id < 0) {
            if (t->unk_id < 0) continue;
            if (t->fuse_unk && m && sy[m - 1].id == t->unk_id) continue;
            id = t->unk_id;
        }
        sy[m].id = id;
        m++;
    }
    if (m <= BPE_SCAN_MAX) {
        for (;;) {
            int32_t best = -1, best_rank = INT32_MAX, best_id = -1;
            for (int32_t i = 0; i + 1 < m; i++) {
                const tok_mslot *e = merge_get(t, sy[i].id, sy[i + 1].id);
                if (e && e->rank < best_rank) { best_rank = e->rank; best = i; best_id = e->id; }
            }
            if (best < 0) break;
            sy[best].id = best_id;
            memmove(sy + best + 1, sy + best + 2, (size_t)(m - best - 2) * sizeof *sy);
            m--;
        }
        for (int32_t i = 0; i < m; i++) PT_TRY(push_id(E, sy[i].id));
        return 0;
    }
    size_t hcap = (size_t)m * 3 + 4;
    if (hcap > E->heap_cap) {
        uint64_t *p = realloc(E->heap, hcap * sizeof *p);
        if (!p) return pt_err(E->err, PETREL_ENOMEM, "out of memory");
        E->heap = p;
        E->heap_cap = hcap;
    }
    uint64_t *h = E->heap;
    size_t hn = 0;
    for (int32_t i = 0; i < m; i++) {
        sy[i].prev = i - 1;
        sy[i].next = i + 1 < m ? i + 1 : -1;
        if (i + 1 < m) {
            const tok_mslot *e = merge_get(t, sy[i].id, sy[i + 1].id);
            if (e) heap_push(h, &hn, ((uint64_t)(uint32_t)e->rank << 32) | (uint32_t)i);
        }
    }
    while (hn) {
        uint64_t top = heap_pop(h, &hn);
        int32_t pos = (int32_t)(uint32_t)top, rank = (int32_t)(top >> 32);
        if (sy[pos].id < 0 || sy[pos].next < 0) continue;
        int32_t nx = sy[pos].next;
        const tok_mslot *e = merge_get(t, sy[pos].id, sy[nx].id);
        if (!e || e->rank != rank) continue;
        sy[pos].id = e->id;
        sy[pos].next = sy[nx].next;
        if (sy[nx].next >= 0) sy[sy[nx].next].prev = pos;
        sy[nx].id = -1;
        if (sy[pos].prev >= 0) {
            const tok_mslot *q = merge_get(t, sy[sy[pos].prev].id, sy[pos].id);
            if (q) heap_push(h, &hn, ((uint64_t)(uint32_t)q->rank << 32) | (uint32_t)sy[pos].prev);
        }
        if (sy[pos].next >= 0) {
            const tok_mslot *q = merge_get(t, sy[pos].id, sy[sy[pos].next].id);
            if (q) heap_push(h, &hn, ((uint64_t)(uint32_t)q->rank << 32) | (uint32_t)pos);
        }
    }
    for (int32_t i = 0; i >= 0; i = sy[i].next) PT_TRY(push_id(E, sy[i].id));
    return 0;
}

/* ---- pre-tokenization ------------------------------------------------------------------- */

/* Next regex match in s[0..n) at or after off; returns 1 with [*ms, *me), 0 if none, <0 error. */
static int re_next(enc *E, const tok_pre *p, const char *s, size_t n, size_t off,
                   size_t *ms, size_t *me) {
    for (;;) {
        /* the text is valid UTF-8 (checked once in tok_encode), so skip PCRE2's checks */
        int r = p->jit ? pcre2_jit_match(p->re, (PCRE2_SPTR)s, n, off, 0, E->md, E->mctx)
                       : pcre2_match(p->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, E->md, E->mctx);
        if (r == PCRE2_ERROR_NOMATCH) return 0;
        if (r == PCRE2_ERROR_JIT_STACKLIMIT && !E->jstack) {
            E->jstack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, NULL);
            if (!E->mctx) E->mctx = pcre2_match_context_create(NULL);
            if (!E->jstack || !E->mctx) return pt_err(E->err, PETREL_ENOMEM, "out of memory");
            pcre2_jit_stack_assign(E->mctx, NULL, E->jstack);
            continue;
        }
        if (r < 0) {
            PCRE2_UCHAR msg[200];
            pcre2_get_error_message(r, msg, sizeof msg);
            return pt_err(E->err, PETREL_EINVAL, "tokenizer: pre-tokenizer regex failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(E->md);
        *ms = ov[0];
        *me = ov[1];
        return 1;
    }
}

static int pre_step(enc *E, int k, const char *s, size_t n);

/* Splits s by step k's regex with its behavior and hands every piece to step k+1. */
static int split_step(enc *E, int k, const char *s, size_t n) {
    const tok_pre *p = &E->t->pre[k];
    size_t off = 0, ms, me, prev = 0;
    if (p->behavior == SPLIT_ISOLATED || (p->behavior == SPLIT_REMOVED)) {
        /* stream: gaps and matches in order; Removed drops the delimiters (the matches, or the
         * gaps when inverted) */
        int keep_gap = p->behavior == SPLIT_ISOLATED || !p->invert;
        int keep_match = p->behavior == SPLIT_ISOLATED || p->invert;
        while (off <= n) {
            int r = re_next(E, p, s, n, off, &ms, &me);
            if (r < 0) return r;
            if (!r) break;
            if (ms > prev && keep_gap) PT_TRY(pre_step(E, k + 1, s + prev, ms - prev));
            if (me > ms && keep_match) PT_TRY(pre_step(E, k + 1, s + ms, me - ms));
            prev = me;
            off = me > ms ? me : me + (me < n ? u8len((unsigned char)s[me]) : 1);
        }
        if (prev < n && keep_gap) PT_TRY(pre_step(E, k + 1, s + prev, n - prev));
        return 0;
    }
    /* other behaviors: collect (range, is_match), then fold as Hugging Face does */
    size_t cnt = 0;
#define LV_PUSH(A, B, M)                                                                    \
    do {                                                                                    \
        if (cnt == E->lv_cap[k]) {                                                          \
            size_t c_ = E->lv_cap[k] ? E->lv_cap[k] * 2 : 64;                               \
            span *q_ = realloc(E->lv[k], c_ * sizeof *q_);                                  \
            if (!q_) return pt_err(E->err, PETREL_ENOMEM, "out of memory");                 \
            E->lv[k] = q_;                                                                  \
            E->lv_cap[k] = c_;                                                              \
        }                                                                                   \
        E->lv[k][cnt].a = (A); E->lv[k][cnt].b = (B); E->lv[k][cnt].m = (M); cnt++;         \
    } while (0)
    while (off <= n) {
        int r = re_next(E, p, s, n, off, &ms, &me);
        if (r < 0) return r;
        if (!r) break;
        if (ms > prev) LV_PUSH(prev, ms, p->invert);
        LV_PUSH(ms, me, !p->invert);
        prev = me;
        off = me > ms ? me : me + (me < n ? u8len((unsigned char)s[me]) : 1);
    }
    if (prev < n) LV_PUSH(prev, n, p->invert);
    /* fold into out-list (in place: the output never outruns the input) */
    span *v = E->lv[k];
    size_t o = 0;
    if (p->behavior == SPLIT_MERGED_PREV || p->behavior == SPLIT_CONTIGUOUS) {
        int prev_m = 0;
        for (size_t i = 0; i < cnt; i++) {
            span c = v[i];
            int join = p->behavior == SPLIT_MERGED_PREV ? (c.m && !prev_m) : (c.m == prev_m);
            if (join && o) v[o - 1].b = c.b;
            else v[o++] = c;
            prev_m = c.m;
        }
    } else { /* MergedWithNext: walk backwards */
        int prev_m = 0;
        size_t w = cnt; /* write from the end */
        for (size_t i = cnt; i-- > 0;) {
            span c = v[i];
            if (c.m && !prev_m && w < cnt) v[w].a = c.a;
            else v[--w] = c;
            prev_m = c.m;
        }
        memmove(v, v + w, (cnt - w) * sizeof *v);
        o = cnt - w;
    }
    for (size_t i = 0; i < o; i++) {
        span c = E->lv[k][i]; /* re-read: recursion does not touch level k, but be explicit */
        if (c.b > c.a) PT_TRY(pre_step(E, k + 1, s + c.a, c.b - c.a));
    }
    return 0;
#undef LV_PUSH
}

static int pre_step(enc *E, int k, const char *s, size_t n) {
    if (!n) return 0;
    const tokenizer *t = E->t;
    if (k == t->n_pre) return bpe_word(E, (const unsigned char *)s, n);
    const tok_pre *p = &t->pre[k];
    if (p->kind == PRE_BYTELEVEL) {
        if (p->add_prefix_space && s[0] != ' ') {
            char *b = malloc(n + 1);
            if (!b) return pt_err(E->err, PETREL_ENOMEM, "out of memory");
            b[0] = ' ';
            memcpy(b + 1, s, n);
            int rc = p->re ? split_step(E, k, b, n + 1) : pre_step(E, k + 1, b, n + 1);
            free(b);
            return rc;
        }
        return p->re ? split_step(E, k, s, n) : pre_step(E, k + 1, s, n);
    }
    return split_step(E, k, s, n);
}

/* ---- added tokens ----------------------------------------------------------------------- */

typedef int (*gap_fn)(enc *E, const char *s, size_t n);

static int split_added(enc *E, const tok_added_set *set, const char *s, size_t n, gap_fn gap) {
    const tokenizer *t = E->t;
    const unsigned char *u = (const unsigned char *)s;
    size_t done = 0, i = 0;
    if (set->start[256] == 0) return gap(E, s, n);
    while (i < n) {
        int32_t b0 = set->start[u[i]], b1 = set->start[u[i] + 1];
        const tok_added *hit = NULL;
        for (int32_t j = b0; j < b1; j++) {
            const tok_added *a = &t->added[set->order[j]];
            if (a->len <= n - i && !memcmp(s + i, a->content, a->len)) { hit = a; break; }
        }
        if (!hit) { i++; continue; }
        size_t start = i, stop = i + hit->len, k;
        if (hit->single_word) {
            size_t ps;
            int before = start > 0 && is_word_char(u8prev(u, start, &ps));
            int after = stop < n && is_word_char(u8get(u + stop, &k));
            if (before || after) { i = stop; continue; }
        }
        if (hit->lstrip) {
            size_t ps;
            while (start > done && is_ws(u8prev(u, start, &ps))) start = ps;
        }
        if (hit->rstrip) {
            uint32_t c;
            while (stop < n && (c = u8get(u + stop, &k), is_ws(c))) stop += k;
        }
        if (start > done) PT_TRY(gap(E, s + done, start - done));
        PT_TRY(push_id(E, hit->id));
        done = i = stop;
    }
    if (n > done) PT_TRY(gap(E, s + done, n - done));
    return 0;
}

static int gap_norm(enc *E, const char *s, size_t n) { return pre_step(E, 0, s, n); }

static int gap_raw(enc *E, const char *s, size_t n) {
    char *o;
    size_t on;
    int owned;
    PT_TRY(tok_normalize(E->t, s, n, &o, &on, &owned, E->err));
    int rc = split_added(E, &E->t->set_norm, o, on, gap_norm);
    if (owned) free(o);
    return rc;
}

int tok_encode(const tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n,
               petrel_error *err) {
    *ids = NULL;
    *n = 0;
    if (!text && len) return pt_err(err, PETREL_EINVAL, "tokenizer: NULL text");
    long bad = tok_utf8_invalid_at((const unsigned char *)text, len);
    if (bad >= 0)
        return pt_err(err, PETREL_EINVAL, "invalid UTF-8 in text at byte offset %ld (byte 0x%02x)",
                      bad, (unsigned char)text[bad]);
    enc E = {.t = t, .err = err};
    E.md = pcre2_match_data_create(1, NULL);
    if (!E.md) return pt_err(err, PETREL_ENOMEM, "out of memory");
    if (len >= 256) { /* words repeat: remember their BPE; table sized to the text */
        uint32_t slots = 64;
        while (slots < WC_SLOTS && slots < len / 4) slots *= 2;
        E.wc = calloc(slots, sizeof *E.wc);
        E.wc_mask = slots - 1;
    }
    int rc = len ? split_added(&E, &t->set_raw, text, len, gap_raw) : 0;
    pcre2_match_data_free(E.md);
    if (E.mctx) pcre2_match_context_free(E.mctx);
    if (E.jstack) pcre2_jit_stack_free(E.jstack);
    for (int i = 0; i < TOK_MAX_STEPS; i++) free(E.lv[i]);
    free(E.sy);
    free(E.heap);
    free(E.wc);
    free(E.wbytes);
    free(E.wids);
    if (rc < 0) {
        free(E.ids);
        return rc;
    }
    *ids = E.ids;
    *n = E.n;
    return 0;
}

/* ---- decoding --------------------------------------------------------------------------- */

int32_t tok_vocab_size(const tokenizer *t) { return t->n_ids; }

const char *tok_id_to_bytes(const tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_ids || t->tok_len[id] < 0) return NULL;
    *len = (size_t)t->tok_len[id];
    return t->arena ? t->arena + t->tok_off[id] : "";
}

int tok_is_special(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->is_special[id];
}

int32_t tok_token_to_id(const tokenizer *t, const char *s) {
    size_t n = strlen(s);
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && !memcmp(t->added[i].content, s, n)) return t->added[i].id;
    return tok_vocab_lookup(t, s, n);
}

static int bad_id(const tokenizer *t, int32_t id, size_t pos, petrel_error *err) {
    return pt_err(err, PETREL_EINVAL, "token id %ld (at position %zu) is not in the vocabulary (%ld ids)",
                  (long)id, pos, (long)t->n_ids);
}

int tok_decode(const tokenizer *t, const int32_t *ids, size_t n, char **out, size_t *out_len,
               petrel_error *err) {
    *out = NULL;
    size_t total = 0, l;
    for (size_t i = 0; i < n; i++) {
        if (!tok_id_to_bytes(t, ids[i], &l)) return bad_id(t, ids[i], i, err);
        total += l;
    }
    char *o = malloc(total + 1);
    if (!o) return pt_err(err, PETREL_ENOMEM, "out of memory");
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        const char *b = tok_id_to_bytes(t, ids[i], &l);
        memcpy(o + w, b, l);
        w += l;
    }
    o[w] = 0;
    *out = o;
    if (out_len) *out_len = w;
    return 0;
}

/* ---- streaming detokenizer -------------------------------------------------------------- */

void tok_stream_init(tok_stream *s, const tokenizer *t) {
    memset(s, 0, sizeof *s);
    s->t = t;
}

void tok_stream_free(tok_stream *s) {
    free(s->buf);
    s->buf = NULL;
    s->cap = 0;
    s->npend = 0;
}

/* Length of the complete prefix of b[0..n): an incomplete trailing character is cut off. */
static size_t complete_prefix(const unsigned char *b, size_t n) {
    size_t lim = n > 4 ? n - 4 : 0;
    for (size_t i = n; i-- > lim;) {
        unsigned c = b[i];
        if ((c & 0xC0) == 0x80) continue;       /* continuation: keep looking for the lead */
        size_t need = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
        return i + need > n ? i : n;
    }
    return n;
}

int tok_stream_push(tok_stream *s, int32_t id, const char **bytes, size_t *len,
                    petrel_error *err) {
    size_t l;
    const char *b = tok_id_to_bytes(s->t, id, &l);
    *bytes = "";
    *len = 0;
    if (!b) return bad_id(s->t, id, 0, err);
    size_t total = (size_t)s->npend + l;
    if (total + 1 > s->cap) {
        size_t c = total + 64;
        char *p = realloc(s->buf, c);
        if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory");
        s->buf = p;
        s->cap = c;
    }
    memcpy(s->buf, s->pend, (size_t)s->npend);
    memcpy(s->buf + s->npend, b, l);
    size_t cut = complete_prefix((const unsigned char *)s->buf, total);
    s->npend = (int)(total - cut);
    memcpy(s->pend, s->buf + cut, (size_t)s->npend);
    s->buf[cut] = 0;
    *bytes = s->buf;
    *len = cut;
    return 0;
}

int tok_stream_flush(tok_stream *s, const char **bytes, size_t *len, petrel_error *err) {
    *bytes = "";
    *len = 0;
    if (!s->npend) return 0;
    if (s->cap < 5) {
        char *p = realloc(s->buf, 8);
        if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory");
        s->buf = p;
        s->cap = 8;
    }
    memcpy(s->buf, s->pend, (size_t)s->npend);
    s->buf[s->npend] = 0;
    *bytes = s->buf;
    *len = (size_t)s->npend;
    s->npend = 0;
    return 0;
}
