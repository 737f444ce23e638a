/* jinja_eval.c: rendering a parsed template: scopes, statements, expressions, filters, tests,
 * string/dict/list methods and the global functions. Semantics follow @huggingface/jinja
 * (the renderer of Hugging Face chat templates in JavaScript): JavaScript numbers and loose ==,
 * one scope per for loop (kept across iterations), macros closing over their defining scope,
 * none/undefined printing as "". Filters and methods it lacks follow Python Jinja2.
 * Every render uses one arena; errors longjmp out with the template line. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "text/jinja_internal.h"

struct jinja_template {
    jarena a;
    jnode **body;
    int n_body;
};

/* ---------------- runtime structures ---------------- */
typedef struct scope scope;
struct scope {
    scope *parent;
    const char **names;
    jv *vals;
    int n, cap;
    /* for-loop state behind the lazily built `loop` object */
    long li, ln;
    jv lprev, lnext;
};

enum { F_BUILTIN, F_MACRO, F_METHOD, F_CALLER };
enum { B_NAMESPACE, B_RANGE, B_RAISE, B_STRFTIME, B_DICT };

struct jfunc {
    int kind, id;
    const jnode *node; /* macro or call block */
    scope *env;
    jv self;           /* method receiver */
    const char *name;
};

typedef struct jargs {
    int np, nk;
    jv *p;
    const char **kn;
    jv *kv;
} jargs;

typedef struct R {
    jarena a;
    jfail f;
    jbuf *out;
    jinja_limits lim;
    uint64_t steps;
    int depth;
    int ctl; /* 1 break, 2 continue */
    jv next_caller;
} R;

#define LAZY_LOOP 2 /* jv.tuple marker: the `loop` variable, built on first use */

static const jv UNDEF = {.t = JV_UNDEF};
static const jv NONE = {.t = JV_NULL};

_Noreturn static void rt_err(R *r, int line, const char *fmt, ...) PT_PRINTF(3, 4);
static void rt_err(R *r, int line, const char *fmt, ...) {
    char msg[800];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    jfail_throw(&r->f, PETREL_EINVAL, line, "%s", msg);
}

static const char *type_name(jv v) {
    switch (v.t) {
    case JV_UNDEF: return "undefined";
    case JV_NULL: return "none";
    case JV_BOOL: return "boolean";
    case JV_INT: return "integer";
    case JV_FLOAT: return "float";
    case JV_STR: return "string";
    case JV_ARRAY: return "list";
    case JV_OBJECT: return "dict";
    case JV_NS: return "namespace";
    default: return "function";
    }
}

static jv mkstr(R *r, const char *s, size_t n) { return jv_str(&r->a, &r->f, s, n); }
static jv mkcstr(R *r, const char *s) { return mkstr(r, s, strlen(s)); }
static jv buf_str(R *r, jbuf *b) {
    jv v = {.t = JV_STR};
    v.u.s = jalloc(&r->a, &r->f, sizeof(jstr));
    v.u.s->s = b->p ? b->p : "";
    v.u.s->len = b->len;
    return v;
}
static void bufinit(R *r, jbuf *b) { jbuf_init(b, &r->a, &r->f, r->lim.max_output); }
/* double -> long without undefined behaviour (NaN -> 0, clamped to +-2^53). */
static long clamp_l(double d) {
    if (isnan(d)) return 0;
    if (d > 9007199254740992.0) return 9007199254740992L;
    if (d < -9007199254740992.0) return -9007199254740992L;
    return (long)d;
}
static int is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT; }
static int is_numlike(jv v) { return is_num(v) || v.t == JV_BOOL; }
static double numval(jv v) { return v.t == JV_BOOL ? v.u.b : v.u.n; }

/* ---------------- scopes ---------------- */
static scope *new_scope(R *r, scope *parent) {
    scope *s = jalloc(&r->a, &r->f, sizeof *s);
    s->parent = parent;
    return s;
}

static void set_var(R *r, scope *s, const char *name, jv v) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        int nc = s->cap ? s->cap * 2 : 8;
        const char **nn = jarena_grow(&r->a, (void *)s->names, (size_t)s->cap * sizeof(char *), (size_t)nc * sizeof(char *));
        jv *nv = nn ? jarena_grow(&r->a, s->vals, (size_t)s->cap * sizeof(jv), (size_t)nc * sizeof(jv)) : NULL;
        if (!nv) jfail_throw(&r->f, PETREL_ENOMEM, 0, "out of memory (template working-memory budget exceeded)");
        s->names = nn;
        s->vals = nv;
        s->cap = nc;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
}

static jstr LOOP_KEYS[9] = {{5, "index"}, {6, "index0"}, {8, "revindex"}, {9, "revindex0"}, {5, "first"},
                            {4, "last"}, {6, "length"}, {8, "previtem"}, {8, "nextitem"}};

static jv make_loop(R *r, scope *s) {
    jv o = jv_object(&r->a, &r->f, 0);
    jobj *ob = o.u.o;
    long i = s->li, n = s->ln;
    jv vals[9] = {jv_num((double)(i + 1), 1), jv_num((double)i, 1), jv_num((double)(n - i), 1),
                  jv_num((double)(n - i - 1), 1), jv_bool(i == 0), jv_bool(i == n - 1), jv_num((double)n, 1),
                  s->lprev, s->lnext};
    ob->k = jalloc(&r->a, &r->f, 9 * sizeof(jstr *));
    ob->v = jalloc(&r->a, &r->f, 9 * sizeof(jv));
    ob->cap = ob->n = 9;
    for (int k = 0; k < 9; k++) {
        ob->k[k] = &LOOP_KEYS[k];
        ob->v[k] = vals[k];
    }
    return o;
}

static jv lookup(R *r, scope *s, const char *name) {
    for (; s; s = s->parent)
        for (int i = 0; i < s->n; i++)
            if (!strcmp(s->names[i], name)) {
                if (s->vals[i].t == JV_UNDEF && s->vals[i].tuple == LAZY_LOOP) s->vals[i] = make_loop(r, s);
                return s->vals[i];
            }
    return UNDEF;
}

/* ---------------- conversions ---------------- */
static void float_str(double d, char *buf) {
    if (d == 0 && signbit(d)) { strcpy(buf, "-0.0"); return; }
    if (isfinite(d) && floor(d) == d) {
        js_num_str(d, buf);
        if (!strchr(buf, 'e')) strcat(buf, ".0");
        return;
    }
    js_num_str(d, buf);
}

static void put_runtime_str(R *r, jbuf *b, jv v, int line);

/* RuntimeValue.toString(): what {{ v }} prints (none/undefined are skipped by the caller). */
static void put_runtime_str(R *r, jbuf *b, jv v, int line) {
    char nb[48];
    switch (v.t) {
    case JV_UNDEF:
    case JV_NULL: return;
    case JV_BOOL: jbuf_puts(b, v.u.b ? "true" : "false"); return;
    case JV_INT: js_num_str(v.u.n, nb); jbuf_puts(b, nb); return;
    case JV_FLOAT: float_str(v.u.n, nb); jbuf_puts(b, nb); return;
    case JV_STR: jbuf_put(b, v.u.s->s, v.u.s->len); return;
    case JV_FUNC: jbuf_puts(b, "[function]"); return;
    default: {
        jjson_opts o = {.indent = -1, .undef_as_null = 0};
        if (jv_to_json(b, v, &o, 0)) rt_err(r, line, "cannot convert a value holding a function to a string");
    }
    }
}

/* JavaScript's value.toString() (used by ~ and + with strings): numbers without ".0". */
static void put_value_str(R *r, jbuf *b, jv v, int line) {
    char nb[48];
    switch (v.t) {
    case JV_INT:
    case JV_FLOAT: js_num_str(v.u.n, nb); jbuf_puts(b, nb); return;
    case JV_ARRAY:
        for (size_t i = 0; i < v.u.a->n; i++) {
            if (i) jbuf_putc(b, ',');
            put_runtime_str(r, b, v.u.a->v[i], line);
        }
        return;
    case JV_OBJECT:
    case JV_NS: jbuf_puts(b, "[object Map]"); return;
    case JV_NULL: jbuf_puts(b, "null"); return;
    default: put_runtime_str(r, b, v, line);
    }
}

static jv to_str(R *r, jv v, int line) {
    if (v.t == JV_STR) return v;
    jbuf b;
    bufinit(r, &b);
    put_runtime_str(r, &b, v, line);
    return buf_str(r, &b);
}

static int truthy(jv v) {
    switch (v.t) {
    case JV_UNDEF:
    case JV_NULL: return 0;
    case JV_BOOL: return v.u.b;
    case JV_INT:
    case JV_FLOAT: return v.u.n != 0 && !isnan(v.u.n);
    case JV_STR: return v.u.s->len > 0;
    case JV_ARRAY: return v.u.a->n > 0;
    case JV_OBJECT: return v.u.o->n > 0;
    default: return 1;
    }
}

/* JavaScript Number(string) */
static double js_tonumber(const char *s, size_t len) {
    size_t i = 0, e = len, cl;
    while (i < e && js_space(utf8_dec(s, len, i, &cl))) i += cl;
    while (e > i) {
        size_t ps = utf8_prev(s, e);
        if (!js_space(utf8_dec(s, e, ps, &cl))) break;
        e = ps;
    }
    if (i == e) return 0;
    char tmp[64];
    size_t n = e - i;
    if (n >= sizeof tmp) return NAN;
    memcpy(tmp, s + i, n);
    tmp[n] = 0;
    if (!strcmp(tmp, "Infinity") || !strcmp(tmp, "+Infinity")) return INFINITY;
    if (!strcmp(tmp, "-Infinity")) return -INFINITY;
    for (size_t k = 0; k < n; k++)
        if (!strchr("0123456789+-.eExXabcdefABCDEF", tmp[k])) return NAN;
    if (strchr(tmp, 'n') || strchr(tmp, 'N') || strchr(tmp, 'p') || strchr(tmp, 'P')) return NAN;
    char *end;
    double d = strtod(tmp, &end);
    return *end ? NAN : d;
}

static int strict_eq(jv a, jv b) {
    if (is_num(a) && is_num(b)) return a.u.n == b.u.n;
    if (a.t != b.t) return 0;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NULL: return 1;
    case JV_BOOL: return a.u.b == b.u.b;
    case JV_STR: return a.u.s->len == b.u.s->len && !memcmp(a.u.s->s, b.u.s->s, a.u.s->len);
    case JV_ARRAY: return a.u.a == b.u.a;
    case JV_OBJECT:
    case JV_NS: return a.u.o == b.u.o;
    default: return a.u.f == b.u.f;
    }
}

/* JavaScript == on the underlying values, as @huggingface/jinja compares. */
static int loose_eq(R *r, jv a, jv b, int line) {
    int an = a.t == JV_UNDEF || a.t == JV_NULL, bn = b.t == JV_UNDEF || b.t == JV_NULL;
    if (an || bn) return an && bn;
    if (is_numlike(a) && is_numlike(b)) return numval(a) == numval(b);
    if (a.t == JV_STR && b.t == JV_STR) return strict_eq(a, b);
    if (a.t == JV_STR && is_numlike(b)) return js_tonumber(a.u.s->s, a.u.s->len) == numval(b);
    if (b.t == JV_STR && is_numlike(a)) return js_tonumber(b.u.s->s, b.u.s->len) == numval(a);
    if (a.t == JV_ARRAY && b.t != JV_ARRAY && b.t != JV_OBJECT && b.t != JV_NS && b.t != JV_FUNC) {
        jbuf buf;
        bufinit(r, &buf);
        put_value_str(r, &buf, a, line);
        return loose_eq(r, buf_str(r, &buf), b, line);
    }
    if (b.t == JV_ARRAY && a.t != JV_ARRAY && a.t != JV_OBJECT && a.t != JV_NS && a.t != JV_FUNC) return loose_eq(r, b, a, line);
    return strict_eq(a, b);
}

