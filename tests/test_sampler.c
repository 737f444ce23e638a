/* test_sampler.c: the token sampler (group "sampler": greedy, seeds, the empirical distribution,
 * top-k / top-p / min-p sets, penalties), the generation loop on the tiny model (group
 * "generate": seeded runs repeat, greedy text equals a plain argmax loop, prompt-prefix reuse)
 * the chat helpers (group "chat": thinking split, UTF-8 cleaning, rendering) and the run / chat
 * command contracts as subprocesses (group "cli_run", needs $PETREL_BIN like tests/test_cli.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "model/config.h"
#include "runtime/chat.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "test.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

static sampler_params neutral(void) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    return p;
}

/* A small deterministic generator for test data (independent of the sampler's). */
static uint64_t trng = 88172645463325252ULL;
static double trand(void) {
    trng ^= trng << 13;
    trng ^= trng >> 7;
    trng ^= trng << 17;
    return (double)(trng >> 11) * 0x1.0p-53;
}
static void rand_logits(float *l, int V, double scale) {
    for (int i = 0; i < V; i++) l[i] = (float)((trand() * 2 - 1) * scale);
}
static int argmax(const float *l, int V) {
    int b = 0;
    for (int i = 1; i < V; i++) if (l[i] > l[b]) b = i;
    return b;
}

TEST(sampler, greedy_is_argmax) {
    enum { V = 3000 };
    float *l = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V);
    sampler s;
    sampler_params p = neutral();
    p.temperature = 0;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    for (int t = 0; t < 50; t++) {
        rand_logits(l, V, 10);
        memcpy(c, l, sizeof(float) * V);
        CHECK_EQ_INT(sampler_sample(&s, c, V), argmax(l, V));
    }
    /* ties: the lowest id */
    for (int i = 0; i < V; i++) l[i] = 0;
    l[17] = l[900] = 5;
    CHECK_EQ_INT(sampler_sample(&s, l, V), 17);
    sampler_free(&s);
    free(l);
    free(c);
}

TEST(sampler, top_k_1_is_greedy) {
    enum { V = 2000 };
    float *l = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V);
    sampler s;
    sampler_params p = neutral();
    p.top_k = 1;
    p.temperature = 1.5f;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    for (int t = 0; t < 50; t++) {
        rand_logits(l, V, 3);
        memcpy(c, l, sizeof(float) * V);
        CHECK_EQ_INT(sampler_sample(&s, c, V), argmax(l, V));
    }
    sampler_free(&s);
    /* the same through the filter path: top_k 1 keeps exactly the argmax */
    p.top_k = 1;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    rand_logits(l, V, 3);
    memcpy(c, l, sizeof(float) * V);
    CHECK_EQ_INT(sampler_filter(&s, c, V), 1);
    CHECK_EQ_INT(s.cand[0], argmax(l, V));
    sampler_free(&s);
    free(l);
    free(c);
}

static void draw_seq(uint64_t seed, int32_t *out, int n, const float *l, int V) {
    sampler s;
    sampler_params p;
    sampler_params_default(&p);
    p.seed = seed;
    p.temperature = 1.2f;
    p.top_k = 0;
    p.top_p = 0.99f;
    p.min_p = 0.0f;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    float *c = malloc(sizeof(float) * V);
    for (int i = 0; i < n; i++) {
        memcpy(c, l, sizeof(float) * V);
        out[i] = sampler_sample(&s, c, V);
    }
    free(c);
    sampler_free(&s);
}

TEST(sampler, seed_repeats_and_differs) {
    enum { V = 500, N = 400 };
    float l[V];
    rand_logits(l, V, 2);
    int32_t a[N], b[N], c[N];
    draw_seq(42, a, N, l, V);
    draw_seq(42, b, N, l, V);
    draw_seq(43, c, N, l, V);
    CHECK(!memcmp(a, b, sizeof a));
    int diff = 0;
    for (int i = 0; i < N; i++) diff += a[i] != c[i];
    CHECK_MSG(diff > N / 2, "seeds 42 and 43 agree on %d of %d draws", N - diff, N);
    /* sampler_reset restarts the same stream */
    sampler s;
    sampler_params p = neutral();
    p.seed = 9;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    double u1 = sampler_uniform(&s), u2 = sampler_uniform(&s);
    sampler_reset(&s, 9);
    CHECK(sampler_uniform(&s) == u1);
    CHECK(sampler_uniform(&s) == u2);
    CHECK(u1 >= 0 && u1 < 1 && u1 != u2);
    sampler_free(&s);
}

