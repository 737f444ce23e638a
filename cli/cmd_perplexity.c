/* cmd_perplexity.c: `petrel perplexity` measures a model's perplexity on a text file in windows
 * of --ctx tokens, and with --kl-base its KL divergence from another model (or another format of
 * the same model) whose log-probabilities were saved with --save-logits.
 *
 * Scoring, exactly. The whole file is tokenized with the model's tokenizer as raw text: no chat
 * template, no BOS/EOS (GLM tokenizers add none to raw text), special tokens written in the text
 * recognised as `petrel tokenize` does. Call the ids x[0..N). Window w covers positions
 * [b_w, e_w) with b_w = w * stride and e_w = min(b_w + ctx, N); it runs in a fresh timeline
 * (the session truncated to 0), so its first token sits at position 0. The logits at position p
 * (the model having read x[b_w..p]) predict x[p+1]. Each token x[t], t = 1..N-1, is scored
 * exactly once, by the first window whose positions include t-1 and whose earlier windows did not
 * score it: window 0 scores x[1..e_0] (all of its positions predict), window w > 0 scores
 * x[e_{w-1}+1 .. e_w] (its last `stride` positions; each of those saw at least ctx - stride + 1
 * tokens), both ranges ending at x[N-1] at most. The last window may be shorter; the windows
 * stop once x[N-1] is scored. Default stride
 * = ctx: windows that do not overlap, and every token after the first is scored with the
 * context of its own window (token b_w from the end of window w-1). Per token NLL = -log
 * softmax(logits)[x[t]], computed in double (max-shifted log-sum-exp); mean NLL over the N-1
 * scored tokens, PPL = exp(mean NLL). A file needs at least ctx tokens (one full window; with
 * exactly ctx, its ctx - 1 predictions, the usual one-window cross entropy); fewer is refused with
 * the count, so the figure always means "windows of ctx".
 *
 * With --kl-base, per scored token: KL(base || this) = sum_v p_b(v) (log p_b(v) - log p(v)) in
 * nats (p_b renormalized from the stored float log-probs, so KL >= 0 up to rounding), top-1
 * agreement = argmax of both float log-prob rows equal (first maximum), and the 99th percentile
 * of the per-token KL (nearest rank: the ceil(0.99 n)-th smallest).
 *
 * The --save-logits file (version 1, little-endian; written whole or not at all, base/outfile.h):
 *   offset 0   char[8]  magic "PTRLLOGP"
 *          8   u32      version = 1
 *         12   u32      vocab V
 *         16   u32      ctx
 *         20   u32      stride
 *         24   u64      n_ids N
 *         32   u64      n_rows = N - 1
 *         40   i32      ids[N]
 *              f32      rows[N-1][V]: row r is the log-softmax (float of the double result) of the
 *                       logits that predict ids[r+1], scored as above
 *        end-8 u64      XXH64 (seed 0) of every byte before it
 * A --kl-base file must match this run's vocab, ids, ctx and stride; it is checked in full (size,
 * header, ids, checksum) before the model runs. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/file.h"
#include "base/outfile.h"
#include "cli.h"
#include "text/tokenizer.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the --save-logits format is little-endian; this writer assumes a little-endian host"
#endif

static const char *usage =
    "usage: petrel perplexity --model DIR|FILE --file TEXT [--ctx N] [--stride N]\n"
    "                         [--save-logits FILE] [--kl-base FILE] [--json] [--tokenizer FILE]\n"
    "Perplexity of a text file, in windows of --ctx tokens, each window in a fresh context.\n"
    "The text is tokenized raw (no chat template, no BOS). Window w holds tokens [w*stride,\n"
    "w*stride+ctx); each token after the first is scored once, from the logits of the position\n"
    "before it: window 0 scores every token its positions predict, a later window only the\n"
    "tokens after the previous window's end (its last `stride` positions). PPL = exp(mean NLL),\n"
    "NLL = -log softmax(logits)[next token] in double. Needs at least ctx tokens.\n"
    "  --file TEXT          UTF-8 text file to score\n"
    "  --ctx N              window length in tokens (default: min(max_position_embeddings, 512))\n"
    "  --stride N           tokens between window starts, 1..ctx (default: ctx, no overlap)\n"
    "  --save-logits FILE   save the ids and every scored position's float32 log-softmax row\n"
    "                       (to compare another model or format against this one later)\n"
    "  --kl-base FILE       a --save-logits file of the same text, ctx and stride: also report\n"
    "                       mean KL(base || this) in nats, its 99th percentile, top-1 agreement\n"
    "                       (without --ctx, the window and stride are the file's)\n"
    "  --json               print one JSON object instead of the text report\n"
    "  --tokenizer FILE     tokenizer.json (default: the model's own, DIR/tokenizer.json or the\n"
    "                       copy a pack stores)\n"
    "  Progress (tokens scored / total) goes to stderr after the first second (terminal or -v).\n"
    CLI_MODEL_OPTS_HELP;

#define LP_MAGIC "PTRLLOGP"
#define LP_VERSION 1u
#define LP_HEADER 40

/* ---- text checks ---- */

