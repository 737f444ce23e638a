/* test_stream.c: expert streaming through the engine. A pack of each fixture is opened fully
 * resident and with a tiny slot budget (--expert-slots 1..K); logits must be bitwise equal in
 * prefill and decode. Faults injected at the I/O seam fail that request with a clear error and
 * leave the engine usable; a corrupted expert record is detected. A budget that cannot be met is
 * refused at open. */
#include <stdlib.h>
#include <string.h>

#include "experts/xs.h"
#include "io/convert.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "model/synth.h"
#include "test.h"

static const char *make_pack(const char *fixture, int quant) { return test_pack_of(fixture, quant); }

static float *logits_of(petrel_engine *e, const int32_t *ids, int T, int decode, int *rc_out, petrel_error *err) {
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s;
    int rc = petrel_session_create(e, T, &s, err);
    if (rc == 0) {
        if (decode)
            for (int t = 0; t < T && rc == 0; t++) rc = petrel_session_forward(s, ids + t, 1, lg + (size_t)t * V, 0, err);
        else rc = petrel_session_forward(s, ids, T, lg, 1, err);
        petrel_session_free(s);
    }
    *rc_out = rc;
    return lg;
}

/* budget 0: --expert-slots 1 alone; else that --mem-budget too, which also leaves the token
 * embedding in the pack (rows read through the map, pages dropped after each batch) */
static void check_bitwise_budget(const char *fixture, int quant, uint64_t budget) {
    const char *pk = make_pack(fixture, quant);
    petrel_error err = {0};
    petrel_engine *res = NULL, *str = NULL;
    petrel_open_opts o1 = {0}, o2 = {0};
    o2.expert_slots = 1;
    o2.mem_budget = budget;
    CHECK(petrel_engine_open(pk, &o1, &res, &err) == 0);
    CHECK_MSG(petrel_engine_open(pk, &o2, &str, &err) == 0, "%s", err.msg);
    if (!res || !str) { petrel_engine_close(res); petrel_engine_close(str); return; }
    CHECK(res->xs == NULL);
    CHECK(str->xs != NULL);
    CHECK(res->pack->on_disk == NULL);
    if (budget && pack_find(str->pack, "lm_head.weight")) {
        CHECK(str->pack->on_disk != NULL && str->pack->on_disk == pack_find(str->pack, "model.embed_tokens.weight"));
        CHECK(str->w.embed_tokens.data >= str->pack->map && str->w.embed_tokens.data < str->pack->map + str->pack->file_size);
        CHECK_MSG(strstr(str->plan_text, "embed_tokens") != NULL, "plan: %s", str->plan_text);
    } else CHECK(str->pack->on_disk == NULL);
    /* slots are at least top-k; with one requested, the plan raises it to the minimum */
    CHECK_EQ_INT(xs_store_slots(str->xs), 1);
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data(fixture));
    st_set *g;
    CHECK(st_open(p, &g, &err) == 0);
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(g, pi, "ids");
        if (!ids) break;
        int T = (int)ids->shape[0], V = res->cfg.vocab_size;
        for (int dec = 0; dec < 2; dec++) {
            int rc1, rc2;
            float *a = logits_of(res, (const int32_t *)ids->data, T, dec, &rc1, &err);
            float *b = logits_of(str, (const int32_t *)ids->data, T, dec, &rc2, &err);
            CHECK(rc1 == 0 && rc2 == 0);
            CHECK_MSG(!memcmp(a, b, sizeof(float) * (size_t)T * V), "%s prompt %d %s: streamed logits differ from resident", fixture, pi,
                      dec ? "decode" : "prefill");
            free(a);
            free(b);
        }
    }
    xs_stats st;
    xs_store_stats(str->xs, &st);
    CHECK(st.reads > 0 && st.evictions > 0); /* the test really streamed (reads: demand misses or prefetches) */
    st_close(g);
    petrel_engine_close(res);
    petrel_engine_close(str);
}

static void check_bitwise(const char *fixture, int quant) { check_bitwise_budget(fixture, quant, 0); }

TEST(stream, bitwise_tiny_bf16) { check_bitwise("tiny", CVQ_BF16); }
TEST(stream, bitwise_budget_embed_on_disk) {
    check_bitwise_budget("tiny", CVQ_Q8, 1ull << 30);
    check_bitwise_budget("odd2", CVQ_Q4, 1ull << 30);
}
TEST(stream, bitwise_fp8_q4) { check_bitwise("tiny-fp8", CVQ_Q4); }
TEST(stream, bitwise_odd_q4) { check_bitwise("odd", CVQ_Q4); }
TEST(stream, bitwise_odd2_q8) { check_bitwise("odd2", CVQ_Q8); }
TEST(stream, bitwise_odd3_q4) { check_bitwise("odd3", CVQ_Q4); }

