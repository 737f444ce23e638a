/* server.c: the scheduler thread and the HTTP front of `petrel serve` (see server.h).
 *
 * Locking: one mutex (serve.mu) guards the queue, the running set, every job's output fields
 * (text released so far, done, finish, error) and the counters. The scheduler holds it only to
 * take jobs in and to publish results, never across a forward. A job is shared by its
 * connection thread and the scheduler (refs = 2); whichever lets go last frees it. Encoding and
 * template rendering run on connection threads under tok_mu. */
#include "serve/server.h"

#include <arpa/inet.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "base/sbuf.h"
#include "base/err.h"
#include "runtime/chat.h"
#include "runtime/sampler.h"
#include "runtime/spec.h"
#include "serve/persist.h"
#include "serve/request.h"
#include "serve/toolcall.h"


static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { J_QUEUED, J_RUNNING, J_DONE };

/* What the n choices of one request share: the condition their connection waits on and the
 * request's tools. Freed with the last of its jobs. */
typedef struct jgroup {
    pthread_cond_t cv;
    int refs;                 /* jobs holding it */
    cJSON *tools;             /* owned; NULL without tools (or tool_choice none) */
} jgroup;

typedef struct tcall {
    char *name, *args;        /* owned */
} tcall;

typedef struct job {
    struct job *next;         /* queue link */
    int refs;                 /* connection + scheduler */
    int state, cancelled;
    long id;
    int chat;
    int32_t *ids;             /* owned [cap]: prompt then generated ids */
    int n_prompt, n_ids, cap, max_new, n_out, fed, n_cached;
    sampler smp;              /* owned */
    int have_smp, penalties, ignore_eos;
    char *stop[SERVE_MAX_STOP];
    int n_stop;
    petrel_session *s;        /* owned while running */
    tok_stream ts;
    chat_split cs;
    sbuf hold;                /* scheduler only: answer bytes held back for stop matching */
    /* published under serve.mu */
    sbuf content, reasoning;
    int done;
    const char *finish;       /* "stop" | "length" */
    int err_status;           /* != 0: failed with errmsg */
    char errmsg[1100];
    double t_queued, t_first, t_last;
    long created;             /* unix time of arrival: every chunk's "created" */
    jgroup *g;                /* shared by the request's choices */
    /* n > 1: choice 0 leads; the others wait unqueued until its prompt is read, then fork its
     * session (copy-on-write) and sample their first token from the same logits */
    int choice;
    struct job **fol;         /* owned array (leader only): the other choices, whose scheduler
                                 references the leader holds until `forked` */
    int n_fol, forked;
    /* tools: the answer text goes through a tool-call parser; calls published under mu */
    int tools_on;
    tc_parser tp;
    tcall *calls;
    int n_calls, cap_calls;
    /* tool_choice required / named: these ids are taken instead of samples as soon as the
     * answer begins (after </think>, or at once without thinking) */
    int32_t *force;
    int n_force, force_i, force_state; /* 0 waiting, 1 forcing, 2 done */
    /* logprobs: per generated token its log probability and the top lp_k alternatives */
    int lp_on, lp_k;
    float *lp, *lp_top;       /* [max_new], [max_new][lp_k] */
    int32_t *lp_top_id;       /* [max_new][lp_k] */
    int lora;                 /* the LoRA adapter the request's "model" names (-1: the base) */
    /* --draft: the job's timeline in the server's speculative context (spec.h); its prompt is
     * fed through spec_feed (the MTP rows with it) and its decode runs in spec_step with the
     * other drafting jobs. Not for jobs with logprobs, forced tokens or several choices. */
    int spec_on;
    spec_seq sq;
} job;

typedef struct metrics {
    long requests_ok, requests_err, prompt_tokens, gen_tokens, cached_tokens, forwards, rows;
    double ttft_sum, itl_sum;
    long ttft_n, itl_n;
    long ttft_le[8];          /* histogram buckets, see ttft_bounds */
    long itl_le[8];           /* see itl_bounds */
    long batch_le[10];        /* rows per forward, see batch_bounds */
} metrics;
static const double ttft_bounds[8] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
static const double itl_bounds[8] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};
static const int batch_bounds[10] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};

struct serve {
    petrel_engine *eng;       /* borrowed */
    const tokenizer *tok;     /* borrowed */
    const jinja_template *tmpl; /* borrowed, may be NULL */
    serve_opts o;
    char *model_name, *api_key; /* owned copies */
    int V, ctx;
    int32_t *masked;          /* ids the tokenizer cannot decode: never sampled */
    int n_masked;
    int32_t chat_stop[3];
    int n_chat_stop;
    pthread_mutex_t mu, tok_mu;
    pthread_cond_t sched_cv;
    job *q_head, *q_tail;
    int n_queued;
    job **run;                /* [parallel] */
    int n_run;
    int stopping;
    int n_conn;               /* open connections (on_connection) */
    long next_id;
    metrics m;
    pthread_t sched;
    int sched_started;
    struct MHD_Daemon *d;
    int port;
    petrel_batch *b;
    petrel_row *rows;
    job **row_job;
    float *lg;                /* [parallel][V] */
    float *lp_row, *fork_row; /* [V] each: a row kept for logprobs, a copy for a forked choice */
    persist *ps;              /* --session-dir, or NULL */
    spec_ctx *spec;           /* --draft, or NULL */
    spec_seq **sseq;          /* [parallel] */
    job **sjob;               /* [parallel] */
    float *spec_lg;           /* [V] */
    int ps_loaded, ps_skipped;
    long ps_written;          /* once the writer has stopped */
};

/* ---------- jobs ---------- */

static void job_release_locked(serve *sv, job *j) {
    (void)sv;
    if (--j->refs > 0) return;
    if (j->spec_on) spec_seq_free(&j->sq);
    if (j->have_smp) sampler_free(&j->smp);
    petrel_session_free(j->s);
    tok_stream_free(&j->ts);
    for (int k = 0; k < j->n_stop; k++) free(j->stop[k]);
    free(j->ids);
    free(j->hold.p);
    free(j->content.p);
    free(j->reasoning.p);
    tc_free(&j->tp);
    for (int k = 0; k < j->n_calls; k++) free(j->calls[k].name), free(j->calls[k].args);
    free(j->calls);
    free(j->force);
    free(j->lp);
    free(j->lp_top);
    free(j->lp_top_id);
    free(j->fol);
    if (j->g && --j->g->refs == 0) {
        pthread_cond_destroy(&j->g->cv);
        cJSON_Delete(j->g->tools);
        free(j->g);
    }
    free(j);
}

/* Under mu: the job ends (once). The scheduler drops its session at the next step. */
static void job_finish_locked(serve *sv, job *j, const char *finish, int status, const char *msg) {
    if (j->done) return;
    if (status) {
        j->err_status = status;
        snprintf(j->errmsg, sizeof j->errmsg, "%s", msg ? msg : "internal error");
        if (j->choice == 0) sv->m.requests_err++; /* a request counts once, by its first choice */
    } else {
        j->finish = j->n_calls && !strcmp(finish, "stop") ? "tool_calls" : finish;
        if (j->choice == 0) sv->m.requests_ok++;
    }
    j->done = 1;
    j->state = J_DONE;
    pthread_cond_broadcast(&j->g->cv);
    /* Until they fork, a leader holds its choices' scheduler references: one that fails (or
     * is cancelled) before then ends them too and lets go of them. */
    if (status && !j->forked) {
        for (int k = 0; k < j->n_fol; k++) {
            job_finish_locked(sv, j->fol[k], NULL, status, msg);
            job_release_locked(sv, j->fol[k]);
        }
        j->n_fol = 0;
    }
}

/* Answer text through the stop strings: bytes that could still begin a stop string are held
 * back; a match ends the job with "stop" and nothing from the match on is released. Returns 1
 * when a stop string matched. */
static int emit_answer(serve *sv, job *j, const char *b, size_t n) {
    sb_add(&j->hold, b, n);
    if (j->hold.oom) return 0;
    size_t cut = j->hold.n, keep = 0;
    int hit = 0;
    for (int k = 0; k < j->n_stop; k++) {
        const char *p = memmem(j->hold.p, j->hold.n, j->stop[k], strlen(j->stop[k]));
        if (p && (size_t)(p - j->hold.p) < cut) cut = (size_t)(p - j->hold.p), hit = 1;
    }
    if (!hit)
        for (int k = 0; k < j->n_stop; k++) {
            size_t sl = strlen(j->stop[k]);
            for (size_t l = sl - 1; l > keep; l--)
                if (l <= j->hold.n && !memcmp(j->hold.p + j->hold.n - l, j->stop[k], l)) { keep = l; break; }
        }
    size_t rel = hit ? cut : j->hold.n - keep;
    pthread_mutex_lock(&sv->mu);
    sb_add(&j->content, j->hold.p, rel);
    if (hit) job_finish_locked(sv, j, "stop", 0, NULL);
    pthread_cond_broadcast(&j->g->cv);
    pthread_mutex_unlock(&sv->mu);
    memmove(j->hold.p, j->hold.p + rel, j->hold.n - rel);
    j->hold.n -= rel;
    if (hit) j->hold.n = 0;
    return hit;
}

typedef struct { serve *sv; job *j; } split_ctx;
static void on_tool_text(void *user, const char *b, size_t n) {
    split_ctx *c = user;
    if (!c->j->done) emit_answer(c->sv, c->j, b, n);
}
static void on_tool_call(void *user, const char *name, const char *args) {
    split_ctx *c = user;
    job *j = c->j;
    if (j->done) return;
    pthread_mutex_lock(&c->sv->mu);
    if (j->n_calls == j->cap_calls) {
        int cap = j->cap_calls ? 2 * j->cap_calls : 4;
        tcall *nc = realloc(j->calls, sizeof *nc * (size_t)cap);
        if (nc) j->calls = nc, j->cap_calls = cap;
    }
    if (j->n_calls < j->cap_calls) {
        tcall t = {strdup(name), strdup(args)};
        if (t.name && t.args) j->calls[j->n_calls++] = t;
        else free(t.name), free(t.args);
    }
    pthread_cond_broadcast(&j->g->cv);
    pthread_mutex_unlock(&c->sv->mu);
}
static void on_split(void *user, int thinking, const char *b, size_t n) {
    split_ctx *c = user;
    if (c->j->done) return;
    if (thinking) {
        pthread_mutex_lock(&c->sv->mu);
        sb_add(&c->j->reasoning, b, n);
        pthread_cond_broadcast(&c->j->g->cv);
        pthread_mutex_unlock(&c->sv->mu);
    } else if (c->j->tools_on)
        tc_feed(&c->j->tp, b, n, on_tool_text, on_tool_call, c);
    else
        emit_answer(c->sv, c->j, b, n);
}