/* Offset of the first byte that is not valid UTF-8 text (a NUL, a bad or overlong sequence, a
 * surrogate, above U+10FFFF, a truncated character), or -1 when all of s is. */
static long long bad_text_at(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c == 0) return (long long)i;
        if (c < 0x80) { i++; continue; }
        int k;
        unsigned cp, min;
        if ((c & 0xe0) == 0xc0) { k = 1; cp = c & 0x1f; min = 0x80; }
        else if ((c & 0xf0) == 0xe0) { k = 2; cp = c & 0x0f; min = 0x800; }
        else if ((c & 0xf8) == 0xf0) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return (long long)i;
        for (int j = 1; j <= k; j++) {
            if (i + (size_t)j >= n || (s[i + j] & 0xc0) != 0x80) return (long long)i;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return (long long)i;
        i += (size_t)k + 1;
    }
    return -1;
}

/* ---- the base file (--kl-base) ---- */

typedef struct lp_header {
    uint32_t version, vocab, ctx, stride;
    uint64_t n_ids, n_rows;
} lp_header;

static void lp_header_pack(const lp_header *h, unsigned char b[LP_HEADER]) {
    memcpy(b, LP_MAGIC, 8);
    memcpy(b + 8, &h->version, 4);
    memcpy(b + 12, &h->vocab, 4);
    memcpy(b + 16, &h->ctx, 4);
    memcpy(b + 20, &h->stride, 4);
    memcpy(b + 24, &h->n_ids, 8);
    memcpy(b + 32, &h->n_rows, 8);
}

/* Opens and checks a --kl-base file against this run (vocab V, ids[N], ctx, stride): size,
 * header, ids and checksum; leaves *out positioned at the first row. Prints one line and returns
 * 1 on any mismatch. */
