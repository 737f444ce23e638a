/* sampler.h: picks the next token from a row of logits. Greedy, temperature, top-k, top-p
 * (nucleus), min-p, and repetition / presence / frequency penalties over a window of recent
 * tokens, with its own seeded PRNG (xoshiro256**, seeded through splitmix64): a fixed seed and the
 * same logits give the same picks on every run and machine.
 *
 * Order of operations in sampler_sample (each step optional; "off" values in sampler_params):
 *   1. penalties, on the raw logits, for every distinct token in the last penalty_last_n accepted
 *      ids (count c = its occurrences in that window):
 *        repetition:  l = l > 0 ? l / repeat_penalty : l * repeat_penalty   (HF / llama.cpp)
 *        frequency and presence:  l -= c * frequency_penalty + presence_penalty
 *   2. temperature <= 0 (or top_k == 1): return the argmax (lowest id on ties). Done.
 *   3. temperature: l /= temperature; softmax.
 *   4. top-k: keep the k highest (ties broken by lower id).
 *   5. top-p: of those, keep the smallest highest-first set whose mass (renormalized over the
 *      top-k set) is >= top_p.
 *   6. min-p: of those, keep tokens whose probability is >= min_p * the highest probability.
 *   7. draw one from what is kept, in proportion to its probability.
 * NaN logits count as -inf. The logits row is modified in place (penalties, scaling).
 *
 * The sampler never allocates after sampler_init: scratch is sized for the vocabulary there.
 * Accepted ids (sampler_accept) feed the penalty window; callers accept the prompt's ids too so
 * that penalties see them (as HF and llama.cpp do). Not thread-safe: one sampler per session. */
#ifndef PETREL_RUNTIME_SAMPLER_H
#define PETREL_RUNTIME_SAMPLER_H
#include <stdint.h>

#include "petrel.h"

typedef struct sampler_params {
    float temperature;       /* <= 0: greedy */
    int top_k;               /* <= 0 or >= vocab: off */
    float top_p;             /* >= 1: off; (0, 1) keeps the nucleus */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off; > 1 discourages repeats */
    float presence_penalty;  /* 0: off */
    float frequency_penalty; /* 0: off */
    int penalty_last_n;      /* penalty window in tokens (0: penalties off) */
    uint64_t seed;
} sampler_params;

/* The CLI defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, penalties off
 * (repeat 1, presence 0, frequency 0) over a window of 64, seed 0. */
void sampler_params_default(sampler_params *p);

typedef struct sampler {
    sampler_params p;
    int vocab;
    uint64_t rng[4];         /* xoshiro256** state */
    int32_t *cand;           /* [vocab] candidate ids (scratch; kept set after a draw) */
    float *prob;             /* [vocab] by id: unnormalized probabilities (scratch) */
    int n_kept;              /* size of the kept set of the last sampler_filter */
    double kept_sum;         /* its unnormalized mass */
    int32_t *counts;         /* [vocab] occurrences of each id in the window */
    int32_t *hist;           /* [penalty_last_n] ring of recent ids */
    int hist_len, hist_pos;
} sampler;

/* Validates the params (PETREL_EINVAL naming the bad one) and allocates scratch for vocab ids. */
int sampler_init(sampler *s, const sampler_params *p, int vocab, petrel_error *err);
void sampler_free(sampler *s);
/* Reseeds the PRNG and forgets the penalty history. */
void sampler_reset(sampler *s, uint64_t seed);
/* Forgets the penalty history only (the PRNG goes on). */
void sampler_clear_history(sampler *s);
/* Adds an id to the penalty window (drops the oldest when full). Out-of-range ids are ignored. */
void sampler_accept(sampler *s, int32_t id);
/* sampler_accept that can be taken back (speculative drafts): returns what sampler_unaccept
 * needs to undo it (the id it pushed out of a full window, -1 for none, -2 if nothing was
 * recorded); undo in the reverse order of the accepts. */
int32_t sampler_accept_undoable(sampler *s, int32_t id);
void sampler_unaccept(sampler *s, int32_t evicted);
/* Whether sampler_sample is a pure argmax (after penalties): no draw, no PRNG. */
static inline int sampler_is_greedy(const sampler *s) { return s->p.temperature <= 0.0f || s->p.top_k == 1; }
/* Steps 1-7 above: returns the chosen id (logits has `vocab` entries, the size given at init). */
int32_t sampler_sample(sampler *s, float *logits, int vocab);

/* For inspection and tests: steps 1 and 3-6 only (no greedy shortcut, no draw; temperature <= 0
 * is treated as 1). Returns the kept count n; s->cand[0..n) holds the kept ids (highest first
 * when top-p ran, else in an unspecified order) and sampler_prob(s, id) their normalized
 * probabilities. */
int sampler_filter(sampler *s, float *logits, int vocab);
static inline double sampler_prob(const sampler *s, int32_t id) { return s->prob[id] / s->kept_sum; }
/* Step 1 alone (what the penalties do to a row). */
void sampler_apply_penalties(sampler *s, float *logits, int vocab);
/* Uniform double in [0, 1) from the sampler's PRNG. */
double sampler_uniform(sampler *s);
#endif