/* compareRuntimeValues of @huggingface/jinja (sort, dictsort, min, max) */
static int cmp_values(R *r, jv a, jv b, int case_sensitive, int line) {
    if (a.t == JV_NULL && b.t == JV_NULL) return 0;
    if (a.t == JV_UNDEF && b.t == JV_UNDEF) return 0;
    if (is_numlike(a) && is_numlike(b)) {
        double x = numval(a), y = numval(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        const jstr *x = a.u.s, *y = b.u.s;
        size_t i = 0, j = 0, cl1, cl2;
        while (i < x->len && j < y->len) {
            uint32_t c1 = utf8_dec(x->s, x->len, i, &cl1), c2 = utf8_dec(y->s, y->len, j, &cl2);
            if (!case_sensitive) {
                c1 = (uint32_t)utf8proc_tolower((utf8proc_int32_t)c1);
                c2 = (uint32_t)utf8proc_tolower((utf8proc_int32_t)c2);
            }
            if (c1 != c2) return c1 < c2 ? -1 : 1;
            i += cl1;
            j += cl2;
        }
        return (i < x->len) - (j < y->len);
    }
    rt_err(r, line, "cannot compare a %s with a %s", type_name(a), type_name(b));
}

/* ---------------- string helpers ---------------- */
static size_t utf16_len(const char *s, size_t n) {
    size_t k = 0, cl;
    for (size_t i = 0; i < n; i += cl) k += utf8_dec(s, n, i, &cl) >= 0x10000 ? 2 : 1;
    return k;
}

/* Byte offsets of each code point, plus the end: returns count. */
static size_t cp_offsets(R *r, const jstr *s, size_t **off) {
    size_t n = 0, cl;
    for (size_t i = 0; i < s->len; i += cl) { utf8_dec(s->s, s->len, i, &cl); n++; }
    size_t *o = jalloc(&r->a, &r->f, (n + 1) * sizeof *o);
    size_t k = 0;
    for (size_t i = 0; i < s->len; i += cl) { o[k++] = i; utf8_dec(s->s, s->len, i, &cl); }
    o[n] = s->len;
    *off = o;
    return n;
}

static jv map_case(R *r, jv v, int upper) {
    jbuf b;
    bufinit(r, &b);
    const jstr *s = v.u.s;
    size_t cl;
    for (size_t i = 0; i < s->len; i += cl) {
        uint32_t c = utf8_dec(s->s, s->len, i, &cl);
        if (cl == 1 && c >= 0x80) { jbuf_put(&b, s->s + i, 1); continue; }
        uint32_t m = (uint32_t)(upper ? utf8proc_toupper((utf8proc_int32_t)c) : utf8proc_tolower((utf8proc_int32_t)c));
        char u[4];
        jbuf_put(&b, u, utf8_enc(m, u));
    }
    return buf_str(r, &b);
}

static int in_set(uint32_t c, const jstr *chars) {
    size_t cl;
    for (size_t i = 0; i < chars->len; i += cl)
        if (utf8_dec(chars->s, chars->len, i, &cl) == c) return 1;
    return 0;
}

/* strip: no argument (or one made only of whitespace, as @huggingface/jinja ignores the
 * argument) strips JavaScript whitespace; other arguments strip those characters (Python). */
static jv strip_str(R *r, jv v, int left, int right, const jstr *chars) {
    const jstr *s = v.u.s;
    if (chars) {
        int all_space = 1;
        size_t cl;
        for (size_t i = 0; i < chars->len; i += cl)
            if (!js_space(utf8_dec(chars->s, chars->len, i, &cl))) all_space = 0;
        if (all_space && chars->len) chars = NULL;
    }
    size_t i = 0, e = s->len, cl;
    if (left)
        while (i < e) {
            uint32_t c = utf8_dec(s->s, s->len, i, &cl);
            if (chars ? !in_set(c, chars) : !js_space(c)) break;
            i += cl;
        }
    if (right)
        while (e > i) {
            size_t ps = utf8_prev(s->s, e);
            uint32_t c = utf8_dec(s->s, e, ps, &cl);
            if (chars ? !in_set(c, chars) : !js_space(c)) break;
            e = ps;
        }
    if (i == 0 && e == s->len) return v;
    return mkstr(r, s->s + i, e - i);
}

static const char *mem_find(const char *h, size_t hl, const char *n, size_t nl) {
    if (nl == 0) return h;
    if (nl > hl) return NULL;
    return memmem(h, hl, n, nl);
}

static jv str_replace(R *r, const jstr *s, const jstr *old, const jstr *new, double count) {
    jbuf b;
    bufinit(r, &b);
    long remaining = count < 0 || isnan(count) ? -1 : clamp_l(count);
    if (remaining == 0) return mkstr(r, s->s, s->len);
    if (old->len == 0) {
        size_t cl;
        for (size_t i = 0; i <= s->len; i += cl) {
            if (remaining != 0) { jbuf_put(&b, new->s, new->len); if (remaining > 0) remaining--; }
            if (i == s->len) break;
            utf8_dec(s->s, s->len, i, &cl);
            jbuf_put(&b, s->s + i, cl);
        }
        return buf_str(r, &b);
    }
    size_t i = 0;
    while (i <= s->len) {
        const char *q = remaining != 0 ? mem_find(s->s + i, s->len - i, old->s, old->len) : NULL;
        if (!q) { jbuf_put(&b, s->s + i, s->len - i); break; }
        size_t at = (size_t)(q - s->s);
        jbuf_put(&b, s->s + i, at - i);
        jbuf_put(&b, new->s, new->len);
        i = at + old->len;
        if (remaining > 0) remaining--;
    }
    return buf_str(r, &b);
}

static jv str_split(R *r, const jstr *s, const jstr *sep, long maxsplit, int from_right) {
    jv out = jv_array(&r->a, &r->f, 0);
    if (!sep) {
        /* runs of whitespace separate; no empty strings */
        size_t cl;
        if (!from_right) {
            size_t i = 0;
            while (i < s->len) {
                while (i < s->len && js_space(utf8_dec(s->s, s->len, i, &cl))) i += cl;
                if (i >= s->len) break;
                if (maxsplit >= 0 && (long)out.u.a->n >= maxsplit) {
                    jarr_push(&r->a, &r->f, out.u.a, mkstr(r, s->s + i, s->len - i));
                    break;
                }
                size_t st = i;
                while (i < s->len && !js_space(utf8_dec(s->s, s->len, i, &cl))) i += cl;
                jarr_push(&r->a, &r->f, out.u.a, mkstr(r, s->s + st, i - st));
            }
        } else {
            size_t e = s->len;
            jv tmp = jv_array(&r->a, &r->f, 0);
            while (e > 0) {
                while (e > 0) { size_t ps = utf8_prev(s->s, e); if (!js_space(utf8_dec(s->s, e, ps, &cl))) break; e = ps; }
                if (e == 0) break;
                if (maxsplit >= 0 && (long)tmp.u.a->n >= maxsplit) {
                    jarr_push(&r->a, &r->f, tmp.u.a, mkstr(r, s->s, e));
                    break;
                }
                size_t en = e;
                while (e > 0) { size_t ps = utf8_prev(s->s, e); if (js_space(utf8_dec(s->s, e, ps, &cl))) break; e = ps; }
                jarr_push(&r->a, &r->f, tmp.u.a, mkstr(r, s->s + e, en - e));
            }
            for (size_t k = tmp.u.a->n; k > 0; k--) jarr_push(&r->a, &r->f, out.u.a, tmp.u.a->v[k - 1]);
        }
        return out;
    }
    if (!from_right) {
        size_t i = 0;
        for (;;) {
            const char *q = (maxsplit < 0 || (long)out.u.a->n < maxsplit) ? mem_find(s->s + i, s->len - i, sep->s, sep->len) : NULL;
            if (!q) { jarr_push(&r->a, &r->f, out.u.a, mkstr(r, s->s + i, s->len - i)); break; }
            size_t at = (size_t)(q - s->s);
            jarr_push(&r->a, &r->f, out.u.a, mkstr(r, s->s + i, at - i));
            i = at + sep->len;
        }
        return out;
    }
    jv tmp = jv_array(&r->a, &r->f, 0);
    size_t e = s->len;
    for (;;) {
        const char *q = NULL;
        if (maxsplit < 0 || (long)tmp.u.a->n < maxsplit)
            for (size_t k = e; k >= sep->len; k--)
                if (!memcmp(s->s + k - sep->len, sep->s, sep->len)) { q = s->s + k - sep->len; break; }
        if (!q) { jarr_push(&r->a, &r->f, tmp.u.a, mkstr(r, s->s, e)); break; }
        size_t at = (size_t)(q - s->s);
        jarr_push(&r->a, &r->f, tmp.u.a, mkstr(r, s->s + at + sep->len, e - at - sep->len));
        e = at;
    }
    for (size_t k = tmp.u.a->n; k > 0; k--) jarr_push(&r->a, &r->f, out.u.a, tmp.u.a->v[k - 1]);
    return out;
}

/* Python-style slice of n items (HF's slice()): fills idx, returns count. */
static size_t slice_idx(R *r, long n, int has_start, long start, int has_stop, long stop, long step, long **idx) {
    long *o = jalloc(&r->a, &r->f, (size_t)(n + 1) * sizeof(long));
    size_t k = 0;
    if (step == 0) { *idx = o; return 0; }
    if (step > 0) {
        if (!has_start) start = 0;
        start = start < 0 ? (n + start > 0 ? n + start : 0) : (start < n ? start : n);
        if (!has_stop) stop = n;
        stop = stop < 0 ? (n + stop > 0 ? n + stop : 0) : (stop < n ? stop : n);
        for (long i = start; i < stop; i += step) o[k++] = i;
    } else {
        if (!has_start) start = n - 1;
        start = start < 0 ? (n + start > -1 ? n + start : -1) : (start < n - 1 ? start : n - 1);
        if (!has_stop) stop = -1;
        stop = stop < -1 ? (n + stop > -1 ? n + stop : -1) : (stop < n - 1 ? stop : n - 1);
        for (long i = start; i > stop; i += step) o[k++] = i;
    }
    *idx = o;
    return k;
}

/* ---------------- arguments ---------------- */
static int arg(const jargs *a, int i, const char *name, jv *out) {
    if (i >= 0 && i < a->np) { *out = a->p[i]; return 1; }
    if (name)
        for (int k = 0; k < a->nk; k++)
            if (!strcmp(a->kn[k], name)) { *out = a->kv[k]; return 1; }
    return 0;
}

static const jstr *arg_str(R *r, const jargs *a, int i, const char *name, const char *what, int line) {
    jv v;
    if (!arg(a, i, name, &v) || v.t == JV_NULL || v.t == JV_UNDEF) return NULL;
    if (v.t != JV_STR) rt_err(r, line, "%s: argument must be a string, got %s", what, type_name(v));
    return v.u.s;
}

static int arg_bool(const jargs *a, int i, const char *name, int dflt) {
    jv v;
    if (!arg(a, i, name, &v) || v.t == JV_UNDEF) return dflt;
    return truthy(v);
}

static double arg_num(R *r, const jargs *a, int i, const char *name, double dflt, const char *what, int line) {
    jv v;
    if (!arg(a, i, name, &v) || v.t == JV_UNDEF || v.t == JV_NULL) return dflt;
    if (!is_numlike(v)) rt_err(r, line, "%s: argument must be a number, got %s", what, type_name(v));
    return numval(v);
}

static jv eval(R *r, const jnode *x, scope *s);
static void exec_block(R *r, jnode *const *body, int n, scope *s);
static jv call_value(R *r, jv fn, jargs *a, int line, const char *what);
static int run_test(R *r, jv v, const char *name, jargs *a, int line);
static jv apply_filter(R *r, jv v, const char *name, jargs *a, scope *s, int line);

static void eval_args(R *r, jnode *const *list, int n, scope *s, jargs *out) {
    int cap = n + 4;
    out->p = jalloc(&r->a, &r->f, (size_t)cap * sizeof(jv));
    out->kn = jalloc(&r->a, &r->f, (size_t)cap * sizeof(char *));
    out->kv = jalloc(&r->a, &r->f, (size_t)cap * sizeof(jv));
    out->np = out->nk = 0;
    for (int i = 0; i < n; i++) {
        const jnode *x = list[i];
        if (x->kind == E_KWARG || x->kind == E_KWSPREAD) continue;
        if (x->kind == E_SPREAD) {
            jv v = eval(r, x->a, s);
            if (v.t != JV_ARRAY) rt_err(r, x->line, "cannot unpack a %s with *", type_name(v));
            size_t need = (size_t)out->np + v.u.a->n + (size_t)n;
            if (need > (size_t)cap) {
                jv *np2 = jalloc(&r->a, &r->f, need * sizeof(jv));
                memcpy(np2, out->p, (size_t)out->np * sizeof(jv));
                out->p = np2;
                cap = (int)need;
            }
            for (size_t k = 0; k < v.u.a->n; k++) out->p[out->np++] = v.u.a->v[k];
        } else {
            out->p[out->np++] = eval(r, x, s);
        }
    }
    int kcap = n + 4;
    for (int i = 0; i < n; i++) {
        const jnode *x = list[i];
        if (x->kind == E_KWARG) {
            for (int k = 0; k < out->nk; k++)
                if (!strcmp(out->kn[k], x->s)) rt_err(r, x->line, "got multiple values for keyword argument '%s'", x->s);
            out->kn[out->nk] = x->s;
            out->kv[out->nk++] = eval(r, x->a, s);
        } else if (x->kind == E_KWSPREAD) {
            jv v = eval(r, x->a, s);
            if (v.t != JV_OBJECT) rt_err(r, x->line, "argument after ** must be a dict, not %s", type_name(v));
            size_t need = (size_t)out->nk + v.u.o->n + (size_t)n;
            if (need > (size_t)kcap) {
                const char **nk = jalloc(&r->a, &r->f, need * sizeof(char *));
                jv *nv = jalloc(&r->a, &r->f, need * sizeof(jv));
                memcpy(nk, out->kn, (size_t)out->nk * sizeof(char *));
                memcpy(nv, out->kv, (size_t)out->nk * sizeof(jv));
                out->kn = nk;
                out->kv = nv;
                kcap = (int)need;
            }
            for (size_t k = 0; k < v.u.o->n; k++) {
                for (int j = 0; j < out->nk; j++)
                    if (!strcmp(out->kn[j], v.u.o->k[k]->s))
                        rt_err(r, x->line, "got multiple values for keyword argument '%s'", v.u.o->k[k]->s);
                out->kn[out->nk] = v.u.o->k[k]->s;
                out->kv[out->nk++] = v.u.o->v[k];
            }
        }
    }
}

/* ---------------- member access ---------------- */
static const char *const STR_METHODS[] = {
    "upper", "lower", "strip", "lstrip", "rstrip", "title", "capitalize", "startswith", "endswith",
    "split", "rsplit", "replace", "find", "rfind", "count", "join", "splitlines", "isdigit", "isalpha",
    "isalnum", "isspace", "isupper", "islower", "removeprefix", "removesuffix", "format", "index", NULL};
static const char *const OBJ_METHODS[] = {"get", "items", "keys", "values", "dictsort", NULL};
static const char *const ARR_METHODS[] = {"append", "extend", "pop", "insert", "index", "count", NULL};

static const char *find_name(const char *const *list, const char *name, size_t len) {
    for (int i = 0; list[i]; i++)
        if (strlen(list[i]) == len && !memcmp(list[i], name, len)) return list[i];
    return NULL;
}

static jv method(R *r, jv self, const char *name) {
    jv v = {.t = JV_FUNC};
    v.u.f = jalloc(&r->a, &r->f, sizeof(jfunc));
    v.u.f->kind = F_METHOD;
    v.u.f->self = self;
    v.u.f->name = name;
    return v;
}

static jv get_member(R *r, jv obj, jv prop, int line) {
    if (obj.t == JV_OBJECT || obj.t == JV_NS) {
        if (prop.t != JV_STR) rt_err(r, line, "cannot look up a %s key in a %s", type_name(prop), type_name(obj));
        jv *p = jobj_get(obj.u.o, prop.u.s->s, prop.u.s->len);
        if (p) return *p;
        if (obj.t == JV_OBJECT) {
            const char *m = find_name(OBJ_METHODS, prop.u.s->s, prop.u.s->len);
            if (m) return method(r, obj, m);
        }
        return UNDEF;
    }
    if (obj.t == JV_ARRAY || obj.t == JV_STR) {
        if (prop.t == JV_INT) {
            double d = prop.u.n;
            if (obj.t == JV_ARRAY) {
                long n = (long)obj.u.a->n;
                if (!(fabs(d) < 1e15)) return UNDEF;
                long i = (long)d;
                if (i < 0) i += n;
                return i >= 0 && i < n ? obj.u.a->v[i] : UNDEF;
            }
            size_t *off;
            long n = (long)cp_offsets(r, obj.u.s, &off);
            if (!(fabs(d) < 1e15)) return UNDEF;
            long i = (long)d;
            if (i < 0) i += n;
            if (i < 0 || i >= n) return UNDEF;
            return mkstr(r, obj.u.s->s + off[i], off[i + 1] - off[i]);
        }
        if (prop.t == JV_STR) {
            if (!strcmp(prop.u.s->s, "length"))
                return jv_num((double)(obj.t == JV_ARRAY ? obj.u.a->n : utf16_len(obj.u.s->s, obj.u.s->len)), 1);
            const char *m = find_name(obj.t == JV_ARRAY ? ARR_METHODS : STR_METHODS, prop.u.s->s, prop.u.s->len);
            if (m) return method(r, obj, m);
            return UNDEF;
        }
        rt_err(r, line, "cannot index a %s with a %s", type_name(obj), type_name(prop));
    }
    if (prop.t != JV_STR) rt_err(r, line, "cannot index a %s with a %s", type_name(obj), type_name(prop));
    return UNDEF;
}

/* ---------------- binary operators ---------------- */
static jv binop(R *r, int op, jv l, jv rv, int line) {
    static const char *const OPS[] = {"", "or", "and", "not", "in", "not in", "==", "!=", "<", ">", "<=", ">=",
                                      "+", "-", "~", "*", "/", "//", "%", "**", "-", "+"};
    if (op == OP_EQ) return jv_bool(loose_eq(r, l, rv, line));
    if (op == OP_NE) return jv_bool(!loose_eq(r, l, rv, line));
    if (is_num(l) && is_num(rv) && op != OP_CONCAT && op != OP_POW) {
        double a = l.u.n, b = rv.u.n;
        int fl = l.t == JV_FLOAT || rv.t == JV_FLOAT;
        switch (op) {
        case OP_ADD: return jv_num(a + b, !fl);
        case OP_SUB: return jv_num(a - b, !fl);
        case OP_MUL: return jv_num(a * b, !fl);
        case OP_DIV:
        case OP_FLOORDIV:
        case OP_MOD:
            /* Jinja (Python) raises ZeroDivisionError where C would give inf / nan */
            if (b == 0) rt_err(r, line, "%s by zero (ZeroDivisionError)", op == OP_MOD ? "modulo" : "division");
            if (op == OP_DIV) return jv_num(a / b, 0);
            if (op == OP_FLOORDIV) return jv_num(floor(a / b), !fl);
            return jv_num(fmod(a, b), !fl);
        case OP_LT: return jv_bool(a < b);
        case OP_GT: return jv_bool(a > b);
        case OP_LE: return jv_bool(a <= b);
        case OP_GE: return jv_bool(a >= b);
        default: break;
        }
    } else if (l.t == JV_UNDEF || rv.t == JV_UNDEF) {
        if (rv.t == JV_UNDEF && (op == OP_IN || op == OP_NOTIN)) return jv_bool(op == OP_NOTIN);
        if (op == OP_CONCAT && l.t != JV_NULL && rv.t != JV_NULL) {
            jbuf b;
            bufinit(r, &b);
            if (l.t != JV_UNDEF) put_value_str(r, &b, l, line);
            if (rv.t != JV_UNDEF) put_value_str(r, &b, rv, line);
            return buf_str(r, &b);
        }
        rt_err(r, line, "cannot apply '%s' to an undefined value", OPS[op]);
    } else if (l.t == JV_NULL || rv.t == JV_NULL) {
        rt_err(r, line, "cannot apply '%s' to none", OPS[op]);
    } else if (op == OP_CONCAT) {
        jbuf b;
        bufinit(r, &b);
        put_value_str(r, &b, l, line);
        put_value_str(r, &b, rv, line);
        return buf_str(r, &b);
    } else if (op == OP_POW && is_numlike(l) && is_numlike(rv)) {
        double a = numval(l), b = numval(rv);
        if (a == 0 && b < 0) rt_err(r, line, "0.0 cannot be raised to a negative power");
        double res = pow(a, b);
        if (!isfinite(res)) rt_err(r, line, "exponentiation result is not a finite real number");
        return jv_num(res, !(l.t == JV_FLOAT || rv.t == JV_FLOAT || b < 0));
    } else if (l.t == JV_ARRAY && rv.t == JV_ARRAY) {
        if (op == OP_ADD) {
            jv o = jv_array(&r->a, &r->f, l.u.a->n + rv.u.a->n);
            for (size_t i = 0; i < l.u.a->n; i++) jarr_push(&r->a, &r->f, o.u.a, l.u.a->v[i]);
            for (size_t i = 0; i < rv.u.a->n; i++) jarr_push(&r->a, &r->f, o.u.a, rv.u.a->v[i]);
            return o;
        }
    } else if (rv.t == JV_ARRAY && (op == OP_IN || op == OP_NOTIN)) {
        int found = 0;
        for (size_t i = 0; i < rv.u.a->n && !found; i++) found = strict_eq(l, rv.u.a->v[i]);
        return jv_bool(op == OP_IN ? found : !found);
    }
    if ((l.t == JV_STR || rv.t == JV_STR) && op == OP_ADD) {
        jbuf b;
        bufinit(r, &b);
        put_value_str(r, &b, l, line);
        put_value_str(r, &b, rv, line);
        return buf_str(r, &b);
    }
    if (l.t == JV_STR && rv.t == JV_STR && (op == OP_IN || op == OP_NOTIN)) {
        int found = mem_find(rv.u.s->s, rv.u.s->len, l.u.s->s, l.u.s->len) != NULL;
        return jv_bool(op == OP_IN ? found : !found);
    }
    if ((rv.t == JV_OBJECT || rv.t == JV_NS) && (op == OP_IN || op == OP_NOTIN)) {
        int found = l.t == JV_STR && jobj_get(rv.u.o, l.u.s->s, l.u.s->len);
        return jv_bool(op == OP_IN ? found : !found);
    }
    /* Python extras: string/list repetition, string comparison */
    if (op == OP_MUL && ((l.t == JV_STR || l.t == JV_ARRAY) && rv.t == JV_INT)) {
        double times = rv.u.n;
        if (l.t == JV_STR) {
            jbuf b;
            bufinit(r, &b);
            for (double k = 0; k < times; k++) jbuf_put(&b, l.u.s->s, l.u.s->len);
            return buf_str(r, &b);
        }
        jv o = jv_array(&r->a, &r->f, 0);
        for (double k = 0; k < times; k++)
            for (size_t i = 0; i < l.u.a->n; i++) jarr_push(&r->a, &r->f, o.u.a, l.u.a->v[i]);
        return o;
    }
    if (l.t == JV_STR && rv.t == JV_STR && op >= OP_LT && op <= OP_GE) {
        int c = cmp_values(r, l, rv, 1, line);
        return jv_bool(op == OP_LT ? c < 0 : op == OP_GT ? c > 0 : op == OP_LE ? c <= 0 : c >= 0);
    }
    if (is_numlike(l) && is_numlike(rv) && op >= OP_LT && op <= OP_GE) {
        double a = numval(l), b = numval(rv);
        return jv_bool(op == OP_LT ? a < b : op == OP_GT ? a > b : op == OP_LE ? a <= b : a >= b);
    }
    rt_err(r, line, "unsupported operator '%s' between a %s and a %s", OPS[op], type_name(l), type_name(rv));
}

/* ---------------- evaluation ---------------- */
static void tick(R *r, int line) {
    if (++r->steps > r->lim.max_steps)
        jfail_throw(&r->f, PETREL_ERANGE, line, "template exceeded the limit of %llu evaluation steps",
                    (unsigned long long)r->lim.max_steps);
}

static void enter(R *r, int line) {
    if (++r->depth > r->lim.max_depth)
        jfail_throw(&r->f, PETREL_ERANGE, line, "template recursion too deep (limit %d)", r->lim.max_depth);
}

static jv render_capture(R *r, jnode *const *body, int n, scope *s) {
    jbuf *saved = r->out, b;
    bufinit(r, &b);
    r->out = &b;
    exec_block(r, body, n, s);
    r->out = saved;
    return buf_str(r, &b);
}

static void bind_params(R *r, const jnode *owner, jnode *const *params, int nparams, jargs *a, scope *ms, int line) {
    int *pending = jalloc(&r->a, &r->f, (size_t)(nparams + 1) * sizeof(int));
    int np = 0;
    char *used = jalloc(&r->a, &r->f, (size_t)a->nk + 1);
    for (int i = 0; i < nparams; i++) {
        const jnode *p = params[i];
        jv v = UNDEF;
        int have = 0;
        if (i < a->np) { v = a->p[i]; have = 1; }
        if (!have)
            for (int k = 0; k < a->nk; k++)
                if (!used[k] && !strcmp(a->kn[k], p->s)) { v = a->kv[k]; used[k] = 1; have = 1; break; }
        if (!have && p->kind == E_KWARG) pending[np++] = i;
        set_var(r, ms, p->s, v);
    }
    jv kw = jv_object(&r->a, &r->f, 0);
    for (int k = 0; k < a->nk; k++)
        if (!used[k]) jobj_set(&r->a, &r->f, kw.u.o, a->kn[k], strlen(a->kn[k]), a->kv[k]);
    set_var(r, ms, "kwargs", kw);
    jv va = jv_array(&r->a, &r->f, 0);
    for (int i = nparams; i < a->np; i++) jarr_push(&r->a, &r->f, va.u.a, a->p[i]);
    set_var(r, ms, "varargs", va);
    for (int k = 0; k < np; k++) set_var(r, ms, params[pending[k]]->s, eval(r, params[pending[k]]->a, ms));
    (void)owner;
    (void)line;
}

static jv call_macro(R *r, jfunc *fn, jargs *a, int line) {
    enter(r, line);
    jv caller = r->next_caller;
    r->next_caller = UNDEF;
    const jnode *m = fn->node;
    scope *ms = new_scope(r, fn->env);
    set_var(r, ms, "caller", caller);
    bind_params(r, m, m->list2, m->nlist2, a, ms, line);
    jv out = render_capture(r, m->list, m->nlist, ms);
    r->depth--;
    return out;
}

static jv call_builtin(R *r, jfunc *fn, jargs *a, int line) {
    switch (fn->id) {
    case B_RAISE: {
        jv m = UNDEF;
        arg(a, 0, "message", &m);
        jv s = to_str(r, m, line);
        jfail_throw(&r->f, PETREL_EINVAL, line, "raise_exception: %s", s.u.s->s);
    }
    case B_NAMESPACE:
    case B_DICT: {
        jv o = jv_object(&r->a, &r->f, fn->id == B_NAMESPACE);
        if (a->np > 1) rt_err(r, line, "%s() takes at most 1 positional argument", fn->name);
        if (a->np == 1) {
            jv src = a->p[0];
            if (src.t == JV_OBJECT) {
                for (size_t i = 0; i < src.u.o->n; i++)
                    jobj_set(&r->a, &r->f, o.u.o, src.u.o->k[i]->s, src.u.o->k[i]->len, src.u.o->v[i]);
            } else if (src.t == JV_ARRAY) {
                for (size_t i = 0; i < src.u.a->n; i++) {
                    jv pr = src.u.a->v[i];
                    if (pr.t != JV_ARRAY || pr.u.a->n != 2 || pr.u.a->v[0].t != JV_STR)
                        rt_err(r, line, "%s() expected a dict or a list of [key, value] pairs", fn->name);
                    jobj_set(&r->a, &r->f, o.u.o, pr.u.a->v[0].u.s->s, pr.u.a->v[0].u.s->len, pr.u.a->v[1]);
                }
            } else {
                rt_err(r, line, "%s() expected a dict, got %s", fn->name, type_name(src));
            }
        }
        for (int k = 0; k < a->nk; k++) jobj_set(&r->a, &r->f, o.u.o, a->kn[k], strlen(a->kn[k]), a->kv[k]);
        return o;
    }
    case B_RANGE: {
        if (a->np < 1 || a->np > 3) rt_err(r, line, "range() takes 1 to 3 arguments");
        for (int i = 0; i < a->np; i++)
            if (!is_numlike(a->p[i])) rt_err(r, line, "range() arguments must be numbers, got %s", type_name(a->p[i]));
        double start = 0, stop, step = 1;
        if (a->np == 1) stop = numval(a->p[0]);
        else { start = numval(a->p[0]); stop = numval(a->p[1]); if (a->np == 3) step = numval(a->p[2]); }
        if (step == 0 || isnan(step)) rt_err(r, line, "range() step must not be zero");
        double cnt = step > 0 ? ceil((stop - start) / step) : ceil((start - stop) / -step);
        if (cnt > 1e7) jfail_throw(&r->f, PETREL_ERANGE, line, "range() of %.0f items is too long", cnt);
        jv o = jv_array(&r->a, &r->f, cnt > 0 ? (size_t)cnt : 0);
        if (step > 0)
            for (double i = start; i < stop; i += step) jarr_push(&r->a, &r->f, o.u.a, jv_num(i, floor(i) == i));
        else
            for (double i = start; i > stop; i += step) jarr_push(&r->a, &r->f, o.u.a, jv_num(i, floor(i) == i));
        return o;
    }
    case B_STRFTIME: {
        const jstr *f = arg_str(r, a, 0, "format", "strftime_now", line);
        if (!f) rt_err(r, line, "strftime_now() needs a format string");
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        size_t cap = 256 + f->len * 8;
        if (cap > 65536) rt_err(r, line, "strftime_now() format too long");
        char *buf = jalloc(&r->a, &r->f, cap);
        size_t n = f->len ? strftime(buf, cap, f->s, &tm) : 0;
        return mkstr(r, buf, n);
    }
    }
    rt_err(r, line, "bad builtin");
}

static jv call_method(R *r, jfunc *fn, jargs *a, int line);

static jv call_value(R *r, jv fn, jargs *a, int line, const char *what) {
    if (fn.t != JV_FUNC) {
        if (fn.t == JV_UNDEF) rt_err(r, line, "'%s' is undefined (cannot call it)", what ? what : "value");
        rt_err(r, line, "'%s' is not callable (it is a %s)", what ? what : "value", type_name(fn));
    }
    jfunc *f = fn.u.f;
    switch (f->kind) {
    case F_MACRO: return call_macro(r, f, a, line);
    case F_BUILTIN: return call_builtin(r, f, a, line);
    case F_METHOD: return call_method(r, f, a, line);
    default: { /* caller() of a call block */
        enter(r, line);
        const jnode *cb = f->node;
        scope *cs = new_scope(r, f->env);
        bind_params(r, cb, cb->list2, cb->nlist2, a, cs, line);
        jv out = render_capture(r, cb->list, cb->nlist, cs);
        r->depth--;
        return out;
    }
    }
}

static const char *callee_name(const jnode *x) {
    if (x->kind == E_NAME) return x->s;
    if (x->kind == E_MEMBER && !x->flag) return x->s;
    return NULL;
}

static jv eval_slice(R *r, const jnode *x, scope *s) {
    jv obj = eval(r, x->a, s);
    if (obj.t != JV_ARRAY && obj.t != JV_STR) rt_err(r, x->line, "cannot slice a %s", type_name(obj));
    long parts[3] = {0, 0, 1};
    int has[3] = {0, 0, 0};
    const jnode *pn[3] = {x->b, x->c, x->d};
    for (int i = 0; i < 3; i++) {
        if (!pn[i]) continue;
        jv v = eval(r, pn[i], s);
        if (v.t == JV_UNDEF || v.t == JV_NULL) continue;
        if (v.t != JV_INT) rt_err(r, x->line, "slice indices must be integers, got %s", type_name(v));
        parts[i] = fabs(v.u.n) < 1e15 ? (long)v.u.n : (v.u.n < 0 ? -(1L << 50) : (1L << 50));
        has[i] = 1;
    }
    long step = has[2] ? parts[2] : 1;
    long *idx;
    if (obj.t == JV_ARRAY) {
        size_t k = slice_idx(r, (long)obj.u.a->n, has[0], parts[0], has[1], parts[1], step, &idx);
        jv o = jv_array(&r->a, &r->f, k);
        for (size_t i = 0; i < k; i++) jarr_push(&r->a, &r->f, o.u.a, obj.u.a->v[idx[i]]);
        return o;
    }
    size_t *off;
    long n = (long)cp_offsets(r, obj.u.s, &off);
    size_t k = slice_idx(r, n, has[0], parts[0], has[1], parts[1], step, &idx);
    jbuf b;
    bufinit(r, &b);
    for (size_t i = 0; i < k; i++) jbuf_put(&b, obj.u.s->s + off[idx[i]], off[idx[i] + 1] - off[idx[i]]);
    return buf_str(r, &b);
}

static jv eval(R *r, const jnode *x, scope *s) {
    tick(r, x->line);
    enter(r, x->line);
    jv v = UNDEF;
    switch (x->kind) {
    case E_STR:
        v.t = JV_STR;
        v.u.s = x->str;
        break;
    case E_INT: v = jv_num(x->num, 1); break;
    case E_FLOAT: v = jv_num(x->num, 0); break;
    case E_NAME: v = lookup(r, s, x->s); break;
    case E_MEMBER: {
        jv obj = eval(r, x->a, s);
        jv prop;
        if (x->flag) prop = eval(r, x->b, s);
        else if (x->op) prop = jv_num(x->num, 1);
        else {
            prop.t = JV_STR;
            prop.tuple = 0;
            prop.u.s = x->str;
        }
        v = get_member(r, obj, prop, x->line);
        break;
    }
    case E_SLICE: v = eval_slice(r, x, s); break;
    case E_CALL: {
        jargs a;
        eval_args(r, x->list, x->nlist, s, &a);
        jv fn = eval(r, x->a, s);
        v = call_value(r, fn, &a, x->line, callee_name(x->a));
        break;
    }
    case E_FILTER: {
        jv operand = eval(r, x->a, s);
        jargs a;
        eval_args(r, x->list, x->nlist, s, &a);
        v = apply_filter(r, operand, x->s, &a, s, x->line);
        break;
    }
    case E_TEST: {
        jv operand = eval(r, x->a, s);
        jargs a;
        eval_args(r, x->list, x->nlist, s, &a);
        int res = run_test(r, operand, x->s, &a, x->line);
        v = jv_bool(x->flag ? !res : res);
        break;
    }
    case E_BIN: {
        jv l = eval(r, x->a, s);
        if (x->op == OP_AND) { v = truthy(l) ? eval(r, x->b, s) : l; break; }
        if (x->op == OP_OR) { v = truthy(l) ? l : eval(r, x->b, s); break; }
        jv rv = eval(r, x->b, s);
        v = binop(r, x->op, l, rv, x->line);
        break;
    }
    case E_UNARY: {
        jv a = eval(r, x->a, s);
        if (x->op == OP_NOT) { v = jv_bool(!truthy(a)); break; }
        if (!is_numlike(a)) rt_err(r, x->line, "unary '%c' needs a number, got %s", x->op == OP_NEG ? '-' : '+', type_name(a));
        double d = numval(a) * (x->op == OP_NEG ? -1 : 1);
        v = jv_num(d, a.t != JV_FLOAT);
        break;
    }
    case E_TERNARY: v = truthy(eval(r, x->a, s)) ? eval(r, x->b, s) : eval(r, x->c, s); break;
    case E_SELECT: v = truthy(eval(r, x->b, s)) ? eval(r, x->a, s) : UNDEF; break;
    case E_LIST:
    case E_TUPLE: {
        v = jv_array(&r->a, &r->f, (size_t)x->nlist);
        for (int i = 0; i < x->nlist; i++) jarr_push(&r->a, &r->f, v.u.a, eval(r, x->list[i], s));
        v.tuple = x->kind == E_TUPLE;
        break;
    }
    case E_DICT: {
        v = jv_object(&r->a, &r->f, 0);
        for (int i = 0; i < x->nlist; i++) {
            jv k = eval(r, x->list[i], s);
            if (k.t != JV_STR) rt_err(r, x->line, "dict keys must be strings, got %s", type_name(k));
            jobj_set(&r->a, &r->f, v.u.o, k.u.s->s, k.u.s->len, eval(r, x->list2[i], s));
        }
        break;
    }
    default:
        rt_err(r, x->line, "this construct cannot be used as an expression");
    }
    r->depth--;
    return v;
}

/* ---------------- statements ---------------- */
static void assign(R *r, const jnode *t, jv v, scope *s, int line) {
    if (t->kind == E_NAME) {
        set_var(r, s, t->s, v);
    } else if (t->kind == E_TUPLE) {
        if (v.t != JV_ARRAY) rt_err(r, line, "cannot unpack a %s", type_name(v));
        if ((int)v.u.a->n != t->nlist)
            rt_err(r, line, "too %s values to unpack (expected %d, got %zu)", (int)v.u.a->n < t->nlist ? "few" : "many",
                   t->nlist, v.u.a->n);
        for (int i = 0; i < t->nlist; i++) set_var(r, s, t->list[i]->s, v.u.a->v[i]);
    } else {
        jv obj = eval(r, t->a, s);
        if (obj.t != JV_NS) rt_err(r, line, "cannot set attribute '%s' on a %s (only on a namespace)", t->s, type_name(obj));
        jobj_set(&r->a, &r->f, obj.u.o, t->s, t->slen, v);
    }
}

static void exec_for(R *r, const jnode *x, scope *s) {
    scope *ls = new_scope(r, s);
    const jnode *test = NULL;
    jv it;
    if (x->b->kind == E_SELECT) {
        it = eval(r, x->b->a, ls);
        test = x->b->b;
    } else {
        it = eval(r, x->b, ls);
    }
    jv *cand;
    size_t nc;
    if (it.t == JV_ARRAY) {
        nc = it.u.a->n;
        cand = jalloc(&r->a, &r->f, (nc + 1) * sizeof(jv));
        if (nc) memcpy(cand, it.u.a->v, nc * sizeof(jv));
    } else if (it.t == JV_OBJECT) {
        nc = it.u.o->n;
        cand = jalloc(&r->a, &r->f, (nc + 1) * sizeof(jv));
        for (size_t i = 0; i < nc; i++) {
            cand[i].t = JV_STR;
            cand[i].u.s = it.u.o->k[i];
        }
    } else if (it.t == JV_STR) {
        size_t *off;
        nc = cp_offsets(r, it.u.s, &off);
        cand = jalloc(&r->a, &r->f, (nc + 1) * sizeof(jv));
        for (size_t i = 0; i < nc; i++) cand[i] = mkstr(r, it.u.s->s + off[i], off[i + 1] - off[i]);
    } else {
        rt_err(r, x->line, "cannot iterate over a value of type %s", type_name(it));
    }
    const jnode *tv = x->a;
    jv *items = cand;
    size_t n = nc;
    if (tv->kind == E_TUPLE || test) {
        items = jalloc(&r->a, &r->f, (nc + 1) * sizeof(jv));
        n = 0;
        for (size_t i = 0; i < nc; i++) {
            if (tv->kind == E_TUPLE) {
                if (cand[i].t != JV_ARRAY) rt_err(r, x->line, "cannot unpack a %s in a for loop", type_name(cand[i]));
                if ((int)cand[i].u.a->n != tv->nlist)
                    rt_err(r, x->line, "too %s values to unpack (expected %d, got %zu)",
                           (int)cand[i].u.a->n < tv->nlist ? "few" : "many", tv->nlist, cand[i].u.a->n);
            }
            if (test) {
                scope *ts = new_scope(r, ls);
                assign(r, tv, cand[i], ts, x->line);
                if (!truthy(eval(r, test, ts))) continue;
            }
            items[n++] = cand[i];
        }
    }
    int none = 1;
    for (size_t i = 0; i < n; i++) {
        tick(r, x->line);
        ls->li = (long)i;
        ls->ln = (long)n;
        ls->lprev = i > 0 ? items[i - 1] : UNDEF;
        ls->lnext = i + 1 < n ? items[i + 1] : UNDEF;
        jv lazy = UNDEF;
        lazy.tuple = LAZY_LOOP;
        set_var(r, ls, "loop", lazy);
        assign(r, tv, items[i], ls, x->line);
        exec_block(r, x->list, x->nlist, ls);
        if (r->ctl == 2) { r->ctl = 0; continue; }
        if (r->ctl == 1) { r->ctl = 0; break; }
        none = 0;
    }
    if (none) exec_block(r, x->list2, x->nlist2, ls);
}

static void exec_stmt(R *r, const jnode *x, scope *s) {
    tick(r, x->line);
    switch (x->kind) {
    case N_TEXT: jbuf_put(r->out, x->s, x->slen); break;
    case N_COMMENT: break;
    case N_OUTPUT: {
        jv v = eval(r, x->a, s);
        if (v.t != JV_NULL && v.t != JV_UNDEF) put_runtime_str(r, r->out, v, x->line);
        break;
    }
    case N_IF:
        if (truthy(eval(r, x->a, s))) exec_block(r, x->list, x->nlist, s);
        else exec_block(r, x->list2, x->nlist2, s);
        break;
    case N_FOR: exec_for(r, x, s); break;
    case N_SET: {
        jv v = x->flag ? render_capture(r, x->list, x->nlist, s) : eval(r, x->b, s);
        assign(r, x->a, v, s, x->line);
        break;
    }
    case N_MACRO: {
        jv f = {.t = JV_FUNC};
        f.u.f = jalloc(&r->a, &r->f, sizeof(jfunc));
        f.u.f->kind = F_MACRO;
        f.u.f->node = x;
        f.u.f->env = s;
        f.u.f->name = x->s;
        set_var(r, s, x->s, f);
        break;
    }
    case N_CALLBLOCK: {
        jv caller = {.t = JV_FUNC};
        caller.u.f = jalloc(&r->a, &r->f, sizeof(jfunc));
        caller.u.f->kind = F_CALLER;
        caller.u.f->node = x;
        caller.u.f->env = s;
        caller.u.f->name = "caller";
        const jnode *call = x->a;
        jargs a;
        eval_args(r, call->list, call->nlist, s, &a);
        jv fn = eval(r, call->a, s);
        if (fn.t == JV_FUNC && fn.u.f->kind == F_MACRO) r->next_caller = caller;
        jv v = call_value(r, fn, &a, x->line, callee_name(call->a));
        r->next_caller = UNDEF;
        if (v.t != JV_NULL && v.t != JV_UNDEF) put_runtime_str(r, r->out, v, x->line);
        break;
    }
    case N_FILTERBLOCK: {
        jv body = render_capture(r, x->list, x->nlist, s);
        jargs a;
        eval_args(r, x->a->list, x->a->nlist, s, &a);
        jv v = apply_filter(r, body, x->a->s, &a, s, x->line);
        if (v.t != JV_NULL && v.t != JV_UNDEF) put_runtime_str(r, r->out, v, x->line);
        break;
    }
    case N_BREAK: r->ctl = 1; break;
    case N_CONTINUE: r->ctl = 2; break;
    case N_DO: eval(r, x->a, s); break;
    default: {
        jv v = eval(r, x, s);
        if (v.t != JV_NULL && v.t != JV_UNDEF) put_runtime_str(r, r->out, v, x->line);
    }
    }
}

static void exec_block(R *r, jnode *const *body, int n, scope *s) {
    if (!n) return;
    enter(r, body[0]->line);
    for (int i = 0; i < n && !r->ctl; i++) exec_stmt(r, body[i], s);
    r->depth--;
}

/* ---------------- tests ---------------- */
static int run_test(R *r, jv v, const char *name, jargs *a, int line) {
    jv x = UNDEF;
    int has = arg(a, 0, NULL, &x);
    if (!strcmp(name, "defined")) return v.t != JV_UNDEF;
    if (!strcmp(name, "undefined")) return v.t == JV_UNDEF;
    if (!strcmp(name, "none")) return v.t == JV_NULL;
    if (!strcmp(name, "boolean")) return v.t == JV_BOOL;
    if (!strcmp(name, "true")) return v.t == JV_BOOL && v.u.b;
    if (!strcmp(name, "false")) return v.t == JV_BOOL && !v.u.b;
    if (!strcmp(name, "string")) return v.t == JV_STR;
    if (!strcmp(name, "number")) return is_num(v);
    if (!strcmp(name, "integer")) return v.t == JV_INT;
    if (!strcmp(name, "float")) return v.t == JV_FLOAT;
    if (!strcmp(name, "iterable")) return v.t == JV_ARRAY || v.t == JV_STR;
    if (!strcmp(name, "mapping")) return v.t == JV_OBJECT;
    if (!strcmp(name, "sequence")) return v.t == JV_ARRAY || v.t == JV_OBJECT || v.t == JV_STR;
    if (!strcmp(name, "callable")) return v.t == JV_FUNC;
    if (!strcmp(name, "escaped")) return 0;
    if (!strcmp(name, "odd") || !strcmp(name, "even")) {
        if (v.t != JV_INT) rt_err(r, line, "test '%s' needs an integer, got %s", name, type_name(v));
        int odd = fmod(v.u.n, 2) != 0;
        return name[0] == 'o' ? odd : !odd;
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (v.t != JV_STR) return 0;
        jv m = map_case(r, v, name[0] == 'u');
        return strict_eq(m, v);
    }
    if (!strcmp(name, "divisibleby")) {
        if (!has || !is_numlike(x) || !is_numlike(v)) rt_err(r, line, "test 'divisibleby' needs two numbers");
        return numval(x) != 0 && fmod(numval(v), numval(x)) == 0;
    }
    static const char *const cmp_names[][3] = {{"eq", "equalto", "=="}, {"ne", "!=", "!="}, {"lt", "lessthan", "<"},
                                               {"le", "<=", "<="}, {"gt", "greaterthan", ">"}, {"ge", ">=", ">="}};
    static const int cmp_ops[] = {OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE};
    for (int i = 0; i < 6; i++)
        for (int k = 0; k < 3; k++)
            if (!strcmp(name, cmp_names[i][k])) {
                if (!has) rt_err(r, line, "test '%s' needs an argument", name);
                return truthy(binop(r, cmp_ops[i], v, x, line));
            }
    if (!strcmp(name, "in")) {
        if (!has) rt_err(r, line, "test 'in' needs an argument");
        return truthy(binop(r, OP_IN, v, x, line));
    }
    if (!strcmp(name, "sameas")) return has && strict_eq(v, x) && (v.t != JV_STR || v.u.s == x.u.s || 1);
    jfail_throw(&r->f, PETREL_EUNSUPPORTED, line, "unknown test '%s'", name);
}

/* ---------------- filters ---------------- */
_Noreturn static void bad_operand(R *r, const char *filter, jv v, int line) {
    rt_err(r, line, "filter '%s' cannot be applied to a %s", filter, type_name(v));
}

static void put_join_str(R *r, jbuf *b, jv v, int line) {
    if (v.t == JV_NULL || v.t == JV_UNDEF) return;
    put_value_str(r, b, v, line);
}

/* attribute path "a.b.0" of an item (HF getAttributeValue) */
static jv attr_path(R *r, jv item, const jstr *path) {
    size_t i = 0;
    jv v = item;
    while (i <= path->len) {
        const char *dot = memchr(path->s + i, '.', path->len - i);
        size_t e = dot ? (size_t)(dot - path->s) : path->len;
        if (v.t == JV_OBJECT || v.t == JV_NS) {
            jv *p = jobj_get(v.u.o, path->s + i, e - i);
            v = p ? *p : UNDEF;
        } else if (v.t == JV_ARRAY) {
            char tmp[24];
            size_t n = e - i < 23 ? e - i : 23;
            memcpy(tmp, path->s + i, n);
            tmp[n] = 0;
            char *end;
            long k = strtol(tmp, &end, 10);
            if (end == tmp || k < 0 || (size_t)k >= v.u.a->n) return UNDEF;
            v = v.u.a->v[k];
        } else {
            return UNDEF;
        }
        if (!dot) break;
        i = e + 1;
    }
    (void)r;
    return v;
}

static void merge_sort(R *r, jv *v, jv *keys, size_t n, int cs, int rev, int line) {
    if (n < 2) return;
    size_t h = n / 2;
    merge_sort(r, v, keys, h, cs, rev, line);
    merge_sort(r, v + h, keys + h, n - h, cs, rev, line);
    jv *tv = jalloc(&r->a, &r->f, n * sizeof(jv)), *tk = jalloc(&r->a, &r->f, n * sizeof(jv));
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int c = cmp_values(r, keys[j], keys[i], cs, line);
        if (rev) c = -c;
        if (c < 0) { tv[k] = v[j]; tk[k++] = keys[j++]; }
        else { tv[k] = v[i]; tk[k++] = keys[i++]; }
    }
    while (i < h) { tv[k] = v[i]; tk[k++] = keys[i++]; }
    while (j < n) { tv[k] = v[j]; tk[k++] = keys[j++]; }
    memcpy(v, tv, n * sizeof(jv));
    memcpy(keys, tk, n * sizeof(jv));
}

