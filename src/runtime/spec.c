/* spec.c: speculative decoding with the MTP head (see spec.h for the loop and its invariants).
 *
 * Invariant per timeline between calls: the session holds positions 0 .. len-1; its MTP cache
 * rows 0 .. mtp_len-1 were computed from the main model's true hidden states (or skipped to zero
 * while drafting was off); pend holds the hidden states of positions mtp_len .. len-1 (npend of
 * them, at most SPEC_PEND) and ptok their tokens. A step's drafted MTP rows (hidden = the MTP's
 * own output) are always truncated away before it returns. */
#include "runtime/spec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/err.h"
#include "model/config.h"
#include "model/engine.h"

typedef struct cost_model {
    double ms[SPEC_AUTO_MAX + 1];  /* running mean of a step's wall time with k drafts (all timelines) */
    int n[SPEC_AUTO_MAX + 1];      /* samples; the first of each k is a warm-up the second replaces */
    long long reach[SPEC_MAX_DRAFT + 1], acc[SPEC_MAX_DRAFT + 1]; /* conditional: draft j verified after j-1 accepted */
    /* plain steps' make-up (batch_stats over their forwards), for predicting wider windows */
    double exp_ms, attn_ms, head_ms, all_ms; /* summed over plain steps: experts (I/O included), attention + indexer per row, head, all */
    double experts, rows, psteps;  /* routed experts run, rows, plain steps measured */
    double mtp_ms, mtp_rounds;     /* measured draft rounds */
    int B;                         /* timelines in the measured steps */
    int best;
    long long step, next_probe, interval;
} cost_model;

struct spec_ctx {
    petrel_engine *eng;  /* borrowed */
    spec_params p;
    int max_seqs, V, H, K;
    petrel_batch *b;     /* owned: max_seqs * SPEC_PEND rows */
    petrel_row *rows;    /* owned [max_rows] */
    float *lg;           /* owned [max_rows][V] verify logits */
    float *hid;          /* owned [max_rows][H] verify hidden states / MTP hidden input */
    float *mout;         /* owned [max_rows][H] MTP outputs */
    float *mlg;          /* owned [max_seqs][V] draft logits */
    float *row;          /* owned [V] a logits row the sampler may modify */
    float *pd;           /* owned [V] the target distribution (dense), sampling */
    int *who;            /* owned [max_rows] */
    uint64_t orng;       /* oracle PRNG state */
    cost_model cm;
    spec_stats st;
    int wrong_rule;      /* test hook */
    char text[512];
};