static int fault_mode;
static void fault_hook(void *ctx, int layer, int expert, int attempt, xs_fault *f) {
    (void)ctx;
    (void)layer;
    (void)expert;
    (void)attempt;
    if (fault_mode == 1) f->kind = XS_FAULT_ERROR;
    if (fault_mode == 2) { f->kind = XS_FAULT_SHORT; f->short_bytes = 100; }
}

/* petrel_engine_expert_stats, the public form of the store's counters (the server's /metrics):
 * all zero when every expert is resident; after forwards over a streamed engine, the store's
 * own counters field by field (4 slots of 16 experts: reads happen; prefetched experts count as
 * hits). */
TEST(stream, public_expert_stats) {
    const char *pk = make_pack("tiny", CVQ_BF16);
    petrel_error err = {0};
    petrel_engine *res = NULL, *str = NULL;
    petrel_open_opts o1 = {0}, o2 = {0};
    o2.expert_slots = 4;
    CHECK(petrel_engine_open(pk, &o1, &res, &err) == 0);
    CHECK_MSG(petrel_engine_open(pk, &o2, &str, &err) == 0, "%s", err.msg);
    if (res && str) {
        int32_t ids[12] = {5, 17, 300, 42, 7, 9, 11, 500, 600, 700, 800, 900};
        int rc;
        free(logits_of(res, ids, 12, 0, &rc, &err));
        CHECK(rc == 0);
        free(logits_of(str, ids, 12, 1, &rc, &err));
        CHECK(rc == 0);
        petrel_expert_stats a, b;
        memset(&a, 0xff, sizeof a);
        petrel_engine_expert_stats(res, &a);
        CHECK(a.accesses == 0 && a.hits == 0 && a.bytes_read == 0 && a.read_failures == 0);
        petrel_engine_expert_stats(str, &b);
        xs_stats xs = {0};
        xs_store_stats(str->xs, &xs);
        CHECK(b.accesses == xs.accesses && b.hits == xs.hits && b.bytes_read == xs.bytes_read && b.read_failures == xs.read_failures);
        CHECK_MSG(b.accesses > 0 && b.hits <= b.accesses && b.bytes_read > 0, "accesses %llu hits %llu bytes %llu", (unsigned long long)b.accesses,
                  (unsigned long long)b.hits, (unsigned long long)b.bytes_read);
    }
    petrel_engine_close(res);
    petrel_engine_close(str);
}