static void push_bytes(serve *sv, job *j, int32_t id, const char *b, size_t n) {
    split_ctx c = {sv, j};
    if (j->chat) chat_split_piece(&j->cs, id, b, n, on_split, &c);
    else if (n) emit_answer(sv, j, b, n);
}

/* The job reached its end without a stop string: what is held goes out. */
static void flush_and_finish(serve *sv, job *j, const char *finish) {
    const char *b = NULL;
    size_t n = 0;
    petrel_error e = {0};
    if (tok_stream_flush(&j->ts, &b, &n, &e) == 0 && n) push_bytes(sv, j, -1, b, n);
    split_ctx c = {sv, j};
    if (j->tools_on && !j->done) tc_flush(&j->tp, on_tool_text, &c);
    pthread_mutex_lock(&sv->mu);
    if (!j->done) {
        sb_add(&j->content, j->hold.p, j->hold.n);
        j->hold.n = 0;
        job_finish_locked(sv, j, finish, 0, NULL);
    }
    pthread_mutex_unlock(&sv->mu);
}

static int is_stop_id(serve *sv, job *j, int32_t t) {
    if (j->ignore_eos) return 0;
    if (petrel_engine_is_eos(sv->eng, t)) return 1;
    for (int k = 0; j->chat && k < sv->n_chat_stop; k++)
        if (sv->chat_stop[k] == t) return 1;
    return 0;
}

/* The log-softmax normalizer of a row (double; -inf entries are left out) and its k highest
 * ids, highest first, lower id on ties. */
static double row_lse(const float *l, int V) {
    double m = -INFINITY, z = 0;
    for (int i = 0; i < V; i++)
        if (l[i] > m) m = l[i];
    if (m == -INFINITY) return m;
    for (int i = 0; i < V; i++) z += exp((double)l[i] - m);
    return m + log(z);
}
static void row_topk(const float *l, int V, int k, int32_t *ids) {
    int n = 0;
    for (int i = 0; i < V && k > 0; i++) {
        if (isnan(l[i])) continue;
        if (n == k && !(l[i] > l[ids[k - 1]])) continue;
        int p = n < k ? n++ : k - 1;
        while (p > 0 && l[i] > l[ids[p - 1]]) ids[p] = ids[p - 1], p--;
        ids[p] = i;
    }
    for (int i = n; i < k; i++) ids[i] = -1;
}

/* One sampled token of a running job. logprobs are those of the model's distribution: the
 * log-softmax of the row as the model gave it (ids the tokenizer cannot decode excluded),
 * before penalties, temperature and truncation change what the sampler draws from. */
static void emit_token(serve *sv, job *j, int32_t t, int accept);
static void take_token(serve *sv, job *j, float *lg) {
    for (int i = 0; i < sv->n_masked; i++) lg[sv->masked[i]] = -INFINITY;
    double lse = 0;
    if (j->lp_on && j->n_out < j->max_new) {
        lse = row_lse(lg, sv->V);
        memcpy(sv->lp_row, lg, sizeof(float) * (size_t)sv->V); /* the sampler changes lg */
        if (j->lp_k) {
            int32_t *ti = j->lp_top_id + (size_t)j->n_out * (size_t)j->lp_k;
            row_topk(lg, sv->V, j->lp_k, ti);
            for (int k = 0; k < j->lp_k; k++) j->lp_top[(size_t)j->n_out * (size_t)j->lp_k + k] = ti[k] < 0 ? -INFINITY : (float)(lg[ti[k]] - lse);
        }
    }
    if (j->force_state == 0 && j->n_force && !j->cs.in_think) j->force_state = 1;
    int32_t t;
    if (j->force_state == 1) {
        t = j->force[j->force_i++];
        if (j->force_i == j->n_force) j->force_state = 2;
    } else
        t = sampler_sample(&j->smp, lg, sv->V);
    if (j->lp_on && j->n_out < j->max_new) j->lp[j->n_out] = (float)((double)sv->lp_row[t] - lse);
    emit_token(sv, j, t, 1);
}

/* A token of j's answer, sampled (accept: the sampler has yet to accept it) or emitted by a
 * speculative step (accepted there): timings, stop ids, the text through the stop strings and
 * the tool-call parser, the length limit. */
static void emit_token(serve *sv, job *j, int32_t t, int accept) {
    double now = now_s();
    pthread_mutex_lock(&sv->mu);
    if (j->n_out == 0) {
        j->t_first = now;
        double d = now - j->t_queued;
        if (j->choice == 0) { /* once per request */
            sv->m.ttft_sum += d;
            sv->m.ttft_n++;
            for (int k = 0; k < 8; k++)
                if (d <= ttft_bounds[k]) sv->m.ttft_le[k]++;
        }
    } else {
        double d = now - j->t_last;
        sv->m.itl_sum += d;
        sv->m.itl_n++;
        for (int k = 0; k < 8; k++)
            if (d <= itl_bounds[k]) sv->m.itl_le[k]++;
    }
    j->t_last = now;
    pthread_mutex_unlock(&sv->mu);
    if (is_stop_id(sv, j, t)) { flush_and_finish(sv, j, "stop"); return; }
    pthread_mutex_lock(&sv->mu);
    j->ids[j->n_ids++] = t;
    j->n_out++;
    sv->m.gen_tokens++;
    pthread_mutex_unlock(&sv->mu);
    if (j->penalties && accept) sampler_accept(&j->smp, t);
    const char *b = NULL;
    size_t n = 0;
    petrel_error e = {0};
    if (tok_stream_push(&j->ts, t, &b, &n, &e) < 0) {
        pthread_mutex_lock(&sv->mu);
        job_finish_locked(sv, j, NULL, 500, e.msg);
        pthread_mutex_unlock(&sv->mu);
        return;
    }
    push_bytes(sv, j, t, b, n);
    if (!j->done && j->n_out >= j->max_new) flush_and_finish(sv, j, "length");
}

/* ---------- the scheduler ---------- */

/* Positions of KV a job may grow into, in whole pages; an unforked leader counts its choices
 * too (each may grow as far; shared prompt pages make this an upper bound). */
static long long job_need(const job *j, int page) {
    long long one = ((long long)j->cap + page - 1) / page * page;
    return one * (1 + (j->forked ? 0 : j->n_fol));
}

/* The leader's prompt is read: each other choice takes a copy-on-write fork of its session and
 * samples its first token from a copy of the same logits row, then runs on its own. */
static void fork_choices(serve *sv, job *j, const float *row) {
    for (int k = 0; k < j->n_fol; k++) {
        job *f = j->fol[k];
        petrel_error e = {0};
        int rc = petrel_session_fork(j->s, &f->s, &e);
        pthread_mutex_lock(&sv->mu);
        if (rc) {
            job_finish_locked(sv, f, NULL, 503, e.msg);
            job_release_locked(sv, f);
            pthread_mutex_unlock(&sv->mu);
            continue;
        }
        f->fed = j->fed;
        f->n_cached = j->n_cached;
        f->state = J_RUNNING;
        sv->run[sv->n_run++] = f;
        pthread_mutex_unlock(&sv->mu);
        memcpy(sv->fork_row, row, sizeof(float) * (size_t)sv->V);
        if (!f->done) take_token(sv, f, sv->fork_row);
    }
    pthread_mutex_lock(&sv->mu);
    j->forked = 1;
    pthread_mutex_unlock(&sv->mu);
}

/* --draft: the drafting jobs' work of one scheduler step. Prompts: the next chunk of each through
 * spec_feed (its MTP rows with it), the first token sampled from its last logits. Decode: one
 * spec_step over every drafting job with a pending token (draft, one verify forward of all their
 * windows, accept), each job's accepted tokens emitted in order. Returns how many jobs ran. */
static int spec_jobs(serve *sv, int n_run) {
    int m = 0, ran = 0;
    for (int a = 0; a < n_run; a++) {
        job *j = sv->run[a];
        if (!j->spec_on || j->done || !j->s) continue;
        petrel_error e = {0};
        if (j->fed < j->n_prompt) {
            int take = j->n_prompt - j->fed, ch = petrel_session_chunk(j->s);
            if (take > ch) take = ch;
            int last = j->fed + take == j->n_prompt;
            if (spec_feed(&j->sq, j->ids + j->fed, take, last ? sv->spec_lg : NULL, &e) < 0) {
                pthread_mutex_lock(&sv->mu);
                job_finish_locked(sv, j, NULL, e.code == PETREL_ERANGE || e.code == PETREL_ENOMEM ? 503 : 500, e.msg);
                pthread_mutex_unlock(&sv->mu);
                continue;
            }
            j->fed += take;
            ran++;
            if (last) {
                petrel_session_prefix_put(j->s, &(petrel_error){0}); /* a hint, MTP rows included */
                take_token(sv, j, sv->spec_lg);
                if (!j->done) spec_set_token(&j->sq, j->ids[j->n_ids - 1]);
            }
            continue;
        }
        int room = j->cap - petrel_session_len(j->s), left = j->max_new - j->n_out;
        if (room < 1) {
            pthread_mutex_lock(&sv->mu);
            job_finish_locked(sv, j, "length", 0, NULL);
            pthread_mutex_unlock(&sv->mu);
            continue;
        }
        j->sq.limit = left < room ? left : room;
        sv->sseq[m] = &j->sq;
        sv->sjob[m++] = j;
    }
    if (!m) return ran;
    petrel_error e = {0};
    int rc = spec_step(sv->spec, sv->sseq, m, &e);
    pthread_mutex_lock(&sv->mu);
    sv->m.forwards++;
    pthread_mutex_unlock(&sv->mu);
    for (int i = 0; i < m; i++) {
        job *j = sv->sjob[i];
        if (rc < 0) { /* rolled back: the step's jobs end with its error */
            pthread_mutex_lock(&sv->mu);
            job_finish_locked(sv, j, NULL, rc == PETREL_ERANGE || rc == PETREL_ENOMEM ? 503 : 500, e.msg);
            pthread_mutex_unlock(&sv->mu);
            continue;
        }
        for (int k = 0; k < j->sq.nout && !j->done; k++) emit_token(sv, j, j->sq.out[k], 0);
        if (!j->done) spec_set_token(&j->sq, j->sq.out[j->sq.nout - 1]);
    }
    return ran + m;
}

