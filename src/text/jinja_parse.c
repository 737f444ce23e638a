/* jinja_parse.c: tokens -> syntax tree. Statement set: set (also block set and ns.attr and
 * tuple targets), if/elif/else, for/else (with "for x in xs if cond", break, continue),
 * macro, call blocks, filter blocks, do. Expression precedence follows @huggingface/jinja
 * (lowest first): a if c else b; or; and; not; comparisons and in / not in; + - ~; * / // %;
 * **; is tests; | filters; unary + -; primary with .attr, [index], [a:b:c] and calls.
 * Unknown or unclosed tags are errors naming the line. Nesting depth is bounded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja_internal.h"

#define MAX_PARSE_DEPTH 200

typedef struct P {
    jarena *a;
    jfail *f;
    const jtok *t;
    size_t n, i;
    int depth;
    int loop_depth;
} P;

typedef struct nvec {
    jnode **v;
    int n, cap;
} nvec;

static void nv_push(P *p, nvec *v, jnode *x) {
    if (v->n == v->cap) {
        int nc = v->cap ? v->cap * 2 : 8;
        jnode **nn = jarena_grow(p->a, v->v, (size_t)v->cap * sizeof(jnode *), (size_t)nc * sizeof(jnode *));
        if (!nn) jfail_throw(p->f, PETREL_ENOMEM, 0, "out of memory");
        v->v = nn;
        v->cap = nc;
    }
    v->v[v->n++] = x;
}

static const jtok *cur(P *p) { return &p->t[p->i < p->n ? p->i : p->n - 1]; }
static const jtok *peek(P *p, size_t k) { return &p->t[p->i + k < p->n ? p->i + k : p->n - 1]; }
static int is(P *p, int type) { return cur(p)->type == type; }
static int is_ident(P *p, const char *name) { return cur(p)->type == TK_IDENT && !strcmp(cur(p)->s, name); }
static int is_ident_at(P *p, size_t k, const char *name) {
    return peek(p, k)->type == TK_IDENT && !strcmp(peek(p, k)->s, name);
}

static const char *tok_desc(const jtok *t, char *buf, size_t sz) {
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_TEXT: return "text";
    case TK_COMMENT: return "comment";
    case TK_STR: snprintf(buf, sz, "string '%.40s'", t->s); return buf;
    default: snprintf(buf, sz, "'%.40s'", t->s); return buf;
    }
}

_Noreturn static void perr(P *p, const char *what) {
    char b[80];
    jfail_throw(p->f, PETREL_EFORMAT, cur(p)->line, "syntax error: expected %s, got %s", what,
                tok_desc(cur(p), b, sizeof b));
}

static void expect(P *p, int type, const char *what) {
    if (!is(p, type)) perr(p, what);
    p->i++;
}

static jnode *mk(P *p, int kind, int line) {
    jnode *x = jalloc(p->a, p->f, sizeof *x);
    x->kind = (uint8_t)kind;
    x->line = line;
    return x;
}

/* The node's text as a string value shared by every render. */
static void lit_str(P *p, jnode *x) {
    x->str = jalloc(p->a, p->f, sizeof(jstr));
    x->str->s = x->s;
    x->str->len = x->slen;
}

static void enter(P *p) {
    if (++p->depth > MAX_PARSE_DEPTH)
        jfail_throw(p->f, PETREL_ERANGE, cur(p)->line, "template nested too deeply (limit %d)", MAX_PARSE_DEPTH);
}
static void leave(P *p) { p->depth--; }

static jnode *parse_expr(P *p);
static jnode *parse_primary(P *p);
static jnode *parse_any(P *p);