static jv items_of(R *r, jv o) {
    jv out = jv_array(&r->a, &r->f, o.u.o->n);
    for (size_t i = 0; i < o.u.o->n; i++) {
        jv pr = jv_array(&r->a, &r->f, 2);
        jv k = {.t = JV_STR};
        k.u.s = o.u.o->k[i];
        jarr_push(&r->a, &r->f, pr.u.a, k);
        jarr_push(&r->a, &r->f, pr.u.a, o.u.o->v[i]);
        jarr_push(&r->a, &r->f, out.u.a, pr);
    }
    return out;
}

static jv dictsort(R *r, jv o, jargs *a, int line) {
    int cs = arg_bool(a, 0, "case_sensitive", 0);
    const jstr *by = arg_str(r, a, 1, "by", "dictsort", line);
    int rev = arg_bool(a, 2, "reverse", 0);
    int by_value = 0;
    if (by) {
        if (!strcmp(by->s, "value")) by_value = 1;
        else if (strcmp(by->s, "key")) rt_err(r, line, "dictsort: 'by' must be 'key' or 'value'");
    }
    jv it = items_of(r, o);
    size_t n = it.u.a->n;
    jv *keys = jalloc(&r->a, &r->f, (n + 1) * sizeof(jv));
    for (size_t i = 0; i < n; i++) keys[i] = it.u.a->v[i].u.a->v[by_value];
    merge_sort(r, it.u.a->v, keys, n, cs, rev, line);
    return it;
}

