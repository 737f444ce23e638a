/* tok_load.c: builds a tokenizer from a Hugging Face tokenizer.json (cJSON): the vocabulary and
 * merge hash tables, the normalizer and pre-tokenizer step lists, the added-token index. Every
 * missing or malformed field is reported by its JSON path; unsupported types by their name. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/file.h"
#include "text/tok_internal.h"

/* GPT-2's byte-level alphabet: printable bytes stand for themselves, the other 68 bytes are
 * shifted to U+0100..U+0143. inv[cp] is the byte a code point stands for, -1 if none. */
static void bytelevel_inverse(int16_t inv[324]) {
    for (int i = 0; i < 324; i++) inv[i] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        if (printable) inv[b] = (int16_t)b;
        else inv[256 + n++] = (int16_t)b;
    }
}

/* Decodes one UTF-8 character at s (valid input assumed: cJSON produced it); returns length. */
static int utf8_dec(const unsigned char *s, size_t n, uint32_t *cp) {
    if (s[0] < 0x80 || n < 2) { *cp = s[0]; return 1; }
    if ((s[0] & 0xE0) == 0xC0) { *cp = ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F); return 2; }
    if ((s[0] & 0xF0) == 0xE0 && n >= 3) {
        *cp = ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
        return 3;
    }
    if ((s[0] & 0xF8) == 0xF0 && n >= 4) {
        *cp = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
              ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
        return 4;
    }
    *cp = s[0];
    return 1;
}

typedef struct loader {
    tokenizer *t;
    petrel_error *err;
    const char *name;
    int16_t inv[324];
    char *tmp;          /* scratch for byte-decoded strings */
    const cJSON **ktab; /* vocabulary keys as written (for added tokens' ids) */
    uint32_t kmask;
    size_t tmp_cap;
} loader;

static int lerr(loader *L, int code, const char *fmt, const char *a, const char *b) {
    char m[700];
    snprintf(m, sizeof m, fmt, a, b);
    return pt_err(L->err, code, "%s: %s", L->name, m);
}

/* Converts a byte-level vocabulary string to the bytes it stands for (into L->tmp). */
static int bl_decode(loader *L, const char *s, size_t *out_len) {
    size_t n = strlen(s);
    if (n + 1 > L->tmp_cap) {
        size_t c = n + 64;
        char *p = realloc(L->tmp, c);
        if (!p) return pt_err(L->err, PETREL_ENOMEM, "out of memory");
        L->tmp = p;
        L->tmp_cap = c;
    }
    size_t o = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = utf8_dec(u + i, n - i, &cp);
        if (cp < 324 && L->inv[cp] >= 0) L->tmp[o++] = (char)L->inv[cp];
        else { memcpy(L->tmp + o, u + i, (size_t)k); o += (size_t)k; }
        i += (size_t)k;
    }
    *out_len = o;
    return 0;
}

static int arena_add(tokenizer *t, const char *s, size_t n, uint32_t *off, petrel_error *err) {
    if (!t->arena || t->arena_len + n > t->arena_cap) { /* allocated even for an empty token: offsets index it */
        size_t c = t->arena_cap ? t->arena_cap * 2 : 1 << 16;
        while (c < t->arena_len + n) c *= 2;
        if (c > UINT32_MAX) return pt_err(err, PETREL_ENOMEM, "tokenizer: token bytes exceed 4 GiB");
        char *p = realloc(t->arena, c);
        if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory");
        t->arena = p;
        t->arena_cap = c;
    }
    if (n) memcpy(t->arena + t->arena_len, s, n);
    *off = (uint32_t)t->arena_len;
    t->arena_len += n;
    return 0;
}

int32_t tok_vocab_lookup(const tokenizer *t, const char *s, size_t len) {
    if (!t->vtab) return -1;
    uint32_t h = (uint32_t)XXH3_64bits(s, len) & t->vmask;
    for (;;) {
        const tok_vslot *e = &t->vtab[h];
        if (e->id < 0) return -1;
        if (e->len == len && !memcmp(t->arena + e->off, s, len)) return e->id;
        h = (h + 1) & t->vmask;
    }
}

