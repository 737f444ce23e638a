/* jinja_lex.c: template preprocessing and tokenizing, as @huggingface/jinja does it:
 * drop one trailing newline, lstrip_blocks (spaces/tabs before "{%", "{#" at a line start),
 * trim_blocks (the newline after "%}", "#}", "-}"), removal of {% generation %} tags, then
 * tokens with "{%-", "-%}", "{{-", "-}}", "{#-", "-#}" whitespace control. Every byte keeps
 * the line it had in the original source, so errors point at the right line. */
#include <stdlib.h>
#include <string.h>

#include "text/jinja_internal.h"

typedef struct pbuf {
    char *s;
    int *ln;
    size_t n;
} pbuf;

static void pb_alloc(jarena *a, jfail *f, pbuf *p, size_t cap) {
    p->s = jalloc(a, f, cap + 1);
    p->ln = jalloc(a, f, (cap + 1) * sizeof(int));
    p->n = 0;
}

static inline void pb_push(pbuf *p, char c, int ln) {
    p->s[p->n] = c;
    p->ln[p->n] = ln;
    p->n++;
}

/* Is there a line terminator (\n, \r, U+2028, U+2029) ending just before position i? */
static int line_start(const pbuf *p, size_t i) {
    if (i == 0) return 1;
    char c = p->s[i - 1];
    if (c == '\n' || c == '\r') return 1;
    if (i >= 3 && (unsigned char)p->s[i - 3] == 0xE2 && (unsigned char)p->s[i - 2] == 0x80 &&
        ((unsigned char)c == 0xA8 || (unsigned char)c == 0xA9))
        return 1;
    return 0;
}

static int space_at(const char *s, size_t n, size_t i, size_t *cl) {
    if (i >= n) return 0;
    uint32_t c = utf8_dec(s, n, i, cl);
    return js_space(c);
}

static void preprocess(jarena *a, jfail *f, const char *src, size_t len, pbuf *out) {
    pbuf p0, p1, p2;
    pb_alloc(a, f, &p0, len);
    int line = 1;
    for (size_t i = 0; i < len; i++) {
        pb_push(&p0, src[i], line);
        if (src[i] == '\n') line++;
    }
    if (p0.n && p0.s[p0.n - 1] == '\n') p0.n--;
    /* lstrip_blocks: /^[ \t]*({[#%-])/gm -> "$1" */
    pb_alloc(a, f, &p1, p0.n);
    for (size_t i = 0; i < p0.n;) {
        if (line_start(&p0, i)) {
            size_t j = i;
            while (j < p0.n && (p0.s[j] == ' ' || p0.s[j] == '\t')) j++;
            if (j > i && j + 1 < p0.n && p0.s[j] == '{' &&
                (p0.s[j + 1] == '#' || p0.s[j + 1] == '%' || p0.s[j + 1] == '-')) {
                i = j; /* drop the indentation */
                pb_push(&p1, p0.s[i], p0.ln[i]);
                pb_push(&p1, p0.s[i + 1], p0.ln[i + 1]);
                i += 2;
                continue;
            }
        }
        pb_push(&p1, p0.s[i], p0.ln[i]);
        i++;
    }
    /* trim_blocks: /([#%-]})\n/g -> "$1" */
    pb_alloc(a, f, &p2, p1.n);
    for (size_t i = 0; i < p1.n;) {
        if (i + 2 < p1.n && (p1.s[i] == '#' || p1.s[i] == '%' || p1.s[i] == '-') && p1.s[i + 1] == '}' &&
            p1.s[i + 2] == '\n') {
            pb_push(&p2, p1.s[i], p1.ln[i]);
            pb_push(&p2, p1.s[i + 1], p1.ln[i + 1]);
            i += 3;
            continue;
        }
        pb_push(&p2, p1.s[i], p1.ln[i]);
        i++;
    }
    /* {% generation %} / {% endgeneration %}: /{%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs */
    pb_alloc(a, f, out, p2.n);
    size_t last = 0;
    for (size_t i = 0; i + 1 < p2.n; i++) {
        if (p2.s[i] != '{' || p2.s[i + 1] != '%') continue;
        size_t j = i + 2, cl;
        int lstrip = 0, rstrip = 0;
        if (j < p2.n && p2.s[j] == '-') { lstrip = 1; j++; }
        while (space_at(p2.s, p2.n, j, &cl)) j += cl;
        if (j + 3 <= p2.n && !memcmp(p2.s + j, "end", 3)) j += 3;
        if (!(j + 10 <= p2.n && !memcmp(p2.s + j, "generation", 10))) continue;
        j += 10;
        while (space_at(p2.s, p2.n, j, &cl)) j += cl;
        if (j < p2.n && p2.s[j] == '-') { rstrip = 1; j++; }
        if (!(j + 2 <= p2.n && p2.s[j] == '%' && p2.s[j + 1] == '}')) continue;
        j += 2;
        size_t after = j;
        while (space_at(p2.s, p2.n, j, &cl)) j += cl;
        size_t end = i;
        while (lstrip && end > last) {
            size_t ps = utf8_prev(p2.s, end);
            if (ps < last || !space_at(p2.s, end, ps, &cl)) break;
            end = ps;
        }
        for (size_t k = last; k < end; k++) pb_push(out, p2.s[k], p2.ln[k]);
        if (!rstrip)
            for (size_t k = after; k < j; k++) pb_push(out, p2.s[k], p2.ln[k]);
        last = j;
        i = j - 1;
    }
    for (size_t k = last; k < p2.n; k++) pb_push(out, p2.s[k], p2.ln[k]);
    out->s[out->n] = 0;
}