TEST(stream, faults_fail_cleanly) {
    const char *pk = make_pack("tiny", CVQ_BF16);
    petrel_error err = {0};
    petrel_engine *e = NULL;
    petrel_open_opts o = {0};
    o.expert_slots = 4;
    CHECK(petrel_engine_open(pk, &o, &e, &err) == 0);
    if (!e) return;
    int32_t ids[12] = {5, 17, 300, 42, 7, 9, 11, 500, 600, 700, 800, 900};
    int rc;
    float *good = logits_of(e, ids, 12, 0, &rc, &err);
    CHECK(rc == 0);
    for (int mode = 1; mode <= 2; mode++) {
        xs_io_fault_hook = fault_hook;
        fault_mode = mode;
        /* a fresh session: its first tokens need experts not all resident (4 slots of 16) */
        int32_t other[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
        float *bad = logits_of(e, other, 12, 0, &rc, &err);
        CHECK_MSG(rc < 0, "mode %d: injected fault not reported", mode);
        CHECK_MSG(strstr(err.msg, "expert") != NULL, "mode %d: message \"%s\"", mode, err.msg);
        free(bad);
        xs_io_fault_hook = NULL;
        fault_mode = 0;
        float *again = logits_of(e, ids, 12, 0, &rc, &err); /* usable afterwards, same answer */
        CHECK(rc == 0);
        CHECK(!memcmp(again, good, sizeof(float) * 12 * 1024));
        free(again);
    }
    free(good);
    petrel_engine_close(e);
}

TEST(stream, corrupt_record_detected) {
    const char *pk = make_pack("tiny", CVQ_Q8);
    petrel_error err = {0};
    petrel_engine *e = NULL;
    CHECK(petrel_engine_open(pk, NULL, &e, &err) == 0);
    if (!e) return;
    uint64_t off, bytes, x;
    CHECK(pack_expert_record(e->pack, 3, 5, &off, &bytes, &x) == 0);
    petrel_engine_close(e);
    FILE *f = fopen(pk, "r+b");
    CHECK(f != NULL);
    if (!f) return;
    fseek(f, (long)(off + 17), SEEK_SET);
    int ch = fgetc(f);
    fseek(f, (long)(off + 17), SEEK_SET);
    fputc(ch ^ 0x40, f);
    fclose(f);
    petrel_open_opts o = {0};
    o.expert_slots = 16; /* all experts fit: a full pass reads every expert once */
    CHECK(petrel_engine_open(pk, &o, &e, &err) == 0);
    if (!e) return;
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (i * 37 + 11) % 1024;
    int rc, hit = 0;
    for (int trial = 0; trial < 8 && !hit; trial++) {
        for (int i = 0; i < 64; i++) ids[i] = (ids[i] * 13 + trial) % 1024;
        float *lg = logits_of(e, ids, 64, 0, &rc, &err);
        free(lg);
        if (rc < 0) {
            CHECK_MSG(strstr(err.msg, "checksum") != NULL, "message \"%s\"", err.msg);
            hit = 1;
        }
    }
    CHECK_MSG(hit, "the corrupted expert 3/5 was never reported");
    petrel_engine_close(e);
}

TEST(stream, budget_refused) {
    const char *pk = make_pack("tiny", CVQ_BF16);
    petrel_error err = {0};
    petrel_engine *e = NULL;
    petrel_open_opts o = {0};
    o.mem_budget = 100000; /* 100 KB: not even the resident weights */
    CHECK(petrel_engine_open(pk, &o, &e, &err) == PETREL_ENOMEM);
    CHECK(e == NULL);
    CHECK_MSG(strstr(err.msg, "budget") != NULL, "message \"%s\"", err.msg);
    o.mem_budget = 1ull << 30; /* plenty: every expert fits */
    CHECK(petrel_engine_open(pk, &o, &e, &err) == 0);
    if (e) CHECK_EQ_INT(xs_store_slots(e->xs), 16);
    petrel_engine_close(e);
    o.mem_budget = 0;
    o.expert_slots = 2;
    CHECK(petrel_engine_open(test_data("tiny"), &o, &e, &err) == PETREL_EUNSUPPORTED); /* HF folder: needs a pack */
}

/* The prefill chunk and span rule (stream_chunk_plan), on GLM-5.2 shapes: no budget, resident
 * chunks and no span; under a budget the largest chunk of 256..2048 whose scratch fits 1/10 of it
 * and a layer-major span of whole chunks, at most the planned context, within 1/16 of it (none
 * when that is not more than a chunk). The engine takes the plan; a session's batch never
 * exceeds the chunk and its span holds min(capacity, span) rows in whole chunks. */
TEST(stream, chunk_follows_budget) {
    char *cj = synth_glm52_config(1, 2);
    petrel_config c;
    petrel_error err = {0};
    CHECK(cj && config_parse(cj, strlen(cj), "glm52", &c, &err) == 0);
    free(cj);
    int ch, pf, spans = 0;
    size_t pfb;
    stream_chunk_plan(&c, 4096, 0, &ch, &pf, &pfb);
    CHECK(ch == PT_CHUNK_RESIDENT && pf == 0 && pfb == 0);
    uint64_t budgets[5] = {1ull << 30, 4ull << 30, 8ull << 30, 24ull << 30, 100ull << 30};
    int ctxs[3] = {1024, 4096, 16384};
    for (int k = 0; k < 5; k++)
        for (int j = 0; j < 3; j++) {
            uint64_t B = budgets[k];
            int ctx = ctxs[j];
            stream_chunk_plan(&c, ctx, B, &ch, &pf, &pfb);
            CHECK(ch >= PT_CHUNK_MIN && ch <= PT_CHUNK_MAX && (ch & (ch - 1)) == 0);
            if (ch > PT_CHUNK_MIN) CHECK(session_scratch_estimate(&c, ctx, ch) <= B / PT_CHUNK_BUDGET_DIV);
            if (ch < PT_CHUNK_MAX) CHECK(session_scratch_estimate(&c, ctx, ch * 2) > B / PT_CHUNK_BUDGET_DIV);
            uint64_t rb = session_prefill_row_bytes(&c, ctx), fit = B / PT_PF_BUDGET_DIV / rb;
            if (fit > (uint64_t)ctx) fit = (uint64_t)ctx;
            fit = fit / (uint64_t)ch * (uint64_t)ch;
            CHECK_EQ_INT(pf, fit > (uint64_t)ch ? (int)fit : 0);
            CHECK(pfb == (size_t)pf * rb && pfb <= B / PT_PF_BUDGET_DIV);
            spans += pf > 0;
        }
    CHECK(spans >= 5); /* the rule gives spans for the budgets that matter (4 GiB and up) */
    config_deinit(&c);
    /* the engine and its sessions follow the plan */
    const char *pk = make_pack("tiny", CVQ_BF16);
    petrel_engine *e = NULL;
    petrel_open_opts o = {0};
    o.expert_slots = 1;
    CHECK(petrel_engine_open(pk, &o, &e, &err) == 0);
    if (e) CHECK(e->chunk == PT_CHUNK_RESIDENT && e->pf_rows == 0);
    petrel_engine_close(e);
    o.expert_slots = 0;
    o.mem_budget = 256ull << 20;
    e = NULL;
    CHECK(petrel_engine_open(pk, &o, &e, &err) == 0);
    if (!e) return;
    int ctx = e->cfg.max_position_embeddings < 4096 ? e->cfg.max_position_embeddings : 4096;
    stream_chunk_plan(&e->cfg, ctx, o.mem_budget, &ch, &pf, &pfb);
    CHECK(e->chunk == ch && e->pf_rows == pf);
    e->chunk = 16; /* sessions take the engine's chunk and span as they are at create */
    e->pf_rows = 100;
    int caps[3] = {10, 70, 300};
    for (int k = 0; k < 3; k++) {
        petrel_session *s = NULL;
        if (petrel_session_create(e, caps[k], &s, &err) == 0) {
            CHECK_EQ_INT(s->max_batch, caps[k] < 16 ? caps[k] : 16);
            CHECK_EQ_INT(s->pf.rows, caps[k] == 10 ? 0 : caps[k] == 70 ? 64 : 96);
            petrel_session_free(s);
        }
    }
    petrel_engine_close(e);
}

/* --trace-out: the engine records every token's experts per MoE layer, in token order, and the
 * file reads back with the same routing the forward used. */
TEST(stream, trace_out_roundtrip) {
    char path[600];
    snprintf(path, sizeof path, "%s/route.trace", test_tmpdir());
    petrel_error err = {0};
    petrel_engine *e = NULL;
    petrel_open_opts o = {0};
    o.trace_out = path;
    CHECK(petrel_engine_open(test_data("tiny"), &o, &e, &err) == 0);
    if (!e) return;
    int32_t ids[10] = {5, 17, 300, 42, 7, 9, 11, 500, 600, 700};
    int rc;
    free(logits_of(e, ids, 7, 0, &rc, &err)); /* a 7-row batch */
    CHECK(rc == 0);
    free(logits_of(e, ids, 3, 1, &rc, &err)); /* then 3 single rows (new session) */
    CHECK(rc == 0);
    int n_moe = e->n_moe, K = e->cfg.num_experts_per_tok;
    petrel_engine_close(e); /* writes the file */
    xs_trace t;
    CHECK(xs_trace_read(&t, path, &err) == 0);
    CHECK_EQ_INT(t.n_tokens, 10);
    CHECK_EQ_INT(t.n_layers, n_moe);
    CHECK_EQ_INT(t.topk, K);
    /* token 7 (first row of the second session) routes like token 0: same id, same position */
    CHECK(!memcmp(t.ids + (size_t)7 * n_moe * K, t.ids, sizeof(int16_t) * (size_t)n_moe * K));
    for (int i = 0; i < t.n_tokens * n_moe * K; i++) CHECK(t.ids[i] >= 0 && t.ids[i] < 16);
    xs_trace_deinit(&t);
    /* one forward of more rows than a small chunk: every row is recorded */
    CHECK(petrel_engine_open(test_data("tiny"), &o, &e, &err) == 0);
    if (!e) return;
    enum { LONG = 400 };
    int32_t many[LONG];
    for (int i = 0; i < LONG; i++) many[i] = (i * 37 + 5) % 1000;
    free(logits_of(e, many, LONG, 0, &rc, &err));
    CHECK(rc == 0);
    petrel_engine_close(e);
    CHECK(xs_trace_read(&t, path, &err) == 0);
    CHECK_EQ_INT(t.n_tokens, LONG);
    int bad = 0;
    for (int i = 0; i < t.n_tokens * n_moe * K; i++) bad += !(t.ids[i] >= 0 && t.ids[i] < 16);
    CHECK_EQ_INT(bad, 0);
    xs_trace_deinit(&t);
}

/* Lookahead reads only the ranks whose running precision reaches the gate: none, the best guess
 * alone, or every guess (at most half the bank), from a store that starts empty. */
TEST(stream, lookahead_reads_ranks_over_the_gate) {
    const char *pk = make_pack("tiny", CVQ_Q8);
    petrel_error err = {0};
    petrel_engine *e = NULL;
    petrel_open_opts o = {0};
    o.expert_slots = 8;
    CHECK(petrel_engine_open(pk, &o, &e, &err) == 0);
    if (!e) return;
    petrel_session *s = NULL;
    CHECK(petrel_session_create(e, 8, &s, &err) == 0);
    int H = e->cfg.hidden_size, K = e->cfg.num_experts_per_tok, l = 0;
    while (!e->cfg.layer_is_moe[l]) l++;
    int ml = e->moe_index[l];
    float *x = malloc(sizeof(float) * (size_t)H);
    for (int i = 0; i < H; i++) x[i] = (float)((i * 7919) % 13) / 6.0f - 1.0f;
    double *prec = xs_la_precision(e->xs, ml);
    xs_stats a, b;
    int expect[3] = {0, 1, K < xs_store_slots(e->xs) / 2 ? K : xs_store_slots(e->xs) / 2};
    for (int round = 0; round < 3; round++) {
        for (int k = 0; k < K; k++) prec[k] = round == 2 || (round == 1 && k == 0) ? 0.9 : 0.5;
        xs_store_stats(e->xs, &a);
        moe_prefetch_next(s, l, x, 1);
        xs_store_stats(e->xs, &b);
        int np = 0;
        for (int i = 0; i < e->cfg.n_routed_experts; i++) np += xs_la_guesses(e->xs, ml)[i] != 0;
        CHECK_EQ_INT(np, K); /* every rank is predicted (and later scored), read or not */
        /* reads started: round 1 reads the best guess, round 2 the rest of the guesses */
        CHECK_EQ_INT((int)(b.prefetch_issued - a.prefetch_issued), round == 2 ? expect[2] - 1 : expect[round]);
    }
    xs_store_drain(e->xs);
    free(x);
    petrel_session_free(s);
    petrel_engine_close(e);
}

/* Layer-major streaming prefill (spans of fwd_rows): spans of pf_rows rows run every layer's
 * attention chunk by chunk and its MoE once over the span. Logits equal the resident chunk-by-
 * chunk run bitwise, in one call, in two calls and in decode after it, while each expert is read
 * fewer times than chunk by chunk. Chunks of 8 rows and spans of 24 make a 61-token prompt
 * cross spans, chunks and a short tail. */
static petrel_engine *open_chunked(const char *pk, int slots, int chunk, int pf_rows) {
    petrel_error err = {0};
    petrel_engine *e = NULL;
    petrel_open_opts o = {0};
    o.expert_slots = slots;
    if (petrel_engine_open(pk, &o, &e, &err)) {
        test_fail(__FILE__, __LINE__, "open %s: %s", pk, err.msg);
        return NULL;
    }
    e->chunk = chunk;
    e->pf_rows = pf_rows;
    return e;
}

static void run_split(petrel_engine *e, const int32_t *ids, int n, int split, int decode, float *lg, uint64_t *reads) {
    petrel_error err = {0};
    petrel_session *s = NULL;
    int V = e->cfg.vocab_size;
    xs_stats a = {0}, b = {0};
    if (e->xs) xs_store_stats(e->xs, &a);
    CHECK(petrel_session_create(e, n + decode, &s, &err) == 0);
    if (!s) return;
    CHECK_MSG(petrel_session_forward(s, ids, split, lg, 1, &err) == 0, "%s", err.msg);
    if (split < n) CHECK_MSG(petrel_session_forward(s, ids + split, n - split, lg + (size_t)split * V, 1, &err) == 0, "%s", err.msg);
    for (int t = 0; t < decode; t++) CHECK(petrel_session_forward(s, ids + t, 1, lg + (size_t)(n + t) * V, 0, &err) == 0);
    CHECK_EQ_INT(petrel_session_len(s), n + decode);
    petrel_session_free(s);
    if (e->xs) xs_store_stats(e->xs, &b);
    *reads = b.reads - a.reads;
}

static void check_layer_major(const char *fixture, int quant) {
    const char *pk = make_pack(fixture, quant);
    petrel_engine *res = open_chunked(pk, 0, 8, 0), *lm = open_chunked(pk, 4, 8, 24), *cm = open_chunked(pk, 4, 8, 0);
    petrel_engine *rlm = open_chunked(pk, 0, 8, 24); /* layer-major over resident experts (no store) */
    if (!res || !lm || !cm || !rlm) {
        petrel_engine_close(res);
        petrel_engine_close(lm);
        petrel_engine_close(cm);
        petrel_engine_close(rlm);
        return;
    }
    int n = 61, dec = 3, V = res->cfg.vocab_size;
    int32_t ids[61];
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((i * 7919 + 13) % V);
    size_t bytes = sizeof(float) * (size_t)(n + dec) * V;
    float *a = malloc(bytes), *b = malloc(bytes), *c2 = malloc(bytes), *d2 = malloc(bytes);
    uint64_t r_res, r_lm, r_cm, r_rlm;
    for (int split = n; split >= 20; split -= 41) { /* one call; then 20 + 41 (the second starts mid-span) */
        run_split(res, ids, n, split, dec, a, &r_res);
        run_split(lm, ids, n, split, dec, b, &r_lm);
        run_split(cm, ids, n, split, dec, c2, &r_cm);
        run_split(rlm, ids, n, split, dec, d2, &r_rlm);
        CHECK_MSG(!memcmp(a, d2, bytes), "%s split %d: resident layer-major logits differ from resident", fixture, split);
        CHECK_MSG(!memcmp(a, b, bytes), "%s split %d: layer-major prefill logits differ from resident", fixture, split);
        CHECK_MSG(!memcmp(a, c2, bytes), "%s split %d: chunked streamed logits differ from resident", fixture, split);
        CHECK_MSG(r_lm < r_cm, "%s split %d: layer-major read %llu experts, chunk by chunk %llu", fixture, split,
                  (unsigned long long)r_lm, (unsigned long long)r_cm);
    }
    petrel_session *s = NULL;
    petrel_error err = {0};
    CHECK(petrel_session_create(lm, 64, &s, &err) == 0);
    if (s) CHECK_EQ_INT(s->pf.rows, 24);
    petrel_session_free(s);
    free(a);
    free(b);
    free(c2);
    free(d2);
    petrel_engine_close(res);
    petrel_engine_close(lm);
    petrel_engine_close(cm);
    petrel_engine_close(rlm);
}

TEST(stream, layer_major_prefill_tiny_q8) { check_layer_major("tiny", CVQ_Q8); }
TEST(stream, layer_major_prefill_odd_q4) { check_layer_major("odd", CVQ_Q4); }

/* The progress hook: within one forward call done rises to total (rows x layers), after every
 * chunk (chunk by chunk) or every layer of a span (layer-major); a one-row call reports nothing. */
typedef struct { long long last, total; int calls, bad; } pg_rec;
static void pg_hook(void *u, long long done, long long total) {
    pg_rec *r = u;
    if (done < r->last || done > total || (r->total && total != r->total)) r->bad++;
    r->last = done;
    r->total = total;
    r->calls++;
}

TEST(stream, progress_hook) {
    const char *pk = make_pack("tiny", CVQ_Q8);
    for (int lm = 0; lm < 2; lm++) {
        petrel_engine *e = open_chunked(pk, 4, 8, lm ? 24 : 0);
        if (!e) return;
        petrel_error err = {0};
        petrel_session *s = NULL;
        CHECK(petrel_session_create(e, 64, &s, &err) == 0);
        if (s) {
            pg_rec r = {0};
            petrel_session_set_progress(s, pg_hook, &r);
            int32_t ids[40];
            for (int i = 0; i < 40; i++) ids[i] = (int32_t)((i * 31 + 7) % e->cfg.vocab_size);
            CHECK(petrel_session_forward(s, ids, 40, NULL, 0, &err) == 0);
            int L = e->cfg.num_hidden_layers;
            CHECK_EQ_INT(r.bad, 0);
            CHECK(r.total == 40LL * L && r.last == r.total);
            /* chunk by chunk: 5 chunks of 8; layer-major: spans of 24 and 16 rows, each per layer and once done */
            CHECK_EQ_INT(r.calls, lm ? 2 * (L + 1) : 5);
            r = (pg_rec){0};
            CHECK(petrel_session_forward(s, ids, 1, NULL, 0, &err) == 0);
            CHECK_EQ_INT(r.calls, 0);
            petrel_session_free(s);
        }
        petrel_engine_close(e);
    }
}
