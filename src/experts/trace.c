/* trace.c: expert-routing traces and offline policy replay.
 * Format (text, same as /work/shared/traces; read plain or gzip-compressed): a header
 *   # petrel-trace v1 layers=L experts=E topk=K tokens=T [other key=value ...]
 * then one line per (token, layer): `token layer e1 ... ek`, ids ascending and distinct.
 * Invariants: ids[] holds n_tokens * n_layers * topk entries, -1 where a (token, layer) has no
 * line. Replay is cold-start, demand-filled (every requested expert ends up resident), and never
 * evicts one of the current token's experts, for the policy, for LRU and for Belady alike, so
 * the three hit counts are comparable; Belady/MIN (evict the expert whose next use is farthest)
 * is the optimum for that model. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "base/err.h"
#include "base/outfile.h"
#include "experts/xs.h"

int xs_trace_init(xs_trace *t, int n_layers, int n_experts, int topk) {
    memset(t, 0, sizeof *t);
    if (n_layers <= 0 || n_experts <= 0 || n_experts > 32767 || topk <= 0 || topk > n_experts) return PETREL_EINVAL;
    t->n_layers = n_layers;
    t->n_experts = n_experts;
    t->topk = topk;
    return 0;
}

void xs_trace_deinit(xs_trace *t) {
    free(t->ids);
    memset(t, 0, sizeof *t);
}

/* room for `tokens` tokens, doubling from 256, never past `limit` tokens (0: none; a read trace's
 * header count, which its lines cannot exceed: a header of millions of layers and 3 tokens once
 * took 256 tokens' room, 10 GB, for a 194-byte file) */
static int reserve(xs_trace *t, int tokens, int limit, petrel_error *err) {
    if (tokens <= t->cap_tokens) return 0;
    int cap = t->cap_tokens ? t->cap_tokens : 256;
    while (cap < tokens) cap *= 2;
    if (limit > 0 && cap > limit) cap = limit > tokens ? limit : tokens;
    size_t per = (size_t)t->n_layers * (size_t)t->topk;
    int16_t *n = realloc(t->ids, sizeof(int16_t) * per * (size_t)cap);
    if (!n) return pt_err(err, PETREL_ENOMEM, "trace: out of memory for %d tokens", cap);
    for (size_t i = per * (size_t)t->cap_tokens; i < per * (size_t)cap; i++) n[i] = -1;
    t->ids = n;
    t->cap_tokens = cap;
    return 0;
}

int xs_trace_add(xs_trace *t, int token, int layer, const int32_t *ids, int k, petrel_error *err) {
    if (token < 0 || token > t->n_tokens || (token < t->n_tokens - 1))
        return pt_err(err, PETREL_EINVAL, "trace: token %d out of order (have %d)", token, t->n_tokens);
    if (layer < 0 || layer >= t->n_layers || k <= 0 || k > t->topk)
        return pt_err(err, PETREL_EINVAL, "trace: layer %d / k %d out of range", layer, k);
    PT_TRY(reserve(t, token + 1, 0, err));
    if (token == t->n_tokens) t->n_tokens++;
    int16_t *d = t->ids + ((size_t)token * t->n_layers + layer) * t->topk;
    for (int i = 0; i < t->topk; i++) d[i] = -1;
    /* stored ascending (insertion sort of k <= topk ids) */
    for (int i = 0; i < k; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_experts) return pt_err(err, PETREL_EINVAL, "trace: expert %d out of range", ids[i]);
        int j = i;
        while (j > 0 && d[j - 1] > ids[i]) { d[j] = d[j - 1]; j--; }
        d[j] = (int16_t)ids[i];
    }
    return 0;
}

int xs_trace_write(const xs_trace *t, const char *path, petrel_error *err) {
    pt_outfile f; /* whole or nothing: a failed write leaves no partial trace */
    if (pt_out_open(&f, path, NULL, err) < 0) return pt_err_ctx(err, "trace");
    pt_out_printf(&f, "# petrel-trace v1 layers=%d experts=%d topk=%d tokens=%d\n", t->n_layers, t->n_experts, t->topk,
                  t->n_tokens);
    for (int tok = 0; tok < t->n_tokens && !f.failed; tok++)
        for (int l = 0; l < t->n_layers; l++) {
            const int16_t *d = t->ids + ((size_t)tok * t->n_layers + l) * t->topk;
            if (d[0] < 0) continue;
            pt_out_printf(&f, "%d %d", tok, l);
            for (int k = 0; k < t->topk && d[k] >= 0; k++) pt_out_printf(&f, " %d", d[k]);
            pt_out_write(&f, "\n", 1, NULL);
        }
    if (pt_out_commit(&f, err) < 0) return pt_err_ctx(err, "trace");
    return 0;
}

