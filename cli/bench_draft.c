/* bench_draft.c: `petrel bench --draft K|auto`: decode with and without speculative drafting in
 * the same run, alternating (round r runs plain then drafting, the next round the other way
 * round, so a drifting machine hits both alike). Each round decodes N tokens after each prompt
 * (the golden set's prompts, or B random prompts of --prompt tokens) greedily, B sessions at a
 * time (B > 1: one batch forward per step for all of them, plain or drafting); prefill and the
 * first token are not timed. Reports tok/s of both, their ratio per round and the median,
 * tokens per verify step, acceptance per draft position, the ms of a step by draft count, and the
 * cost of a step with k drafts over a plain decode step. --oracle-accept P (random-weight
 * models, whose MTP agrees with nothing): each draft is accepted with probability P instead of
 * being checked, so the verify cost of real shapes at a given acceptance can be measured; the
 * decoded tokens are then not the model's. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/err.h"
#include "cli.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "runtime/sampler.h"
#include "runtime/spec.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int32_t amax(const float *l, int V) {
    int32_t b = 0;
    for (int v = 1; v < V; v++)
        if (l[v] > l[b]) b = v;
    return b;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct prompts {
    int32_t **ids;
    int *n, np;
} prompts;

/* Plain greedy: B sessions (prompt i % np), N tokens each; seconds of the N - 1 decode steps. */
static int run_plain(petrel_engine *eng, const prompts *P, int first, int B, long N, double *secs, long *steps, petrel_error *err) {
    int V = eng->cfg.vocab_size, rc = 0;
    petrel_session *ss[64] = {0};
    petrel_row rows[64];
    int32_t last[64];
    float *lg = malloc(sizeof(float) * (size_t)B * V);
    petrel_batch *b = NULL;
    if (!lg) return pt_err(err, PETREL_ENOMEM, "out of memory");
    if (B > 1) rc = petrel_batch_create(eng, B, &b, err);
    for (int i = 0; i < B && !rc; i++) {
        int p = (first + i) % P->np;
        rc = petrel_session_create(eng, P->n[p] + (int)N + 1, &ss[i], err);
        if (!rc) rc = petrel_session_forward(ss[i], P->ids[p], P->n[p], lg, 0, err);
        if (!rc) last[i] = amax(lg, V);
    }
    double t0 = now_s();
    for (long k = 1; k < N && !rc; k++) {
        if (B == 1) {
            rc = petrel_session_forward(ss[0], &last[0], 1, lg, 0, err);
            if (!rc) last[0] = amax(lg, V);
        } else {
            for (int i = 0; i < B; i++) rows[i] = (petrel_row){ss[i], last[i], 1};
            rc = petrel_batch_forward(b, rows, B, lg, err);
            for (int i = 0; i < B && !rc; i++) last[i] = amax(lg + (size_t)i * V, V);
        }
        ++*steps;
    }
    *secs += now_s() - t0;
    for (int i = 0; i < B; i++) petrel_session_free(ss[i]);
    petrel_batch_free(b);
    free(lg);
    return rc;
}

static int run_spec(petrel_engine *eng, spec_ctx *c, const prompts *P, int first, int B, long N, double *secs, petrel_error *err) {
    int V = eng->cfg.vocab_size, rc = 0;
    petrel_session *ss[64] = {0};
    sampler smp[64];
    spec_seq q[64];
    int have[64] = {0}, got[64] = {0};
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 0;
    sp.penalty_last_n = 0;
    float *lg = malloc(sizeof(float) * (size_t)V);
    if (!lg) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int i = 0; i < B && !rc; i++) {
        int p = (first + i) % P->np;
        rc = petrel_session_create(eng, P->n[p] + (int)N + 1, &ss[i], err);
        if (!rc) rc = sampler_init(&smp[i], &sp, V, err);
        if (!rc) rc = spec_seq_init(&q[i], c, ss[i], &smp[i], NULL, 0, err);
        have[i] = !rc;
        if (!rc) rc = spec_feed(&q[i], P->ids[p], P->n[p], lg, err);
        if (!rc) spec_set_token(&q[i], amax(lg, V)), got[i] = 1;
    }
    double t0 = now_s();
    while (!rc) {
        spec_seq *run[64];
        int m = 0;
        for (int i = 0; i < B; i++)
            if (got[i] < N) {
                q[i].limit = (int)(N - got[i]);
                run[m++] = &q[i];
            }
        if (!m) break;
        rc = spec_step(c, run, m, err);
        for (int i = 0; i < B && !rc; i++)
            if (q[i].nout && got[i] < N) {
                got[i] += q[i].nout;
                spec_set_token(&q[i], q[i].out[q[i].nout - 1]);
                q[i].nout = 0;
            }
    }
    *secs += now_s() - t0;
    for (int i = 0; i < B; i++) {
        if (have[i]) {
            spec_seq_free(&q[i]);
            sampler_free(&smp[i]);
        }
        petrel_session_free(ss[i]);
    }
    free(lg);
    return rc;
}