static void *sched_main(void *arg) {
    serve *sv = arg;
    const int max_rows = sv->o.max_rows;
    for (;;) {
        pthread_mutex_lock(&sv->mu);
        while (!sv->stopping && !sv->q_head && sv->n_run == 0) pthread_cond_wait(&sv->sched_cv, &sv->mu);
        if (sv->stopping) { /* everything still open ends with an error; what finished is kept first */
            for (int a = 0; a < sv->n_run; a++) {
                job *j = sv->run[a];
                if (j->done && sv->ps && !j->err_status && j->s) persist_offer(sv->ps, j->s); /* a finished job not yet swept below */
                job_finish_locked(sv, j, NULL, 503, "the server is shutting down");
                job_release_locked(sv, j);
            }
            sv->n_run = 0;
            while (sv->q_head) {
                job *j = sv->q_head;
                sv->q_head = j->next;
                job_finish_locked(sv, j, NULL, 503, "the server is shutting down");
                job_release_locked(sv, j);
            }
            sv->q_tail = NULL;
            sv->n_queued = 0;
            pthread_mutex_unlock(&sv->mu);
            break;
        }
        /* finished or cancelled jobs free their place */
        for (int a = 0; a < sv->n_run;) {
            job *j = sv->run[a];
            if (j->cancelled && !j->done) job_finish_locked(sv, j, NULL, 499, "cancelled: the client went away");
            if (j->done) {
                if (sv->ps && !j->err_status && j->s) persist_offer(sv->ps, j->s); /* its KV for later runs */
                if (j->spec_on) spec_seq_free(&j->sq);
                j->spec_on = 0;
                petrel_session_free(j->s);
                j->s = NULL;
                job_release_locked(sv, j);
                sv->run[a] = sv->run[--sv->n_run];
            } else a++;
        }
        int first_new = sv->n_run;
        /* Admission from the KV pool: a request starts only when the pages it can grow into fit
         * beside what the running ones may still take (each may grow to its cap); one that can
         * never fit the pool is refused now, with the numbers, instead of failing mid-way. A
         * request of n choices takes n places of --parallel. */
        long long kv_free = 0, kv_total = 0, owed = 0;
        int kv_page = 1, used = 0;
        petrel_kv_usage(sv->eng, &kv_free, &kv_total, &kv_page);
        for (int a = 0; a < sv->n_run; a++) {
            const job *r = sv->run[a];
            long long want = job_need(r, kv_page), held = r->s ? petrel_session_kv_reserved(r->s) : 0;
            if (want > held) owed += want - held;
            used += 1 + (r->forked ? 0 : r->n_fol);
        }
        while (sv->q_head && used + 1 + sv->q_head->n_fol <= sv->o.parallel) {
            job *j = sv->q_head;
            if (j->cancelled) {
                sv->q_head = j->next;
                if (!sv->q_head) sv->q_tail = NULL;
                sv->n_queued--;
                job_finish_locked(sv, j, NULL, 499, "cancelled");
                job_release_locked(sv, j);
                continue;
            }
            long long need = job_need(j, kv_page);
            if (need > kv_total) { /* never: refuse it */
                sv->q_head = j->next;
                if (!sv->q_head) sv->q_tail = NULL;
                sv->n_queued--;
                char msg[256];
                snprintf(msg, sizeof msg, "the request needs %lld KV positions (prompt + max_tokens%s) but the KV pool holds %lld (raise --kv-size or lower max_tokens%s)",
                         need, j->n_fol ? ", for each of n choices" : "", kv_total, j->n_fol ? " or n" : "");
                job_finish_locked(sv, j, NULL, 503, msg);
                job_release_locked(sv, j);
                continue;
            }
            if (need + owed > kv_free && sv->n_run > 0) break; /* wait for running ones to finish */
            sv->q_head = j->next;
            if (!sv->q_head) sv->q_tail = NULL;
            sv->n_queued--;
            j->state = J_RUNNING;
            sv->run[sv->n_run++] = j;
            owed += need;
            used += 1 + j->n_fol;
        }
        int n_run = sv->n_run;
        pthread_mutex_unlock(&sv->mu);
        if (!n_run) continue;
        /* sessions for the new jobs; a known prefix comes from the cache */
        for (int a = first_new; a < n_run; a++) {
            job *j = sv->run[a];
            petrel_error e = {0};
            if (petrel_session_create(sv->eng, j->cap, &j->s, &e) ||
                (j->lora >= 0 && petrel_session_set_lora(j->s, &j->lora, NULL, 1, &e))) { /* the adapter before the prefix lookup */
                pthread_mutex_lock(&sv->mu);
                job_finish_locked(sv, j, NULL, 503, e.msg);
                pthread_mutex_unlock(&sv->mu);
                continue;
            }
            int got = petrel_session_prefix_get(j->s, j->ids, j->n_prompt - 1, &e);
            if (got > 0) {
                j->fed = got;
                j->n_cached = got;
                pthread_mutex_lock(&sv->mu);
                sv->m.cached_tokens += got;
                pthread_mutex_unlock(&sv->mu);
            }
            /* drafting: the job's own timeline over the session (cached rows without MTP rows get
             * zero latents there: still exact, drafts only weaker) */
            if (sv->spec && !j->lp_on && !j->n_force && !j->n_fol && j->choice == 0) {
                if (spec_seq_init(&j->sq, sv->spec, j->s, &j->smp, sv->masked, sv->n_masked, &e)) {
                    pthread_mutex_lock(&sv->mu);
                    job_finish_locked(sv, j, NULL, 500, e.msg);
                    pthread_mutex_unlock(&sv->mu);
                } else j->spec_on = 1;
            }
        }
        /* rows: a decode row per generating job first, then prompt chunks */
        int n = 0;
        for (int a = 0; a < n_run; a++) {
            job *j = sv->run[a];
            if (j->done || !j->s || j->spec_on || j->fed < j->n_prompt || n >= max_rows) continue;
            sv->rows[n] = (petrel_row){j->s, j->ids[j->n_ids - 1], 1};
            sv->row_job[n++] = j;
        }
        for (int a = 0; a < n_run && n < max_rows; a++) {
            job *j = sv->run[a];
            if (j->done || !j->s || j->spec_on || j->fed >= j->n_prompt) continue;
            int take = j->n_prompt - j->fed, ch = petrel_session_chunk(j->s);
            if (take > ch) take = ch;
            if (take > max_rows - n) take = max_rows - n;
            for (int k = 0; k < take; k++) {
                int last = j->fed + k == j->n_prompt - 1;
                sv->rows[n] = (petrel_row){j->s, j->ids[j->fed + k], last};
                sv->row_job[n++] = j;
            }
        }
        int ran_spec = sv->spec ? spec_jobs(sv, n_run) : 0;
        if (!n) {
            if (ran_spec) continue;
            continue;
        }
        petrel_error e = {0};
        int rc = petrel_batch_forward(sv->b, sv->rows, n, sv->lg, &e);
        pthread_mutex_lock(&sv->mu);
        sv->m.forwards++;
        sv->m.rows += n;
        for (int k = 0; k < 10; k++)
            if (n <= batch_bounds[k]) sv->m.batch_le[k]++;
        pthread_mutex_unlock(&sv->mu);
        if (rc) {
            /* A failed forward appends nothing. Rerun each job's rows alone (rows are independent
             * of their batch: the same logits), so only the jobs that fail by themselves (a read
             * error of their experts, a full KV pool) end with the error; the others go on. */
            int li0 = 0;
            for (int r = 0; r < n;) {
                job *j = sv->row_job[r];
                int r1 = r, nl = 0;
                while (r1 < n && sv->row_job[r1] == j) nl += sv->rows[r1++].want_logits;
                petrel_error e1 = {0};
                int rc1 = petrel_batch_forward(sv->b, sv->rows + r, r1 - r, sv->lg + (size_t)li0 * (size_t)sv->V, &e1);
                if (rc1) {
                    pthread_mutex_lock(&sv->mu);
                    job_finish_locked(sv, j, NULL, rc1 == PETREL_ERANGE || rc1 == PETREL_ENOMEM ? 503 : 500, e1.msg);
                    pthread_mutex_unlock(&sv->mu);
                }
                li0 += nl;
                r = r1;
            }
        }
        int li = 0;
        for (int r = 0; r < n; r++) {
            job *j = sv->row_job[r];
            int want = sv->rows[r].want_logits;
            float *row = want ? sv->lg + (size_t)li++ * (size_t)sv->V : NULL;
            if (j->done) continue; /* failed in this forward: its rows were not appended */
            if (j->fed < j->n_prompt) {
                if (++j->fed == j->n_prompt) petrel_session_prefix_put(j->s, &(petrel_error){0}); /* a hint */
            } else
                j->fed++;
            if (want && j->n_fol && !j->forked) fork_choices(sv, j, row);
            if (want) take_token(sv, j, row);
        }
    }
    return NULL;
}

/* ---------- HTTP ---------- */

typedef struct conn {
    sbuf body;
    int too_big;
    int over;                 /* arrived over --max-connections: answered 503 */
} conn;

/* Open TCP connections. The daemon accepts a few more than max_connections so that those get
 * an OpenAI 503 body instead of a closed socket; beyond that it closes them. The socket context
 * marks a connection that arrived over the limit. */
