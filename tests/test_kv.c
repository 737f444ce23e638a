/* test_kv.c: the paged latent KV module (src/kv, group `kv`): scheme round trips within their
 * stated bounds (f32 bitwise), runs never crossing a page, copy-on-write forks isolated from
 * their source, truncate releasing only the pages past the cut, the prefix cache's hits, misses
 * and LRU eviction, pool exhaustion failing only the request that does not fit, and session
 * files: round trips (also into a pool of another page size) and the refusal, with one clear
 * line and no change to the session, of truncated, corrupt, other-model, other-scheme and
 * future-version files. A small made-up shape (4 layers, the last the MTP layer; indexer keys on
 * layers 0 and 2) and pages of 4 positions, so every test crosses page boundaries. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "kv/kv.h"
#include "test.h"

enum { NL = 4, RKV = 32, DR = 8, DI = 16, PP = 4 };
static const uint8_t HAS_IDX[NL] = {1, 0, 1, 0};
static kv_shape shape(void) { return (kv_shape){NL, RKV, DR, DI, HAS_IDX, NL - 1}; }

/* Deterministic values in about [-2, 2], with an outlier now and then (int8 scales see it). */
static float val(int salt, int l, int pos, int part, int i) {
    uint32_t h = (uint32_t)(salt * 73856093) ^ (uint32_t)(l * 19349663) ^ (uint32_t)(pos * 83492791) ^ (uint32_t)(part * 2654435761u) ^
                 (uint32_t)(i * 40503);
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    float v = (float)(h % 40001) / 10000.0f - 2.0f;
    return (h & 63) == 7 ? v * 9 : v;
}
static void row(int salt, int l, int pos, int part, int w, float *out) {
    for (int i = 0; i < w; i++) out[i] = val(salt, l, pos, part, i);
}

static kv_pool *mk_pool(kv_scheme sc, int P, int pages, int pe_f32) {
    kv_shape sh = shape();
    kv_layout lay;
    kv_pool_opts o = {sc, P, pe_f32, 0};
    petrel_error err = {0};
    if (kv_layout_init(&lay, &sh, &o, &err)) return NULL;
    size_t pb = lay.page_bytes;
    kv_layout_deinit(&lay);
    kv_pool *p = NULL;
    if (kv_pool_create(&sh, &o, (uint64_t)pb * (uint64_t)pages, &p, &err)) test_fail(__FILE__, __LINE__, "pool: %s", err.msg);
    return p;
}

/* Writes positions [a, b) of every layer with salt (reserve, write, append ids pos * 7 + salt). */
static int fill(kv_seq *s, int a, int b, int salt) {
    petrel_error err = {0};
    if (kv_seq_reserve(s, a, b, &err)) return -1;
    float c[RKV], pe[DR], ki[DI];
    for (int pos = a; pos < b; pos++)
        for (int l = 0; l < NL; l++) {
            row(salt, l, pos, 0, RKV, c), row(salt, l, pos, 1, DR, pe);
            if (kv_write(s, l, pos, c, pe, &err)) return -1;
            if (HAS_IDX[l]) {
                row(salt, l, pos, 2, DI, ki);
                if (kv_write_index(s, l, pos, ki, &err)) return -1;
            }
        }
    for (int pos = a; pos < b; pos++) {
        int32_t id = pos * 7 + salt;
        if (pos >= s->len && kv_seq_append(s, &id, 1, &err)) return -1;
    }
    return 0;
}

/* Max |decoded - written| / bound over positions [a, b) of every layer (<= 1 passes); bound per
 * value: 0 (bitwise) for f32, 2^-8 |x| for bf16, max|row| / 254 for int8 (k_pe bf16). */
static double check_rows(const kv_seq *s, int a, int b, int salt, kv_scheme sc, int pe_f32) {
    petrel_error err = {0};
    int n = b - a;
    float *c = malloc(sizeof(float) * (size_t)n * RKV), *pe = malloc(sizeof(float) * (size_t)n * DR), *ki = malloc(sizeof(float) * (size_t)n * DI);
    double worst = 0;
    for (int l = 0; l < NL; l++) {
        if (kv_decode(s, l, a, b, c, pe, HAS_IDX[l] ? ki : NULL, &err)) {
            worst = 1e9;
            break;
        }
        for (int r = 0; r < n; r++)
            for (int part = 0; part < 3; part++) {
                int w = part == 0 ? RKV : part == 1 ? DR : DI;
                if (part == 2 && !HAS_IDX[l]) continue;
                const float *got = part == 0 ? c + (size_t)r * RKV : part == 1 ? pe + (size_t)r * DR : ki + (size_t)r * DI;
                float x[RKV], mx = 0;
                row(salt, l, a + r, part, w, x);
                for (int i = 0; i < w; i++) mx = fmaxf(mx, fabsf(x[i]));
                int pe_part = part == 1;
                kv_scheme es = pe_part ? (sc == KV_F32 || pe_f32 ? KV_F32 : KV_BF16) : sc;
                for (int i = 0; i < w; i++) {
                    double d = fabs((double)got[i] - x[i]);
                    double bound = es == KV_F32 ? 0 : es == KV_BF16 ? ldexp(fabs(x[i]), -8) : mx / 254.0 * (1 + 1e-6);
                    double q = d == 0 ? 0 : bound == 0 ? 1e9 : d / bound;
                    if (q > worst) worst = q;
                }
            }
    }
    free(c), free(pe), free(ki);
    return worst;
}

