/* tokenizer.h: the Hugging Face `tokenizer.json` byte-level BPE tokenizer (GLM, Qwen, DeepSeek,
 * GPT-2 family).
 *
 * Supported pipeline (anything else is refused at load with an error naming it):
 *   normalizer     null, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Sequence
 *   pre_tokenizer  ByteLevel (add_prefix_space, use_regex), Split (Regex or String pattern, every
 *                  behavior, invert), Digits, Sequence; a ByteLevel step is required
 *   model          BPE (vocab, merges as "a b" or ["a","b"], ignore_merges, unk_token)
 *   decoder        null, ByteLevel, Sequence of ByteLevel
 *   added_tokens   matched in the text before normalization (normalized=false) or after it
 *                  (normalized=true), leftmost-longest; honours single_word, lstrip, rstrip.
 *                  Ids as Hugging Face assigns them: the vocabulary's id when the content is a
 *                  model.vocab key, else the next id after the vocabulary / earlier added tokens
 *                  (for real tokenizer.json files this is the "id" field)
 * Split regexes run on PCRE2 (UTF + UCP, JIT when available). The post_processor is ignored:
 * encoding never adds BOS/EOS.
 *
 * A loaded tokenizer is immutable; every function taking a const tokenizer* is thread-safe.
 * Errors: negative PETREL_E* with a one-line message in the caller's petrel_error. */
#ifndef PETREL_TEXT_TOKENIZER_H
#define PETREL_TEXT_TOKENIZER_H
#include <stddef.h>
#include <stdint.h>

#include "petrel.h"

typedef struct tokenizer tokenizer;

/* Loads a tokenizer.json file. */
int tok_load(const char *path, tokenizer **out, petrel_error *err);
/* Loads from JSON text in memory (len bytes, need not be NUL-terminated). name is used in
 * error messages (e.g. the file name). */
int tok_load_json(const char *json, size_t len, const char *name, tokenizer **out,
                  petrel_error *err);
void tok_free(tokenizer *t);

/* Number of ids: one more than the largest id of the vocabulary and the added tokens. */
int32_t tok_vocab_size(const tokenizer *t);

/* Encodes len bytes of UTF-8 text into a malloc'd array of ids (*ids, *n; *ids may be NULL when
 * *n is 0). No BOS/EOS is added; added and special tokens written in the text are recognized.
 * Invalid UTF-8 is an error (PETREL_EINVAL) naming the byte offset. */
int tok_encode(const tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n,
               petrel_error *err);

/* Decodes ids into a malloc'd, NUL-terminated buffer (*out, *out_len excludes the NUL; out_len
 * may be NULL). Exact bytes: special tokens are written out, bytes are not repaired, so the
 * result may hold invalid UTF-8 if the ids split a character. Unknown ids: PETREL_EINVAL. */
int tok_decode(const tokenizer *t, const int32_t *ids, size_t n, char **out, size_t *out_len,
               petrel_error *err);

/* The id of a token given as its text (an added/special token such as "<|user|>", or a vocabulary
 * entry given as the raw bytes it stands for); -1 if there is none. */
int32_t tok_token_to_id(const tokenizer *t, const char *s);
/* The bytes a token stands for (not NUL-terminated) and their count; NULL for an unknown id. */
const char *tok_id_to_bytes(const tokenizer *t, int32_t id, size_t *len);
/* 1 if id is an added token marked "special", else 0. */
int tok_is_special(const tokenizer *t, int32_t id);

/* Streaming detokenizer: push ids one at a time and get the bytes that are ready; a UTF-8
 * character split across tokens is held back until it is complete, so every piece handed out
 * ends on a character boundary (bytes that can never complete a character are passed through).
 *   tok_stream s; tok_stream_init(&s, t);
 *   for each id: tok_stream_push(&s, id, &p, &n, err); fwrite(p, 1, n, out);
 *   tok_stream_flush(&s, &p, &n); fwrite(p, 1, n, out); tok_stream_free(&s);
 * The returned pointer stays valid until the next call on the stream. */
typedef struct tok_stream {
    const tokenizer *t;
    char *buf;          /* output buffer (owned) */
    size_t cap;
    unsigned char pend[4]; /* held-back bytes of an incomplete character */
    int npend;
} tok_stream;

void tok_stream_init(tok_stream *s, const tokenizer *t);
int tok_stream_push(tok_stream *s, int32_t id, const char **bytes, size_t *len,
                    petrel_error *err);
/* Hands out whatever is held back (an incomplete character at the end of the stream). */
int tok_stream_flush(tok_stream *s, const char **bytes, size_t *len, petrel_error *err);
void tok_stream_free(tok_stream *s);

#endif
