/* test_tokenizer.c: the tokenizer.json BPE tokenizer against goldens from the real Hugging Face
 * tokenizers library (tests/data/tokenizers/goldens.json, made by tests/gen/tokenizer/
 * gen_goldens.js) for Qwen3, DeepSeek-V3, the tiny model's vocabulary and variants of it with
 * other pre-tokenizers/normalizers/added-token flags; round trips, the
 * streaming detokenizer, and clear errors on bad text, ids and tokenizer.json files. */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "test.h"
#include "text/tok_internal.h" /* tok_normalize */
#include "text/tokenizer.h"

static int valid_utf8(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &c);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* 1 if NFC leaves s unchanged (round trips through an NFC normalizer are then exact). */
static int nfc_stable(const char *s) {
    utf8proc_uint8_t *d = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, 0, &d,
                                      UTF8PROC_NULLTERM | UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    int same = r >= 0 && !strcmp((const char *)d, s);
    free(d);
    return same;
}

static void check_vocab(const cJSON *entry) {
    const cJSON *file = cJSON_GetObjectItem(entry, "file");
    const cJSON *cases = cJSON_GetObjectItem(entry, "cases");
    CHECK(cJSON_IsString(file) && cJSON_IsArray(cases));
    if (!cJSON_IsString(file) || !cJSON_IsArray(cases)) return;
    int roundtrip = cJSON_IsTrue(cJSON_GetObjectItem(entry, "roundtrip"));
    tokenizer *t = NULL;
    petrel_error err = {0};
    int rc = tok_load(test_data(file->valuestring), &t, &err);
    CHECK_MSG(rc == 0, "load %s: %s", file->valuestring, err.msg);
    if (rc) return;
    int ci = 0, bad = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        const cJSON *want = cJSON_GetObjectItem(c, "ids");
        int32_t *ids = NULL;
        size_t n = 0, len = strlen(text);
        rc = tok_encode(t, text, len, &ids, &n, &err);
        CHECK_MSG(rc == 0, "%s case %d: %s", entry->string, ci, err.msg);
        int same = rc == 0 && (int)n == cJSON_GetArraySize(want);
        for (size_t i = 0; same && i < n; i++) same = ids[i] == cJSON_GetArrayItem(want, (int)i)->valueint;
        if (!same) {
            if (bad++ < 5) {
                char got[400] = "", exp[400] = "";
                size_t o = 0;
                for (size_t i = 0; i < n && o < sizeof got - 16; i++) o += (size_t)snprintf(got + o, sizeof got - o, "%d ", ids[i]);
                o = 0;
                for (int i = 0; i < cJSON_GetArraySize(want) && o < sizeof exp - 16; i++)
                    o += (size_t)snprintf(exp + o, sizeof exp - o, "%d ", cJSON_GetArrayItem(want, i)->valueint);
                test_fail(__FILE__, __LINE__, "%s case %d \"%.60s\": got [%s] want [%s]", entry->string, ci, text, got, exp);
            }
        }
        /* round trip, whole and streamed */
        char *dec = NULL;
        size_t dn = 0;
        rc = tok_decode(t, ids, n, &dec, &dn, &err);
        CHECK_MSG(rc == 0, "decode: %s", err.msg);
        if (rc == 0 && roundtrip && nfc_stable(text))
            CHECK_MSG(dn == len && !memcmp(dec, text, len), "%s case %d: round trip differs", entry->string, ci);
        tok_stream s;
        tok_stream_init(&s, t);
        char *acc = malloc(dn + 8);
        size_t an = 0;
        for (size_t i = 0; i < n && acc; i++) {
            const char *p;
            size_t pn;
            CHECK(tok_stream_push(&s, ids[i], &p, &pn, &err) == 0);
            if (valid_utf8(dec, dn)) CHECK_MSG(valid_utf8(p, pn), "%s case %d: stream piece splits a character", entry->string, ci);
            memcpy(acc + an, p, pn);
            an += pn;
        }
        const char *p;
        size_t pn;
        CHECK(tok_stream_flush(&s, &p, &pn, &err) == 0);
        if (acc) {
            memcpy(acc + an, p, pn);
            an += pn;
            CHECK_MSG(an == dn && (!dn || !memcmp(acc, dec, dn)), "%s case %d: streamed text differs", entry->string, ci);
        }
        free(acc);
        tok_stream_free(&s);
        free(dec);
        free(ids);
        ci++;
    }
    tok_free(t);
}