static void vocab_insert(tokenizer *t, uint32_t off, uint32_t len, int32_t id) {
    uint32_t h = (uint32_t)XXH3_64bits(t->arena + off, len) & t->vmask;
    for (;;) {
        tok_vslot *e = &t->vtab[h];
        if (e->id < 0) { e->off = off; e->len = len; e->id = id; return; }
        if (e->len == len && !memcmp(t->arena + e->off, t->arena + off, len)) return; /* keep first */
        h = (h + 1) & t->vmask;
    }
}

/* The id of the vocabulary entry whose key is exactly the string s, or -1 (through L->ktab, a
 * temporary hash of the JSON keys, filled while the vocabulary is read). */
static int32_t vocab_string_id(loader *L, const char *s) {
    size_t n = strlen(s);
    uint32_t h = (uint32_t)XXH3_64bits(s, n) & L->kmask;
    for (;;) {
        const cJSON *e = L->ktab[h];
        if (!e) return -1;
        if (!strcmp(e->string, s)) return (int32_t)e->valuedouble;
        h = (h + 1) & L->kmask;
    }
}

static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL; k ^= k >> 33;
    return k;
}

static void merge_insert(tokenizer *t, uint64_t key, int32_t rank, int32_t id) {
    uint64_t h = mix64(key) & t->mmask;
    for (;;) {
        tok_mslot *e = &t->mtab[h];
        if (e->id < 0) { e->key = key; e->rank = rank; e->id = id; return; }
        if (e->key == key) return; /* keep the lower rank */
        h = (h + 1) & t->mmask;
    }
}

static int get_bool(loader *L, const cJSON *o, const char *field, const char *path, int dflt,
                    int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, field);
    if (!v || cJSON_IsNull(v)) { *out = dflt; return 0; }
    if (!cJSON_IsBool(v)) return lerr(L, PETREL_EFORMAT, "field \"%s.%s\" is not a boolean", path, field);
    *out = cJSON_IsTrue(v);
    return 0;
}

static int compile_re(loader *L, const char *pat, int literal, const char *path, pcre2_code **out) {
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opts, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        char m[400];
        snprintf(m, sizeof m, "at pattern offset %zu: %s", (size_t)eo, (const char *)msg);
        return lerr(L, PETREL_EUNSUPPORTED, "regex of \"%s\" does not compile %s", path, m);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    *out = re;
    return 0;
}

/* A {"Regex": ...} or {"String": ...} pattern object. */
static int parse_pattern(loader *L, const cJSON *o, const char *path, pcre2_code **out) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "pattern");
    char f[200];
    snprintf(f, sizeof f, "%s.pattern", path);
    if (!p) return lerr(L, PETREL_EFORMAT, "missing field \"%s\"%s", f, "");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(p, "Regex");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(p, "String");
    if (cJSON_IsString(r)) return compile_re(L, r->valuestring, 0, f, out);
    if (cJSON_IsString(s)) return compile_re(L, s->valuestring, 1, f, out);
    if (cJSON_IsString(p)) return compile_re(L, p->valuestring, 1, f, out);
    return lerr(L, PETREL_EFORMAT, "field \"%s\" is not {\"Regex\": ...} or {\"String\": ...}%s", f, "");
}

/* The common front of a normalizer or pre-tokenizer entry: checks the object, the nesting depth
 * and its "type"; a "Sequence" recurses into seq_field with fn. Returns 1 when the entry was a
 * Sequence (all done), 0 with *type set otherwise, or a negative error. */
