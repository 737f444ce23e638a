/* jinja_internal.h: shared pieces of the Jinja interpreter (jinja_*.c): the arena, runtime
 * values, tokens, the syntax tree and the error exit. Not part of the public API. */
#ifndef PETREL_TEXT_JINJA_INTERNAL_H
#define PETREL_TEXT_JINJA_INTERNAL_H
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "text/jinja.h"

/* ---- arena: every value, string and tree node of one compile or render lives in one ---- */
typedef struct jarena_chunk jarena_chunk;
typedef struct jarena {
    jarena_chunk *head;
    size_t used_total, cap; /* cap: budget in bytes, 0 = unlimited */
    void *last;             /* last allocation (may grow in place) */
    size_t last_size;
} jarena;

/* The failure exit shared by compile and render: errors longjmp to env after filling err. */
typedef struct jfail {
    jmp_buf env;
    petrel_error *err;
} jfail;

_Noreturn void jfail_throw(jfail *f, int code, int line, const char *fmt, ...) PT_PRINTF(4, 5);

void jarena_init(jarena *a, size_t cap);
void jarena_free(jarena *a);
/* Returns NULL when the budget is exceeded or malloc fails. Zeroed memory. */
void *jarena_alloc(jarena *a, size_t n);
/* The same without zeroing (for bytes about to be overwritten). */
void *jarena_alloc_raw(jarena *a, size_t n);
/* Grows p (from jarena_alloc, old size old) to n bytes, keeping its content (the new tail is
 * not zeroed); in place when it was the last block. */
void *jarena_grow(jarena *a, void *p, size_t old, size_t n);

/* ---- values ---- */
typedef enum {
    JV_UNDEF = 0, JV_NULL, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_ARRAY, JV_OBJECT, JV_NS, JV_FUNC
} jv_type;

typedef struct jstr { size_t len; const char *s; } jstr; /* s is NUL-terminated too */
typedef struct jarr jarr;
typedef struct jobj jobj;
typedef struct jfunc jfunc;

typedef struct jv {
    uint8_t t;
    uint8_t tuple; /* an array made by a tuple literal (only affects nothing visible) */
    union {
        double n; /* JV_INT and JV_FLOAT: JavaScript numbers, as @huggingface/jinja */
        int b;
        jstr *s;
        jarr *a;
        jobj *o; /* JV_OBJECT and JV_NS */
        jfunc *f;
    } u;
} jv;

struct jarr { size_t n, cap; jv *v; };
struct jobj { size_t n, cap; jstr **k; jv *v; };

/* ---- tokens ---- */
typedef enum {
    TK_TEXT, TK_NUM, TK_STR, TK_IDENT, TK_EQUALS, TK_LPAREN, TK_RPAREN, TK_OPEN_STMT,
    TK_CLOSE_STMT, TK_OPEN_EXPR, TK_CLOSE_EXPR, TK_LBRACKET, TK_RBRACKET, TK_LBRACE, TK_RBRACE,
    TK_COMMA, TK_DOT, TK_COLON, TK_PIPE, TK_ADD, TK_MUL, TK_POW, TK_CMP, TK_UNARY, TK_COMMENT,
    TK_EOF
} jtok_type;

typedef struct jtok {
    uint8_t type;
    int line;
    const char *s; /* value (arena, NUL-terminated): text, literal, identifier, operator */
    size_t len;
} jtok;

/* Preprocesses and tokenizes src into arena memory; throws on a lexical error. */
void jinja_lex(jarena *a, jfail *f, const char *src, size_t len, jtok **out, size_t *n_out);

/* ---- syntax tree ---- */
typedef enum {
    /* statements */
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_MACRO, N_CALLBLOCK, N_FILTERBLOCK, N_BREAK,
    N_CONTINUE, N_DO, N_COMMENT,
    /* expressions */
    E_STR, E_INT, E_FLOAT, E_NAME, E_MEMBER, E_SLICE, E_CALL, E_FILTER, E_TEST, E_BIN, E_UNARY,
    E_TERNARY, E_SELECT, E_LIST, E_TUPLE, E_DICT, E_KWARG, E_SPREAD, E_KWSPREAD
} jnode_kind;

