/* test_plan.c: `petrel plan` and its library (src/model/plan.h). The plan computed without the
 * store (stream_plan on an inspect-only engine) must be the plan an open with that budget makes
 * (text and slots); plan_min_budget is the boundary (it plans, 1 MiB less does not); the usage
 * history estimate, the machine cache and the prediction follow their definitions; the CLI
 * refuses a budget below the minimum naming it, and bad flags, with one line. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "experts/xs.h"
#include "io/convert.h"
#include "io/pack.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/plan.h"
#include "test.h"

static petrel_engine *open_inspect(const char *path) {
    petrel_open_opts o = {0};
    o.inspect_only = 1;
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(path, &o, &e, &err)) test_fail(__FILE__, __LINE__, "open %s: %s", path, err.msg);
    return e;
}

/* a budget that leaves a few slots per layer: the minimum plus 3 slots in every layer */
static uint64_t some_budget(petrel_engine *e, int ctx) {
    uint64_t min = 0;
    petrel_error err = {0};
    CHECK(plan_min_budget(e, ctx, &min, &err) == 0);
    pt_mem_plan p;
    CHECK(stream_plan(e, min, 0, ctx, &p, &err) == 0);
    return min + 3 * p.xs.slot_bytes * (uint64_t)p.n_store_layers;
}

TEST(plan, matches_open) {
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    petrel_engine *ins = open_inspect(pk);
    if (!ins) return;
    CHECK(ins->xs == NULL);          /* inspect-only, no budget: no store, no slots */
    CHECK(ins->pack->copy == NULL);  /* and nothing copied */
    int ctx = 512;
    uint64_t b = some_budget(ins, ctx);
    pt_mem_plan p;
    petrel_error err = {0};
    CHECK_MSG(stream_plan(ins, b, 0, ctx, &p, &err) == 0, "%s", err.msg);
    CHECK(p.streaming);
    CHECK(ins->xs == NULL); /* planning created nothing */
    CHECK(p.xs.slots_per_layer > 1 && p.xs.slots_per_layer < ins->cfg.n_routed_experts);
    CHECK(p.total_bytes <= b);
    petrel_open_opts o = {0};
    o.mem_budget = b;
    o.plan_context = ctx;
    petrel_engine *e = NULL;
    CHECK_MSG(petrel_engine_open(pk, &o, &e, &err) == 0, "%s", err.msg);
    if (e) {
        CHECK(e->xs != NULL);
        CHECK_EQ_INT(xs_store_slots(e->xs), p.xs.slots_per_layer);
        CHECK_MSG(!strcmp(petrel_engine_plan(e), p.text), "open's plan:\n%s\nplan's:\n%s", petrel_engine_plan(e), p.text);
        CHECK_EQ_INT(e->chunk, p.chunk);
        CHECK_EQ_INT(e->pf_rows, p.pf_rows);
        petrel_engine_close(e);
    }
    /* resident: the same text as the resident open */
    CHECK(stream_plan(ins, 0, 0, ctx, &p, &err) == 0);
    CHECK(!p.streaming);
    petrel_open_opts r = {0};
    r.plan_context = ctx;
    CHECK(petrel_engine_open(pk, &r, &e, &err) == 0);
    if (e) {
        CHECK(!strcmp(petrel_engine_plan(e), p.text));
        petrel_engine_close(e);
    }
    petrel_engine_close(ins);
}

