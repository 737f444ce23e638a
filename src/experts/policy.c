/* policy.c: which resident expert to evict, per layer. Shared by the store and trace replay so
 * the replayed hit rate is the store's. Research behind the choices: bench/POLICY.md.
 *
 * XS_POL_FREQ keeps a decayed use count for every expert of the layer (resident or not): each
 * use adds `inc`, and inc grows by 2^(1/halflife) per access of the layer, which is the same as
 * decaying every count without touching them (rescaled when inc gets large). The victim is the
 * resident expert with the lowest decayed count, ties to the least recently used (this is LRFU
 * with an exponential weighting). Routing has a power-law popularity that drifts, so a decayed
 * count estimates each expert's current routing rate far better than recency (LRU, ARC, 2Q) or
 * lifetime counts (LFU, LFU-DA) do.
 *
 * XS_POL_ADAPT (default) is XS_POL_FREQ with the half-life chosen online: the best half-life
 * grows with the capacity and with how slowly the routing drifts, so instead of a constant the
 * policy runs XS_POL_NSHADOW shadow caches of the layer's capacity (demand-filled, same rules
 * as the real bank, no I/O: ids only), each evicting by a decayed count with its own half-life
 * (16, 32, ... 512 accesses), keeps a decayed hit score per shadow (half-life adapt_window), and
 * evicts the real bank by the counts of the shadow that currently scores best. Shadows see an
 * access when the next one begins (its set of experts is complete by then). Cost per access:
 * NSHADOW x (uses + misses x capacity) comparisons; memory NSHADOW x (E doubles + E + cap ints).
 *
 * Pins: the n_pins = pin_frac * cap experts with the most lifetime uses (history loaded from the
 * usage file + this run) are never chosen while any unpinned candidate exists. Re-pinned every
 * repin_every accesses. XS_POL_LRU ignores counts (pins still apply). Pins cost hit rate at
 * small capacities (the popular set drifts); the default keeps a few so a usage file still
 * gives a warm start (xs_store_warm_pins). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "experts/xs.h"

static const double shadow_halflife[XS_POL_NSHADOW] = {16, 32, 64, 128, 256, 512};

void xs_policy_defaults(xs_policy_params *p) {
    p->kind = XS_POL_ADAPT;
    p->halflife = 64;
    p->pin_frac = 0.10;
    p->repin_every = 64;
    p->adapt_window = 512;
}

int xs_pol_init(xs_pol *p, int n_experts, int cap, const xs_policy_params *prm) {
    memset(p, 0, sizeof *p);
    if (prm) p->prm = *prm;
    else xs_policy_defaults(&p->prm);
    if (p->prm.halflife <= 0) p->prm.halflife = 64;
    if (p->prm.repin_every <= 0) p->prm.repin_every = 64;
    if (p->prm.pin_frac < 0) p->prm.pin_frac = 0;
    if (p->prm.pin_frac > 0.9) p->prm.pin_frac = 0.9;
    if (p->prm.adapt_window <= 0) p->prm.adapt_window = 512;
    p->n_experts = n_experts;
    p->cap = cap;
    p->n_pins = (int)(p->prm.pin_frac * cap);
    p->inc = 1.0;
    p->score = calloc((size_t)n_experts, sizeof *p->score);
    p->uses = calloc((size_t)n_experts, sizeof *p->uses);
    p->last = calloc((size_t)n_experts, sizeof *p->last);
    p->pinned = calloc((size_t)n_experts, 1);
    int ok = p->score && p->uses && p->last && p->pinned;
    if (ok && p->prm.kind == XS_POL_ADAPT) {
        size_t NE = (size_t)XS_POL_NSHADOW * n_experts;
        p->sh_score = calloc(NE, sizeof *p->sh_score);
        p->sh_res = calloc(NE, 1);
        p->sh_slot = calloc((size_t)XS_POL_NSHADOW * (cap > 0 ? cap : 1), sizeof *p->sh_slot);
        p->tok = calloc((size_t)n_experts, sizeof *p->tok);
        p->in_tok = calloc((size_t)n_experts, 1);
        ok = p->sh_score && p->sh_res && p->sh_slot && p->tok && p->in_tok;
        /* start from the shadow nearest to the configured half-life */
        for (int i = 0; i < XS_POL_NSHADOW; i++) {
            p->sh_inc[i] = 1.0;
            if (fabs(log2(shadow_halflife[i] / p->prm.halflife)) <
                fabs(log2(shadow_halflife[p->sh_best] / p->prm.halflife)))
                p->sh_best = i;
        }
    }
    if (!ok) {
        xs_pol_deinit(p);
        return -1;
    }
    return 0;
}

void xs_pol_deinit(xs_pol *p) {
    free(p->score);
    free(p->uses);
    free(p->last);
    free(p->pinned);
    free(p->sh_score);
    free(p->sh_res);
    free(p->sh_slot);
    free(p->tok);
    free(p->in_tok);
    memset(p, 0, sizeof *p);
}