typedef enum {
    OP_NONE, OP_OR, OP_AND, OP_NOT, OP_IN, OP_NOTIN, OP_EQ, OP_NE, OP_LT, OP_GT, OP_LE, OP_GE,
    OP_ADD, OP_SUB, OP_CONCAT, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_NEG, OP_POS
} jop;

typedef struct jnode jnode;
struct jnode {
    uint8_t kind, op;
    uint8_t flag;  /* E_MEMBER: computed ([]); E_TEST: negated; N_SET: block form */
    int line;
    const char *s; /* name / literal text */
    size_t slen;
    double num;
    jnode *a, *b, *c, *d;
    jnode **list;  int nlist;  /* body, args, items, dict keys */
    jnode **list2; int nlist2; /* else body, dict values */
    struct jstr *str; /* E_STR and E_MEMBER: s as a ready string value */
};

/* Parses tokens into a program (N_* list); throws on a syntax error. */
void jinja_parse(jarena *a, jfail *f, const jtok *toks, size_t n, jnode ***body, int *n_body);

/* ---- strings, numbers and JSON (jinja_value.c) ---- */
/* A growable byte buffer in an arena; throws via f when the arena or max is exceeded. */
typedef struct jbuf {
    jarena *a;
    jfail *f;
    char *p;
    size_t len, cap, max;
} jbuf;
void jbuf_init(jbuf *b, jarena *a, jfail *f, size_t max);
void jbuf_put(jbuf *b, const char *s, size_t n);
void jbuf_puts(jbuf *b, const char *s);
void jbuf_putc(jbuf *b, char c);

void *jalloc(jarena *a, jfail *f, size_t n); /* jarena_alloc or throw ENOMEM */
jstr *jstr_new(jarena *a, jfail *f, const char *s, size_t n);
jv jv_str(jarena *a, jfail *f, const char *s, size_t n);
jv jv_num(double n, int is_int);
jv jv_bool(int b);
jv jv_array(jarena *a, jfail *f, size_t cap);
jv jv_object(jarena *a, jfail *f, int ns);
void jarr_push(jarena *a, jfail *f, jarr *arr, jv v);
jv *jobj_get(const jobj *o, const char *k, size_t klen);
void jobj_set(jarena *a, jfail *f, jobj *o, const char *k, size_t klen, jv v);
/* The same with a key string that outlives the object (not copied). */
void jobj_set_key(jarena *a, jfail *f, jobj *o, const char *k, size_t klen, jstr *key, jv v);

/* JavaScript Number.prototype.toString of d into buf (>= 32 bytes). */
void js_num_str(double d, char *buf);
/* Decodes one UTF-8 code point at s[i] (invalid bytes decode as themselves, length 1). */
uint32_t utf8_dec(const char *s, size_t len, size_t i, size_t *clen);
size_t utf8_enc(uint32_t cp, char *out);
/* Start of the code point that ends at s[end-1]. */
size_t utf8_prev(const char *s, size_t end);
/* JavaScript's \s (String.prototype.trim's set). */
int js_space(uint32_t cp);

typedef struct jjson_opts {
    int indent;    /* < 0: none */
    int ensure_ascii, sort_keys, undef_as_null;
    const char *item_sep, *key_sep; /* NULL: defaults */
} jjson_opts;
/* JSON of v as @huggingface/jinja's toJSON; returns 0, or -1 for a function value inside. */
int jv_to_json(jbuf *b, jv v, const jjson_opts *o, int depth);
/* cJSON -> value (numbers integral -> JV_INT as JavaScript's Number.isInteger). */
jv jv_from_cjson(jarena *a, jfail *f, const cJSON *j, int depth);
#endif