TEST(kv, bytes_per_token) {
    /* GLM-5.2: 78 layers + MTP, Rkv 512, Dr 64, Di 128 on 21 layers */
    uint8_t hi[79] = {0};
    for (int l = 0; l < 21; l++) hi[l * 3] = 1;
    kv_shape g = {79, 512, 64, 128, hi, 78};
    CHECK_EQ_INT(kv_bytes_per_token(&g, KV_F32, 0), 79 * 576 * 4 + 21 * 128 * 4);          /* 192768 */
    CHECK_EQ_INT(kv_bytes_per_token(&g, KV_BF16, 0), 79 * 576 * 2 + 21 * 128 * 2);         /* 96384 */
    CHECK_EQ_INT(kv_bytes_per_token(&g, KV_INT8, 0), 79 * (512 + 4 + 128) + 21 * (128 + 4)); /* 53648 */
    CHECK_EQ_INT(kv_bytes_per_token(&g, KV_INT8, 1), 79 * (512 + 4 + 256) + 21 * (128 + 4));
    kv_layout lay;
    kv_pool_opts o = {KV_INT8, 0, 0, 0};
    petrel_error err = {0};
    CHECK(kv_layout_init(&lay, &g, &o, &err) == 0);
    CHECK_EQ_INT(lay.P, KV_PAGE_DEFAULT);
    CHECK_EQ_INT(lay.bytes_per_token, 53648);
    CHECK(lay.page_bytes % 64 == 0 && lay.page_bytes >= lay.bytes_per_token * 64);
    CHECK(lay.page_bytes < lay.bytes_per_token * 64 + 64 * 79 * 5); /* padding only */
    CHECK_EQ_INT(kv_layout_max_positions(&lay, (uint64_t)lay.page_bytes * 10 + 5), 640);
    kv_layout_deinit(&lay);
    kv_scheme s;
    CHECK(kv_scheme_parse("auto", &s, &err) == 0 && s == KV_BF16);
    CHECK(kv_scheme_parse("int8", &s, &err) == 0 && s == KV_INT8);
    CHECK(kv_scheme_parse("fp8", &s, &err) == PETREL_EINVAL && strstr(err.msg, "f32, bf16, int8"));
    /* a pool too small for one page */
    kv_pool *p = NULL;
    CHECK(kv_pool_create(&g, &o, 1000, &p, &err) == PETREL_ERANGE && !p && strstr(err.msg, "holds no page"));
}

