/* cmd_plan.c: `petrel plan`: will this model run here under a budget, with which settings, and
 * how fast? Opens the model inspect-only (weights mapped, nothing copied, no expert store, no
 * slots), computes the memory plan an open with that budget would make (stream_plan), the
 * expected hit rate of its slots (the model's usage history, else a replay of the shipped
 * locality trace), the disk bytes per token, and decode / prefill speed predicted from this
 * machine's measured memory, SSD and kernel speeds (src/model/plan.h); suggests a split of the
 * budget and refuses one that cannot work, naming the minimum. */
#include <libgen.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "base/err.h"
#include "cli.h"
#include "experts/xs.h"
#include "io/pack.h"
#include "kernels/kernels.h"
#include "kv/kv.h"
#include "model/engine.h"
#include "model/plan.h"

static const char *usage =
    "usage: petrel plan --model M [--mem-budget SIZE] [--ctx N] [--measure] [--json]\n"
    "Prints the memory plan for the budget without loading the weights (resident weights by\n"
    "class, KV for the context, scratch, expert slots per layer), the expected hit rate of the\n"
    "slots, the expected disk bytes per token, the predicted decode and prefill speed on this\n"
    "machine and how long opening the model takes (a pack: its resident bytes at the SSD's rate);\n"
    "suggests how to split the budget; refuses a budget that cannot work, naming the\n"
    "minimum.\n"
    "  --model DIR|FILE     petrel pack, Hugging Face folder or colibri folder (experts stream\n"
    "                       only from a pack: for the others the plan uses their own formats)\n"
    "  --mem-budget SIZE    whole-process budget (4G, 1536M; powers of 1024); default: none,\n"
    "                       every weight resident\n"
    "  --expert-slots N     plan N slots per layer instead of as many as fit\n"
    "  --ctx N              tokens of KV the plan reserves (default 4096, as an open does)\n"
    "  --prompt N           prompt length of the prefill prediction and context of the decode\n"
    "                       prediction (default 512)\n"
    "  --route-trace FILE   expected hit rate from replaying this routing trace (.txt or .gz)\n"
    "                       instead of the model's usage history (<model>.petrel-usage) or, when\n"
    "                       it has none, the shipped trace bench/data/glm5-like-2048.txt.gz\n"
    "  --hit-rate P         assume this hit rate (0..1) instead of estimating it (what-if)\n"
    "  --measure            probe this machine (a few seconds: memory read bandwidth, O_DIRECT\n"
    "                       random reads of the model's expert records, int8 and f32 matmul\n"
    "                       throughput) and cache the result; without it the cached figures are\n"
    "                       used, and with none cached the speed prediction is left out\n"
    "  --machine-cache FILE the cache (default $XDG_CACHE_HOME/petrel/machine.json, else\n"
    "                       $HOME/.cache/petrel/machine.json), keyed by CPU model\n"
    "  --threads N          compute threads of the probes and prediction (default: all cores)\n"
    "  --json               one JSON object on stdout instead of the text\n";

static double gib(double b) { return b / 1073741824.0; }

/* The shipped locality trace: bench/data next to the build folder of this executable, else under
 * the current folder. */
static const char *shipped_trace(char *buf, size_t n) {
    static const char rel[] = "bench/data/glm5-like-2048.txt.gz";
    char exe[4096];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k > 0) {
        exe[k] = 0;
        char *d = dirname(exe);
        snprintf(buf, n, "%s/../%s", d, rel);
        if (access(buf, R_OK) == 0) return buf;
        snprintf(buf, n, "%s/%s", d, rel);
        if (access(buf, R_OK) == 0) return buf;
    }
    snprintf(buf, n, "%s", rel);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

static int cache_path(const char *opt, char *buf, size_t n) {
    if (opt) { snprintf(buf, n, "%s", opt); return 0; }
    const char *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    if (x && *x) snprintf(buf, n, "%s/petrel/machine.json", x);
    else if (h && *h) snprintf(buf, n, "%s/.cache/petrel/machine.json", h);
    else return -1;
    return 0;
}
static void mkdir_parents(const char *file) {
    char d[4200];
    snprintf(d, sizeof d, "%s", file);
    for (char *s = d + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            mkdir(d, 0755);
            *s = '/';
        }
}

