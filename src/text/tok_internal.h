/* tok_internal.h: the tokenizer's private layout, shared by tok_load.c (building it from
 * tokenizer.json) and tokenizer.c (encode, decode, streaming). Not part of the API. */
#ifndef PETREL_TEXT_TOK_INTERNAL_H
#define PETREL_TEXT_TOK_INTERNAL_H
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "text/tokenizer.h"

#define TOK_MAX_ID (1 << 24)   /* ids beyond this are refused (keeps tables bounded) */
#define TOK_MAX_STEPS 32       /* normalizer / pre-tokenizer steps after flattening Sequences */

/* Normalizer steps (a Sequence is flattened into a list). */
enum { NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_LOWER, NORM_REPLACE, NORM_PREPEND };
typedef struct tok_norm {
    int kind;
    pcre2_code *re;     /* NORM_REPLACE: the pattern */
    char *str;          /* NORM_REPLACE: replacement; NORM_PREPEND: prefix */
    size_t str_len;
} tok_norm;

/* Pre-tokenizer steps (Sequence flattened). Splits use a regex and a behavior. */
enum { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };
enum { PRE_SPLIT, PRE_BYTELEVEL };
typedef struct tok_pre {
    int kind;
    pcre2_code *re;     /* PRE_SPLIT, PRE_BYTELEVEL with use_regex */
    int behavior;
    int invert;
    int add_prefix_space; /* PRE_BYTELEVEL */
    int jit;            /* re was JIT-compiled: match with pcre2_jit_match */
} tok_pre;

typedef struct tok_added {
    char *content;      /* as matched (normalized content when normalized) */
    size_t len;
    int32_t id;
    uint8_t special, single_word, lstrip, rstrip, normalized;
} tok_added;

/* Added tokens of one class (raw or normalized), indexed by first byte, longest first. */
typedef struct tok_added_set {
    int32_t *order;     /* indices into tokenizer.added */
    int32_t start[257]; /* order[start[b] .. start[b+1]) begin with byte b */
} tok_added_set;

typedef struct tok_vslot { uint32_t off, len; int32_t id; } tok_vslot;     /* vocab hash slot */
typedef struct tok_mslot { uint64_t key; int32_t rank, id; } tok_mslot;    /* merge hash slot */

struct tokenizer {
    /* id -> bytes (decode); len < 0 = no such id */
    int32_t n_ids;
    uint32_t *tok_off;
    int32_t *tok_len;
    uint8_t *is_special;
    char *arena;        /* all token bytes */
    size_t arena_len, arena_cap;

    /* vocabulary of the BPE model: bytes -> id (open addressing, power-of-two size) */
    tok_vslot *vtab;
    uint32_t vmask;
    int32_t byte_id[256]; /* the id of each single byte, -1 if absent */

    /* merges: (left id, right id) -> (rank, merged id) */
    tok_mslot *mtab;
    uint64_t mmask;

    int ignore_merges;
    int32_t unk_id;     /* -1 if none */
    int fuse_unk;

    tok_norm norm[TOK_MAX_STEPS];
    int n_norm;
    tok_pre pre[TOK_MAX_STEPS];
    int n_pre;

    tok_added *added;
    int n_added;
    tok_added_set set_raw, set_norm;
};

/* Shared helpers (tokenizer.c). */
int32_t tok_vocab_lookup(const tokenizer *t, const char *s, size_t len);
/* Offset of the first invalid UTF-8 byte, or -1 when all len bytes are valid. */
long tok_utf8_invalid_at(const unsigned char *s, size_t len);
/* Applies the normalizers to s; *out is s itself (no copy) or a malloc'd buffer (*owned = 1). */
int tok_normalize(const tokenizer *t, const char *s, size_t len, char **out, size_t *out_len,
                  int *owned, petrel_error *err);
#endif