static void roundtrip(kv_scheme sc, int pe_f32, double *worst) {
    kv_pool *p = mk_pool(sc, PP, 16, pe_f32);
    kv_seq *s = NULL;
    petrel_error err = {0};
    CHECK(p && kv_seq_create(p, 40, &s, &err) == 0);
    CHECK(fill(s, 0, 23, 1) == 0);
    CHECK_EQ_INT(kv_seq_len(s), 23);
    CHECK_EQ_INT(kv_seq_reserved(s), 24);
    *worst = check_rows(s, 0, 23, 1, sc, pe_f32);
    /* runs: one page at most, contiguous, the same values as decode */
    float dc[RKV], rc[RKV];
    for (int l = 0; l < NL; l++)
        for (int a = 3; a < 23;) {
            kv_run r;
            int n = kv_run_at(s, l, a, 23, &r, &err);
            CHECK(n > 0 && r.pos == a && r.n == n && (a % PP) + n <= PP);
            CHECK((r.idx != NULL) == HAS_IDX[l]);
            CHECK((r.c_scale != NULL) == (sc == KV_INT8));
            if (n <= 0) break;
            CHECK(kv_decode(s, l, a + n - 1, a + n, dc, NULL, NULL, &err) == 0);
            const kv_layout *y = kv_pool_layout(p);
            const uint8_t *last = (const uint8_t *)r.c + (size_t)(n - 1) * RKV * y->c_bytes;
            for (int i = 0; i < RKV; i++)
                rc[i] = sc == KV_F32 ? ((const float *)last)[i] : sc == KV_INT8 ? ((const int8_t *)last)[i] * r.c_scale[n - 1] : dc[i];
            CHECK(!memcmp(dc, rc, sizeof dc));
            a += n;
        }
    /* gather in any order == decode of each position */
    int32_t pos[5] = {22, 0, 9, 9, 4};
    float g[5 * DI], one[DI];
    CHECK(kv_gather(s, 2, pos, 5, NULL, NULL, g, &err) == 0);
    for (int i = 0; i < 5; i++) {
        CHECK(kv_decode(s, 2, pos[i], pos[i] + 1, NULL, NULL, one, &err) == 0);
        CHECK(!memcmp(one, g + i * DI, sizeof one));
    }
    /* out of range reads and writes are refused */
    CHECK(kv_decode(s, 0, 20, 25, dc, NULL, NULL, &err) == PETREL_EINVAL);
    CHECK(kv_decode(s, 1, 0, 1, NULL, NULL, one, &err) == PETREL_EINVAL); /* layer 1 keeps no keys */
    CHECK(kv_gather(s, 0, (int32_t[]){24}, 1, dc, NULL, NULL, &err) == PETREL_EINVAL);
    CHECK(kv_write(s, 0, 24, dc, NULL, &err) == PETREL_EINVAL && strstr(err.msg, "reserved"));
    CHECK(kv_write(s, NL, 0, dc, NULL, &err) == PETREL_EINVAL);
    CHECK(kv_write_index(s, 1, 0, one, &err) == PETREL_EINVAL);
    kv_seq_free(s);
    kv_pool_stats st;
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, st.pages); /* freeing the session returned every page */
    kv_pool_free(p);
}

TEST(kv, roundtrip_f32_bitwise) {
    double w;
    roundtrip(KV_F32, 0, &w);
    CHECK_MSG(w == 0, "f32 KV not bitwise: worst error %g", w);
}
TEST(kv, roundtrip_bf16) {
    double w;
    roundtrip(KV_BF16, 0, &w);
    CHECK_MSG(w <= 1 && w > 0, "bf16 KV error %g of its bound 2^-8 |x| (0 would mean nothing was rounded)", w);
}
TEST(kv, roundtrip_int8) {
    double w;
    roundtrip(KV_INT8, 0, &w);
    CHECK_MSG(w <= 1 && w > 0.1, "int8 KV error %g of its bound max|row| / 254", w);
    roundtrip(KV_INT8, 1, &w); /* k_pe kept f32: bitwise there, c and idx within the int8 bound */
    CHECK_MSG(w <= 1, "int8 KV (k_pe f32) error %g of its bound", w);
    /* an all-zero row decodes to zeros (scale 0) */
    kv_pool *p = mk_pool(KV_INT8, PP, 2, 0);
    kv_seq *s = NULL;
    petrel_error err = {0};
    CHECK(p && kv_seq_create(p, 4, &s, &err) == 0 && kv_seq_reserve(s, 0, 1, &err) == 0);
    float z[RKV] = {0}, out[RKV];
    out[0] = 1;
    CHECK(kv_write(s, 0, 0, z, NULL, &err) == 0 && kv_decode(s, 0, 0, 1, out, NULL, NULL, &err) == 0);
    CHECK(!memcmp(z, out, sizeof z));
    kv_seq_free(s);
    kv_pool_free(p);
}