typedef int (*step_fn)(loader *L, const cJSON *o, const char *path, int depth);
static int step_front(loader *L, const cJSON *o, const char *path, int depth, const char *seq_field, step_fn fn,
                      const char **type) {
    if (!cJSON_IsObject(o)) return lerr(L, PETREL_EFORMAT, "field \"%s\" is not an object%s", path, "");
    if (depth > 8) return lerr(L, PETREL_EUNSUPPORTED, "field \"%s\" nests Sequences too deeply%s", path, "");
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
    if (!cJSON_IsString(ty)) return lerr(L, PETREL_EFORMAT, "missing field \"%s.type\"%s", path, "");
    *type = ty->valuestring;
    if (strcmp(*type, "Sequence")) return 0;
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, seq_field);
    if (!cJSON_IsArray(a)) return lerr(L, PETREL_EFORMAT, "missing field \"%s.%s\"", path, seq_field);
    int i = 0;
    const cJSON *e;
    char sub[200];
    cJSON_ArrayForEach(e, a) {
        snprintf(sub, sizeof sub, "%s.%s[%d]", path, seq_field, i++);
        PT_TRY(fn(L, e, sub, depth + 1));
    }
    return 1;
}

static int parse_normalizer(loader *L, const cJSON *o, const char *path, int depth) {
    tokenizer *t = L->t;
    if (!o || cJSON_IsNull(o)) return 0;
    const char *s;
    int fr = step_front(L, o, path, depth, "normalizers", parse_normalizer, &s);
    if (fr) return fr < 0 ? fr : 0;
    if (t->n_norm >= TOK_MAX_STEPS) return lerr(L, PETREL_EUNSUPPORTED, "too many normalizer steps in \"%s\"%s", path, "");
    tok_norm *n = &t->norm[t->n_norm];
    memset(n, 0, sizeof *n);
    if (!strcmp(s, "NFC")) n->kind = NORM_NFC;
    else if (!strcmp(s, "NFD")) n->kind = NORM_NFD;
    else if (!strcmp(s, "NFKC")) n->kind = NORM_NFKC;
    else if (!strcmp(s, "NFKD")) n->kind = NORM_NFKD;
    else if (!strcmp(s, "Lowercase")) n->kind = NORM_LOWER;
    else if (!strcmp(s, "Replace") || !strcmp(s, "Prepend")) {
        int rep = s[0] == 'R';
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(o, rep ? "content" : "prepend");
        if (!cJSON_IsString(c))
            return lerr(L, PETREL_EFORMAT, "missing field \"%s.%s\"", path, rep ? "content" : "prepend");
        if (tok_utf8_invalid_at((const unsigned char *)c->valuestring, strlen(c->valuestring)) >= 0)
            return lerr(L, PETREL_EFORMAT, "field \"%s.%s\" is not valid UTF-8", path, rep ? "content" : "prepend");
        n->kind = rep ? NORM_REPLACE : NORM_PREPEND;
        n->str = strdup(c->valuestring);
        if (!n->str) return pt_err(L->err, PETREL_ENOMEM, "out of memory");
        n->str_len = strlen(n->str);
        t->n_norm++;
        if (rep) PT_TRY(parse_pattern(L, o, path, &n->re));
        return 0;
    } else return lerr(L, PETREL_EUNSUPPORTED, "unsupported normalizer type \"%s\" (field \"%s.type\")", s, path);
    t->n_norm++;
    return 0;
}