int bench_draft(petrel_engine *eng, const bench_draft_opts *o) {
    petrel_error err = {0};
    const petrel_config *cfg = &eng->cfg;
    int V = cfg->vocab_size, B = o->batch > 0 ? o->batch : 1, rc = 0;
    if (B > 64) return cli_fail("bench: --draft with --batch: at most 64 sessions");
    spec_params dp = {.draft = o->draft, .oracle_accept = o->oracle, .oracle_seed = 1};
    if (spec_check(eng, &dp, &err)) return cli_fail_err("bench", &err);
    if (!eng->w.has_mtp) return cli_fail("bench: --draft: this model (%s) has no MTP layer to draft with", eng->path);
    prompts P = {0};
    st_set *g = NULL;
    if (o->golden) {
        if (st_open(o->golden, &g, &err)) return cli_fail_err("bench", &err);
        P.ids = calloc(64, sizeof *P.ids);
        P.n = calloc(64, sizeof *P.n);
        for (int pi = 0; pi < 64; pi++) {
            char nm[64];
            snprintf(nm, sizeof nm, "prompt_%d.ids", pi);
            const st_tensor *t = st_find(g, nm);
            if (!t) break;
            P.ids[P.np] = (int32_t *)t->data;
            P.n[P.np++] = (int)t->shape[0];
        }
        if (!P.np) { st_close(g); return cli_fail("bench: %s holds no prompt_N.ids", o->golden); }
    } else {
        P.np = B;
        P.ids = calloc((size_t)B, sizeof *P.ids);
        P.n = calloc((size_t)B, sizeof *P.n);
        uint64_t x = 12345;
        for (int i = 0; i < B; i++) {
            P.n[i] = (int)o->prompt;
            P.ids[i] = malloc(sizeof(int32_t) * (size_t)o->prompt);
            for (long k = 0; k < o->prompt; k++) {
                x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                P.ids[i][k] = (int32_t)((x >> 33) % (uint64_t)V);
            }
        }
    }
    spec_ctx *c = NULL;
    if (spec_create(eng, &dp, B, &c, &err)) rc = cli_fail_err("bench", &err);
    long R = o->rounds, N = o->tokens;
    double *rp = calloc((size_t)R, sizeof(double)), *rs = calloc((size_t)R, sizeof(double)), *rr = calloc((size_t)R, sizeof(double));
    long plain_steps = 0;
    double plain_s_all = 0;
    /* each round covers every prompt (B at a time) */
    int groups = o->golden ? (P.np + B - 1) / B : 1;
    printf("draft bench: %s, %d session%s per step, %ld tokens per prompt, %d prompt%s, %ld rounds%s\n", o->draft == SPEC_AUTO ? "--draft auto" : "",
           B, B > 1 ? "s" : "", N, o->golden ? P.np : B, (o->golden ? P.np : B) > 1 ? "s" : "", R,
           o->oracle > 0 ? " (oracle acceptance: tokens are not the model's)" : "");
    if (o->draft != SPEC_AUTO) printf("drafts per step: %d\n", o->draft);
    for (long r = 0; r < R && !rc; r++) {
        double ps = 0, ss = 0;
        long st0 = plain_steps;
        for (int pass = 0; pass < 2 && !rc; pass++) {
            int spec = (pass + (int)r) % 2 == 1;
            for (int gi = 0; gi < groups && !rc; gi++) {
                int first = gi * B, nb = B;
                if (o->golden && first + nb > P.np) nb = P.np - first;
                rc = spec ? run_spec(eng, c, &P, first, nb, N, &ss, &err) : run_plain(eng, &P, first, nb, N, &ps, &plain_steps, &err);
            }
        }
        if (rc) { cli_fail_err("bench", &err); break; }
        long toks = 0;
        for (int gi = 0; gi < groups; gi++) {
            int nb = B;
            if (o->golden && gi * B + nb > P.np) nb = P.np - gi * B;
            toks += (long)nb * (N - 1);
        }
        plain_s_all += ps;
        rp[r] = toks / ps;
        rs[r] = toks / ss;
        rr[r] = rs[r] / rp[r];
        printf("round %ld: plain %.2f tok/s (%.3f ms/step), drafting %.2f tok/s: %.3fx\n", r, rp[r], 1e3 * ps / (double)(plain_steps - st0), rs[r], rr[r]);
        fflush(stdout);
    }
    if (!rc) {
        const spec_stats *st = spec_get_stats(c);
        char js[2048];
        spec_stats_json(c, js, sizeof js);
        double plain_ms = 1e3 * plain_s_all / (double)plain_steps;
        qsort(rp, (size_t)R, sizeof(double), cmp_d);
        qsort(rs, (size_t)R, sizeof(double), cmp_d);
        qsort(rr, (size_t)R, sizeof(double), cmp_d);
        int kk = 0;
        for (int k = 0; k <= SPEC_MAX_DRAFT; k++)
            if (st->steps_k[k] > st->steps_k[kk]) kk = k;
        double kms = st->steps_k[kk] ? 1e3 * st->step_s[kk] / (double)st->steps_k[kk] : 0;
        printf("median: plain %.2f tok/s, drafting %.2f tok/s, speedup %.3fx (median of the rounds' ratios; range %.3f..%.3f)\n", rp[R / 2],
               rs[R / 2], rr[R / 2], rr[0], rr[R - 1]);
        printf("tokens per verify step %.3f; plain decode step %.3f ms; most used k = %d: %.3f ms per step (draft + verify) = %.3fx a plain step\n",
               st->steps ? (double)st->tokens / (double)st->steps : 0, plain_ms, kk, kms, kms / plain_ms);
        long nst = 0;
        for (int k = 0; k <= SPEC_MAX_DRAFT; k++) nst += st->steps_k[k];
        double vms = nst ? 1e3 * st->verify_s / (double)nst : 0, dms = nst ? 1e3 * st->draft_s / (double)nst : 0;
        printf("per drafting step (mean over %ld): verify forward %.3f ms = %.3fx a plain step, drafting %.3f ms = %.3fx\n", nst, vms, vms / plain_ms, dms,
               dms / plain_ms);
        printf("cost model: %s\n", spec_model_text(c));
        printf("stats: %s\n", js);
        if (o->json)
            printf("{\"plain_tok_s\": %.4f, \"draft_tok_s\": %.4f, \"speedup\": %.4f, \"speedup_min\": %.4f, \"speedup_max\": %.4f, \"plain_step_ms\": %.4f, "
                   "\"k_most\": %d, \"k_step_ms\": %.4f, \"k_step_over_plain\": %.4f, \"verify_over_plain\": %.4f, \"draft_over_plain\": %.4f, \"batch\": %d, \"tokens\": %ld, \"rounds\": %ld, \"spec\": %s}\n",
                   rp[R / 2], rs[R / 2], rr[R / 2], rr[0], rr[R - 1], plain_ms, kk, kms, kms / plain_ms, vms / plain_ms, dms / plain_ms, B, N, R, js);
    }
    spec_free(c);
    if (!o->golden)
        for (int i = 0; i < P.np; i++) free(P.ids[i]);
    free(P.ids);
    free(P.n);
    if (g) st_close(g);
    free(rp);
    free(rs);
    free(rr);
    return rc;
}