TEST(kv, fork_cow_isolation) {
    kv_pool *p = mk_pool(KV_F32, PP, 16, 0);
    kv_seq *a = NULL, *b = NULL;
    petrel_error err = {0};
    kv_pool_stats st;
    CHECK(p && kv_seq_create(p, 32, &a, &err) == 0);
    CHECK(fill(a, 0, 10, 1) == 0); /* pages 0, 1 full, 2 holds 8..9 */
    kv_pool_get_stats(p, &st);
    int used = st.pages - st.pages_free;
    CHECK_EQ_INT(used, 3);
    CHECK(kv_seq_fork(a, 0, &b, &err) == 0);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages - st.pages_free, 3); /* a fork costs no page */
    CHECK_EQ_INT(kv_seq_len(b), 10);
    CHECK(check_rows(b, 0, 10, 1, KV_F32, 0) == 0);
    /* a shared page cannot be written in place */
    float c[RKV];
    row(9, 0, 10, 0, RKV, c);
    CHECK(kv_write(b, 0, 9, c, NULL, &err) == PETREL_EINVAL && strstr(err.msg, "shared"));
    /* b writes 10..11 (copies page 2), a writes its own 10..13 (page 2 is a's alone again) */
    CHECK(fill(b, 10, 12, 2) == 0);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages - st.pages_free, 4);
    CHECK(fill(a, 10, 14, 3) == 0);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages - st.pages_free, 5); /* a's page 3 is new; page 2 written in place */
    CHECK(check_rows(a, 0, 10, 1, KV_F32, 0) == 0 && check_rows(a, 10, 14, 3, KV_F32, 0) == 0);
    CHECK(check_rows(b, 0, 10, 1, KV_F32, 0) == 0 && check_rows(b, 10, 12, 2, KV_F32, 0) == 0);
    /* b rewrites position 5 (a full shared page) after a rollback: a is untouched */
    CHECK(kv_seq_truncate(b, 5, &err) == 0);
    CHECK(fill(b, 5, 7, 4) == 0);
    CHECK(check_rows(a, 0, 10, 1, KV_F32, 0) == 0);
    CHECK(check_rows(b, 0, 5, 1, KV_F32, 0) == 0 && check_rows(b, 5, 7, 4, KV_F32, 0) == 0);
    CHECK_EQ_INT(b->tokens[5], 5 * 7 + 4);
    CHECK_EQ_INT(a->tokens[5], 5 * 7 + 1);
    /* a fork into a capacity below the length is refused */
    kv_seq *c2 = NULL;
    CHECK(kv_seq_fork(a, 5, &c2, &err) == PETREL_EINVAL && !c2);
    kv_seq_free(a);
    kv_seq_free(b);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, st.pages);
    kv_pool_free(p);
}

TEST(kv, truncate_touches_only_pages_past_cut) {
    kv_pool *p = mk_pool(KV_BF16, PP, 8, 0);
    kv_seq *s = NULL;
    petrel_error err = {0};
    kv_pool_stats st;
    CHECK(p && kv_seq_create(p, 32, &s, &err) == 0);
    CHECK(fill(s, 0, 13, 1) == 0); /* 4 pages */
    CHECK(kv_seq_mtp_advance(s, 12, &err) == 0);
    CHECK(kv_seq_mtp_advance(s, 5, &err) == PETREL_EINVAL); /* past the 16 reserved (drafts may run past len, not past the reserve) */
    int32_t kept[3] = {s->pages[0], s->pages[1], s->pages[2]};
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, 4);
    CHECK(kv_seq_truncate(s, 9, &err) == 0);
    CHECK_EQ_INT(kv_seq_len(s), 9);
    CHECK_EQ_INT(s->mtp_len, 9);
    CHECK_EQ_INT(s->n_pages, 3);
    CHECK(s->pages[0] == kept[0] && s->pages[1] == kept[1] && s->pages[2] == kept[2]);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, 5);
    CHECK(check_rows(s, 0, 9, 1, KV_BF16, 0) <= 1);
    CHECK(kv_seq_truncate(s, 10, &err) == PETREL_EINVAL); /* only backwards */
    /* a cut at a page boundary keeps that many whole pages; to 0 releases all */
    CHECK(kv_seq_truncate(s, 8, &err) == 0 && s->n_pages == 2);
    CHECK(fill(s, 8, 12, 2) == 0 && check_rows(s, 8, 12, 2, KV_BF16, 0) <= 1 && check_rows(s, 0, 8, 1, KV_BF16, 0) <= 1);
    CHECK(kv_seq_truncate(s, 0, &err) == 0 && s->n_pages == 0 && s->mtp_len == 0);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, st.pages);
    kv_seq_free(s);
    kv_pool_free(p);
}

static void ids_of(int32_t *ids, int n, int salt) {
    for (int i = 0; i < n; i++) ids[i] = i * 7 + salt;
}