/* Plays the finished access (tok[0..n_tok)) through every shadow bank and re-picks the best. */
static void shadow_access(xs_pol *p) {
    int E = p->n_experts, cap = p->cap;
    double keep = exp2(-1.0 / p->prm.adapt_window);
    for (int s = 0; s < XS_POL_NSHADOW; s++) {
        const double *sc = p->sh_score + (size_t)s * E;
        uint8_t *res = p->sh_res + (size_t)s * E;
        int *slot = p->sh_slot + (size_t)s * cap;
        p->sh_hits[s] *= keep;
        for (int k = 0; k < p->n_tok; k++) {
            int e = p->tok[k];
            if (res[e]) {
                p->sh_hits[s] += 1.0;
                continue;
            }
            if (p->sh_n[s] < cap) {
                slot[p->sh_n[s]++] = e;
                res[e] = 1;
                continue;
            }
            int vi = -1;
            for (int i = 0; i < cap; i++) {
                int a = slot[i];
                if (p->in_tok[a]) continue;
                if (vi < 0) {
                    vi = i;
                    continue;
                }
                int b = slot[vi];
                if (sc[a] != sc[b] ? sc[a] < sc[b] : p->last[a] != p->last[b] ? p->last[a] < p->last[b] : a < b) vi = i;
            }
            if (vi < 0) continue; /* the access alone fills the bank: no room, count the miss */
            res[slot[vi]] = 0;
            slot[vi] = e;
            res[e] = 1;
        }
    }
    int b = p->sh_best;
    for (int s = 0; s < XS_POL_NSHADOW; s++)
        if (p->sh_hits[s] > p->sh_hits[b] * (1 + 1e-9) + 1e-9) b = s; /* ties keep the current one */
    p->sh_best = b;
}

void xs_pol_begin(xs_pol *p) {
    if (p->prm.kind == XS_POL_ADAPT) {
        if (p->n_tok) shadow_access(p);
        for (int k = 0; k < p->n_tok; k++) p->in_tok[p->tok[k]] = 0;
        p->n_tok = 0;
        for (int s = 0; s < XS_POL_NSHADOW; s++) {
            p->sh_inc[s] *= exp2(1.0 / shadow_halflife[s]);
            if (p->sh_inc[s] > 1e200) {
                double *sc = p->sh_score + (size_t)s * p->n_experts;
                for (int e = 0; e < p->n_experts; e++) sc[e] /= p->sh_inc[s];
                p->sh_inc[s] = 1.0;
            }
        }
    }
    p->clock++;
    p->inc *= exp2(1.0 / p->prm.halflife);
    if (p->inc > 1e200) { /* rescale: relative order is unchanged */
        for (int e = 0; e < p->n_experts; e++) p->score[e] /= p->inc;
        p->inc = 1.0;
    }
    if (++p->since_repin >= p->prm.repin_every) {
        p->since_repin = 0;
        xs_pol_repin(p);
    }
}

void xs_pol_use(xs_pol *p, int e) {
    p->score[e] += p->inc;
    p->uses[e]++;
    p->last[e] = p->clock;
    if (p->prm.kind == XS_POL_ADAPT) {
        for (int s = 0; s < XS_POL_NSHADOW; s++) p->sh_score[(size_t)s * p->n_experts + e] += p->sh_inc[s];
        if (!p->in_tok[e]) {
            p->in_tok[e] = 1;
            p->tok[p->n_tok++] = e;
        }
    }
}

int xs_pol_evict_before(const xs_pol *p, int a, int b) {
    if (p->pinned[a] != p->pinned[b]) return p->pinned[b]; /* unpinned goes first */
    const double *sc = p->prm.kind == XS_POL_ADAPT ? p->sh_score + (size_t)p->sh_best * p->n_experts
                       : p->prm.kind == XS_POL_FREQ ? p->score
                                                    : NULL;
    if (sc && sc[a] != sc[b]) return sc[a] < sc[b];
    if (p->last[a] != p->last[b]) return p->last[a] < p->last[b];
    return a < b;
}

double xs_pol_halflife(const xs_pol *p) {
    return p->prm.kind == XS_POL_ADAPT ? shadow_halflife[p->sh_best] : p->prm.halflife;
}

void xs_pol_repin(xs_pol *p) {
    memset(p->pinned, 0, (size_t)p->n_experts);
    /* n_pins is small relative to E: repeated selection of the max unpinned with uses > 0 */
    for (int k = 0; k < p->n_pins; k++) {
        int best = -1;
        for (int e = 0; e < p->n_experts; e++)
            if (!p->pinned[e] && p->uses[e] && (best < 0 || p->uses[e] > p->uses[best])) best = e;
        if (best < 0) break;
        p->pinned[best] = 1;
    }
}
