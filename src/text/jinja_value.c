/* jinja_value.c: the Jinja interpreter's memory and values: a bump arena with a byte budget,
 * the error exit (longjmp), growable buffers, runtime values (JavaScript numbers, strings,
 * arrays, ordered objects), UTF-8 helpers, JavaScript number formatting and the JSON writer
 * behind the tojson filter, and the conversion of cJSON input into values. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja_internal.h"

/* ---------------- arena ---------------- */
struct jarena_chunk {
    jarena_chunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
};

void jarena_init(jarena *a, size_t cap) {
    memset(a, 0, sizeof *a);
    a->cap = cap;
}

void jarena_free(jarena *a) {
    jarena_chunk *c = a->head;
    while (c) {
        jarena_chunk *n = c->next;
        free(c);
        c = n;
    }
    a->head = NULL;
    a->used_total = 0;
    a->last = NULL;
}

static void *arena_get(jarena *a, size_t n, int zero);
void *jarena_alloc(jarena *a, size_t n) { return arena_get(a, n, 1); }
void *jarena_alloc_raw(jarena *a, size_t n) { return arena_get(a, n, 0); }

static void *arena_get(jarena *a, size_t n, int zero) {
    if (n > ((size_t)1 << 40)) return NULL;
    size_t need = (n + 15) & ~(size_t)15;
    if (need == 0) need = 16;
    jarena_chunk *c = a->head;
    if (!c || c->size - c->used < need) {
        size_t sz = need > 65536 ? need : 65536;
        if (c && c->size * 2 > sz && c->size < ((size_t)16 << 20)) sz = c->size * 2 > need ? c->size * 2 : need;
        if (a->cap && a->used_total + sz > a->cap) {
            if (a->used_total + need > a->cap) return NULL;
            sz = need;
        }
        jarena_chunk *nc = malloc(sizeof *nc + sz);
        if (!nc) return NULL;
        nc->next = c;
        nc->size = sz;
        nc->used = 0;
        a->head = nc;
        a->used_total += sz;
        c = nc;
    }
    void *p = c->data + c->used;
    c->used += need;
    if (zero) memset(p, 0, n);
    a->last = p;
    a->last_size = need;
    return p;
}

void *jarena_grow(jarena *a, void *p, size_t old, size_t n) {
    if (n <= old) return p;
    jarena_chunk *c = a->head;
    if (p && p == a->last && c && (unsigned char *)p + a->last_size == c->data + c->used) {
        size_t need = (n + 15) & ~(size_t)15;
        size_t start = (size_t)((unsigned char *)p - c->data);
        if (start + need <= c->size) {
            c->used = start + need;
            a->last_size = need;
            return p;
        }
    }
    void *q = jarena_alloc_raw(a, n);
    if (!q) return NULL;
    if (p && old) memcpy(q, p, old);
    return q;
}

_Noreturn void jfail_throw(jfail *f, int code, int line, const char *fmt, ...) {
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* Keep the message one line. */
    for (char *p = msg; *p; p++)
        if (*p == '\n' || *p == '\r') *p = ' ';
    if (line > 0)
        pt_err(f->err, code, "template line %d: %s", line, msg);
    else
        pt_err(f->err, code, "template: %s", msg);
    longjmp(f->env, 1);
}

void *jalloc(jarena *a, jfail *f, size_t n) {
    void *p = jarena_alloc(a, n);
    if (!p) jfail_throw(f, PETREL_ENOMEM, 0, "out of memory (template working-memory budget exceeded)");
    return p;
}

/* ---------------- buffers ---------------- */
void jbuf_init(jbuf *b, jarena *a, jfail *f, size_t max) {
    b->a = a;
    b->f = f;
    b->p = NULL;
    b->len = b->cap = 0;
    b->max = max;
}

void jbuf_put(jbuf *b, const char *s, size_t n) {
    if (!n) return;
    if (b->max && b->len + n > b->max)
        jfail_throw(b->f, PETREL_ERANGE, 0, "output exceeds the limit of %zu bytes", b->max);
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *np = jarena_grow(b->a, b->p, b->cap, nc);
        if (!np) jfail_throw(b->f, PETREL_ENOMEM, 0, "out of memory (template working-memory budget exceeded)");
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}
void jbuf_puts(jbuf *b, const char *s) { jbuf_put(b, s, strlen(s)); }
void jbuf_putc(jbuf *b, char c) { jbuf_put(b, &c, 1); }

