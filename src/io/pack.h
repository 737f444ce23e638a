/* pack.h: petrel's own model file ("pack"), reader side. Written by src/io/convert.c.
 *
 * Layout (all integers little-endian):
 *   [0, 64)        prefix: "PETRELPK" | u32 version (2; 1 is read too) | u32 flags (0) | u64 header_len |
 *                  u64 file_size | u64 xxh64(header JSON) | 24 reserved zero bytes
 *   [64, 64+hl)    header: one JSON object (UTF-8, not NUL-terminated)
 *                    "format": "petrel-pack", "version": 1,
 *                    "config": the model's config.json text, verbatim (a JSON string),
 *                    "generation_config": generation_config.json text or null,
 *                    "files": [ {name, offset, bytes, xxh64} ... ]   optional (packs written since
 *                                  2026-12; readers before ignore it): the source folder's
 *                                  tokenizer.json, tokenizer_config.json, chat_template.jinja,
 *                                  verbatim, so a pack is self-contained (pack_read_file)
 *                    "tensors": [ {name, qtype, rows, cols, offset, bytes, scale_offset,
 *                                  scale_bytes, scale_dtype, group, block_rows, block_cols,
 *                                  vector, xxh64} ... ]   resident tensors (absolute offsets)
 *                    "experts": [ {layer, n_experts, first_offset, record_bytes,
 *                                  parts: [gate, up, down] (same fields, offsets RELATIVE to the
 *                                  record start; version 2: optional "layout": "r16" when
 *                                  the part is stored row-interleaved, quant/qtypes.h),
 *                                  xxh64: [hex per expert]} ... ]
 *   then, 4096-aligned: the side files (each 64-byte aligned), then the resident region (every
 *   payload and scale array 64-byte aligned),
 *   then, 4096-aligned: the expert region. Record (layer, e) is the byte range
 *   [first_offset + e * record_bytes, + record_bytes): gate payload, gate scales, up payload,
 *   up scales, down payload, down scales (each 64-aligned), zero padding to a multiple of 4096.
 *   Offsets and lengths of records are multiples of 4096, so one O_DIRECT read fetches an expert.
 *
 * Checksums are XXH64 with seed 0, written as 16 lowercase hex digits: a resident tensor's over
 * its payload bytes followed by its scale bytes; a side file's over its bytes; a record's over all record_bytes (padding
 * included); the header's over the JSON text.
 *
 * Vectors (norms, biases, e_score_correction_bias) are stored as f32 [cols] with rows = 1 and
 * "vector": true. Matrices use pt_qtype layouts (src/quant/quant.h); FP8 keeps its checkpoint
 * block scales (block_rows x block_cols, scale rows = ceil(rows / block_rows)).
 *
 * The MTP layer (checkpoint index num_hidden_layers) is stored like any MoE layer: its routed
 * experts are records with layer = num_hidden_layers, everything else is resident.
 *
 * Invariants checked at open (the header is untrusted input): magic, version, header length and
 * checksum, file size equal to the prefix's file_size, every range inside the file, byte counts
 * equal to what qtype x shape implies, record sizes and alignment. Data checksums are checked by
 * whoever reads the data: pack_load_resident (resident tensors), pack_read_expert /
 * pack_check_expert, pack_read_file (side files), the engine's load of resident experts and
 * the expert store's reads (src/experts), or in full by pack_verify. */
#ifndef PETREL_IO_PACK_H
#define PETREL_IO_PACK_H
#include <stddef.h>
#include <stdint.h>

#include "model/config.h"
#include "model/weights.h"
#include "petrel.h"
#include "quant/qtypes.h"

#define PACK_MAGIC "PETRELPK"
#define PACK_VERSION 2u     /* written; versions 1 (no "layout" fields) and 2 are read */
#define PACK_VERSION_MIN 1u
#define PACK_PREFIX 64
#define PACK_ALIGN 4096
#define PACK_TALIGN 64

typedef struct pack_tensor {
    char *name;                 /* owned HF name (NULL for expert parts) */
    int vector;                 /* 1: f32 [cols], rows == 1 */
    pt_qtype qtype;
    int64_t rows, cols;
    uint64_t offset, bytes;     /* payload (absolute; relative to the record for parts) */
    uint64_t scale_offset, scale_bytes; /* 0, 0 when unscaled */
    int scale_dtype;            /* PT_F32 / PT_BF16 / PT_F16 (meaningful when scale_bytes) */
    int64_t group;              /* grouped formats: columns per scale; Q8_ROW: cols */
    int block_rows, block_cols; /* FP8 only */
    uint64_t xxh64;             /* resident tensors only */
    int layout;                 /* PT_LAYOUT_PLAIN, or PT_LAYOUT_R16 ("layout": "r16"; expert parts) */
} pack_tensor;