#define SERVE_CONN_SPARE 32
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context, enum MHD_ConnectionNotificationCode toe) {
    (void)c;
    serve *sv = cls;
    pthread_mutex_lock(&sv->mu);
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) *socket_context = (void *)(intptr_t)(++sv->n_conn > sv->o.max_connections);
    else sv->n_conn--;
    pthread_mutex_unlock(&sv->mu);
}

static int queue_response(struct MHD_Connection *c, int status, const char *ctype, char *body, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(body); return MHD_NO; }
    MHD_add_response_header(r, "Content-Type", ctype);
    int ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static int send_json(struct MHD_Connection *c, int status, cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!s) return MHD_NO;
    return queue_response(c, status, "application/json", s, strlen(s));
}

static const char *err_type(int status) {
    return status == 401 ? "authentication_error" : status == 404 ? "not_found_error" : status < 500 ? "invalid_request_error" : status == 503 ? "server_overloaded" : "server_error";
}

static cJSON *error_obj(int status, const char *code, const char *param, const char *msg) {
    cJSON *j = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(j, "error");
    char *clean = chat_utf8_clean(msg, strlen(msg));
    cJSON_AddStringToObject(e, "message", clean ? clean : "error");
    free(clean);
    cJSON_AddStringToObject(e, "type", err_type(status));
    if (param && *param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    return j;
}

static int send_error(struct MHD_Connection *c, int status, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int send_error(struct MHD_Connection *c, int status, const char *code, const char *param, const char *fmt, ...) {
    char msg[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return send_json(c, status, error_obj(status, code, param, msg));
}

/* Constant time in the key's length: every byte of the key is compared, whatever the input. */
static int key_ok(const serve *sv, struct MHD_Connection *c) {
    if (!sv->api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    const char *k = sv->api_key;
    size_t kn = strlen(k);
    if (!h || strncmp(h, "Bearer ", 7)) return 0;
    h += 7;
    size_t hn = strlen(h);
    volatile unsigned char d = hn != kn;
    for (size_t i = 0; i < kn; i++) d |= (unsigned char)(i < hn ? h[i] : 0) ^ (unsigned char)k[i];
    return d == 0;
}

/* Usage over a request's choices: the prompt once, the completions summed. */
static cJSON *usage_obj(job *const *js, int n) {
    int out = 0;
    for (int k = 0; k < n; k++) out += js[k]->n_out;
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", js[0]->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", out);
    cJSON_AddNumberToObject(u, "total_tokens", js[0]->n_prompt + out);
    if (js[0]->n_cached) {
        cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
        cJSON_AddNumberToObject(d, "cached_tokens", js[0]->n_cached);
    }
    return u;
}

static void add_clean(cJSON *o, const char *name, const char *s, size_t n) {
    char *c = chat_utf8_clean(s ? s : "", s ? n : 0);
    cJSON_AddStringToObject(o, name, c ? c : "");
    free(c);
}

static cJSON *ids_arr(const int32_t *ids, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int k = 0; a && k < n; k++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[k]));
    return a;
}

/* The envelope of a reply or a chunk. */
static cJSON *envelope(const serve *sv, const job *j, const char *object) {
    cJSON *r = cJSON_CreateObject();
    char id[64];
    snprintf(id, sizeof id, "%s-%ld", j->chat ? "chatcmpl" : "cmpl", j->id);
    cJSON_AddStringToObject(r, "id", id);
    cJSON_AddStringToObject(r, "object", object);
    cJSON_AddNumberToObject(r, "created", (double)j->created);
    cJSON_AddStringToObject(r, "model", sv->model_name);
    return r;
}

/* ---------- logprobs and tool calls in replies ---------- */

static double lp_num(float v) { return isfinite(v) ? v : -9999.0; } /* OpenAI's -inf */

/* {"token", "logprob", "bytes"}: the token's text (clean UTF-8; a piece of a character shows as
 * U+FFFD) and its exact bytes. */
static cJSON *lp_token(const serve *sv, int32_t id, float lp) {
    size_t n = 0;
    const char *b = id >= 0 ? tok_id_to_bytes(sv->tok, id, &n) : NULL;
    cJSON *o = cJSON_CreateObject(), *by = cJSON_CreateArray();
    add_clean(o, "token", b ? b : "", b ? n : 0);
    cJSON_AddNumberToObject(o, "logprob", lp_num(lp));
    for (size_t k = 0; b && k < n; k++) cJSON_AddItemToArray(by, cJSON_CreateNumber((unsigned char)b[k]));
    cJSON_AddItemToObject(o, "bytes", by);
    return o;
}

/* Chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}...], "refusal": null} for the
 * generated tokens [from, to). */
static cJSON *chat_logprobs(const serve *sv, const job *j, int from, int to) {
    cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "content");
    for (int t = from; t < to; t++) {
        cJSON *e = lp_token(sv, j->ids[j->n_prompt + t], j->lp[t]), *top = cJSON_AddArrayToObject(e, "top_logprobs");
        for (int k = 0; k < j->lp_k; k++) {
            int32_t id = j->lp_top_id[(size_t)t * (size_t)j->lp_k + k];
            if (id >= 0) cJSON_AddItemToArray(top, lp_token(sv, id, j->lp_top[(size_t)t * (size_t)j->lp_k + k]));
        }
        cJSON_AddItemToArray(a, e);
    }
    cJSON_AddNullToObject(o, "refusal");
    return o;
}

/* Completions: {tokens, token_logprobs, top_logprobs (null when logprobs is 0), text_offset}
 * for [from, to); text_offset counts bytes of the completion text, *off carries it on. */
static cJSON *cmpl_logprobs(const serve *sv, const job *j, int from, int to, size_t *off) {
    cJSON *o = cJSON_CreateObject(), *tk = cJSON_AddArrayToObject(o, "tokens"), *tl = cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON *top = j->lp_k ? cJSON_AddArrayToObject(o, "top_logprobs") : (cJSON_AddNullToObject(o, "top_logprobs"), NULL);
    cJSON *to_ = cJSON_AddArrayToObject(o, "text_offset");
    for (int t = from; t < to; t++) {
        size_t n = 0;
        const char *b = tok_id_to_bytes(sv->tok, j->ids[j->n_prompt + t], &n);
        char *s = chat_utf8_clean(b ? b : "", b ? n : 0);
        cJSON_AddItemToArray(tk, cJSON_CreateString(s ? s : ""));
        free(s);
        cJSON_AddItemToArray(tl, cJSON_CreateNumber(lp_num(j->lp[t])));
        cJSON_AddItemToArray(to_, cJSON_CreateNumber((double)*off));
        *off += n;
        if (!top) continue;
        cJSON *d = cJSON_CreateObject();
        for (int k = 0; k < j->lp_k; k++) {
            int32_t id = j->lp_top_id[(size_t)t * (size_t)j->lp_k + k];
            if (id < 0) continue;
            const char *tb = tok_id_to_bytes(sv->tok, id, &n);
            char *ts = chat_utf8_clean(tb ? tb : "", tb ? n : 0);
            if (ts && !cJSON_GetObjectItemCaseSensitive(d, ts)) cJSON_AddNumberToObject(d, ts, lp_num(j->lp_top[(size_t)t * (size_t)j->lp_k + k]));
            free(ts);
        }
        cJSON_AddItemToArray(top, d);
    }
    return o;
}

/* OpenAI's tool call object; `index` in stream deltas. */
static cJSON *tool_call_obj(const job *j, int k, int with_index) {
    cJSON *o = cJSON_CreateObject();
    char id[80];
    snprintf(id, sizeof id, "call_%lx%ld_%d_%d", j->created, j->id, j->choice, k); /* the arrival time: unique across restarts */
    if (with_index) cJSON_AddNumberToObject(o, "index", k);
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "type", "function");
    cJSON *f = cJSON_AddObjectToObject(o, "function");
    add_clean(f, "name", j->calls[k].name, strlen(j->calls[k].name));
    add_clean(f, "arguments", j->calls[k].args, strlen(j->calls[k].args));
    return o;
}