static int header_int(const char *line, const char *key, int *out) {
    const char *p = strstr(line, key);
    if (!p) return -1;
    char *end;
    long v = strtol(p + strlen(key), &end, 10);
    if (end == p + strlen(key) || v <= 0 || v > 100000000) return -1;
    *out = (int)v;
    return 0;
}

/* The file gives a line that did not fit in the buffer whole as several; each is refused by the
 * line check below, as a line that long is no trace line anyway. */
int xs_trace_read(xs_trace *t, const char *path, petrel_error *err) {
    memset(t, 0, sizeof *t);
    errno = 0; /* zlib sets it when the open fails, not when its own allocation does */
    gzFile f = gzopen(path, "rb"); /* gzip or plain text: zlib reads a plain file as it is */
    if (!f) return pt_err(err, PETREL_EIO, "trace: cannot open %s: %s", path, errno ? strerror(errno) : "out of memory");
    char line[4096];
    line[0] = 0;
    int L, E, K, T, rc = 0, zerr;
    long ln = 1;
    if (!gzgets(f, line, sizeof line) || strncmp(line, "# petrel-trace v1", 17) || header_int(line, " layers=", &L) ||
        header_int(line, " experts=", &E) || header_int(line, " topk=", &K) || header_int(line, " tokens=", &T)) {
        const char *ze = gzerror(f, &zerr);
        rc = zerr != Z_OK ? pt_err(err, PETREL_EFORMAT, "trace %s: not readable as gzip or text: %s", path, ze)
                          : pt_err(err, PETREL_EFORMAT, "trace %s: line 1 is not a '# petrel-trace v1 layers= experts= topk= tokens=' header", path);
        gzclose(f);
        return rc;
    }
    if (xs_trace_init(t, L, E, K)) {
        gzclose(f);
        return pt_err(err, PETREL_EFORMAT, "trace %s: bad dimensions layers=%d experts=%d topk=%d", path, L, E, K);
    }
    /* the header sizes what is allocated: bounded before anything is (the header is outside input) */
    if ((double)L * K * T > XS_TRACE_MAX_ENTRIES) {
        gzclose(f);
        memset(t, 0, sizeof *t);
        return pt_err(err, PETREL_EFORMAT, "trace %s: layers=%d x topk=%d x tokens=%d entries, more than the %d a trace may hold", path,
                      L, K, T, XS_TRACE_MAX_ENTRIES);
    }
    long *v = malloc(sizeof(long) * (size_t)(2 + K)); /* one line: token, layer and up to K ids */
    if (!v) {
        gzclose(f);
        return pt_err(err, PETREL_ENOMEM, "trace: out of memory");
    }
    /* storage grows with the lines read, never from the header's count alone: lines come in
     * token order (a token at most one past the highest so far), and the last must reach T - 1 */
    int top = -1;
    while (gzgets(f, line, sizeof line)) {
        ln++;
        if (line[0] == '#' || line[0] == '\n') continue;
        char *p = line, *end;
        int n = 0;
        for (;;) {
            long x = strtol(p, &end, 10);
            if (end == p) break;
            if (n >= 2 + K) { n = -1; break; }
            v[n++] = x;
            p = end;
        }
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
        if (n < 3 || *p || v[0] < 0 || v[0] >= T || v[1] < 0 || v[1] >= L) {
            rc = pt_err(err, PETREL_EFORMAT, "trace %s:%ld: expected 'token layer e1..e%d' within tokens=%d layers=%d",
                        path, ln, K, T, L);
            goto fail;
        }
        if (v[0] > top + 1) {
            rc = pt_err(err, PETREL_EFORMAT, "trace %s:%ld: token %ld before token %d (lines go in token order)", path, ln, v[0], top + 1);
            goto fail;
        }
        if (v[0] > top) {
            if ((rc = reserve(t, (int)v[0] + 1, T, err))) goto fail;
            top = (int)v[0];
            t->n_tokens = top + 1;
        }
        int16_t *d = t->ids + ((size_t)v[0] * L + v[1]) * K;
        if (d[0] >= 0) { /* a second line would leave the first one's ids behind its own */
            rc = pt_err(err, PETREL_EFORMAT, "trace %s:%ld: token %ld layer %ld listed twice", path, ln, v[0], v[1]);
            goto fail;
        }
        for (int i = 0; i < n - 2; i++) {
            if (v[2 + i] < 0 || v[2 + i] >= E) {
                rc = pt_err(err, PETREL_EFORMAT, "trace %s:%ld: expert %ld out of range", path, ln, v[2 + i]);
                goto fail;
            }
            for (int j = 0; j < i; j++)
                if (d[j] == v[2 + i]) {
                    rc = pt_err(err, PETREL_EFORMAT, "trace %s:%ld: expert %ld repeated", path, ln, v[2 + i]);
                    goto fail;
                }
            d[i] = (int16_t)v[2 + i];
        }
    }
    const char *ze = gzerror(f, &zerr); /* the loop ends at the end of the data or at a bad stream */
    if (zerr != Z_OK) {
        rc = pt_err(err, PETREL_EFORMAT, "trace %s: gzip data damaged after line %ld: %s", path, ln, ze);
        goto fail;
    }
    if (top + 1 != T) {
        rc = top < 0 ? pt_err(err, PETREL_EFORMAT, "trace %s: the header says tokens=%d, and no line follows it", path, T)
                     : pt_err(err, PETREL_EFORMAT, "trace %s: the header says tokens=%d, the lines end at token %d", path, T, top);
        goto fail;
    }
    free(v);
    gzclose(f);
    return 0;
fail:
    free(v);
    gzclose(f);
    xs_trace_deinit(t);
    return rc;
}