TEST(plan, min_budget_is_the_boundary) {
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    petrel_engine *e = open_inspect(pk);
    if (!e) return;
    uint64_t min = 0;
    petrel_error err = {0};
    pt_mem_plan p;
    CHECK(plan_min_budget(e, 1024, &min, &err) == 0);
    CHECK(min > 0 && min % (1u << 20) == 0);
    CHECK_MSG(stream_plan(e, min, 0, 1024, &p, &err) == 0, "%s", err.msg);
    CHECK(p.xs.slots_per_layer >= 1);
    CHECK_EQ_INT(stream_plan(e, min - (1u << 20), 0, 1024, &p, &err), PETREL_ENOMEM);
    CHECK(strstr(err.msg, "cannot be met") != NULL);
    /* the open refuses the same budget */
    petrel_open_opts o = {0};
    o.mem_budget = min - (1u << 20);
    petrel_engine *x = NULL;
    CHECK_EQ_INT(petrel_engine_open(pk, &o, &x, &err), PETREL_ENOMEM);
    petrel_engine_close(x);
    petrel_engine_close(e);
}

TEST(plan, hf_folder_plans_without_pack) {
    petrel_engine *e = open_inspect(test_data("trained"));
    if (!e) return;
    pt_mem_plan p;
    petrel_error err = {0};
    CHECK_MSG(stream_plan(e, 1ull << 30, 0, 0, &p, &err) == 0, "%s", err.msg);
    CHECK(p.streaming && p.needs_pack);
    CHECK_EQ_INT(p.ctx, e->cfg.max_position_embeddings < 4096 ? e->cfg.max_position_embeddings : 4096);
    CHECK(p.record_bytes > 0);
    uint64_t sum = 0;
    for (int k = 0; k < WK_COUNT; k++) sum += p.kind_bytes[k];
    CHECK(sum == e->w.kind_bytes[WK_EXPERTS] + p.resident_bytes); /* nothing on disk for a folder */
    petrel_engine_close(e);
}

TEST(plan, usage_hit_rate) {
    const char *f = test_tmp("u.petrel-usage");
    FILE *o = fopen(f, "w");
    fprintf(o, "# petrel-usage v1 layers=2 experts=4\n0 10 0 30 60\n1 25 25 25 25\n");
    fclose(o);
    double r;
    uint64_t acc;
    int found;
    petrel_error err = {0};
    CHECK(plan_usage_hit_rate(f, 2, 4, 1, &r, &acc, &found, &err) == 0);
    CHECK(found && acc == 200);
    CHECK_NEAR(r, (60 + 25) / 200.0, 1e-12);
    CHECK(plan_usage_hit_rate(f, 2, 4, 2, &r, &acc, &found, &err) == 0);
    CHECK_NEAR(r, (90 + 50) / 200.0, 1e-12);
    CHECK_EQ_INT(plan_usage_hit_rate(f, 3, 4, 1, &r, &acc, &found, &err), PETREL_EFORMAT); /* another model's shape */
    CHECK(plan_usage_hit_rate(test_tmp("none.petrel-usage"), 2, 4, 1, &r, &acc, &found, &err) == 0 && !found);
    o = fopen(f, "w");
    fprintf(o, "# petrel-usage v1 layers=2 experts=4\n0 10 0 30\n");
    fclose(o);
    CHECK_EQ_INT(plan_usage_hit_rate(f, 2, 4, 1, &r, &acc, &found, &err), PETREL_EFORMAT);
}