/* One choice of a JSON reply. */
static cJSON *choice_obj(const serve *sv, const job *j, int return_ids) {
    cJSON *c0 = cJSON_CreateObject();
    cJSON_AddNumberToObject(c0, "index", j->choice);
    if (j->chat) {
        cJSON *m = cJSON_AddObjectToObject(c0, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        if (j->n_calls && !j->content.n) cJSON_AddNullToObject(m, "content");
        else add_clean(m, "content", j->content.p, j->content.n);
        if (j->reasoning.n) add_clean(m, "reasoning_content", j->reasoning.p, j->reasoning.n);
        if (j->n_calls) {
            cJSON *a = cJSON_AddArrayToObject(m, "tool_calls");
            for (int k = 0; k < j->n_calls; k++) cJSON_AddItemToArray(a, tool_call_obj(j, k, 0));
        }
    } else
        add_clean(c0, "text", j->content.p, j->content.n);
    if (return_ids) cJSON_AddItemToObject(c0, "token_ids", ids_arr(j->ids + j->n_prompt, j->n_out));
    if (j->lp_on) {
        size_t off = 0;
        cJSON_AddItemToObject(c0, "logprobs", j->chat ? chat_logprobs(sv, j, 0, j->n_out) : cmpl_logprobs(sv, j, 0, j->n_out, &off));
    } else
        cJSON_AddNullToObject(c0, "logprobs");
    cJSON_AddStringToObject(c0, "finish_reason", j->finish);
    return c0;
}

/* ---------- streams ---------- */

typedef struct chstate { /* what one choice's stream has sent */
    int role_sent, ids_sent, calls_sent, lp_sent, end_sent;
    size_t c_sent, r_sent, lp_off;
} chstate;

typedef struct stream {
    serve *sv;
    job **js;                 /* owned array of the request's choices (their connection refs) */
    int n;
    chstate *cs;              /* [n] */
    int return_ids, include_usage, phase; /* phase 0 streaming, 1 ended */
    sbuf out;
    size_t off;
} stream;

static void sse_json(sbuf *b, cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    sb_add(b, "data: ", 6);
    if (s) sb_add(b, s, strlen(s));
    sb_add(b, "\n\n", 2);
    free(s);
}

/* Under mu: whether a choice has something its stream has not sent. */
static int choice_news(const stream *st, const job *j, const chstate *c) {
    return (j->chat && !c->role_sent) || j->err_status || (j->done && !c->end_sent) || j->content.n > c->c_sent ||
           j->reasoning.n > c->r_sent || j->n_calls > c->calls_sent || ((st->return_ids || j->lp_on) && j->n_out > c->ids_sent);
}

static cJSON *chunk_of(const serve *sv, const job *j, cJSON **choice) {
    cJSON *e = envelope(sv, j, j->chat ? "chat.completion.chunk" : "text_completion"), *ch = cJSON_AddArrayToObject(e, "choices");
    *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(*choice, "index", j->choice);
    cJSON_AddItemToArray(ch, *choice);
    return e;
}

/* Under mu: SSE events for what the choices published since the last call. */
static void stream_events_locked(stream *st) {
    serve *sv = st->sv;
    for (int i = 0; i < st->n; i++) {
        job *j = st->js[i];
        chstate *cs = &st->cs[i];
        if (!cs->role_sent && j->chat) { /* OpenAI's first chunk of a choice: the role */
            cJSON *c, *e = chunk_of(sv, j, &c), *d = cJSON_AddObjectToObject(c, "delta");
            cJSON_AddStringToObject(d, "role", "assistant");
            cJSON_AddStringToObject(d, "content", "");
            cJSON_AddNullToObject(c, "logprobs");
            cJSON_AddNullToObject(c, "finish_reason");
            sse_json(&st->out, e);
            cs->role_sent = 1;
        }
    }
    for (int i = 0; i < st->n; i++)
        if (st->js[i]->err_status) {
            sse_json(&st->out, error_obj(st->js[i]->err_status, NULL, NULL, st->js[i]->errmsg));
            sb_add(&st->out, "data: [DONE]\n\n", 14);
            st->phase = 1;
            return;
        }
    int ended = 0;
    for (int i = 0; i < st->n; i++) {
        job *j = st->js[i];
        chstate *cs = &st->cs[i];
        int newc = j->content.n > cs->c_sent, newr = j->reasoning.n > cs->r_sent, newids = j->n_out > cs->ids_sent,
            newcalls = j->n_calls > cs->calls_sent;
        if (newc || newr || newcalls || (newids && (st->return_ids || j->lp_on))) {
            cJSON *c, *e = chunk_of(sv, j, &c);
            if (j->chat) {
                cJSON *d = cJSON_AddObjectToObject(c, "delta");
                if (newr) add_clean(d, "reasoning_content", j->reasoning.p + cs->r_sent, j->reasoning.n - cs->r_sent);
                if (newc || (!newr && !newcalls)) add_clean(d, "content", j->content.p ? j->content.p + cs->c_sent : "", j->content.n - cs->c_sent);
                if (newcalls) {
                    cJSON *a = cJSON_AddArrayToObject(d, "tool_calls");
                    for (int k = cs->calls_sent; k < j->n_calls; k++) cJSON_AddItemToArray(a, tool_call_obj(j, k, 1));
                }
            } else
                add_clean(c, "text", j->content.p ? j->content.p + cs->c_sent : "", j->content.n - cs->c_sent);
            if (st->return_ids) cJSON_AddItemToObject(c, "token_ids", ids_arr(j->ids + j->n_prompt + cs->ids_sent, j->n_out - cs->ids_sent));
            if (j->lp_on && newids)
                cJSON_AddItemToObject(c, "logprobs", j->chat ? chat_logprobs(sv, j, cs->ids_sent, j->n_out) : cmpl_logprobs(sv, j, cs->ids_sent, j->n_out, &cs->lp_off));
            else
                cJSON_AddNullToObject(c, "logprobs");
            cJSON_AddNullToObject(c, "finish_reason");
            sse_json(&st->out, e);
            cs->c_sent = j->content.n;
            cs->r_sent = j->reasoning.n;
            cs->ids_sent = j->n_out;
            cs->calls_sent = j->n_calls;
        }
        if (j->done && !cs->end_sent) {
            cJSON *c, *e = chunk_of(sv, j, &c);
            if (j->chat) cJSON_AddObjectToObject(c, "delta");
            else cJSON_AddStringToObject(c, "text", "");
            cJSON_AddNullToObject(c, "logprobs");
            cJSON_AddStringToObject(c, "finish_reason", j->finish);
            sse_json(&st->out, e);
            cs->end_sent = 1;
        }
        ended += cs->end_sent;
    }
    if (ended == st->n) {
        if (st->include_usage) {
            cJSON *e = envelope(sv, st->js[0], st->js[0]->chat ? "chat.completion.chunk" : "text_completion");
            cJSON_AddArrayToObject(e, "choices");
            cJSON_AddItemToObject(e, "usage", usage_obj(st->js, st->n));
            sse_json(&st->out, e);
        }
        sb_add(&st->out, "data: [DONE]\n\n", 14);
        st->phase = 1;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream *st = cls;
    serve *sv = st->sv;
    if (st->off == st->out.n) {
        st->out.n = st->off = 0;
        if (st->phase == 1) return MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&sv->mu);
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        long ns = dl.tv_nsec + (long)(sv->o.keepalive_ms % 1000) * 1000000L;
        dl.tv_sec += sv->o.keepalive_ms / 1000 + ns / 1000000000L;
        dl.tv_nsec = ns % 1000000000L;
        int timed_out = 0;
        for (;;) {
            int news = 0;
            for (int i = 0; i < st->n && !news; i++) news = choice_news(st, st->js[i], &st->cs[i]);
            if (news || timed_out) break;
            timed_out = pthread_cond_timedwait(&st->js[0]->g->cv, &sv->mu, &dl) != 0;
        }
        stream_events_locked(st);
        pthread_mutex_unlock(&sv->mu);
        if (st->out.n == 0) sb_add(&st->out, ": keep-alive\n\n", 14);
        if (st->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t k = st->out.n - st->off;
    if (k > max) k = max;
    memcpy(buf, st->out.p + st->off, k);
    st->off += k;
    return (ssize_t)k;
}

/* Under mu: the connection lets go of a request's choices; unfinished ones are cancelled (the
 * scheduler drops them at its next step). */
static void release_choices_locked(serve *sv, job **js, int n) {
    int cancel = 0;
    for (int i = 0; i < n; i++)
        if (!js[i]->done) js[i]->cancelled = 1, cancel = 1;
    if (cancel) pthread_cond_signal(&sv->sched_cv);
    for (int i = 0; i < n; i++) job_release_locked(sv, js[i]);
}

static void stream_free(void *cls) {
    stream *st = cls;
    serve *sv = st->sv;
    pthread_mutex_lock(&sv->mu);
    release_choices_locked(sv, st->js, st->n);
    pthread_mutex_unlock(&sv->mu);
    free(st->js);
    free(st->cs);
    free(st->out.p);
    free(st);
}

/* Renders the chat template over the request's messages (and its tools unless tool_choice is
 * none). */
static int render_chat(const serve *sv, const serve_request *rq, int with_tools, char **text, size_t *tl, petrel_error *e) {
    cJSON *vars = cJSON_CreateObject();
    int ok = vars && cJSON_AddItemReferenceToObject(vars, "messages", rq->messages) && cJSON_AddBoolToObject(vars, "add_generation_prompt", 1) &&
             (rq->enable_thinking < 0 || cJSON_AddBoolToObject(vars, "enable_thinking", rq->enable_thinking != 0)) &&
             (!with_tools || cJSON_AddItemReferenceToObject(vars, "tools", rq->tools));
    if (!ok) {
        cJSON_Delete(vars);
        return pt_err(e, PETREL_ENOMEM, "out of memory rendering the chat template");
    }
    int rc = jinja_render_compiled(sv->tmpl, vars, NULL, text, tl, e);
    cJSON_Delete(vars); /* the references only */
    if (rc < 0) pt_err_ctx(e, "chat template");
    return rc;
}

/* A job for choice `choice` of a request (refs 2: connection + scheduler). NULL when out of
 * memory or the sampler refuses its params (e says which). */
static job *job_create(serve *sv, const serve_request *rq, const int32_t *ids, int n, int max_new, int in_think, jgroup *g, int choice,
                       const int32_t *force, int n_force, petrel_error *e) {
    job *j = calloc(1, sizeof *j);
    if (!j) { pt_err(e, PETREL_ENOMEM, "out of memory"); return NULL; }
    j->g = g;
    g->refs++;
    j->refs = 1;
    j->chat = rq->chat;
    j->choice = choice;
    j->lora = rq->lora;
    tok_stream_init(&j->ts, sv->tok);
    j->ids = malloc(sizeof(int32_t) * ((size_t)n + (size_t)max_new + 1));
    int bad = !j->ids;
    if (!bad) memcpy(j->ids, ids, sizeof(int32_t) * (size_t)n);
    j->n_prompt = j->n_ids = n;
    j->max_new = max_new;
    j->cap = n + max_new - 1 > n ? n + max_new - 1 : n;
    j->ignore_eos = rq->ignore_eos;
    j->penalties = rq->sp.penalty_last_n > 0;
    for (int k = 0; !bad && k < rq->n_stop; k++)
        if ((j->stop[k] = strdup(rq->stop[k]))) j->n_stop++;
        else bad = 1;
    if (rq->chat) chat_split_init(&j->cs, sv->tok, in_think);
    j->tools_on = g->tools != NULL;
    tc_init(&j->tp, g->tools);
    if (!bad && n_force) {
        j->force = malloc(sizeof(int32_t) * (size_t)n_force);
        if (j->force) memcpy(j->force, force, sizeof(int32_t) * (size_t)n_force), j->n_force = n_force;
        else bad = 1;
    }
    if (!bad && rq->logprobs && max_new > 0) {
        j->lp_on = 1;
        j->lp_k = rq->top_logprobs;
        j->lp = malloc(sizeof(float) * (size_t)max_new);
        if (j->lp_k) {
            j->lp_top = malloc(sizeof(float) * (size_t)max_new * (size_t)j->lp_k);
            j->lp_top_id = malloc(sizeof(int32_t) * (size_t)max_new * (size_t)j->lp_k);
        }
        bad = !j->lp || (j->lp_k && (!j->lp_top || !j->lp_top_id));
    }
    if (bad) pt_err(e, PETREL_ENOMEM, "out of memory");
    sampler_params sp = rq->sp;
    if (rq->seed_set) sp.seed = rq->sp.seed + (uint64_t)choice; /* choice i: the seed + i */
    else sp.seed = (uint64_t)(now_s() * 1e9) ^ ((uint64_t)(uintptr_t)j << 17);
    if (!bad && sampler_init(&j->smp, &sp, sv->V, e)) bad = 2;
    else if (!bad) j->have_smp = 1;
    if (bad) {
        pthread_mutex_lock(&sv->mu);
        job_release_locked(sv, j);
        pthread_mutex_unlock(&sv->mu);
        return NULL;
    }
    j->refs = 2;
    return j;
}

static int all_done(job *const *js, int n) {
    for (int i = 0; i < n; i++)
        if (!js[i]->done) return 0;
    return 1;
}

static int handle_completion(serve *sv, struct MHD_Connection *c, conn *cs, int chat) {
    serve_request rq;
    char param[64] = "";
    petrel_error e = {0};
    if (serve_request_parse(cs->body.p, cs->body.n, chat, &rq, param, &e))
        return send_error(c, e.code == PETREL_ENOMEM ? 500 : 400, NULL, param, "%s", e.msg);
    int ret;
    rq.lora = -1; /* "model": the base model's name, or one of the LoRA adapters' (--lora NAME=DIR) */
    for (int i = 0; rq.model && strcmp(rq.model, sv->model_name) && i < petrel_engine_lora_count(sv->eng); i++)
        if (!strcmp(rq.model, petrel_engine_lora_name(sv->eng, i))) rq.lora = i;
    if (rq.model && strcmp(rq.model, sv->model_name) && rq.lora < 0) {
        ret = send_error(c, 404, "model_not_found", "model", "The model '%.200s' does not exist; this server serves '%.200s'%s (GET /v1/models)", rq.model,
                         sv->model_name, petrel_engine_lora_count(sv->eng) ? " and its LoRA adapters" : "");
        serve_request_free(&rq);
        return ret;
    }
    if (rq.n > sv->o.parallel) {
        ret = send_error(c, 400, NULL, "n", "'n' is %d but this server runs at most %d sequences at once (--parallel)", rq.n, sv->o.parallel);
        serve_request_free(&rq);
        return ret;
    }
    int32_t *ids = NULL, *force = NULL;
    int n = 0, in_think = 0, rc = 0, n_force = 0;
    if (chat && !sv->tmpl) {
        serve_request_free(&rq);
        return send_error(c, 400, NULL, "messages", "this model has no chat template: use /v1/completions");
    }
    int with_tools = chat && rq.tools && rq.tool_choice != SERVE_TOOLS_NONE;
    pthread_mutex_lock(&sv->tok_mu);
    if (chat) {
        char *text = NULL;
        size_t tl = 0;
        rc = render_chat(sv, &rq, with_tools, &text, &tl, &e);
        if (!rc) {
            in_think = chat_ends_in_think(text, tl);
            size_t m = 0;
            rc = tok_encode(sv->tok, text, tl, &ids, &m, &e);
            n = (int)m;
        }
        free(text);
        if (!rc && (sv->o.force_answer || (with_tools && (rq.tool_choice == SERVE_TOOLS_REQUIRED || rq.tool_choice == SERVE_TOOLS_NAMED)))) {
            /* the answer is made to begin "<tool_call>" (and the name, when one is named) */
            char fs[300];
            snprintf(fs, sizeof fs, "<tool_call>%.280s", rq.tool_choice == SERVE_TOOLS_NAMED ? rq.tool_name : "");
            const char *f = sv->o.force_answer ? sv->o.force_answer : fs;
            size_t m = 0;
            rc = tok_encode(sv->tok, f, strlen(f), &force, &m, &e);
            n_force = (int)m;
        }
    } else if (rq.prompt) {
        size_t m = 0;
        rc = tok_encode(sv->tok, rq.prompt, rq.prompt_len, &ids, &m, &e);
        n = (int)m;
    } else {
        ids = rq.prompt_ids, n = rq.n_prompt_ids;
        rq.prompt_ids = NULL;
    }
    pthread_mutex_unlock(&sv->tok_mu);
    if (rc) {
        free(ids);
        free(force);
        serve_request_free(&rq);
        return send_error(c, rc == PETREL_ENOMEM ? 500 : 400, NULL, chat ? "messages" : "prompt", "%s", e.msg);
    }
    const char *perr = NULL, *pparam = chat ? "messages" : "prompt", *pcode = NULL;
    char pmsg[300];
    if (n == 0) perr = "the prompt holds no tokens";
    for (int k = 0; !perr && k < n; k++)
        if (ids[k] >= sv->V) snprintf(pmsg, sizeof pmsg, "token id %d is outside the vocabulary (%d ids)", ids[k], sv->V), perr = pmsg;
    long max_new = rq.max_tokens >= 0 ? rq.max_tokens : chat ? sv->ctx - n + 1 : 16;
    if (!perr && n > sv->ctx) {
        snprintf(pmsg, sizeof pmsg, "This model's maximum context length is %d tokens. However, your prompt has %d tokens.", sv->ctx, n);
        perr = pmsg, pcode = "context_length_exceeded";
    }
    if (!perr && rq.max_tokens >= 0 && n + max_new - 1 > sv->ctx) {
        snprintf(pmsg, sizeof pmsg, "This model's maximum context length is %d tokens. However, you requested %ld tokens (%d in the prompt, %ld in the completion).",
                 sv->ctx, n + max_new, n, max_new);
        perr = pmsg, pcode = "context_length_exceeded", pparam = "max_tokens";
    }
    if (rq.max_tokens < 0 && n + max_new - 1 > sv->ctx) max_new = sv->ctx - n + 1;
    if (perr) {
        free(ids);
        free(force);
        serve_request_free(&rq);
        return send_error(c, 400, pcode, pparam, "%s", perr);
    }
    int nc = rq.n;
    jgroup *g = calloc(1, sizeof *g);
    job **js = calloc((size_t)nc, sizeof *js);
    if (!g || !js) {
        free(g), free(js), free(ids), free(force);
        serve_request_free(&rq);
        return send_error(c, 500, NULL, NULL, "out of memory");
    }
    pthread_cond_init(&g->cv, NULL);
    if (with_tools) g->tools = rq.tools, rq.tools = NULL;
    g->refs = 1; /* ours until the jobs hold it */
    int made = 0, bad_status = 0;
    for (; made < nc; made++)
        if (!(js[made] = job_create(sv, &rq, ids, n, (int)max_new, in_think, g, made, force, n_force, &e))) {
            bad_status = e.code == PETREL_ENOMEM ? 500 : 400;
            break;
        }
    free(ids);
    free(force);
    int stream_mode = rq.stream, return_ids = rq.return_token_ids, include_usage = rq.include_usage;
    serve_request_free(&rq);
    pthread_mutex_lock(&sv->mu);
    if (--g->refs == 0) { /* no job was made */
        pthread_cond_destroy(&g->cv);
        cJSON_Delete(g->tools);
        free(g);
    }
    if (!bad_status && sv->stopping) bad_status = 503, snprintf(e.msg, sizeof e.msg, "the server is shutting down");
    if (bad_status) {
        for (int k = 0; k < made; k++) js[k]->refs = 1, job_release_locked(sv, js[k]);
        pthread_mutex_unlock(&sv->mu);
        free(js);
        return send_error(c, bad_status, NULL, NULL, "%s", e.msg);
    }
    long id = ++sv->next_id;
    double tq = now_s();
    long created = (long)time(NULL);
    for (int k = 0; k < nc; k++) js[k]->id = id, js[k]->t_queued = tq, js[k]->created = created;
    sv->m.prompt_tokens += n;
    job *lead = js[0];
    if (max_new == 0) { /* nothing to generate: no session needed */
        for (int k = 0; k < nc; k++) js[k]->refs = 1, job_finish_locked(sv, js[k], "length", 0, NULL);
    } else {
        if (nc > 1) { /* the leader holds the other choices until they fork */
            lead->fol = malloc(sizeof(job *) * (size_t)(nc - 1));
            if (!lead->fol) {
                for (int k = 0; k < nc; k++) js[k]->refs = 1, job_release_locked(sv, js[k]);
                pthread_mutex_unlock(&sv->mu);
                free(js);
                return send_error(c, 500, NULL, NULL, "out of memory");
            }
            for (int k = 1; k < nc; k++) lead->fol[k - 1] = js[k], js[k]->state = J_QUEUED;
            lead->n_fol = nc - 1;
        }
        lead->state = J_QUEUED;
        if (sv->q_tail) sv->q_tail->next = lead;
        else sv->q_head = lead;
        sv->q_tail = lead;
        sv->n_queued++;
        pthread_cond_signal(&sv->sched_cv);
    }
    if (stream_mode) {
        pthread_mutex_unlock(&sv->mu);
        stream *st = calloc(1, sizeof *st);
        chstate *chs = calloc((size_t)nc, sizeof *chs);
        struct MHD_Response *r = st && chs ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, st, stream_free) : NULL;
        if (!r) {
            pthread_mutex_lock(&sv->mu);
            release_choices_locked(sv, js, nc);
            pthread_mutex_unlock(&sv->mu);
            free(js);
            free(chs);
            free(st);
            return MHD_NO;
        }
        st->sv = sv;
        st->js = js;
        st->n = nc;
        st->cs = chs;
        st->return_ids = return_ids;
        st->include_usage = include_usage;
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    /* wait, checking every 50 ms that the client is still there (a closed socket reads 0
     * bytes): one that went away cancels its request */
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    int fd = ci ? ci->connect_fd : -1;
    double next_check = now_s() + 0.05;
    while (!all_done(js, nc)) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_nsec += 50000000L;
        if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&lead->g->cv, &sv->mu, &dl); /* woken by every token, too */
        if (all_done(js, nc) || fd < 0 || now_s() < next_check) continue;
        next_check = now_s() + 0.05;
        char b;
        if (recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0) { /* gone: the scheduler drops it at its next step */
            release_choices_locked(sv, js, nc);
            pthread_mutex_unlock(&sv->mu);
            free(js);
            return MHD_NO;
        }
    }
    cJSON *out = NULL;
    int status = 200;
    for (int k = 0; k < nc && !out; k++)
        if (js[k]->err_status) {
            status = js[k]->err_status == 499 ? 500 : js[k]->err_status;
            out = error_obj(status, NULL, NULL, js[k]->errmsg);
        }
    if (!out) {
        out = envelope(sv, lead, chat ? "chat.completion" : "text_completion");
        cJSON *ch = cJSON_AddArrayToObject(out, "choices");
        for (int k = 0; k < nc; k++) cJSON_AddItemToArray(ch, choice_obj(sv, js[k], return_ids));
        if (return_ids) cJSON_AddItemToObject(out, "prompt_token_ids", ids_arr(lead->ids, lead->n_prompt));
        cJSON_AddItemToObject(out, "usage", usage_obj(js, nc));
    }
    release_choices_locked(sv, js, nc);
    pthread_mutex_unlock(&sv->mu);
    free(js);
    return send_json(c, status, out);
}

static int handle_tokenize(serve *sv, struct MHD_Connection *c, conn *cs, int detok) {
    cJSON *j = cs->body.n ? cJSON_ParseWithLength(cs->body.p, cs->body.n) : NULL;
    if (!cJSON_IsObject(j)) { cJSON_Delete(j); return send_error(c, 400, NULL, NULL, "the request body is not a JSON object"); }
    petrel_error e = {0};
    cJSON *out = cJSON_CreateObject();
    int status = 200;
    if (detok) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "tokens");
        int32_t *ids = NULL;
        int n = 0;
        if (!cJSON_IsArray(t) || serve_parse_ids_array(t, &ids, &n, "tokens", &e)) {
            cJSON_Delete(out);
            out = error_obj(400, NULL, "tokens", cJSON_IsArray(t) ? e.msg : "'tokens' must be an array of token ids");
            status = 400;
        } else {
            char *s = NULL;
            size_t l = 0;
            pthread_mutex_lock(&sv->tok_mu);
            int rc = tok_decode(sv->tok, ids, (size_t)n, &s, &l, &e);
            pthread_mutex_unlock(&sv->tok_mu);
            if (rc) { cJSON_Delete(out); out = error_obj(400, NULL, "tokens", e.msg); status = 400; }
            else add_clean(out, "prompt", s, l);
            free(s);
        }
        free(ids);
    } else {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "prompt");
        if (!cJSON_IsString(p)) { cJSON_Delete(out); out = error_obj(400, NULL, "prompt", "'prompt' must be a string"); status = 400; }
        else {
            int32_t *ids = NULL;
            size_t n = 0;
            pthread_mutex_lock(&sv->tok_mu);
            int rc = tok_encode(sv->tok, p->valuestring, strlen(p->valuestring), &ids, &n, &e);
            pthread_mutex_unlock(&sv->tok_mu);
            if (rc) { cJSON_Delete(out); out = error_obj(400, NULL, "prompt", e.msg); status = 400; }
            else {
                cJSON_AddItemToObject(out, "tokens", ids_arr(ids, (int)n));
                cJSON_AddNumberToObject(out, "count", (double)n);
                cJSON_AddNumberToObject(out, "max_model_len", sv->ctx);
            }
            free(ids);
        }
    }
    cJSON_Delete(j);
    return send_json(c, status, out);
}