TEST(kv, prefix_cache_hit_miss) {
    kv_pool *p = mk_pool(KV_INT8, PP, 16, 0);
    kv_seq *a = NULL, *b = NULL;
    petrel_error err = {0};
    kv_pool_stats st;
    CHECK(p && kv_seq_create(p, 32, &a, &err) == 0 && kv_seq_create(p, 32, &b, &err) == 0);
    CHECK(fill(a, 0, 14, 1) == 0);
    CHECK(kv_seq_mtp_advance(a, 9, &err) == 0);
    CHECK_EQ_INT(kv_prefix_put(a, &err), 3); /* 3 full pages of 14 positions */
    CHECK_EQ_INT(kv_prefix_put(a, &err), 0); /* already there */
    int32_t ids[20];
    ids_of(ids, 20, 1);
    ids[13] = 999; /* differs after the cached pages */
    CHECK_EQ_INT(kv_prefix_get(b, ids, 20, &err), 12);
    CHECK_EQ_INT(kv_seq_len(b), 12);
    CHECK_EQ_INT(b->mtp_len, 8); /* pages 0, 1 had their MTP rows; page 2 not */
    CHECK(check_rows(b, 0, 12, 1, KV_INT8, 0) <= 1);
    /* bitwise the same encoded pages as a's: shared, not recomputed */
    CHECK(b->pages[0] == a->pages[0] && b->pages[2] == a->pages[2]);
    /* b goes on past the prefix: its own page; the shared ones unchanged for a */
    CHECK(fill(b, 12, 15, 5) == 0);
    CHECK(check_rows(a, 0, 14, 1, KV_INT8, 0) <= 1);
    /* b rewrites inside a cached page: copied, so the cache and a keep the old rows */
    CHECK(kv_seq_truncate(b, 6, &err) == 0 && fill(b, 6, 8, 6) == 0);
    CHECK(b->pages[1] != a->pages[1]);
    kv_seq_free(b);
    b = NULL;
    CHECK(kv_seq_create(p, 32, &b, &err) == 0);
    ids_of(ids, 20, 1);
    ids[5] = -3; /* differs inside page 1: one page */
    CHECK_EQ_INT(kv_prefix_get(b, ids, 20, &err), 4);
    CHECK(check_rows(b, 0, 4, 1, KV_INT8, 0) <= 1);
    CHECK(kv_prefix_get(b, ids, 20, &err) == PETREL_EINVAL); /* not empty */
    kv_seq_free(b);
    CHECK(kv_seq_create(p, 32, &b, &err) == 0);
    ids_of(ids, 20, 2); /* another prompt */
    CHECK_EQ_INT(kv_prefix_get(b, ids, 20, &err), 0);
    ids_of(ids, 20, 1);
    CHECK_EQ_INT(kv_prefix_get(b, ids, 11, &err), 8); /* whole pages of the tokens given only */
    kv_seq_free(b);
    CHECK(kv_seq_create(p, 6, &b, &err) == 0);
    CHECK_EQ_INT(kv_prefix_get(b, ids, 20, &err), 4); /* and of the session's capacity */
    kv_seq_free(b);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.prefix_entries, 3);
    CHECK(st.prefix_hits == 3 + 1 + 2 + 1 && st.prefix_misses == 3); /* the lookups stopped by a page not cached */
    kv_seq_free(a);
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.prefix_only, 3); /* only the cache holds them now */
    CHECK_EQ_INT(st.pages_free, st.pages - 3);
    kv_prefix_clear(p);
    kv_pool_get_stats(p, &st);
    CHECK(st.prefix_entries == 0 && st.pages_free == st.pages);
    kv_pool_free(p);
}

TEST(kv, prefix_cache_lru_eviction) {
    kv_pool *p = mk_pool(KV_F32, PP, 8, 0);
    kv_seq *s = NULL;
    petrel_error err = {0};
    kv_pool_stats st;
    int32_t x[12], y[12];
    ids_of(x, 12, 1);
    ids_of(y, 12, 2);
    /* prefix X (3 pages), then Y (3 pages); the sessions go, the cache alone holds 6 pages */
    CHECK(p && kv_seq_create(p, 32, &s, &err) == 0 && fill(s, 0, 12, 1) == 0 && kv_prefix_put(s, &err) == 3);
    kv_seq_free(s);
    CHECK(kv_seq_create(p, 32, &s, &err) == 0 && fill(s, 0, 12, 2) == 0 && kv_prefix_put(s, &err) == 3);
    kv_seq_free(s);
    kv_pool_get_stats(p, &st);
    CHECK(st.pages_free == 2 && st.prefix_only == 6);
    /* a session needing 3 pages: 2 free + 1 evicted, X's deepest page (the oldest) */
    CHECK(kv_seq_create(p, 32, &s, &err) == 0);
    CHECK_EQ_INT(kv_seq_room(s), 32); /* 8 obtainable pages hold the capacity */
    CHECK(fill(s, 0, 12, 3) == 0);
    kv_pool_get_stats(p, &st);
    CHECK(st.prefix_evictions == 1 && st.prefix_entries == 5);
    kv_seq_free(s);
    CHECK(kv_seq_create(p, 32, &s, &err) == 0);
    CHECK_EQ_INT(kv_prefix_get(s, x, 12, &err), 8); /* X lost its last page only; now X is the newest */
    CHECK(check_rows(s, 0, 8, 1, KV_F32, 0) == 0);
    kv_seq_free(s);
    /* the next eviction takes Y's deepest page, not X's */
    CHECK(kv_seq_create(p, 32, &s, &err) == 0 && fill(s, 0, 16, 4) == 0); /* 4 pages: 3 free + 1 evicted */
    kv_seq_free(s);
    CHECK(kv_seq_create(p, 32, &s, &err) == 0);
    CHECK_EQ_INT(kv_prefix_get(s, y, 12, &err), 8);
    kv_seq_free(s);
    CHECK(kv_seq_create(p, 32, &s, &err) == 0);
    CHECK_EQ_INT(kv_prefix_get(s, x, 12, &err), 8);
    kv_seq *t = NULL;
    CHECK(kv_seq_create(p, 32, &t, &err) == 0);
    CHECK_EQ_INT(kv_prefix_get(t, y, 12, &err), 8); /* Y newest, X older */
    kv_seq_free(t);
    /* entries of pages a session uses are not evicted (it would free nothing): s holds X's 2
     * pages, so a session needing 6 takes the 4 free and evicts Y's 2, though X's are older */
    CHECK(kv_seq_create(p, 32, &t, &err) == 0);
    CHECK_EQ_INT(kv_seq_room(t), 24); /* 8 - 2 (s's shared pages) */
    CHECK(kv_seq_reserve(t, 0, 28, &err) == PETREL_ERANGE && strstr(err.msg, "24 positions fit"));
    CHECK(fill(t, 0, 24, 5) == 0);
    CHECK(check_rows(s, 0, 8, 1, KV_F32, 0) == 0);
    kv_seq_free(t);
    kv_seq_free(s);
    kv_pool_get_stats(p, &st);
    CHECK(st.prefix_entries == 2 && st.pages_free == st.pages - 2);
    CHECK(kv_seq_create(p, 32, &s, &err) == 0);
    CHECK_EQ_INT(kv_prefix_get(s, x, 12, &err), 8);
    kv_seq_free(s);
    kv_pool_free(p);
}