TEST(plan, machine_cache_round_trip) {
    const char *f = test_tmp("machine.json");
    pt_machine m = {0}, a = {0}, got;
    snprintf(m.cpu, sizeof m.cpu, "CPU A");
    m.threads = 2, m.mem_gbs = 40.5, m.ssd_gbs = 2.5, m.int8_gops = 800, m.f32_gflops = 150, m.when = 1234;
    a = m;
    snprintf(a.cpu, sizeof a.cpu, "CPU B");
    a.mem_gbs = 30;
    petrel_error err = {0};
    int found;
    CHECK(plan_machine_load(f, "CPU A", &got, &found, &err) == 0 && !found); /* no file yet */
    CHECK(plan_machine_save(f, &m, &err) == 0);
    CHECK(plan_machine_save(f, &a, &err) == 0); /* merged, keyed by CPU */
    CHECK(plan_machine_load(f, "CPU A", &got, &found, &err) == 0 && found);
    CHECK_NEAR(got.mem_gbs, 40.5, 1e-9);
    CHECK_NEAR(got.ssd_gbs, 2.5, 1e-9);
    CHECK_EQ_INT(got.threads, 2);
    CHECK(plan_machine_load(f, "CPU B", &got, &found, &err) == 0 && found);
    CHECK_NEAR(got.mem_gbs, 30, 1e-9);
    CHECK(plan_machine_load(f, "CPU C", &got, &found, &err) == 0 && !found);
    FILE *o = fopen(f, "w");
    fputs("not json", o);
    fclose(o);
    CHECK_EQ_INT(plan_machine_load(f, "CPU A", &got, &found, &err), PETREL_EFORMAT);
    /* rates that are not positive count as not measured: no memory figure, no entry */
    o = fopen(f, "w");
    fputs("{\"CPU A\": {\"threads\": -4, \"mem_gbs\": 40, \"ssd_gbs\": -3, \"int8_gops\": 0, \"f32_gflops\": 1e300},"
          " \"CPU B\": {\"mem_gbs\": -1, \"ssd_gbs\": 2}}", o);
    fclose(o);
    CHECK(plan_machine_load(f, "CPU A", &got, &found, &err) == 0 && found);
    CHECK_NEAR(got.mem_gbs, 40, 1e-9);
    CHECK(got.ssd_gbs == 0 && got.int8_gops == 0 && got.f32_gflops == 0 && got.threads == 0);
    CHECK(plan_machine_load(f, "CPU B", &got, &found, &err) == 0 && !found);
}

TEST(plan, predict_follows_the_model) {
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    petrel_engine *e = open_inspect(pk);
    if (!e) return;
    pt_machine m = {0};
    m.mem_gbs = 10, m.ssd_gbs = 1, m.int8_gops = 100, m.f32_gflops = 50;
    pt_mem_plan res, str;
    petrel_error err = {0};
    CHECK(stream_plan(e, 0, 0, 512, &res, &err) == 0);
    CHECK(stream_plan(e, some_budget(e, 512), 0, 512, &str, &err) == 0);
    pt_predict a, h1, h0;
    plan_predict(e, &res, &m, 0, 64, 64, &a);
    double bytes = a.head_bytes + a.pre_bytes + a.layer_bytes + a.expert_bytes_tok + a.kv_read_bytes;
    for (int l = 0; l < e->cfg.num_hidden_layers; l++) /* dense layers after the first MoE layer are not in pre/layer bytes */
        CHECK(l < e->cfg.first_k_dense_replace || e->cfg.layer_is_moe[l]);
    CHECK_NEAR(a.decode_ms, bytes / 10e9 * PLAN_RESIDENT_RATIO * 1e3 + a.decode_attn_ms, 1e-9);
    /* at context 64 past the trained fixture's index_topk of 32: every layer attends 32 keys, the
     * indexer's full layers read and score all 64 */
    const petrel_config *c = &e->cfg;
    int sel = c->index_topk < 64 ? c->index_topk : 64, nfull = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) nfull += c->layer_indexer_full[l];
    CHECK(sel < 64 && nfull > 0);
    double flop = 2.0 * c->num_hidden_layers * sel * c->num_attention_heads * (2.0 * c->kv_lora_rank + c->qk_rope_head_dim) +
                  2.0 * nfull * 64 * c->index_n_heads * c->index_head_dim;
    CHECK_NEAR(a.decode_attn_ms, flop / 50e9 * 1e3, 1e-12);
    CHECK_NEAR(a.kv_read_bytes, 4.0 * c->num_hidden_layers * sel * (c->kv_lora_rank + c->qk_rope_head_dim) + 4.0 * nfull * 64 * c->index_head_dim, 1e-6);
    CHECK(a.misses_tok == 0 && a.prefill_tok_s > 0);
    /* opening: the resident bytes at the SSD's rate on a pack, nothing claimed for a folder */
    CHECK(e->pack ? fabs(a.open_s - (double)res.resident_bytes / 1e9) < 1e-9 && a.open_s > 0 : a.open_s == 0);
    plan_predict(e, &str, &m, 1, 64, 64, &h1);
    plan_predict(e, &str, &m, 0, 64, 64, &h0);
    CHECK(h1.misses_tok == 0 && h1.decode_io_ms == 0);
    int K = e->cfg.num_experts_per_tok, nm = str.n_moe_main;
    CHECK_NEAR(h0.misses_tok, (double)K * nm, 1e-9);
    CHECK_NEAR(h0.disk_bytes_tok, (double)K * nm * str.record_bytes, 1e-3);
    CHECK_NEAR(h0.decode_io_ms, h0.disk_bytes_tok / 1e9 * 1e3, 1e-6);
    CHECK(h0.decode_ms > h1.decode_ms && h0.decode_ms >= h0.decode_serial_ms + h0.decode_io_ms);
    m.ssd_gbs = 0; /* unknown disk: no streamed figure */
    plan_predict(e, &str, &m, 0.5, 64, 64, &h0);
    CHECK(h0.decode_tok_s == 0);
    petrel_engine_close(e);
}