void spec_test_wrong_rule(spec_ctx *c, int wrong) { c->wrong_rule = wrong; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t orng_next(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int spec_check(const petrel_engine *eng, const spec_params *p, petrel_error *err) {
    if (p->draft != SPEC_AUTO && (p->draft < 0 || p->draft > SPEC_MAX_DRAFT))
        return pt_err(err, PETREL_EINVAL, "--draft %d is out of range: want 0..%d or auto", p->draft, SPEC_MAX_DRAFT);
    if (!(p->oracle_accept >= 0 && p->oracle_accept <= 1)) return pt_err(err, PETREL_EINVAL, "--oracle-accept %g is not in [0, 1]", p->oracle_accept);
    if (p->draft > 0 && !eng->w.has_mtp)
        return pt_err(err, PETREL_EUNSUPPORTED, "--draft %d: this model (%s) has no MTP layer to draft with", p->draft, eng->path);
    if (p->draft > 0 && eng->cu)
        return pt_err(err, PETREL_EUNSUPPORTED, "--draft %d: the MTP head does not run on the GPU yet (--device cuda drafts nothing: --draft 0)", p->draft);
    if (p->draft > 0 && eng->trace)
        return pt_err(err, PETREL_EUNSUPPORTED, "--draft %d: drafting does not run while a routing trace is recorded (--trace-out)", p->draft);
    return 0;
}

int spec_effective_draft(const petrel_engine *eng, int draft) {
    if (draft == SPEC_AUTO && (!eng->w.has_mtp || eng->trace || eng->cu)) return 0;
    return draft;
}

int spec_create(petrel_engine *eng, const spec_params *p, int max_seqs, spec_ctx **out, petrel_error *err) {
    *out = NULL;
    PT_TRY(spec_check(eng, p, err));
    if (!eng->w.has_mtp || eng->trace || p->draft == 0)
        return pt_err(err, PETREL_EUNSUPPORTED, "no drafting here: %s", p->draft == 0 ? "--draft 0" : !eng->w.has_mtp ? "the model has no MTP layer" : "a routing trace is recorded");
    if (max_seqs < 1) return pt_err(err, PETREL_EINVAL, "speculative decoding of %d timelines", max_seqs);
    spec_ctx *c = calloc(1, sizeof *c);
    if (!c) return pt_err(err, PETREL_ENOMEM, "out of memory");
    c->eng = eng;
    c->p = *p;
    c->max_seqs = max_seqs;
    c->V = eng->cfg.vocab_size;
    c->H = eng->cfg.hidden_size;
    c->K = p->draft == SPEC_AUTO ? SPEC_AUTO_MAX : p->draft;
    c->orng = p->oracle_seed ^ 0x5eedULL;
    size_t R = (size_t)max_seqs * SPEC_PEND, V = (size_t)c->V, H = (size_t)c->H;
    int rc = petrel_batch_create(eng, (int)R, &c->b, err);
    if (rc) {
        free(c);
        return rc;
    }
    c->rows = malloc(sizeof(petrel_row) * R);
    c->who = malloc(sizeof(int) * R);
    c->lg = malloc(sizeof(float) * R * V);
    c->hid = malloc(sizeof(float) * R * H);
    c->mout = malloc(sizeof(float) * R * H);
    c->mlg = malloc(sizeof(float) * (size_t)max_seqs * V);
    c->row = malloc(sizeof(float) * V);
    c->pd = calloc(V, sizeof(float));
    if (!c->rows || !c->who || !c->lg || !c->hid || !c->mout || !c->mlg || !c->row || !c->pd) {
        spec_free(c);
        return pt_err(err, PETREL_ENOMEM, "out of memory for speculative decoding of %d timelines", max_seqs);
    }
    c->cm.best = c->K > 0 ? (c->K < 3 ? c->K : 3) : 0;
    c->cm.interval = 16;
    *out = c;
    return 0;
}

void spec_free(spec_ctx *c) {
    if (!c) return;
    petrel_batch_free(c->b);
    free(c->rows);
    free(c->who);
    free(c->lg);
    free(c->hid);
    free(c->mout);
    free(c->mlg);
    free(c->row);
    free(c->pd);
    free(c);
}

const spec_stats *spec_get_stats(const spec_ctx *c) { return &c->st; }

int spec_seq_init(spec_seq *q, spec_ctx *c, petrel_session *s, sampler *smp, const int32_t *masked, int n_masked, petrel_error *err) {
    memset(q, 0, sizeof *q);
    if (s->eng != c->eng) return pt_err(err, PETREL_EINVAL, "speculative timeline: a session of another engine");
    q->s = s;
    q->smp = smp;
    q->masked = masked;
    q->n_masked = n_masked;
    q->ctx = c;
    q->tok = -1;
    q->pend = malloc(sizeof(float) * SPEC_PEND * (size_t)c->H);
    q->chain = malloc(sizeof(float) * (size_t)c->H);
    if (!sampler_is_greedy(smp) || c->p.oracle_accept > 0) q->q = malloc(sizeof(float) * (size_t)(c->K > 0 ? c->K : 1) * (size_t)c->V);
    if (!q->pend || !q->chain || (!sampler_is_greedy(smp) && !q->q)) {
        spec_seq_free(q);
        return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    /* rows cached before this timeline took the session over have no hidden states here */
    if (s->mtp_len < s->len) PT_TRY(session_mtp_skip(s, s->len, err));
    return 0;
}

void spec_seq_free(spec_seq *q) {
    free(q->pend);
    free(q->chain);
    free(q->q);
    memset(q, 0, sizeof *q);
}

/* ---- feeding ids: the main forward, then the MTP rows whose next token is known ---- */

typedef struct feed_state {
    spec_seq *q;
    const int32_t *ids;
    int n;
} feed_state;

/* MTP rows for hidden[0..m) at the session's next MTP positions, next tokens next[0..m), in
 * pieces of the session's chunk; no logits. */
static int mtp_rows(petrel_session *s, const float *hidden, const int32_t *next, int m, int H, petrel_error *err) {
    for (int r0 = 0; r0 < m;) {
        int t = m - r0 < s->max_batch ? m - r0 : s->max_batch;
        fwd_seg one = {s, 0, t};
        PT_TRY(fwd_mtp_h(s, &one, 1, next + r0, hidden + (size_t)r0 * H, t, NULL, NULL, 0, NULL, err));
        r0 += t;
    }
    return 0;
}

static int feed_chunk(void *user, const float *hidden, int done, int T, petrel_error *err) {
    feed_state *f = user;
    spec_seq *q = f->q;
    petrel_session *s = q->s;
    int H = q->ctx->H;
    /* the pending rows first (the last of them waited for ids[done]) */
    if (q->npend) {
        int32_t nx[SPEC_PEND];
        for (int i = 0; i < q->npend; i++) nx[i] = i + 1 < q->npend ? q->ptok[i + 1] : f->ids[done];
        PT_TRY(mtp_rows(s, q->pend, nx, q->npend, H, err));
        q->npend = 0;
    }
    /* the chunk's rows but its last, whose next id is in the next chunk or not yet sampled */
    PT_TRY(mtp_rows(s, hidden, f->ids + done + 1, T - 1, H, err));
    memcpy(q->pend, hidden + (size_t)(T - 1) * H, sizeof(float) * (size_t)H);
    q->ptok[0] = f->ids[done + T - 1];
    q->npend = 1;
    return 0;
}

int spec_feed(spec_seq *q, const int32_t *ids, int n, float *logits, petrel_error *err) {
    petrel_session *s = q->s;
    q->tok = -1;
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "empty prompt: nothing to run");
    int span = session_span_rows(s);
    float *hid = malloc(sizeof(float) * (size_t)span * q->ctx->H); /* once per prompt, not per token */
    if (!hid) return pt_err(err, PETREL_ENOMEM, "out of memory for %d rows of hidden states", span);
    /* a state that fails half-way is restored to where it was: the main cache by the forward,
     * the MTP cache and the pending rows from a copy */
    int mtp0 = s->mtp_len, np0 = q->npend;
    float *save = np0 ? malloc(sizeof(float) * (size_t)np0 * q->ctx->H) : NULL;
    int32_t ptok0[SPEC_PEND];
    memcpy(ptok0, q->ptok, sizeof ptok0);
    if (np0 && save) memcpy(save, q->pend, sizeof(float) * (size_t)np0 * q->ctx->H);
    feed_state f = {q, ids, n};
    int rc = np0 && !save ? pt_err(err, PETREL_ENOMEM, "out of memory") : session_forward_h(s, ids, n, logits, 0, hid, feed_chunk, &f, err);
    if (rc < 0) {
        session_mtp_truncate(s, mtp0);
        if (save) memcpy(q->pend, save, sizeof(float) * (size_t)np0 * q->ctx->H);
        memcpy(q->ptok, ptok0, sizeof ptok0);
        q->npend = np0;
    }
    free(save);
    free(hid);
    return rc;
}

int spec_truncate(spec_seq *q, int n, petrel_error *err) {
    petrel_session *s = q->s;
    int len = petrel_session_len(s);
    if (n >= len) return len;
    if (n < 0) return pt_err(err, PETREL_EINVAL, "cannot truncate a %d-token timeline to %d", len, n);
    q->tok = -1;
    /* MTP row i took the token at i + 1: rows up to n - 2 stay valid */
    int m = s->mtp_len;
    if (m > n - 1) m = n > 0 ? n - 1 : 0;
    int keep = n;
    if (m < s->mtp_len) keep = m; /* the hidden state of position m is gone: recompute from it */
    int mtp_len0 = s->mtp_len;
    PT_TRY(petrel_session_truncate(s, keep, err));
    session_mtp_truncate(s, m);
    if (m == mtp_len0) q->npend = keep - m; /* a prefix of the pending rows */
    else q->npend = 0;
    return keep;
}

void spec_set_token(spec_seq *q, int32_t tok) { q->tok = tok; }

/* ---- the cost model ----
 * Time per token of k drafts = step_ms(k) / expected_tokens(k). expected_tokens multiplies the
 * running conditional acceptance of each draft position (a uniform prior: (acc + 1) / (tries +
 * 2)); step_ms is measured (after a warm-up sample) for each k that ran, else predicted from the
 * plain steps' make-up: + the routed experts a wider window adds (the union of B(k+1) rows'
 * choices in each MoE layer, at random routing, times the measured ms per expert, which holds the
 * I/O wait when experts stream), + the per-row attention of the k more rows, + k draft rounds
 * (measured, or one MoE layer plus the head of a plain step). Plain first (two steps), then the
 * best k; a neighbour is probed at doubling intervals while the choice holds, and only when it
 * could win with every draft accepted. */

static double expected_tokens_r(const cost_model *m, int k, double bonus) {
    double e = 1, pr = 1;
    for (int j = 1; j <= k; j++) {
        double r = (m->acc[j] + 1.0 + bonus) / (m->reach[j] + 2.0 + bonus);
        pr *= r;
        e += pr;
    }
    return e;
}
static double expected_tokens(const cost_model *m, int k) { return expected_tokens_r(m, k, 0); }

static double predict_ms(const spec_ctx *c, const cost_model *m, int k) {
    if (!m->psteps) return 1e30; /* nothing measured: only plain is known to be cheap */
    const petrel_config *cf = &c->eng->cfg;
    double T0 = m->n[0] ? m->ms[0] : m->all_ms / m->psteps, E = cf->n_routed_experts, K = cf->num_experts_per_tok;
    int L = cf->num_hidden_layers, nmoe = c->eng->n_moe > 0 ? c->eng->n_moe : 1;
    double B = m->B > 0 ? m->B : 1;
    double per_exp = m->experts > 0 ? m->exp_ms / m->experts : 0;
    double u1 = E * (1 - pow(1 - K / E, B)), uk = E * (1 - pow(1 - K / E, B * (k + 1)));
    double attn_row = m->rows > 0 ? m->attn_ms / m->rows : 0;
    double round = m->mtp_rounds > 0 ? m->mtp_ms / m->mtp_rounds : (T0 - m->head_ms / m->psteps) / L + m->head_ms / m->psteps;
    (void)nmoe;
    return T0 + (uk - u1) * per_exp * (m->experts / m->psteps / (u1 > 0 ? u1 : 1)) + k * B * attn_row + k * round;
}

static double step_ms(const spec_ctx *c, const cost_model *m, int k) {
    if (m->n[k] >= 2 || (k == 0 && m->n[0])) return m->ms[k];
    return predict_ms(c, m, k);
}

static int best_k_b(const spec_ctx *c, const cost_model *m, double bonus, int kmax) {
    int best = 0;
    double bc = step_ms(c, m, 0);
    for (int k = 1; k <= kmax; k++) {
        double v = step_ms(c, m, k) / expected_tokens_r(m, k, bonus);
        if (v < bc) bc = v, best = k;
    }
    return best;
}
static int best_k(const spec_ctx *c, const cost_model *m) { return best_k_b(c, m, 0, SPEC_AUTO_MAX); }

static int choose_k(spec_ctx *c) {
    cost_model *m = &c->cm;
    if (c->p.draft != SPEC_AUTO) return c->K;
    long long s = m->step++;
    if (s < 2) return 0; /* plain first: a warm-up step, then one measured */
    int b = best_k(c, m);
    if (s == 2) m->next_probe = s + m->interval;
    if (s >= m->next_probe) {
        m->interval = b == m->best && m->interval < 1024 ? m->interval * 2 : 16;
        m->next_probe = s + m->interval;
        m->best = b;
        /* a neighbour, if it could win were every draft accepted (bonus: a strong prior) */
        for (int d = 1; d >= -1; d -= 2) {
            int pk = b + d;
            if (pk < 0 || pk > SPEC_AUTO_MAX) continue;
            double v = step_ms(c, m, pk) / expected_tokens_r(m, pk, 1e6), cur = step_ms(c, m, b) / expected_tokens(m, b);
            if (v < cur) return pk;
        }
    }
    m->best = b;
    return b;
}

static void cost_note(spec_ctx *c, int k, double ms) {
    cost_model *m = &c->cm;
    if (k > SPEC_AUTO_MAX) return;
    /* a running mean that forgets: the last ~8 steps of each k weigh most */
    if (m->n[k] <= 1) m->ms[k] = ms; /* the first sample of each k is a warm-up */
    else m->ms[k] += (ms - m->ms[k]) * (m->n[k] < 8 ? 1.0 / m->n[k] : 0.125);
    m->n[k]++;
}

const char *spec_model_text(const spec_ctx *c) {
    const cost_model *m = &c->cm;
    int o = snprintf((char *)c->text, sizeof c->text, "draft %s, chosen k %d:", c->p.draft == SPEC_AUTO ? "auto" : "fixed",
                     c->p.draft == SPEC_AUTO ? best_k(c, m) : c->K);
    for (int k = 0; k <= SPEC_AUTO_MAX && o < (int)sizeof c->text - 64; k++) {
        double ms = step_ms(c, m, k);
        o += snprintf((char *)c->text + o, sizeof c->text - (size_t)o, " k%d %.2f tok %.2f ms%s", k, expected_tokens(m, k), ms < 1e29 ? ms : 0.0,
                      m->n[k] >= 2 || (k == 0 && m->n[0]) ? "" : " (predicted)");
    }
    return c->text;
}

/* ---- sampling pieces ---- */

static void mask_row(const spec_seq *q, float *row) {
    for (int i = 0; i < q->n_masked; i++) row[q->masked[i]] = -INFINITY;
}

/* The sampler's kept distribution of row into dense [V] (zeroed first). */
static void dense_dist(sampler *smp, float *row, int V, float *dst) {
    memset(dst, 0, sizeof(float) * (size_t)V);
    int n = sampler_filter(smp, row, V);
    for (int i = 0; i < n; i++) dst[smp->cand[i]] = (float)sampler_prob(smp, smp->cand[i]);
}

static int32_t draw_dense(sampler *smp, const float *p, int V) {
    double sum = 0;
    for (int i = 0; i < V; i++) sum += p[i];
    double r = sampler_uniform(smp) * sum, cum = 0;
    int last = 0;
    for (int i = 0; i < V; i++) {
        if (p[i] <= 0) continue;
        cum += p[i];
        last = i;
        if (r < cum) return i;
    }
    return last;
}

/* A draft token from the MTP logits row (penalties over the sampler's current window). */
static int32_t draft_pick(spec_seq *q, float *row, int j) {
    spec_ctx *c = q->ctx;
    mask_row(q, row);
    if (sampler_is_greedy(q->smp)) return sampler_sample(q->smp, row, c->V);
    float *qd = q->q + (size_t)j * c->V;
    dense_dist(q->smp, row, c->V, qd);
    return draw_dense(q->smp, qd, c->V);
}

/* ---- one step ---- */

int spec_step(spec_ctx *c, spec_seq *const *seqs, int n, petrel_error *err) {
    if (n < 1 || n > c->max_seqs) return pt_err(err, PETREL_EINVAL, "a speculative step of %d timelines (at most %d)", n, c->max_seqs);
    int V = c->V, H = c->H;
    double t0 = now_s();
    int k = choose_k(c), kmax = 0;
    for (int i = 0; i < n; i++) {
        spec_seq *q = seqs[i];
        if (q->tok < 0) return pt_err(err, PETREL_EINVAL, "speculative step: timeline %d has no pending token", i);
        int room = q->s->cap - q->s->len;
        if (room < 1 || q->limit < 1) return pt_err(err, PETREL_ERANGE, "speculative step: timeline %d has no room (%d positions, limit %d)", i, room, q->limit);
        int ki = k;
        if (ki > q->limit - 1) ki = q->limit - 1;
        if (ki > room - 1) ki = room - 1;
        if (q->npend < 1) ki = 0;
        q->k = ki;
        q->nout = 0;
        if (ki > kmax) kmax = ki;
    }
    /* draft: round 1 over the catch-up rows, rounds 2..k one row per timeline */
    if (n > 64) return pt_err(err, PETREL_EINVAL, "a speculative step holds at most 64 timelines");
    int32_t ev[64][SPEC_MAX_DRAFT + 1];
    int nacc[64], mtp0[64], len0[64], rc = 0;
    for (int i = 0; i < n; i++) mtp0[i] = seqs[i]->s->mtp_len, len0[i] = seqs[i]->s->len, nacc[i] = 0;
    for (int j = 1; j <= kmax && !rc; j++) {
        int m = 0, nl = 0;
        for (int i = 0; i < n; i++) {
            spec_seq *q = seqs[i];
            if (q->k < j) continue;
            if (j == 1)
                for (int r = 0; r < q->npend; r++) {
                    c->rows[m] = (petrel_row){q->s, r + 1 < q->npend ? q->ptok[r + 1] : q->tok, r + 1 == q->npend};
                    memcpy(c->hid + (size_t)m * H, q->pend + (size_t)r * H, sizeof(float) * (size_t)H);
                    c->who[m++] = i;
                }
            else {
                c->rows[m] = (petrel_row){q->s, q->d[j - 1], 1};
                memcpy(c->hid + (size_t)m * H, q->chain, sizeof(float) * (size_t)H);
                c->who[m++] = i;
            }
        }
        rc = batch_mtp(c->b, c->rows, m, c->hid, c->mlg, c->mout, err);
        for (int r = 0; r < m && !rc; r++) {
            if (!c->rows[r].want_logits) continue;
            int i = c->who[r];
            spec_seq *q = seqs[i];
            memcpy(q->chain, c->mout + (size_t)r * H, sizeof(float) * (size_t)H);
            q->d[j] = draft_pick(q, c->mlg + (size_t)nl++ * V, j - 1);
            /* the next draft's penalties see this one (taken back before verifying) */
            if (j < q->k) ev[i][++nacc[i]] = sampler_accept_undoable(q->smp, q->d[j]);
        }
    }
    for (int i = 0; i < n; i++) { /* the drafts leave the penalty window; the drafted MTP rows go */
        spec_seq *q = seqs[i];
        for (int j = nacc[i]; j >= 1; j--) sampler_unaccept(q->smp, ev[i][j]);
        session_mtp_truncate(q->s, rc || q->k == 0 ? mtp0[i] : len0[i]);
    }
    if (rc) return rc;
    double t1 = now_s();
    /* verify: every timeline's pending token and drafts, one forward */
    int m = 0, base[64];
    for (int i = 0; i < n; i++) {
        spec_seq *q = seqs[i];
        base[i] = m;
        c->rows[m++] = (petrel_row){q->s, q->tok, 1};
        for (int j = 1; j <= q->k; j++) c->rows[m++] = (petrel_row){q->s, q->d[j], 1};
    }
    fwd_stats fs0 = *batch_stats(c->b);
    rc = batch_forward_h(c->b, c->rows, m, c->lg, c->hid, err);
    if (rc) {
        for (int i = 0; i < n; i++) session_mtp_truncate(seqs[i]->s, mtp0[i]);
        return rc;
    }
    double t2 = now_s();
    /* accept */
    for (int i = 0; i < n && !rc; i++) {
        spec_seq *q = seqs[i];
        sampler *smp = q->smp;
        int greedy = sampler_is_greedy(smp), a = 0, oracle = c->p.oracle_accept > 0;
        int oa = 0; /* oracle: how many drafts are taken */
        if (oracle)
            while (oa < q->k && (double)(orng_next(&c->orng) >> 11) * 0x1.0p-53 < c->p.oracle_accept) oa++;
        int32_t x = -1;
        for (int j = 0; j <= q->k; j++) {
            float *row = c->lg + (size_t)(base[i] + j) * V;
            if (oracle && j < oa) { /* taken without looking */
                sampler_accept(smp, q->d[j + 1]);
                a++;
                continue;
            }
            memcpy(c->row, row, sizeof(float) * (size_t)V);
            mask_row(q, c->row);
            if (greedy) {
                int32_t t = sampler_sample(smp, c->row, V);
                if (!oracle && j < q->k && t == q->d[j + 1]) {
                    sampler_accept(smp, t);
                    a++;
                    continue;
                }
                x = t;
                break;
            }
            dense_dist(smp, c->row, V, c->pd);
            if (j < q->k && !oracle) {
                int32_t d = q->d[j + 1];
                const float *qd = q->q + (size_t)j * V;
                double pr = c->pd[d], qr = qd[d];
                if (qr > 0 && sampler_uniform(smp) * qr < pr) { /* u < p/q */
                    sampler_accept(smp, d);
                    a++;
                    continue;
                }
                /* rejected: the residual max(0, p - q), renormalized */
                double sum = 0;
                for (int v = 0; v < V && !c->wrong_rule; v++) {
                    float r = c->pd[v] - qd[v];
                    c->pd[v] = r > 0 ? r : 0;
                    sum += c->pd[v];
                }
                if (!(sum > 0) && !c->wrong_rule) { /* p == q: cannot happen after a rejection but for rounding */
                    memcpy(c->row, row, sizeof(float) * (size_t)V);
                    mask_row(q, c->row);
                    dense_dist(smp, c->row, V, c->pd);
                }
            }
            x = draw_dense(smp, c->pd, V);
            break;
        }
        sampler_accept(smp, x);
        for (int j = 1; j <= a; j++) q->out[j - 1] = q->d[j];
        q->out[a] = x;
        q->nout = a + 1;
        /* the cache keeps the pending token and the accepted drafts */
        int n0 = len0[i];
        rc = petrel_session_truncate(q->s, n0 + a + 1, err);
        if (rc) break;
        if (q->k == 0) {
            /* no drafting this step: the pending rows wait for the next draft, but when the cost
             * model turned drafting off (the MTP head does not run then) or they overflow, the
             * older ones are skipped (zero latents) */
            int drop = k == 0 && c->p.draft == SPEC_AUTO ? q->npend : q->npend + 1 - SPEC_PEND;
            if (drop > 0) {
                rc = session_mtp_skip(q->s, q->s->mtp_len + drop, err);
                if (rc) break;
                memmove(q->pend, q->pend + (size_t)drop * H, sizeof(float) * (size_t)(q->npend - drop) * H);
                memmove(q->ptok, q->ptok + drop, sizeof(int32_t) * (size_t)(q->npend - drop));
                q->npend -= drop;
            }
        } else q->npend = 0; /* round 1 ran them */
        q->ptok[q->npend] = q->tok;
        for (int j = 1; j <= a; j++) q->ptok[q->npend + j] = q->d[j];
        memcpy(q->pend + (size_t)q->npend * H, c->hid + (size_t)base[i] * H, sizeof(float) * (size_t)(a + 1) * H);
        q->npend += a + 1;
        q->tok = x;
        c->st.tokens += a + 1;
        c->st.steps++;
        for (int j = 1; j <= q->k; j++) {
            c->st.drafted[j]++;
            if (a >= j) c->st.accepted[j]++;
            if (a >= j - 1) {
                c->cm.reach[j]++;
                if (a >= j) c->cm.acc[j]++;
            }
        }
    }
    double t3 = now_s();
    c->st.steps_k[k]++;
    c->st.step_s[k] += t3 - t0;
    c->st.draft_s += t1 - t0;
    c->st.verify_s += t2 - t1;
    if (kmax == k) cost_note(c, k, (t3 - t0) * 1e3);
    if (!rc && kmax == 0 && k == 0 && c->cm.step > 1) { /* a plain step's make-up (not the warm-up) */
        const fwd_stats *f1 = batch_stats(c->b);
        cost_model *cm = &c->cm;
        cm->exp_ms += (double)(f1->ns[FS_EXPERTS] - fs0.ns[FS_EXPERTS]) / 1e6;
        cm->attn_ms += (double)(f1->ns[FS_ATTN] + f1->ns[FS_INDEXER] - fs0.ns[FS_ATTN] - fs0.ns[FS_INDEXER]) / 1e6;
        cm->head_ms += (double)(f1->ns[FS_HEAD] - fs0.ns[FS_HEAD]) / 1e6;
        cm->all_ms += (t2 - t1) * 1e3;
        cm->experts += (double)(f1->experts_run - fs0.experts_run);
        cm->rows += (double)(f1->rows - fs0.rows);
        cm->psteps++;
        cm->B = n;
    }
    if (!rc && kmax > 0) {
        c->cm.mtp_ms += (t1 - t0) * 1e3;
        c->cm.mtp_rounds += kmax;
    }
    return rc;
}

int spec_stats_json(const spec_ctx *c, char *buf, size_t cap) {
    const spec_stats *s = &c->st;
    int last = 0;
    for (int j = 1; j <= SPEC_MAX_DRAFT; j++)
        if (s->drafted[j]) last = j;
    int o = snprintf(buf, cap, "{\"draft\":");
    if (c->p.draft == SPEC_AUTO) o += snprintf(buf + o, cap - (size_t)o, "\"auto\"");
    else o += snprintf(buf + o, cap - (size_t)o, "%d", c->p.draft);
    o += snprintf(buf + o, cap - (size_t)o, ",\"tokens\":%lld,\"forwards\":%lld,\"tokens_per_forward\":%.4f,\"acceptance_by_position\":[", s->tokens,
                  s->steps, s->steps ? (double)s->tokens / s->steps : 0.0);
    for (int j = 1; j <= last && o < (int)cap - 32; j++)
        o += snprintf(buf + o, cap - (size_t)o, "%s%.4f", j > 1 ? "," : "", s->drafted[j] ? (double)s->accepted[j] / s->drafted[j] : 0.0);
    o += snprintf(buf + o, cap - (size_t)o, "],\"steps_by_k\":[");
    int kl = 0;
    for (int k = 0; k <= SPEC_MAX_DRAFT; k++)
        if (s->steps_k[k]) kl = k;
    for (int k = 0; k <= kl && o < (int)cap - 32; k++) o += snprintf(buf + o, cap - (size_t)o, "%s%lld", k ? "," : "", s->steps_k[k]);
    o += snprintf(buf + o, cap - (size_t)o, "],\"ms_per_step_by_k\":[");
    for (int k = 0; k <= kl && o < (int)cap - 32; k++)
        o += snprintf(buf + o, cap - (size_t)o, "%s%.3f", k ? "," : "", s->steps_k[k] ? 1e3 * s->step_s[k] / s->steps_k[k] : 0.0);
    o += snprintf(buf + o, cap - (size_t)o, "],\"draft_ms\":%.3f,\"verify_ms\":%.3f", 1e3 * s->draft_s, 1e3 * s->verify_s);
    if (c->p.oracle_accept > 0) o += snprintf(buf + o, cap - (size_t)o, ",\"oracle_accept\":%.3f", c->p.oracle_accept);
    o += snprintf(buf + o, cap - (size_t)o, "}");
    return o < (int)cap ? 0 : -1;
}
