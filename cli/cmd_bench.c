/* cmd_bench.c: `petrel bench` measures decode and prefill speed of a model and compares decode
 * with its floor: the weight bytes one decode token reads divided by the machine's memory read
 * bandwidth, measured in the same run, right before every timed step (on a GPU, whose HBM does
 * not drift, before the first and after the last; decode_floor_ratio = the
 * median over steps of step time / floor at that step's bandwidth; 1.0 = bound by memory). Bytes per token are counted from the views a decode step uses: every resident
 * non-expert matrix of every layer, num_experts_per_tok routed experts per MoE layer, the shared
 * expert, lm_head, one embedding row and the norm vectors; the MTP layer is not run and not
 * counted. Resident weights are touched once before timing so that page faults are not measured.
 * With --json the last stdout line is one JSON object. */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/stat.h>

#include "cuda/cu.h"
#include "base/err.h"
#include "base/mem.h"
#include "base/pool.h"
#include "cli.h"
#include "experts/xs.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "kernels/kernels.h"
#include "kv/kv.h"
#include "model/engine.h"
#include "model/plan.h"

/* The CPU's AMX (amx_int8 in /proc/cpuinfo's flags): a fact of the machine every figure names. */
static int cpu_has_amx(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192];
    int amx = 0;
    while (f && !amx && fgets(line, sizeof line, f))
        if (!strncmp(line, "flags", 5)) amx = strstr(line, " amx_int8") != NULL;
    if (f) fclose(f);
    return amx;
}

static const char *usage =
    "usage: petrel bench --model PACK|DIR [--json] [--ctx N] [--prompt N] [--steps N] [--threads N]\n"
    "Prefills a random prompt, then times decode steps; prints ms/token, prefill tok/s, a breakdown\n"
    "per part, bytes of weights read per token, measured memory bandwidth and the floor ratio.\n"
    "  --prompt N       prompt length for prefill (default 512)\n"
    "  --ctx N          context at which decode is timed (default = prompt; at least the prompt)\n"
    "  --steps N        timed decode steps (default 24)\n"
    "  --prefill-runs N prefill the prompt N times (default 3) and report the median run (with\n"
    "                   experts streaming: once, since a second run would find them cached)\n"
    "  --batch B        also time B sessions decoding together at --ctx (petrel_batch_forward: one\n"
    "                   row per session per step): aggregate tok/s, ms per row, experts run per step\n"
    "                   (the union of the rows' choices), bytes per step, floor ratio of the step;\n"
    "                   resident and without --profile also the speedup over one session pair by\n"
    "                   pair (one more session's step timed right after each batched step)\n"
    "  --bw-mib N       size of the bandwidth probe buffer in MiB (default 1024; 128 with --mem-budget)\n"
    "  --json           print the result as one JSON object on the last line\n"
    "  --profile        on the CPU: the timed decode steps by product (each kind of matrix product's\n"
    "                   ms, MB and GB/s per step against the memory probe of the same steps, and the\n"
    "                   attention core), the rest of each part, and the thread pool's dispatches and\n"
    "                   end-of-job waits; the last prefill run the same way (its products' ms);\n"
    "                   with --batch, the batched steps too;\n"
    "                   with --device cuda: the GPU kernels' time by part over the prefill runs and\n"
    "                   the timed decode steps (events between the parts: a little slower), and\n"
    "                   the prefill's routed experts in TOP/s against the measured int8\n"
    "                   tensor-core peak\n"
    "  --cuda-pdl on|off with --device cuda: launch each kernel of a forward as a programmatic\n"
    "                   dependent of the one before it (on, the default: it may start while its\n"
    "                   predecessor ends) or after its end (off); the same results either way\n"
    "  --cuda-fork on|off with --device cuda: run a decode step's shared experts and DSA top-k on a\n"
    "                   second stream beside the routed experts and the MLA queries (on, the\n"
    "                   default) or every kernel on one stream (off); the same results either way\n"
    "  --cuda-experts int8|bf16|wgmma|tma with --device cuda: a prompt's routed experts (q4)\n"
    "                   on the int8 tensor-core GEMM (int8: the CPU's int8 bits per product) or a\n"
    "                   bf16 one (the scales in the dequantized weights, f32 sums): mma.sync (bf16),\n"
    "                   Hopper's warpgroup MMA (wgmma), or the same with its loads on the TMA\n"
    "                   unit (tma, the default; the same bits as wgmma)\n"
    "  --cuda-dense int8|wgmma|tma with --device cuda: a prompt's other q8 products on\n"
    "                   the int8 tensor-core GEMM or on warpgroup MMA in bf16: wgmma unpacks the\n"
    "                   weights in every block; tma (the default) unpacks them once a product for\n"
    "                   chunks of 512 rows or more and loads both operands by TMA (the same bits)\n"
    "  --cuda-prompt-attn absorbed|expanded|expanded-wgmma|flash-bf16 with --device cuda: a prompt\n"
    "                   chunk's attention (one session, every key selected: contexts up to\n"
    "                   index_topk) in the absorbed form or expanded: each head's keys and values\n"
    "                   made once for the chunk (fewer products; ~1e-6 from absorbed), its products\n"
    "                   in f32 on mma.sync tiles (expanded) or warpgroup MMA (expanded-wgmma), or\n"
    "                   scores, softmax and P V in one pass on bf16 tensor cores (flash-bf16, the\n"
    "                   default; quantized models on the quantized path, else expanded)\n"
    "  --prefix-cache   after prefill, time a new session of the same prompt through the prefix\n"
    "                   cache (its whole pages taken, the rest run): time to the first token's logits\n"
    "  --route-trace FILE  route every MoE layer by a recorded trace (.txt or .gz; its layers spread\n"
    "                   over the model's MoE layers, token = position mod its length) instead of the\n"
    "                   routers, and report the decode hit rate beside the offline replay of the\n"
    "                   same tokens at the same slots (policy, LRU, Belady)\n"
    "  --trace FILE     no model needed: replay a routing trace (.txt or .gz) through the expert\n"
    "                   cache policy at --expert-slots N slots per layer (default: 16..192) and\n"
    "                   report its hit rate beside LRU and the offline optimum (Belady)\n"
    "  --history-split  with --trace: the first half as an earlier run's usage history (the pins\n"
    "                   a store loads), the second half replayed with it, cold, and without pins\n"
    "  With --mem-budget / --expert-slots (a pack): experts stream from the SSD; the report adds\n"
    "  hit rate, experts and bytes read per token, I/O wait and disk-busy time, prefill's reads,\n"
    "  the SSD read bandwidth of the same run (the better of an O_DIRECT probe and the store's own\n"
    "  reads during decode), and decode_floor_ratio = decode time / max(needed SSD bytes per\n"
    "  token / SSD bandwidth, bytes per token / memory bandwidth).\n"
    "  --draft K|auto   decode with and without speculative drafting (K drafts per step, or the\n"
    "                   cost model), alternating over --rounds R (default 3) of --steps tokens per\n"
    "                   prompt; with --golden FILE its prompts, else random ones of --prompt tokens;\n"
    "                   with --batch B, B sessions per step; reports both tok/s and their ratio,\n"
    "                   tokens per verify, acceptance by position, ms per step by draft count\n"
    "  --oracle-accept P with --draft: accept each draft with probability P instead of checking it\n"
    "                   (random-weight slices, whose MTP agrees with nothing: the verify cost of\n"
    "                   real shapes at a given acceptance; the tokens are then not the model's)\n"
    "  --golden FILE    quality instead of speed: run every prompt_N.ids of a golden.safetensors and\n"
    "                   compare with its prompt_N.logits (relative L2 error, top-1 agreement, KL)\n"
    "  --golden-out FILE  write such a file instead of timing: prompt_0.ids (a random prompt of\n"
    "                   --prompt tokens, bench's own) and prompt_0.logits from this engine, so that\n"
    "                   one path's logits become another's reference (the exact f32 products:\n"
    "                   --act-quant off --relayout off)\n" CLI_MODEL_OPTS_HELP;

/* Quality against reference logits: rel L2 over all positions, top-1 agreement, mean KL(ref||model). */
static int bench_golden(petrel_engine *eng, const char *path, int json) {
    st_set *g;
    petrel_error err = {0};
    if (st_open(path, &g, &err)) return cli_fail_err("bench", &err);
    int V = eng->cfg.vocab_size, rc = 0;
    double num = 0, den = 0, kl = 0;
    long pos = 0, agree = 0;
    for (int pi = 0; !rc; pi++) {
        char n[64];
        snprintf(n, sizeof n, "prompt_%d.ids", pi);
        const st_tensor *ids = st_find(g, n);
        snprintf(n, sizeof n, "prompt_%d.logits", pi);
        const st_tensor *ref = st_find(g, n);
        if (!ids || !ref) break;
        int T = (int)ids->shape[0];
        float *lg = malloc(sizeof(float) * (size_t)T * V);
        petrel_session *s;
        if (!lg || petrel_session_create(eng, T, &s, &err)) { free(lg); rc = cli_fail_err("bench", &err); break; }
        if (petrel_session_forward(s, (const int32_t *)ids->data, T, lg, 1, &err)) rc = cli_fail_err("bench", &err);
        for (int t = 0; !rc && t < T; t++) {
            const float *a = lg + (size_t)t * V, *r = (const float *)ref->data + (size_t)t * V;
            int ba = 0, br = 0;
            double ma = a[0], mr = r[0];
            for (int v = 0; v < V; v++) {
                double d = (double)a[v] - r[v];
                num += d * d;
                den += (double)r[v] * r[v];
                if (a[v] > a[ba]) ba = v;
                if (r[v] > r[br]) br = v;
                if (a[v] > ma) ma = a[v];
                if (r[v] > mr) mr = r[v];
            }
            double za = 0, zr = 0;
            for (int v = 0; v < V; v++) { za += exp(a[v] - ma); zr += exp(r[v] - mr); }
            double k = 0;
            for (int v = 0; v < V; v++) {
                double lr = r[v] - mr - log(zr), la = a[v] - ma - log(za);
                k += exp(lr) * (lr - la);
            }
            kl += k;
            agree += ba == br;
            pos++;
        }
        petrel_session_free(s);
        free(lg);
    }
    st_close(g);
    if (rc) return rc;
    if (!pos) return cli_fail("bench: %s holds no prompt_N.ids / prompt_N.logits", path);
    double rel = den > 0 ? sqrt(num / den) : 0;
    printf("quality vs %s: %ld positions, logits rel L2 error %.3g, top-1 agreement %.1f%%, mean KL %.3g nats\n", path, pos, rel,
           100.0 * (double)agree / (double)pos, kl / (double)pos);
    if (json) printf("{\"positions\": %ld, \"rel_l2\": %.6g, \"top1_agreement\": %.6f, \"kl_mean\": %.6g}\n", pos, rel, (double)agree / (double)pos, kl / (double)pos);
    return 0;
}

/* bench's random prompts: n token ids below V from the xorshift state *x (BENCH_SEED for the
 * timed prompt, so --golden-out writes the same prompt bench times) */
#define BENCH_SEED 88172645463325252ull
static void random_ids(int32_t *ids, long n, int V, uint64_t *x) {
    for (long i = 0; i < n; i++) {
        *x ^= *x << 13; *x ^= *x >> 7; *x ^= *x << 17;
        ids[i] = (int32_t)(*x % (uint64_t)V);
    }
}

/* The reference for --golden from this engine: a random prompt of T tokens (bench's generator),
 * its logits at every position. */