/* ---------------- expressions ---------------- */
static void parse_args(P *p, int params, nvec *out) {
    expect(p, TK_LPAREN, "'('");
    int saw_kw = 0;
    while (!is(p, TK_RPAREN)) {
        if (is(p, TK_EOF)) perr(p, "')'");
        int line = cur(p)->line;
        if (is(p, TK_POW) || (is(p, TK_MUL) && !strcmp(cur(p)->s, "*"))) {
            if (params) jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: argument unpacking in a macro's parameters");
            int kw = is(p, TK_POW);
            p->i++;
            jnode *x = mk(p, kw ? E_KWSPREAD : E_SPREAD, line);
            x->a = parse_expr(p);
            nv_push(p, out, x);
            if (kw) saw_kw = 1;
        } else {
            jnode *x = parse_expr(p);
            if (is(p, TK_EQUALS)) {
                p->i++;
                if (x->kind != E_NAME)
                    jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: a keyword argument needs a name");
                jnode *k = mk(p, E_KWARG, line);
                k->s = x->s;
                k->slen = x->slen;
                k->a = parse_expr(p);
                x = k;
                saw_kw = 1;
            } else if (params && x->kind != E_NAME) {
                jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: a macro parameter must be a name");
            } else if (saw_kw) {
                jfail_throw(p->f, PETREL_EFORMAT, line,
                            params ? "syntax error: parameter without default after one with a default"
                                   : "syntax error: positional argument after keyword argument");
            }
            if (params)
                for (int k = 0; k < out->n; k++)
                    if (!strcmp(out->v[k]->s, x->s))
                        jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: duplicate parameter '%s'", x->s);
            nv_push(p, out, x);
        }
        if (is(p, TK_COMMA)) p->i++;
        else if (!is(p, TK_RPAREN)) perr(p, "',' or ')'");
    }
    p->i++;
}

static jnode *parse_subscript(P *p, jnode *obj, int line) {
    /* after '[': index or slice a:b:c */
    jnode *parts[3] = {0};
    int np = 0, slice = 0;
    while (!is(p, TK_RBRACKET)) {
        if (is(p, TK_EOF)) perr(p, "']'");
        if (np >= 3) jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: a slice takes at most 3 parts");
        if (is(p, TK_COLON)) {
            parts[np++] = NULL;
            p->i++;
            slice = 1;
        } else {
            parts[np++] = parse_expr(p);
            if (is(p, TK_COLON)) {
                p->i++;
                slice = 1;
            } else if (!is(p, TK_RBRACKET)) {
                perr(p, "']' or ':'");
            }
        }
    }
    p->i++;
    if (np == 0) jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: empty subscript []");
    jnode *x;
    if (slice) {
        x = mk(p, E_SLICE, line);
        x->a = obj;
        x->b = parts[0];
        x->c = np > 1 ? parts[1] : NULL;
        x->d = np > 2 ? parts[2] : NULL;
    } else {
        x = mk(p, E_MEMBER, line);
        x->a = obj;
        x->b = parts[0];
        x->flag = 1;
    }
    return x;
}

static jnode *parse_postfix(P *p, jnode *x) {
    for (;;) {
        int line = cur(p)->line;
        if (is(p, TK_DOT)) {
            p->i++;
            const jtok *t = cur(p);
            if (t->type != TK_IDENT && !(t->type == TK_NUM && !strchr(t->s, '.') && t->s[0] != '-'))
                perr(p, "a name after '.'");
            p->i++;
            jnode *m = mk(p, E_MEMBER, line);
            m->a = x;
            m->s = t->s;
            m->slen = t->len;
            m->flag = 0;
            if (t->type == TK_NUM) { m->num = strtod(t->s, NULL); m->op = 1; }
            else lit_str(p, m);
            x = m;
        } else if (is(p, TK_LBRACKET)) {
            p->i++;
            x = parse_subscript(p, x, line);
        } else if (is(p, TK_LPAREN)) {
            jnode *c = mk(p, E_CALL, line);
            c->a = x;
            nvec args = {0};
            parse_args(p, 0, &args);
            c->list = args.v;
            c->nlist = args.n;
            x = c;
        } else {
            return x;
        }
    }
}

static jnode *parse_unary(P *p) {
    const jtok *t = cur(p);
    if ((t->type == TK_UNARY || t->type == TK_ADD) && (!strcmp(t->s, "-") || !strcmp(t->s, "+"))) {
        enter(p);
        p->i++;
        jnode *x = mk(p, E_UNARY, t->line);
        x->op = t->s[0] == '-' ? OP_NEG : OP_POS;
        x->a = parse_unary(p);
        leave(p);
        return x;
    }
    return parse_postfix(p, parse_primary(p));
}