/* Draws n times and compares the frequencies with want[] (max abs diff). */
static double freq_err(const sampler_params *p, const float *l, int V, const double *want, int n) {
    sampler s;
    CHECK(sampler_init(&s, p, V, NULL) == 0);
    double *cnt = calloc((size_t)V, sizeof(double));
    float *c = malloc(sizeof(float) * V);
    for (int i = 0; i < n; i++) {
        memcpy(c, l, sizeof(float) * V);
        int32_t id = sampler_sample(&s, c, V);
        CHECK(id >= 0 && id < V);
        if (id >= 0 && id < V) cnt[id]++;
    }
    double worst = 0;
    for (int i = 0; i < V; i++) {
        double d = fabs(cnt[i] / n - want[i]);
        if (d > worst) worst = d;
    }
    free(cnt);
    free(c);
    sampler_free(&s);
    return worst;
}

TEST(sampler, empirical_distribution) {
    enum { V = 6, N = 100000 };
    const float l[V] = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 0.0f};
    double want[V], z = 0;
    /* temperature 1, nothing else: the softmax */
    for (int i = 0; i < V; i++) z += exp(l[i]);
    for (int i = 0; i < V; i++) want[i] = exp(l[i]) / z;
    sampler_params p = neutral();
    p.seed = 1234;
    double e = freq_err(&p, l, V, want, N);
    CHECK_MSG(e < 0.006, "softmax frequencies off by %.4f", e);
    /* temperature 0.5 and top-k 3: softmax(l / 0.5) over ids 4, 1, 0 */
    z = 0;
    for (int i = 0; i < V; i++) want[i] = (i == 4 || i == 1 || i == 0) ? exp(l[i] / 0.5) : 0;
    for (int i = 0; i < V; i++) z += want[i];
    for (int i = 0; i < V; i++) want[i] /= z;
    p.temperature = 0.5f;
    p.top_k = 3;
    p.seed = 99;
    e = freq_err(&p, l, V, want, N);
    CHECK_MSG(e < 0.006, "temperature + top-k frequencies off by %.4f", e);
}

/* logits = log(prob) so that the softmax gives back prob */
static void logits_of(const double *prob, float *l, int V) {
    for (int i = 0; i < V; i++) l[i] = (float)log(prob[i]);
}

static int kept_set(sampler *s, const float *l0, int V, int32_t *ids) {
    float *c = malloc(sizeof(float) * V);
    memcpy(c, l0, sizeof(float) * V);
    int n = sampler_filter(s, c, V);
    memcpy(ids, s->cand, sizeof(int32_t) * (size_t)n);
    free(c);
    return n;
}

TEST(sampler, top_p_smallest_set) {
    enum { V = 5 };
    const double prob[V] = {0.15, 0.4, 0.05, 0.3, 0.1};
    float l[V];
    logits_of(prob, l, V);
    struct { float p; int n; int32_t ids[5]; } cases[] = {
        {0.30f, 1, {1}}, {0.65f, 2, {1, 3}}, {0.72f, 3, {1, 3, 0}}, {0.90f, 4, {1, 3, 0, 4}}, {0.97f, 5, {1, 3, 0, 4, 2}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        sampler s;
        sampler_params p = neutral();
        p.top_p = cases[k].p;
        CHECK(sampler_init(&s, &p, V, NULL) == 0);
        int32_t ids[V];
        int n = kept_set(&s, l, V, ids);
        CHECK_EQ_INT(n, cases[k].n);
        double mass = 0;
        for (int i = 0; i < n && i < cases[k].n; i++) {
            CHECK_EQ_INT(ids[i], cases[k].ids[i]);
            mass += prob[ids[i]];
        }
        for (int i = 0; i < n; i++) CHECK_NEAR(sampler_prob(&s, ids[i]), prob[ids[i]] / mass, 1e-5);
        sampler_free(&s);
    }
}

static const float *g_ref;
static int cmp_desc(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (g_ref[x] != g_ref[y]) return g_ref[x] > g_ref[y] ? -1 : 1;
    return x < y ? -1 : 1;
}

/* A sampler for p, and sampler_filter over a copy c of l: the kept count, -1 if init failed. */
static int filtered(sampler *s, const sampler_params *p, const float *l, float *c, int V) {
    if (sampler_init(s, p, V, NULL) != 0) return -1;
    memcpy(c, l, sizeof(float) * (size_t)V);
    return sampler_filter(s, c, V);
}

/* On a large vocabulary (the chunked partial sort), against a full sort. */
TEST(sampler, top_p_large_vocab) {
    enum { V = 50000 };
    float *l = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V);
    int32_t *order = malloc(sizeof(int32_t) * V);
    const float ps[] = {0.1f, 0.5f, 0.9f, 0.999f};
    for (int t = 0; t < 4; t++) {
        rand_logits(l, V, 6);
        for (int i = 0; i < V; i++) order[i] = i;
        g_ref = l;
        qsort(order, V, sizeof(int32_t), cmp_desc);
        double z = 0, mx = l[order[0]];
        for (int i = 0; i < V; i++) z += exp((double)l[i] - mx);
        int want = V;
        double cum = 0;
        for (int i = 0; i < V; i++) {
            cum += exp((double)l[order[i]] - mx) / z;
            if (cum >= ps[t]) { want = i + 1; break; }
        }
        sampler s;
        sampler_params p = neutral();
        p.top_p = ps[t];
        int n = filtered(&s, &p, l, c, V);
        CHECK(n >= 0);
        /* float vs double sums may move the edge by one token whose mass is tiny */
        CHECK_MSG(abs(n - want) <= 1, "top_p %g: kept %d, want %d", (double)ps[t], n, want);
        int m = n < want ? n : want, same = 1;
        for (int i = 0; i < m; i++) same &= s.cand[i] == order[i];
        CHECK_MSG(same, "top_p %g: kept set is not the head of the sorted order", (double)ps[t]);
        sampler_free(&s);
    }
    free(l);
    free(c);
    free(order);
}