static const char *GPT2_RE =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int parse_pre(loader *L, const cJSON *o, const char *path, int depth) {
    tokenizer *t = L->t;
    if (!o || cJSON_IsNull(o)) return 0;
    const char *s;
    int fr = step_front(L, o, path, depth, "pretokenizers", parse_pre, &s);
    if (fr) return fr < 0 ? fr : 0;
    if (t->n_pre >= TOK_MAX_STEPS) return lerr(L, PETREL_EUNSUPPORTED, "too many pre-tokenizer steps in \"%s\"%s", path, "");
    tok_pre *p = &t->pre[t->n_pre];
    memset(p, 0, sizeof *p);
    if (!strcmp(s, "ByteLevel")) {
        int use_re;
        p->kind = PRE_BYTELEVEL;
        PT_TRY(get_bool(L, o, "add_prefix_space", path, 1, &p->add_prefix_space));
        PT_TRY(get_bool(L, o, "use_regex", path, 1, &use_re));
        p->behavior = SPLIT_ISOLATED;
        t->n_pre++;
        if (use_re) PT_TRY(compile_re(L, GPT2_RE, 0, path, &p->re));
        return 0;
    }
    if (!strcmp(s, "Split")) {
        p->kind = PRE_SPLIT;
        PT_TRY(get_bool(L, o, "invert", path, 0, &p->invert));
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "behavior");
        if (!cJSON_IsString(b)) return lerr(L, PETREL_EFORMAT, "missing field \"%s.behavior\"%s", path, "");
        const char *bs = b->valuestring;
        if (!strcmp(bs, "Removed")) p->behavior = SPLIT_REMOVED;
        else if (!strcmp(bs, "Isolated")) p->behavior = SPLIT_ISOLATED;
        else if (!strcmp(bs, "MergedWithPrevious")) p->behavior = SPLIT_MERGED_PREV;
        else if (!strcmp(bs, "MergedWithNext")) p->behavior = SPLIT_MERGED_NEXT;
        else if (!strcmp(bs, "Contiguous")) p->behavior = SPLIT_CONTIGUOUS;
        else return lerr(L, PETREL_EUNSUPPORTED, "unsupported Split behavior \"%s\" (field \"%s.behavior\")", bs, path);
        t->n_pre++;
        return parse_pattern(L, o, path, &p->re);
    }
    if (!strcmp(s, "Digits")) {
        int indiv;
        PT_TRY(get_bool(L, o, "individual_digits", path, 0, &indiv));
        p->kind = PRE_SPLIT;
        p->behavior = indiv ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS;
        t->n_pre++;
        return compile_re(L, "\\p{N}", 0, path, &p->re);
    }
    return lerr(L, PETREL_EUNSUPPORTED, "unsupported pre_tokenizer type \"%s\" (field \"%s.type\")", s, path);
}

static int check_decoder(loader *L, const cJSON *o, const char *path, int depth) {
    if (!o || cJSON_IsNull(o)) return 0;
    if (!cJSON_IsObject(o)) return lerr(L, PETREL_EFORMAT, "field \"%s\" is not an object%s", path, "");
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
    if (!cJSON_IsString(ty)) return lerr(L, PETREL_EFORMAT, "missing field \"%s.type\"%s", path, "");
    if (!strcmp(ty->valuestring, "ByteLevel")) return 0;
    if (!strcmp(ty->valuestring, "Sequence") && depth < 8) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "decoders");
        if (!cJSON_IsArray(a)) return lerr(L, PETREL_EFORMAT, "missing field \"%s.decoders\"%s", path, "");
        int i = 0;
        const cJSON *e;
        char sub[200];
        cJSON_ArrayForEach(e, a) {
            snprintf(sub, sizeof sub, "%s.decoders[%d]", path, i++);
            PT_TRY(check_decoder(L, e, sub, depth + 1));
        }
        return 0;
    }
    return lerr(L, PETREL_EUNSUPPORTED, "unsupported decoder type \"%s\" (field \"%s.type\")", ty->valuestring, path);
}

static int get_id(loader *L, const cJSON *v, const char *what, const char *path, int32_t *out) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= TOK_MAX_ID ||
        v->valuedouble != (double)(int32_t)v->valuedouble)
        return lerr(L, PETREL_EFORMAT, "field \"%s\" of \"%s\" is not a token id (an integer in 0..16777215)", path, what);
    *out = (int32_t)v->valuedouble;
    return 0;
}