static jnode *parse_filter(P *p) {
    jnode *x = parse_unary(p);
    while (is(p, TK_PIPE)) {
        int line = cur(p)->line;
        p->i++;
        if (!is(p, TK_IDENT)) perr(p, "a filter name after '|'");
        jnode *fl = mk(p, E_FILTER, line);
        fl->a = x;
        fl->s = cur(p)->s;
        fl->slen = cur(p)->len;
        p->i++;
        if (is(p, TK_LPAREN)) {
            nvec args = {0};
            parse_args(p, 0, &args);
            fl->list = args.v;
            fl->nlist = args.n;
        }
        x = fl;
    }
    return x;
}

static int test_takes_arg(const char *n) {
    static const char *const with_arg[] = {"divisibleby", "eq", "equalto", "ne", "lt", "le", "gt", "ge",
                                           "lessthan", "greaterthan", "sameas", "in", NULL};
    for (int i = 0; with_arg[i]; i++)
        if (!strcmp(n, with_arg[i])) return 1;
    return 0;
}

static int is_keyword(const char *s) {
    return !strcmp(s, "and") || !strcmp(s, "or") || !strcmp(s, "not") || !strcmp(s, "in") || !strcmp(s, "is") ||
           !strcmp(s, "if") || !strcmp(s, "else");
}

static jnode *parse_test(P *p) {
    jnode *x = parse_filter(p);
    while (is_ident(p, "is")) {
        int line = cur(p)->line;
        p->i++;
        int neg = 0;
        if (is_ident(p, "not")) { neg = 1; p->i++; }
        if (!is(p, TK_IDENT)) perr(p, "a test name after 'is'");
        jnode *t = mk(p, E_TEST, line);
        t->a = x;
        t->flag = (uint8_t)neg;
        t->s = cur(p)->s;
        t->slen = cur(p)->len;
        p->i++;
        if (is(p, TK_LPAREN)) {
            nvec args = {0};
            parse_args(p, 0, &args);
            t->list = args.v;
            t->nlist = args.n;
        } else if (test_takes_arg(t->s)) {
            const jtok *n = cur(p);
            if (n->type == TK_NUM || n->type == TK_STR || n->type == TK_LBRACKET || n->type == TK_LBRACE ||
                (n->type == TK_IDENT && !is_keyword(n->s))) {
                t->list = jalloc(p->a, p->f, sizeof(jnode *));
                t->list[0] = parse_postfix(p, parse_primary(p));
                t->nlist = 1;
            }
        }
        x = t;
    }
    return x;
}

static jnode *parse_pow(P *p) {
    jnode *x = parse_test(p);
    while (is(p, TK_POW)) {
        jnode *b = mk(p, E_BIN, cur(p)->line);
        p->i++;
        b->op = OP_POW;
        b->a = x;
        b->b = parse_test(p);
        x = b;
    }
    return x;
}

static jnode *parse_mul(P *p) {
    jnode *x = parse_pow(p);
    while (is(p, TK_MUL)) {
        const char *o = cur(p)->s;
        jnode *b = mk(p, E_BIN, cur(p)->line);
        p->i++;
        b->op = !strcmp(o, "*") ? OP_MUL : !strcmp(o, "/") ? OP_DIV : !strcmp(o, "//") ? OP_FLOORDIV : OP_MOD;
        b->a = x;
        b->b = parse_pow(p);
        x = b;
    }
    return x;
}

static jnode *parse_add(P *p) {
    jnode *x = parse_mul(p);
    while (is(p, TK_ADD)) {
        const char *o = cur(p)->s;
        jnode *b = mk(p, E_BIN, cur(p)->line);
        p->i++;
        b->op = o[0] == '+' ? OP_ADD : o[0] == '-' ? OP_SUB : OP_CONCAT;
        b->a = x;
        b->b = parse_mul(p);
        x = b;
    }
    return x;
}

