/* spec.h: speculative decoding with the model's MTP (NextN) head, for one session or many in one
 * batch (generate, run, chat, batch, bench).
 *
 * A timeline (spec_seq) holds a session, its sampler, the pending token (sampled and emitted but
 * not yet in the cache) and the main model's final-normed hidden states of the positions whose
 * MTP row is still to run (`pend`, positions mtp_len .. len-1; MTP row i takes hidden h_i and the
 * token at i + 1, so the last one waits for the pending token). One step (spec_step) for every
 * timeline of a spec_ctx:
 *   draft   round 1: the pending MTP rows of every timeline (the catch-up rows with the true
 *           hidden states) in one MTP batch, logits on the last row: draft d1; rounds 2..k: one
 *           row per timeline, the token just drafted and the MTP layer's own output (before
 *           shared_head.norm) as its hidden: d2..dk. Then the drafted MTP rows are dropped again
 *           (their hidden was the MTP's own), so the MTP cache always equals the one-pass form.
 *   verify  the pending token and the k drafts as k + 1 rows of one batch forward (all the
 *           timelines' windows together), logits and hidden states on every row.
 *   accept  greedy: the longest prefix of drafts equal to the target's choice (sampler_sample on
 *           the row, penalties included, so the tokens are exactly plain greedy's); sampling:
 *           speculative rejection sampling (accept d with probability min(1, p(d)/q(d)), else draw
 *           from norm(max(0, p - q)); after k acceptances a bonus draw from p), where p and q are
 *           the target's and the MTP's rows through the same sampler pipeline (penalties over the
 *           same window, temperature, top-k, top-p, min-p), so the output is distributed exactly as
 *           plain sampling's. The cache is truncated past the accepted prefix; its hidden states
 *           become the next step's catch-up rows.
 * k per step: fixed (--draft K), or SPEC_AUTO: a cost model over the measured wall time of steps
 * with each k (which counts whatever a wider window costs: more experts computed or read from
 * disk) and the running acceptance per draft position; it picks the k of the lowest expected time
 * per token, 0 included, and re-probes a neighbour at growing intervals. While k is 0 the MTP head
 * does not run at all: the MTP rows of those positions are filled with zero latents
 * (session_mtp_skip) and drafting restarts from the last hidden state.
 *
 * Not thread-safe; allocates at create/init only. */
#ifndef PETREL_RUNTIME_SPEC_H
#define PETREL_RUNTIME_SPEC_H
#include <stdint.h>

#include "petrel.h"
#include "runtime/sampler.h"

#define SPEC_MAX_DRAFT 16
#define SPEC_AUTO (-1)
#define SPEC_AUTO_MAX 4    /* the largest k the cost model considers */
#define SPEC_PEND (SPEC_MAX_DRAFT + 1)

typedef struct spec_params {
    int draft;            /* drafts per step: 0 = off, 1..SPEC_MAX_DRAFT, or SPEC_AUTO */
    double oracle_accept; /* > 0 (benchmarks of random-weight models only): each draft is accepted
                             with this probability, in order, instead of being checked; the
                             emitted tokens are then not the model's */
    uint64_t oracle_seed;
} spec_params;

typedef struct spec_stats {
    long long tokens;                         /* tokens emitted by steps (the prompt's first not counted) */
    long long steps;                          /* verify steps (= main forwards after the prompt), per timeline */
    long long drafted[SPEC_MAX_DRAFT + 1];    /* [j]: steps that verified a j-th draft (j >= 1) */
    long long accepted[SPEC_MAX_DRAFT + 1];   /* [j]: of those, steps that accepted it */
    long long steps_k[SPEC_MAX_DRAFT + 1];    /* batch steps run with k drafts */
    double step_s[SPEC_MAX_DRAFT + 1];        /* their wall time */
    double draft_s, verify_s;                 /* wall time of drafting and of the verify forwards */
} spec_stats;

typedef struct spec_ctx spec_ctx;