static cJSON *goldens(void) {
    char *j = test_read_file(test_data("tokenizers/goldens.json"), NULL);
    CHECK_MSG(j != NULL, "cannot read %s", test_data("tokenizers/goldens.json"));
    if (!j) return NULL;
    cJSON *g = cJSON_Parse(j);
    free(j);
    CHECK(g != NULL);
    return g;
}

static void golden_for(const char *name) {
    cJSON *g = goldens();
    if (!g) return;
    const cJSON *e = cJSON_GetObjectItem(g, name);
    CHECK_MSG(e != NULL, "no goldens for %s", name);
    if (e) check_vocab(e);
    cJSON_Delete(g);
}

TEST(tokenizer, golden_qwen3) { golden_for("qwen3"); }
TEST(tokenizer, golden_deepseek_v3) { golden_for("deepseek_v3"); }
TEST(tokenizer, golden_tiny) { golden_for("tiny"); }
/* the tiny vocabulary with other pipelines (tests/gen/tokenizer/gen_goldens.js) */
TEST(tokenizer, golden_variant_gpt2) { golden_for("variant_gpt2"); }
TEST(tokenizer, golden_variant_ignore_merges) { golden_for("variant_ignore_merges"); }
TEST(tokenizer, golden_variant_splits) { golden_for("variant_splits"); }