static int bench_golden_out(petrel_engine *eng, const char *path, int T) {
    int V = eng->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    petrel_error err = {0};
    petrel_session *s = NULL;
    int rc = 0;
    if (!lg || !ids) rc = cli_fail("bench: --golden-out: out of memory for %d x %d logits", T, V);
    uint64_t x = BENCH_SEED;
    if (!rc) random_ids(ids, T, V, &x);
    if (!rc && (petrel_session_create(eng, T, &s, &err) || petrel_session_forward(s, ids, T, lg, 1, &err))) rc = cli_fail_err("bench", &err);
    if (!rc) {
        st_write_tensor ts[2] = {{"prompt_0.ids", ST_I32, 1, {T}, ids}, {"prompt_0.logits", ST_F32, 2, {T, V}, lg}};
        if (st_write(path, ts, 2, &err)) rc = cli_fail_err("bench", &err);
        else printf("golden: %d positions of %d logits written to %s\n", T, V, path);
    }
    if (s) petrel_session_free(s);
    free(lg), free(ids);
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- memory bandwidth ----
 * The floor's bandwidth must be what the weights can get: the probe buffer sits in transparent
 * huge pages like the resident weights (pack.c), and is read with AVX-512 loads and the same
 * 4 KiB-ahead software prefetch as the kernels where the CPU has them. (A plain malloc'd buffer
 * in 4 KiB pages read by scalar loads measured ~25 % less here, which put decode "under the
 * floor".) */

static uint64_t *bw_buffer(size_t bytes) {
    size_t n = bytes / 8;
    uint64_t *b = pt_alloc_big(n * 8, 64);
    if (!b) return NULL;
    for (size_t i = 0; i < n; i++) b[i] = i * 2654435761u;
    return b;
}


/* ---- bytes per decode token ---- */
static uint64_t layer_bytes(const petrel_config *c, const layer_w *lw, uint64_t *experts) {
    uint64_t b = pt_wview_bytes(&lw->q_a_proj) + pt_wview_bytes(&lw->q_b_proj) + pt_wview_bytes(&lw->kv_a_proj_with_mqa) +
                 pt_wview_bytes(&lw->kv_b_proj) + pt_wview_bytes(&lw->o_proj);
    b += 4ull * (2 * (uint64_t)c->hidden_size + (uint64_t)c->q_lora_rank + (uint64_t)c->kv_lora_rank);
    if (lw->has_indexer) b += pt_wview_bytes(&lw->idx_wq_b) + pt_wview_bytes(&lw->idx_wk) + pt_wview_bytes(&lw->idx_weights_proj) + 8ull * (uint64_t)c->index_head_dim;
    if (!lw->is_moe) return b + pt_wview_bytes(&lw->gate_proj) + pt_wview_bytes(&lw->up_proj) + pt_wview_bytes(&lw->down_proj);
    b += pt_wview_bytes(&lw->router) + 4ull * (uint64_t)c->n_routed_experts;
    if (lw->has_shared) b += pt_wview_bytes(&lw->sh_gate) + pt_wview_bytes(&lw->sh_up) + pt_wview_bytes(&lw->sh_down);
    /* all routed experts of a layer share one format and shape */
    uint64_t e1 = pt_wview_bytes(&lw->exp_gate[0]) + pt_wview_bytes(&lw->exp_up[0]) + pt_wview_bytes(&lw->exp_down[0]);
    *experts += e1 * (uint64_t)c->num_experts_per_tok;
    return b;
}

/* ---- batched decode (--batch B): B sessions, one row each per forward ---- */
typedef struct batch_result {
    double step_ms, tok_s, row_ms, bytes_step, experts_step, floor_ratio, bw;
    double part_ms[FS_COUNT]; /* per step, over the timed steps */
    double reads_step;        /* streaming: expert records read from the SSD per step */
    double speedup_paired;    /* B x median of (one-session step / batched step) over adjacent pairs; 0: not run */
    unsigned long long pool_jobs, pool_tail_ns; /* --profile: the thread pool over the timed forwards only */
} batch_result;

/* B sessions filled to ctx tokens (random prompts), then `steps` timed forwards of B decode rows
 * through petrel_batch_forward. Bytes per step: the non-expert weights and the head once, plus
 * each routed expert the step ran (the union of the rows' choices, per layer). The floor ratio
 * is the median over steps of step time / (bytes / bandwidth probed right before the step).
 * Resident and unprofiled, one more session at ctx decodes one token right after each timed
 * batched step: the speedup of B rows over one is then also taken pair by pair, at the same
 * moment, so a shared machine's drift between the one-session steps (timed before this) and the
 * batched ones cannot skew it. */
static int bench_batch(petrel_engine *eng, int B, long ctx, long steps, uint64_t shared_bytes, uint64_t expert1, const uint64_t *bw_buf,
                       size_t bw_n, long bw_mib, int threads, kn_prof *prof, batch_result *out, petrel_error *err) {
    const petrel_config *c = &eng->cfg;
    int V = c->vocab_size, rc = 0;
    petrel_session **ss = calloc((size_t)B, sizeof *ss);
    petrel_row *rows = calloc((size_t)B, sizeof *rows);
    float *lg = malloc(sizeof(float) * (size_t)B * (size_t)V);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx), *tok = calloc((size_t)B, sizeof(int32_t));
    double *ms = calloc((size_t)steps, sizeof(double)), *ratio = calloc((size_t)steps, sizeof(double));
    double *pair = calloc((size_t)steps, sizeof(double));
    petrel_batch *b = NULL;
    petrel_session *solo = NULL; /* the paired one-session steps (resident, unprofiled) */
    int32_t solo_tok = 0;
    const int paired = !eng->xs && !eng->cu && !prof;
    if (!ss || !rows || !lg || !ids || !tok || !ms || !ratio || !pair) {
        snprintf(err->msg, sizeof err->msg, "out of memory");
        rc = err->code = PETREL_ENOMEM;
    }
    if (!rc) rc = petrel_batch_create(eng, B, &b, err);
    uint64_t x = 0x2545F4914F6CDD1Dull;
    for (int k = 0; k < B && !rc; k++) {
        random_ids(ids, ctx, V, &x);
        rc = petrel_session_create(eng, (int)(ctx + steps + 4), &ss[k], err);
        if (!rc) petrel_session_set_route_offset(ss[k], 257 * k); /* trace-driven routing: rows route like different tokens */
        if (!rc) rc = petrel_session_forward(ss[k], ids, (int)ctx, lg, 0, err);
        tok[k] = ids[ctx - 1];
        if (!rc && paired && k == B - 1) { /* the last prompt again, in a session of its own */
            rc = petrel_session_create(eng, (int)(ctx + steps + 4), &solo, err);
            if (!rc) rc = petrel_session_forward(solo, ids, (int)ctx, lg, 0, err);
            solo_tok = ids[ctx - 1];
        }
    }
    const fwd_stats *st = b ? batch_stats(b) : NULL;
    uint64_t ex0 = 0, ns0[FS_COUNT] = {0};
    xs_stats x0 = {0}, x1 = {0};
    double gpu_bw = 0;
    for (long k = 0; k < 2 + steps && !rc; k++) { /* two untimed forwards first */
        if (k == 2) {
            ex0 = st->experts_run;
            memcpy(ns0, st->ns, sizeof ns0);
            if (eng->xs) xs_store_stats(eng->xs, &x0);
        }
        if (k == 2 && eng->cu) gpu_bw = cu_hbm_probe(eng->cu, 1ull << 30); /* on the GPU: HBM, once before the timed steps, not between them (see bench's decode) */
        double g = k >= 2 && eng->cu ? gpu_bw : 0;
        if (k >= 2 && !eng->cu)
            for (int rep = 0, parts = bw_mib >= 1024 ? 4 : 1; rep < 3; rep++) {
                double v = plan_bw_pass(bw_buf + (size_t)(rep % parts) * (bw_n / (size_t)parts), bw_n / (size_t)parts, threads, (2 + rep) % 3);
                if (v > g) g = v;
            }
        for (int r = 0; r < B; r++) rows[r] = (petrel_row){ss[r], tok[r], 1};
        uint64_t e0 = st->experts_run, t0 = pt_now_ns();
        unsigned long long pj0 = 0, pt0 = 0, pj1 = 0, pt1 = 0;
        if (k >= 2 && prof) {
            kn_set_profile(prof);
            pool_stats(kn_pool(), &pj0, &pt0);
        }
        rc = petrel_batch_forward(b, rows, B, lg, err);
        kn_set_profile(NULL);
        if (k >= 2 && prof) { /* not the sessions' prefill above: its chunks' dispatches are not the step's */
            pool_stats(kn_pool(), &pj1, &pt1);
            out->pool_jobs += pj1 - pj0;
            out->pool_tail_ns += pt1 - pt0;
        }
        if (rc) break;
        if (k >= 2) {
            ms[k - 2] = (double)(pt_now_ns() - t0) / 1e6;
            double bytes = (double)shared_bytes + (double)(st->experts_run - e0) * (double)expert1;
            ratio[k - 2] = ms[k - 2] / (bytes / (g * 1e9) * 1e3);
            out->bw += g / (double)steps;
        }
        for (int r = 0; r < B; r++) {
            const float *l = lg + (size_t)r * V;
            tok[r] = (int32_t)kn_argmax(l, V);
        }
        if (k >= 2 && solo) { /* the paired one-session step, right after (its argmax untimed) */
            uint64_t s0 = pt_now_ns();
            if ((rc = petrel_session_forward(solo, &solo_tok, 1, lg, 0, err))) break;
            pair[k - 2] = (double)(pt_now_ns() - s0) / 1e6 / ms[k - 2];
            solo_tok = (int32_t)kn_argmax(lg, V);
        }
    }
    if (!rc) {
        if (solo) {
            qsort(pair, (size_t)steps, sizeof(double), cmp_double);
            out->speedup_paired = B * pair[steps / 2];
        }
        out->experts_step = (double)(st->experts_run - ex0) / (double)steps;
        out->bytes_step = (double)shared_bytes + out->experts_step * (double)expert1;
        qsort(ms, (size_t)steps, sizeof(double), cmp_double);
        qsort(ratio, (size_t)steps, sizeof(double), cmp_double);
        out->step_ms = ms[steps / 2];
        out->row_ms = out->step_ms / B;
        out->tok_s = 1e3 * B / out->step_ms;
        out->floor_ratio = ratio[steps / 2];
        for (int p = 0; p < FS_COUNT; p++) out->part_ms[p] = (double)(st->ns[p] - ns0[p]) / 1e6 / (double)steps;
        if (eng->xs) {
            xs_store_stats(eng->xs, &x1);
            out->reads_step = (double)(x1.reads - x0.reads) / (double)steps;
        }
    }
    for (int k = 0; ss && k < B; k++) petrel_session_free(ss[k]);
    petrel_session_free(solo);
    free(pair);
    petrel_batch_free(b);
    free(ss);
    free(rows);
    free(lg);
    free(ids);
    free(tok);
    free(ms);
    free(ratio);
    return rc;
}

/* the multiply-adds x 2 of a T-token prompt from position 0, counted as the GPU's quickest forms
 * do them: every layer's products for each row (the indexer's query side only where a row's keys
 * pass index_topk), the attention expanded (each head's keys and values made once: T NH (Dn + Dv)
 * Rkv, then each row's min(r + 1, index_topk) keys at NH (Dqk + Dv)); the head not counted (a
 * prompt's logits are a few rows) */
static double prompt_flops(const petrel_config *c, long T) {
    const double H = c->hidden_size, NH = c->num_attention_heads, Rkv = c->kv_lora_rank, Dr = c->qk_rope_head_dim;
    const double Dn = c->qk_nope_head_dim, Dqk = c->qk_head_dim, Dv = c->v_head_dim, ql = c->q_lora_rank > 0 ? c->q_lora_rank : 0;
    const double Hi = c->index_n_heads, Di = c->index_head_dim;
    const long topk = c->index_topk > 0 ? c->index_topk : T;
    double keys = 0, rows_past = T > topk ? (double)(T - topk) : 0; /* keys summed over the rows; rows scoring the indexer */
    for (long r = 0; r < T; r++) keys += r + 1 < topk ? r + 1 : topk;
    double mac = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const double proj = (ql > 0 ? H * ql + ql * NH * Dqk : H * NH * Dqk) + H * (Rkv + Dr) + NH * Dv * H;
        const double idx = Hi > 0 ? H * Di : 0, idx_q = Hi > 0 ? ql * Hi * Di + H * Hi : 0; /* its keys every row; wq_b, weights_proj */
        double mlp = 3.0 * H * c->intermediate_size;
        if (c->layer_is_moe[l])
            mlp = 3.0 * H * c->moe_intermediate_size * (c->num_experts_per_tok + (c->n_shared_experts > 0 ? c->n_shared_experts : 0)) + H * c->n_routed_experts;
        mac += (double)T * (proj + idx + mlp) + rows_past * idx_q + rows_past * (double)T * Hi * Di; /* the indexer's scores: past topk rows over ~T keys */
        mac += (double)T * NH * (Dn + Dv) * Rkv + keys * NH * (Dqk + Dv);
    }
    return 2 * mac;
}