TEST(kv, pool_exhaustion_leaves_others_intact) {
    kv_pool *p = mk_pool(KV_BF16, PP, 6, 0);
    kv_seq *a = NULL, *b = NULL, *c = NULL;
    petrel_error err = {0};
    kv_pool_stats st;
    CHECK(p && kv_seq_create(p, 64, &a, &err) == 0 && kv_seq_create(p, 64, &b, &err) == 0 && kv_seq_create(p, 64, &c, &err) == 0);
    CHECK(fill(a, 0, 12, 1) == 0 && fill(b, 0, 7, 2) == 0); /* 3 + 2 pages of 6 */
    CHECK_EQ_INT(kv_seq_room(c), 4);
    int rc = kv_seq_reserve(c, 0, 12, &err);
    CHECK_EQ_INT(rc, PETREL_ERANGE);
    CHECK_MSG(strstr(err.msg, "KV pool full") && strstr(err.msg, "4 positions fit from position 0"), "message: %s", err.msg);
    CHECK_EQ_INT(c->n_pages, 0); /* nothing taken */
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, 1);
    CHECK(check_rows(a, 0, 12, 1, KV_BF16, 0) <= 1 && check_rows(b, 0, 7, 2, KV_BF16, 0) <= 1);
    /* b can still grow within its page and into the last one; then b is out too */
    CHECK(fill(b, 7, 12, 2) == 0);
    CHECK_EQ_INT(kv_seq_room(b), 0);
    CHECK(kv_seq_reserve(b, 12, 13, &err) == PETREL_ERANGE && strstr(err.msg, "0 positions fit"));
    CHECK(check_rows(b, 0, 12, 2, KV_BF16, 0) <= 1);
    /* a session's own capacity is a limit too */
    kv_seq *d = NULL;
    CHECK(kv_seq_create(p, 5, &d, &err) == 0);
    CHECK(kv_seq_reserve(d, 0, 6, &err) == PETREL_ERANGE && strstr(err.msg, "5 more fit"));
    kv_seq_free(d);
    /* freeing a gives c its room */
    kv_seq_free(a);
    CHECK(fill(c, 0, 12, 3) == 0 && check_rows(c, 0, 12, 3, KV_BF16, 0) <= 1);
    kv_seq_free(b);
    kv_seq_free(c);
    kv_pool_free(p);
}

/* ---- session files ---- */

static const uint64_t MODEL = 0x1234abcd5678ef01ull;

static void spit(const char *path, const void *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(b, 1, n, f);
        fclose(f);
    }
}

