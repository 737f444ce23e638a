/* fuzz_session_file.c: libFuzzer target for the session file loader (src/kv/file.c). A small
 * pool (4 layers, the last the MTP layer, indexer keys on layers 0 and 2, pages of 4 positions,
 * int8 KV) and a session holding 5 positions. The input is loaded twice: as the whole file, and
 * with its header and trailing checksums made right (the input's first 96 bytes become the
 * header after the magic and version are set; its last 8 the payload checksum), so the shape,
 * length, token and payload checks behind the checksums are reached. kv_load_stream must refuse
 * bad input with an error and leave the session as it was, never crash or leak; a file it
 * accepts must have left a consistent session. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kv/kv.h"

static const uint8_t HAS_IDX[4] = {1, 0, 1, 0};
static kv_pool *pool;
static kv_seq *seq;

static void setup(void) {
    kv_shape sh = {4, 16, 4, 8, HAS_IDX, 3};
    kv_pool_opts o = {KV_INT8, 4, 0, 0};
    petrel_error err;
    kv_layout lay;
    if (kv_layout_init(&lay, &sh, &o, &err)) abort();
    uint64_t bytes = (uint64_t)lay.page_bytes * 64;
    kv_layout_deinit(&lay);
    if (kv_pool_create(&sh, &o, bytes, &pool, &err) || kv_seq_create(pool, 128, &seq, &err)) abort();
    if (kv_seq_reserve(seq, 0, 5, &err)) abort();
    float c[16] = {1, -2, 3}, pe[4] = {0.5f}, ki[8] = {4};
    int32_t ids[5] = {1, 2, 3, 4, 5};
    for (int p = 0; p < 5; p++)
        for (int l = 0; l < 4; l++) {
            if (kv_write(seq, l, p, c, pe, &err)) abort();
            if (HAS_IDX[l] && kv_write_index(seq, l, p, ki, &err)) abort();
        }
    if (kv_seq_append(seq, ids, 5, &err)) abort();
}

static void load(const uint8_t *b, size_t n) {
    FILE *f = n ? fmemopen((void *)b, n, "rb") : fopen("/dev/null", "rb");
    if (!f) return;
    petrel_error err;
    kv_pool_stats a, z;
    kv_pool_get_stats(pool, &a);
    int len = seq->len;
    int rc = kv_load_stream(seq, f, "fuzz", 42, 1000, &err);
    fclose(f);
    kv_pool_get_stats(pool, &z);
    if (rc) {
        if (seq->len != len || z.pages_free != a.pages_free) abort(); /* a refusal changed something */
        return;
    }
    if (seq->mtp_len > seq->len || seq->len > seq->cap || kv_seq_reserved(seq) < seq->len) abort();
    /* reads of everything loaded work; then back to the 5-position state for the next input */
    float c[16], pe[4], ki[8];
    for (int p = 0; p < seq->len; p++)
        if (kv_decode(seq, 0, p, p + 1, c, pe, ki, &err)) abort();
    if (seq->len > 5 && kv_seq_truncate(seq, 5, &err)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!pool) setup();
    load(data, size);
    if (size < 96 + 8) return 0;
    uint8_t *b = malloc(size);
    if (!b) return 0;
    memcpy(b, data, size);
    memcpy(b, "PETRELKV", 8);
    uint32_t ver = KV_FILE_VERSION;
    memcpy(b + 8, &ver, 4);
    uint64_t hs = XXH3_64bits(b, 88);
    memcpy(b + 88, &hs, 8);
    uint64_t sum = XXH3_64bits(b, size - 8);
    memcpy(b + size - 8, &sum, 8);
    load(b, size);
    free(b);
    return 0;
}