/* ---- arithmetic peak: f32 FMA throughput of this machine (AVX-512 when present) ---- */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static double fma_loop_avx512(long iters) {
    /* 12 independent accumulators in registers: enough to cover FMA latency x throughput */
    __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2), a3 = _mm512_set1_ps(3);
    __m512 a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5), a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7);
    __m512 a8 = _mm512_set1_ps(8), a9 = _mm512_set1_ps(9), a10 = _mm512_set1_ps(10), a11 = _mm512_set1_ps(11);
    for (long k = 0; k < iters; k++) {
        a0 = _mm512_fmadd_ps(a0, b, c); a1 = _mm512_fmadd_ps(a1, b, c); a2 = _mm512_fmadd_ps(a2, b, c);
        a3 = _mm512_fmadd_ps(a3, b, c); a4 = _mm512_fmadd_ps(a4, b, c); a5 = _mm512_fmadd_ps(a5, b, c);
        a6 = _mm512_fmadd_ps(a6, b, c); a7 = _mm512_fmadd_ps(a7, b, c); a8 = _mm512_fmadd_ps(a8, b, c);
        a9 = _mm512_fmadd_ps(a9, b, c); a10 = _mm512_fmadd_ps(a10, b, c); a11 = _mm512_fmadd_ps(a11, b, c);
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                               _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    float out[16];
    _mm512_storeu_ps(out, sum);
    return out[0];
}
/* int8 dot products (vpdpbusd: 16 lanes x 4 multiply-adds = 128 ops) with 12 independent
 * accumulators: the VNNI peak the int8-activation kernels run against. The accumulators start
 * different and all twelve pass through the asm barrier: before 2026-12-05 six of them started
 * equal outside it, the compiler merged those into one chain, and the loop ran 7 vpdpbusd per
 * iteration while counting 12 (a peak 1.7x too high; bench/RESULTS.md, 2026-12-05). */
__attribute__((target("avx512f,avx512vnni"))) static double vnni_loop(long iters) {
    __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(-2);
    __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3),
            a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7),
            a8 = _mm512_set1_epi32(8), a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10), a11 = _mm512_set1_epi32(11);
    for (long k = 0; k < iters; k++) {
        a0 = _mm512_dpbusd_epi32(a0, b, c); a1 = _mm512_dpbusd_epi32(a1, b, c); a2 = _mm512_dpbusd_epi32(a2, b, c);
        a3 = _mm512_dpbusd_epi32(a3, b, c); a4 = _mm512_dpbusd_epi32(a4, b, c); a5 = _mm512_dpbusd_epi32(a5, b, c);
        a6 = _mm512_dpbusd_epi32(a6, b, c); a7 = _mm512_dpbusd_epi32(a7, b, c); a8 = _mm512_dpbusd_epi32(a8, b, c);
        a9 = _mm512_dpbusd_epi32(a9, b, c); a10 = _mm512_dpbusd_epi32(a10, b, c); a11 = _mm512_dpbusd_epi32(a11, b, c);
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                 _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
    return (double)_mm512_reduce_add_epi32(s);
}
#endif
typedef struct { long iters; double sink; int vnni; } peakjob;
static void *peak_thread(void *a) {
    peakjob *j = a;
#if defined(__x86_64__)
    j->sink = j->vnni ? vnni_loop(j->iters) : fma_loop_avx512(j->iters);
#endif
    return NULL;
}
/* GFLOP/s of f32 FMAs (vnni: GOP/s of int8 vpdpbusd) on `threads` threads (0 if the CPU lacks
 * AVX-512 / VNNI). */