static void file_roundtrip(kv_scheme sc) {
    kv_pool *p = mk_pool(sc, PP, 16, 0);
    kv_seq *s = NULL, *t = NULL;
    petrel_error err = {0};
    CHECK(p && kv_seq_create(p, 32, &s, &err) == 0 && kv_seq_create(p, 32, &t, &err) == 0);
    CHECK(fill(s, 0, 11, 1) == 0 && kv_seq_mtp_advance(s, 10, &err) == 0);
    const char *path = test_tmp(sc == KV_F32 ? "rt-f32.session" : sc == KV_BF16 ? "rt-bf16.session" : "rt-int8.session");
    CHECK_MSG(kv_save(s, path, MODEL, &err) == 0, "save: %s", err.msg);
    struct stat stt;
    CHECK(stat(path, &stt) == 0 && (uint64_t)stt.st_size == kv_file_bytes(kv_pool_layout(p), 11, 10));
    CHECK(fill(t, 0, 3, 9) == 0); /* t had other contents: replaced */
    CHECK_MSG(kv_load(t, path, MODEL, 1000, &err) == 0, "load: %s", err.msg);
    CHECK(t->len == 11 && t->mtp_len == 10 && !memcmp(t->tokens, s->tokens, 11 * sizeof(int32_t)));
    /* the encoded rows come back bitwise (decode of both equal), valid MTP rows included */
    float c1[11 * RKV], c2[11 * RKV];
    for (int l = 0; l < NL; l++) {
        int v = l == NL - 1 ? 10 : 11;
        CHECK(kv_decode(s, l, 0, v, c1, NULL, NULL, &err) == 0 && kv_decode(t, l, 0, v, c2, NULL, NULL, &err) == 0);
        CHECK(!memcmp(c1, c2, sizeof(float) * (size_t)v * RKV));
    }
    CHECK(check_rows(t, 0, 10, 1, sc, 0) <= 1);
    /* into a pool of another page size */
    kv_pool *q = mk_pool(sc, 8, 4, 0);
    kv_seq *u = NULL;
    CHECK(q && kv_seq_create(q, 16, &u, &err) == 0);
    CHECK_MSG(kv_load(u, path, MODEL, 0, &err) == 0, "load (page 8): %s", err.msg);
    CHECK(u->len == 11 && check_rows(u, 0, 10, 1, sc, 0) <= 1);
    kv_seq_free(u);
    kv_pool_free(q);
    /* an empty session saves and loads too */
    kv_seq *e = NULL;
    CHECK(kv_seq_create(p, 8, &e, &err) == 0 && kv_save(e, path, MODEL, &err) == 0);
    CHECK(kv_load(t, path, MODEL, 0, &err) == 0 && t->len == 0 && t->n_pages == 0);
    kv_seq_free(e);
    kv_seq_free(s);
    kv_seq_free(t);
    kv_pool_stats st;
    kv_pool_get_stats(p, &st);
    CHECK_EQ_INT(st.pages_free, st.pages);
    kv_pool_free(p);
}

TEST(kv, session_file_roundtrip) {
    file_roundtrip(KV_F32);
    file_roundtrip(KV_BF16);
    file_roundtrip(KV_INT8);
}

/* Loads `path` into t (which holds 6 positions of salt 7): refused with `code` and a message
 * containing `want`, and t and the pool exactly as before. */
static void refuse(kv_seq *t, const char *path, uint64_t model, int code, const char *want, int line) {
    petrel_error err = {0};
    kv_pool_stats a, b;
    kv_pool_get_stats(t->pool, &a);
    int32_t pages[2] = {t->pages[0], t->pages[1]};
    int rc = kv_load(t, path, model, 1000, &err);
    if (rc != code || !strstr(err.msg, want)) test_fail(__FILE__, line, "load: %d \"%s\", wanted %d with \"%s\"", rc, err.msg, code, want);
    if (strchr(err.msg, '\n')) test_fail(__FILE__, line, "message of more than one line: %s", err.msg);
    kv_pool_get_stats(t->pool, &b);
    if (a.pages_free != b.pages_free || t->len != 6 || t->n_pages != 2 || t->pages[0] != pages[0] || t->pages[1] != pages[1] ||
        check_rows(t, 0, 6, 7, kv_pool_layout(t->pool)->scheme, 0) > 1 || t->tokens[5] != 5 * 7 + 7)
        test_fail(__FILE__, line, "a refused load changed the session or the pool");
}