/* ---------------- values ---------------- */
jstr *jstr_new(jarena *a, jfail *f, const char *s, size_t n) {
    jstr *r = jarena_alloc_raw(a, sizeof(jstr) + n + 1);
    if (!r) jfail_throw(f, PETREL_ENOMEM, 0, "out of memory (template working-memory budget exceeded)");
    char *d = (char *)(r + 1);
    r->len = n;
    if (n) memcpy(d, s, n);
    d[n] = 0;
    r->s = d;
    return r;
}

jv jv_str(jarena *a, jfail *f, const char *s, size_t n) {
    jv v = {.t = JV_STR};
    v.u.s = jstr_new(a, f, s, n);
    return v;
}

jv jv_num(double n, int is_int) {
    jv v = {.t = (uint8_t)(is_int ? JV_INT : JV_FLOAT)};
    v.u.n = n;
    return v;
}

jv jv_bool(int b) {
    jv v = {.t = JV_BOOL};
    v.u.b = !!b;
    return v;
}

jv jv_array(jarena *a, jfail *f, size_t cap) {
    jv v = {.t = JV_ARRAY};
    v.u.a = jalloc(a, f, sizeof(jarr));
    if (cap) {
        v.u.a->v = jalloc(a, f, cap * sizeof(jv));
        v.u.a->cap = cap;
    }
    return v;
}

jv jv_object(jarena *a, jfail *f, int ns) {
    jv v = {.t = (uint8_t)(ns ? JV_NS : JV_OBJECT)};
    v.u.o = jalloc(a, f, sizeof(jobj));
    return v;
}

void jarr_push(jarena *a, jfail *f, jarr *arr, jv v) {
    if (arr->n == arr->cap) {
        size_t nc = arr->cap ? arr->cap * 2 : 4;
        jv *nv = jarena_grow(a, arr->v, arr->cap * sizeof(jv), nc * sizeof(jv));
        if (!nv) jfail_throw(f, PETREL_ENOMEM, 0, "out of memory (template working-memory budget exceeded)");
        arr->v = nv;
        arr->cap = nc;
    }
    arr->v[arr->n++] = v;
}

jv *jobj_get(const jobj *o, const char *k, size_t klen) {
    for (size_t i = 0; i < o->n; i++)
        if (o->k[i]->len == klen && !memcmp(o->k[i]->s, k, klen)) return &o->v[i];
    return NULL;
}

void jobj_set(jarena *a, jfail *f, jobj *o, const char *k, size_t klen, jv v) { jobj_set_key(a, f, o, k, klen, NULL, v); }

void jobj_set_key(jarena *a, jfail *f, jobj *o, const char *k, size_t klen, jstr *key, jv v) {
    jv *p = jobj_get(o, k, klen);
    if (p) {
        *p = v;
        return;
    }
    if (o->n == o->cap) {
        size_t nc = o->cap ? o->cap * 2 : 4;
        jstr **nk = jarena_grow(a, o->k, o->cap * sizeof(jstr *), nc * sizeof(jstr *));
        jv *nv = nk ? jarena_grow(a, o->v, o->cap * sizeof(jv), nc * sizeof(jv)) : NULL;
        if (!nk || !nv) jfail_throw(f, PETREL_ENOMEM, 0, "out of memory (template working-memory budget exceeded)");
        o->k = nk;
        o->v = nv;
        o->cap = nc;
    }
    o->k[o->n] = key ? key : jstr_new(a, f, k, klen);
    o->v[o->n] = v;
    o->n++;
}