static int handle_metrics(serve *sv, struct MHD_Connection *c) {
    sbuf b = {0};
    pthread_mutex_lock(&sv->mu);
    metrics m = sv->m;
    int run = sv->n_run, q = sv->n_queued;
    pthread_mutex_unlock(&sv->mu);
    sb_printf(&b, "# HELP petrel_requests_total Completed requests by result.\n# TYPE petrel_requests_total counter\n");
    sb_printf(&b, "petrel_requests_total{result=\"ok\"} %ld\npetrel_requests_total{result=\"error\"} %ld\n", m.requests_ok, m.requests_err);
    sb_printf(&b, "# TYPE petrel_prompt_tokens_total counter\npetrel_prompt_tokens_total %ld\n", m.prompt_tokens);
    sb_printf(&b, "# TYPE petrel_prompt_tokens_cached_total counter\npetrel_prompt_tokens_cached_total %ld\n", m.cached_tokens);
    sb_printf(&b, "# TYPE petrel_generation_tokens_total counter\npetrel_generation_tokens_total %ld\n", m.gen_tokens);
    sb_printf(&b, "# TYPE petrel_running_sequences gauge\npetrel_running_sequences %d\n", run);
    sb_printf(&b, "# TYPE petrel_queued_sequences gauge\npetrel_queued_sequences %d\n", q);
    sb_printf(&b, "# TYPE petrel_forwards_total counter\npetrel_forwards_total %ld\n", m.forwards);
    sb_printf(&b, "# TYPE petrel_batch_rows_total counter\npetrel_batch_rows_total %ld\n", m.rows);
    sb_printf(&b, "# TYPE petrel_time_to_first_token_seconds histogram\n");
    for (int k = 0; k < 8; k++) sb_printf(&b, "petrel_time_to_first_token_seconds_bucket{le=\"%g\"} %ld\n", ttft_bounds[k], m.ttft_le[k]);
    sb_printf(&b, "petrel_time_to_first_token_seconds_bucket{le=\"+Inf\"} %ld\n", m.ttft_n);
    sb_printf(&b, "petrel_time_to_first_token_seconds_sum %.6f\npetrel_time_to_first_token_seconds_count %ld\n", m.ttft_sum, m.ttft_n);
    sb_printf(&b, "# TYPE petrel_inter_token_latency_seconds histogram\n");
    for (int k = 0; k < 8; k++) sb_printf(&b, "petrel_inter_token_latency_seconds_bucket{le=\"%g\"} %ld\n", itl_bounds[k], m.itl_le[k]);
    sb_printf(&b, "petrel_inter_token_latency_seconds_bucket{le=\"+Inf\"} %ld\n", m.itl_n);
    sb_printf(&b, "petrel_inter_token_latency_seconds_sum %.6f\npetrel_inter_token_latency_seconds_count %ld\n", m.itl_sum, m.itl_n);
    sb_printf(&b, "# HELP petrel_batch_rows Rows (decode tokens and prompt tokens) per batch forward.\n# TYPE petrel_batch_rows histogram\n");
    for (int k = 0; k < 10; k++) sb_printf(&b, "petrel_batch_rows_bucket{le=\"%d\"} %ld\n", batch_bounds[k], m.batch_le[k]);
    sb_printf(&b, "petrel_batch_rows_bucket{le=\"+Inf\"} %ld\npetrel_batch_rows_sum %ld\npetrel_batch_rows_count %ld\n", m.forwards, m.rows, m.forwards);
    /* the KV pool and the expert store (zero when every expert is resident) */
    long long kv_free = 0, kv_total = 0;
    int kv_page = 1;
    petrel_kv_usage(sv->eng, &kv_free, &kv_total, &kv_page);
    sb_printf(&b, "# HELP petrel_kv_pages_in_use KV pages held by sessions (pages only the prefix cache holds count as free).\n");
    sb_printf(&b, "# TYPE petrel_kv_pages_in_use gauge\npetrel_kv_pages_in_use %lld\n", (kv_total - kv_free) / kv_page);
    sb_printf(&b, "# TYPE petrel_kv_pages_total gauge\npetrel_kv_pages_total %lld\n", kv_total / kv_page);
    petrel_expert_stats xs;
    petrel_engine_expert_stats(sv->eng, &xs);
    sb_printf(&b, "# HELP petrel_expert_accesses_total Routed experts requested from the expert store (hits + misses).\n");
    sb_printf(&b, "# TYPE petrel_expert_accesses_total counter\npetrel_expert_accesses_total %llu\n", (unsigned long long)xs.accesses);
    sb_printf(&b, "# TYPE petrel_expert_hits_total counter\npetrel_expert_hits_total %llu\n", (unsigned long long)xs.hits);
    sb_printf(&b, "# TYPE petrel_expert_hit_rate gauge\npetrel_expert_hit_rate %.6f\n", xs.accesses ? (double)xs.hits / (double)xs.accesses : 1.0);
    sb_printf(&b, "# TYPE petrel_disk_read_bytes_total counter\npetrel_disk_read_bytes_total %llu\n", (unsigned long long)xs.bytes_read);
    sb_printf(&b, "# TYPE petrel_disk_read_failures_total counter\npetrel_disk_read_failures_total %llu\n", (unsigned long long)xs.read_failures);
    if (b.oom || !b.p) { free(b.p); return MHD_NO; }
    return queue_response(c, 200, "text/plain; version=0.0.4", b.p, b.n);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method, const char *version,
                                  const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    serve *sv = cls;
    conn *cs = *con_cls;
    if (!cs) {
        cs = calloc(1, sizeof *cs);
        if (!cs) return MHD_NO;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        cs->over = ci && ci->socket_context;
        *con_cls = cs;
        return MHD_YES;
    }
    if (*upload_size) {
        if (cs->body.n + *upload_size > sv->o.max_body) cs->too_big = 1;
        else sb_add(&cs->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    if (cs->over)
        return send_error(c, 503, "too_many_connections", NULL, "too many connections: this server takes %d at once (--max-connections); retry later",
                          sv->o.max_connections);
    int get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) return get ? send_json(c, 200, cJSON_Parse("{\"status\":\"ok\"}")) : send_error(c, 405, NULL, NULL, "use GET");
    if (!key_ok(sv, c)) return send_error(c, 401, "invalid_api_key", NULL, "Incorrect or missing API key: send the header \"Authorization: Bearer KEY\"");
    if (cs->too_big) return send_error(c, 413, "request_too_large", NULL, "the request body is larger than the limit of %zu bytes", sv->o.max_body);
    if (cs->body.oom) return send_error(c, 500, NULL, NULL, "out of memory");
    int chat = !strcmp(url, "/v1/chat/completions");
    if (chat || !strcmp(url, "/v1/completions")) return post ? handle_completion(sv, c, cs, chat) : send_error(c, 405, NULL, NULL, "use POST");
    if (!strcmp(url, "/tokenize") || !strcmp(url, "/detokenize"))
        return post ? handle_tokenize(sv, c, cs, url[1] == 'd') : send_error(c, 405, NULL, NULL, "use POST");
    if (!strcmp(url, "/metrics")) return get ? handle_metrics(sv, c) : send_error(c, 405, NULL, NULL, "use GET");
    int one = -2; /* /v1/models/NAME: -1 the base, i adapter i */
    if (!strncmp(url, "/v1/models/", 11)) {
        if (!strcmp(url + 11, sv->model_name)) one = -1;
        for (int i = 0; one == -2 && i < petrel_engine_lora_count(sv->eng); i++)
            if (!strcmp(url + 11, petrel_engine_lora_name(sv->eng, i))) one = i;
    }
    if (!strcmp(url, "/v1/models") || one > -2) { /* the base model, then each LoRA adapter as a model of its own */
        if (!get) return send_error(c, 405, NULL, NULL, "use GET");
        cJSON *l = cJSON_CreateObject(), *data = NULL;
        cJSON_AddStringToObject(l, "object", "list");
        data = cJSON_AddArrayToObject(l, "data");
        cJSON *pick = NULL;
        for (int i = -1; i < petrel_engine_lora_count(sv->eng); i++) {
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "id", i < 0 ? sv->model_name : petrel_engine_lora_name(sv->eng, i));
            cJSON_AddStringToObject(m, "object", "model");
            cJSON_AddNumberToObject(m, "created", 0);
            cJSON_AddStringToObject(m, "owned_by", "petrel");
            if (i >= 0) cJSON_AddStringToObject(m, "parent", sv->model_name); /* vLLM's field for a LoRA model */
            cJSON_AddNumberToObject(m, "max_model_len", sv->ctx);
            cJSON_AddItemToArray(data, m);
            if (i == one) pick = m;
        }
        if (one > -2) {
            cJSON *m = cJSON_Duplicate(pick, 1);
            cJSON_Delete(l);
            return send_json(c, 200, m);
        }
        return send_json(c, 200, l);
    }
    return send_error(c, 404, "not_found", NULL, "no endpoint %.200s %.200s", method, url);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls, (void)c, (void)toe;
    conn *cs = *con_cls;
    if (!cs) return;
    free(cs->body.p);
    free(cs);
    *con_cls = NULL;
}