static int added_cmp_ctx_len(const tokenizer *t, int32_t a, int32_t b) {
    size_t la = t->added[a].len, lb = t->added[b].len;
    if (la != lb) return la > lb ? -1 : 1;
    return a < b ? -1 : (a > b);
}
/* Buckets the added tokens of one class by first byte, longest first (insertion sort: few). */
static int build_set(tokenizer *t, tok_added_set *set, int normalized, petrel_error *err) {
    int n = 0;
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len && t->added[i].normalized == normalized) n++;
    set->order = malloc(((size_t)n + 1) * sizeof *set->order);
    if (!set->order) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int32_t count[257] = {0};
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len && t->added[i].normalized == normalized)
            count[(unsigned char)t->added[i].content[0] + 1]++;
    for (int b = 0; b < 256; b++) count[b + 1] += count[b];
    memcpy(set->start, count, sizeof count);
    int32_t fill[256];
    memcpy(fill, count, sizeof fill);
    for (int i = 0; i < t->n_added; i++) {
        if (!t->added[i].len || t->added[i].normalized != normalized) continue;
        unsigned char b = (unsigned char)t->added[i].content[0];
        int32_t j = fill[b]++;
        /* insert keeping longest first within the bucket */
        while (j > set->start[b] && added_cmp_ctx_len(t, i, set->order[j - 1]) < 0) {
            set->order[j] = set->order[j - 1];
            j--;
        }
        set->order[j] = i;
    }
    return 0;
}