static jv to_list(R *r, jv v, const char *what, int line) {
    if (v.t == JV_ARRAY) return v;
    jv out = jv_array(&r->a, &r->f, 0);
    if (v.t == JV_STR) {
        size_t *off;
        size_t n = cp_offsets(r, v.u.s, &off);
        for (size_t i = 0; i < n; i++) jarr_push(&r->a, &r->f, out.u.a, mkstr(r, v.u.s->s + off[i], off[i + 1] - off[i]));
        return out;
    }
    if (v.t == JV_OBJECT) {
        for (size_t i = 0; i < v.u.o->n; i++) {
            jv k = {.t = JV_STR};
            k.u.s = v.u.o->k[i];
            jarr_push(&r->a, &r->f, out.u.a, k);
        }
        return out;
    }
    if (v.t == JV_UNDEF) return out;
    bad_operand(r, what, v, line);
}

static jv f_tojson(R *r, jv v, jargs *a, int line) {
    jjson_opts o = {.indent = -1, .undef_as_null = 1};
    jv x;
    /* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
    o.ensure_ascii = arg_bool(a, 0, "ensure_ascii", 0);
    if (arg(a, 1, "indent", &x) && x.t != JV_NULL && x.t != JV_UNDEF) {
        if (x.t != JV_INT) rt_err(r, line, "tojson: indent must be an integer");
        o.indent = x.u.n > 64 ? 64 : x.u.n < 0 ? 0 : (int)x.u.n;
    }
    if (arg(a, 2, "separators", &x) && x.t != JV_NULL && x.t != JV_UNDEF) {
        if (x.t != JV_ARRAY || x.u.a->n != 2 || x.u.a->v[0].t != JV_STR || x.u.a->v[1].t != JV_STR)
            rt_err(r, line, "tojson: separators must be a pair of strings");
        o.item_sep = x.u.a->v[0].u.s->s;
        o.key_sep = x.u.a->v[1].u.s->s;
    }
    o.sort_keys = arg_bool(a, 3, "sort_keys", 0);
    jbuf b;
    bufinit(r, &b);
    if (jv_to_json(&b, v, &o, 0)) rt_err(r, line, "tojson: cannot convert a function (or too deep a value) to JSON");
    return buf_str(r, &b);
}

static jv select_items(R *r, jv v, jargs *a, int attr_mode, int select, int line) {
    const char *fname = attr_mode ? (select ? "selectattr" : "rejectattr") : (select ? "select" : "reject");
    if (v.t == JV_UNDEF) return jv_array(&r->a, &r->f, 0);
    if (v.t != JV_ARRAY) bad_operand(r, fname, v, line);
    int off = attr_mode ? 1 : 0;
    const jstr *attr = NULL;
    if (attr_mode) {
        attr = arg_str(r, a, 0, "attribute", fname, line);
        if (!attr) rt_err(r, line, "%s needs an attribute name", fname);
    }
    const jstr *test = arg_str(r, a, off, NULL, fname, line);
    jargs ta = {0};
    if (a->np > off + 1) {
        ta.np = a->np - off - 1;
        ta.p = a->p + off + 1;
    }
    jv out = jv_array(&r->a, &r->f, 0);
    for (size_t i = 0; i < v.u.a->n; i++) {
        jv item = v.u.a->v[i], x = item;
        int res;
        if (attr_mode) {
            if (item.t != JV_OBJECT && item.t != JV_NS) rt_err(r, line, "%s can only be applied to a list of dicts", fname);
            jv *p = jobj_get(item.u.o, attr->s, attr->len);
            if (!p) { res = 0; goto decide; }
            x = *p;
        }
        res = test ? run_test(r, x, test->s, &ta, line) : truthy(x);
    decide:
        if (select ? res : !res) jarr_push(&r->a, &r->f, out.u.a, item);
    }
    return out;
}

static jv apply_filter(R *r, jv v, const char *name, jargs *a, scope *s, int line) {
    jv x;
    if (!strcmp(name, "safe")) return v;
    if (!strcmp(name, "tojson")) return f_tojson(r, v, a, line);
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        jv dv;
        if (!arg(a, 0, "default_value", &dv)) dv = mkstr(r, "", 0);
        int boolean = arg_bool(a, 1, "boolean", 0);
        return v.t == JV_UNDEF || (boolean && !truthy(v)) ? dv : v;
    }
    if (!strcmp(name, "string")) {
        if (v.t == JV_NULL) return mkcstr(r, "None");
        return to_str(r, v, line);
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        switch (v.t) {
        case JV_STR: return jv_num((double)utf16_len(v.u.s->s, v.u.s->len), 1);
        case JV_ARRAY: return jv_num((double)v.u.a->n, 1);
        case JV_OBJECT: return jv_num((double)v.u.o->n, 1);
        case JV_UNDEF: return jv_num(0, 1);
        default: bad_operand(r, name, v, line);
        }
    }
    if (!strcmp(name, "list")) return to_list(r, v, name, line);
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jv l = v.t == JV_STR ? to_list(r, v, name, line) : v;
        if (l.t != JV_ARRAY) bad_operand(r, name, v, line);
        if (!l.u.a->n) return UNDEF;
        return name[0] == 'f' ? l.u.a->v[0] : l.u.a->v[l.u.a->n - 1];
    }
    if (!strcmp(name, "reverse")) {
        if (v.t == JV_STR) {
            jv l = to_list(r, v, name, line);
            jbuf b;
            bufinit(r, &b);
            for (size_t i = l.u.a->n; i > 0; i--) jbuf_put(&b, l.u.a->v[i - 1].u.s->s, l.u.a->v[i - 1].u.s->len);
            return buf_str(r, &b);
        }
        if (v.t != JV_ARRAY) bad_operand(r, name, v, line);
        jv out = jv_array(&r->a, &r->f, v.u.a->n);
        for (size_t i = v.u.a->n; i > 0; i--) jarr_push(&r->a, &r->f, out.u.a, v.u.a->v[i - 1]);
        return out;
    }
    if (!strcmp(name, "sort")) {
        if (v.t != JV_ARRAY) bad_operand(r, name, v, line);
        int rev = arg_bool(a, 0, "reverse", 0), cs = arg_bool(a, 1, "case_sensitive", 0);
        jv at = UNDEF;
        arg(a, 2, "attribute", &at);
        size_t n = v.u.a->n;
        jv out = jv_array(&r->a, &r->f, n);
        jv *keys = jalloc(&r->a, &r->f, (n + 1) * sizeof(jv));
        for (size_t i = 0; i < n; i++) {
            jarr_push(&r->a, &r->f, out.u.a, v.u.a->v[i]);
            if (at.t == JV_STR) keys[i] = attr_path(r, v.u.a->v[i], at.u.s);
            else if (at.t == JV_INT) keys[i] = attr_path(r, v.u.a->v[i], to_str(r, at, line).u.s);
            else keys[i] = v.u.a->v[i];
        }
        merge_sort(r, out.u.a->v, keys, n, cs, rev, line);
        return out;
    }
    if (!strcmp(name, "join")) {
        const jstr *sep = arg_str(r, a, 0, "d", "join", line);
        if (!sep) sep = arg_str(r, a, -1, "separator", "join", line);
        jv at = UNDEF;
        arg(a, 1, "attribute", &at);
        jv l = v.t == JV_STR ? to_list(r, v, name, line) : v;
        if (l.t != JV_ARRAY) bad_operand(r, name, v, line);
        jbuf b;
        bufinit(r, &b);
        jbuf_put(&b, "", 0);
        for (size_t i = 0; i < l.u.a->n; i++) {
            if (i && sep) jbuf_put(&b, sep->s, sep->len);
            jv it = l.u.a->v[i];
            if (at.t == JV_STR) it = attr_path(r, it, at.u.s);
            put_join_str(r, &b, it, line);
        }
        return buf_str(r, &b);
    }
    if (!strcmp(name, "unique")) {
        if (v.t != JV_ARRAY) bad_operand(r, name, v, line);
        jv out = jv_array(&r->a, &r->f, 0);
        for (size_t i = 0; i < v.u.a->n; i++) {
            int dup = 0;
            for (size_t k = 0; k < out.u.a->n && !dup; k++) dup = strict_eq(out.u.a->v[k], v.u.a->v[i]);
            if (!dup) jarr_push(&r->a, &r->f, out.u.a, v.u.a->v[i]);
        }
        return out;
    }
    if (!strcmp(name, "upper") || !strcmp(name, "lower")) {
        if (v.t != JV_STR) bad_operand(r, name, v, line);
        return map_case(r, v, name[0] == 'u');
    }
    if (!strcmp(name, "title") || !strcmp(name, "capitalize") || !strcmp(name, "trim")) {
        if (v.t != JV_STR) bad_operand(r, name, v, line);
        jv m = method(r, v, name[0] == 't' && name[1] == 'r' ? "strip" : name);
        return call_method(r, m.u.f, a, line);
    }
    if (!strcmp(name, "replace")) {
        jv sv = v.t == JV_STR ? v : to_str(r, v, line);
        jv m = method(r, sv, "replace");
        return call_method(r, m.u.f, a, line);
    }
    if (!strcmp(name, "indent")) {
        if (v.t != JV_STR) bad_operand(r, name, v, line);
        jv w = jv_num(4, 1);
        arg(a, 0, "width", &w);
        int first = arg_bool(a, 1, "first", 0), blank = arg_bool(a, 2, "blank", 0);
        jbuf ind;
        bufinit(r, &ind);
        if (w.t == JV_STR) jbuf_put(&ind, w.u.s->s, w.u.s->len);
        else if (w.t == JV_INT) for (double k = 0; k < w.u.n && k < 1000; k++) jbuf_putc(&ind, ' ');
        else rt_err(r, line, "indent: width must be an integer or a string");
        jbuf b;
        bufinit(r, &b);
        jbuf_put(&b, "", 0);
        const jstr *str = v.u.s;
        size_t i = 0;
        int ln = 0;
        for (;;) {
            const char *nl = memchr(str->s + i, '\n', str->len - i);
            size_t e = nl ? (size_t)(nl - str->s) : str->len;
            if (!((!first && ln == 0) || (!blank && e == i))) jbuf_put(&b, ind.p, ind.len);
            jbuf_put(&b, str->s + i, e - i);
            if (!nl) break;
            jbuf_putc(&b, '\n');
            i = e + 1;
            ln++;
        }
        return buf_str(r, &b);
    }
    if (!strcmp(name, "int") || !strcmp(name, "float")) {
        int is_int = name[0] == 'i';
        jv dv = is_int ? jv_num(0, 1) : jv_num(0, 0);
        arg(a, 0, "default", &dv);
        if (v.t == JV_STR) {
            char *end;
            const char *p = v.u.s->s;
            size_t cl;
            while (*p && js_space(utf8_dec(p, strlen(p), 0, &cl))) p += cl;
            double d;
            if (is_int) {
                const char *q = p;
                if (*q == '+' || *q == '-') q++;
                if (!(*q >= '0' && *q <= '9')) return dv;
                d = strtod(p, &end); /* parseInt: leading digits only */
                char tmp[400];
                size_t n = 0;
                if (*p == '+' || *p == '-') tmp[n++] = *p, p++;
                while (*p >= '0' && *p <= '9' && n < sizeof tmp - 1) tmp[n++] = *p++;
                tmp[n] = 0;
                d = strtod(tmp, NULL);
                return jv_num(d == 0 ? 0 : d, 1);
            }
            d = strtod(p, &end);
            if (end == p || (isnan(d) && strncmp(p, "NaN", 3))) return dv;
            if (isinf(d) && strncmp(p + (*p == '-' || *p == '+'), "Infinity", 8)) {
                /* strtod accepts "inf"; parseFloat does not */
                return dv;
            }
            return jv_num(d, 0);
        }
        if (is_num(v)) return is_int ? jv_num(trunc(v.u.n) + 0.0, 1) : jv_num(v.u.n, 0);
        if (v.t == JV_BOOL) return jv_num(v.u.b, is_int);
        if (v.t == JV_UNDEF || v.t == JV_NULL) return dv;
        bad_operand(r, name, v, line);
    }
    if (!strcmp(name, "abs")) {
        if (!is_num(v)) bad_operand(r, name, v, line);
        return jv_num(fabs(v.u.n), v.t == JV_INT);
    }
    if (!strcmp(name, "round")) {
        if (!is_numlike(v)) bad_operand(r, name, v, line);
        double prec = arg_num(r, a, 0, "precision", 0, "round", line);
        const jstr *m = arg_str(r, a, 1, "method", "round", line);
        double d = numval(v), p10 = pow(10, prec);
        if (!m || !strcmp(m->s, "common")) d = round(d * p10) / p10;
        else if (!strcmp(m->s, "ceil")) d = ceil(d * p10) / p10;
        else if (!strcmp(m->s, "floor")) d = floor(d * p10) / p10;
        else rt_err(r, line, "round: method must be common, ceil or floor");
        return jv_num(d, 0);
    }
    if (!strcmp(name, "bool")) return jv_bool(truthy(v));
    if (!strcmp(name, "items")) {
        if (v.t == JV_UNDEF) return jv_array(&r->a, &r->f, 0);
        if (v.t != JV_OBJECT && v.t != JV_NS) bad_operand(r, name, v, line);
        return items_of(r, v);
    }
    if (!strcmp(name, "dictsort")) {
        if (v.t != JV_OBJECT) bad_operand(r, name, v, line);
        return dictsort(r, v, a, line);
    }
    if (!strcmp(name, "selectattr")) return select_items(r, v, a, 1, 1, line);
    if (!strcmp(name, "rejectattr")) return select_items(r, v, a, 1, 0, line);
    if (!strcmp(name, "select")) return select_items(r, v, a, 0, 1, line);
    if (!strcmp(name, "reject")) return select_items(r, v, a, 0, 0, line);
    if (!strcmp(name, "map")) {
        if (v.t == JV_UNDEF) return jv_array(&r->a, &r->f, 0);
        jv l = to_list(r, v, name, line);
        jv out = jv_array(&r->a, &r->f, l.u.a->n);
        jv at, dv = UNDEF;
        int has_dv = arg(a, -1, "default", &dv);
        if (arg(a, -1, "attribute", &at)) {
            if (at.t != JV_STR) rt_err(r, line, "map: attribute must be a string");
            for (size_t i = 0; i < l.u.a->n; i++) {
                jv it = attr_path(r, l.u.a->v[i], at.u.s);
                jarr_push(&r->a, &r->f, out.u.a, it.t == JV_UNDEF && has_dv ? dv : it);
            }
            return out;
        }
        const jstr *fname = arg_str(r, a, 0, NULL, "map", line);
        if (!fname) rt_err(r, line, "map needs a filter name or attribute=");
        jargs fa = {0};
        if (a->np > 1) { fa.np = a->np - 1; fa.p = a->p + 1; }
        fa.nk = a->nk;
        fa.kn = a->kn;
        fa.kv = a->kv;
        for (size_t i = 0; i < l.u.a->n; i++)
            jarr_push(&r->a, &r->f, out.u.a, apply_filter(r, l.u.a->v[i], fname->s, &fa, s, line));
        return out;
    }
    if (!strcmp(name, "sum") || !strcmp(name, "min") || !strcmp(name, "max")) {
        jv l = to_list(r, v, name, line);
        jv at = UNDEF;
        arg(a, name[1] == 'u' ? 0 : 1, "attribute", &at);
        if (name[1] == 'u') {
            jv acc = jv_num(0, 1);
            arg(a, 1, "start", &acc);
            for (size_t i = 0; i < l.u.a->n; i++) {
                jv it = at.t == JV_STR ? attr_path(r, l.u.a->v[i], at.u.s) : l.u.a->v[i];
                acc = binop(r, OP_ADD, acc, it, line);
            }
            return acc;
        }
        int cs = arg_bool(a, 0, "case_sensitive", 0);
        jv best = UNDEF;
        for (size_t i = 0; i < l.u.a->n; i++) {
            jv it = l.u.a->v[i];
            jv k = at.t == JV_STR ? attr_path(r, it, at.u.s) : it;
            jv bk = at.t == JV_STR && best.t != JV_UNDEF ? attr_path(r, best, at.u.s) : best;
            if (best.t == JV_UNDEF) { best = it; continue; }
            int c = cmp_values(r, k, bk, cs, line);
            if (name[1] == 'i' ? c < 0 : c > 0) best = it;
        }
        return best;
    }
    if (!strcmp(name, "attr")) {
        if (!arg(a, 0, "name", &x)) rt_err(r, line, "attr needs a name");
        return get_member(r, v, x, line);
    }
    if (!strcmp(name, "escape") || !strcmp(name, "e") || !strcmp(name, "forceescape")) {
        jv sv = to_str(r, v, line);
        jbuf b;
        bufinit(r, &b);
        jbuf_put(&b, "", 0);
        for (size_t i = 0; i < sv.u.s->len; i++) {
            char c = sv.u.s->s[i];
            switch (c) {
            case '&': jbuf_puts(&b, "&amp;"); break;
            case '<': jbuf_puts(&b, "&lt;"); break;
            case '>': jbuf_puts(&b, "&gt;"); break;
            case '"': jbuf_puts(&b, "&#34;"); break;
            case '\'': jbuf_puts(&b, "&#39;"); break;
            default: jbuf_putc(&b, c);
            }
        }
        return buf_str(r, &b);
    }
    if (!strcmp(name, "wordcount")) {
        if (v.t != JV_STR) bad_operand(r, name, v, line);
        jv parts = str_split(r, v.u.s, NULL, -1, 0);
        return jv_num((double)parts.u.a->n, 1);
    }
    if (!strcmp(name, "batch")) {
        jv l = to_list(r, v, name, line);
        double sz = arg_num(r, a, 0, "linecount", 0, "batch", line);
        if (!(sz >= 1)) rt_err(r, line, "batch: size must be at least 1");
        jv out = jv_array(&r->a, &r->f, 0), cur = UNDEF;
        for (size_t i = 0; i < l.u.a->n; i++) {
            if (cur.t == JV_UNDEF || (double)cur.u.a->n >= sz) {
                cur = jv_array(&r->a, &r->f, 0);
                jarr_push(&r->a, &r->f, out.u.a, cur);
            }
            jarr_push(&r->a, &r->f, cur.u.a, l.u.a->v[i]);
        }
        return out;
    }
    jfail_throw(&r->f, PETREL_EUNSUPPORTED, line, "unknown filter '%s'", name);
}