static int base_open(const char *path, int V, const int32_t *ids, size_t N, int ctx, int stride, FILE **out) {
    FILE *f = fopen(path, "rb");
    if (!f) return cli_fail("perplexity: --kl-base %s: %s", path, strerror(errno));
    int rc = 0;
    struct stat st;
    unsigned char hb[LP_HEADER];
    lp_header h;
    unsigned char *buf = NULL;
    XXH64_state_t *xs = NULL;
    if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode)) { rc = cli_fail("perplexity: --kl-base %s is not a regular file", path); goto done; }
    uint64_t size = (uint64_t)st.st_size;
    if (size < LP_HEADER + 8 || fread(hb, 1, LP_HEADER, f) != LP_HEADER) {
        rc = cli_fail("perplexity: --kl-base %s is truncated (%llu bytes; not a --save-logits file)", path, (unsigned long long)size);
        goto done;
    }
    if (memcmp(hb, LP_MAGIC, 8)) { rc = cli_fail("perplexity: --kl-base %s is not a --save-logits file (bad magic)", path); goto done; }
    memcpy(&h.version, hb + 8, 4);
    memcpy(&h.vocab, hb + 12, 4);
    memcpy(&h.ctx, hb + 16, 4);
    memcpy(&h.stride, hb + 20, 4);
    memcpy(&h.n_ids, hb + 24, 8);
    memcpy(&h.n_rows, hb + 32, 8);
    if (h.version != LP_VERSION) {
        rc = cli_fail("perplexity: --kl-base %s has format version %u; this petrel reads version %u", path, h.version, LP_VERSION);
        goto done;
    }
    if (h.vocab == 0 || h.vocab > (1u << 24) || h.n_ids < 2 || h.n_ids > (1ull << 31) || h.n_rows != h.n_ids - 1) {
        rc = cli_fail("perplexity: --kl-base %s: corrupt header (vocab %u, %llu ids, %llu rows)", path, h.vocab,
                      (unsigned long long)h.n_ids, (unsigned long long)h.n_rows);
        goto done;
    }
    uint64_t want = LP_HEADER + 4 * h.n_ids + 4ull * h.vocab * h.n_rows + 8;
    if (size != want) {
        rc = cli_fail("perplexity: --kl-base %s is truncated or corrupt: %llu bytes, its header needs %llu", path,
                      (unsigned long long)size, (unsigned long long)want);
        goto done;
    }
    if ((int)h.vocab != V) {
        rc = cli_fail("perplexity: --kl-base %s was saved from a model with vocab %u; this model has %d", path, h.vocab, V);
        goto done;
    }
    if (h.n_ids != N) {
        rc = cli_fail("perplexity: --kl-base %s holds %llu token ids; this text has %zu (save it from the same text and tokenizer)", path,
                      (unsigned long long)h.n_ids, N);
        goto done;
    }
    if ((int)h.ctx != ctx || (int)h.stride != stride) {
        rc = cli_fail("perplexity: --kl-base %s was saved with --ctx %u --stride %u; run with the same (this run: --ctx %d --stride %d)", path,
                      h.ctx, h.stride, ctx, stride);
        goto done;
    }
    /* the checksum over everything first, so a corrupt file is refused before the model runs */
    size_t bsz = 1 << 20;
    buf = malloc(bsz);
    xs = XXH64_createState();
    if (!buf || !xs) { rc = cli_fail("perplexity: out of memory"); goto done; }
    XXH64_reset(xs, 0);
    XXH64_update(xs, hb, LP_HEADER);
    size_t id_pos = 0, id_diff = (size_t)-1;
    for (uint64_t left = size - LP_HEADER - 8; left > 0;) {
        size_t k = left < bsz ? (size_t)left : bsz;
        if (fread(buf, 1, k, f) != k) { rc = cli_fail("perplexity: --kl-base %s: read error", path); goto done; }
        XXH64_update(xs, buf, k);
        for (size_t o = 0; id_pos < N && o + 4 <= k && id_diff == (size_t)-1; o += 4, id_pos++) {
            int32_t v;
            memcpy(&v, buf + o, 4);
            if (v != ids[id_pos]) id_diff = id_pos;
        }
        left -= k;
    }
    uint64_t sum;
    if (fread(&sum, 1, 8, f) != 8) { rc = cli_fail("perplexity: --kl-base %s: read error", path); goto done; }
    if (sum != XXH64_digest(xs)) { rc = cli_fail("perplexity: --kl-base %s is corrupt (checksum mismatch)", path); goto done; }
    if (id_diff != (size_t)-1) {
        rc = cli_fail("perplexity: --kl-base %s holds other token ids (first difference at token %zu): save it from the same text and tokenizer",
                      path, id_diff);
        goto done;
    }
    if (fseek(f, (long)(LP_HEADER + 4 * h.n_ids), SEEK_SET)) { rc = cli_fail("perplexity: --kl-base %s: seek failed", path); goto done; }
done:
    XXH64_freeState(xs);
    free(buf);
    if (rc) fclose(f);
    else *out = f;
    return rc;
}

/* The window a --kl-base file was saved with (its header only; base_open checks the rest):
 * 0, or -1 when it has no readable header of this version. */