static int load_json(loader *L, const cJSON *root) {
    tokenizer *t = L->t;
    petrel_error *err = L->err;
    if (!cJSON_IsObject(root)) return lerr(L, PETREL_EFORMAT, "top level is not a JSON object%s%s", "", "");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) return lerr(L, PETREL_EFORMAT, "missing field \"model\"%s%s", "", "");
    const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (mtype && !cJSON_IsString(mtype)) return lerr(L, PETREL_EFORMAT, "field \"model.type\" is not a string%s%s", "", "");
    if (mtype && strcmp(mtype->valuestring, "BPE"))
        return lerr(L, PETREL_EUNSUPPORTED, "unsupported model type \"%s\" (field \"model.type\"; only BPE)%s", mtype->valuestring, "");
    if (!mtype && !merges) return lerr(L, PETREL_EFORMAT, "missing field \"model.type\"%s%s", "", "");
    if (!cJSON_IsObject(vocab)) return lerr(L, PETREL_EFORMAT, "missing field \"model.vocab\" (an object)%s%s", "", "");
    if (!cJSON_IsArray(merges)) return lerr(L, PETREL_EFORMAT, "missing field \"model.merges\" (an array)%s%s", "", "");
    PT_TRY(get_bool(L, model, "ignore_merges", "model", 0, &t->ignore_merges));
    PT_TRY(get_bool(L, model, "fuse_unk", "model", 0, &t->fuse_unk));
    int byte_fallback;
    PT_TRY(get_bool(L, model, "byte_fallback", "model", 0, &byte_fallback));
    if (byte_fallback) return lerr(L, PETREL_EUNSUPPORTED, "unsupported \"model.byte_fallback\": true (sentencepiece-style BPE)%s%s", "", "");
    static const char *affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(model, affix[i]);
        if (a && !cJSON_IsNull(a) && !(cJSON_IsString(a) && !a->valuestring[0]))
            return lerr(L, PETREL_EUNSUPPORTED, "unsupported \"model.%s\" (only empty or null)%s", affix[i], "");
    }

    /* vocabulary ids */
    int32_t max_id = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        int32_t id = 0;
        PT_TRY(get_id(L, e, e->string, "model.vocab", &id));
        if (id > max_id) max_id = id;
    }
    /* vocabulary hash; id -> bytes into temporary arrays until the added tokens' ids are known */
    int nv = cJSON_GetArraySize(vocab);
    uint32_t vs = 16;
    while (vs < (uint32_t)nv * 2u + 16) vs *= 2;
    t->vtab = malloc(vs * sizeof *t->vtab);
    L->ktab = calloc(vs, sizeof *L->ktab);
    L->kmask = vs - 1;
    t->n_ids = max_id + 1;
    t->tok_off = calloc((size_t)t->n_ids + 1, sizeof *t->tok_off);
    t->tok_len = malloc(((size_t)t->n_ids + 1) * sizeof *t->tok_len);
    if (!t->vtab || !L->ktab || !t->tok_off || !t->tok_len) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < vs; i++) t->vtab[i].id = -1;
    for (int32_t i = 0; i <= t->n_ids; i++) t->tok_len[i] = -1;
    t->vmask = vs - 1;
    cJSON_ArrayForEach(e, vocab) {
        int32_t id = (int32_t)e->valuedouble;
        size_t n = 0;
        uint32_t off;
        PT_TRY(bl_decode(L, e->string, &n));
        PT_TRY(arena_add(t, L->tmp, n, &off, err));
        vocab_insert(t, off, (uint32_t)n, id);
        uint32_t h = (uint32_t)XXH3_64bits(e->string, strlen(e->string)) & L->kmask;
        while (L->ktab[h]) h = (h + 1) & L->kmask;
        L->ktab[h] = e;
        t->tok_off[id] = off;
        t->tok_len[id] = (int32_t)n;
    }

    /* added tokens, with ids given as Hugging Face gives them: the vocabulary's id when the
     * content is a vocabulary entry, else the next id after the vocabulary and the added tokens
     * so far (the "id" field must be present but does not decide) */
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return lerr(L, PETREL_EFORMAT, "field \"added_tokens\" is not an array%s%s", "", "");
    int n_added = added && cJSON_IsArray(added) ? cJSON_GetArraySize(added) : 0;
    if (n_added) {
        t->added = calloc((size_t)n_added, sizeof *t->added);
        if (!t->added) return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    int ai = 0, idx = -1;
    int32_t max_added = -1;
    if (n_added) cJSON_ArrayForEach(e, added) {
        char path[64];
        snprintf(path, sizeof path, "added_tokens[%d]", ++idx);
        if (!cJSON_IsObject(e)) return lerr(L, PETREL_EFORMAT, "field \"%s\" is not an object%s", path, "");
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsString(c)) return lerr(L, PETREL_EFORMAT, "missing field \"%s.content\"%s", path, "");
        tok_added *a = &t->added[ai];
        char idpath[80];
        int32_t json_id;
        snprintf(idpath, sizeof idpath, "%s.id", path);
        PT_TRY(get_id(L, cJSON_GetObjectItemCaseSensitive(e, "id"), c->valuestring, idpath, &json_id));
        int sp, sw, ls, rs, no;
        PT_TRY(get_bool(L, e, "special", path, 0, &sp));
        PT_TRY(get_bool(L, e, "single_word", path, 0, &sw));
        PT_TRY(get_bool(L, e, "lstrip", path, 0, &ls));
        PT_TRY(get_bool(L, e, "rstrip", path, 0, &rs));
        PT_TRY(get_bool(L, e, "normalized", path, !sp, &no));
        size_t clen = strlen(c->valuestring);
        if (tok_utf8_invalid_at((const unsigned char *)c->valuestring, clen) >= 0)
            return lerr(L, PETREL_EFORMAT, "field \"%s.content\" is not valid UTF-8%s", path, "");
        int dup = 0;
        for (int j = 0; j < ai && !dup; j++)
            dup = t->added[j].len == clen && !memcmp(t->added[j].content, c->valuestring, clen);
        if (dup) continue; /* the first definition wins */
        a->special = (uint8_t)sp; a->single_word = (uint8_t)sw; a->lstrip = (uint8_t)ls;
        a->rstrip = (uint8_t)rs; a->normalized = (uint8_t)no;
        a->len = clen;
        a->content = malloc(a->len + 1);
        if (!a->content) return pt_err(err, PETREL_ENOMEM, "out of memory");
        memcpy(a->content, c->valuestring, a->len + 1);
        a->id = vocab_string_id(L, a->content);
        if (a->id < 0)
            a->id = max_added < 0 ? nv : (max_added >= nv || nv == 0) ? max_added + 1 : nv;
        if (a->id >= TOK_MAX_ID) return lerr(L, PETREL_EFORMAT, "field \"%s\": too many ids%s", path, "");
        if (a->id > max_added) max_added = a->id;
        ai++;
        t->n_added = ai;
    }
    if (max_added > max_id) {
        int32_t old = t->n_ids;
        t->n_ids = max_added + 1;
        uint32_t *o2 = realloc(t->tok_off, ((size_t)t->n_ids + 1) * sizeof *o2);
        if (o2) t->tok_off = o2;
        int32_t *l2 = realloc(t->tok_len, ((size_t)t->n_ids + 1) * sizeof *l2);
        if (l2) t->tok_len = l2;
        if (!o2 || !l2) return pt_err(err, PETREL_ENOMEM, "out of memory");
        for (int32_t i = old + 1; i <= t->n_ids; i++) t->tok_len[i] = -1;
    }
    t->is_special = calloc((size_t)t->n_ids + 1, 1);
    if (!t->is_special) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_id[b] = tok_vocab_lookup(t, &c, 1);
    }
    t->unk_id = -1;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (cJSON_IsString(unk)) {
        size_t n;
        PT_TRY(bl_decode(L, unk->valuestring, &n));
        t->unk_id = tok_vocab_lookup(t, L->tmp, n);
        if (t->unk_id < 0) return lerr(L, PETREL_EFORMAT, "field \"model.unk_token\" names \"%.100s\", which is not in model.vocab%s", unk->valuestring, "");
    }

    /* merges */
    int nm = cJSON_GetArraySize(merges);
    uint64_t ms = 16;
    while (ms < (uint64_t)nm * 2 + 16) ms *= 2;
    t->mtab = malloc(ms * sizeof *t->mtab);
    if (!t->mtab) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < ms; i++) t->mtab[i].id = -1;
    t->mmask = ms - 1;
    int rank = 0;
    char *cat = NULL;
    size_t cat_cap = 0;
    cJSON_ArrayForEach(e, merges) {
        char path[64];
        snprintf(path, sizeof path, "model.merges[%d]", rank);
        const char *a = NULL, *b = NULL;
        char *split = NULL;
        if (cJSON_IsString(e)) {
            const char *sp = strchr(e->valuestring, ' ');
            if (!sp || sp == e->valuestring || !sp[1] || strchr(sp + 1, ' ')) {
                free(cat);
                return lerr(L, PETREL_EFORMAT, "field \"%s\" is not two tokens separated by one space (\"%.80s\")", path, e->valuestring);
            }
            split = strdup(e->valuestring);
            if (!split) { free(cat); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
            split[sp - e->valuestring] = 0;
            a = split;
            b = split + (sp - e->valuestring) + 1;
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 0)) && cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            a = cJSON_GetArrayItem(e, 0)->valuestring;
            b = cJSON_GetArrayItem(e, 1)->valuestring;
        } else {
            free(cat);
            return lerr(L, PETREL_EFORMAT, "field \"%s\" is not a string \"a b\" or a pair [\"a\", \"b\"]%s", path, "");
        }
        int32_t ia = -1, ib = -1, iab = -1;
        const char *missing = NULL;
        size_t la, lb;
        int rc = bl_decode(L, a, &la);
        if (rc == 0 && (ia = tok_vocab_lookup(t, L->tmp, la)) < 0) missing = a;
        if (rc == 0 && !missing && la + 1 > cat_cap) {
            cat_cap = (la + 1) * 2 + 64;
            char *p = realloc(cat, cat_cap);
            if (!p) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
            else cat = p;
        }
        if (rc == 0 && !missing) {
            memcpy(cat, L->tmp, la);
            rc = bl_decode(L, b, &lb);
        }
        if (rc == 0 && !missing && (ib = tok_vocab_lookup(t, L->tmp, lb)) < 0) missing = b;
        if (rc == 0 && !missing && la + lb > cat_cap) {
            cat_cap = (la + lb) * 2 + 64;
            char *p = realloc(cat, cat_cap);
            if (!p) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
            else cat = p;
        }
        if (rc == 0 && !missing) {
            memcpy(cat + la, L->tmp, lb);
            if ((iab = tok_vocab_lookup(t, cat, la + lb)) < 0) missing = "";
        }
        if (rc == 0 && missing) {
            char both[200];
            if (!missing[0]) snprintf(both, sizeof both, "%.90s%.90s", a, b);
            rc = lerr(L, PETREL_EFORMAT, "field \"%s\": token \"%.100s\" is not in model.vocab", path, missing[0] ? missing : both);
        }
        if (rc < 0) {
            free(split);
            free(cat);
            return rc;
        }
        merge_insert(t, ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib, rank, iab);
        free(split);
        rank++;
    }
    free(cat);

    /* added tokens: decode bytes are their content */
    for (int i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        uint32_t off;
        PT_TRY(arena_add(t, a->content, a->len, &off, err));
        t->tok_off[a->id] = off;
        t->tok_len[a->id] = (int32_t)a->len;
        t->is_special[a->id] = a->special;
    }

    PT_TRY(parse_normalizer(L, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), "normalizer", 0));
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    if (!pre || cJSON_IsNull(pre))
        return lerr(L, PETREL_EUNSUPPORTED, "field \"pre_tokenizer\" is null or missing: only byte-level BPE (a ByteLevel pre-tokenizer) is supported%s%s", "", "");
    PT_TRY(parse_pre(L, pre, "pre_tokenizer", 0));
    int has_bl = 0;
    for (int i = 0; i < t->n_pre; i++) has_bl |= t->pre[i].kind == PRE_BYTELEVEL;
    for (int i = 0; i < t->n_pre; i++) {
        size_t jsz = 0;
        if (t->pre[i].re && pcre2_pattern_info(t->pre[i].re, PCRE2_INFO_JITSIZE, &jsz) == 0)
            t->pre[i].jit = jsz > 0;
    }
    if (!has_bl)
        return lerr(L, PETREL_EUNSUPPORTED, "field \"pre_tokenizer\" has no ByteLevel step: only byte-level BPE is supported%s%s", "", "");
    PT_TRY(check_decoder(L, cJSON_GetObjectItemCaseSensitive(root, "decoder"), "decoder", 0));

    /* normalized added tokens are matched against normalized text: normalize their content */
    for (int i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        if (!a->normalized || !t->n_norm) continue;
        char *o;
        size_t ol;
        int owned;
        PT_TRY(tok_normalize(t, a->content, a->len, &o, &ol, &owned, err));
        if (owned) {
            free(a->content);
            a->content = o;
            a->len = ol;
        }
    }
    PT_TRY(build_set(t, &t->set_raw, 0, err));
    PT_TRY(build_set(t, &t->set_norm, 1, err));
    return 0;
}