TEST(kv, session_file_refusals) {
    kv_pool *p = mk_pool(KV_INT8, PP, 16, 0);
    kv_seq *s = NULL, *t = NULL;
    petrel_error err = {0};
    CHECK(p && kv_seq_create(p, 32, &s, &err) == 0 && kv_seq_create(p, 32, &t, &err) == 0);
    CHECK(fill(s, 0, 11, 1) == 0 && fill(t, 0, 6, 7) == 0);
    const char *path = test_tmp("good.session"), *bad = test_tmp("bad.session");
    CHECK(kv_save(s, path, MODEL, &err) == 0);
    size_t n = 0;
    uint8_t *f = test_read_file(path, &n);
    CHECK(f && n > 200);
    if (!f) return;
    /* truncated anywhere: the empty file, inside the magic, the header, the tokens, the payload, the checksum */
    size_t cuts[] = {0, 5, 50, 100, 120, n / 2, n - 9, n - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        spit(bad, f, cuts[i]);
        refuse(t, bad, MODEL, PETREL_EFORMAT, cuts[i] < 8 ? "not a petrel session file" : "truncated session file", __LINE__);
    }
    /* corrupt: a payload byte, a token, a header byte; trailing bytes */
    uint8_t *g = malloc(n + 1);
    memcpy(g, f, n), g[n - 40] ^= 1, spit(bad, g, n);
    refuse(t, bad, MODEL, PETREL_EFORMAT, "corrupt session file: checksum mismatch", __LINE__);
    memcpy(g, f, n), g[96 + 8 + 4] ^= 0x10, spit(bad, g, n);
    refuse(t, bad, MODEL, PETREL_EFORMAT, "checksum mismatch", __LINE__);
    memcpy(g, f, n), g[53] ^= 1, spit(bad, g, n);
    refuse(t, bad, MODEL, PETREL_EFORMAT, "header checksum mismatch", __LINE__);
    memcpy(g, f, n), g[n] = 0, spit(bad, g, n + 1);
    refuse(t, bad, MODEL, PETREL_EFORMAT, "bytes after the checksum", __LINE__);
    memcpy(g, f, n), memcpy(g, "GGUF", 4), spit(bad, g, n);
    refuse(t, bad, MODEL, PETREL_EFORMAT, "not a petrel session file", __LINE__);
    /* a future version (its header checksum right, so it is not reported as corruption) */
    memcpy(g, f, n);
    uint32_t v2 = KV_FILE_VERSION + 1;
    memcpy(g + 8, &v2, 4);
    uint64_t hs = XXH3_64bits(g, 88);
    memcpy(g + 88, &hs, 8);
    spit(bad, g, n);
    refuse(t, bad, MODEL, PETREL_EUNSUPPORTED, "format version 2 is newer than this build reads (up to 1)", __LINE__);
    /* a token out of the vocabulary with a right checksum is still refused */
    kv_seq *w = NULL;
    CHECK(kv_seq_create(p, 32, &w, &err) == 0 && fill(w, 0, 6, 1) == 0);
    w->tokens[2] = 5000;
    CHECK(kv_save(w, bad, MODEL, &err) == 0);
    kv_seq_free(w);
    refuse(t, bad, MODEL, PETREL_EFORMAT, "token 5000 at position 2 is out of range", __LINE__);
    /* another model; another scheme; too long for the session */
    refuse(t, path, MODEL ^ 1, PETREL_EINVAL, "saved for another model (model id 1234abcd5678ef01; this model is 1234abcd5678ef00)", __LINE__);
    kv_pool *q = mk_pool(KV_BF16, PP, 16, 0);
    kv_seq *u = NULL;
    CHECK(q && kv_seq_create(q, 32, &u, &err) == 0 && fill(u, 0, 6, 7) == 0);
    refuse(u, path, MODEL, PETREL_EINVAL, "holds int8 KV (k_pe 2, indexer keys 1 bytes a value); this session uses bf16", __LINE__);
    kv_seq_free(u);
    kv_pool_free(q);
    kv_seq *small = NULL;
    CHECK(kv_seq_create(p, 8, &small, &err) == 0);
    CHECK(kv_load(small, path, MODEL, 0, &err) == PETREL_ERANGE && strstr(err.msg, "holds 11 tokens; this session has room for 8"));
    kv_seq_free(small);
    /* a pool without the pages: refused, nothing taken */
    kv_pool *r = mk_pool(KV_INT8, PP, 4, 0);
    kv_seq *x = NULL;
    CHECK(r && kv_seq_create(r, 32, &x, &err) == 0 && fill(x, 0, 6, 7) == 0);
    refuse(x, path, MODEL, PETREL_ERANGE, "need 3 KV pages; the pool has 2 obtainable", __LINE__);
    kv_seq_free(x);
    kv_pool_free(r);
    /* the good file still loads (the refusals did not depend on t's state) */
    CHECK(kv_load(t, path, MODEL, 1000, &err) == 0 && t->len == 11);
    /* a save that cannot be written leaves no file */
    CHECK(kv_save(s, test_tmp("no-such-dir/x.session"), MODEL, &err) != 0);
    free(g);
    free(f);
    kv_seq_free(s);
    kv_seq_free(t);
    kv_pool_free(p);
}
