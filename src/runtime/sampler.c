/* sampler.c: the token sampler (see sampler.h for the order of operations). Candidates are
 * ranked by (logit desc, id asc), a strict total order, so every step is deterministic. Top-k is
 * a quickselect; top-p sorts only as much of the head as it needs (growing chunks, each a
 * quickselect then a heapsort), so a typical draw over a large vocabulary stays O(vocab). */
#include "runtime/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "kernels/kernels.h"

void sampler_params_default(sampler_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->presence_penalty = 0.0f;
    p->frequency_penalty = 0.0f;
    p->penalty_last_n = 64;
    p->seed = 0;
}

/* ---- PRNG: xoshiro256** seeded through splitmix64 ---- */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static uint64_t xoshiro_next(uint64_t *s) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}
double sampler_uniform(sampler *s) { return (double)(xoshiro_next(s->rng) >> 11) * 0x1.0p-53; }

void sampler_clear_history(sampler *s) {
    for (int i = 0; i < s->hist_len; i++) s->counts[s->hist[i]] = 0;
    s->hist_len = s->hist_pos = 0;
}

void sampler_reset(sampler *s, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
    s->p.seed = seed;
    sampler_clear_history(s);
}

int sampler_init(sampler *s, const sampler_params *p, int vocab, petrel_error *err) {
    memset(s, 0, sizeof *s);
    if (vocab <= 0) return pt_err(err, PETREL_EINVAL, "sampler: vocabulary size %d", vocab);
    if (!(p->temperature == p->temperature) || p->temperature > 1e6f)
        return pt_err(err, PETREL_EINVAL, "sampler: temperature %g is not a number in [0, 1e6]", (double)p->temperature);
    if (!(p->top_p >= 0.0f && p->top_p <= 1e6f))
        return pt_err(err, PETREL_EINVAL, "sampler: top_p %g is not in [0, 1] (1 = off)", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return pt_err(err, PETREL_EINVAL, "sampler: min_p %g is not in [0, 1]", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f && p->repeat_penalty < 1e6f))
        return pt_err(err, PETREL_EINVAL, "sampler: repeat_penalty %g must be > 0 (1 = off)", (double)p->repeat_penalty);
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        return pt_err(err, PETREL_EINVAL, "sampler: presence/frequency penalties must be finite");
    if (p->penalty_last_n < 0 || p->penalty_last_n > (1 << 24))
        return pt_err(err, PETREL_EINVAL, "sampler: penalty window %d is not in [0, 2^24]", p->penalty_last_n);
    s->p = *p;
    s->vocab = vocab;
    s->cand = malloc(sizeof(int32_t) * (size_t)vocab);
    s->prob = malloc(sizeof(float) * (size_t)vocab);
    s->counts = calloc((size_t)vocab, sizeof(int32_t));
    if (p->penalty_last_n > 0) s->hist = malloc(sizeof(int32_t) * (size_t)p->penalty_last_n);
    if (!s->cand || !s->prob || !s->counts || (p->penalty_last_n > 0 && !s->hist)) {
        sampler_free(s);
        return pt_err(err, PETREL_ENOMEM, "sampler: out of memory for a vocabulary of %d", vocab);
    }
    sampler_reset(s, p->seed);
    return 0;
}

void sampler_free(sampler *s) {
    free(s->cand);
    free(s->prob);
    free(s->counts);
    free(s->hist);
    memset(s, 0, sizeof *s);
}

void sampler_accept(sampler *s, int32_t id) {
    int W = s->p.penalty_last_n;
    if (W <= 0 || id < 0 || id >= s->vocab) return;
    if (s->hist_len == W) s->counts[s->hist[s->hist_pos]]--;
    else s->hist_len++;
    s->hist[s->hist_pos] = id;
    s->counts[id]++;
    s->hist_pos = (s->hist_pos + 1) % W;
}

int32_t sampler_accept_undoable(sampler *s, int32_t id) {
    int W = s->p.penalty_last_n;
    if (W <= 0 || id < 0 || id >= s->vocab) return -2; /* nothing recorded */
    int32_t ev = s->hist_len == W ? s->hist[s->hist_pos] : -1;
    sampler_accept(s, id);
    return ev;
}

void sampler_unaccept(sampler *s, int32_t evicted) {
    int W = s->p.penalty_last_n;
    if (evicted == -2 || W <= 0 || s->hist_len == 0) return;
    s->hist_pos = (s->hist_pos + W - 1) % W;
    s->counts[s->hist[s->hist_pos]]--;
    if (evicted >= 0) {
        s->hist[s->hist_pos] = evicted;
        s->counts[evicted]++;
    } else s->hist_len--;
}

