/* convert.h: writing petrel packs (format in io/pack.h) from any weight source.
 *
 * convert_from_wsource is the one writer: it lists the model's tensors by running weights_bind
 * over a recording wrapper of the source (so the pack holds exactly what the engine binds, in
 * the engine's naming), plans the whole file (per-class number formats, offsets, alignment),
 * then converts tensor by tensor (and expert record by record) with bounded memory:
 *   - a resident tensor is converted in row chunks of at most 32 MiB;
 *   - an expert record (gate|up|down + scales) is assembled in one buffer and written once.
 * Sources: a Hugging Face folder (convert_hf), a colibri artifact (its wsource), or a generator
 * (petrel synth: a `row` callback supplies f32 rows instead of the view's bytes).
 *
 * Resumable: output goes to OUT.partial with a journal OUT.partial.journal listing finished items
 * and their checksums. A rerun with the same plan re-reads each journaled item, keeps it if its
 * checksum matches, and converts the rest. At the end the header is written, the whole file is
 * re-read and verified (pack_verify), and OUT.partial is renamed to OUT.
 *
 * Number formats (per class, see convert_quant): norms, biases and the router stay f32;
 * bf16 is lossless for bf16, f16 and FP8 sources (FP8 stays FP8 with its block scales, f16 stays
 * f16); q8 = int8 per group of 32 with bf16 scales; q8row = int8 per row with f32 scales;
 * q4 = int4 per group of 64 with bf16 scales, round to nearest; q4x = the same bytes chosen by
 * pt_quant_row_q4x's search (importance-weighted when opts.calib is set). A source already in the target format is copied
 * bit-exactly (e.g. colibri int4 into q4 keeps its scales). */
#ifndef PETREL_IO_CONVERT_H
#define PETREL_IO_CONVERT_H
#include <stdint.h>

#include "model/config.h"
#include "model/weights.h"
#include "petrel.h"

typedef enum { CV_EXPERTS, CV_ATTN, CV_DENSE, CV_EMBED, CV_MTP, CV_CLASS_COUNT } convert_class;
typedef enum { CVQ_DEFAULT = 0, CVQ_F32, CVQ_BF16, CVQ_Q8, CVQ_Q8ROW, CVQ_Q4, CVQ_Q4X, CVQ_COUNT } convert_quant;
extern const char *const convert_class_names[CV_CLASS_COUNT]; /* "experts", "attention", ... */
/* "f32", "bf16", "q8", "q8row", "q4", "q4x" -> CVQ_*; -1 if unknown. */
int convert_quant_parse(const char *s);
const char *convert_quant_name(int q);

typedef struct convert_opts {
    int quant;                     /* CVQ_* for every class (CVQ_DEFAULT = bf16) */
    int cls[CV_CLASS_COUNT];       /* per-class overrides, CVQ_DEFAULT = follow `quant` (MTP: q8
                                      when `quant` is q4 or q4x, since int4 breaks MTP drafting;
                                      q4x: dense MLPs + shared experts and the DSA indexer q8) */
    int progress;                  /* progress lines on stderr */
    int stop_after;                /* test hook: stop (PETREL_ERANGE) after this many items */
    const char *label;             /* progress prefix, default "convert" */
    int expert_plain;              /* 1: routed experts in the plain layout; 0 (default): q8/q4
                                      expert parts row-interleaved (PT_LAYOUT_R16) where the
                                      shape allows, for the int8-activation kernels */
    const struct calib_stats *calib; /* borrowed, or NULL: activation statistics (io/calib.h)
                                      that weight q4x's error per input column */
} convert_opts;

typedef struct convert_result {
    int items;                     /* resident tensors + expert records */
    int resumed;                   /* items kept from an earlier interrupted run */
    uint64_t file_bytes;
} convert_result;

/* Produces f32 row r of matrix `name` ([rows, cols]) into out[cols]; must be thread-safe. */
typedef void (*convert_row_fn)(void *ctx, const char *name, int64_t rows, int64_t cols, int64_t r, float *out);

/* A side file stored verbatim in the pack (pack.h "files"). */
typedef struct convert_file {
    const char *name;                   /* e.g. "tokenizer.json" */
    const char *data;                   /* borrowed, len bytes */
    size_t len;
} convert_file;
/* The side files convert_configs_load takes from a model folder when present. */
#define CONVERT_SIDE_FILES {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
#define CONVERT_N_SIDE 3

typedef struct convert_src {
    const char *config_json;            /* config.json text, stored verbatim */
    const char *generation_config_json; /* or NULL */
    const petrel_config *cfg;           /* parsed config_json */
    const wsource *ws;                  /* tensors by HF name */
    convert_row_fn row;                 /* NULL: rows come from ws's views (pt_dequant_row) */
    void *row_ctx;
    const convert_file *files;          /* side files to store (borrowed [n_files], <= PACK_MAX_FILES) */
    int n_files;
} convert_src;

int convert_from_wsource(const convert_src *src, const char *out_path, const convert_opts *o, convert_result *res, petrel_error *err);
/* Converts a Hugging Face folder (or single .safetensors with config.json beside it). */
/* The config texts a pack stores verbatim, and the parsed config, of a model folder. */
typedef struct convert_configs {
    char *config_json;            /* owned */
    char *generation_config_json; /* owned or NULL */
    petrel_config cfg;
    int loaded;
    convert_file files[CONVERT_N_SIDE]; /* the side files present (CONVERT_SIDE_FILES), data owned */
    int n_files;
} convert_configs;
int convert_configs_load(const char *dir, convert_configs *cc, petrel_error *err);
void convert_configs_free(convert_configs *cc);

int convert_hf(const char *in, const char *out_path, const convert_opts *o, convert_result *res, petrel_error *err);
#endif