typedef struct lexer {
    jarena *a;
    jfail *f;
    const char *s;
    const int *ln;
    size_t n, pos;
    jtok *t;
    size_t nt, cap;
} lexer;

static int cur_line(const lexer *L) { return L->pos < L->n ? L->ln[L->pos] : (L->n ? L->ln[L->n - 1] : 1); }

static void push(lexer *L, int type, const char *s, size_t len, int line) {
    if (L->nt == L->cap) {
        size_t nc = L->cap ? L->cap * 2 : 64;
        jtok *nt = jarena_grow(L->a, L->t, L->cap * sizeof(jtok), nc * sizeof(jtok));
        if (!nt) jfail_throw(L->f, PETREL_ENOMEM, 0, "out of memory");
        L->t = nt;
        L->cap = nc;
    }
    jtok *k = &L->t[L->nt++];
    k->type = (uint8_t)type;
    k->line = line;
    char *c = jalloc(L->a, L->f, len + 1);
    memcpy(c, s, len);
    c[len] = 0;
    k->s = c;
    k->len = len;
}

static int is_word(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }
static int is_digit(int c) { return c >= '0' && c <= '9'; }

static int at(const lexer *L, size_t i) { return i < L->n ? (unsigned char)L->s[i] : -1; }

/* consumeWhile of @huggingface/jinja: it is an error for the input to end while it holds. */
static void consume_digits(lexer *L) {
    while (is_digit(at(L, L->pos)))
        if (++L->pos >= L->n) jfail_throw(L->f, PETREL_EFORMAT, cur_line(L), "unexpected end of template");
}

static void skip_space(lexer *L, int throw_at_end) {
    size_t cl;
    while (L->pos < L->n && space_at(L->s, L->n, L->pos, &cl)) {
        L->pos += cl;
        if (throw_at_end && L->pos >= L->n) jfail_throw(L->f, PETREL_EFORMAT, cur_line(L), "unexpected end of template (unclosed tag)");
    }
}