/* ---------------------------------------------------------------- replay */

/* One layer through an xs_pol: returns hits. res/inres/cur are scratch [cap], [E], [E]. */
static uint64_t replay_pol(const xs_trace *t, int layer, xs_pol *pol, int cap, int *res, uint8_t *inres,
                           uint8_t *cur) {
    int n_res = 0, K = t->topk;
    uint64_t hits = 0;
    memset(inres, 0, (size_t)t->n_experts);
    for (int tok = 0; tok < t->n_tokens; tok++) {
        const int16_t *d = t->ids + ((size_t)tok * t->n_layers + layer) * K;
        if (d[0] < 0) continue;
        xs_pol_begin(pol);
        for (int k = 0; k < K && d[k] >= 0; k++) {
            cur[d[k]] = 1;
            xs_pol_use(pol, d[k]);
        }
        for (int k = 0; k < K && d[k] >= 0; k++) {
            int e = d[k];
            if (inres[e]) { hits++; continue; }
            if (n_res < cap) {
                res[n_res++] = e;
                inres[e] = 1;
                continue;
            }
            int vi = -1;
            for (int i = 0; i < n_res; i++)
                if (!cur[res[i]] && (vi < 0 || xs_pol_evict_before(pol, res[i], res[vi]))) vi = i;
            inres[res[vi]] = 0;
            res[vi] = e;
            inres[e] = 1;
        }
        for (int k = 0; k < K && d[k] >= 0; k++) cur[d[k]] = 0;
    }
    return hits;
}

/* Belady/MIN for one layer. nextu: scratch [n_tokens * K] (next token using the same expert). */
static uint64_t replay_belady(const xs_trace *t, int layer, int cap, int *res, uint8_t *inres, uint8_t *cur,
                              int *nextpos, int *nextu, int *nu) {
    int K = t->topk, E = t->n_experts, T = t->n_tokens, INF = 0x7fffffff;
    for (int e = 0; e < E; e++) nextpos[e] = INF;
    for (int tok = T - 1; tok >= 0; tok--) {
        const int16_t *d = t->ids + ((size_t)tok * t->n_layers + layer) * K;
        for (int k = 0; k < K && d[k] >= 0; k++) {
            nextu[(size_t)tok * K + k] = nextpos[d[k]];
            nextpos[d[k]] = tok;
        }
    }
    memset(inres, 0, (size_t)E);
    int n_res = 0;
    uint64_t hits = 0;
    for (int tok = 0; tok < T; tok++) {
        const int16_t *d = t->ids + ((size_t)tok * t->n_layers + layer) * K;
        if (d[0] < 0) continue;
        for (int k = 0; k < K && d[k] >= 0; k++) cur[d[k]] = 1;
        for (int k = 0; k < K && d[k] >= 0; k++) {
            int e = d[k];
            if (inres[e]) hits++;
            else if (n_res < cap) {
                res[n_res++] = e;
                inres[e] = 1;
            } else {
                int vi = -1;
                for (int i = 0; i < n_res; i++)
                    if (!cur[res[i]] && (vi < 0 || nu[res[i]] > nu[res[vi]])) vi = i;
                inres[res[vi]] = 0;
                res[vi] = e;
                inres[e] = 1;
            }
            nu[e] = nextu[(size_t)tok * K + k];
        }
        for (int k = 0; k < K && d[k] >= 0; k++) cur[d[k]] = 0;
    }
    return hits;
}