static const char *bin(void) {
    const char *b = getenv("PETREL_BIN");
    if (!b) test_skip("PETREL_BIN unset (make test sets it): CLI tests skipped");
    return b;
}

TEST(plan, cli_refuses_below_minimum) {
    const char *b = bin();
    if (!b) return;
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    char cmd[2048], out[8192], er[4096];
    snprintf(cmd, sizeof cmd, "%s plan --model %s --mem-budget 1M --machine-cache %s", b, pk, test_tmp("nomachine.json"));
    CHECK(test_sh(cmd, out, sizeof out, er, sizeof er) != 0);
    CHECK_EQ_INT(test_count_lines(er), 1);
    CHECK_MSG(strstr(er, "the minimum is") != NULL, "%s", er);
    /* the minimum it names works */
    const char *m = strstr(er, "(");
    m = strstr(er, "GiB (");
    long mib = m ? atol(m + 5) : 0;
    CHECK(mib > 1);
    snprintf(cmd, sizeof cmd, "%s plan --model %s --mem-budget %ldM --machine-cache %s", b, pk, mib, test_tmp("nomachine.json"));
    CHECK_MSG(test_sh(cmd, out, sizeof out, er, sizeof er) == 0, "%s", er);
    CHECK(strstr(out, "\nslots       ") != NULL);
    CHECK(strstr(out, "--measure") != NULL); /* no machine figures cached: says how to get them */
}