TEST(sampler, top_k_set) {
    enum { V = 1000 };
    float l[V];
    for (int i = 0; i < V; i++) l[i] = (float)(i % 97); /* many ties */
    sampler s;
    sampler_params p = neutral();
    p.top_k = 25;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    int32_t ids[V];
    int n = kept_set(&s, l, V, ids);
    CHECK_EQ_INT(n, 25);
    /* ranking: value desc, then id asc */
    int32_t order[V];
    for (int i = 0; i < V; i++) order[i] = i;
    g_ref = l;
    qsort(order, V, sizeof(int32_t), cmp_desc);
    int hit[V] = {0};
    for (int i = 0; i < n; i++) hit[ids[i]] = 1;
    for (int i = 0; i < 25; i++) CHECK_MSG(hit[order[i]], "top-k lost id %d", order[i]);
    sampler_free(&s);
}

/* Top-p over a whole large vocabulary (the histogram front, then the incremental search) against
 * the rule computed directly: the best-first order, expf(l / T - max) per id, the total summed in
 * id order and the nucleus summed best first in double; the same kept ids in the same order and
 * the same mass, bit for bit. */
TEST(sampler, top_p_exact_large_vocab) {
    enum { V = 154880 };
    float *l = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V), *sc = malloc(sizeof(float) * V);
    int32_t *order = malloc(sizeof(int32_t) * V);
    const float ps[] = {0.05f, 0.5f, 0.9f, 0.95f, 0.999f};
    const float temps[] = {0.7f, 1.0f, 0.2f};
    for (int t = 0; t < 5; t++) {
        rand_logits(l, V, 4 + 3 * t);
        for (int i = 0; i < V; i += 97) l[i] = NAN;
        for (int i = 5; i < V; i += 101) l[i] = -INFINITY;
        for (int i = 7; i < V; i += 7) l[i] = l[i - 7]; /* ties */
        float T = temps[t % 3], inv = 1.0f / T;
        for (int i = 0; i < V; i++) sc[i] = l[i] != l[i] ? -INFINITY : l[i] * inv;
        for (int i = 0; i < V; i++) order[i] = i;
        g_ref = sc;
        qsort(order, V, sizeof(int32_t), cmp_desc);
        float mx = sc[order[0]];
        double sum = 0;
        for (int i = 0; i < V; i++) sum += expf(sc[i] - mx);
        double target = (double)ps[t] * sum, cum = 0;
        int want = V;
        for (int i = 0; i < V; i++) {
            cum += expf(sc[order[i]] - mx);
            if (cum >= target) { want = i + 1; break; }
        }
        sampler s;
        sampler_params p = neutral();
        p.temperature = T;
        p.top_p = ps[t];
        int n = filtered(&s, &p, l, c, V);
        CHECK(n >= 0);
        CHECK_EQ_INT(n, want);
        int same = n == want;
        for (int i = 0; i < n && same; i++) same = s.cand[i] == order[i];
        CHECK_MSG(same, "top_p %g: kept ids differ from the best-first order", (double)ps[t]);
        CHECK_MSG(s.kept_sum == cum, "top_p %g: kept mass %.17g, want %.17g", (double)ps[t], s.kept_sum, cum);
        sampler_free(&s);
    }
    free(l); free(c); free(sc); free(order);
}