static int base_peek(const char *path, long *ctx, long *stride) {
    FILE *f = fopen(path, "rb");
    unsigned char hb[LP_HEADER];
    int ok = f && fread(hb, 1, LP_HEADER, f) == LP_HEADER && !memcmp(hb, LP_MAGIC, 8);
    if (f) fclose(f);
    uint32_t v, c, st;
    if (!ok) return -1;
    memcpy(&v, hb + 8, 4);
    memcpy(&c, hb + 16, 4);
    memcpy(&st, hb + 20, 4);
    if (v != LP_VERSION || c < 2 || c > (1u << 24) || st < 1 || st > c) return -1;
    *ctx = c;
    *stride = st;
    return 0;
}

/* ---- the saved file (--save-logits): a whole-or-nothing output (base/outfile.h), hashed as it
 * goes ---- */

typedef struct lp_writer {
    pt_outfile o;
    XXH64_state_t *xs; /* owned; NULL when not open */
    petrel_error err;  /* the first write error */
    int failed;
} lp_writer;

static void lp_write(lp_writer *w, const void *p, size_t n) {
    if (w->failed) return;
    XXH64_update(w->xs, p, n);
    if (pt_out_write(&w->o, p, n, &w->err) < 0) w->failed = 1;
}

static int lp_writer_open(lp_writer *w, const char *path, const char *model, const lp_header *h, const int32_t *ids) {
    petrel_error err = {0};
    if (pt_out_open(&w->o, path, model, &err) < 0) return cli_fail("perplexity: --save-logits: %s", err.msg);
    w->xs = XXH64_createState();
    if (!w->xs) { pt_out_abort(&w->o); return cli_fail("perplexity: out of memory"); }
    XXH64_reset(w->xs, 0);
    unsigned char hb[LP_HEADER];
    lp_header_pack(h, hb);
    lp_write(w, hb, LP_HEADER);
    lp_write(w, ids, 4 * (size_t)h->n_ids);
    return 0;
}

/* Appends the checksum and commits (the file appears whole) when ok, else removes the
 * temporary; a no-op when not open. */
static int lp_writer_close(lp_writer *w, int ok) {
    if (!w->xs) return 0;
    int rc = 0;
    if (ok) {
        uint64_t sum = XXH64_digest(w->xs);
        if (!w->failed && pt_out_write(&w->o, &sum, 8, &w->err) < 0) w->failed = 1;
        if (!w->failed && pt_out_commit(&w->o, &w->err) < 0) w->failed = 1;
        else if (w->failed) pt_out_abort(&w->o);
        if (w->failed) rc = cli_fail("perplexity: --save-logits: %s", w->err.msg);
    } else pt_out_abort(&w->o);
    XXH64_freeState(w->xs);
    w->xs = NULL;
    return rc;
}

/* ---- progress ---- */