typedef struct spec_seq {
    petrel_session *s;     /* borrowed */
    sampler *smp;          /* borrowed */
    const int32_t *masked; /* borrowed: ids never sampled (their logits set to -inf), n_masked */
    int n_masked;
    float *pend;           /* owned [SPEC_PEND][H]: hidden states of positions mtp_len .. len-1 */
    int32_t ptok[SPEC_PEND]; /* the tokens at those positions */
    int npend;
    int32_t tok;           /* the pending token (emitted, not cached); -1 before spec_set_token */
    int limit;             /* spec_step: at most this many tokens from this step (>= 1), set by the caller */
    int k;                 /* this step's drafts */
    int32_t d[SPEC_MAX_DRAFT + 1];
    float *q;              /* owned [SPEC_MAX_DRAFT][V] draft distributions (sampling only) */
    float *chain;          /* owned [H]: the last MTP row's output (a chained draft's hidden) */
    int32_t out[SPEC_MAX_DRAFT + 1]; /* spec_step: the tokens emitted, nout of them (the last is */
    int nout;                        /* the new pending token) */
    spec_ctx *ctx;         /* borrowed */
} spec_seq;

/* Validates p against the engine (PETREL_EUNSUPPORTED "this model has no MTP layer" when drafting
 * is asked of a model without one; PETREL_EINVAL for a draft count outside 0..16 or auto) and
 * allocates for up to max_seqs timelines per step. */
int spec_check(const petrel_engine *eng, const spec_params *p, petrel_error *err);
/* The draft setting in effect: SPEC_AUTO on a model without an MTP layer, or while a routing
 * trace is recorded, is 0 (off); anything else as given (spec_check refuses what cannot run). */
int spec_effective_draft(const petrel_engine *eng, int draft);
int spec_create(petrel_engine *eng, const spec_params *p, int max_seqs, spec_ctx **out, petrel_error *err);
void spec_free(spec_ctx *c);
const spec_stats *spec_get_stats(const spec_ctx *c);
/* The k the cost model chose last (or the fixed draft count) and the model's view as text:
 * "k=3: 1.92 tok/step 12.3 ms/step; ..." (static buffer). */
const char *spec_model_text(const spec_ctx *c);

/* A timeline over session s (empty or holding positions whose MTP rows were computed by an
 * earlier spec_seq; pass the ids fed so far through spec_feed), with its sampler. */
int spec_seq_init(spec_seq *q, spec_ctx *c, petrel_session *s, sampler *smp, const int32_t *masked, int n_masked, petrel_error *err);
void spec_seq_free(spec_seq *q);
/* Runs ids[0..n) at the session's next positions (petrel_session_forward: logits of the last row
 * into logits [V], or NULL) and the MTP rows that become computable. Drops a pending token. */
int spec_feed(spec_seq *q, const int32_t *ids, int n, float *logits, petrel_error *err);
/* Truncates the timeline to at most n positions (petrel_session_truncate and the MTP cache);
 * returns the length kept, which may be one less than n when the MTP row before it must be
 * recomputed (feed from there), or a negative error. */
int spec_truncate(spec_seq *q, int n, petrel_error *err);
/* The pending token: sampled from the last logits and emitted by the caller (its sampler has
 * accepted it). */
void spec_set_token(spec_seq *q, int32_t tok);
/* One draft + verify step over seqs[0..n) (each with its pending token, limit set: at most
 * `limit` tokens emitted, and the session must have room for limit positions); fills each seq's
 * out/nout (1 .. k + 1 tokens, accepted into its sampler; the last is the new pending token, the
 * others are cached). On failure the sessions are rolled back to before the step. */
int spec_step(spec_ctx *c, spec_seq *const *seqs, int n, petrel_error *err);
/* Test hook: 1 makes a rejection draw from p instead of max(0, p - q) (a wrong rule the
 * distribution test must catch). */
void spec_test_wrong_rule(spec_ctx *c, int wrong);
/* One line of JSON (no newline) with tokens, forwards, tokens_per_forward, acceptance_by_position,
 * steps_by_k, ms_per_step_by_k, draft_ms, verify_ms, and the draft setting. */
int spec_stats_json(const spec_ctx *c, char *buf, size_t cap);
#endif