/* The one-pass heap for top-k up to 4096 against a full sort, over GLM-5.2's vocabulary: values
 * on a coarse grid (ties everywhere), NaNs and -inf among them, k from 1 to 4096 (and past the
 * heap's range: the quickselect path); the kept ids come best first. */
TEST(sampler, top_k_large_vocab) {
    enum { V = 154880 };
    float *l = malloc(sizeof(float) * V), *c = malloc(sizeof(float) * V);
    int32_t *ids = malloc(sizeof(int32_t) * V), *order = malloc(sizeof(int32_t) * V);
    uint64_t r = 12345;
    for (int i = 0; i < V; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t u = (uint32_t)(r >> 33);
        l[i] = u % 53 == 0 ? NAN : u % 61 == 0 ? -INFINITY : (float)(u % 300) * 0.25f - 40.f;
    }
    /* the reference ranks NaN as -inf, as the sampler does */
    float *rk = malloc(sizeof(float) * V);
    for (int i = 0; i < V; i++) rk[i] = l[i] != l[i] ? -INFINITY : l[i];
    for (int i = 0; i < V; i++) order[i] = i;
    g_ref = rk;
    qsort(order, V, sizeof(int32_t), cmp_desc);
    static const int ks[] = {1, 2, 3, 40, 97, 1000, 4096, 5000};
    for (int ki = 0; ki < 8; ki++) {
        sampler s;
        sampler_params p = neutral();
        p.top_k = ks[ki];
        int n = filtered(&s, &p, l, c, V);
        CHECK(n >= 0);
        CHECK_EQ_INT(n, ks[ki]);
        int same = 1;
        for (int i = 0; i < n; i++) same &= ks[ki] > 4096 || s.cand[i] == order[i]; /* best first in the heap path */
        CHECK_MSG(same, "k=%d: kept ids not the reference's best-first order", ks[ki]);
        memset(ids, 0, sizeof(int32_t) * V);
        for (int i = 0; i < n; i++) ids[s.cand[i]] = 1;
        int lost = 0;
        for (int i = 0; i < n; i++) lost += !ids[order[i]];
        CHECK_MSG(lost == 0, "k=%d: %d of the top ids lost", ks[ki], lost);
        sampler_free(&s);
    }
    free(l); free(c); free(ids); free(order); free(rk);
}

TEST(sampler, min_p_threshold) {
    enum { V = 6 };
    const double prob[V] = {0.04, 0.5, 0.1, 0.2, 0.06, 0.1};
    float l[V];
    logits_of(prob, l, V);
    sampler s;
    sampler_params p = neutral();
    p.min_p = 0.15f; /* threshold 0.075: keeps 0.5, 0.2, 0.1, 0.1 */
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    int32_t ids[V];
    int n = kept_set(&s, l, V, ids);
    CHECK_EQ_INT(n, 4);
    int hit[V] = {0};
    for (int i = 0; i < n; i++) hit[ids[i]] = 1;
    CHECK(hit[1] && hit[2] && hit[3] && hit[5] && !hit[0] && !hit[4]);
    for (int i = 0; i < n; i++) CHECK_NEAR(sampler_prob(&s, ids[i]), prob[ids[i]] / 0.9, 1e-5);
    sampler_free(&s);
    /* after top-p: top_p 0.75 keeps {1, 3, 2 or 5}; min_p 0.3 (threshold 0.15) then keeps {1, 3} */
    p.top_p = 0.75f;
    p.min_p = 0.3f;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    n = kept_set(&s, l, V, ids);
    CHECK_EQ_INT(n, 2);
    CHECK(n == 2 && ids[0] == 1 && ids[1] == 3);
    sampler_free(&s);
}