/* int4 (group-64) bytes of a class's matrices, at the routed experts' bytes per weight. */
static uint64_t int4_bytes(const petrel_engine *e, int kind, double q4_per_elem) {
    double el = 0;
    const petrel_config *c = &e->cfg;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const layer_w *w = &e->w.layers[l];
        const pt_wview *v[8] = {0};
        int nv = 0;
        if (kind == WK_ATTN) { v[0] = &w->q_a_proj; v[1] = &w->q_b_proj; v[2] = &w->kv_a_proj_with_mqa; v[3] = &w->kv_b_proj; v[4] = &w->o_proj; nv = 5; }
        else if (kind == WK_SHARED && w->is_moe && w->has_shared) { v[0] = &w->sh_gate; v[1] = &w->sh_up; v[2] = &w->sh_down; nv = 3; }
        else if (kind == WK_DENSE && !w->is_moe) { v[0] = &w->gate_proj; v[1] = &w->up_proj; v[2] = &w->down_proj; nv = 3; }
        for (int i = 0; i < nv; i++) el += (double)v[i]->rows * (double)v[i]->cols;
    }
    return (uint64_t)(el * q4_per_elem);
}

typedef struct { const char *name; int kind; uint64_t now, q4; } split;

CLI_CMD(plan) {
    cli_model_opts mo = {0};
    long ctx = 4096, prompt = 512;
    int measure = 0, json = 0;
    const char *trace_opt = NULL, *cache_opt = NULL;
    double hit_opt = -1;
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); return 0; }
        if (!strcmp(a, "--measure")) { measure = 1; continue; }
        if (!strcmp(a, "--json")) { json = 1; continue; }
        int takes = !strcmp(a, "--ctx") || !strcmp(a, "--prompt") || !strcmp(a, "--route-trace") || !strcmp(a, "--machine-cache") ||
                    !strcmp(a, "--hit-rate");
        if (!takes) return cli_fail("plan: unknown option \"%s\" (petrel plan --help)", a);
        if (i + 1 >= argc) return cli_fail("plan: %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--ctx")) { if (cli_opt_count("plan", "--ctx", v, 1, 1 << 24, &ctx)) return 1; }
        else if (!strcmp(a, "--prompt")) { if (cli_opt_count("plan", "--prompt", v, 1, 1 << 24, &prompt)) return 1; }
        else if (!strcmp(a, "--route-trace")) trace_opt = v;
        else if (!strcmp(a, "--hit-rate")) {
            char *end;
            hit_opt = strtod(v, &end);
            if (!*v || *end || !(hit_opt >= 0 && hit_opt <= 1)) return cli_fail("plan: --hit-rate: \"%s\" is not a number in 0..1", v);
        }
        else cache_opt = v;
    }
    if (!mo.model) return cli_fail("plan: --model is required (petrel plan --help)");
    if (mo.open.trace_out) return cli_fail("plan: --trace-out: plan runs no tokens, there is no routing to record");
    uint64_t budget = mo.open.mem_budget;
    int slots_req = mo.open.expert_slots;
    mo.open.mem_budget = 0; /* the engine is opened inspect-only and resident: no store, no slots */
    mo.open.expert_slots = 0;
    mo.open.inspect_only = 1;
    mo.open.verbose = 0;
    petrel_error err = {0};
    petrel_engine *eng = NULL;
    if (mo.open.n_lora) mo.open.lora = mo.lora; /* adapters count in the plan */
    if (petrel_engine_open(mo.model, &mo.open, &eng, &err)) return cli_fail_err("plan", &err);
    const petrel_config *c = &eng->cfg;
    int rc = 0;
    pt_mem_plan *p = calloc(1, sizeof *p);
    if (!p) { petrel_engine_close(eng); return cli_fail("plan: out of memory"); }
    if (stream_plan(eng, budget, slots_req, (int)ctx, p, &err)) {
        uint64_t min = 0;
        petrel_error e2 = {0};
        if (err.code == PETREL_ENOMEM && budget && !slots_req && plan_min_budget(eng, (int)ctx, &min, &e2) == 0)
            rc = cli_fail("plan: %s: a budget of %.2f GiB cannot work at a %ld-token context; the minimum is %.2f GiB (%llu MiB) (%s)", mo.model,
                          gib((double)budget), ctx < c->max_position_embeddings ? ctx : (long)c->max_position_embeddings, gib((double)min),
                          (unsigned long long)(min >> 20), err.msg);
        else rc = cli_fail_err("plan", &err);
        free(p);
        petrel_engine_close(eng);
        return rc;
    }
    int slots = p->streaming ? p->xs.slots_per_layer : c->n_routed_experts;
    int E = c->n_routed_experts, K = c->num_experts_per_tok;

    /* expected hit rate */
    double hit = 1;
    char hit_src[12000] = "every expert resident";
    char up[4200], tbuf[4200];
    xs_replay_stats rs = {0};
    int have_hit = 1;
    if (p->streaming && slots < E && hit_opt >= 0) {
        hit = hit_opt;
        snprintf(hit_src, sizeof hit_src, "assumed (--hit-rate)");
    } else if (p->streaming && slots < E) {
        have_hit = 0;
        int found = 0;
        uint64_t acc = 0;
        petrel_error ue = {0};
        xs_usage_path(eng->path, up, sizeof up);
        if (!trace_opt) {
            if (plan_usage_hit_rate(up, p->n_store_layers, E, slots, &hit, &acc, &found, &ue))
                fprintf(stderr, "petrel: plan: ignoring the usage history: %s\n", ue.msg);
            if (found && acc < 16ull * (uint64_t)E * (uint64_t)p->n_store_layers) { /* a short history overstates the top experts' share */
                snprintf(hit_src, sizeof hit_src, " (the usage history %s has only %llu accesses, fewer than 16 per expert: not used)", up,
                         (unsigned long long)acc);
                found = 0;
            }
            if (found && acc > 0) {
                have_hit = 1;
                snprintf(hit_src, sizeof hit_src, "from the usage history %s (%llu accesses): the %d most used experts of each layer", up,
                         (unsigned long long)acc, slots);
            }
        }
        if (!have_hit) {
            const char *tp = trace_opt ? trace_opt : shipped_trace(tbuf, sizeof tbuf);
            xs_trace t;
            if (!tp) snprintf(hit_src, sizeof hit_src, "unknown: no usage history and the shipped trace bench/data/glm5-like-2048.txt.gz was not found");
            else if (xs_trace_read(&t, tp, &ue)) {
                if (trace_opt) { rc = cli_fail("plan: --route-trace: %s", ue.msg); goto done; }
                snprintf(hit_src, sizeof hit_src, "unknown: %s", ue.msg);
            } else {
                if (t.n_experts != E || t.topk != K) {
                    if (trace_opt) {
                        rc = cli_fail("plan: --route-trace %s: %d experts top-%d, but the model has %d experts top-%d", tp, t.n_experts, t.topk, E, K);
                        xs_trace_deinit(&t);
                        goto done;
                    }
                    snprintf(hit_src, sizeof hit_src, "unknown: the shipped trace %s has %d experts top-%d, the model %d top-%d (and no usage history)", tp,
                             t.n_experts, t.topk, E, K);
                } else {
                    xs_policy_params prm;
                    xs_policy_defaults(&prm);
                    if (xs_trace_replay(&t, &prm, slots, &rs, &ue) == 0) {
                        have_hit = 1;
                        hit = rs.policy_rate;
                        char note[sizeof hit_src];
                        snprintf(note, sizeof note, "%s", hit_src[0] == ' ' ? hit_src : "");
                        snprintf(hit_src, sizeof hit_src,
                                 "from replaying the %s %s (%d tokens x %d layers) at %d slots per layer: policy %.1f %%, LRU %.1f %%, Belady %.1f %%%.3000s",
                                 trace_opt ? "routing trace" : "shipped locality trace", tp, t.n_tokens, t.n_layers, slots, 100 * rs.policy_rate,
                                 100 * rs.lru_rate, 100 * rs.belady_rate, note);
                    } else snprintf(hit_src, sizeof hit_src, "unknown: %s", ue.msg);
                }
                xs_trace_deinit(&t);
            }
        }
    }

    /* machine */
    pt_machine m = {0};
    int have_m = 0;
    char cpu[128], cp[4200], msrc[4400] = "";
    plan_cpu_model(cpu, sizeof cpu);
    int threads = mo.open.n_threads > 0 ? mo.open.n_threads : kn_threads();
    int have_cp = cache_path(cache_opt, cp, sizeof cp) == 0;
    if (measure) {
        if (plan_measure(eng, threads, 512, &m, &err)) { rc = cli_fail_err("plan: --measure", &err); goto done; }
        have_m = 1;
        snprintf(msrc, sizeof msrc, "measured now");
        if (have_cp) {
            mkdir_parents(cp);
            if (plan_machine_save(cp, &m, &err)) fprintf(stderr, "petrel: plan: the measurement was not cached: %s\n", err.msg);
            else snprintf(msrc, sizeof msrc, "measured now, cached in %s", cp);
        }
    } else if (have_cp) {
        int found = 0;
        petrel_error ce = {0};
        if (plan_machine_load(cp, cpu, &m, &found, &ce)) fprintf(stderr, "petrel: plan: %s\n", ce.msg);
        else if (found) {
            have_m = 1;
            time_t w = (time_t)m.when;
            char ts[64] = "?";
            struct tm tmv;
            if (localtime_r(&w, &tmv)) strftime(ts, sizeof ts, "%Y-%m-%d %H:%M", &tmv);
            snprintf(msrc, sizeof msrc, "cached in %s, measured %s", cp, ts);
            if (p->streaming && m.ssd_gbs <= 0) snprintf(msrc + strlen(msrc), sizeof msrc - strlen(msrc), "; no SSD figure: run --measure on a pack");
        }
    }
    pt_predict pr = {0};
    if (have_m) plan_predict(eng, p, &m, have_hit ? hit : 0, (int)prompt, (int)prompt, &pr);
    if (!have_hit) pr.decode_ms = pr.decode_tok_s = 0; /* no figure rather than one from an invented hit rate */

    /* KV per scheme */
    kv_shape ks;
    kv_shape_from_config(c, eng->w.has_mtp, &ks);
    size_t kvs[KV_SCHEME_COUNT];
    for (int s = 0; s < KV_SCHEME_COUNT; s++) { /* as engines keep them */
        kv_pool_opts ko = kv_engine_opts((kv_scheme)s, 0);
        kvs[s] = kv_bytes_per_token_opts(&ks, &ko);
    }

    /* budget split: the classes that could be int4 (q4 group-64), and what the saving buys */
    split sp[3] = {{"attention (MLA)", WK_ATTN, 0, 0}, {"shared experts", WK_SHARED, 0, 0}, {"dense MLP", WK_DENSE, 0, 0}};
    double q4pe = 0.5 + 4.0 / 64; /* int4 + an f32 scale per 64 */
    for (int l = 0; l < c->num_hidden_layers && p->record_bytes; l++)
        if (eng->w.layers[l].is_moe) {
            const pt_wview *g = &eng->w.layers[l].exp_gate[0];
            q4pe = (double)p->record_bytes / (3.0 * (double)g->rows * (double)g->cols);
            break;
        }
    uint64_t save = 0;
    for (int i = 0; i < 3; i++) {
        sp[i].now = eng->w.kind_bytes[sp[i].kind];
        sp[i].q4 = int4_bytes(eng, sp[i].kind, q4pe);
        if (sp[i].q4 < sp[i].now) save += sp[i].now - sp[i].q4;
    }
    int more_slots = 0;
    if (p->streaming && budget && !slots_req && slots < E) {
        xs_plan_in in = p->xs.in;
        in.resident_bytes -= save < in.resident_bytes ? save : 0;
        xs_plan x2;
        petrel_error ig = {0};
        if (xs_plan_make(&in, &x2, &ig) == 0) more_slots = x2.slots_per_layer - slots;
    }
    uint64_t min_budget = 0;
    petrel_error ig2 = {0};
    if (E) plan_min_budget(eng, (int)ctx, &min_budget, &ig2);

    if (json) {
        cJSON *j = cJSON_CreateObject(), *o;
        cJSON_AddStringToObject(j, "model", mo.model);
        cJSON_AddNumberToObject(j, "budget_bytes", (double)budget);
        cJSON_AddNumberToObject(j, "ctx", p->ctx);
        cJSON_AddBoolToObject(j, "streaming", p->streaming);
        cJSON_AddBoolToObject(j, "needs_pack", p->needs_pack);
        o = cJSON_AddObjectToObject(j, "weights_bytes");
        for (int k = 0; k < WK_COUNT; k++) cJSON_AddNumberToObject(o, weight_kind_names[k], (double)eng->w.kind_bytes[k]);
        cJSON_AddNumberToObject(j, "resident_bytes", (double)p->resident_bytes);
        cJSON_AddNumberToObject(j, "embed_on_disk_bytes", (double)p->embed_on_disk);
        cJSON_AddNumberToObject(j, "kv_bytes_per_token", (double)p->kv_token);
        o = cJSON_AddObjectToObject(j, "kv_bytes_per_token_by_scheme");
        for (int s = 0; s < KV_SCHEME_COUNT; s++) cJSON_AddNumberToObject(o, kv_scheme_name((kv_scheme)s), (double)kvs[s]);
        cJSON_AddNumberToObject(j, "kv_bytes", (double)p->kv_bytes);
        cJSON_AddNumberToObject(j, "scratch_bytes", (double)p->scratch_bytes);
        cJSON_AddNumberToObject(j, "chunk", p->chunk);
        cJSON_AddNumberToObject(j, "prefill_span", p->pf_rows);
        cJSON_AddNumberToObject(j, "store_layers", p->n_store_layers);
        cJSON_AddNumberToObject(j, "slots_per_layer", slots);
        cJSON_AddNumberToObject(j, "n_experts", E);
        cJSON_AddNumberToObject(j, "slot_bytes", (double)p->xs.slot_bytes);
        cJSON_AddNumberToObject(j, "expert_slot_bytes", (double)p->xs.expert_bytes);
        cJSON_AddNumberToObject(j, "total_bytes", (double)p->total_bytes);
        cJSON_AddNumberToObject(j, "min_budget_bytes", (double)min_budget);
        if (have_hit) cJSON_AddNumberToObject(j, "hit_rate", hit);
        else cJSON_AddNullToObject(j, "hit_rate");
        cJSON_AddStringToObject(j, "hit_rate_source", hit_src);
        if (have_hit && p->streaming) {
            cJSON_AddNumberToObject(j, "misses_per_token", pr.misses_tok);
            cJSON_AddNumberToObject(j, "disk_bytes_per_token", have_m ? pr.disk_bytes_tok : (1 - hit) * K * p->n_moe_main * (double)p->record_bytes);
        }
        if (have_m) {
            o = cJSON_AddObjectToObject(j, "machine");
            cJSON_AddStringToObject(o, "cpu", m.cpu);
            cJSON_AddNumberToObject(o, "threads", m.threads);
            cJSON_AddNumberToObject(o, "mem_gbs", m.mem_gbs);
            cJSON_AddNumberToObject(o, "ssd_gbs", m.ssd_gbs);
            cJSON_AddNumberToObject(o, "int8_gops", m.int8_gops);
            cJSON_AddNumberToObject(o, "f32_gflops", m.f32_gflops);
            cJSON_AddStringToObject(o, "source", msrc);
            if (pr.decode_tok_s > 0) {
                cJSON_AddNumberToObject(j, "decode_ms", pr.decode_ms);
                cJSON_AddNumberToObject(j, "decode_tok_s", pr.decode_tok_s);
            } else {
                cJSON_AddNullToObject(j, "decode_ms");
                cJSON_AddNullToObject(j, "decode_tok_s");
            }
            cJSON_AddNumberToObject(j, "decode_serial_ms", pr.decode_serial_ms);
            cJSON_AddNumberToObject(j, "decode_attn_ms", pr.decode_attn_ms);
            cJSON_AddNumberToObject(j, "decode_disk_ms", pr.decode_io_ms);
            cJSON_AddNumberToObject(j, "prefill_tok_s", pr.prefill_tok_s);
            if (pr.open_s > 0) cJSON_AddNumberToObject(j, "open_s", pr.open_s);
            else cJSON_AddNullToObject(j, "open_s");
            cJSON_AddNumberToObject(j, "prompt", prompt);
        } else cJSON_AddNullToObject(j, "machine");
        cJSON_AddNumberToObject(j, "int4_rest_saving_bytes", (double)save);
        cJSON_AddNumberToObject(j, "int4_rest_more_slots", more_slots);
        char *txt = cJSON_PrintUnformatted(j);
        if (txt) printf("%s\n", txt);
        free(txt);
        cJSON_Delete(j);
        goto done;
    }

    int nd = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) nd += !c->layer_is_moe[l];
    printf("model       %s: %d layers (%d dense + %d MoE), %d routed experts top-%d%s\n", mo.model, c->num_hidden_layers, nd,
           c->num_hidden_layers - nd, E, K, eng->pack ? "" : " (not a pack)");
    if (budget) printf("budget      %.2f GiB, context %d tokens\n", gib((double)budget), p->ctx);
    else printf("budget      none (every weight resident), context %d tokens\n", p->ctx);
    if (p->needs_pack)
        printf("note        experts stream only from a petrel pack: petrel convert --in %s --out model.pack first; the figures below are for "
               "this checkpoint's own formats\n", mo.model);
    printf("\nmemory plan (what an open with these options allocates):\n%s\n", p->text);
    printf("\nweights by class%s:\n", p->streaming ? " (routed experts: in the slots above)" : "");
    for (int k = 0; k < WK_COUNT; k++) {
        if (!eng->w.kind_count[k]) continue;
        const char *where = k == WK_EXPERTS && p->streaming ? "  streamed from the pack"
                            : k == WK_EMBED && p->embed_on_disk ? "  stays in the pack (a token reads its row)" : "";
        printf("  %-16s %10.2f GiB%s\n", weight_kind_names[k], gib((double)eng->w.kind_bytes[k]), where);
    }
    printf("\nKV cache    %.2f KiB per token as this open keeps it (%s, --kv-type); f32 %.2f, bf16 %.2f, int8 %.2f KiB per token;\n"
           "            %d tokens: %.3f GiB f32, %.3f GiB bf16, %.3f GiB int8\n",
           p->kv_token / 1024.0, kv_scheme_name((kv_scheme)eng->kv_scheme), kvs[KV_F32] / 1024.0, kvs[KV_BF16] / 1024.0, kvs[KV_INT8] / 1024.0, p->ctx,
           gib((double)kvs[KV_F32] * p->ctx), gib((double)kvs[KV_BF16] * p->ctx), gib((double)kvs[KV_INT8] * p->ctx));
    if (p->budget && p->kv_token) { /* what the KV could grow to if the slots shrank to one per layer */
        uint64_t fixed = p->total_bytes - p->kv_bytes - (p->streaming ? p->xs.expert_bytes : 0);
        uint64_t one = p->streaming ? (uint64_t)p->n_store_layers * p->xs.slot_bytes : 0;
        uint64_t room = p->budget > fixed + one ? p->budget - fixed - one : 0;
        long long fit = (long long)(room / p->kv_token);
        if (fit > eng->cfg.max_position_embeddings) fit = eng->cfg.max_position_embeddings;
        printf("            longest context this budget allows: %lld tokens in %s (with one expert slot per layer; scratch as planned)\n", fit,
               kv_scheme_name((kv_scheme)eng->kv_scheme));
    }
    printf("scratch     %.2f GiB (chunks of %d rows%s)\n", gib((double)p->scratch_bytes), p->chunk,
           p->pf_rows ? ", layer-major prefill spans" : "");
    if (p->streaming)
        printf("slots       %d of %d per layer x %d layers, %.2f MiB each\n", slots, E, p->n_store_layers, p->xs.slot_bytes / 1048576.0);
    printf("\nhit rate    ");
    if (!p->streaming || slots >= E) printf("100 %% (%s)\n", hit_src);
    else if (have_hit) printf("%.1f %% expected, %s\n", 100 * hit, hit_src);
    else printf("%s\n", hit_src);
    if (p->streaming && have_hit && slots < E) {
        double miss = (1 - hit) * K * p->n_moe_main;
        printf("disk        %.1f expert reads = %.1f MB per token\n", miss, miss * (double)p->record_bytes / 1e6);
    }
    printf("\nmachine     ");
    if (!have_m) printf("no measurement of this machine (%s): run petrel plan --measure for the speed figures\n", cpu);
    else {
        char ssd[48], i8[48], f32[48]; /* a figure the cache lacks (0) says so */
        if (m.ssd_gbs > 0) snprintf(ssd, sizeof ssd, "%.2f GB/s", m.ssd_gbs); else snprintf(ssd, sizeof ssd, "not measured");
        if (m.int8_gops > 0) snprintf(i8, sizeof i8, "%.0f GOP/s", m.int8_gops); else snprintf(i8, sizeof i8, "not measured");
        if (m.f32_gflops > 0) snprintf(f32, sizeof f32, "%.0f GFLOP/s", m.f32_gflops); else snprintf(f32, sizeof f32, "not measured");
        printf("%s, %d threads (%s): memory %.1f GB/s, SSD %s (O_DIRECT random expert reads), int8 matmul %s, f32-activation matmul %s\n",
               m.cpu, m.threads, msrc, m.mem_gbs, ssd, i8, f32);
        if (pr.decode_tok_s > 0) {
            printf("decode      %.2f tok/s predicted (%.1f ms/token at a %ld-token context", pr.decode_tok_s, pr.decode_ms, prompt);
            if (p->streaming)
                printf(": %.1f ms serial with the reads (head, layers before the first routing), %.1f ms of disk reads", pr.decode_serial_ms, pr.decode_io_ms);
            else printf(": %.2f GB / %.1f GB/s x %.2f", (pr.head_bytes + pr.pre_bytes + pr.layer_bytes + pr.expert_bytes_tok + pr.kv_read_bytes) / 1e9,
                        m.mem_gbs, PLAN_RESIDENT_RATIO);
            if (pr.decode_attn_ms >= 0.05) printf(" + %.1f ms attention and indexer arithmetic at %.0f GFLOP/s", pr.decode_attn_ms, m.f32_gflops);
            printf(")\n");
        } else printf("decode      no prediction: %s\n", !have_hit ? "the hit rate is unknown" : "no SSD figure (run --measure on a pack)");
        if (pr.prefill_tok_s > 0)
            printf("prefill     %.1f tok/s predicted (a %ld-token prompt: compute %.2f s%s)\n", pr.prefill_tok_s, prompt, pr.prefill_compute_s,
                   p->streaming ? ", expert reads overlapped with the MoE phase" : "");
        if (pr.open_s > 0)
            printf("open        ~%.1f s predicted (%.2f GB of resident weights read at the SSD's %.2f GB/s; zeroing the pages they go to adds "
                   "a little)\n", pr.open_s, (double)p->resident_bytes / 1e9, m.ssd_gbs);
    }
    printf("\nsuggestions\n");
    if (min_budget) printf("  minimum budget at a %d-token context: %.2f GiB (one expert slot per layer)\n", p->ctx, gib((double)min_budget));
    for (int i = 0; i < 3; i++)
        if (sp[i].q4 < sp[i].now)
            printf("  %s at int4 (q4 group-64): %.2f -> %.2f GiB\n", sp[i].name, gib((double)sp[i].now), gib((double)sp[i].q4));
    if (more_slots > 0)
        printf("  converting them so (petrel convert --attention q4 --dense q4) frees %.2f GiB = %d more slots per layer (%d -> %d)\n", gib((double)save),
               more_slots, slots, slots + more_slots);
    if (p->streaming && p->ctx > 1024 && budget) {
        pt_mem_plan *q = malloc(sizeof *q);
        petrel_error ig = {0};
        if (q && stream_plan(eng, budget, 0, 1024, q, &ig) == 0 && q->xs.slots_per_layer > slots)
            printf("  --ctx 1024 instead of %d: %d slots per layer instead of %d\n", p->ctx, q->xs.slots_per_layer, slots);
        free(q);
    }
done:
    free(p);
    petrel_engine_close(eng);
    return rc;
}
