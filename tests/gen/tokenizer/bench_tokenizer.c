/* bench_tokenizer.c: encode throughput of the tokenizer (not part of `make test`).
 * Builds a few MB of mixed text (English prose, code, CJK, digits, emoji, whitespace runs) by
 * repeating a deterministic mix, loads a tokenizer.json, times load, encode and decode.
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Iinclude -Isrc tests/gen/tokenizer/bench_tokenizer.c \
 *      src/text/tokenizer.c src/text/tok_load.c src/base/err.c \
 *      -lcjson -lpcre2-8 -lutf8proc -lxxhash -o /tmp/bench_tok
 *   /tmp/bench_tok tests/data/tokenizers/qwen3/tokenizer.json [MB] [ascii|mixed] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "text/tokenizer.h"

/* Process CPU time: the encoder is single-threaded, and on a shared box CPU time is steadier than
 * wall time (equal to it when the machine is idle). */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const char *ascii_parts[] = {
    "The quick brown fox jumps over the lazy dog. ",
    "In 2024, the model processed 1234567 tokens per second, which isn't bad at all!\n",
    "def tokenize(text):\n    return [vocab[w] for w in text.split()]  # TODO: BPE\n\n",
    "    if (x->next != NULL && count < 4096) { total += x->value * 3.14159; }\n",
    "She said, \"We'll see what they're doing tomorrow.\" He replied: 'I'd rather not.'\n",
    "https://example.com/api/v2/users?id=42&sort=desc  -- see RFC 3986, section 3.4\n",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.\n",
};
static const char *mixed_parts[] = {
    "中文文本的分词测试，包含标点符号。我们今天去公园散步。", "日本語のテキスト、カタカナとひらがな。",
    "Русский текст для проверки. ", "हिन्दी पाठ का उदाहरण। ", "emoji 👋🏽 👨‍👩‍👧‍👦 🚀 ",
    "café naïve résumé Ünïcödé ", "<|im_start|>user\nhello<|im_end|>\n",
};

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: bench_tok TOKENIZER.json [MB] [ascii|mixed]\n"); return 2; }
    double mb = argc > 2 ? atof(argv[2]) : 4;
    int mixed = argc > 3 && !strcmp(argv[3], "mixed");
    size_t want = (size_t)(mb * 1024 * 1024), n = 0;
    char *text = malloc(want + 256);
    unsigned seed = 1;
    while (n < want) {
        seed = seed * 1103515245u + 12345u;
        const char *p = (mixed && (seed >> 16) % 3 == 0) ? mixed_parts[(seed >> 8) % 7] : ascii_parts[(seed >> 8) % 7];
        size_t l = strlen(p);
        memcpy(text + n, p, l);
        n += l;
    }
    petrel_error err = {0};
    tokenizer *t;
    double t0 = now();
    if (tok_load(argv[1], &t, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
    double t1 = now();
    int32_t *ids;
    size_t nid;
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        double a = now();
        if (tok_encode(t, text, n, &ids, &nid, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
        double b = now();
        if (b - a < best) best = b - a;
        if (r < 2) free(ids);
    }
    /* the same text in ~2 KB calls (below the per-call word cache threshold) */
    double c0 = now();
    size_t nchunk_tok = 0;
    for (size_t at = 0; at < n;) {
        size_t e = at + 2000 < n ? at + 2000 : n;
        while (e < n && ((unsigned char)text[e] & 0xC0) == 0x80) e--;
        int32_t *ci;
        size_t cn;
        if (tok_encode(t, text + at, e - at, &ci, &cn, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
        nchunk_tok += cn;
        free(ci);
        at = e;
    }
    double c1 = now();
    char *dec;
    size_t dn;
    double d0 = now();
    tok_decode(t, ids, nid, &dec, &dn, &err);
    double d1 = now();
    printf("load %.0f ms; %s text %.2f MB -> %zu tokens (%.2f bytes/token); encode %.1f MB/s "
           "(%.2f Mtok/s); in 2 KB calls %.1f MB/s; decode %.0f MB/s; round trip %s\n",
           (t1 - t0) * 1e3, mixed ? "mixed" : "ascii", n / 1048576.0, nid, (double)n / nid,
           n / 1048576.0 / best, nid / 1e6 / best, n / 1048576.0 / (c1 - c0), dn / 1048576.0 / (d1 - d0),
           dn == n && !memcmp(dec, text, n) ? "ok" : "DIFFERS");
    (void)nchunk_tok;
    free(dec);
    free(ids);
    free(text);
    tok_free(t);
    return 0;
}