static void strip_trailing(lexer *L) {
    if (!L->nt || L->t[L->nt - 1].type != TK_TEXT) return;
    jtok *k = &L->t[L->nt - 1];
    size_t e = k->len, cl;
    while (e > 0) {
        size_t ps = utf8_prev(k->s, e);
        if (!space_at(k->s, e, ps, &cl)) break;
        e = ps;
    }
    k->len = e;
    ((char *)k->s)[e] = 0;
    if (e == 0) L->nt--;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void lex_string(lexer *L, char quote) {
    int line = cur_line(L);
    L->pos++; /* opening quote */
    jbuf b;
    jbuf_init(&b, L->a, L->f, 0);
    jbuf_put(&b, "", 0);
    uint32_t pending_hi = 0;
    for (;;) {
        if (L->pos >= L->n) jfail_throw(L->f, PETREL_EFORMAT, line, "unterminated string literal");
        char c = L->s[L->pos];
        if (c == quote) break;
        L->pos++;
        if (c != '\\') {
            if (pending_hi) { char u[4]; jbuf_put(&b, u, utf8_enc(0xFFFD, u)); pending_hi = 0; }
            jbuf_putc(&b, c);
            continue;
        }
        if (L->pos >= L->n) jfail_throw(L->f, PETREL_EFORMAT, line, "unterminated string literal");
        char e = L->s[L->pos++];
        const char *rep = NULL;
        switch (e) {
        case 'n': rep = "\n"; break;
        case 't': rep = "\t"; break;
        case 'r': rep = "\r"; break;
        case 'b': rep = "\b"; break;
        case 'f': rep = "\f"; break;
        case 'v': rep = "\v"; break;
        case '\'': rep = "'"; break;
        case '"': rep = "\""; break;
        case '\\': rep = "\\"; break;
        case 'x':
        case 'u': {
            int nh = e == 'x' ? 2 : 4;
            uint32_t cp = 0;
            for (int k = 0; k < nh; k++) {
                int h = hexval(at(L, L->pos + (size_t)k));
                if (h < 0) jfail_throw(L->f, PETREL_EFORMAT, line, "invalid \\%c escape in string literal", e);
                cp = cp * 16 + (uint32_t)h;
            }
            L->pos += (size_t)nh;
            char u[4];
            if (cp >= 0xD800 && cp < 0xDC00) {
                if (pending_hi) jbuf_put(&b, u, utf8_enc(0xFFFD, u));
                pending_hi = cp;
                continue;
            }
            if (cp >= 0xDC00 && cp < 0xE000) {
                if (pending_hi) { cp = 0x10000 + ((pending_hi - 0xD800) << 10) + (cp - 0xDC00); pending_hi = 0; }
                else cp = 0xFFFD;
            } else if (pending_hi) {
                jbuf_put(&b, u, utf8_enc(0xFFFD, u));
                pending_hi = 0;
            }
            jbuf_put(&b, u, utf8_enc(cp, u));
            continue;
        }
        default:
            jfail_throw(L->f, PETREL_EFORMAT, line, "unknown escape '\\%c' in string literal", e);
        }
        if (pending_hi) { char u[4]; jbuf_put(&b, u, utf8_enc(0xFFFD, u)); pending_hi = 0; }
        jbuf_puts(&b, rep);
    }
    if (pending_hi) { char u[4]; jbuf_put(&b, u, utf8_enc(0xFFFD, u)); }
    L->pos++; /* closing quote */
    push(L, TK_STR, b.p ? b.p : "", b.len, line);
}

static const struct { const char *s; int type; } RULES[] = {
    {"{%", TK_OPEN_STMT}, {"%}", TK_CLOSE_STMT}, {"{{", TK_OPEN_EXPR}, {"}}", TK_CLOSE_EXPR},
    {"(", TK_LPAREN}, {")", TK_RPAREN}, {"{", TK_LBRACE}, {"}", TK_RBRACE}, {"[", TK_LBRACKET},
    {"]", TK_RBRACKET}, {",", TK_COMMA}, {".", TK_DOT}, {":", TK_COLON}, {"|", TK_PIPE},
    {"<=", TK_CMP}, {">=", TK_CMP}, {"==", TK_CMP}, {"!=", TK_CMP}, {"<", TK_CMP}, {">", TK_CMP},
    {"+", TK_ADD}, {"-", TK_ADD}, {"~", TK_ADD}, {"**", TK_POW}, {"*", TK_MUL}, {"//", TK_MUL},
    {"/", TK_MUL}, {"%", TK_MUL}, {"=", TK_EQUALS},
};

void jinja_lex(jarena *a, jfail *f, const char *src, size_t len, jtok **out, size_t *n_out) {
    pbuf p;
    preprocess(a, f, src, len, &p);
    lexer L = {.a = a, .f = f, .s = p.s, .ln = p.ln, .n = p.n};
    int curly = 0;
    while (L.pos < L.n) {
        int last = L.nt ? L.t[L.nt - 1].type : -1;
        if (last == -1 || last == TK_CLOSE_STMT || last == TK_CLOSE_EXPR || last == TK_COMMENT) {
            size_t end = L.pos;
            for (;;) {
                const char *q = end < L.n ? memchr(L.s + end, '{', L.n - end) : NULL;
                if (!q) { end = L.n; break; }
                end = (size_t)(q - L.s);
                int nx = at(&L, end + 1);
                if (nx == '%' || nx == '{' || nx == '#') break;
                end++;
            }
            if (end > L.pos) {
                push(&L, TK_TEXT, L.s + L.pos, end - L.pos, L.ln[L.pos]);
                L.pos = end;
                continue;
            }
        }
        if (at(&L, L.pos) == '{') {
            int nx = at(&L, L.pos + 1);
            if (nx == '#') {
                int line = cur_line(&L);
                L.pos += 2;
                int strip_before = at(&L, L.pos) == '-';
                if (strip_before) L.pos++;
                size_t e = L.pos;
                while (e + 1 < L.n && !(L.s[e] == '#' && L.s[e + 1] == '}')) e++;
                if (e + 1 >= L.n) jfail_throw(f, PETREL_EFORMAT, line, "unclosed comment (missing '#}')");
                int strip_after = e > L.pos && L.s[e - 1] == '-';
                if (strip_before) strip_trailing(&L);
                push(&L, TK_COMMENT, L.s + L.pos, e - L.pos - (size_t)strip_after, line);
                L.pos = e + 2;
                if (strip_after) skip_space(&L, 0);
                continue;
            }
            if (at(&L, L.pos + 2) == '-') {
                if (nx == '%') {
                    strip_trailing(&L);
                    push(&L, TK_OPEN_STMT, "{%", 2, cur_line(&L));
                    L.pos += 3;
                    continue;
                }
                if (nx == '{') {
                    strip_trailing(&L);
                    push(&L, TK_OPEN_EXPR, "{{", 2, cur_line(&L));
                    curly = 0;
                    L.pos += 3;
                    continue;
                }
            }
        }
        skip_space(&L, 1);
        int c = at(&L, L.pos);
        int line = cur_line(&L);
        if (c == '-' && at(&L, L.pos + 2) == '}') {
            int nx = at(&L, L.pos + 1);
            if (nx == '%' || nx == '}') {
                push(&L, nx == '%' ? TK_CLOSE_STMT : TK_CLOSE_EXPR, nx == '%' ? "%}" : "}}", 2, line);
                L.pos += 3;
                skip_space(&L, 0);
                continue;
            }
        }
        if (c == '-' || c == '+') {
            if (last == TK_TEXT || last == -1)
                jfail_throw(f, PETREL_EFORMAT, line, "unexpected character '%c'", c);
            if (!(last == TK_IDENT || last == TK_NUM || last == TK_STR || last == TK_RPAREN || last == TK_RBRACKET)) {
                size_t st = L.pos;
                L.pos++;
                size_t ds = L.pos;
                consume_digits(&L);
                if (L.pos > ds && at(&L, L.pos) == '.' && is_digit(at(&L, L.pos + 1))) {
                    L.pos++;
                    consume_digits(&L);
                }
                push(&L, L.pos > ds ? TK_NUM : TK_UNARY, L.s + st, L.pos - st, line);
                continue;
            }
        }
        int matched = 0;
        for (size_t r = 0; r < sizeof RULES / sizeof RULES[0]; r++) {
            size_t rl = strlen(RULES[r].s);
            if (RULES[r].type == TK_CLOSE_EXPR && curly > 0) continue;
            if (L.pos + rl <= L.n && !memcmp(L.s + L.pos, RULES[r].s, rl)) {
                push(&L, RULES[r].type, RULES[r].s, rl, line);
                if (RULES[r].type == TK_OPEN_EXPR) curly = 0;
                else if (RULES[r].type == TK_LBRACE) curly++;
                else if (RULES[r].type == TK_RBRACE) curly--;
                L.pos += rl;
                matched = 1;
                break;
            }
        }
        if (matched) continue;
        if (c == '\'' || c == '"') {
            lex_string(&L, (char)c);
            continue;
        }
        if (is_digit(c)) {
            size_t st = L.pos;
            consume_digits(&L);
            if (last != TK_DOT && at(&L, L.pos) == '.' && is_digit(at(&L, L.pos + 1))) {
                L.pos++;
                consume_digits(&L);
            }
            push(&L, TK_NUM, L.s + st, L.pos - st, line);
            continue;
        }
        if (is_word(c)) {
            size_t st = L.pos;
            while (is_word(at(&L, L.pos)))
                if (++L.pos >= L.n) jfail_throw(f, PETREL_EFORMAT, line, "unexpected end of template (unclosed tag)");
            push(&L, TK_IDENT, L.s + st, L.pos - st, line);
            continue;
        }
        if (c < 0x20 || c >= 0x7F)
            jfail_throw(f, PETREL_EFORMAT, line, "unexpected character (byte 0x%02x) in a tag", c & 0xFF);
        jfail_throw(f, PETREL_EFORMAT, line, "unexpected character '%c' in a tag", c);
    }
    push(&L, TK_EOF, "", 0, L.n ? L.ln[L.n - 1] : 1);
    *out = L.t;
    *n_out = L.nt;
}