typedef struct ppl_progress {
    int verbose, shown;
    double t0, last; /* start, last line printed (at most 4 lines a second) */
} ppl_progress;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void progress(ppl_progress *p, long long done, long long total) {
    if (!p->verbose && !isatty(STDERR_FILENO)) return;
    double t = now_s() - p->t0;
    if (!p->shown && (t < 1.0 || done >= total)) return;
    if (p->shown && done < total && t - p->last < 0.25) return;
    p->shown = 1;
    p->last = t;
    fprintf(stderr, "\rperplexity: %lld / %lld tokens (%d%%, %.0f s)", done, total, (int)(100 * done / (total ? total : 1)), t);
    if (done >= total) fputc('\n', stderr);
    fflush(stderr);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- the command ---- */

typedef struct ppl_run {
    int V;
    double *ld;        /* owned [V]: this row's log-softmax */
    float *lf;         /* owned [V]: the same in float (saved; argmax for top-1) */
    float *lb;         /* owned [V]: the base row (--kl-base) */
    double nll_sum, *kl; /* kl: owned [N-1] per scored token */
    long long n, agree;
    double base_nll_sum;
} ppl_run;

/* Scores one row of logits x[V] predicting `target` (the n-th scored token). */
static int score_row(ppl_run *r, const float *x, int32_t target, lp_writer *w, FILE *base, const char *base_path) {
    int V = r->V;
    double m = x[0];
    for (int v = 1; v < V; v++) if (x[v] > m) m = x[v];
    double z = 0;
    for (int v = 0; v < V; v++) z += exp((double)x[v] - m);
    double lse = m + log(z);
    for (int v = 0; v < V; v++) r->ld[v] = (double)x[v] - lse;
    r->nll_sum += -r->ld[target];
    if (w || base)
        for (int v = 0; v < V; v++) r->lf[v] = (float)r->ld[v];
    if (w) lp_write(w, r->lf, sizeof(float) * (size_t)V);
    if (base) {
        if (fread(r->lb, sizeof(float), (size_t)V, base) != (size_t)V) return cli_fail("perplexity: --kl-base %s: read error", base_path);
        double bm = r->lb[0];
        int ab = 0, at = 0;
        for (int v = 0; v < V; v++) {
            if (!isfinite(r->lb[v])) return cli_fail("perplexity: --kl-base %s: row %lld holds a non-finite log-prob", base_path, r->n);
            if (r->lb[v] > r->lb[ab]) ab = v;
            if (r->lf[v] > r->lf[at]) at = v;
            if (r->lb[v] > bm) bm = r->lb[v];
        }
        double bz = 0;
        for (int v = 0; v < V; v++) bz += exp((double)r->lb[v] - bm);
        double blse = bm + log(bz), k = 0;
        for (int v = 0; v < V; v++) {
            double lp = (double)r->lb[v] - blse;
            k += exp(lp) * (lp - r->ld[v]);
        }
        r->kl[r->n] = k;
        r->agree += ab == at;
        r->base_nll_sum += -((double)r->lb[target] - blse);
    }
    r->n++;
    return 0;
}

CLI_CMD(perplexity) {
    cli_model_opts mo = {0};
    const char *file = NULL, *tok_opt = NULL, *save = NULL, *base_path = NULL;
    long ctx = 0, stride = 0;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--file") && has) file = argv[++i];
        else if (!strcmp(a, "--tokenizer") && has) tok_opt = argv[++i];
        else if (!strcmp(a, "--save-logits") && has) save = argv[++i];
        else if (!strcmp(a, "--kl-base") && has) base_path = argv[++i];
        else if (!strcmp(a, "--ctx") && has) {
            if (cli_opt_count("perplexity", "--ctx", argv[++i], 2, 1 << 24, &ctx)) return 1;
        } else if (!strcmp(a, "--stride") && has) {
            if (cli_opt_count("perplexity", "--stride", argv[++i], 1, 1 << 24, &stride)) return 1;
        } else return cli_fail("perplexity: unknown or incomplete option \"%s\" (petrel perplexity --help)", a);
    }
    if (!mo.model) return cli_fail("perplexity: --model is required");
    if (!file) return cli_fail("perplexity: --file TEXT is required");
    if (ctx && stride > ctx) return cli_fail("perplexity: --stride %ld is larger than --ctx %ld (windows would skip tokens)", stride, ctx);
    /* an output that must not be replaced is refused before the model runs */
    if (save && (cli_out_check("perplexity: --save-logits", save, mo.model) || cli_out_check("perplexity: --save-logits", save, file))) return 1;
    char tbuf[4096];
    const char *tok_path = cli_tokenizer_path("perplexity", tok_opt, mo.model, tbuf, sizeof tbuf);
    if (!tok_path) return 1;

    petrel_error err = {0};
    char *text = NULL;
    size_t tlen = 0;
    if (pt_read_file(file, (size_t)1 << 30, &text, &tlen, &err)) return cli_fail_err("perplexity: --file", &err);
    if (tlen == 0) { free(text); return cli_fail("perplexity: %s is empty: nothing to score", file); }
    long long bad = bad_text_at((const unsigned char *)text, tlen);
    if (bad >= 0) {
        int nul = text[bad] == 0;
        free(text);
        return cli_fail("perplexity: %s is not UTF-8 text (%s at offset %lld)", file, nul ? "a NUL byte, so binary" : "invalid UTF-8", bad);
    }
    tokenizer *tok = NULL;
    int32_t *ids = NULL;
    size_t N = 0;
    int rc = 0;
    if (cli_tok_load(tok_path, &tok, &err) < 0) rc = cli_fail_err("perplexity", &err);
    else if (tok_encode(tok, text, tlen, &ids, &N, &err) < 0) rc = cli_fail_err("perplexity: tokenizing", &err);
    tok_free(tok);
    free(text);
    if (!rc && N < 2) rc = cli_fail("perplexity: %s holds %zu token%s: nothing to score (at least 2 are needed)", file, N, N == 1 ? "" : "s");
    if (!rc && N > (size_t)1 << 31) rc = cli_fail("perplexity: %s holds %zu tokens; at most 2^31 are supported", file, N);
    if (rc) { free(ids); return rc; }

    /* without --ctx, a --kl-base file's window (and stride, unless given) */
    const char *ctx_from = ctx ? "" : " (the default)";
    long bctx, bstride;
    if (!ctx && base_path && base_peek(base_path, &bctx, &bstride) == 0) {
        ctx = bctx;
        if (!stride) stride = bstride;
        ctx_from = " (from --kl-base)";
    }
    petrel_engine *eng = NULL;
    if (ctx && !mo.open.plan_context) mo.open.plan_context = (int)ctx;
    if (cli_engine_open(&mo, &eng, &err) < 0) { free(ids); return cli_fail_err("perplexity", &err); }
    int V = petrel_engine_vocab_size(eng), maxpos = petrel_engine_max_positions(eng);
    if (!ctx) ctx = maxpos > 0 && maxpos < 512 ? maxpos : 512;
    if (!stride) stride = ctx;
    petrel_session *s = NULL;
    FILE *base = NULL;
    lp_writer w = {0};
    ppl_run run = {.V = V};
    float *lg = NULL;
    if (maxpos > 0 && ctx > maxpos)
        rc = cli_fail("perplexity: --ctx %ld is above the model's context (max_position_embeddings %d)", ctx, maxpos);
    else if (stride > ctx)
        rc = cli_fail("perplexity: --stride %ld is larger than the window, --ctx %ld%s", stride, ctx, ctx_from);
    else if (N < (size_t)ctx)
        rc = cli_fail("perplexity: %s holds %zu tokens, fewer than one window of --ctx %ld%s: use --ctx %zu or less", file, N, ctx, ctx_from, N);
    for (size_t t = 0; !rc && t < N; t++)
        if (ids[t] < 0 || ids[t] >= V)
            rc = cli_fail("perplexity: token %zu of %s is id %d, outside the model's vocab of %d (wrong --tokenizer?)", t, file, ids[t], V);
    if (!rc && base_path) rc = base_open(base_path, V, ids, N, (int)ctx, (int)stride, &base);
    /* logits of up to R rows at a time: at most 64 MiB of them */
    int R = (int)((64u << 20) / (4u * (unsigned)V));
    if (R < 1) R = 1;
    if (R > ctx) R = (int)ctx;
    if (!rc) {
        lg = malloc(sizeof(float) * (size_t)R * (size_t)V);
        run.ld = malloc(sizeof(double) * (size_t)V);
        run.lf = malloc(sizeof(float) * (size_t)V);
        run.lb = malloc(sizeof(float) * (size_t)V);
        run.kl = base ? malloc(sizeof(double) * (N - 1)) : NULL;
        if (!lg || !run.ld || !run.lf || !run.lb || (base && !run.kl)) rc = cli_fail("perplexity: out of memory for %d x %d logits", R, V);
    }
    if (!rc && petrel_session_create(eng, (int)ctx, &s, &err)) rc = cli_fail_err("perplexity", &err);
    if (!rc && save) {
        lp_header h = {LP_VERSION, (uint32_t)V, (uint32_t)ctx, (uint32_t)stride, (uint64_t)N, (uint64_t)N - 1};
        rc = lp_writer_open(&w, save, mo.model, &h, ids);
    }
    /* the windows (see the file's opening comment) */
    ppl_progress pg = {.verbose = mo.open.verbose, .t0 = now_s()};
    long long total = (long long)N - 1, scored_end = 0, windows = 0;
    for (long long b = 0; !rc && scored_end < total; b += stride) {
        long long e = b + ctx < (long long)N ? b + ctx : (long long)N;
        long long s1 = e < total ? e : total; /* last token this window scores */
        long long p0 = scored_end;            /* first predicting position: token scored_end + 1 */
        windows++;
        if (petrel_session_truncate(s, 0, &err)) { rc = cli_fail_err("perplexity", &err); break; }
        if (p0 > b && petrel_session_forward(s, ids + b, (int)(p0 - b), NULL, 0, &err)) { rc = cli_fail_err("perplexity", &err); break; }
        for (long long p = p0; !rc && p < s1; p += R) {
            int n = (int)(s1 - p < R ? s1 - p : R);
            if (petrel_session_forward(s, ids + p, n, lg, 1, &err)) { rc = cli_fail_err("perplexity", &err); break; }
            for (int k = 0; !rc && k < n; k++) rc = score_row(&run, lg + (size_t)k * V, ids[p + k + 1], save ? &w : NULL, base, base_path);
            progress(&pg, run.n, total);
        }
        scored_end = s1;
    }
    if (save) {
        int wrc = lp_writer_close(&w, !rc);
        if (!rc) rc = wrc;
    }
    if (!rc) {
        double nll = run.nll_sum / (double)run.n, ppl = exp(nll);
        double klm = 0, klp99 = 0, top1 = 0, bppl = 0;
        if (base) {
            double ks = 0;
            for (long long k = 0; k < run.n; k++) ks += run.kl[k];
            klm = ks / (double)run.n;
            qsort(run.kl, (size_t)run.n, sizeof(double), cmp_double);
            long long rank = (long long)ceil(0.99 * (double)run.n);
            klp99 = run.kl[(rank < 1 ? 1 : rank) - 1];
            top1 = (double)run.agree / (double)run.n;
            bppl = exp(run.base_nll_sum / (double)run.n);
        }
        if (json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "model", mo.model);
            cJSON_AddStringToObject(o, "file", file);
            cJSON_AddNumberToObject(o, "tokens", (double)N);
            cJSON_AddNumberToObject(o, "scored", (double)run.n);
            cJSON_AddNumberToObject(o, "ctx", (double)ctx);
            cJSON_AddNumberToObject(o, "stride", (double)stride);
            cJSON_AddNumberToObject(o, "windows", (double)windows);
            cJSON_AddNumberToObject(o, "mean_nll", nll);
            cJSON_AddNumberToObject(o, "ppl", ppl);
            if (base) {
                cJSON_AddStringToObject(o, "kl_base", base_path);
                cJSON_AddNumberToObject(o, "kl_mean", klm);
                cJSON_AddNumberToObject(o, "kl_p99", klp99);
                cJSON_AddNumberToObject(o, "top1_agreement", top1);
                cJSON_AddNumberToObject(o, "base_ppl", bppl);
            }
            if (save) cJSON_AddStringToObject(o, "saved_logits", save);
            char *js = o ? cJSON_PrintUnformatted(o) : NULL;
            if (js) printf("%s\n", js);
            else rc = cli_fail("perplexity: out of memory");
            cJSON_free(js);
            cJSON_Delete(o);
        } else {
            printf("perplexity %.6f over %lld tokens of %s (mean NLL %.6f nats; %lld windows, ctx %ld, stride %ld)\n", ppl, run.n, file, nll,
                   windows, ctx, stride);
            if (base)
                printf("vs %s: mean KL %.6g nats, p99 KL %.6g nats, top-1 agreement %.2f%% (base perplexity %.6f)\n", base_path, klm, klp99,
                       100.0 * top1, bppl);
        }
        if (!rc && (fflush(stdout) || ferror(stdout))) rc = cli_fail("perplexity: writing to stdout failed");
    }
    if (base) fclose(base);
    petrel_session_free(s);
    rc = cli_engine_close("perplexity", eng, rc); /* writes --trace-out */
    free(lg);
    free(run.ld);
    free(run.lf);
    free(run.lb);
    free(run.kl);
    free(ids);
    return rc;
}