TEST(sampler, penalties_exact) {
    enum { V = 8 };
    sampler s;
    sampler_params p = neutral();
    p.repeat_penalty = 2.0f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.penalty_last_n = 4;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    const int32_t hist[] = {6, 3, 3, 5, 3}; /* window of 4: 3, 3, 5, 3 -> counts 3:3, 5:1 */
    for (int i = 0; i < 5; i++) sampler_accept(&s, hist[i]);
    float l[V] = {1, 1, 1, 2.0f, 1, -1.0f, 4.0f, 0};
    sampler_apply_penalties(&s, l, V);
    CHECK_NEAR(l[3], 2.0 / 2 - (3 * 0.25 + 0.5), 1e-6);  /* positive: divided */
    CHECK_NEAR(l[5], -1.0 * 2 - (1 * 0.25 + 0.5), 1e-6); /* negative: multiplied */
    CHECK_NEAR(l[6], 4.0, 0);                            /* fell out of the window */
    CHECK_NEAR(l[0], 1.0, 0);
    CHECK_NEAR(l[7], 0.0, 0);
    /* applying twice applies twice (counts restored after the first) */
    sampler_apply_penalties(&s, l, V);
    CHECK_NEAR(l[3], -0.25 * 2 - 1.25, 1e-6);
    /* each alone */
    sampler_free(&s);
    struct { float r, pr, f; float in, out; } one[] = {
        {1.5f, 0, 0, 3.0f, 2.0f}, {1.5f, 0, 0, -3.0f, -4.5f}, {1, 0.7f, 0, 1.0f, 0.3f}, {1, 0, 0.5f, 1.0f, 0.0f},
    };
    for (size_t k = 0; k < sizeof one / sizeof one[0]; k++) {
        p = neutral();
        p.repeat_penalty = one[k].r;
        p.presence_penalty = one[k].pr;
        p.frequency_penalty = one[k].f;
        CHECK(sampler_init(&s, &p, V, NULL) == 0);
        sampler_accept(&s, 2);
        sampler_accept(&s, 2);
        float x[V] = {0};
        x[2] = one[k].in;
        x[1] = one[k].in;
        sampler_apply_penalties(&s, x, V);
        /* frequency counts 2 occurrences: 1 - 2 * 0.5 = 0 */
        CHECK_NEAR(x[2], one[k].out, 1e-6);
        CHECK_NEAR(x[1], one[k].in, 0);
        sampler_free(&s);
    }
    /* defaults are off: nothing changes */
    sampler_params_default(&p);
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    sampler_accept(&s, 1);
    float x[V] = {0, 2.5f};
    sampler_apply_penalties(&s, x, V);
    CHECK(x[1] == 2.5f);
    sampler_free(&s);
}

TEST(sampler, penalty_changes_greedy_pick) {
    enum { V = 4 };
    sampler s;
    sampler_params p = neutral();
    p.temperature = 0;
    p.repeat_penalty = 3.0f;
    CHECK(sampler_init(&s, &p, V, NULL) == 0);
    float l[V] = {0, 3.0f, 2.0f, 0};
    sampler_accept(&s, 1);
    CHECK_EQ_INT(sampler_sample(&s, l, V), 2);
    sampler_free(&s);
}