/* ---------- lifetime ---------- */

int serve_start(petrel_engine *eng, const tokenizer *tok, const jinja_template *tmpl, const serve_opts *o, serve **out, petrel_error *err) {
    *out = NULL;
    serve *sv = calloc(1, sizeof *sv);
    if (!sv) return pt_err(err, PETREL_ENOMEM, "out of memory");
    sv->eng = eng;
    sv->tok = tok;
    sv->tmpl = tmpl;
    sv->o = *o;
    sv->V = petrel_engine_vocab_size(eng);
    if (sv->o.parallel <= 0) sv->o.parallel = 8;
    if (sv->o.max_rows <= 0) sv->o.max_rows = 512;
    if (sv->o.max_body == 0) sv->o.max_body = 4u << 20;
    if (sv->o.keepalive_ms <= 0) sv->o.keepalive_ms = 5000;
    if (sv->o.max_connections <= 0) sv->o.max_connections = 512;
    if (sv->o.max_rows < sv->o.parallel) sv->o.max_rows = sv->o.parallel;
    int maxpos = petrel_engine_max_positions(eng);
    sv->ctx = sv->o.ctx > 0 ? sv->o.ctx : 4096;
    if (sv->ctx > maxpos) sv->ctx = maxpos;
    sv->model_name = strdup(o->model_name && *o->model_name ? o->model_name : "petrel");
    sv->api_key = o->api_key && *o->api_key ? strdup(o->api_key) : NULL;
    pthread_mutex_init(&sv->mu, NULL);
    pthread_mutex_init(&sv->tok_mu, NULL);
    pthread_cond_init(&sv->sched_cv, NULL);
    int rc = 0;
    sv->run = calloc((size_t)sv->o.parallel, sizeof *sv->run);
    sv->rows = malloc(sizeof(petrel_row) * (size_t)sv->o.max_rows);
    sv->row_job = malloc(sizeof(job *) * (size_t)sv->o.max_rows);
    sv->lg = malloc(sizeof(float) * (size_t)sv->o.parallel * (size_t)sv->V);
    sv->masked = malloc(sizeof(int32_t) * (size_t)sv->V);
    sv->lp_row = malloc(sizeof(float) * (size_t)sv->V);
    sv->fork_row = malloc(sizeof(float) * (size_t)sv->V);
    if (!sv->model_name || (o->api_key && *o->api_key && !sv->api_key) || !sv->run || !sv->rows || !sv->row_job || !sv->lg || !sv->masked || !sv->lp_row || !sv->fork_row)
        rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int id = 0; !rc && id < sv->V; id++)
        if (!tok_id_to_bytes(tok, id, &(size_t){0})) sv->masked[sv->n_masked++] = id;
    static const char *const stop_names[] = {"<|user|>", "<|observation|>", "<|endoftext|>"};
    for (int k = 0; k < 3; k++) {
        int32_t id = tok_token_to_id(tok, stop_names[k]);
        if (id >= 0) sv->chat_stop[sv->n_chat_stop++] = id;
    }
    if (!rc) rc = petrel_batch_create(eng, sv->o.max_rows, &sv->b, err);
    if (!rc && o->draft) {
        spec_params sp = {.draft = o->draft};
        rc = spec_check(eng, &sp, err);
        if (!rc && spec_effective_draft(eng, o->draft)) {
            rc = spec_create(eng, &sp, sv->o.parallel, &sv->spec, err);
            sv->sseq = calloc((size_t)sv->o.parallel, sizeof *sv->sseq);
            sv->sjob = calloc((size_t)sv->o.parallel, sizeof *sv->sjob);
            sv->spec_lg = malloc(sizeof(float) * (size_t)sv->V);
            if (!rc && (!sv->sseq || !sv->sjob || !sv->spec_lg)) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
        }
    }
    if (!rc && o->session_dir) rc = persist_open(eng, o->session_dir, o->session_dir_max, sv->ctx, &sv->ps, &sv->ps_loaded, &sv->ps_skipped, err);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    const char *host = o->host && *o->host ? o->host : "127.0.0.1";
    if (!strcmp(host, "localhost")) host = "127.0.0.1";
    if (!rc && inet_pton(AF_INET, host, &sa.sin_addr) != 1) rc = pt_err(err, PETREL_EINVAL, "--host: \"%s\" is not an IPv4 address", host);
    if (!rc && (o->port < 0 || o->port > 65535)) rc = pt_err(err, PETREL_EINVAL, "--port: %d is not a port (0 .. 65535)", o->port);
    if (!rc) {
        if (pthread_create(&sv->sched, NULL, sched_main, sv)) rc = pt_err(err, PETREL_ENOMEM, "cannot start the scheduler thread");
        else sv->sched_started = 1;
    }
    if (!rc) {
        sv->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL, 0, NULL, NULL,
                                 (MHD_AccessHandlerCallback)on_request, sv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, sv, MHD_OPTION_NOTIFY_CONNECTION, on_connection, sv,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)(sv->o.max_connections + SERVE_CONN_SPARE),
                                 MHD_OPTION_END);
        if (!sv->d) rc = pt_err(err, PETREL_EIO, "cannot listen on %s:%d (in use, or not an address of this machine?)", host, o->port);
    }
    if (!rc) {
        const union MHD_DaemonInfo *di = MHD_get_daemon_info(sv->d, MHD_DAEMON_INFO_BIND_PORT);
        sv->port = di ? di->port : o->port;
    }
    if (rc) {
        serve_stop(sv);
        serve_free(sv);
        return rc;
    }
    *out = sv;
    return 0;
}