void sampler_apply_penalties(sampler *s, float *logits, int vocab) {
    const sampler_params *p = &s->p;
    if (p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f) return;
    /* Each distinct id once: its count is negated after use and restored below. */
    for (int i = 0; i < s->hist_len; i++) {
        int32_t id = s->hist[i];
        int32_t c = s->counts[id];
        if (c <= 0) continue;
        if (id < vocab) {
            float l = logits[id];
            if (p->repeat_penalty != 1.0f) l = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
            l -= (float)c * p->frequency_penalty + p->presence_penalty;
            logits[id] = l;
        }
        s->counts[id] = -c;
    }
    for (int i = 0; i < s->hist_len; i++)
        if (s->counts[s->hist[i]] < 0) s->counts[s->hist[i]] = -s->counts[s->hist[i]];
}

/* ---- ranking: a before b when its logit is higher, or equal with a lower id ---- */
static inline int better(const float *l, int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); }
static inline void swp(int32_t *c, int i, int j) { int32_t t = c[i]; c[i] = c[j]; c[j] = t; }

/* Rearranges c[0..n) so that c[0..k) are its k best (in no particular order), 0 < k <= n. */
static void select_top(int32_t *c, int n, int k, const float *l) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (better(l, c[mid], c[lo])) swp(c, lo, mid);
        if (better(l, c[hi], c[lo])) swp(c, lo, hi);
        if (better(l, c[hi], c[mid])) swp(c, mid, hi);
        int32_t pv = c[mid];
        int i = lo, j = hi;
        while (i <= j) {
            while (better(l, c[i], pv)) i++;
            while (better(l, pv, c[j])) j--;
            if (i <= j) { swp(c, i, j); i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
}

static void sift(int32_t *c, int root, int n, const float *l);
static void sort_best_first(int32_t *c, int n, const float *l);
/* c[0..k) = the k best ids of l[0..V) (0 < k < V), in heap order (the caller sorts them): one pass
 * keeping the k best so far in a heap whose root is the worst of them. Ids come ascending, so a later id ties below every id
 * kept and beats the root only with a larger value: one float compare per id in the common case.
 * The same set as select_top over all V ids (which touches each id several times through the
 * candidate array: ~1 ms over GLM-5.2's 154880 ids, ~0.1 ms here). */
static void heap_top(int32_t *c, int V, int k, const float *l) {
    for (int i = 0; i < k; i++) c[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--) sift(c, i, k, l);
    float thr = l[c[0]];
    for (int i = k; i < V; i++)
        if (l[i] > thr) {
            c[0] = i;
            sift(c, 0, k, l);
            thr = l[c[0]];
        }
}

/* Heapsort of c[0..n), best first (no allocation). */
static void sift(int32_t *c, int root, int n, const float *l) {
    for (;;) {
        int ch = 2 * root + 1;
        if (ch >= n) return;
        /* min-heap on "better": the worst element at the root, so the sort ends best first */
        if (ch + 1 < n && better(l, c[ch], c[ch + 1])) ch++;
        if (!better(l, c[root], c[ch])) return;
        swp(c, root, ch);
        root = ch;
    }
}
static void sort_best_first(int32_t *c, int n, const float *l) {
    for (int i = n / 2 - 1; i >= 0; i--) sift(c, i, n, l);
    for (int e = n - 1; e > 0; e--) {
        swp(c, 0, e);
        sift(c, 0, e, l);
    }
}

/* Top-p over many candidates (no top-k, or a large one): a histogram of the probabilities by
 * d = mx - l (16 buckets per unit, exp(-d) falling by e per unit; -inf in the last) finds the
 * buckets that hold the nucleus' mass, with one bucket to spare; their ids are moved to the
 * front, sorted best first, and summed in that order as the incremental search below would.
 * Larger l means a lower bucket and equal l the same one, so the front is the head of the
 * best-first order, and the kept set, its order and its sum are the ones the incremental search
 * finds alone (it goes on from the front when rounding left the mass short). Over GLM-5.2's
 * 154880 ids the incremental search alone took ~6 ms per token. Returns the front's size. */
enum { NUC_B = 2048, NUC_PER_UNIT = 16 };
static inline int nuc_bucket(float d) { return d < (float)(NUC_B - 1) / NUC_PER_UNIT ? (int)(d * NUC_PER_UNIT) : NUC_B - 1; }
static int nucleus_front(sampler *s, int32_t *c, int n, const float *l, float mx, double target, double *cum, int *m, int *hit) {
    double mass[NUC_B] = {0};
    for (int i = 0; i < n; i++) mass[nuc_bucket(mx - l[c[i]])] += s->prob[c[i]];
    int b = 0;
    for (double acc = 0; b < NUC_B - 1; b++)
        if ((acc += mass[b]) >= target) break;
    if (b < NUC_B - 1) b++; /* one bucket to spare against rounding */
    int f = 0;
    for (int i = 0; i < n; i++)
        if (nuc_bucket(mx - l[c[i]]) <= b) swp(c, f++, i);
    sort_best_first(c, f, l);
    for (int i = 0; i < f && !*hit; i++) {
        *cum += s->prob[c[i]];
        if (*cum >= target) { *m = i + 1; *hit = 1; }
    }
    return f;
}

/* Steps 3-6 on already-penalized logits. */
static int filter_core(sampler *s, float *l, int V, float temp) {
    const sampler_params *p = &s->p;
    float inv = 1.0f / temp;
    int32_t *c = s->cand;
    int n = V, small_k = p->top_k > 0 && p->top_k < V && p->top_k <= 4096;
    for (int i = 0; i < V; i++) {
        float x = l[i];
        l[i] = x != x ? -INFINITY : x * inv;
    }
    if (small_k) {
        heap_top(c, V, p->top_k, l);
        n = p->top_k;
        sort_best_first(c, n, l); /* a canonical order for the sums below */
    } else {
        for (int i = 0; i < V; i++) c[i] = i;
        if (p->top_k > 0 && p->top_k < V) {
            select_top(c, V, p->top_k, l);
            n = p->top_k;
        }
    }
    int32_t best = c[0];
    for (int i = 1; i < n; i++)
        if (better(l, c[i], best)) best = c[i];
    float mx = l[best];
    if (mx == -INFINITY) { /* nothing is possible: keep the best-ranked id alone */
        c[0] = best;
        s->prob[best] = 1.0f;
        s->kept_sum = 1.0;
        return s->n_kept = 1;
    }
    double sum = 0;
    for (int i = 0; i < n; i++) {
        float e = expf(l[c[i]] - mx);
        s->prob[c[i]] = e;
        sum += e;
    }
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        double target = (double)p->top_p * sum, cum = 0;
        int sorted = 0, m = n, hit = 0;
        if (n > 4096) sorted = nucleus_front(s, c, n, l, mx, target, &cum, &m, &hit);
        while (sorted < n && !hit) {
            int want = sorted < 32 ? 64 : sorted * 2;
            if (want > n) want = n;
            if (want < n) select_top(c + sorted, n - sorted, want - sorted, l);
            sort_best_first(c + sorted, want - sorted, l);
            for (int i = sorted; i < want && !hit; i++) {
                cum += s->prob[c[i]];
                if (cum >= target) { m = i + 1; hit = 1; }
            }
            sorted = want;
        }
        n = m;
        if (hit) sum = cum; /* the mass of c[0..m) */
    }
    if (p->min_p > 0.0f) {
        float thresh = p->min_p; /* the highest probability is exp(0) = 1 */
        int m = 0;
        sum = 0;
        for (int i = 0; i < n; i++)
            if (s->prob[c[i]] >= thresh) {
                c[m++] = c[i];
                sum += s->prob[c[i]];
            }
        n = m; /* the best token (prob 1) always stays */
    }
    s->kept_sum = sum;
    return s->n_kept = n;
}

int sampler_filter(sampler *s, float *logits, int vocab) {
    if (vocab > s->vocab) vocab = s->vocab;
    sampler_apply_penalties(s, logits, vocab);
    float t = s->p.temperature > 0.0f ? s->p.temperature : 1.0f;
    return filter_core(s, logits, vocab, t);
}

int32_t sampler_sample(sampler *s, float *logits, int vocab) {
    if (vocab > s->vocab) vocab = s->vocab;
    if (vocab <= 0) return 0;
    sampler_apply_penalties(s, logits, vocab);
    if (s->p.temperature <= 0.0f || s->p.top_k == 1) return (int32_t)kn_argmax(logits, vocab); /* NaN never wins; ties: lowest id */
    int n = filter_core(s, logits, vocab, s->p.temperature);
    double r = sampler_uniform(s) * s->kept_sum, cum = 0;
    for (int i = 0; i < n; i++) {
        cum += s->prob[s->cand[i]];
        if (r < cum) return s->cand[i];
    }
    return s->cand[n - 1];
}