TEST(sampler, bad_params_and_nan) {
    sampler s;
    petrel_error err = {0};
    sampler_params p = neutral();
    p.repeat_penalty = 0;
    CHECK(sampler_init(&s, &p, 10, &err) == PETREL_EINVAL);
    CHECK(strstr(err.msg, "repeat_penalty") != NULL);
    p = neutral();
    p.min_p = 2;
    CHECK(sampler_init(&s, &p, 10, &err) == PETREL_EINVAL);
    p = neutral();
    p.temperature = NAN;
    CHECK(sampler_init(&s, &p, 10, &err) == PETREL_EINVAL);
    p = neutral();
    CHECK(sampler_init(&s, &p, 0, &err) == PETREL_EINVAL);
    /* NaN logits are never picked; all -inf still returns an id in range */
    CHECK(sampler_init(&s, &p, 4, &err) == 0);
    for (int t = 0; t < 100; t++) {
        float l[4] = {NAN, 1.0f, NAN, 0.5f};
        int32_t id = sampler_sample(&s, l, 4);
        CHECK(id == 1 || id == 3);
    }
    float l[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int32_t id = sampler_sample(&s, l, 4);
    CHECK(id >= 0 && id < 4);
    sampler_free(&s);
}

/* ---- generation on the tiny model ---- */

typedef struct { char *text; size_t n, cap; int32_t ids[512]; int n_ids; } collect;
static int collect_piece(void *u, int32_t id, const char *b, size_t n) {
    collect *c = u;
    if (id >= 0 && c->n_ids < 512) c->ids[c->n_ids++] = id;
    if (c->n + n + 1 > c->cap) {
        c->cap = (c->n + n + 1) * 2;
        c->text = realloc(c->text, c->cap);
    }
    memcpy(c->text + c->n, b, n);
    c->n += n;
    c->text[c->n] = 0;
    return 0;
}

typedef struct { petrel_engine *eng; tokenizer *tok; } tiny;
static int tiny_open(tiny *t) {
    petrel_error err = {0};
    memset(t, 0, sizeof *t);
    if (petrel_engine_open(test_data("tiny"), NULL, &t->eng, &err)) { test_fail(__FILE__, __LINE__, "open: %s", err.msg); return -1; }
    if (tok_load(test_data("tiny/tokenizer.json"), &t->tok, &err)) {
        test_fail(__FILE__, __LINE__, "tokenizer: %s", err.msg);
        petrel_engine_close(t->eng);
        return -1;
    }
    return 0;
}
static void tiny_close(tiny *t) {
    tok_free(t->tok);
    petrel_engine_close(t->eng);
}

static const char PROMPT[] = "The quick brown fox <|user|> jumps over the lazy dog.";

TEST(generate, seeded_runs_repeat) {
    tiny t;
    if (tiny_open(&t)) return;
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1.0f;
    p.seed = 2024;
    gen_opts o = {.max_tokens = 24};
    collect a = {0}, b = {0}, c = {0};
    gen_stats st;
    petrel_error err = {0};
    CHECK(generate_text(t.eng, t.tok, PROMPT, strlen(PROMPT), &p, &o, collect_piece, &a, &st, &err) == 0);
    CHECK(generate_text(t.eng, t.tok, PROMPT, strlen(PROMPT), &p, &o, collect_piece, &b, &st, &err) == 0);
    p.seed = 2025;
    CHECK(generate_text(t.eng, t.tok, PROMPT, strlen(PROMPT), &p, &o, collect_piece, &c, &st, &err) == 0);
    CHECK(a.n_ids > 0 && a.text);
    CHECK(a.n == b.n && a.text && b.text && !memcmp(a.text, b.text, a.n));
    CHECK(a.n_ids == b.n_ids && !memcmp(a.ids, b.ids, sizeof(int32_t) * (size_t)a.n_ids));
    CHECK_MSG(a.n_ids != c.n_ids || memcmp(a.ids, c.ids, sizeof(int32_t) * (size_t)a.n_ids), "seeds 2024 and 2025 gave the same ids");
    free(a.text);
    free(b.text);
    free(c.text);
    tiny_close(&t);
}

TEST(generate, greedy_matches_argmax_loop) {
    tiny t;
    if (tiny_open(&t)) return;
    enum { N = 40 };
    petrel_error err = {0};
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0;
    gen_opts o = {.max_tokens = N};
    collect got = {0};
    gen_stats st;
    CHECK(generate_text(t.eng, t.tok, PROMPT, strlen(PROMPT), &p, &o, collect_piece, &got, &st, &err) == 0);
    /* the reference: plain argmax over petrel_session_forward, skipping ids with no text */
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK(tok_encode(t.tok, PROMPT, strlen(PROMPT), &ids, &n, &err) == 0);
    CHECK_EQ_INT(st.n_prompt, (int)n);
    const petrel_config *cfg = petrel_engine_config(t.eng);
    int V = cfg->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)V);
    petrel_session *s;
    CHECK(petrel_session_create(t.eng, (int)n + N, &s, &err) == 0);
    CHECK(petrel_session_forward(s, ids, (int)n, lg, 0, &err) == 0);
    int32_t ref[N];
    int nr = 0;
    for (int g = 0; g < N; g++) {
        int32_t best = -1;
        for (int v = 0; v < V; v++) {
            size_t bl;
            if (!tok_id_to_bytes(t.tok, v, &bl)) continue;
            if (best < 0 || lg[v] > lg[best]) best = v;
        }
        if (config_is_eos(cfg, best)) break;
        ref[nr++] = best;
        if (petrel_session_forward(s, &best, 1, lg, 0, &err)) break;
    }
    CHECK(nr > 0);
    CHECK_EQ_INT(got.n_ids, nr);
    CHECK(got.n_ids == nr && !memcmp(got.ids, ref, sizeof(int32_t) * (size_t)nr));
    char *text = NULL;
    size_t tl = 0;
    CHECK(tok_decode(t.tok, ref, (size_t)nr, &text, &tl, &err) == 0);
    CHECK_EQ_INT(got.n, tl);
    CHECK(got.text && text && got.n == tl && !memcmp(got.text, text, tl));
    CHECK(st.stop == (nr == N ? GEN_STOP_LENGTH : GEN_STOP_EOS));
    free(text);
    free(got.text);
    petrel_session_free(s);
    free(lg);
    free(ids);
    tiny_close(&t);
}

