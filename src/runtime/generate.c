/* generate.c: the generation loop (see generate.h): prompt-prefix reuse over one session,
 * sampling, stop ids, streaming detokenization to a callback. Allocates only at gen_init and
 * once per gen_generate (the detokenizer's buffer); the per-token path does not allocate. */
#include "runtime/generate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/err.h"
#include "model/config.h"
#include "model/engine.h"

const char *gen_stop_name(gen_stop s) {
    switch (s) {
    case GEN_STOP_EOS: return "eos";
    case GEN_STOP_LENGTH: return "length";
    case GEN_STOP_CONTEXT: return "context full";
    case GEN_STOP_CALLBACK: return "stopped by caller";
    default: return "none";
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int gen_init(gen_ctx *g, petrel_engine *eng, const tokenizer *tok, int ctx, const sampler_params *sp,
             petrel_error *err) {
    memset(g, 0, sizeof *g);
    if (ctx <= 0) return pt_err(err, PETREL_EINVAL, "context size %d must be positive", ctx);
    g->eng = eng;
    g->tok = tok;
    g->ctx = ctx;
    g->vocab = petrel_engine_vocab_size(eng);
    int rc = sampler_init(&g->smp, sp, g->vocab, err);
    if (rc < 0) return rc;
    g->logits = malloc(sizeof(float) * (size_t)g->vocab);
    g->ids = malloc(sizeof(int32_t) * (size_t)ctx);
    if (!g->logits || !g->ids) {
        gen_free(g);
        return pt_err(err, PETREL_ENOMEM, "out of memory for a %d-token context", ctx);
    }
    /* Ids the tokenizer cannot write out are never sampled. */
    int nm = 0;
    for (int32_t id = 0; id < g->vocab; id++)
        if (!tok_id_to_bytes(tok, id, &(size_t){0})) nm++;
    if (nm) {
        g->masked = malloc(sizeof(int32_t) * (size_t)nm);
        if (!g->masked) {
            gen_free(g);
            return pt_err(err, PETREL_ENOMEM, "out of memory");
        }
        for (int32_t id = 0; id < g->vocab; id++)
            if (!tok_id_to_bytes(tok, id, &(size_t){0})) g->masked[g->n_masked++] = id;
    }
    rc = petrel_session_create(eng, ctx, &g->s, err);
    if (rc < 0) {
        gen_free(g);
        return rc;
    }
    return 0;
}

int gen_enable_spec(gen_ctx *g, const spec_params *p, petrel_error *err) {
    if (!p || p->draft == 0) return 0;
    PT_TRY(spec_check(g->eng, p, err));
    if (spec_effective_draft(g->eng, p->draft) == 0) return 0;
    PT_TRY(spec_create(g->eng, p, 1, &g->spec, err));
    int rc = spec_seq_init(&g->seq, g->spec, g->s, &g->smp, g->masked, g->n_masked, err);
    if (rc < 0) {
        spec_free(g->spec);
        g->spec = NULL;
    }
    return rc;
}

void gen_free(gen_ctx *g) {
    if (g->spec) spec_seq_free(&g->seq);
    spec_free(g->spec);
    petrel_session_free(g->s);
    sampler_free(&g->smp);
    free(g->logits);
    free(g->ids);
    free(g->masked);
    memset(g, 0, sizeof *g);
}

int gen_prompt(gen_ctx *g, const int32_t *ids, int n, gen_stats *st, petrel_error *err) {
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "empty prompt: it encodes to no tokens");
    if (n > g->ctx)
        return pt_err(err, PETREL_ERANGE, "context full: the prompt is %d tokens but the context holds %d", n, g->ctx);
    double t0 = now_s();
    int p = 0;
    while (p < g->n_ids && p < n && g->ids[p] == ids[p]) p++;
    if (p == n && !(g->have_logits && p == g->n_ids)) p = n - 1; /* rerun the last for its logits */
    int rc;
    if (p < n) {
        g->have_logits = 0;
        if (g->spec) { /* the MTP cache may need its last kept row recomputed: feed from there */
            if ((rc = spec_truncate(&g->seq, p, err)) < 0) return rc;
            p = rc;
        } else if ((rc = petrel_session_truncate(g->s, p, err)) < 0) return rc;
        g->n_ids = p;
        if ((rc = g->spec ? spec_feed(&g->seq, ids + p, n - p, g->logits, err) : petrel_session_forward(g->s, ids + p, n - p, g->logits, 0, err)) < 0) {
            g->n_ids = petrel_session_len(g->s);
            return rc;
        }
        memcpy(g->ids + p, ids + p, sizeof(int32_t) * (size_t)(n - p));
        g->n_ids = n;
        g->have_logits = 1;
    }
    sampler_clear_history(&g->smp);
    int W = g->smp.p.penalty_last_n;
    for (int i = n > W ? n - W : 0; i < n; i++) sampler_accept(&g->smp, ids[i]);
    if (st) {
        st->n_prompt = n;
        st->n_reused = p;
        st->prompt_s = now_s() - t0;
    }
    return 0;
}

int gen_load(gen_ctx *g, const char *path, petrel_error *err) {
    PT_TRY(petrel_session_load(g->s, path, err));
    const int32_t *tk;
    int n = petrel_session_tokens(g->s, &tk);
    memcpy(g->ids, tk, sizeof(int32_t) * (size_t)n);
    g->n_ids = n;
    g->have_logits = 0; /* the next prompt reruns at least its last token */
    return 0;
}

int gen_save(const gen_ctx *g, const char *path, petrel_error *err) { return petrel_session_save(g->s, path, err); }

static int is_stop(const petrel_config *cfg, const gen_opts *o, int32_t id) {
    if (config_is_eos(cfg, id)) return 1;
    for (int i = 0; o && i < o->n_stop; i++)
        if (o->stop_ids[i] == id) return 1;
    return 0;
}

/* Drafting: the first token from the prompt's logits as plain, then speculative steps; each step
 * caches the pending token and the accepted drafts and emits them with the new pending token. A
 * stop inside a step's tokens truncates the cache back to what plain generation would hold. */
static int gen_generate_spec(gen_ctx *g, const gen_opts *o, gen_piece_fn fn, void *user, gen_stats *st,
                             petrel_error *err) {
    const petrel_config *cfg = petrel_engine_config(g->eng);
    int max = o ? o->max_tokens : -1;
    tok_stream ts;
    tok_stream_init(&ts, g->tok);
    const char *b;
    size_t bl;
    int rc = 0, pending = 0;
    spec_seq *q = &g->seq;
    for (;;) {
        if (max >= 0 && st->n_gen >= max) { st->stop = GEN_STOP_LENGTH; break; }
        int32_t out[SPEC_MAX_DRAFT + 1];
        int nout = 1, cached0 = g->n_ids;
        if (!pending) {
            for (int i = 0; i < g->n_masked; i++) g->logits[g->masked[i]] = -INFINITY;
            out[0] = sampler_sample(&g->smp, g->logits, g->vocab);
            g->have_logits = 0;
            if (is_stop(cfg, o, out[0])) {
                st->stop = GEN_STOP_EOS;
                st->stop_id = out[0];
                break;
            }
            sampler_accept(&g->smp, out[0]);
        } else {
            if (g->n_ids >= g->ctx) { st->stop = GEN_STOP_CONTEXT; break; }
            q->limit = max < 0 ? SPEC_PEND : max - st->n_gen;
            int32_t t0 = q->tok;
            spec_seq *one = q;
            if ((rc = spec_step(g->spec, &one, 1, err)) < 0) break;
            st->n_forwards++;
            nout = q->nout;
            memcpy(out, q->out, sizeof(int32_t) * (size_t)nout);
            g->ids[g->n_ids++] = t0;
            for (int j = 0; j + 1 < nout; j++) g->ids[g->n_ids++] = out[j];
        }
        int stop = 0;
        for (int j = 0; j < nout && !stop; j++) {
            if (pending && is_stop(cfg, o, out[j])) {
                st->stop = GEN_STOP_EOS;
                st->stop_id = out[j];
                stop = 1;
            } else {
                st->n_gen++;
                if ((rc = tok_stream_push(&ts, out[j], &b, &bl, err)) < 0) stop = 1;
                else if (fn && fn(user, out[j], b, bl)) st->stop = GEN_STOP_CALLBACK, stop = 1;
            }
            if (stop && pending && j + 1 < nout) { /* the cache holds the tokens before out[j] only */
                int keep = cached0 + 1 + j;
                int k2 = spec_truncate(q, keep, err);
                if (k2 < 0) rc = k2;
                else g->n_ids = k2;
            }
        }
        if (stop || rc < 0) break;
        spec_set_token(q, out[nout - 1]);
        pending = 1;
    }
    if (rc >= 0 && tok_stream_flush(&ts, &b, &bl, err) >= 0 && bl && fn) fn(user, -1, b, bl);
    tok_stream_free(&ts);
    return rc < 0 ? rc : 0;
}

static void gen_json(const gen_ctx *g, gen_stats *st) {
    if (g->spec) {
        char sj[1800];
        spec_stats_json(g->spec, sj, sizeof sj);
        snprintf(st->json, sizeof st->json, "{\"generated\":%d,\"tok_per_s\":%.3f,%s", st->n_gen, st->gen_s > 0 ? st->n_gen / st->gen_s : 0.0, sj + 1);
    } else
        snprintf(st->json, sizeof st->json,
                 "{\"generated\":%d,\"tok_per_s\":%.3f,\"draft\":0,\"tokens\":%d,\"forwards\":%d,\"tokens_per_forward\":%.4f,\"acceptance_by_position\":[]}",
                 st->n_gen, st->gen_s > 0 ? st->n_gen / st->gen_s : 0.0, st->n_forwards, st->n_forwards, st->n_forwards ? 1.0 : 0.0);
}

int gen_generate(gen_ctx *g, const gen_opts *o, gen_piece_fn fn, void *user, gen_stats *st,
                 petrel_error *err) {
    gen_stats local;
    if (!st) st = &local;
    st->n_forwards = 0;
    st->json[0] = 0;
    if (g->spec) {
        st->n_gen = 0;
        st->stop = GEN_STOP_NONE;
        st->stop_id = -1;
        if (!g->have_logits) return pt_err(err, PETREL_EINVAL, "generate: no prompt has been fed");
        double t0 = now_s();
        int rc = gen_generate_spec(g, o, fn, user, st, err);
        st->gen_s = now_s() - t0;
        gen_json(g, st);
        return rc;
    }
    st->n_gen = 0;
    st->stop = GEN_STOP_NONE;
    st->stop_id = -1;
    st->gen_s = 0;
    if (!g->have_logits) return pt_err(err, PETREL_EINVAL, "generate: no prompt has been fed");
    const petrel_config *cfg = petrel_engine_config(g->eng);
    int max = o ? o->max_tokens : -1;
    double t0 = now_s();
    tok_stream ts;
    tok_stream_init(&ts, g->tok);
    const char *b;
    size_t bl;
    int rc = 0;
    for (;;) {
        if (max >= 0 && st->n_gen >= max) { st->stop = GEN_STOP_LENGTH; break; }
        for (int i = 0; i < g->n_masked; i++) g->logits[g->masked[i]] = -INFINITY;
        int32_t id = sampler_sample(&g->smp, g->logits, g->vocab);
        g->have_logits = 0;
        if (is_stop(cfg, o, id)) {
            st->stop = GEN_STOP_EOS;
            st->stop_id = id;
            break;
        }
        sampler_accept(&g->smp, id);
        st->n_gen++;
        if ((rc = tok_stream_push(&ts, id, &b, &bl, err)) < 0) break;
        if (fn && fn(user, id, b, bl)) { st->stop = GEN_STOP_CALLBACK; break; }
        if (max >= 0 && st->n_gen >= max) { st->stop = GEN_STOP_LENGTH; break; }
        if (g->n_ids >= g->ctx) { st->stop = GEN_STOP_CONTEXT; break; }
        if ((rc = petrel_session_forward(g->s, &id, 1, g->logits, 0, err)) < 0) break;
        st->n_forwards++;
        g->ids[g->n_ids++] = id;
        g->have_logits = 1;
    }
    if (rc >= 0 && tok_stream_flush(&ts, &b, &bl, err) >= 0 && bl && fn) fn(user, -1, b, bl);
    tok_stream_free(&ts);
    st->gen_s = now_s() - t0;
    gen_json(g, st);
    return rc < 0 ? rc : 0;
}

int generate_text(petrel_engine *eng, const tokenizer *tok, const char *prompt, size_t prompt_len,
                  const sampler_params *sp, const gen_opts *o, gen_piece_fn fn, void *user,
                  gen_stats *st, petrel_error *err) {
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = tok_encode(tok, prompt, prompt_len, &ids, &n, err);
    if (rc < 0) return rc;
    int maxpos = petrel_engine_config(eng)->max_position_embeddings;
    if (n == 0) {
        free(ids);
        return pt_err(err, PETREL_EINVAL, "empty prompt: it encodes to no tokens");
    }
    if (n > (size_t)maxpos) {
        free(ids);
        return pt_err(err, PETREL_ERANGE, "the prompt is %zu tokens, more than the model's %d positions", n, maxpos);
    }
    int max = o ? o->max_tokens : -1;
    /* the last sampled token is emitted, never fed back: n + max - 1 positions suffice */
    long ctx = max < 0 || (o && o->session) ? maxpos : (long)n + (max > 0 ? max - 1 : 0); /* a session grows over runs */
    if (ctx > maxpos) ctx = maxpos;
    gen_ctx g;
    rc = gen_init(&g, eng, tok, (int)ctx, sp, err);
    if (rc < 0) {
        free(ids);
        return rc;
    }
    if (o && o->spec && (rc = gen_enable_spec(&g, o->spec, err)) < 0) {
        gen_free(&g);
        free(ids);
        return rc;
    }
    if (o && o->progress) petrel_session_set_progress(g.s, o->progress, o->progress_user);
    if (o && o->session && access(o->session, F_OK) == 0) rc = gen_load(&g, o->session, err);
    if (rc >= 0) rc = gen_prompt(&g, ids, (int)n, st, err);
    free(ids);
    if (rc >= 0) rc = gen_generate(&g, o, fn, user, st, err);
    if (rc >= 0 && o && o->session) rc = gen_save(&g, o->session, err);
    gen_free(&g);
    return rc;
}