TEST(tokenizer, tiny_specials_and_roundtrip) {
    tokenizer *t;
    petrel_error err = {0};
    int rc = tok_load(test_data("tiny/tokenizer.json"), &t, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (rc) return;
    CHECK_EQ_INT(tok_vocab_size(t), 1024);
    static const char *sp[] = {"[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                               "<|observation|>", "<think>", "</think>", "<|endoftext|>"};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) {
        int32_t id = tok_token_to_id(t, sp[i]);
        CHECK_MSG(id >= 0 && id < 1024, "%s -> %d", sp[i], id);
    }
    CHECK(tok_is_special(t, tok_token_to_id(t, "<|user|>")));
    CHECK_EQ_INT(tok_token_to_id(t, "no such token here"), -1);
    CHECK_EQ_INT(tok_token_to_id(t, "a"), 16 + 'a');
    const char *text = "[gMASK]<sop><|user|>\nHello, how are you?<|assistant|>\n<think></think>Fine.";
    int32_t *ids;
    size_t n;
    CHECK(tok_encode(t, text, strlen(text), &ids, &n, &err) == 0);
    CHECK(n > 6);
    if (n > 3) {
        CHECK_EQ_INT(ids[0], tok_token_to_id(t, "[gMASK]"));
        CHECK_EQ_INT(ids[1], tok_token_to_id(t, "<sop>"));
        CHECK_EQ_INT(ids[2], tok_token_to_id(t, "<|user|>"));
    }
    for (size_t i = 0; i < n; i++) CHECK(ids[i] >= 0 && ids[i] < 1024);
    char *dec;
    CHECK(tok_decode(t, ids, n, &dec, NULL, &err) == 0);
    CHECK(!strcmp(dec, text));
    free(dec);
    free(ids);
    /* the config next to it carries the chat template and eos */
    char *cfg = test_read_file(test_data("tiny/tokenizer_config.json"), NULL);
    CHECK(cfg != NULL);
    cJSON *c = cfg ? cJSON_Parse(cfg) : NULL;
    CHECK(c != NULL);
    const cJSON *tpl = cJSON_GetObjectItem(c, "chat_template");
    CHECK(cJSON_IsString(tpl) && strstr(tpl->valuestring, "[gMASK]<sop>"));
    const cJSON *eos = cJSON_GetObjectItem(c, "eos_token");
    CHECK(cJSON_IsString(eos) && tok_token_to_id(t, eos->valuestring) >= 0);
    cJSON_Delete(c);
    free(cfg);
    tok_free(t);
}

TEST(tokenizer, bad_text_and_ids) {
    tokenizer *t;
    petrel_error err = {0};
    if (tok_load(test_data("tiny/tokenizer.json"), &t, &err)) { CHECK_MSG(0, "%s", err.msg); return; }
    int32_t *ids;
    size_t n;
    static const struct { const char *s; size_t len; const char *off; } bad[] = {
        {"abc\xff", 4, "byte offset 3"}, {"\xc3", 1, "byte offset 0"}, {"ab\xc0\xaf", 4, "byte offset 2"},
        {"x\xed\xa0\x80", 4, "byte offset 1"}, {"hi \xf4\x90\x80\x80", 7, "byte offset 3"},
        {"ok\x80", 3, "byte offset 2"}, {"\xe2\x82", 2, "byte offset 0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err.msg[0] = 0;
        CHECK_EQ_INT(tok_encode(t, bad[i].s, bad[i].len, &ids, &n, &err), PETREL_EINVAL);
        CHECK_MSG(strstr(err.msg, bad[i].off) && strstr(err.msg, "UTF-8"), "case %zu: %s", i, err.msg);
    }
    CHECK(tok_encode(t, "", 0, &ids, &n, &err) == 0 && n == 0);
    free(ids);
    /* an embedded NUL is text like any other */
    CHECK(tok_encode(t, "a\0b", 3, &ids, &n, &err) == 0 && n == 3);
    free(ids);
    int32_t unk[] = {5, 99999};
    char *out;
    CHECK_EQ_INT(tok_decode(t, unk, 2, &out, NULL, &err), PETREL_EINVAL);
    CHECK_MSG(strstr(err.msg, "99999") != NULL, "%s", err.msg);
    int32_t neg[] = {-3};
    CHECK_EQ_INT(tok_decode(t, neg, 1, &out, NULL, &err), PETREL_EINVAL);
    CHECK_MSG(strstr(err.msg, "-3") != NULL, "%s", err.msg);
    tok_stream s;
    tok_stream_init(&s, t);
    const char *p;
    size_t pn;
    CHECK_EQ_INT(tok_stream_push(&s, 5000, &p, &pn, &err), PETREL_EINVAL);
    CHECK(strstr(err.msg, "5000") != NULL);
    /* a 4-byte character fed one byte token at a time comes out whole, once */
    const unsigned char emoji[] = {0xF0, 0x9F, 0x98, 0x80};
    for (int i = 0; i < 4; i++) {
        CHECK(tok_stream_push(&s, 16 + emoji[i], &p, &pn, &err) == 0);
        CHECK_EQ_INT(pn, i == 3 ? 4 : 0);
    }
    CHECK(!memcmp(p, emoji, 4));
    /* an incomplete tail is handed out by flush */
    CHECK(tok_stream_push(&s, 16 + 0xE2, &p, &pn, &err) == 0 && pn == 0);
    CHECK(tok_stream_flush(&s, &p, &pn, &err) == 0 && pn == 1 && (unsigned char)p[0] == 0xE2);
    tok_stream_free(&s);
    tok_free(t);
}

/* Loads JSON text, expecting failure with code and a message containing want. */
static void expect_load_error(const char *json, int code, const char *want) {
    tokenizer *t = NULL;
    petrel_error err = {0};
    int rc = tok_load_json(json, strlen(json), "test.json", &t, &err);
    CHECK_MSG(rc == code, "want %d got %d (%s) for %.80s", code, rc, err.msg, json);
    CHECK_MSG(strstr(err.msg, want) != NULL, "message \"%s\" lacks \"%s\"", err.msg, want);
    CHECK(t == NULL);
    tok_free(t);
}

#define PRE_OK "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false}"
TEST(tokenizer, bad_json) {
    expect_load_error("{", PETREL_EFORMAT, "not valid JSON");
    expect_load_error("[]", PETREL_EFORMAT, "not a JSON object");
    expect_load_error("{\"added_tokens\":[]}", PETREL_EFORMAT, "\"model\"");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"merges\":[]}," PRE_OK "}", PETREL_EFORMAT, "model.vocab");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{}}," PRE_OK "}", PETREL_EFORMAT, "model.merges");
    expect_load_error("{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", PETREL_EUNSUPPORTED, "WordPiece");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"},\"merges\":[]}," PRE_OK "}", PETREL_EFORMAT, "model.vocab");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[7]}," PRE_OK "}", PETREL_EFORMAT, "model.merges[0]");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]}," PRE_OK "}", PETREL_EFORMAT, "\"ab\" is not in model.vocab");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"Metaspace\"}}", PETREL_EUNSUPPORTED, "Metaspace");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}", PETREL_EUNSUPPORTED, "pre_tokenizer");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}," PRE_OK ","
                      "\"normalizer\":{\"type\":\"BertNormalizer\"}}", PETREL_EUNSUPPORTED, "BertNormalizer");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}," PRE_OK ","
                      "\"decoder\":{\"type\":\"WordPiece\"}}", PETREL_EUNSUPPORTED, "WordPiece");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}," PRE_OK ","
                      "\"added_tokens\":[{\"id\":1}]}", PETREL_EFORMAT, "added_tokens[0].content");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}," PRE_OK ","
                      "\"added_tokens\":[{\"content\":\"<x>\",\"id\":-1}]}", PETREL_EFORMAT, "added_tokens[0].id");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},\"behavior\":\"Isolated\"}}",
                      PETREL_EUNSUPPORTED, "pre_tokenizer.pattern");
    tokenizer *t;
    petrel_error err = {0};
    CHECK_EQ_INT(tok_load("/nonexistent/tokenizer.json", &t, &err), PETREL_EIO);
    CHECK(strstr(err.msg, "/nonexistent/tokenizer.json") != NULL);
}