/* A side file stored in the pack ("files"): name without a folder, bytes at offset (absolute). */
#define PACK_MAX_FILES 8
#define PACK_FILE_MAX_BYTES (1ull << 30)
typedef struct pack_file {
    char name[64];
    uint64_t offset, bytes, xxh64;
} pack_file;

typedef struct pack_expert_layer {
    int layer;                  /* checkpoint layer index (num_hidden_layers = the MTP layer) */
    int n_experts;
    uint64_t first_offset;      /* record e at first_offset + e * record_bytes */
    uint64_t record_bytes;      /* multiple of PACK_ALIGN */
    pack_tensor part[3];        /* gate, up, down; offsets relative to the record start */
    uint64_t *xxh64;            /* owned [n_experts] */
} pack_expert_layer;

typedef struct pack {
    char path[4096];
    int fd;                     /* owned, -1 when parsed from memory */
    const uint8_t *map;         /* owned read-only mmap of the whole file (NULL when parsed) */
    uint8_t *copy;              /* owned anonymous copy (pack_load_resident) or NULL; same offsets as map */
    int copy_experts;           /* 1 when copy also holds the expert records */
    const struct pack_tensor *on_disk; /* a tensor left out of the copy (served from map, see
                                          pack_load_resident), or NULL */
    uint64_t file_size;
    uint32_t version;
    uint64_t header_len;
    char *config_json;          /* owned, NUL-terminated */
    char *generation_config_json; /* owned or NULL */
    int n_files;                /* side files ("files"; 0 in packs written before them) */
    pack_file files[PACK_MAX_FILES];
    int n_tensors;
    pack_tensor *tensors;       /* owned, sorted by name */
    int n_elayers;
    pack_expert_layer *elayers; /* owned, ascending layer */
    int n_layer_index;
    int *layer_index;           /* owned [n_layer_index]: layer -> elayers index or -1 */
    uint64_t data_start;        /* first byte after the header region */
} pack;

/* Copies the resident tensors into anonymous memory backed by transparent huge pages, checking
 * each resident tensor's checksum on the way; the weight source then serves views into the copy.
 * With experts != 0 the copy also gets room for every expert record (copy_experts = 1 when they
 * fit): the caller fills it before binding weights (the engine reads and checks every record
 * through the expert I/O pool, stream_load_experts); otherwise records are served from the map. Decode reads every resident byte per token:
 * from the file map that costs a TLB miss per 4 KiB page (about 20 % of the bandwidth here).
 * Only what fits into the memory the kernel reports as available is copied (the rest stays on
 * the map, its checksums checked through it); *copied_bytes says how much the copy holds (expert
 * records included). progress (may be NULL) gets (done, total) bytes of the resident tensors.
 * With embed_on_disk, the token embedding (one row per token, ~1 GB at GLM-5's vocabulary) is not
 * copied either when the pack has a separate lm_head: its view then points into the file map and
 * the caller drops the pages it touched (pack_release_on_disk), so they never add up in RSS. Its
 * checksum is still checked, through the map in 64 MiB steps released as they go.
 * Call before binding weights. */
int pack_load_resident(pack *p, int experts, int embed_on_disk, uint64_t *copied_bytes, void (*progress)(uint64_t done, uint64_t total, void *ud),
                       void *ud, petrel_error *err);
/* Byte ranges [a, b) of the file, for pack_read_ranges. */
typedef struct pack_range {
    uint64_t a, b;
} pack_range;
/* Reads the file's bytes of the ranges rg[0..n) into dst at their file offsets (dst mirrors the
 * file: page-aligned, at least the file's size rounded up to 4 KiB). Ranges are widened to whole
 * pages and merged where they touch (rg is reordered and rewritten), so dst gets some bytes of
 * the neighbours too, each in its own place. direct: O_DIRECT reads where the file system takes
 * them (no page-cache copy; falls back to buffered reads when it does not), else buffered.
 * progress (may be NULL) gets (done, total) bytes of the merged ranges. pack_load_resident reads
 * the resident tensors this way, direct. */
int pack_read_ranges(const pack *p, uint8_t *dst, pack_range *rg, int n, int direct, void (*progress)(uint64_t done, uint64_t total, void *ud),
                     void *ud, petrel_error *err);
/* Drops this process's pages of the tensor kept on disk (no-op without one): its rows were read
 * through the map; the kernel keeps them in the page cache, not in our resident set. */
void pack_release_on_disk(const pack *p);
/* Bytes pack_load_resident leaves on disk with embed_on_disk (the embedding when the pack has a
 * separate lm_head, else 0), whether or not it ran: memory plans of inspect-only opens. */