int serve_port(const serve *s) { return s->port; }

void serve_session_files(const serve *s, int *loaded, int *skipped, long *written) {
    if (loaded) *loaded = s->ps_loaded;
    if (skipped) *skipped = s->ps_skipped;
    if (written) *written = s->ps ? persist_written(s->ps) : s->ps_written;
}

void serve_stop(serve *sv) {
    if (!sv) return;
    if (sv->d) MHD_quiesce_daemon(sv->d); /* no new connections */
    pthread_mutex_lock(&sv->mu);
    sv->stopping = 1;
    pthread_cond_signal(&sv->sched_cv);
    pthread_mutex_unlock(&sv->mu);
    if (sv->sched_started) pthread_join(sv->sched, NULL);
    sv->sched_started = 0;
    if (sv->d) MHD_stop_daemon(sv->d); /* joins the connection threads: their jobs have ended */
    sv->d = NULL;
    if (sv->ps) sv->ps_written = persist_close(sv->ps); /* what is queued is written first */
    sv->ps = NULL;
}

void serve_free(serve *sv) {
    if (!sv) return;
    spec_free(sv->spec);
    free(sv->sseq);
    free(sv->sjob);
    free(sv->spec_lg);
    petrel_batch_free(sv->b);
    free(sv->run);
    free(sv->rows);
    free(sv->row_job);
    free(sv->lg);
    free(sv->masked);
    free(sv->lp_row);
    free(sv->fork_row);
    free(sv->model_name);
    free(sv->api_key);
    pthread_mutex_destroy(&sv->mu);
    pthread_mutex_destroy(&sv->tok_mu);
    pthread_cond_destroy(&sv->sched_cv);
    free(sv);
}
