/* generate.h: the text-generation loop shared by `petrel run`, `petrel chat` and the tests:
 * prompt ids in (reusing the cached prefix of the session), sampled tokens out, each handed to a
 * callback as ready-to-print UTF-8 (the streaming detokenizer never splits a character).
 *
 * A gen_ctx owns one session, a mirror of the token ids in its cache, a logits row and a
 * sampler. gen_prompt feeds a prompt: the longest common prefix with the ids already cached is
 * kept, the rest is truncated away (petrel_session_truncate) and the new suffix is run.
 * gen_generate then samples until an eos id (config eos + generation_config eos), an extra stop
 * id, max_tokens, the callback asking to stop, or the session being full.
 *
 * Ids the tokenizer cannot decode (padding rows of the embedding beyond the tokenizer's
 * vocabulary) are never sampled: their logits are set to -inf before sampling. */
#ifndef PETREL_RUNTIME_GENERATE_H
#define PETREL_RUNTIME_GENERATE_H
#include <stddef.h>
#include <stdint.h>

#include "petrel.h"
#include "runtime/sampler.h"
#include "runtime/spec.h"
#include "text/tokenizer.h"

typedef enum {
    GEN_STOP_NONE = 0,
    GEN_STOP_EOS,      /* sampled an eos / stop id (not emitted, not cached) */
    GEN_STOP_LENGTH,   /* max_tokens reached */
    GEN_STOP_CONTEXT,  /* the session is full */
    GEN_STOP_CALLBACK, /* the callback returned non-zero */
} gen_stop;
const char *gen_stop_name(gen_stop s);

typedef struct gen_opts {
    int max_tokens;           /* < 0: no limit (until a stop id or the context is full) */
    const int32_t *stop_ids;  /* extra stop ids besides the model's eos ids (may be NULL) */
    int n_stop;
    petrel_progress_fn progress; /* generate_text: the prompt's progress (may be NULL) */
    void *progress_user;
    const char *session;      /* generate_text: load the session from this file first when it
                                 exists (the prompt then reuses its cached prefix), save it at
                                 the end; NULL: none */
    const spec_params *spec;  /* generate_text: speculative decoding (NULL or draft 0: off;
                                 SPEC_AUTO on a model without an MTP layer: off) */
} gen_opts;

typedef struct gen_stats {
    int n_prompt;       /* ids of the last prompt */
    int n_reused;       /* of those, already in the cache */
    int n_gen;          /* tokens emitted */
    gen_stop stop;
    int32_t stop_id;    /* the eos id sampled, when stop == GEN_STOP_EOS, else -1 */
    double prompt_s, gen_s; /* wall time of prompt processing and of generation */
    int n_forwards;     /* main-model forwards after the prompt (decode or verify steps) */
    char json[2048];    /* gen_generate: the --stats line (tokens, forwards, tokens_per_forward,
                           acceptance_by_position, ...), no newline */
} gen_stats;

/* Called per emitted token with its text (possibly empty while a character is incomplete), and
 * once with id -1 for bytes still held at the end. Return non-zero to stop generating. */
typedef int (*gen_piece_fn)(void *user, int32_t id, const char *bytes, size_t len);

typedef struct gen_ctx {
    petrel_engine *eng;       /* borrowed */
    const tokenizer *tok;     /* borrowed */
    petrel_session *s;        /* owned */
    int ctx;                  /* session capacity */
    int vocab;                /* logits row length */
    float *logits;            /* [vocab] logits of the last cached position, when have_logits */
    int have_logits;
    int32_t *ids;             /* [ctx] ids in the cache */
    int n_ids;
    int32_t *masked;          /* ids never sampled (no bytes in the tokenizer) */
    int n_masked;
    sampler smp;
    spec_ctx *spec;           /* owned, NULL unless gen_enable_spec turned drafting on */
    spec_seq seq;             /* the session's speculative timeline, when spec */
} gen_ctx;

/* Creates the session (ctx positions) and the sampler. */
int gen_init(gen_ctx *g, petrel_engine *eng, const tokenizer *tok, int ctx, const sampler_params *sp,
             petrel_error *err);
void gen_free(gen_ctx *g);
/* Speculative decoding for this context (before its first gen_prompt): p->draft 0 leaves it
 * off, SPEC_AUTO on a model without an MTP layer too; a fixed draft count on one is refused
 * (spec_check). */
int gen_enable_spec(gen_ctx *g, const spec_params *p, petrel_error *err);
/* Makes the cache hold exactly ids[0..n) with logits for the last one, reusing the common
 * prefix. The penalty window is refilled from the prompt's last ids. PETREL_ERANGE if n > ctx. */
int gen_prompt(gen_ctx *g, const int32_t *ids, int n, gen_stats *st, petrel_error *err);
/* Session files (petrel_session_save / _load): gen_load replaces the cache and the id mirror
 * with a file's (the next gen_prompt reuses its common prefix); gen_save writes them. */
int gen_load(gen_ctx *g, const char *path, petrel_error *err);
int gen_save(const gen_ctx *g, const char *path, petrel_error *err);
/* Samples after the last gen_prompt (see above). st may be NULL. */
int gen_generate(gen_ctx *g, const gen_opts *o, gen_piece_fn fn, void *user, gen_stats *st,
                 petrel_error *err);

/* One-shot completion: encodes prompt (special tokens recognized, nothing added), opens a session
 * of n_prompt + max_tokens - 1 positions (the last token is never fed back; capped at
 * max_position_embeddings; max_tokens < 0 takes the cap), and generates. */
int generate_text(petrel_engine *eng, const tokenizer *tok, const char *prompt, size_t prompt_len,
                  const sampler_params *sp, const gen_opts *o, gen_piece_fn fn, void *user,
                  gen_stats *st, petrel_error *err);
#endif