int tok_load_json(const char *json, size_t len, const char *name, tokenizer **out,
                  petrel_error *err) {
    *out = NULL;
    loader L = {.err = err, .name = name ? name : "tokenizer.json"};
    bytelevel_inverse(L.inv);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) {
        const char *ep = cJSON_GetErrorPtr();
        long off = ep && ep >= json && ep <= json + len ? (long)(ep - json) : -1;
        return pt_err(err, PETREL_EFORMAT, "%s: not valid JSON (near byte %ld)", L.name, off);
    }
    L.t = calloc(1, sizeof *L.t);
    if (!L.t) { cJSON_Delete(root); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
    int rc = load_json(&L, root);
    cJSON_Delete(root);
    free(L.tmp);
    free(L.ktab);
    if (rc < 0) { tok_free(L.t); return rc; }
    *out = L.t;
    return 0;
}

int tok_load(const char *path, tokenizer **out, petrel_error *err) {
    *out = NULL;
    char *buf;
    size_t n;
    PT_TRY(pt_read_file(path, (size_t)1 << 31, &buf, &n, err));
    int rc = tok_load_json(buf, n, path, out, err);
    free(buf);
    return rc;
}

void tok_free(tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_norm; i++) {
        pcre2_code_free(t->norm[i].re);
        free(t->norm[i].str);
    }
    for (int i = 0; i < t->n_pre; i++) pcre2_code_free(t->pre[i].re);
    for (int i = 0; i < t->n_added; i++) free(t->added[i].content);
    free(t->added);
    free(t->set_raw.order);
    free(t->set_norm.order);
    free(t->tok_off);
    free(t->tok_len);
    free(t->is_special);
    free(t->arena);
    free(t->vtab);
    free(t->mtab);
    free(t);
}