/* gen_prompt keeps the common prefix: continuing after reuse equals a fresh run. */
TEST(generate, prefix_reuse) {
    tiny t;
    if (tiny_open(&t)) return;
    petrel_error err = {0};
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0;
    gen_opts o = {.max_tokens = 8};
    int32_t a[] = {5, 17, 300, 42, 7, 99, 100}, b[] = {5, 17, 300, 42, 8, 200};
    gen_ctx g, f;
    gen_stats st;
    CHECK(gen_init(&g, t.eng, t.tok, 64, &p, &err) == 0);
    CHECK(gen_prompt(&g, a, 7, &st, &err) == 0);
    CHECK_EQ_INT(st.n_reused, 0);
    collect c1 = {0}, c2 = {0}, c3 = {0};
    CHECK(gen_generate(&g, &o, collect_piece, &c1, &st, &err) == 0);
    CHECK(gen_prompt(&g, b, 6, &st, &err) == 0);
    CHECK_EQ_INT(st.n_reused, 4);
    CHECK(gen_generate(&g, &o, collect_piece, &c2, &st, &err) == 0);
    CHECK(gen_init(&f, t.eng, t.tok, 64, &p, &err) == 0);
    CHECK(gen_prompt(&f, b, 6, &st, &err) == 0);
    CHECK(gen_generate(&f, &o, collect_piece, &c3, &st, &err) == 0);
    CHECK(c2.n_ids == c3.n_ids && !memcmp(c2.ids, c3.ids, sizeof(int32_t) * (size_t)c2.n_ids));
    /* the same prompt again: all but the last reused, same continuation */
    collect c4 = {0};
    CHECK(gen_prompt(&f, b, 6, &st, &err) == 0);
    CHECK_EQ_INT(st.n_reused, 5);
    CHECK(gen_generate(&f, &o, collect_piece, &c4, &st, &err) == 0);
    CHECK(c4.n_ids == c3.n_ids && !memcmp(c4.ids, c3.ids, sizeof(int32_t) * (size_t)c3.n_ids));
    /* a prompt longer than the context */
    int32_t big[80] = {0};
    CHECK(gen_prompt(&f, big, 80, &st, &err) == PETREL_ERANGE);
    /* a full context stops generation */
    gen_opts lots = {.max_tokens = -1};
    CHECK(gen_prompt(&f, b, 6, &st, &err) == 0);
    collect c5 = {0};
    CHECK(gen_generate(&f, &lots, collect_piece, &c5, &st, &err) == 0);
    CHECK(st.stop == GEN_STOP_CONTEXT || st.stop == GEN_STOP_EOS);
    if (st.stop == GEN_STOP_CONTEXT) CHECK_EQ_INT(st.n_gen, 64 - 6 + 1);
    gen_free(&g);
    gen_free(&f);
    free(c1.text);
    free(c2.text);
    free(c3.text);
    free(c4.text);
    free(c5.text);
    tiny_close(&t);
}

/* ---- chat helpers ---- */

typedef struct { char think[256], answer[256]; } split_out;
static void split_cb(void *u, int thinking, const char *b, size_t n) {
    split_out *o = u;
    strncat(thinking ? o->think : o->answer, b, n);
}