uint64_t pack_embed_on_disk_bytes(const pack *p);
/* Drops the file's pages from this process's map and asks the kernel to drop them from the page
 * cache, once the copy serves every resident tensor and nothing is read through the map but
 * the tensor kept on disk (rows on demand) and streamed experts (O_DIRECT): reading the pack at
 * open left up to its whole size cached beside the copy, and a model near the machine's memory
 * then ran under reclaim (on the 24 GiB dev box the 13 GB slice's experts read at half the speed
 * they reached once the cache was dropped). expert_map: routed experts are read through the map
 * (resident but not in the copy): then nothing is dropped. Returns 1 if it asked, 0 if not. */
int pack_drop_cache(pack *p, int expert_map);
/* Whether the page cache holds at least 90 % of the file (mincore over the map): an open then
 * copies it through buffered reads at memory speed instead of reading the disk again with
 * O_DIRECT (a pack just written, or read by something else; 0 where it cannot tell). */
int pack_cached(const pack *p);
/* 1 if the file at path is a regular file starting with PACK_MAGIC (never blocks on a FIFO). */
int pack_is_pack(const char *path);
/* Opens and validates a pack; maps it read-only. */
int pack_open(const char *path, pack **out, petrel_error *err);
void pack_close(pack *p);
/* Parses a pack header from memory: buf[0, len) holds at least the prefix and the JSON header;
 * ranges are validated against file_size. Fills *p (no fd, no map); free with pack_deinit.
 * Used by pack_open and by the fuzz target. */
int pack_parse(const uint8_t *buf, size_t len, uint64_t file_size, const char *where, pack *p, petrel_error *err);
void pack_deinit(pack *p);

int pack_fd(const pack *p);
const char *pack_path(const pack *p);
const pack_tensor *pack_find(const pack *p, const char *name);
/* The parsed config (config.json plus generation_config.json's eos ids). */
int pack_load_config(const pack *p, petrel_config *cfg, petrel_error *err);

/* Expert records, for the expert store.
 * pack_expert_record: where record (layer, expert) lies in the file and its checksum. Returns 0,
 * or PETREL_EINVAL if the pack holds no such record.
 * pack_expert_views: views of gate/up/down into record_buf, a buffer holding that layer's record
 * (any expert; all records of a layer share one layout). Returns 0 or PETREL_EINVAL. */
int pack_expert_record(const pack *p, int layer, int expert, uint64_t *offset, uint64_t *bytes, uint64_t *xxh64);
int pack_expert_views(const pack *p, int layer, const uint8_t *record_buf, pt_wview *gate, pt_wview *up, pt_wview *down);
/* Checks a record held in buf (record_bytes long) against its checksum: 0 or PETREL_EFORMAT. */
int pack_check_expert(const pack *p, int layer, int expert, const uint8_t *buf, petrel_error *err);
/* Reads record (layer, expert) with pread into buf (record_bytes; 4096-aligned for O_DIRECT
 * users, any alignment here) and checks its checksum. */
int pack_read_expert(const pack *p, int layer, int expert, uint8_t *buf, petrel_error *err);
/* Side files. pack_find_file: the entry named name, or NULL. pack_read_file: its bytes, checked
 * against its checksum, into a malloc'd NUL-terminated *out (*len without the NUL; len may be
 * NULL); "generation_config.json" is served from the header's text. PETREL_EIO naming the pack
 * when it stores no such file, PETREL_EFORMAT on a checksum mismatch. */
const pack_file *pack_find_file(const pack *p, const char *name);
int pack_read_file(const pack *p, const char *name, char **out, size_t *len, petrel_error *err);
/* Full check: every side file, resident tensor and record against its checksum. */
int pack_verify(const pack *p, petrel_error *err);

/* A view of a tensor whose bytes start at base (the map for resident tensors, a record buffer
 * for parts). */
void pack_tensor_view(const pack_tensor *t, const uint8_t *base, pt_wview *out);
/* 1 if any expert part is stored with layout r16. */
int pack_has_r16(const pack *p);
/* Can a tensor of this format and shape be stored with layout r16 (kn_r16_supported)? */
int pack_r16_ok(pt_qtype q, int64_t rows, int64_t cols, int scale_dtype);
/* Byte counts a tensor of this type and shape must have (payload; scales). 0 on success. */
int pack_tensor_sizes(pt_qtype q, int64_t rows, int64_t cols, int scale_dtype, int block_rows, int block_cols,
                      uint64_t *bytes, uint64_t *scale_bytes);

/* The weight source over an open pack: resident tensors are views into the map; routed-expert
 * matrices are views into the map at their record (the fully resident path). ctx = p. */
void wsource_pack(wsource *ws, const pack *p);

const char *pack_qtype_key(pt_qtype q);     /* "f32", "bf16", "f16", "fp8_e4m3", "q8_row", "q8_g32", "q4_g64" */
int pack_qtype_from_key(const char *s);     /* -1 if unknown */
#endif