/* ---------------- methods ---------------- */
static long cp_index(const jstr *s, size_t byte_off) {
    size_t k = 0, cl;
    for (size_t i = 0; i < byte_off && i < s->len; i += cl) { utf8_dec(s->s, s->len, i, &cl); k++; }
    return (long)k;
}

static jv str_format(R *r, const jstr *f, jargs *a, int line) {
    jbuf b;
    bufinit(r, &b);
    jbuf_put(&b, "", 0);
    int auto_i = 0;
    for (size_t i = 0; i < f->len; i++) {
        char c = f->s[i];
        if (c == '{' && i + 1 < f->len && f->s[i + 1] == '{') { jbuf_putc(&b, '{'); i++; continue; }
        if (c == '}' && i + 1 < f->len && f->s[i + 1] == '}') { jbuf_putc(&b, '}'); i++; continue; }
        if (c != '{') { jbuf_putc(&b, c); continue; }
        const char *end = memchr(f->s + i, '}', f->len - i);
        if (!end) rt_err(r, line, "format: unmatched '{'");
        size_t fs = i + 1, fe = (size_t)(end - f->s);
        jv v = UNDEF;
        if (fe == fs) {
            if (!arg(a, auto_i++, NULL, &v)) rt_err(r, line, "format: not enough arguments");
        } else if (f->s[fs] >= '0' && f->s[fs] <= '9') {
            if (!arg(a, (int)clamp_l(strtod(f->s + fs, NULL) > 1e6 ? 1e6 : strtod(f->s + fs, NULL)), NULL, &v)) rt_err(r, line, "format: argument index out of range");
        } else {
            char nm[64];
            size_t n = fe - fs < 63 ? fe - fs : 63;
            memcpy(nm, f->s + fs, n);
            nm[n] = 0;
            if (strchr(nm, ':') || strchr(nm, '!')) rt_err(r, line, "format: format specs are not supported");
            if (!arg(a, -1, nm, &v)) rt_err(r, line, "format: no argument named '%s'", nm);
        }
        put_runtime_str(r, &b, v, line);
        i = fe;
    }
    return buf_str(r, &b);
}