static jnode *parse_cmp(P *p) {
    jnode *x = parse_add(p);
    for (;;) {
        int op, line = cur(p)->line;
        if (is_ident(p, "not") && is_ident_at(p, 1, "in")) { op = OP_NOTIN; p->i += 2; }
        else if (is_ident(p, "in")) { op = OP_IN; p->i++; }
        else if (is(p, TK_CMP)) {
            const char *o = cur(p)->s;
            op = !strcmp(o, "==") ? OP_EQ : !strcmp(o, "!=") ? OP_NE : !strcmp(o, "<") ? OP_LT
               : !strcmp(o, ">") ? OP_GT : !strcmp(o, "<=") ? OP_LE : OP_GE;
            p->i++;
        } else {
            return x;
        }
        jnode *b = mk(p, E_BIN, line);
        b->op = (uint8_t)op;
        b->a = x;
        b->b = parse_add(p);
        x = b;
    }
}

static jnode *parse_not(P *p) {
    if (is_ident(p, "not")) {
        enter(p);
        jnode *x = mk(p, E_UNARY, cur(p)->line);
        p->i++;
        x->op = OP_NOT;
        x->a = parse_not(p);
        leave(p);
        return x;
    }
    return parse_cmp(p);
}

static jnode *parse_and(P *p) {
    jnode *x = parse_not(p);
    while (is_ident(p, "and")) {
        jnode *b = mk(p, E_BIN, cur(p)->line);
        p->i++;
        b->op = OP_AND;
        b->a = x;
        b->b = parse_not(p);
        x = b;
    }
    return x;
}

static jnode *parse_or(P *p) {
    jnode *x = parse_and(p);
    while (is_ident(p, "or")) {
        jnode *b = mk(p, E_BIN, cur(p)->line);
        p->i++;
        b->op = OP_OR;
        b->a = x;
        b->b = parse_and(p);
        x = b;
    }
    return x;
}

static jnode *parse_expr(P *p) {
    enter(p);
    jnode *x = parse_or(p);
    if (is_ident(p, "if")) {
        int line = cur(p)->line;
        p->i++;
        jnode *test = parse_or(p);
        if (is_ident(p, "else")) {
            p->i++;
            jnode *t = mk(p, E_TERNARY, line);
            t->a = test;
            t->b = x;
            t->c = parse_expr(p);
            x = t;
        } else {
            jnode *s = mk(p, E_SELECT, line);
            s->a = x;
            s->b = test;
            x = s;
        }
    }
    leave(p);
    return x;
}

/* expr[, expr ...] -> a tuple when there is a comma */
static jnode *parse_expr_seq(P *p, int primary) {
    int line = cur(p)->line;
    jnode *first = primary ? parse_primary(p) : parse_expr(p);
    if (!is(p, TK_COMMA)) return first;
    nvec v = {0};
    nv_push(p, &v, first);
    while (is(p, TK_COMMA)) {
        p->i++;
        nv_push(p, &v, primary ? parse_primary(p) : parse_expr(p));
    }
    jnode *t = mk(p, E_TUPLE, line);
    t->list = v.v;
    t->nlist = v.n;
    return t;
}