TEST(plan, cli_json_and_text) {
    const char *b = bin();
    if (!b) return;
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    const char *mc = test_tmp("m2.json");
    FILE *f = fopen(mc, "w");
    fprintf(f, "{}");
    fclose(f);
    pt_machine m = {0};
    plan_cpu_model(m.cpu, sizeof m.cpu);
    m.threads = 2, m.mem_gbs = 20, m.ssd_gbs = 2, m.int8_gops = 300, m.f32_gflops = 60;
    petrel_error err = {0};
    CHECK(plan_machine_save(mc, &m, &err) == 0);
    static char out[65536];
    char cmd[2048], er[4096];
    petrel_engine *e = open_inspect(pk);
    if (!e) return;
    uint64_t min = 0;
    CHECK(plan_min_budget(e, 256, &min, &err) == 0);
    pt_mem_plan p;
    long mib = (long)(min >> 20) + 1; /* a few slots of the 32 */
    CHECK(stream_plan(e, (uint64_t)mib << 20, 0, 256, &p, &err) == 0 && p.xs.slots_per_layer < e->cfg.n_routed_experts);
    petrel_engine_close(e);
    /* the scratch in the minimum grows with the threads: the CLI plans with this process's count */
    snprintf(cmd, sizeof cmd, "%s plan --model %s --threads %d --mem-budget %ldM --ctx 256 --json --machine-cache %s --hit-rate 0.5", b, pk, kn_threads(), mib, mc);
    CHECK_MSG(test_sh(cmd, out, sizeof out, er, sizeof er) == 0, "%s", er);
    CHECK_EQ_INT(test_count_lines(out), 1);
    cJSON *j = cJSON_Parse(out);
    CHECK_MSG(j != NULL, "not JSON: %s", out);
    if (j) {
        CHECK(cJSON_IsTrue(cJSON_GetObjectItem(j, "streaming")));
        CHECK(cJSON_GetObjectItem(j, "ctx")->valueint == 256);
        CHECK_NEAR(cJSON_GetObjectItem(j, "hit_rate")->valuedouble, 0.5, 1e-12);
        CHECK(cJSON_GetObjectItem(j, "decode_tok_s")->valuedouble > 0);
        CHECK(cJSON_IsObject(cJSON_GetObjectItem(j, "machine")));
        const cJSON *os = cJSON_GetObjectItem(j, "open_s"); /* a pack, SSD at 2 GB/s: its resident bytes over that */
        CHECK(cJSON_IsNumber(os) && os->valuedouble > 0 && fabs(os->valuedouble - (double)p.resident_bytes / 2e9) < 1e-6 * os->valuedouble);
        cJSON_Delete(j);
    }
    /* the trained fixture has 32 experts: the shipped 256-expert trace cannot estimate it, and
     * plan says so instead of inventing a figure */
    snprintf(cmd, sizeof cmd, "%s plan --model %s --threads %d --mem-budget %ldM --ctx 256 --machine-cache %s", b, pk, kn_threads(), mib, mc);
    CHECK_MSG(test_sh(cmd, out, sizeof out, er, sizeof er) == 0, "%s", er);
    CHECK_MSG(strstr(out, "hit rate    unknown") != NULL, "%s", out);
    CHECK(strstr(out, "decode      no prediction") != NULL);
}

TEST(plan, cli_bad_flags) {
    const char *b = bin();
    if (!b) return;
    const char *bad[] = {"--model %s --ctx 0", "--model %s --hit-rate 2", "--model %s --frob", "--ctx 5", "--model %s --mem-budget 1.5G",
                         "--model %s --trace-out /tmp/x", "--model %s --ctx", "--model /nonexistent/model"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char args[512], cmd[1024], out[4096], er[4096];
        snprintf(args, sizeof args, bad[i], test_data("trained"));
        snprintf(cmd, sizeof cmd, "%s plan %s", b, args);
        int rc = test_sh(cmd, out, sizeof out, er, sizeof er);
        CHECK_MSG(rc != 0 && test_count_lines(er) == 1, "%s: rc %d, stderr %s", args, rc, er);
    }
    char cmd[1024], out[8192], er[4096];
    snprintf(cmd, sizeof cmd, "%s plan --help", b);
    CHECK(test_sh(cmd, out, sizeof out, er, sizeof er) == 0 && strstr(out, "--mem-budget") && strstr(out, "--measure"));
}

/* the memory probe reads every byte it counts, in each of its kinds (every other line
 * prefetched, every line, two interleaved streams): its sum equals the words' sum */
TEST(plan, bw_probe_reads_every_word) {
    const size_t sizes[] = {64, 640, 4096 + 64, 100000};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        size_t n = sizes[s];
        uint64_t *b = malloc(sizeof(uint64_t) * (n + 64)), want = 0;
        for (size_t i = 0; i < n + 64; i++) b[i] = (i + 1) * 0x9e3779b97f4a7c15ull;
        for (size_t i = 0; i < n / 64 * 64; i++) want += b[i];
        for (int kind = 0; kind < 3; kind++)
            CHECK_MSG(plan_bw_checksum(b, n, kind) == want, "probe kind %d over %zu words: a word counted but not read", kind, n);
        free(b);
    }
}