static jv call_method(R *r, jfunc *fn, jargs *a, int line) {
    jv self = fn->self;
    const char *m = fn->name;
    if (self.t == JV_STR) {
        const jstr *s = self.u.s;
        if (!strcmp(m, "upper") || !strcmp(m, "lower")) return map_case(r, self, m[0] == 'u');
        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
            const jstr *chars = arg_str(r, a, 0, "chars", m, line);
            return strip_str(r, self, m[0] != 'r', m[0] != 'l', chars);
        }
        if (!strcmp(m, "title")) {
            jbuf b;
            bufinit(r, &b);
            jbuf_put(&b, "", 0);
            int prev_word = 0;
            for (size_t i = 0; i < s->len; i++) {
                char c = s->s[i];
                int w = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
                jbuf_putc(&b, w && !prev_word && c >= 'a' && c <= 'z' ? (char)(c - 32) : c);
                prev_word = w;
            }
            return buf_str(r, &b);
        }
        if (!strcmp(m, "capitalize")) {
            if (!s->len) return self;
            size_t cl;
            uint32_t c = utf8_dec(s->s, s->len, 0, &cl);
            jbuf b;
            bufinit(r, &b);
            char u[4];
            if (cl == 1 && c >= 0x80) jbuf_put(&b, s->s, 1);
            else jbuf_put(&b, u, utf8_enc((uint32_t)utf8proc_toupper((utf8proc_int32_t)c), u));
            jbuf_put(&b, s->s + cl, s->len - cl);
            return buf_str(r, &b);
        }
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            jv p;
            if (!arg(a, 0, NULL, &p)) rt_err(r, line, "%s() needs an argument", m);
            int ends = m[0] == 'e';
            jv *cands = &p;
            size_t nc = 1;
            if (p.t == JV_ARRAY) { cands = p.u.a->v; nc = p.u.a->n; }
            for (size_t i = 0; i < nc; i++) {
                if (cands[i].t != JV_STR) rt_err(r, line, "%s() argument must be a string or a tuple of strings", m);
                const jstr *q = cands[i].u.s;
                if (q->len <= s->len && !memcmp(s->s + (ends ? s->len - q->len : 0), q->s, q->len)) return jv_bool(1);
            }
            return jv_bool(0);
        }
        if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
            const jstr *sep = arg_str(r, a, 0, "sep", m, line);
            double maxsplit = arg_num(r, a, 1, "maxsplit", -1, m, line);
            if (sep && !sep->len) rt_err(r, line, "%s(): empty separator", m);
            return str_split(r, s, sep, clamp_l(maxsplit), m[0] == 'r');
        }
        if (!strcmp(m, "replace")) {
            const jstr *o = arg_str(r, a, 0, "old", m, line), *n = arg_str(r, a, 1, "new", m, line);
            if (!o || !n) rt_err(r, line, "replace() needs two string arguments");
            double cnt = arg_num(r, a, 2, "count", -1, m, line);
            return str_replace(r, s, o, n, cnt);
        }
        if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "count")) {
            const jstr *sub = arg_str(r, a, 0, "sub", m, line);
            if (!sub) rt_err(r, line, "%s() needs a string argument", m);
            if (!strcmp(m, "count")) {
                long k = 0;
                if (!sub->len) return jv_num((double)cp_index(s, s->len) + 1, 1);
                for (const char *q = s->s; (q = mem_find(q, s->len - (size_t)(q - s->s), sub->s, sub->len)); q += sub->len) k++;
                return jv_num((double)k, 1);
            }
            const char *q = NULL;
            if (m[0] == 'r') {
                for (size_t k = s->len + 1; k-- > 0;)
                    if (k + sub->len <= s->len && !memcmp(s->s + k, sub->s, sub->len)) { q = s->s + k; break; }
            } else {
                q = mem_find(s->s, s->len, sub->s, sub->len);
            }
            if (!q && m[0] == 'i') rt_err(r, line, "index(): substring not found");
            return jv_num(q ? (double)cp_index(s, (size_t)(q - s->s)) : -1, 1);
        }
        if (!strcmp(m, "join")) {
            jv l;
            if (!arg(a, 0, NULL, &l)) rt_err(r, line, "join() needs a list");
            l = to_list(r, l, "join", line);
            jbuf b;
            bufinit(r, &b);
            jbuf_put(&b, "", 0);
            for (size_t i = 0; i < l.u.a->n; i++) {
                if (i) jbuf_put(&b, s->s, s->len);
                put_join_str(r, &b, l.u.a->v[i], line);
            }
            return buf_str(r, &b);
        }
        if (!strcmp(m, "splitlines")) {
            jv out = jv_array(&r->a, &r->f, 0);
            size_t i = 0;
            while (i < s->len) {
                size_t e = i;
                while (e < s->len && s->s[e] != '\n' && s->s[e] != '\r') e++;
                jarr_push(&r->a, &r->f, out.u.a, mkstr(r, s->s + i, e - i));
                if (e < s->len && s->s[e] == '\r' && e + 1 < s->len && s->s[e + 1] == '\n') e++;
                i = e + 1;
            }
            return out;
        }
        if (!strncmp(m, "is", 2)) {
            if (!s->len) return jv_bool(0);
            int has_cased = 0;
            size_t cl;
            for (size_t i = 0; i < s->len; i += cl) {
                uint32_t c = utf8_dec(s->s, s->len, i, &cl);
                utf8proc_category_t cat = utf8proc_category((utf8proc_int32_t)c);
                int alpha = cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
                int digit = cat == UTF8PROC_CATEGORY_ND;
                int ok;
                if (!strcmp(m, "isdigit")) ok = digit;
                else if (!strcmp(m, "isalpha")) ok = alpha;
                else if (!strcmp(m, "isalnum")) ok = alpha || digit;
                else if (!strcmp(m, "isspace")) ok = js_space(c);
                else {
                    int up = cat == UTF8PROC_CATEGORY_LU, lo = cat == UTF8PROC_CATEGORY_LL;
                    if (up || lo) has_cased = 1;
                    ok = m[2] == 'u' ? !lo : !up;
                }
                if (!ok) return jv_bool(0);
            }
            return jv_bool(strcmp(m, "isupper") && strcmp(m, "islower") ? 1 : has_cased);
        }
        if (!strcmp(m, "removeprefix") || !strcmp(m, "removesuffix")) {
            const jstr *p = arg_str(r, a, 0, NULL, m, line);
            if (!p) rt_err(r, line, "%s() needs a string", m);
            int suf = m[6] == 's';
            if (p->len <= s->len && !memcmp(s->s + (suf ? s->len - p->len : 0), p->s, p->len))
                return mkstr(r, s->s + (suf ? 0 : p->len), s->len - p->len);
            return self;
        }
        if (!strcmp(m, "format")) return str_format(r, s, a, line);
    } else if (self.t == JV_OBJECT) {
        jobj *o = self.u.o;
        if (!strcmp(m, "get")) {
            jv k, d = NONE;
            if (!arg(a, 0, "key", &k)) rt_err(r, line, "get() needs a key");
            arg(a, 1, "default", &d);
            if (k.t != JV_STR) rt_err(r, line, "get(): dict keys are strings, got %s", type_name(k));
            jv *p = jobj_get(o, k.u.s->s, k.u.s->len);
            return p ? *p : d;
        }
        if (!strcmp(m, "items")) return items_of(r, self);
        if (!strcmp(m, "keys") || !strcmp(m, "values")) {
            jv out = jv_array(&r->a, &r->f, o->n);
            for (size_t i = 0; i < o->n; i++) {
                jv k = {.t = JV_STR};
                k.u.s = o->k[i];
                jarr_push(&r->a, &r->f, out.u.a, m[0] == 'k' ? k : o->v[i]);
            }
            return out;
        }
        if (!strcmp(m, "dictsort")) return dictsort(r, self, a, line);
    } else if (self.t == JV_ARRAY) {
        jarr *l = self.u.a;
        jv x;
        if (!strcmp(m, "append")) {
            if (!arg(a, 0, NULL, &x)) rt_err(r, line, "append() needs an argument");
            jarr_push(&r->a, &r->f, l, x);
            return NONE;
        }
        if (!strcmp(m, "extend")) {
            if (!arg(a, 0, NULL, &x)) rt_err(r, line, "extend() needs a list");
            x = to_list(r, x, "extend", line);
            size_t n = x.u.a->n;
            for (size_t i = 0; i < n; i++) jarr_push(&r->a, &r->f, l, x.u.a->v[i]);
            return NONE;
        }
        if (!strcmp(m, "pop")) {
            if (!l->n) rt_err(r, line, "pop from an empty list");
            double i = arg_num(r, a, 0, "index", -1, "pop", line);
            long k = clamp_l(i);
            if (k < 0) k += (long)l->n;
            if (k < 0 || k >= (long)l->n) rt_err(r, line, "pop index out of range");
            jv out = l->v[k];
            memmove(l->v + k, l->v + k + 1, (l->n - (size_t)k - 1) * sizeof(jv));
            l->n--;
            return out;
        }
        if (!strcmp(m, "insert")) {
            double i = arg_num(r, a, 0, "index", 0, "insert", line);
            if (!arg(a, 1, NULL, &x)) rt_err(r, line, "insert() needs an index and a value");
            long k = clamp_l(i), n = (long)l->n;
            if (k < 0) k += n;
            if (k < 0) k = 0;
            if (k > n) k = n;
            jarr_push(&r->a, &r->f, l, x);
            memmove(l->v + k + 1, l->v + k, (size_t)(n - k) * sizeof(jv));
            l->v[k] = x;
            return NONE;
        }
        if (!strcmp(m, "index") || !strcmp(m, "count")) {
            if (!arg(a, 0, NULL, &x)) rt_err(r, line, "%s() needs an argument", m);
            long cnt = 0;
            for (size_t i = 0; i < l->n; i++)
                if (loose_eq(r, l->v[i], x, line)) {
                    if (m[0] == 'i') return jv_num((double)i, 1);
                    cnt++;
                }
            if (m[0] == 'i') rt_err(r, line, "index(): value not in list");
            return jv_num((double)cnt, 1);
        }
    }
    rt_err(r, line, "unknown method '%s' of a %s", m, type_name(self));
}