/* Split behaviors and a Sequence, on a tiny vocabulary of single bytes (ids = byte values):
 * the pieces show up as where merges could not cross. */
TEST(tokenizer, split_behaviors) {
    static const struct { const char *behavior; int invert; const char *want; } cases[] = {
        {"Isolated", 0, "ab|-|cd|-|-|e"}, {"Removed", 0, "ab|cd|e"}, {"Removed", 1, "-|-|-"},
        {"MergedWithPrevious", 0, "ab-|cd-|-|e"}, {"MergedWithNext", 0, "ab|-cd|-|-e"},
        {"Contiguous", 0, "ab|-|cd|--|e"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        /* vocab: bytes a b c d e - and "|" markers are not needed: we decode piece by piece by
         * giving every pair a merge, so a piece merges fully into one token */
        char json[4096];
        snprintf(json, sizeof json,
                 "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"d\":3,\"e\":4,\"-\":5,"
                 "\"ab\":6,\"cd\":7,\"ab-\":8,\"cd-\":9,\"-cd\":10,\"-e\":11,\"--\":12},"
                 "\"merges\":[\"a b\",\"c d\",\"ab -\",\"cd -\",\"- cd\",\"- e\",\"- -\"]},"
                 "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\","
                 "\"pattern\":{\"String\":\"-\"},\"behavior\":\"%s\",\"invert\":%s},"
                 "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}]}}",
                 cases[c].behavior, cases[c].invert ? "true" : "false");
        tokenizer *t;
        petrel_error err = {0};
        int rc = tok_load_json(json, strlen(json), "split.json", &t, &err);
        CHECK_MSG(rc == 0, "%s: %s", cases[c].behavior, err.msg);
        if (rc) continue;
        int32_t *ids;
        size_t n;
        CHECK(tok_encode(t, "ab-cd--e", 8, &ids, &n, &err) == 0);
        char got[128] = "";
        size_t o = 0;
        for (size_t i = 0; i < n; i++) {
            size_t l;
            const char *b = tok_id_to_bytes(t, ids[i], &l);
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%.*s", i ? "|" : "", (int)l, b);
        }
        CHECK_MSG(!strcmp(got, cases[c].want), "%s invert=%d: got %s want %s", cases[c].behavior,
                  cases[c].invert, got, cases[c].want);
        free(ids);
        tok_free(t);
    }
}

/* The NFC normalizer only runs utf8proc on stretches that can change: it must agree with a
 * whole-string NFC on random mixes of starters, marks, Hangul jamo and precomposed letters. */
TEST(tokenizer, nfc_chunked_matches_full) {
    static const char *json =
        "{\"normalizer\":{\"type\":\"NFC\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
        "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false}}";
    static const char *pool[] = {"a", "e", " ", "\xcc\x81" /* U+0301 */, "\xcc\x88", "\xcc\xa3" /* U+0323 */,
                                 "\xc3\xa9", "\xe1\x84\x80" /* U+1100 L */, "\xe1\x85\xa1" /* U+1161 V */,
                                 "\xe1\x86\xa8" /* U+11A8 T */, "\xea\xb0\x80" /* U+AC00 */, "\xe4\xb8\xad",
                                 "\xe3\x81\x8b" /* ka */, "\xe3\x82\x99" /* U+3099 */, "\xe2\x84\xab" /* U+212B */,
                                 "\xef\xac\x81", "\xe0\xa4\x95", "\xe0\xa4\xbc" /* U+093C */, "\xf0\x9f\x99\x82",
                                 "\xe0\xbd\xb1" /* U+0F71 */, "\xe0\xbe\x80"};
    tokenizer *t;
    petrel_error err = {0};
    int rc = tok_load_json(json, strlen(json), "nfc.json", &t, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (rc) return;
    unsigned seed = 7;
    char buf[256];
    for (int it = 0; it < 3000; it++) {
        size_t n = 0;
        seed = seed * 1103515245u + 12345u;
        int k = 1 + (int)((seed >> 16) % 24);
        for (int j = 0; j < k; j++) {
            seed = seed * 1103515245u + 12345u;
            const char *p = pool[(seed >> 16) % (sizeof pool / sizeof pool[0])];
            memcpy(buf + n, p, strlen(p));
            n += strlen(p);
        }
        buf[n] = 0;
        char *o;
        size_t on;
        int owned;
        CHECK(tok_normalize(t, buf, n, &o, &on, &owned, &err) == 0);
        utf8proc_uint8_t *d = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)buf, (utf8proc_ssize_t)n, &d,
                                          UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        CHECK_MSG(r >= 0 && (size_t)r == on && !memcmp(d, o, on), "NFC differs on case %d", it);
        free(d);
        if (owned) free(o);
    }
    tok_free(t);
}

/* Found by fuzz_tokenizer: an empty token listed first (the byte arena was still unallocated)
 * and a word that encodes to no ids (bytes outside a vocabulary without byte fallback) must load
 * and encode cleanly (make asan stops on the undefined behaviour they used to hit). */
TEST(tokenizer, empty_token_and_empty_word) {
    const char *json = "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"\":0,\"a\":1,\"b\":2},\"merges\":[]}," PRE_OK "}";
    tokenizer *t = NULL;
    petrel_error err = {0};
    CHECK_MSG(tok_load_json(json, strlen(json), "empty.json", &t, &err) == 0, "%s", err.msg);
    if (!t) return;
    for (int rep = 0; rep < 2; rep++) { /* the second pass hits the word cache */
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK(tok_encode(t, "a zz b", 6, &ids, &n, &err) == 0);
        int a = 0, b = 0;
        for (size_t i = 0; i < n; i++) a += ids[i] == 1, b += ids[i] == 2;
        CHECK(a == 1 && b == 1);
        free(ids);
    }
    tok_free(t);
}
