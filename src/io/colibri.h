/* colibri.h: reading colibri GLM-5.2 artifacts (docs: shared/docs/colibri-format.md) directly,
 * as a `wsource` the model binds through, like a Hugging Face checkpoint.
 *
 * An artifact is a folder of safetensors shards found by name (there is no index file):
 *   out-NNNNN.safetensors       main shards (resident weights and routed experts)
 *   out-mtp-NNNNN.safetensors   the MTP layer (int8)
 *   out-idx-NNNNN.safetensors   optional DSA indexer weights (absent from most public builds)
 * plus config.json (+ generation_config.json). colibri's sidecars (.coli_usage, .coli_kv) are
 * ignored. All shards are mmap'd as one st_set; a tensor's payload and its scales may sit in
 * different shards (views are per tensor, so straddling experts need no special case).
 *
 * A quantized 2-D weight `name` is a U8 payload `name` plus F32 scales `name.qs`; no format id
 * is stored, so the format follows from the byte counts for the logical [O, I] the binder asks
 * for (coli_infer_format). Mapping to petrel's views (exact: every value a kernel sees equals
 * (q * s) of the stored data):
 *   int8 per row            -> PT_Q8_ROW, zero-copy
 *   int4 group 64           -> PT_Q4_G64, zero-copy (routed experts of current builds)
 *   int4 per row, int4 gs with gs % 64 == 0 (128, 192, 256)
 *                           -> PT_Q4_G64, payload zero-copy, scales repeated per 64 columns
 *   int4 gs 32, 96          -> PT_Q8_G32, payload widened to int8 + scales per 32 (owned)
 *   int4 gs 16, 48          -> PT_F32, dequantized at open (owned)
 *   F32 / BF16 / F16 tensors (norms, router, biases) -> plain views (copied only if misaligned)
 * Owned conversions live as long as the colibri object. Other colibri formats (int3, int2,
 * FP8, MXFP4, E8) are refused with a message naming the tensor and the byte counts seen. */
#ifndef PETREL_IO_COLIBRI_H
#define PETREL_IO_COLIBRI_H
#include <stdint.h>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/weights.h"

/* The storage formats colibri writes that petrel reads. */
typedef enum coli_fmt { COLI_FLOAT = 0, COLI_I8_ROW, COLI_I4_ROW, COLI_I4_GROUP, COLI_FMT_COUNT } coli_fmt;

typedef struct colibri {
    char dir[4096];
    st_set *set;              /* owned: every shard, one set */
    int n_main, n_mtp, n_idx; /* shards found by kind */
    int has_indexer;          /* 1 if the artifact holds DSA indexer weights for its full layers
                                 (or the config has no full indexer layer) */
    /* Statistics over the matrices handed out (for `petrel info`). */
    int n_fmt[COLI_FMT_COUNT];
    int n_zero_copy, n_converted; /* views into the maps / into owned memory */
    uint64_t owned_bytes;
    void **owned;             /* owned: converted payloads and scales */
    int n_owned, cap_owned;
} colibri;

/* 1 if `dir` is a folder that looks like a colibri artifact: at least one out-NNNNN.safetensors
 * and no model.safetensors.index.json. */
int colibri_detect(const char *dir);

/* Opens the shards of the artifact in `dir`. `cfg` (may be NULL) is the artifact's config: with
 * it, has_indexer is resolved from the full indexer layers of its schedule. Validates shard
 * names and numbering (a gap means a missing shard). */
int colibri_open(const char *dir, const petrel_config *cfg, colibri **out, petrel_error *err);
void colibri_close(colibri *c);

/* The weight source over an open artifact (ctx = c; valid while c is open). */
void colibri_wsource(colibri *c, wsource *ws);

/* Infers the format of the quantized tensor `name` (for messages) of logical shape [O, I] from
 * its payload bytes and scale count; *gs is the group size (I for per-row formats). Ambiguous
 * group sizes (possible only when gs does not divide I) resolve to the gs that divides I, then
 * to 64 (colibri's default); anything else is refused. Returns 0 or PETREL_EUNSUPPORTED /
 * PETREL_EFORMAT with a message naming the tensor, the byte counts and the formats tried. */
int coli_infer_format(const char *name, int64_t O, int64_t I, uint64_t payload_bytes, uint64_t n_scales,
                      coli_fmt *fmt, int *gs, petrel_error *err);
const char *coli_fmt_name(coli_fmt f);

/* `petrel convert --in COLIBRI_DIR`: writes a petrel pack from the artifact in `dir` through
 * convert_from_wsource (io/convert.h), config.json and generation_config.json stored verbatim. */
struct convert_opts;
struct convert_result;
int colibri_convert(const char *dir, const char *out_path, const struct convert_opts *o, struct convert_result *res,
                    petrel_error *err);
#endif