/* ---------------- entry points ---------------- */
static void def_builtin(R *r, scope *g, const char *name, int id) {
    jv f = {.t = JV_FUNC};
    f.u.f = jalloc(&r->a, &r->f, sizeof(jfunc));
    f.u.f->kind = F_BUILTIN;
    f.u.f->id = id;
    f.u.f->name = name;
    set_var(r, g, name, f);
}

int jinja_compile(const char *src, size_t len, jinja_template **out, petrel_error *err) {
    *out = NULL;
    if (!src && len) return pt_err(err, PETREL_EINVAL, "jinja_compile: no template text");
    jinja_template *t = calloc(1, sizeof *t);
    if (!t) return pt_err(err, PETREL_ENOMEM, "out of memory");
    jarena_init(&t->a, 0);
    jfail f = {.err = err};
    petrel_error local;
    if (!err) f.err = &local;
    if (setjmp(f.env)) {
        jinja_free(t);
        return f.err->code;
    }
    jtok *toks;
    size_t nt;
    jinja_lex(&t->a, &f, src ? src : "", len, &toks, &nt);
    jinja_parse(&t->a, &f, toks, nt, &t->body, &t->n_body);
    *out = t;
    return 0;
}

void jinja_free(jinja_template *t) {
    if (!t) return;
    jarena_free(&t->a);
    free(t);
}