static jnode *parse_primary(P *p) {
    const jtok *t = cur(p);
    enter(p);
    jnode *x = NULL;
    switch (t->type) {
    case TK_NUM:
        p->i++;
        x = mk(p, strchr(t->s, '.') ? E_FLOAT : E_INT, t->line);
        x->num = strtod(t->s, NULL);
        break;
    case TK_STR: {
        p->i++;
        x = mk(p, E_STR, t->line);
        if (!is(p, TK_STR)) {
            x->s = t->s;
            x->slen = t->len;
            lit_str(p, x);
            break;
        }
        jbuf b;
        jbuf_init(&b, p->a, p->f, 0);
        jbuf_put(&b, t->s, t->len);
        while (is(p, TK_STR)) {
            jbuf_put(&b, cur(p)->s, cur(p)->len);
            p->i++;
        }
        x->s = b.p ? b.p : "";
        x->slen = b.len;
        lit_str(p, x);
        break;
    }
    case TK_IDENT:
        p->i++;
        x = mk(p, E_NAME, t->line);
        x->s = t->s;
        x->slen = t->len;
        break;
    case TK_LPAREN:
        p->i++;
        x = parse_expr_seq(p, 0);
        expect(p, TK_RPAREN, "')'");
        break;
    case TK_LBRACKET: {
        p->i++;
        nvec v = {0};
        while (!is(p, TK_RBRACKET)) {
            if (is(p, TK_EOF)) perr(p, "']'");
            nv_push(p, &v, parse_expr(p));
            if (is(p, TK_COMMA)) p->i++;
            else if (!is(p, TK_RBRACKET)) perr(p, "',' or ']'");
        }
        p->i++;
        x = mk(p, E_LIST, t->line);
        x->list = v.v;
        x->nlist = v.n;
        break;
    }
    case TK_LBRACE: {
        p->i++;
        nvec k = {0}, v = {0};
        while (!is(p, TK_RBRACE)) {
            if (is(p, TK_EOF)) perr(p, "'}'");
            nv_push(p, &k, parse_expr(p));
            expect(p, TK_COLON, "':' in a dict literal");
            nv_push(p, &v, parse_expr(p));
            if (is(p, TK_COMMA)) p->i++;
            else if (!is(p, TK_RBRACE)) perr(p, "',' or '}'");
        }
        p->i++;
        x = mk(p, E_DICT, t->line);
        x->list = k.v;
        x->nlist = k.n;
        x->list2 = v.v;
        x->nlist2 = v.n;
        break;
    }
    default:
        perr(p, "an expression");
    }
    leave(p);
    return x;
}

/* ---------------- statements ---------------- */
static int is_stmt(P *p, const char *const *names) {
    if (!is(p, TK_OPEN_STMT) || peek(p, 1)->type != TK_IDENT) return 0;
    for (int i = 0; names[i]; i++)
        if (!strcmp(peek(p, 1)->s, names[i])) return 1;
    return 0;
}

static int is_end_tag(const char *s) {
    return !strncmp(s, "end", 3) || !strcmp(s, "else") || !strcmp(s, "elif");
}

/* Parses statements until one of stops; errors if the template ends first. */
static void parse_body(P *p, const char *const *stops, const char *opener, int open_line, nvec *out) {
    while (!is_stmt(p, stops)) {
        if (is(p, TK_EOF))
            jfail_throw(p->f, PETREL_EFORMAT, open_line, "unclosed '%s' block (expected {%% %s %%} before the end of the template)",
                        opener, stops[0]);
        if (is(p, TK_OPEN_STMT) && peek(p, 1)->type == TK_IDENT && is_end_tag(peek(p, 1)->s))
            jfail_throw(p->f, PETREL_EFORMAT, peek(p, 1)->line,
                        "unexpected '%s' (expected {%% %s %%} to close the '%s' on line %d)", peek(p, 1)->s,
                        stops[0], opener, open_line);
        nv_push(p, out, parse_any(p));
    }
}

static void expect_end(P *p, const char *name) {
    expect(p, TK_OPEN_STMT, "'{%'");
    if (!is_ident(p, name)) {
        char b[64];
        snprintf(b, sizeof b, "'%s'", name);
        perr(p, b);
    }
    p->i++;
    expect(p, TK_CLOSE_STMT, "'%}'");
}

static jnode *parse_if(P *p, int line) {
    static const char *const stops[] = {"endif", "elif", "else", NULL};
    jnode *x = mk(p, N_IF, line);
    x->a = parse_expr(p);
    expect(p, TK_CLOSE_STMT, "'%}'");
    nvec body = {0}, alt = {0};
    parse_body(p, stops, "if", line, &body);
    if (is_ident_at(p, 1, "elif")) {
        int l2 = peek(p, 1)->line;
        p->i += 2;
        enter(p);
        nv_push(p, &alt, parse_if(p, l2));
        leave(p);
    } else if (is_ident_at(p, 1, "else")) {
        static const char *const stops2[] = {"endif", NULL};
        p->i += 2;
        expect(p, TK_CLOSE_STMT, "'%}'");
        parse_body(p, stops2, "if", line, &alt);
    }
    x->list = body.v;
    x->nlist = body.n;
    x->list2 = alt.v;
    x->nlist2 = alt.n;
    return x;
}