static double measure_peak_gflops(int threads, int vnni) {
#if defined(__x86_64__)
    if (!__builtin_cpu_supports("avx512f") || (vnni && !__builtin_cpu_supports("avx512vnni"))) return 0;
    long iters = 20000000;
    pthread_t th[64];
    peakjob jobs[64];
    if (threads > 64) threads = 64;
    uint64_t t0 = pt_now_ns();
    for (int t = 0; t < threads; t++) {
        jobs[t] = (peakjob){iters, 0, vnni};
        if (t) pthread_create(&th[t], NULL, peak_thread, &jobs[t]);
    }
    peak_thread(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(th[t], NULL);
    double dt = (double)(pt_now_ns() - t0) / 1e9;
    return (double)iters * 12 * 16 * (vnni ? 8 : 2) * threads / dt / 1e9;
#else
    (void)threads;
    (void)vnni;
    return 0;
#endif
}

/* ---- routing-trace replay (--trace): the policy against LRU and Belady at equal capacity ---- */
/* tokens [a, b) of t as a trace of their own */
static int sub_trace(const xs_trace *t, int a, int b, xs_trace *out, petrel_error *err) {
    PT_TRY(xs_trace_init(out, t->n_layers, t->n_experts, t->topk));
    int32_t ids[256];
    for (int tok = a; tok < b; tok++)
        for (int l = 0; l < t->n_layers; l++) {
            const int16_t *d = t->ids + ((size_t)tok * t->n_layers + l) * t->topk;
            int k = 0;
            for (; k < t->topk && k < 256 && d[k] >= 0; k++) ids[k] = d[k];
            PT_TRY(xs_trace_add(out, tok - a, l, ids, k, err));
        }
    return 0;
}

/* --history-split: the first half of the trace as an earlier run's usage history (the pins a
 * store would load), the second half replayed: with that history, cold (pins learned as it
 * goes), and without pins. */
static int bench_trace_history(const xs_trace *t, int slots, petrel_error *err) {
    xs_trace h, r;
    int half = t->n_tokens / 2;
    PT_TRY(sub_trace(t, 0, half, &h, err));
    int rc = sub_trace(t, half, t->n_tokens, &r, err);
    printf("history: tokens 0..%d as the usage history, %d..%d replayed\n", half, half, t->n_tokens);
    printf("%-8s %16s %12s %12s %10s %10s\n", "slots", "pins+history", "pins, cold", "no pins", "LRU", "Belady");
    int caps_default[] = {16, 32, 64, 96, 128, 192}, ncap = slots ? 1 : 6;
    for (int i = 0; i < ncap && !rc; i++) {
        int cap = slots ? slots : caps_default[i];
        if (cap > t->n_experts || cap < t->topk) continue;
        xs_policy_params prm, np;
        xs_policy_defaults(&prm);
        np = prm;
        np.pin_frac = 0;
        xs_replay_stats a, b, c;
        if ((rc = xs_trace_replay_hist(&r, &h, &prm, cap, &a, err)) || (rc = xs_trace_replay(&r, &prm, cap, &b, err)) ||
            (rc = xs_trace_replay(&r, &np, cap, &c, err)))
            break;
        printf("%-8d %15.1f%% %11.1f%% %11.1f%% %9.1f%% %9.1f%%\n", cap, 100 * a.policy_rate, 100 * b.policy_rate, 100 * c.policy_rate, 100 * a.lru_rate,
               100 * a.belady_rate);
    }
    xs_trace_deinit(&h);
    xs_trace_deinit(&r);
    return rc;
}

static int bench_trace(const char *path, int slots, int json, int history_split) {
    xs_trace t;
    petrel_error err = {0};
    int rc = xs_trace_read(&t, path, &err);
    if (rc) return cli_fail_err("bench", &err);
    printf("trace: %s: %d tokens x %d MoE layers, %d experts, top-%d\n", path, t.n_tokens, t.n_layers, t.n_experts, t.topk);
    if (history_split) {
        rc = bench_trace_history(&t, slots, &err);
        xs_trace_deinit(&t);
        return rc ? cli_fail_err("bench", &err) : 0;
    }
    printf("%-10s %10s %10s %10s %16s\n", "slots", "policy", "LRU", "Belady", "policy/Belady");
    int caps_default[] = {16, 32, 64, 96, 128, 192}, ncap = slots ? 1 : 6;
    xs_policy_params prm;
    xs_policy_defaults(&prm);
    char js[2048];
    size_t jo = (size_t)snprintf(js, sizeof js, "{\"trace\": \"%s\", \"tokens\": %d, \"results\": [", path, t.n_tokens);
    for (int i = 0; i < ncap && !rc; i++) {
        int cap = slots ? slots : caps_default[i];
        if (cap > t.n_experts) continue;
        xs_replay_stats st;
        if ((rc = xs_trace_replay(&t, &prm, cap, &st, &err))) { cli_fail_err("bench", &err); break; }
        printf("%-10d %9.1f%% %9.1f%% %9.1f%% %15.3f\n", cap, 100 * st.policy_rate, 100 * st.lru_rate, 100 * st.belady_rate, st.policy_vs_belady);
        if (jo < sizeof js)
            jo += (size_t)snprintf(js + jo, sizeof js - jo, "%s{\"slots\": %d, \"hit_rate\": %.5f, \"lru_hit_rate\": %.5f, \"belady_hit_rate\": %.5f, \"vs_belady\": %.5f}",
                                   i ? ", " : "", cap, st.policy_rate, st.lru_rate, st.belady_rate, st.policy_vs_belady);
    }
    if (!rc && json) printf("%s]}\n", js);
    xs_trace_deinit(&t);
    return rc ? 1 : 0;
}

/* SSD read bandwidth: plan_ssd_probe (src/model/plan.h), expert records at random through the
 * store's own I/O pool. */

/* Trace-driven routing (--route-trace): the offline replay of the tokens the timed decode steps
 * routed, at the store's slots, after the tokens before them (prompt and untimed steps): the
 * policy's, LRU's and Belady's hit rates over those steps (Belady's as the whole replay's minus
 * the prefix's, so it sees no further than the run). */
static int route_replay(const petrel_engine *eng, long first, long steps, int slots, double *pol, double *lru, double *bel, petrel_error *err) {
    const xs_trace *rt = eng->route;
    int M = eng->n_moe, K = rt->topk;
    xs_trace sub;
    PT_TRY(xs_trace_init(&sub, M, rt->n_experts, K));
    int rc = 0;
    int32_t e8[64];
    for (long tok = 0; tok < first + steps && !rc; tok++)
        for (int m = 0; m < M && !rc; m++) {
            const int16_t *te = rt->ids + ((size_t)(tok % rt->n_tokens) * rt->n_layers + eng->route_layer[m]) * K;
            for (int k = 0; k < K && k < 64; k++) e8[k] = te[k];
            rc = xs_trace_add(&sub, (int)tok, m, e8, K, err);
        }
    xs_policy_params prm;
    xs_policy_defaults(&prm);
    xs_replay_stats all, pre;
    if (!rc) rc = xs_trace_replay(&sub, &prm, slots, &all, err);
    sub.n_tokens = (int)first; /* the prefix alone */
    if (!rc) rc = xs_trace_replay(&sub, &prm, slots, &pre, err);
    if (!rc) {
        double acc = (double)(all.accesses - pre.accesses);
        *pol = acc > 0 ? (double)(all.policy_hits - pre.policy_hits) / acc : 0;
        *lru = acc > 0 ? (double)(all.lru_hits - pre.lru_hits) / acc : 0;
        *bel = acc > 0 ? (double)(all.belady_hits - pre.belady_hits) / acc : 0;
    }
    xs_trace_deinit(&sub);
    return rc;
}

/* ---- --profile on the CPU: the decode step by product ---- */
/* The name of the weight whose data is `data` (or, failing that, of the first tensor of its shape
 * and format, cols / qtype < 0: any; streamed experts live in the store's slots), and its part. */
static const char *prof_name(const petrel_engine *eng, const uint8_t *data, int64_t rows, int64_t cols, int qtype, fwd_part *part) {
    const petrel_config *c = &eng->cfg;
    const model_w *w = &eng->w;
    for (int pass = 0; pass < 2; pass++) {
        if (pass ? w->lm_head.rows == rows && (cols < 0 || w->lm_head.cols == cols) && (qtype < 0 || (int)w->lm_head.qtype == qtype) : w->lm_head.data == data)
            return *part = FS_HEAD, "lm_head";
        for (int l = 0; l < c->num_hidden_layers; l++) {
            const layer_w *lw = &w->layers[l];
            struct { const pt_wview *v; const char *name; fwd_part part; } t[] = {
                {&lw->q_a_proj, "q_a_proj", FS_ATTN}, {&lw->kv_a_proj_with_mqa, "kv_a_proj_with_mqa", FS_ATTN}, {&lw->q_b_proj, "q_b_proj", FS_ATTN},
                {&lw->kv_b_proj, "kv_b_proj", FS_ATTN}, {&lw->o_proj, "o_proj", FS_ATTN}, {&lw->idx_wq_b, "indexer wq_b", FS_INDEXER},
                {&lw->idx_wk, "indexer wk", FS_INDEXER}, {&lw->idx_weights_proj, "indexer weights_proj", FS_INDEXER},
                {&lw->gate_proj, "mlp gate_proj", FS_DENSE}, {&lw->up_proj, "mlp up_proj", FS_DENSE}, {&lw->down_proj, "mlp down_proj", FS_DENSE},
                {&lw->router, "router", FS_ROUTER}, {&lw->sh_gate, "shared gate_proj", FS_SHARED}, {&lw->sh_up, "shared up_proj", FS_SHARED},
                {&lw->sh_down, "shared down_proj", FS_SHARED},
                {lw->exp_gate ? &lw->exp_gate[0] : NULL, "experts gate_proj", FS_EXPERTS}, {lw->exp_up ? &lw->exp_up[0] : NULL, "experts up_proj", FS_EXPERTS},
                {lw->exp_down ? &lw->exp_down[0] : NULL, "experts down_proj", FS_EXPERTS},
            };
            for (size_t k = 0; k < sizeof t / sizeof t[0]; k++) {
                const pt_wview *v = t[k].v;
                if (!v || !v->rows) continue;
                if (pass ? v->rows == rows && (cols < 0 || v->cols == cols) && (qtype < 0 || (int)v->qtype == qtype) : v->data == data && t[k].part != FS_EXPERTS)
                    return *part = t[k].part, t[k].name;
            }
        }
    }
    return *part = FS_OTHER, "(unnamed)";
}

static int cmp_prof(const void *a, const void *b) {
    const kn_prof_row *x = a, *y = b;
    return x->prep_ns + x->run_ns < y->prep_ns + y->run_ns ? 1 : x->prep_ns + x->run_ns > y->prep_ns + y->run_ns ? -1 : 0;
}

/* Every kind of product of the timed steps (per token: calls, MB of weights, ms, GB/s and the
 * share of the memory probe), then per part what its products do not explain (attention's
 * per-head W_UK / W_UV, its core over the cache, norms, RoPE, routing arithmetic) and the pool's
 * figures. */
static void print_cpu_profile(const petrel_engine *eng, kn_prof *p, const char *what, const double *part_ns, long steps, double bw, uint64_t kv_step,
                              double jobs, double tail_ns, double step_ms) {
    qsort(p->row, (size_t)p->n_rows, sizeof p->row[0], cmp_prof);
    double part_ms[FS_COUNT] = {0}, part_mb[FS_COUNT] = {0}, sum_ms = 0, sum_mb = 0;
    printf("%s by product (--profile; per step, over %ld steps; %% of the memory probe's %.1f GB/s):\n", what, steps, bw);
    printf("%-40s %-16s %-6s %4s %5s %7s %9s %8s %8s %6s\n", "product", "shape", "format", "rows", "jobs", "calls", "MB", "ms", "GB/s", "%");
    for (int i = 0; i < p->n_rows; i++) {
        const kn_prof_row *r = &p->row[i];
        fwd_part part;
        fwd_part part2;
        char name[48];
        if (r->rows < 0) snprintf(name, sizeof name, "(others)"), part = FS_OTHER;
        else if (r->kind == KN_PROF_ATTN) snprintf(name, sizeof name, "attention core (%d queries)%s", (int)r->rows, r->jobs > 1 ? ", rows" : ""), part = FS_ATTN;
        else if (r->jobs == 1) snprintf(name, sizeof name, "%s", prof_name(eng, r->data, r->rows, r->cols, r->qtype, &part));
        else if (r->jobs == 2)
            snprintf(name, sizeof name, "%s + %s", prof_name(eng, r->data, r->rows, r->cols, r->qtype, &part),
                     prof_name(eng, r->data2, r->rows2, r->cols, r->qtype, &part2)); /* (jobs of one dispatch: as a rule one input width and format) */
        else snprintf(name, sizeof name, "%s + %d more", prof_name(eng, r->data, r->rows, r->cols, r->qtype, &part), r->jobs - 1);
        double ms = (double)(r->prep_ns + r->run_ns) / 1e6 / (double)steps, mb = (double)r->wbytes / 1e6 / (double)steps;
        char shape[48];
        if (r->kind == KN_PROF_ATTN) snprintf(shape, sizeof shape, "latent cache");
        else snprintf(shape, sizeof shape, "%s%lldx%lld", r->kind == KN_PROF_MATMUL_T ? "T " : "", (long long)r->rows, (long long)r->cols);
        double gbs = ms > 0 ? mb / ms : 0;
        printf("%-40s %-16s %-6s %4d %5d %7.1f %9.2f %8.3f %8.1f %6.1f\n", name, shape, pt_qtype_name((pt_qtype)r->qtype), r->n, r->jobs,
               (double)r->calls / (double)steps, mb, ms, gbs, bw > 0 ? 100 * gbs / bw : 0);
        part_ms[part] += ms, part_mb[part] += mb, sum_ms += ms, sum_mb += mb;
    }
    printf("products: %.3f ms and %.1f MB per step, %.1f GB/s (%.1f%% of the probe); the step: %.3f ms\n", sum_ms, sum_mb,
           sum_ms > 0 ? sum_mb / sum_ms : 0, bw > 0 && sum_ms > 0 ? 100 * sum_mb / sum_ms / bw : 0, step_ms);
    printf("what each part's products do not explain (ms per step):");
    for (int q = 0; q < FS_COUNT; q++) {
        double rest = part_ns[q] / 1e6 / (double)steps - part_ms[q];
        printf(" %s %.3f%s", fwd_part_names[q], rest, q + 1 < FS_COUNT ? "," : "\n");
    }
    double kvb = 0;
    for (int l = 0; l < eng->cfg.num_hidden_layers; l++) kvb += (double)pt_wview_bytes(&eng->w.layers[l].kv_b_proj);
    printf("(attention's rest: the per-head W_UK / W_UV products over %.1f MB of kv_b_proj, the latent KV writes (%.2f MB read per "
           "step in all), norms, RoPE; routed experts' rest: their routing bookkeeping and the weighted sum)\n", kvb / 1e6, (double)kv_step / 1e6);
    printf("thread pool: %.1f dispatches per step; the calling thread waited %.3f ms per step for the last task of a dispatch "
           "(imbalance and synchronization, inside the figures above)\n", jobs / (double)steps, tail_ns / 1e6 / (double)steps);
}

CLI_CMD(bench) {
    cli_model_opts mo = {0};
    int json = 0;
    const char *golden = NULL, *golden_out = NULL, *trace = NULL, *route = NULL;
    long ctx = 0, prompt = 512, steps = 24, bw_mib = 1024, prefill_runs = 3, batch = 0, rounds = 3;
    int draft_set = 0, prefix_reuse = 0, history_split = 0, profile = 0, pdl = -1, two_streams = -1, bf16_experts = -1, bf16_dense = -1, xattn = -1;
    static const char *const off_on[] = {"off", "on"};
    bench_draft_opts bd = {0};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--prefix-cache")) prefix_reuse = 1;
        else if (!strcmp(argv[i], "--profile")) profile = 1;
        else if (!strcmp(argv[i], "--cuda-pdl") && i + 1 < argc) {
            if ((pdl = cli_opt_choice("bench", "--cuda-pdl", argv[++i], off_on, 2)) < 0) return 1;
        }
        else if (!strcmp(argv[i], "--cuda-fork") && i + 1 < argc) {
            if ((two_streams = cli_opt_choice("bench", "--cuda-fork", argv[++i], off_on, 2)) < 0) return 1;
        }
        else if (!strcmp(argv[i], "--cuda-experts") && i + 1 < argc) { /* 1 mma.sync, 2 wgmma */
            static const char *const forms[] = {"int8", "bf16", "wgmma", "tma"};
            if ((bf16_experts = cli_opt_choice("bench", "--cuda-experts", argv[++i], forms, 4)) < 0) return 1;
        }
        else if (!strcmp(argv[i], "--cuda-dense") && i + 1 < argc) {
            static const char *const forms[] = {"int8", "wgmma", "tma"};
            if ((bf16_dense = cli_opt_choice("bench", "--cuda-dense", argv[++i], forms, 3)) < 0) return 1;
        }
        else if (!strcmp(argv[i], "--cuda-prompt-attn") && i + 1 < argc) { /* 1 mma.sync tiles, 2 wgmma, 3 one bf16 pass */
            static const char *const forms[] = {"absorbed", "expanded", "expanded-wgmma", "flash-bf16"};
            if ((xattn = cli_opt_choice("bench", "--cuda-prompt-attn", argv[++i], forms, 4)) < 0) return 1;
        }
        else if (!strcmp(argv[i], "--history-split")) history_split = 1;
        else if (!strcmp(argv[i], "--golden") && i + 1 < argc) golden = argv[++i];
        else if (!strcmp(argv[i], "--golden-out") && i + 1 < argc) golden_out = argv[++i];
        else if (!strcmp(argv[i], "--draft") && i + 1 < argc) { if (cli_opt_draft("bench", argv[++i], &bd.draft)) return 1; draft_set = 1; }
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) { if (cli_parse_int(argv[++i], 1, 1000, &rounds)) return cli_fail("bench: --rounds: \"%s\" is not a count (1 .. 1000)", argv[i]); }
        else if (!strcmp(argv[i], "--oracle-accept") && i + 1 < argc) {
            char *end;
            bd.oracle = strtod(argv[++i], &end);
            if (*end || end == argv[i] || !(bd.oracle >= 0 && bd.oracle <= 1)) return cli_fail("bench: --oracle-accept: \"%s\" is not a probability in [0, 1]", argv[i]);
        }
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace = argv[++i];
        else if (!strcmp(argv[i], "--route-trace") && i + 1 < argc) route = argv[++i];
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) { if (cli_parse_int(argv[++i], 1, 1 << 24, &ctx)) return cli_fail("bench: bad --ctx"); }
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc) { if (cli_parse_int(argv[++i], 1, 1 << 24, &prompt)) return cli_fail("bench: bad --prompt"); }
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) { if (cli_parse_int(argv[++i], 1, 1 << 20, &steps)) return cli_fail("bench: bad --steps"); }
        else if (!strcmp(argv[i], "--prefill-runs") && i + 1 < argc) { if (cli_parse_int(argv[++i], 1, 100, &prefill_runs)) return cli_fail("bench: bad --prefill-runs"); }
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) { if (cli_parse_int(argv[++i], 1, 4096, &batch)) return cli_fail("bench: --batch: \"%s\" is not a count (1 .. 4096)", argv[i]); }
        else if (!strcmp(argv[i], "--bw-mib") && i + 1 < argc) { if (cli_parse_int(argv[++i], 16, 1 << 20, &bw_mib)) return cli_fail("bench: bad --bw-mib"); }
        else return cli_fail("bench: unknown or incomplete option \"%s\" (petrel bench --help)", argv[i]);
    }
    if (trace) return bench_trace(trace, mo.open.expert_slots, json, history_split);
    if (!mo.model) return cli_fail("bench: --model is required");
    if (golden_out && (golden || draft_set)) return cli_fail("bench: --golden-out writes a reference; it does not combine with --golden or --draft");
    if (golden_out && cli_out_check("bench", golden_out, mo.model)) return 1; /* before the model opens */
    if (mo.open.mem_budget && bw_mib > 128) bw_mib = 128; /* the probe buffer counts against the budget */
    if (ctx < prompt) ctx = prompt;
    if (!mo.open.plan_context) /* the plan (KV pool, scratch) for the sessions this bench runs, whole pages each */
        mo.open.plan_context = (int)((batch + 2) * (ctx + steps + 4 + 64)); /* the timed session, a prefill run's, the batch's */
    petrel_error err = {0};
    petrel_engine *eng;
    mo.open.route_trace = route;
    uint64_t open_t0 = pt_now_ns();
    int orc = cli_engine_open(&mo, &eng, &err);
    if (orc) return cli_fail_err("bench", &err);
    double open_s = (double)(pt_now_ns() - open_t0) / 1e9; /* reading, checking and laying out the weights */
    if (pdl >= 0 && !eng->cu) { petrel_engine_close(eng); return cli_fail("bench: --cuda-pdl is for --device cuda"); }
    if (pdl >= 0) cu_model_use_pdl(eng->cu, pdl);
    if (two_streams >= 0 && !eng->cu) { petrel_engine_close(eng); return cli_fail("bench: --cuda-fork is for --device cuda"); }
    if (two_streams >= 0) cu_model_use_fork(eng->cu, two_streams);
    if (bf16_experts >= 0 && !eng->cu) { petrel_engine_close(eng); return cli_fail("bench: --cuda-experts is for --device cuda"); }
    if (bf16_experts >= 0) cu_model_use_bf16_experts(eng->cu, bf16_experts);
    if (bf16_dense >= 0 && !eng->cu) { petrel_engine_close(eng); return cli_fail("bench: --cuda-dense is for --device cuda"); }
    if (bf16_dense >= 0) cu_model_use_bf16_dense(eng->cu, bf16_dense);
    if (xattn >= 0 && !eng->cu) { petrel_engine_close(eng); return cli_fail("bench: --cuda-prompt-attn is for --device cuda"); }
    if (xattn >= 0) cu_model_use_expanded_attn(eng->cu, xattn);
    if (route) printf("routing: every MoE layer's choices from %s (%d tokens, trace layers spread over the %d MoE layers)\n", route, eng->route->n_tokens,
                      eng->n_moe);
    if (draft_set && bd.draft == 0) { petrel_engine_close(eng); return cli_fail("bench: --draft 0: nothing to compare (give 1..16 or auto)"); }
    if (golden && !draft_set) {
        int grc = bench_golden(eng, golden, json);
        return cli_engine_close("bench", eng, grc);
    }
    if (golden_out) return cli_engine_close("bench", eng, bench_golden_out(eng, golden_out, (int)prompt));
    const petrel_config *c = &eng->cfg;
    int threads = kn_threads();
    char cpu[256];
    plan_cpu_model(cpu, sizeof cpu);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    char pfs[48];
    if (eng->kt.pf_bytes) snprintf(pfs, sizeof pfs, "%d B ahead into %s, %s", eng->kt.pf_bytes, eng->kt.pf_l2 ? "L2" : "L1",
                                    eng->kt.pf_all ? "every line" : "every other line");
    else snprintf(pfs, sizeof pfs, "none");
    printf("machine: %s%s, %ld cores online, kernels %s (prefetch %s), %d threads\n", cpu, cpu_has_amx() ? " (AMX)" : " (no AMX)", cores,
           kt_isa_name(&eng->kt), pfs, threads);
    if (eng->cu) printf("device: %s (the floor's bandwidth: HBM reads, probed before and after the timed steps)\n", petrel_engine_device(eng));
    printf("model: %s (%d layers, hidden %d, %d experts top-%d), opened in %.2f s\n", mo.model, c->num_hidden_layers, c->hidden_size,
           c->n_routed_experts, c->num_experts_per_tok, open_s);
    fflush(stdout);

    /* bytes per decode token */
    const model_w *w = &eng->w;
    uint64_t resident = 0, experts = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) resident += layer_bytes(c, &w->layers[l], &experts);
    uint64_t head = pt_wview_bytes(&w->lm_head) + (uint64_t)w->embed_tokens.row_bytes + 4ull * (uint64_t)c->hidden_size;
    /* the latent KV a decode step at context ctx reads: each layer's attended keys (c and k_pe of
     * min(ctx, index_topk) keys on DSA layers, every key on the others) and the indexer keys
     * every full layer scores past index_topk, in the pool's scheme */
    const kv_layout *kl = kv_pool_layout(eng->kv);
    uint64_t kv_step = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        uint64_t keys = (uint64_t)ctx, sel = keys < (uint64_t)c->index_topk ? keys : (uint64_t)c->index_topk;
        kv_step += sel * ((uint64_t)kl->Rkv * (uint64_t)kl->c_bytes + (uint64_t)kl->Dr * (uint64_t)kl->pe_bytes + (kl->c_bytes == 1 ? 4u : 0u));
        if (c->layer_indexer_full[l] && keys > (uint64_t)c->index_topk) /* scored only past index_topk */
            kv_step += keys * ((uint64_t)kl->Di * (uint64_t)kl->idx_bytes + (kl->idx_bytes == 1 ? 4u : 0u));
    }
    uint64_t bytes_tok = resident + experts + head + kv_step;
    printf("latent KV read per decode step: %.2f MB (%s, context %ld; counted in bytes per token and the floor)\n", (double)kv_step / 1e6,
           kv_scheme_name(kl->scheme), ctx);
    uint64_t expert1 = experts / (uint64_t)c->num_experts_per_tok; /* then one expert of one layer (all alike) */
    int n_moe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) n_moe += c->layer_is_moe[l] && eng->w.layers[l].exp_gate;
    if (n_moe) expert1 /= (uint64_t)n_moe;

    /* warm the map so page faults are not timed (when streaming: the resident tensors only);
     * a copy made at open is read once too, so that no first read of a page is timed (a
     * read-only copy's first reads cost kernel time on the dev box: bench/RESULTS.md,
     * 2026-12-04 19:05; the open no longer makes it read-only) */
    if (eng->pack && eng->pack->copy) {
        volatile uint8_t s = 0;
        const pack *pk = eng->pack;
        for (int t = 0; t < pk->n_tensors; t++)
            if (&pk->tensors[t] != pk->on_disk)
                for (uint64_t o = 0; o < pk->tensors[t].bytes + pk->tensors[t].scale_bytes; o += 64)
                    s ^= pk->copy[o < pk->tensors[t].bytes ? pk->tensors[t].offset + o : pk->tensors[t].scale_offset + (o - pk->tensors[t].bytes)];
        for (int i = 0; pk->copy_experts && i < pk->n_elayers; i++)
            for (uint64_t o = 0; o < (uint64_t)pk->elayers[i].n_experts * pk->elayers[i].record_bytes; o += 64)
                s ^= pk->copy[pk->elayers[i].first_offset + o];
        (void)s;
    }
    if (eng->pack && !eng->pack->copy) {
        volatile uint8_t s = 0;
        if (!eng->xs)
            for (uint64_t o = 0; o < eng->pack->file_size; o += 4096) s ^= eng->pack->map[o];
        else
            for (int t = 0; t < eng->pack->n_tensors; t++)
                for (uint64_t o = 0; o < eng->pack->tensors[t].bytes + eng->pack->tensors[t].scale_bytes; o += 4096)
                    s ^= eng->pack->map[eng->pack->tensors[t].offset + (o < eng->pack->tensors[t].bytes ? o : 0)];
        (void)s;
    }
    /* SSD bandwidth: probed before and after the timed decode (a shared disk varies); the best
     * probe is used, which gives the lowest floor and so the most conservative ratio. */
    if (draft_set) {
        bd.prompt = prompt;
        bd.tokens = steps + 1;
        bd.rounds = rounds;
        bd.batch = (int)batch;
        bd.golden = golden;
        bd.json = json;
        return cli_engine_close("bench", eng, bench_draft(eng, &bd));
    }
    double ssd_gbs = eng->xs ? plan_ssd_probe(eng, 16, 2ull << 30, 60.0) : 0;

    petrel_session *s;
    int rc = 0;
    if (petrel_session_create(eng, (int)(ctx + steps + 2), &s, &err)) { petrel_engine_close(eng); return cli_fail_err("bench", &err); }
    int V = c->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)V);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx);
    if (!lg || !ids) {
        free(lg), free(ids), petrel_session_free(s), petrel_engine_close(eng);
        return cli_fail("bench: out of memory for a prompt of %ld tokens", ctx);
    }
    uint64_t x = BENCH_SEED;
    random_ids(ids, ctx, V, &x);
    /* Prefill: the median of several runs on the same prompt (a shared machine's noise only
     * ever slows a run down); its per-part breakdown is reported with it. */
    if (eng->xs) prefill_runs = 1;
    xs_stats xp0 = {0};
    uint64_t prefill_reads = 0;
    if (eng->xs) xs_store_stats(eng->xs, &xp0);
    double pre_s[100], prefill_s = 0;
    fwd_stats pre_st[100], pst;
    memset(&pst, 0, sizeof pst);
    if (profile && eng->cu) cu_model_profile(eng->cu, 1);
    static kn_prof pprof; /* --profile on the CPU: the last prefill run's products */
    unsigned long long pp_jobs0 = 0, pp_tail0 = 0, pp_jobs1 = 0, pp_tail1 = 0;
    for (long r = 0; r < prefill_runs && !rc; r++) {
        if (r && petrel_session_truncate(s, 0, &err)) { rc = cli_fail_err("bench", &err); break; }
        memset(&s->stats, 0, sizeof s->stats);
        int prof_run = profile && !eng->cu && r == prefill_runs - 1;
        if (prof_run) {
            memset(&pprof, 0, sizeof pprof);
            pool_stats(kn_pool(), &pp_jobs0, &pp_tail0);
            kn_set_profile(&pprof);
        }
        uint64_t t0 = pt_now_ns();
        if (petrel_session_forward(s, ids, (int)prompt, lg, 0, &err)) rc = cli_fail_err("bench", &err);
        pre_s[r] = (double)(pt_now_ns() - t0) / 1e9;
        pre_st[r] = s->stats;
        if (prof_run) {
            kn_set_profile(NULL);
            pool_stats(kn_pool(), &pp_jobs1, &pp_tail1);
        }
    }
    double gpu_ex_ms = 0; /* the prefill runs' routed-expert kernel time (GPU, profiled) */
    if (profile && eng->cu && !rc) {
        char rep[2048];
        gpu_ex_ms = cu_model_profile_experts_ms(eng->cu);
        cu_model_profile_report(eng->cu, rep, sizeof rep);
        cu_model_profile(eng->cu, 0);
        printf("GPU kernel time by part, summed over the %ld prefill runs of %ld tokens (profiled: a little slower):\n%s", prefill_runs, prompt, rep);
    }
    double prefill_best = 0;
    if (!rc) {
        int order[100];
        for (int r = 0; r < prefill_runs; r++) order[r] = r;
        for (int a = 1; a < prefill_runs; a++) /* insertion sort by time */
            for (int b = a; b > 0 && pre_s[order[b]] < pre_s[order[b - 1]]; b--) {
                int t = order[b]; order[b] = order[b - 1]; order[b - 1] = t;
            }
        int med = order[(prefill_runs - 1) / 2];
        prefill_s = pre_s[med];
        pst = pre_st[med];
        prefill_best = pre_s[order[0]];
    }
    double pfx_s = -1;
    int pfx_got = 0, pfx_same = 0;
    if (!rc && prefix_reuse) { /* the prefix cache: a new session with the same prompt takes its pages */
        petrel_session *t = NULL;
        float *l2 = malloc(sizeof(float) * (size_t)V);
        if (!l2 || petrel_session_prefix_put(s, &err) < 0 || petrel_session_create(eng, (int)(ctx + 2), &t, &err)) rc = cli_fail_err("bench", &err);
        uint64_t t0 = pt_now_ns();
        if (!rc && (pfx_got = petrel_session_prefix_get(t, ids, (int)prompt - 1, &err)) < 0) rc = cli_fail_err("bench", &err);
        if (!rc && petrel_session_forward(t, ids + pfx_got, (int)prompt - pfx_got, l2, 0, &err)) rc = cli_fail_err("bench", &err);
        pfx_s = (double)(pt_now_ns() - t0) / 1e9;
        if (!rc) pfx_same = !memcmp(lg, l2, sizeof(float) * (size_t)V);
        if (!rc)
            printf("prefix cache: a new session of the same %ld-token prompt took %d tokens from the cache and ran %ld: first token's logits after "
                   "%.3f s instead of %.3f s (%.1fx), bitwise %s\n",
                   prompt, pfx_got, prompt - pfx_got, pfx_s, prefill_s > 0 ? prefill_s : pre_s[0], pfx_s > 0 ? (prefill_s > 0 ? prefill_s : pre_s[0]) / pfx_s : 0,
                   pfx_same ? "the same" : "DIFFERENT");
        petrel_session_free(t);
        free(l2);
    }
    double peak = 0, peak_int8 = 0, amx_peak = 0, expert_gflops = 0, expert_peak_frac = 0;
    if (!rc) {
        if (prefill_runs > 1) {
            printf("prefill: %ld tokens in %.2f s = %.1f tok/s (median of %ld runs; best %.1f tok/s; runs", prompt, prefill_s,
                   (double)prompt / prefill_s, prefill_runs, (double)prompt / prefill_best);
            for (long r = 0; r < prefill_runs; r++) printf(" %.2f", pre_s[r]);
            printf(" s, the first also pays for first-touch of the session's scratch)\n");
        } else
            printf("prefill: %ld tokens in %.2f s = %.1f tok/s\n", prompt, prefill_s, (double)prompt / prefill_s);
        if (eng->xs) {
            xs_stats xp1;
            xs_store_stats(eng->xs, &xp1);
            double busy = (double)(xp1.io_busy_ns - xp0.io_busy_ns) / 1e9;
            prefill_reads = xp1.reads - xp0.reads;
            printf("prefill expert reads: %" PRIu64 " (%.2f GB; chunks of %d rows, layer-major spans of %d), I/O wait %.2f s, disk busy %.2f s (%.2f GB/s while busy)\n",
                   xp1.reads - xp0.reads, (double)(xp1.bytes_read - xp0.bytes_read) / 1e9, s->max_batch, s->pf.rows,
                   (double)(xp1.io_wait_ns - xp0.io_wait_ns) / 1e9, busy,
                   busy > 0 ? (double)(xp1.bytes_read - xp0.bytes_read) / busy / 1e9 : 0);
        }
        /* the routed-expert products of the prefill against the machine's f32 FMA peak */
        int n_moe = 0;
        for (int l = 0; l < c->num_hidden_layers; l++) n_moe += c->layer_is_moe[l];
        double ex_flop = 2.0 * (double)prompt * c->num_experts_per_tok * 3.0 * c->hidden_size * (double)c->moe_intermediate_size * n_moe;
        double ex_s = (double)pst.ns[FS_EXPERTS] / 1e9;
        if (eng->cu) { /* on the GPU: the profiled expert kernels against the measured int8 tensor-core peak */
            double tc = cu_tc_int8_peak(eng->cu), gex_s = gpu_ex_ms / 1e3 / (double)prefill_runs;
            expert_gflops = gex_s > 0 ? ex_flop / gex_s / 1e9 : 0;
            amx_peak = 0, peak = 0, peak_int8 = tc * 1e3;
            expert_peak_frac = peak_int8 > 0 && expert_gflops > 0 ? expert_gflops / peak_int8 : 0;
            if (gex_s > 0)
                printf("prefill routed experts (GPU kernels): %.1f TOP/s = %.1f%% of the measured int8 tensor-core peak (%.0f TOP/s)\n", expert_gflops / 1e3,
                       100 * expert_peak_frac, tc);
            else
                printf("prefill routed experts (GPU): their kernel time needs --profile; the int8 tensor-core peak measured %.0f TOP/s\n", tc);
            if (bf16_experts != 0 && gex_s > 0) { /* the bf16 forms (wgmma the default) run the products in bf16: that format's peak too */
                double tb = cu_tc_bf16_peak(eng->cu);
                printf("prefill routed experts (GPU, bf16 products): %.1f%% of the measured bf16 tensor-core peak (%.0f TFLOP/s, wgmma)\n",
                       tb > 0 ? 100 * expert_gflops / 1e3 / tb : 0, tb);
            }
            /* the whole prompt: its products and attention (prompt_flops) over the median prefill */
            const double pf = prompt_flops(c, prompt), tb = cu_tc_bf16_peak(eng->cu);
            if (prefill_s > 0 && tb > 0)
                printf("prefill on the GPU: %.1f TFLOP/s over its products and attention (%.3f TFLOP a prompt) = %.1f%% of the measured bf16 tensor-core "
                       "peak (%.0f TFLOP/s)\n", pf / prefill_s / 1e12, pf / 1e12, 100 * pf / prefill_s / 1e12 / tb, tb);
        } else {
            peak = measure_peak_gflops(threads, 0);
            expert_gflops = ex_s > 0 ? ex_flop / ex_s / 1e9 : 0;
            /* the products run on int8 VNNI when the experts are q4/q8 and the CPU has it: that
             * peak is the one they are held to (this CPU has no AMX) */
            const pt_wview *ev = NULL;
            for (int l = 0; l < c->num_hidden_layers && !ev; l++)
                if (eng->w.layers[l].is_moe && eng->w.layers[l].exp_gate) ev = &eng->w.layers[l].exp_gate[0];
            int on_int8 = ev && (ev->layout == PT_LAYOUT_R16 || kt_act_quant_active(&eng->kt, ev));
            peak_int8 = on_int8 ? measure_peak_gflops(threads, 1) : 0;
            /* with AMX-INT8 in the engine's table, R16 expert batches of enough rows run on the
             * tiles: the AMX int8 peak of the same threads is the one they are held to */
            amx_peak = on_int8 && eng->kt.amx == 1 && ev->layout == PT_LAYOUT_R16 ? 2 * kn_amx_peak_macs(threads) / 1e9 : 0;
            double ref_peak = amx_peak > 0 ? amx_peak : on_int8 && peak_int8 > 0 ? peak_int8 : peak;
            expert_peak_frac = ref_peak > 0 ? expert_gflops / ref_peak : 0;
            if (amx_peak > 0)
                printf("prefill routed experts: %.1f GFLOP/s = %.1f%% of the measured AMX int8 peak (%.0f GOP/s, %d threads; int8 VNNI peak %.0f GOP/s, f32 FMA peak %.0f GFLOP/s)\n",
                       expert_gflops, 100 * expert_peak_frac, amx_peak, threads, peak_int8, peak);
            else
                printf("prefill routed experts: %.1f GFLOP/s = %.1f%% of the measured %s peak (%.0f G%s/s, %d threads; f32 FMA peak %.0f GFLOP/s; %s)\n",
                       expert_gflops, 100 * expert_peak_frac, on_int8 && peak_int8 > 0 ? "int8 VNNI" : "AVX-512 f32 FMA", ref_peak,
                       on_int8 && peak_int8 > 0 ? "OP" : "FLOP", threads, peak, kn_amx_available() ? "AMX not in this kernel set" : "no AMX on this CPU");
        }
        fflush(stdout);
    }
    if (!rc && ctx > prompt && petrel_session_forward(s, ids + prompt, (int)(ctx - prompt), lg, 0, &err)) rc = cli_fail_err("bench", &err);
    /* two untimed steps, then the timed ones */
    int32_t tok = ids[ctx - 1];
    /* Memory bandwidth is probed right before every timed step (one pass over the probe buffer):
     * on a shared machine it drifts by 2x within seconds, so each step is paired with the
     * bandwidth of its moment (best of three short passes) and the ratio is the median of the
     * per-step ratios. The unpaired ratio (median step / floor at the median bandwidth) is
     * reported beside it. */
    size_t bw_n = ((size_t)bw_mib << 20) / 8;
    uint64_t *bw_buf = rc ? NULL : bw_buffer(bw_n * 8);
    double *step_ms = calloc((size_t)steps, sizeof(double)), *step_bw = calloc((size_t)steps, sizeof(double)),
           *step_ratio = calloc((size_t)steps, sizeof(double));
    if (!rc && (!step_ms || !step_bw || !step_ratio || !bw_buf)) rc = cli_fail("bench: out of memory");
    if (!rc) plan_bw_pass(bw_buf, bw_n, threads, 1); /* page-in */
    xs_stats xs0 = {0}, xs1 = {0};
    cu_tier_stats ct0 = {0}, ct1 = {0};
    static kn_prof kprof, bprof; /* --profile on the CPU: the timed steps' products, one session's and the batch's */
    unsigned long long pool_jobs0 = 0, pool_tail0 = 0, pool_jobs1 = 0, pool_tail1 = 0;
    double gpu_bw = 0;
    for (int k = 0; !rc && k < 2 + steps; k++) { /* ctx + 2 + steps tokens in all */
        if (k == 2) {
            memset(&s->stats, 0, sizeof s->stats);
            if (eng->xs) xs_store_stats(eng->xs, &xs0);
            if (eng->cu) cu_model_tier_stats(eng->cu, &ct0);
            if (profile && eng->cu) cu_model_profile(eng->cu, 1);
            if (profile && !eng->cu) {
                memset(&kprof, 0, sizeof kprof);
                pool_stats(kn_pool(), &pool_jobs0, &pool_tail0);
            }
        }
        /* on the GPU: HBM, before the first timed step and after the last (below): a probe between
         * steps (1 GB allocated, read and freed) slowed the step after it by ~0.22 ms on an H100
         * (RESULTS 2026-12-07 21:15), and an HBM's bandwidth does not drift like a shared VM's memory */
        if (k == 2 && eng->cu) gpu_bw = cu_hbm_probe(eng->cu, 1ull << 30);
        else if (k >= 2 && !eng->cu) /* best of 3 passes, each over a quarter of a large buffer (~5 ms a pass),
                          * of the three kinds of plan_bw_pass: two streams, every other line, every line */
            for (int rep = 0, parts = bw_mib >= 1024 ? 4 : 1; rep < 3; rep++) {
                double g = plan_bw_pass(bw_buf + (size_t)(rep % parts) * (bw_n / (size_t)parts), bw_n / (size_t)parts, threads, (2 + rep) % 3);
                if (g > step_bw[k - 2]) step_bw[k - 2] = g;
            }
        uint64_t ts = pt_now_ns();
        if (k >= 2 && profile && !eng->cu) kn_set_profile(&kprof); /* the steps only, not the probes */
        int frc = petrel_session_forward(s, &tok, 1, lg, 0, &err);
        kn_set_profile(NULL);
        if (frc) { rc = cli_fail_err("bench", &err); break; }
        if (k >= 2) step_ms[k - 2] = (double)(pt_now_ns() - ts) / 1e6;
        tok = (int32_t)kn_argmax(lg, V);
    }
    if (!rc && eng->cu) {
        double b = cu_hbm_probe(eng->cu, 1ull << 30);
        if (b > gpu_bw) gpu_bw = b;
        for (long i = 0; i < steps; i++) step_bw[i] = gpu_bw;
    }
    if (profile && !eng->cu) pool_stats(kn_pool(), &pool_jobs1, &pool_tail1);
    /* the single session's store statistics end here, before any batched steps */
    if (eng->xs) xs_store_stats(eng->xs, &xs1);
    if (eng->cu) cu_model_tier_stats(eng->cu, &ct1);
    if (profile && eng->cu && !rc) {
        char rep[2048];
        cu_model_profile_report(eng->cu, rep, sizeof rep);
        cu_model_profile(eng->cu, 0);
        printf("GPU kernel time by part, summed over the %ld timed decode steps (profiled steps run a little slower):\n%s", steps, rep);
    }
    batch_result br = {0};
    if (!rc && batch > 0) {
        if (profile && !eng->cu) memset(&bprof, 0, sizeof bprof);
        if (bench_batch(eng, (int)batch, ctx, steps, resident + head, expert1, bw_buf, bw_n, bw_mib, threads, profile && !eng->cu ? &bprof : NULL, &br,
                        &err))
            rc = cli_fail_err("bench", &err);
    }
    if (!rc) {
        double mean_ms = 0;
        for (long i = 0; i < steps; i++) mean_ms += step_ms[i] / (double)steps;
        double *sorted_bw = malloc(sizeof(double) * (size_t)steps);
        if (sorted_bw) memcpy(sorted_bw, step_bw, sizeof(double) * (size_t)steps);
        else sorted_bw = step_bw;
        qsort(sorted_bw, (size_t)steps, sizeof(double), cmp_double);
        double bw = sorted_bw[steps / 2], bw_lo = sorted_bw[0], bw_hi = sorted_bw[steps - 1];
        if (sorted_bw != step_bw) free(sorted_bw);
        double floor_ms = (double)bytes_tok / (bw * 1e9) * 1e3;
        double hit_rate = 1, miss_bytes_tok = 0, ssd_seen_gbs = 0, ssd_probe_gbs = 0, route_pol = -1, route_bel = -1;
        if (eng->xs) {
            double ssd1 = plan_ssd_probe(eng, 16, 2ull << 30, 60.0);
            if (ssd1 > ssd_gbs) ssd_gbs = ssd1;
            /* The store's own reads during decode are a lower bound on what the disk can do
             * (bytes over the time any read was in progress): a probe that ran while the shared
             * disk was slow must not make the floor lower than what decode itself got. */
            double busy_s = (double)(xs1.io_busy_ns - xs0.io_busy_ns) / 1e9;
            ssd_seen_gbs = busy_s > 0 ? (double)(xs1.bytes_read - xs0.bytes_read) / busy_s / 1e9 : 0;
            ssd_probe_gbs = ssd_gbs;
            if (ssd_seen_gbs > ssd_gbs) ssd_gbs = ssd_seen_gbs;
            /* a hit is an expert that needed no read for this token (a prefetch that was used
             * still cost a read: it counts with the misses here) */
            uint64_t acc = xs1.accesses - xs0.accesses, reads = (xs1.misses - xs0.misses) + (xs1.prefetch_used - xs0.prefetch_used);
            hit_rate = acc ? 1.0 - (double)reads / (double)acc : 1;
            /* SSD bytes the token needed: demand misses plus prefetches that were used (wasted
             * prefetch reads are overhead, not floor) */
            uint64_t roff = 0, rec = 0, rh;
            for (int l = 0; l < c->num_hidden_layers && !rec; l++)
                if (eng->moe_index[l] >= 0) pack_expert_record(eng->pack, l, 0, &roff, &rec, &rh);
            miss_bytes_tok = (double)((xs1.misses - xs0.misses) + (xs1.prefetch_used - xs0.prefetch_used)) * (double)rec / (double)steps;
            char la_text[256];
            int lo = 0;
            la_text[0] = 0;
            for (int m = 0; m < eng->n_moe && m < 4; m++) {
                lo += snprintf(la_text + lo, sizeof la_text - (size_t)lo, "%s", m ? " / " : "");
                for (int k = 0; k < c->num_experts_per_tok && lo < (int)sizeof la_text - 8; k++)
                    lo += snprintf(la_text + lo, sizeof la_text - (size_t)lo, "%s%.2f", k ? " " : "", xs_la_precision(eng->xs, m)[k]);
            }
            double ssd_ms = ssd_gbs > 0 ? miss_bytes_tok / (ssd_gbs * 1e9) * 1e3 : 0;
            if (ssd_ms > floor_ms) floor_ms = ssd_ms;
            printf("expert store: %d slots/layer, %s%s; hit rate %.1f%%, %.1f experts/token read because needed (%.1f MB; demand misses and the layer's own reads ahead), I/O wait %.2f ms/token, "
                   "disk busy %.2f ms/token, prefetch %" PRIu64 " issued / %" PRIu64 " used / %" PRIu64 " wasted / %" PRIu64 " cancelled; lookahead precision by rank (first MoE layers) %s\n",
                   xs_store_slots(eng->xs), xs_store_uring(eng->xs) ? "io_uring" : "pread", xs_store_direct(eng->xs) ? " + O_DIRECT" : "",
                   100 * hit_rate, (double)reads / (double)steps, miss_bytes_tok / 1e6,
                   (double)(xs1.io_wait_ns - xs0.io_wait_ns) / 1e6 / (double)steps,
                   (double)(xs1.io_busy_ns - xs0.io_busy_ns) / 1e6 / (double)steps, xs1.prefetch_issued - xs0.prefetch_issued,
                   xs1.prefetch_used - xs0.prefetch_used, xs1.prefetch_wasted - xs0.prefetch_wasted,
                   xs1.prefetch_cancelled - xs0.prefetch_cancelled, la_text);
            if (eng->route) {
                double rp = 0, rl = 0, rb = 0;
                if (route_replay(eng, ctx + 2, steps, xs_store_slots(eng->xs), &rp, &rl, &rb, &err)) rc = cli_fail_err("bench", &err);
                else printf("route trace: decode hit rate %.1f%%; offline replay of the same tokens at %d slots: policy %.1f%%, LRU %.1f%%, Belady %.1f%%\n",
                            100 * hit_rate, xs_store_slots(eng->xs), 100 * rp, 100 * rl, 100 * rb);
                route_pol = rp;
                route_bel = rb;
            }
            printf("ssd read bandwidth: %.2f GB/s = the better of a probe (%.2f GB/s: random expert records through the store's own I/O pool, best of one before and one after decode) and the store's own reads during decode (%.2f GB/s while busy); floor = max(%.2f ms SSD, %.2f ms memory)\n",
                   ssd_gbs, ssd_probe_gbs, ssd_seen_gbs, ssd_ms, (double)bytes_tok / (bw * 1e9) * 1e3);
        }
        /* the GPU's expert tiers: what came over PCIe per token, against the link's measured
         * bandwidth (pinned host memory to HBM) */
        double pcie_gbs = 0, pcie_ms = 0, tier_hit = 1, tier_mb = 0, tier_copies = 0, tier_copy_ms = 0, tier_host = 0;
        if (ct1.slots) {
            pcie_gbs = cu_h2d_probe(eng->cu, 256ull << 20);
            uint64_t uses = ct1.uses - ct0.uses, copies = ct1.copies - ct0.copies;
            tier_mb = (double)(ct1.bytes - ct0.bytes) / 1e6 / (double)steps;
            tier_copies = (double)copies / (double)steps;
            tier_copy_ms = (double)(ct1.copy_ns - ct0.copy_ns) / 1e6 / (double)steps;
            pcie_ms = pcie_gbs > 0 ? tier_mb * 1e6 / (pcie_gbs * 1e9) * 1e3 : 0;
            double host_x = (double)(ct1.host - ct0.host) / (double)steps, host_ms = (double)(ct1.host_ns - ct0.host_ns) / 1e6 / (double)steps;
            tier_hit = uses ? (double)(ct1.hits - ct0.hits) / (double)uses : 1;
            printf("GPU expert tiers: %d HBM slots/layer; HBM hit rate %.1f%%, %.1f experts/token copied from the host (%.1f MB), %.2f ms/token issuing%s "
                   "them; %.1f experts/token computed on the host CPU instead (%.2f ms/token); the link: %.1f GB/s (pinned host to HBM, probed); "
                   "PCIe floor %.2f ms/token\n",
                   ct1.slots, 100 * tier_hit, tier_copies, tier_mb, tier_copy_ms, eng->xs ? ", reading and waiting for" : "", host_x, host_ms, pcie_gbs, pcie_ms);
            tier_host = host_x;
            if (eng->route) { /* the HBM tier against the offline replay of the same tokens at its slots */
                double rp = 0, rl = 0, rb = 0;
                if (route_replay(eng, ctx + 2, steps, ct1.slots, &rp, &rl, &rb, &err)) rc = cli_fail_err("bench", &err);
                else printf("route trace: HBM hit rate %.1f%%; offline replay of the same tokens at %d slots: policy %.1f%%, LRU %.1f%%, Belady %.1f%%\n",
                            100 * tier_hit, ct1.slots, 100 * rp, 100 * rl, 100 * rb);
                if (!eng->xs) route_pol = rp, route_bel = rb;
            }
            if (pcie_ms > floor_ms) floor_ms = pcie_ms;
        }
        /* per step: its time over the floor of its moment (memory floor from the probe right
         * before it; the SSD floor from the run's SSD probe; the GPU tiers' PCIe floor) */
        double ssd_floor_ms = eng->xs && ssd_gbs > 0 ? miss_bytes_tok / (ssd_gbs * 1e9) * 1e3 : 0;
        if (pcie_ms > ssd_floor_ms) ssd_floor_ms = pcie_ms;
        for (long i = 0; i < steps; i++) {
            double f = (double)bytes_tok / (step_bw[i] * 1e9) * 1e3;
            step_ratio[i] = step_ms[i] / (f > ssd_floor_ms ? f : ssd_floor_ms);
        }
        qsort(step_ratio, (size_t)steps, sizeof(double), cmp_double);
        qsort(step_ms, (size_t)steps, sizeof(double), cmp_double);
        double dms = step_ms[steps / 2], min_ms = step_ms[0]; /* median: robust to a shared machine */
        double ratio = step_ratio[steps / 2], pf = (double)prompt / prefill_s, ratio_unpaired = dms / floor_ms;
        if (eng->cu) {
            const char *when = "the better of the probes before the first and after the last step";
            printf("decode steps: median %.2f ms, mean %.2f ms, min %.2f ms, max %.2f ms; HBM read bandwidth %.1f GB/s (%s); "
                   "per-step floor ratio %.2f..%.2f\n",
                   dms, mean_ms, min_ms, step_ms[steps - 1], bw, when, step_ratio[0], step_ratio[steps - 1]);
            printf("memory read bandwidth: %.1f GB/s (HBM, %s, 1024 MiB buffer)\n", bw, when);
        } else {
            printf("decode steps: median %.2f ms, mean %.2f ms, min %.2f ms, max %.2f ms; memory bandwidth before each step %.1f..%.1f GB/s "
                   "(median %.1f); per-step floor ratio %.2f..%.2f\n",
                   dms, mean_ms, min_ms, step_ms[steps - 1], bw_lo, bw_hi, bw, step_ratio[0], step_ratio[steps - 1]);
            printf("memory read bandwidth: %.1f GB/s (median of the probes before each step, %d threads, %ld MiB buffer)\n", bw, threads, bw_mib);
        }
        printf("bytes per decode token: %.1f MB (resident %.1f MB + routed experts %.1f MB + head %.1f MB + latent KV %.2f MB)\n", bytes_tok / 1e6,
               resident / 1e6, experts / 1e6, head / 1e6, kv_step / 1e6);
        printf("decode at context %ld: %.2f ms/token = %.2f tok/s; floor %.2f ms; decode_floor_ratio %.2f (median of per-step ratios)\n", ctx, dms,
               1e3 / dms, floor_ms, ratio);
        if (batch > 0)
            printf("batched decode: %ld sessions at context %ld: %.2f ms/step = %.1f tok/s aggregate (%.2fx one session), %.2f ms/row; %.1f experts/step "
                   "(union of the rows' choices; %.1f per layer), %.1f MB/step; floor ratio of the step %.2f (median; bandwidth %.1f GB/s)\n",
                   batch, ctx, br.step_ms, br.tok_s, br.tok_s * dms / 1e3, br.row_ms, br.experts_step,
                   br.experts_step / (n_moe ? n_moe : 1), br.bytes_step / 1e6,
                   br.floor_ratio, br.bw);
        if (batch > 0 && br.speedup_paired > 0)
            printf("batched decode, paired: %.2fx one session (median over the steps of %ld x the step of one more session run right after "
                   "each batched step / the batched step: the same moment, whatever the machine's drift)\n",
                   br.speedup_paired, batch);
        if (batch > 0 && eng->xs)
            printf("batched decode, streamed: %.1f expert records read per step (%.1f per row); the floor ratio above is against memory only\n",
                   br.reads_step, br.reads_step / (double)batch);
        if (batch > 0) {
            printf("batched step by part (ms):");
            for (int p = 0; p < FS_COUNT; p++) printf(" %s %.2f%s", fwd_part_names[p], br.part_ms[p], p + 1 < FS_COUNT ? "," : "\n");
        }
        printf("%-16s %12s %12s\n", "part", "decode ms/tok", "prefill ms");
        for (int p = 0; p < FS_COUNT; p++)
            printf("%-16s %12.3f %12.1f\n", fwd_part_names[p], (double)s->stats.ns[p] / 1e6 / (double)steps, (double)pst.ns[p] / 1e6);
        if (eng->cu) printf("(on the GPU a forward is one stream: all of it counts as \"other\" here; --profile splits it by part)\n");
        double dns[FS_COUNT];
        for (int p = 0; p < FS_COUNT; p++) dns[p] = (double)s->stats.ns[p];
        if (profile && !eng->cu && prefill_runs > 0 && prompt > 0) { /* the last prefill run (profiled: a little slower) */
            double pns[FS_COUNT];
            const fwd_stats *lst = &pre_st[prefill_runs - 1];
            for (int p = 0; p < FS_COUNT; p++) pns[p] = (double)lst->ns[p];
            printf("(the prefill below: its last run, %.3f s; GB/s are weight bytes over the product's time, not a bound here)\n", pre_s[prefill_runs - 1]);
            print_cpu_profile(eng, &pprof, "prefill run", pns, 1, bw, 0, (double)(pp_jobs1 - pp_jobs0), (double)(pp_tail1 - pp_tail0),
                              pre_s[prefill_runs - 1] * 1e3);
        }
        if (profile && !eng->cu)
            print_cpu_profile(eng, &kprof, "decode step", dns, steps, bw, kv_step, (double)(pool_jobs1 - pool_jobs0), (double)(pool_tail1 - pool_tail0), dms);
        if (profile && !eng->cu && batch > 0) {
            double pns[FS_COUNT];
            for (int p = 0; p < FS_COUNT; p++) pns[p] = br.part_ms[p] * 1e6 * (double)steps;
            print_cpu_profile(eng, &bprof, "batched step", pns, steps, br.bw, kv_step * (uint64_t)batch, (double)br.pool_jobs,
                              (double)br.pool_tail_ns, br.step_ms);
        }
        if (json) {
            printf("{\"open_s\": %.3f, \"decode_ms\": %.4f, \"decode_tok_s\": %.4f, \"prefill_tok_s\": %.3f, \"prefill_best_tok_s\": %.3f, \"prefill_runs\": %ld, \"bytes_per_token\": %" PRIu64
                   ", \"mem_bw_gbs\": %.3f, \"decode_floor_ratio\": %.4f, \"decode_floor_ratio_unpaired\": %.4f, \"floor_ms\": %.4f, \"ctx\": %ld, \"prompt\": %ld, \"steps\": %ld, "
                   "\"decode_mean_ms\": %.4f, \"decode_min_ms\": %.4f, \"threads\": %d, \"isa\": \"%s\", \"cpu\": \"%s\", \"cores\": %ld, "
                   "\"expert_hit_rate\": %.5f, \"ssd_bw_gbs\": %.3f, \"ssd_probe_gbs\": %.3f, \"ssd_seen_gbs\": %.3f, \"miss_bytes_per_token\": %.0f, \"prefill_expert_gflops\": %.2f, \"fma_peak_gflops\": %.1f, \"int8_peak_gops\": %.1f, \"amx_peak_gops\": %.1f, \"prefill_expert_peak_fraction\": %.4f, \"prefill_expert_reads\": %" PRIu64 ", \"prefill_chunk\": %d, \"prefill_span\": %d, \"decode_breakdown_ms\": {",
                   open_s, dms, 1e3 / dms, pf, prefill_best > 0 ? (double)prompt / prefill_best : 0, prefill_runs, bytes_tok, bw, ratio, ratio_unpaired, floor_ms, ctx, prompt, steps, mean_ms, min_ms, threads, kt_isa_name(&eng->kt), cpu, cores,
                   hit_rate, ssd_gbs, ssd_probe_gbs, ssd_seen_gbs, miss_bytes_tok, expert_gflops, peak, peak_int8, amx_peak, expert_peak_frac, prefill_reads,
                   s->max_batch, s->pf.rows);
            for (int p = 0; p < FS_COUNT; p++) printf("%s\"%s\": %.4f", p ? ", " : "", fwd_part_names[p], (double)s->stats.ns[p] / 1e6 / (double)steps);
            printf("}, \"batch\": %ld, \"batch_step_ms\": %.4f, \"batch_tok_s\": %.3f, \"batch_speedup\": %.4f, \"batch_row_ms\": %.4f, \"batch_experts_per_step\": %.2f, "
                   "\"batch_bytes_per_step\": %.0f, \"batch_floor_ratio\": %.4f, \"batch_expert_reads_per_step\": %.2f, \"batch_speedup_paired\": %.4f",
                   batch, br.step_ms, br.tok_s, batch ? br.tok_s * dms / 1e3 : 0, br.row_ms, br.experts_step, br.bytes_step, br.floor_ratio, br.reads_step,
                   br.speedup_paired);
            printf(", \"batch_breakdown_ms\": {");
            for (int p = 0; p < FS_COUNT; p++) printf("%s\"%s\": %.4f", p ? ", " : "", fwd_part_names[p], br.part_ms[p]);
            printf("}");
            if (route_pol >= 0) printf(", \"route_replay_hit_rate\": %.5f, \"route_replay_belady\": %.5f", route_pol, route_bel);
            if (ct1.slots)
                printf(", \"gpu_expert_slots\": %d, \"gpu_hbm_hit_rate\": %.5f, \"gpu_copies_per_token\": %.3f, \"gpu_copy_mb_per_token\": %.3f, "
                       "\"gpu_copy_ms_per_token\": %.4f, \"gpu_host_experts_per_token\": %.3f, \"pcie_gbs\": %.3f",
                       ct1.slots, tier_hit, tier_copies, tier_mb, tier_copy_ms, tier_host, pcie_gbs);
            printf(", \"prefill_breakdown_ms\": {");
            for (int p = 0; p < FS_COUNT; p++) printf("%s\"%s\": %.3f", p ? ", " : "", fwd_part_names[p], (double)pst.ns[p] / 1e6);
            printf("}, \"cpu_amx\": %s, \"prefetch_bytes\": %d, \"prefetch_l2\": %d, \"prefetch_all_lines\": %d, \"device\": \"", cpu_has_amx() ? "true" : "false",
                   eng->kt.pf_bytes, eng->kt.pf_l2, eng->kt.pf_all);
            for (const char *d = petrel_engine_device(eng); *d; d++) /* "cpu" or the GPU's line */
                if (*d == '"' || *d == '\\') printf("\\%c", *d);
                else if ((unsigned char)*d >= 0x20) putchar(*d);
            printf("\"}\n");
        }
    }
    free(step_ms);
    free(step_bw);
    free(step_ratio);
    free(bw_buf);
    free(lg);
    free(ids);
    petrel_session_free(s);
    rc = cli_engine_close("bench", eng, rc);
    return rc;
}