int jinja_render_compiled(const jinja_template *t, const cJSON *vars, const jinja_limits *limits, char **out,
                          size_t *out_len, petrel_error *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!t) return pt_err(err, PETREL_EINVAL, "jinja_render: no template");
    if (vars && !cJSON_IsObject(vars) && !cJSON_IsNull(vars))
        return pt_err(err, PETREL_EINVAL, "jinja_render: variables must be a JSON object");
    R *r = calloc(1, sizeof *r);
    if (!r) return pt_err(err, PETREL_ENOMEM, "out of memory");
    petrel_error local;
    r->f.err = err ? err : &local;
    if (limits) r->lim = *limits;
    if (!r->lim.max_output) r->lim.max_output = (size_t)64 << 20;
    if (!r->lim.max_memory) r->lim.max_memory = (size_t)512 << 20;
    if (!r->lim.max_steps) r->lim.max_steps = 200000000ull;
    if (!r->lim.max_depth) r->lim.max_depth = 400;
    jarena_init(&r->a, r->lim.max_memory);
    if (setjmp(r->f.env)) {
        int code = r->f.err->code;
        jarena_free(&r->a);
        free(r);
        return code;
    }
    scope *g = new_scope(r, NULL);
    def_builtin(r, g, "namespace", B_NAMESPACE);
    def_builtin(r, g, "range", B_RANGE);
    def_builtin(r, g, "raise_exception", B_RAISE);
    def_builtin(r, g, "strftime_now", B_STRFTIME);
    def_builtin(r, g, "dict", B_DICT);
    set_var(r, g, "true", jv_bool(1));
    set_var(r, g, "false", jv_bool(0));
    set_var(r, g, "none", NONE);
    set_var(r, g, "True", jv_bool(1));
    set_var(r, g, "False", jv_bool(0));
    set_var(r, g, "None", NONE);
    if (vars && cJSON_IsObject(vars))
        for (const cJSON *c = vars->child; c; c = c->next) {
            if (!c->string) continue;
            jstr *k = jstr_new(&r->a, &r->f, c->string, strlen(c->string));
            set_var(r, g, k->s, jv_from_cjson(&r->a, &r->f, c, 0));
        }
    jbuf b;
    bufinit(r, &b);
    r->out = &b;
    exec_block(r, t->body, t->n_body, g);
    char *res = malloc(b.len + 1);
    if (!res) {
        jarena_free(&r->a);
        free(r);
        return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    if (b.len) memcpy(res, b.p, b.len);
    res[b.len] = 0;
    *out = res;
    if (out_len) *out_len = b.len;
    jarena_free(&r->a);
    free(r);
    return 0;
}

int jinja_render(const char *tmpl, size_t len, const cJSON *vars, char **out, size_t *out_len, petrel_error *err) {
    jinja_template *t;
    *out = NULL;
    int rc = jinja_compile(tmpl, len, &t, err);
    if (rc < 0) return rc;
    rc = jinja_render_compiled(t, vars, NULL, out, out_len, err);
    jinja_free(t);
    return rc;
}