TEST(chat, think_split) {
    tokenizer *tok;
    petrel_error err = {0};
    if (tok_load(test_data("tiny/tokenizer.json"), &tok, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    int32_t open = tok_token_to_id(tok, "<think>"), close = tok_token_to_id(tok, "</think>");
    CHECK(open >= 0 && close >= 0);
    chat_split cs;
    split_out o = {{0}, {0}};
    chat_split_init(&cs, tok, 1); /* the prompt ended with <think> */
    chat_split_piece(&cs, 100, "let me ", 7, split_cb, &o);
    chat_split_piece(&cs, 101, "see", 3, split_cb, &o);
    chat_split_piece(&cs, close, "!</think>", 9, split_cb, &o); /* a held-back byte + the tag */
    chat_split_piece(&cs, 102, "Hi.", 3, split_cb, &o);
    CHECK(!strcmp(o.think, "let me see!"));
    CHECK(!strcmp(o.answer, "Hi."));
    memset(&o, 0, sizeof o);
    chat_split_init(&cs, tok, 0);
    chat_split_piece(&cs, 102, "a", 1, split_cb, &o);
    chat_split_piece(&cs, open, "<think>", 7, split_cb, &o);
    chat_split_piece(&cs, 102, "b", 1, split_cb, &o);
    chat_split_piece(&cs, close, "</think>", 8, split_cb, &o);
    chat_split_piece(&cs, 102, "c", 1, split_cb, &o);
    CHECK(!strcmp(o.think, "b"));
    CHECK(!strcmp(o.answer, "ac"));
    CHECK(chat_ends_in_think("x<|assistant|><think>", 21));
    CHECK(!chat_ends_in_think("x<|assistant|><think></think>", 29));
    CHECK(!chat_ends_in_think("plain", 5));
    tok_free(tok);
}

TEST(chat, utf8_clean) {
    char *s = chat_utf8_clean("a\xff" "b\xe2\x82\xac" "c\xe2\x82", 9);
    CHECK(s && !strcmp(s, "a\xef\xbf\xbd" "b\xe2\x82\xac" "c\xef\xbf\xbd\xef\xbf\xbd"));
    free(s);
    s = chat_utf8_clean("\xed\xa0\x80", 3); /* a surrogate */
    CHECK(s && !strcmp(s, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"));
    free(s);
}

TEST(chat, render_tiny_template) {
    petrel_error err = {0};
    char *src = NULL;
    size_t sl = 0;
    CHECK(jinja_load_chat_template(test_data("tiny"), &src, &sl, &err) == 0);
    jinja_template *t = NULL;
    CHECK(src && jinja_compile(src, sl, &t, &err) == 0);
    free(src);
    if (!t) return;
    cJSON *m = cJSON_CreateArray();
    CHECK(chat_add_message(m, "system", "Be brief.", NULL, &err) == 0);
    CHECK(chat_add_message(m, "user", "Hi", NULL, &err) == 0);
    char *out = NULL;
    size_t n = 0;
    CHECK(chat_render(t, m, 1, 0, &out, &n, &err) == 0);
    CHECK_MSG(out && strstr(out, "<|system|>Be brief.<|user|>Hi<|assistant|><think></think>"), "rendered: %s", out ? out : "(null)");
    CHECK(out && !chat_ends_in_think(out, n));
    free(out);
    CHECK(chat_render(t, m, 1, 1, &out, &n, &err) == 0);
    CHECK(out && chat_ends_in_think(out, n));
    free(out);
    CHECK(chat_add_message(m, "assistant", "Hello.", "thought", &err) == 0);
    CHECK(chat_add_message(m, "user", "Again", NULL, &err) == 0);
    CHECK(chat_render(t, m, 1, 0, &out, &n, &err) == 0);
    CHECK_MSG(out && strstr(out, "<|assistant|><think></think>Hello.<|user|>Again<|assistant|>"), "rendered: %s", out ? out : "(null)");
    free(out);
    cJSON_Delete(m);
    jinja_free(t);
}

/* ---- `petrel run` / `petrel chat` as subprocesses ($PETREL_BIN; skipped when unset) ---- */


TEST(cli_run, run_and_chat_contracts) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset (make test sets it): run/chat CLI tests skipped"); return; }
    static char cmd[2048], o1[65536], o2[65536], e[8192];
    const char *m = test_data("tiny");
    /* seeded sampling repeats; stdout holds only the text, stderr stays empty without -v */
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'Hello there' -n 24 --seed 11 --temp 1", b, m);
    CHECK_EQ_INT(test_sh(cmd, o1, sizeof o1, e, sizeof e), 0);
    CHECK(o1[0] != 0);
    CHECK_MSG(e[0] == 0, "stderr: %s", e);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK(!strcmp(o1, o2));
    /* -v: stats on stderr, same stdout */
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'Hello there' -n 24 --seed 11 --temp 1 -v", b, m);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK(!strcmp(o1, o2));
    CHECK(strstr(e, "tok/s") != NULL);
    /* failures: non-zero and one line on stderr */
    const char *bad[] = {"run --model %s -p hi --tokenizer /nonexistent/tokenizer.json", "run --model %s", "run --model %s -p hi --top-p 7",
                         "run --model %s -p hi --bogus", "chat --model %s --template /nonexistent.jinja", "chat --model %s --ctx x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char c2[1024];
        snprintf(c2, sizeof c2, bad[i], m);
        snprintf(cmd, sizeof cmd, "%s %s </dev/null", b, c2);
        int rc = test_sh(cmd, o2, sizeof o2, e, sizeof e);
        CHECK_MSG(rc != 0, "%s: exit 0", c2);
        CHECK_MSG(test_count_lines(e) == 1, "%s: stderr has %d lines: %s", c2, test_count_lines(e), e);
        CHECK_MSG(o2[0] == 0, "%s: wrote to stdout", c2);
    }
    snprintf(cmd, sizeof cmd, "%s run --help", b);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK(strstr(o2, "--seed") && strstr(o2, "--chat"));
    /* chat over a pipe: one reply per line, EOF ends, exit 0 */
    snprintf(cmd, sizeof cmd, "printf 'hello\\nagain\\n' | %s chat --model %s -n 6 --seed 3 --no-think", b, m);
    CHECK_EQ_INT(test_sh(cmd, o1, sizeof o1, e, sizeof e), 0);
    CHECK(test_count_lines(o1) >= 2);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK(!strcmp(o1, o2));
}