static void check_target(P *p, jnode *t, int allow_member) {
    if (t->kind == E_NAME) return;
    if (t->kind == E_TUPLE) {
        for (int i = 0; i < t->nlist; i++)
            if (t->list[i]->kind != E_NAME)
                jfail_throw(p->f, PETREL_EFORMAT, t->line, "syntax error: can only unpack into names");
        return;
    }
    if (allow_member && t->kind == E_MEMBER && !t->flag && !t->op) return;
    jfail_throw(p->f, PETREL_EFORMAT, t->line, "syntax error: cannot assign to this expression");
}

static jnode *parse_stmt(P *p) {
    int line = cur(p)->line;
    expect(p, TK_OPEN_STMT, "'{%'");
    if (!is(p, TK_IDENT)) perr(p, "a tag name after '{%'");
    const char *name = cur(p)->s;
    line = cur(p)->line;
    p->i++;
    jnode *x;
    if (!strcmp(name, "set")) {
        x = mk(p, N_SET, line);
        x->a = parse_expr_seq(p, 0);
        check_target(p, x->a, 1);
        if (is(p, TK_EQUALS)) {
            p->i++;
            x->b = parse_expr_seq(p, 0);
        } else {
            static const char *const stops[] = {"endset", NULL};
            expect(p, TK_CLOSE_STMT, "'=' or '%}'");
            nvec body = {0};
            parse_body(p, stops, "set", line, &body);
            x->list = body.v;
            x->nlist = body.n;
            x->flag = 1;
            p->i += 2;
        }
        expect(p, TK_CLOSE_STMT, "'%}'");
    } else if (!strcmp(name, "if")) {
        x = parse_if(p, line);
        expect_end(p, "endif");
    } else if (!strcmp(name, "for")) {
        static const char *const stops[] = {"endfor", "else", NULL};
        static const char *const stops2[] = {"endfor", NULL};
        x = mk(p, N_FOR, line);
        x->a = parse_expr_seq(p, 1);
        check_target(p, x->a, 0);
        if (!is_ident(p, "in")) perr(p, "'in'");
        p->i++;
        x->b = parse_expr(p);
        if (is_ident(p, "recursive"))
            jfail_throw(p->f, PETREL_EUNSUPPORTED, line, "recursive for loops are not supported");
        expect(p, TK_CLOSE_STMT, "'%}'");
        nvec body = {0}, alt = {0};
        p->loop_depth++;
        parse_body(p, stops, "for", line, &body);
        p->loop_depth--;
        if (is_ident_at(p, 1, "else")) {
            p->i += 2;
            expect(p, TK_CLOSE_STMT, "'%}'");
            parse_body(p, stops2, "for", line, &alt);
        }
        expect_end(p, "endfor");
        x->list = body.v;
        x->nlist = body.n;
        x->list2 = alt.v;
        x->nlist2 = alt.n;
    } else if (!strcmp(name, "macro")) {
        static const char *const stops[] = {"endmacro", NULL};
        x = mk(p, N_MACRO, line);
        if (!is(p, TK_IDENT)) perr(p, "a macro name");
        x->s = cur(p)->s;
        x->slen = cur(p)->len;
        p->i++;
        nvec params = {0}, body = {0};
        parse_args(p, 1, &params);
        expect(p, TK_CLOSE_STMT, "'%}'");
        int ld = p->loop_depth;
        p->loop_depth = 0;
        parse_body(p, stops, "macro", line, &body);
        p->loop_depth = ld;
        expect_end(p, "endmacro");
        x->list = body.v;
        x->nlist = body.n;
        x->list2 = params.v;
        x->nlist2 = params.n;
    } else if (!strcmp(name, "call")) {
        static const char *const stops[] = {"endcall", NULL};
        x = mk(p, N_CALLBLOCK, line);
        nvec cparams = {0}, body = {0};
        if (is(p, TK_LPAREN)) parse_args(p, 1, &cparams);
        x->a = parse_postfix(p, parse_primary(p));
        if (x->a->kind != E_CALL) jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: {%% call %%} needs a macro call");
        expect(p, TK_CLOSE_STMT, "'%}'");
        int ld = p->loop_depth;
        p->loop_depth = 0;
        parse_body(p, stops, "call", line, &body);
        p->loop_depth = ld;
        expect_end(p, "endcall");
        x->list = body.v;
        x->nlist = body.n;
        x->list2 = cparams.v;
        x->nlist2 = cparams.n;
    } else if (!strcmp(name, "filter")) {
        static const char *const stops[] = {"endfilter", NULL};
        x = mk(p, N_FILTERBLOCK, line);
        if (!is(p, TK_IDENT)) perr(p, "a filter name");
        jnode *fl = mk(p, E_FILTER, line);
        fl->s = cur(p)->s;
        fl->slen = cur(p)->len;
        p->i++;
        if (is(p, TK_LPAREN)) {
            nvec args = {0};
            parse_args(p, 0, &args);
            fl->list = args.v;
            fl->nlist = args.n;
        }
        x->a = fl;
        expect(p, TK_CLOSE_STMT, "'%}'");
        nvec body = {0};
        parse_body(p, stops, "filter", line, &body);
        expect_end(p, "endfilter");
        x->list = body.v;
        x->nlist = body.n;
    } else if (!strcmp(name, "break") || !strcmp(name, "continue")) {
        if (!p->loop_depth) jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: '%s' outside of a for loop", name);
        x = mk(p, name[0] == 'b' ? N_BREAK : N_CONTINUE, line);
        expect(p, TK_CLOSE_STMT, "'%}'");
    } else if (!strcmp(name, "do")) {
        x = mk(p, N_DO, line);
        x->a = parse_expr_seq(p, 0);
        expect(p, TK_CLOSE_STMT, "'%}'");
    } else if (is_end_tag(name)) {
        jfail_throw(p->f, PETREL_EFORMAT, line, "syntax error: unexpected '%s' (no open block to close)", name);
    } else {
        jfail_throw(p->f, PETREL_EUNSUPPORTED, line, "unknown tag '%s'", name);
    }
    return x;
}