/* ---------------- UTF-8 ---------------- */
uint32_t utf8_dec(const char *s, size_t len, size_t i, size_t *clen) {
    const unsigned char *u = (const unsigned char *)s;
    unsigned c = u[i];
    if (c < 0x80) { *clen = 1; return c; }
    int n = c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 0;
    if (c >= 0xF8) n = 0;
    if (!n || i + (size_t)n > len) { *clen = 1; return c; }
    uint32_t cp = c & (0x7F >> n);
    for (int k = 1; k < n; k++) {
        if ((u[i + k] & 0xC0) != 0x80) { *clen = 1; return c; }
        cp = (cp << 6) | (u[i + k] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) { *clen = 1; return c; }
    *clen = (size_t)n;
    return cp;
}

size_t utf8_enc(uint32_t cp, char *o) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t utf8_prev(const char *s, size_t end) {
    if (!end) return 0;
    size_t i = end - 1, k = 0;
    while (i > 0 && k < 3 && ((unsigned char)s[i] & 0xC0) == 0x80) { i--; k++; }
    size_t cl;
    utf8_dec(s, end, i, &cl);
    return i + cl == end ? i : end - 1;
}

int js_space(uint32_t c) {
    if (c <= 32) return c == 32 || (c >= 9 && c <= 13);
    return c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF;
}

/* ---------------- numbers ---------------- */
void js_num_str(double d, char *buf) {
    if (isnan(d)) { strcpy(buf, "NaN"); return; }
    if (isinf(d)) { strcpy(buf, d < 0 ? "-Infinity" : "Infinity"); return; }
    if (d == 0) { strcpy(buf, "0"); return; }
    char tmp[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    if (p > 17) snprintf(tmp, sizeof tmp, "%.16e", d);
    /* tmp: [-]d[.ddd]e[+-]xx */
    char digits[24];
    int nd = 0, neg = 0;
    const char *q = tmp;
    if (*q == '-') { neg = 1; q++; }
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9' && nd < 20) digits[nd++] = *q;
    int e = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int n = e + 1, k = nd;
    char *o = buf;
    if (neg) *o++ = '-';
    if (k <= n && n <= 21) {
        memcpy(o, digits, (size_t)k); o += k;
        for (int i = 0; i < n - k; i++) *o++ = '0';
    } else if (0 < n && n <= 21) {
        memcpy(o, digits, (size_t)n); o += n;
        *o++ = '.';
        memcpy(o, digits + n, (size_t)(k - n)); o += k - n;
    } else if (-6 < n && n <= 0) {
        *o++ = '0'; *o++ = '.';
        for (int i = 0; i < -n; i++) *o++ = '0';
        memcpy(o, digits, (size_t)k); o += k;
    } else {
        *o++ = digits[0];
        if (k > 1) { *o++ = '.'; memcpy(o, digits + 1, (size_t)(k - 1)); o += k - 1; }
        o += sprintf(o, "e%c%d", n - 1 >= 0 ? '+' : '-', abs(n - 1));
    }
    *o = 0;
}

/* ---------------- JSON ---------------- */
static void json_str(jbuf *b, const char *s, size_t len, int ascii) {
    jbuf_putc(b, '"');
    size_t i = 0, run = 0;
    while (i < len) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char e6[16];
        size_t cl = 1;
        if (c == '"') esc = "\\\"";
        else if (c == '\\') esc = "\\\\";
        else if (c == '\n') esc = "\\n";
        else if (c == '\r') esc = "\\r";
        else if (c == '\t') esc = "\\t";
        else if (c == '\b') esc = "\\b";
        else if (c == '\f') esc = "\\f";
        else if (c < 0x20) { snprintf(e6, sizeof e6, "\\u%04x", c); esc = e6; }
        else if (ascii && c >= 0x7F) {
            uint32_t cp = utf8_dec(s, len, i, &cl);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(e6, sizeof e6, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(e6, sizeof e6, "\\u%04x", cp);
            }
            esc = e6;
        }
        if (esc) {
            jbuf_put(b, s + i - run, run);
            run = 0;
            jbuf_puts(b, esc);
            i += cl;
        } else {
            run++;
            i++;
        }
    }
    jbuf_put(b, s + len - run, run);
    jbuf_putc(b, '"');
}

/* An approximation of String.prototype.localeCompare (ICU root collation) for sort_keys:
 * punctuation < digits < letters, letters case-insensitively, lower case first on ties. */
static int coll_class(unsigned char c) {
    if (c >= '0' && c <= '9') return 1;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 2;
    if (c >= 0x80) return 3;
    return 0;
}
static int locale_cmp(const jstr *x, const jstr *y) {
    size_t n = x->len < y->len ? x->len : y->len;
    for (size_t i = 0; i < n; i++) {
        unsigned char a = (unsigned char)x->s[i], b = (unsigned char)y->s[i];
        int ca = coll_class(a), cb = coll_class(b);
        if (ca != cb) return ca - cb;
        int la = (a >= 'A' && a <= 'Z') ? a + 32 : a, lb = (b >= 'A' && b <= 'Z') ? b + 32 : b;
        if (la != lb) return la - lb;
    }
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    for (size_t i = 0; i < n; i++) {
        unsigned char a = (unsigned char)x->s[i], b = (unsigned char)y->s[i];
        if (a != b) return (a >= 'a' && a <= 'z') ? -1 : 1;
    }
    return 0;
}

int jv_to_json(jbuf *b, jv v, const jjson_opts *o, int depth) {
    char nb[40];
    if (depth > 512) return -1;
    switch (v.t) {
    case JV_UNDEF: jbuf_puts(b, o->undef_as_null ? "null" : "undefined"); return 0;
    case JV_NULL: jbuf_puts(b, "null"); return 0;
    case JV_BOOL: jbuf_puts(b, v.u.b ? "true" : "false"); return 0;
    case JV_INT:
    case JV_FLOAT:
        if (!isfinite(v.u.n)) { jbuf_puts(b, "null"); return 0; }
        js_num_str(v.u.n, nb);
        jbuf_puts(b, nb);
        return 0;
    case JV_STR: json_str(b, v.u.s->s, v.u.s->len, o->ensure_ascii); return 0;
    case JV_FUNC: return -1;
    default: break;
    }
    int ind = o->indent > 0 ? o->indent : 0;
    const char *isep = o->item_sep ? o->item_sep : ind ? "," : ", ";
    const char *ksep = o->key_sep ? o->key_sep : ": ";
    /* padding: "\n" + indent * depth (base), + indent (children) */
    #define PAD(d) do { jbuf_putc(b, '\n'); for (int pi_ = 0; pi_ < (d) * ind; pi_++) jbuf_putc(b, ' '); } while (0)
    if (v.t == JV_ARRAY) {
        jarr *a = v.u.a;
        jbuf_putc(b, '[');
        for (size_t i = 0; i < a->n; i++) {
            if (i) jbuf_puts(b, isep);
            if (ind) PAD(depth + 1);
            if (jv_to_json(b, a->v[i], o, depth + 1)) return -1;
        }
        if (ind && a->n) PAD(depth);
        jbuf_putc(b, ']');
        return 0;
    }
    jobj *ob = v.u.o;
    size_t n = ob->n;
    size_t *ord = NULL;
    if (o->sort_keys && n > 1) {
        ord = jalloc(b->a, b->f, n * sizeof *ord);
        for (size_t i = 0; i < n; i++) ord[i] = i;
        for (size_t i = 1; i < n; i++) { /* insertion sort: stable */
            size_t x = ord[i], j = i;
            while (j > 0 && locale_cmp(ob->k[ord[j - 1]], ob->k[x]) > 0) { ord[j] = ord[j - 1]; j--; }
            ord[j] = x;
        }
    }
    jbuf_putc(b, '{');
    for (size_t ii = 0; ii < n; ii++) {
        size_t i = ord ? ord[ii] : ii;
        if (ii) jbuf_puts(b, isep);
        if (ind) PAD(depth + 1);
        json_str(b, ob->k[i]->s, ob->k[i]->len, o->ensure_ascii);
        jbuf_puts(b, ksep);
        if (jv_to_json(b, ob->v[i], o, depth + 1)) return -1;
    }
    if (ind && n) PAD(depth);
    jbuf_putc(b, '}');
    #undef PAD
    return 0;
}

jv jv_from_cjson(jarena *a, jfail *f, const cJSON *j, int depth) {
    jv v = {.t = JV_UNDEF};
    if (!j) return v;
    if (depth > 1000) jfail_throw(f, PETREL_ERANGE, 0, "input JSON nested too deeply");
    if (cJSON_IsNull(j)) { v.t = JV_NULL; return v; }
    if (cJSON_IsTrue(j)) return jv_bool(1);
    if (cJSON_IsFalse(j)) return jv_bool(0);
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        return jv_num(d, isfinite(d) && floor(d) == d);
    }
    if (cJSON_IsString(j) || cJSON_IsRaw(j)) {
        const char *s = j->valuestring ? j->valuestring : "";
        return jv_str(a, f, s, strlen(s));
    }
    if (cJSON_IsArray(j)) {
        v = jv_array(a, f, 0);
        for (const cJSON *c = j->child; c; c = c->next) jarr_push(a, f, v.u.a, jv_from_cjson(a, f, c, depth + 1));
        return v;
    }
    if (cJSON_IsObject(j)) {
        v = jv_object(a, f, 0);
        for (const cJSON *c = j->child; c; c = c->next) {
            const char *k = c->string ? c->string : "";
            jobj_set(a, f, v.u.o, k, strlen(k), jv_from_cjson(a, f, c, depth + 1));
        }
        return v;
    }
    return v;
}
