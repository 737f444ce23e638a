/* fuzz_tokenizer.c: libFuzzer target for the tokenizer (src/text/tokenizer.h). The first input
 * byte picks what the rest is:
 *   even  text to encode with a bundled tokenizer (loaded once: $PETREL_FUZZ_TOKENIZER, else
 *         tests/data/tiny/tokenizer.json, relative to the repo root); valid UTF-8 must round-trip
 *         through decode (only checked for the tiny one: it has no normalizer) and the streaming
 *         decoder must give the same bytes; the bytes as raw ids must decode or fail cleanly
 *   odd   a tokenizer.json for the loader; when it loads, the rest after the first NUL (or the
 *         JSON itself) is encoded and decoded with it
 * Errors are fine; crashes, sanitizer reports and round-trip mismatches (trap) are findings.
 *   build-fuzz/fuzz_tokenizer -max_total_time=60 fuzz/corpus/tokenizer */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer.h"

static tokenizer *g_tok;

static void exercise(const tokenizer *t, const char *s, size_t n, int check_roundtrip) {
    petrel_error err;
    int32_t *ids = NULL;
    size_t nid = 0;
    if (tok_encode(t, s, n, &ids, &nid, &err) < 0) return;
    char *dec = NULL;
    size_t dn = 0;
    if (tok_decode(t, ids, nid, &dec, &dn, &err) == 0) {
        if (check_roundtrip && (dn != n || memcmp(dec, s, n))) __builtin_trap();
        tok_stream st;
        tok_stream_init(&st, t);
        size_t at = 0;
        for (size_t i = 0; i < nid; i++) {
            const char *p;
            size_t pn;
            if (tok_stream_push(&st, ids[i], &p, &pn, &err) < 0) __builtin_trap();
            if (at + pn > dn || memcmp(dec + at, p, pn)) __builtin_trap();
            at += pn;
        }
        const char *p;
        size_t pn;
        tok_stream_flush(&st, &p, &pn, &err);
        if (at + pn != dn || memcmp(dec + at, p, pn)) __builtin_trap();
        tok_stream_free(&st);
        free(dec);
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok) {
        const char *path = getenv("PETREL_FUZZ_TOKENIZER");
        petrel_error err;
        if (tok_load(path ? path : "tests/data/tiny/tokenizer.json", &g_tok, &err) < 0) {
            fprintf(stderr, "fuzz_tokenizer: %s\n", err.msg);
            abort();
        }
    }
    if (size < 1) return 0;
    const char *s = (const char *)data + 1;
    size_t n = size - 1;
    if (!(data[0] & 1)) {
        /* the tiny vocabulary has no normalizer: valid text round-trips exactly */
        exercise(g_tok, s, n, getenv("PETREL_FUZZ_TOKENIZER") == NULL);
        /* ids from the raw bytes: decoding must not crash on any id */
        size_t k = n / 4;
        if (k) {
            int32_t *ids = malloc(k * sizeof *ids);
            memcpy(ids, s, k * sizeof *ids);
            for (size_t i = 0; i < k; i++) ids[i] = data[0] & 2 ? ids[i] % 1100 : ids[i];
            char *out;
            petrel_error err;
            if (tok_decode(g_tok, ids, k, &out, NULL, &err) == 0) free(out);
            free(ids);
        }
        return 0;
    }
    tokenizer *t = NULL;
    petrel_error err;
    const char *nul = memchr(s, 0, n);
    size_t jl = nul ? (size_t)(nul - s) : n;
    if (tok_load_json(s, jl, "fuzz.json", &t, &err) == 0) {
        if (nul) exercise(t, nul + 1, n - jl - 1, 0);
        else exercise(t, s, jl, 0);
        tok_free(t);
    }
    return 0;
}