static jnode *parse_any(P *p) {
    const jtok *t = cur(p);
    jnode *x;
    enter(p);
    switch (t->type) {
    case TK_COMMENT:
        p->i++;
        x = mk(p, N_COMMENT, t->line);
        break;
    case TK_TEXT:
        p->i++;
        x = mk(p, N_TEXT, t->line);
        x->s = t->s;
        x->slen = t->len;
        break;
    case TK_OPEN_STMT:
        x = parse_stmt(p);
        break;
    case TK_OPEN_EXPR:
        p->i++;
        x = mk(p, N_OUTPUT, t->line);
        x->a = parse_expr(p);
        expect(p, TK_CLOSE_EXPR, "'}}'");
        break;
    default: {
        char b[80];
        jfail_throw(p->f, PETREL_EFORMAT, t->line, "syntax error: unexpected %s outside of a tag", tok_desc(t, b, sizeof b));
    }
    }
    leave(p);
    return x;
}

void jinja_parse(jarena *a, jfail *f, const jtok *toks, size_t n, jnode ***body, int *n_body) {
    P p = {.a = a, .f = f, .t = toks, .n = n};
    nvec v = {0};
    while (!is(&p, TK_EOF)) {
        if (is(&p, TK_OPEN_STMT) && peek(&p, 1)->type == TK_IDENT && is_end_tag(peek(&p, 1)->s))
            jfail_throw(f, PETREL_EFORMAT, peek(&p, 1)->line, "syntax error: unexpected '%s' (no open block to close)",
                        peek(&p, 1)->s);
        nv_push(&p, &v, parse_any(&p));
    }
    *body = v.v;
    *n_body = v.n;
}