int xs_trace_replay(const xs_trace *t, const xs_policy_params *prm, int capacity, xs_replay_stats *st,
                    petrel_error *err) {
    return xs_trace_replay_hist(t, NULL, prm, capacity, st, err);
}

int xs_trace_replay_hist(const xs_trace *t, const xs_trace *hist, const xs_policy_params *prm, int capacity, xs_replay_stats *st,
                         petrel_error *err) {
    if (hist && (hist->n_layers != t->n_layers || hist->n_experts != t->n_experts))
        return pt_err(err, PETREL_EINVAL, "replay: the history trace has %d layers x %d experts, the trace %d x %d", hist->n_layers,
                      hist->n_experts, t->n_layers, t->n_experts);
    memset(st, 0, sizeof *st);
    st->capacity = capacity;
    if (capacity < t->topk || capacity > t->n_experts)
        return pt_err(err, PETREL_EINVAL, "replay: capacity %d must be in [topk %d, experts %d]", capacity, t->topk,
                      t->n_experts);
    int E = t->n_experts, K = t->topk;
    int *res = malloc(sizeof(int) * (size_t)capacity);
    uint8_t *inres = malloc((size_t)E), *cur = calloc((size_t)E, 1);
    int *nextpos = malloc(sizeof(int) * (size_t)E), *nu = malloc(sizeof(int) * (size_t)E);
    int *nextu = malloc(sizeof(int) * (size_t)(t->n_tokens ? t->n_tokens : 1) * (size_t)K);
    int rc = 0;
    if (!res || !inres || !cur || !nextpos || !nu || !nextu) {
        rc = pt_err(err, PETREL_ENOMEM, "replay: out of memory");
        goto out;
    }
    xs_policy_params lru;
    xs_policy_defaults(&lru);
    lru.kind = XS_POL_LRU;
    lru.pin_frac = 0;
    for (int l = 0; l < t->n_layers; l++) {
        for (int tok = 0; tok < t->n_tokens; tok++) {
            const int16_t *d = t->ids + ((size_t)tok * t->n_layers + l) * K;
            for (int k = 0; k < K && d[k] >= 0; k++) st->accesses++;
        }
        xs_pol p;
        if (xs_pol_init(&p, E, capacity, prm)) { rc = pt_err(err, PETREL_ENOMEM, "replay: out of memory"); goto out; }
        if (hist) { /* the usage history of an earlier run: its counts, then the pins they give */
            for (int tok = 0; tok < hist->n_tokens; tok++) {
                const int16_t *d = hist->ids + ((size_t)tok * hist->n_layers + l) * hist->topk;
                for (int k = 0; k < hist->topk && d[k] >= 0; k++) p.uses[d[k]]++;
            }
            xs_pol_repin(&p);
        }
        st->policy_hits += replay_pol(t, l, &p, capacity, res, inres, cur);
        xs_pol_deinit(&p);
        if (xs_pol_init(&p, E, capacity, &lru)) { rc = pt_err(err, PETREL_ENOMEM, "replay: out of memory"); goto out; }
        st->lru_hits += replay_pol(t, l, &p, capacity, res, inres, cur);
        xs_pol_deinit(&p);
        st->belady_hits += replay_belady(t, l, capacity, res, inres, cur, nextpos, nextu, nu);
    }
    double a = st->accesses ? (double)st->accesses : 1.0;
    st->policy_rate = st->policy_hits / a;
    st->lru_rate = st->lru_hits / a;
    st->belady_rate = st->belady_hits / a;
    st->policy_vs_belady = st->belady_hits ? (double)st->policy_hits / (double)st->belady_hits : 1.0;
out:
    free(res);
    free(inres);
    free(cur);
    free(nextpos);
    free(nu);
    free(nextu);
    return rc;
}
