/* test_experts.c: the expert store (group "experts"): plan arithmetic and refusals; a store over a
 * synthetic record file (random payloads with xxh64) — bytes, LRU order, pins, in-use slots,
 * O_DIRECT vs buffered and io_uring vs pread, prefetch, injected faults through the I/O seam,
 * checksum mismatch; policy eviction order and half-life adaptation on hand-made sequences;
 * traces (round trip, Belady on a textbook string, replay on the committed
 * GLM-5-like trace against the >= 90%-of-Belady target); usage-file persistence. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/clock.h"
#include "experts/xs.h"
#include "test.h"

/* ---------------------------------------------------------------- synthetic record file */
#define SL 3
#define SE 16
typedef struct synth {
    char path[512];
    uint64_t off[SL][SE], bytes[SL][SE], xxh[SL][SE];
    uint64_t max_bytes;
} synth;

static uint8_t synth_byte(int l, int e, uint64_t i) { return (uint8_t)((l * 131 + e * 31 + i * 7 + (i >> 8)) ^ (i * 2654435761u >> 13)); }

static void synth_make(synth *s, const char *name) {
    snprintf(s->path, sizeof s->path, "%s/%s", test_tmpdir(), name);
    FILE *f = fopen(s->path, "wb");
    CHECK(f != NULL);
    uint64_t off = 4096; /* a header page first, like a pack */
    uint8_t page[4096] = {0};
    fwrite(page, 1, sizeof page, f);
    s->max_bytes = 0;
    for (int l = 0; l < SL; l++)
        for (int e = 0; e < SE; e++) {
            uint64_t n = 3000 + (uint64_t)((l * SE + e) * 397 % 6000); /* not page multiples */
            /* the last two records are over 1 MiB, so io_uring reads them as several pieces;
             * the very last one ends the file mid-page (an O_DIRECT read of it comes up short
             * at EOF, which is not an error) */
            if (l == SL - 1 && e == SE - 2) n = (5u << 19) + 123;
            if (l == SL - 1 && e == SE - 1) n = (3u << 20) + 5;
            uint8_t *b = malloc(n);
            for (uint64_t i = 0; i < n; i++) b[i] = synth_byte(l, e, i);
            s->off[l][e] = off;
            s->bytes[l][e] = n;
            s->xxh[l][e] = XXH64(b, n, 0);
            fwrite(b, 1, n, f);
            uint64_t pad = l == SL - 1 && e == SE - 1 ? 0 : (4096 - n % 4096) % 4096;
            for (uint64_t i = 0; i < pad; i++) fputc(0, f);
            off += n + pad;
            if (n > s->max_bytes) s->max_bytes = n;
            free(b);
        }
    fclose(f);
}

static int synth_record(void *ctx, int l, int e, uint64_t *off, uint64_t *bytes, uint64_t *xxh, petrel_error *err) {
    (void)err;
    synth *s = ctx;
    *off = s->off[l][e];
    *bytes = s->bytes[l][e];
    *xxh = s->xxh[l][e];
    return 0;
}

static int synth_views(void *ctx, int l, int e, const uint8_t *rec, pt_wview *g, pt_wview *u, pt_wview *d, petrel_error *err) {
    (void)ctx;
    (void)err;
    g->data = rec;
    g->rows = l;
    g->cols = e;
    *u = *g;
    *d = *g;
    return 0;
}

static int bytes_ok(const synth *s, int l, int e, const xs_expert_ref *r) {
    if (r->bytes != s->bytes[l][e] || r->expert != e) return 0;
    if (r->gate.data != r->data || r->gate.rows != l || r->gate.cols != e) return 0;
    for (uint64_t i = 0; i < r->bytes; i++)
        if (r->data[i] != synth_byte(l, e, i)) return 0;
    return 1;
}

static xs_store *open_store(synth *sy, int slots, int io_mode, int backend, const xs_policy_params *pol) {
    xs_source src = {.ctx = sy, .path = sy->path, .fd = -1, .n_layers = SL, .n_experts = SE,
                     .record = synth_record, .views = synth_views};
    xs_plan_in in = {.expert_slots = slots, .record_bytes = sy->max_bytes, .n_layers = SL, .n_experts = SE, .min_slots = 1};
    xs_plan plan;
    petrel_error err = {0};
    if (xs_plan_make(&in, &plan, &err)) {
        CHECK_MSG(0, "plan: %s", err.msg);
        return NULL;
    }
    xs_store_opts o = {.io_mode = io_mode, .backend = backend};
    if (pol) o.policy = *pol;
    xs_store *st = NULL;
    if (xs_store_create(&src, &plan, &o, &st, &err)) {
        CHECK_MSG(0, "store: %s", err.msg);
        return NULL;
    }
    return st;
}

static int acq1(xs_store *st, int l, int e, xs_expert_ref *r, petrel_error *err) {
    int32_t id = e;
    return xs_acquire(st, l, &id, 1, r, err);
}

static xs_policy_params lru_params(void) {
    xs_policy_params p;
    xs_policy_defaults(&p);
    p.kind = XS_POL_LRU;
    p.pin_frac = 0;
    return p;
}

/* ---------------------------------------------------------------- plan */
TEST(experts, plan_arithmetic) {
    const uint64_t GiB = 1ull << 30, MiB = 1ull << 20;
    xs_plan_in in = {.budget = 40 * GiB, .resident_bytes = 10 * GiB, .kv_bytes = 1 * GiB, .scratch_bytes = 1 * GiB,
                     .record_bytes = 19 * MiB + 100, .n_layers = 75, .n_experts = 256, .min_slots = 8};
    xs_plan p;
    petrel_error err = {0};
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), 0);
    CHECK_EQ_INT(p.slot_bytes, 19 * MiB + 4096);
    uint64_t per = p.slot_bytes * 75;
    CHECK_EQ_INT(p.slots_per_layer, (int)((28 * GiB) / per));
    CHECK(p.slots_per_layer >= 8);
    CHECK(p.total_bytes <= in.budget);
    CHECK(p.total_bytes + per > in.budget); /* one more slot per layer would not fit */
    char buf[1024];
    xs_plan_format(&p, buf, sizeof buf);
    CHECK(strstr(buf, "resident weights") && strstr(buf, "KV cache") && strstr(buf, "expert slots") && strstr(buf, "scratch"));
    /* explicit slots that fit / do not fit */
    in.expert_slots = 4 + p.slots_per_layer / 2;
    if (in.expert_slots < 8) in.expert_slots = 8;
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), 0);
    CHECK_EQ_INT(p.slots_per_layer, in.expert_slots);
    in.expert_slots = 200;
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), PETREL_ENOMEM);
    CHECK(strstr(err.msg, "200 expert slots") != NULL);
    /* resident alone over budget */
    in.expert_slots = 0;
    in.resident_bytes = 50 * GiB;
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), PETREL_ENOMEM);
    CHECK(strstr(err.msg, "before any expert slot") != NULL);
    /* fewer than min_slots fit */
    in.resident_bytes = 10 * GiB;
    in.budget = 12 * GiB + 5 * per;
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), PETREL_ENOMEM);
    CHECK(strstr(err.msg, "need at least 8") != NULL);
    /* no budget: all resident by default, capped at n_experts */
    in.budget = 0;
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), 0);
    CHECK_EQ_INT(p.slots_per_layer, 256);
    CHECK(p.all_resident);
    in.budget = 1000 * GiB;
    CHECK_EQ_INT(xs_plan_make(&in, &p, &err), 0);
    CHECK_EQ_INT(p.slots_per_layer, 256);
}

/* ---------------------------------------------------------------- store */
TEST(experts, store_bytes_all_backends) {
    synth sy;
    synth_make(&sy, "bytes.rec");
    int modes[2] = {XS_IO_DIRECT, XS_IO_BUFFERED}, backs[2] = {XS_BACKEND_URING, XS_BACKEND_PREAD};
    int ran_direct = 0;
    for (int mi = 0; mi < 2; mi++)
        for (int bi = 0; bi < 2; bi++) {
            xs_source src = {.ctx = &sy, .path = sy.path, .fd = -1, .n_layers = SL, .n_experts = SE,
                             .record = synth_record, .views = synth_views};
            xs_plan_in in = {.expert_slots = 5, .record_bytes = sy.max_bytes, .n_layers = SL, .n_experts = SE};
            xs_plan plan;
            petrel_error err = {0};
            CHECK_EQ_INT(xs_plan_make(&in, &plan, &err), 0);
            xs_store_opts o = {.io_mode = modes[mi], .backend = backs[bi]};
            xs_store *st = NULL;
            int rc = xs_store_create(&src, &plan, &o, &st, &err);
            if (rc == PETREL_EUNSUPPORTED) { /* tmpfs: no O_DIRECT; io_uring blocked: no ring */
                fprintf(stderr, "note: experts.store_bytes_all_backends: skipped mode %d backend %d: %s\n", modes[mi],
                        backs[bi], err.msg);
                continue;
            }
            CHECK_MSG(rc == 0, "create: %s", err.msg);
            if (rc) continue;
            CHECK_EQ_INT(xs_store_direct(st), mi == 0);
            CHECK_EQ_INT(xs_store_uring(st), bi == 0);
            ran_direct += mi == 0;
            for (int l = 0; l < SL; l++) {
                int32_t ids[5] = {1, 4, 7, 10, 15};
                xs_expert_ref r[5];
                CHECK_EQ_INT(xs_acquire(st, l, ids, 5, r, &err), 0);
                for (int i = 0; i < 5; i++) CHECK_MSG(bytes_ok(&sy, l, ids[i], &r[i]), "bytes of %d/%d", l, ids[i]);
                xs_release(st, l, r, 5);
                for (int e = 0; e < SE; e++) { /* stream every expert through the bank */
                    CHECK_EQ_INT(acq1(st, l, e, r, &err), 0);
                    CHECK_MSG(bytes_ok(&sy, l, e, &r[0]), "bytes of %d/%d (stream)", l, e);
                    xs_release(st, l, r, 1);
                }
            }
            xs_stats s;
            xs_store_stats(st, &s);
            CHECK_EQ_INT(s.accesses, SL * (5 + SE));
            CHECK_EQ_INT(s.hits + s.misses, s.accesses);
            CHECK(s.bytes_read > 0 && s.read_failures == 0);
            xs_store_free(st);
        }
    if (!ran_direct) fprintf(stderr, "note: O_DIRECT not available under %s\n", test_tmpdir());
}

TEST(experts, lru_eviction_order) {
    synth sy;
    synth_make(&sy, "lru.rec");
    xs_policy_params p = lru_params();
    xs_store *st = open_store(&sy, 4, XS_IO_AUTO, XS_BACKEND_AUTO, &p);
    if (!st) return;
    petrel_error err = {0};
    xs_expert_ref r;
    for (int e = 0; e < 4; e++) {
        CHECK_EQ_INT(acq1(st, 0, e, &r, &err), 0);
        xs_release(st, 0, &r, 1);
    }
    CHECK_EQ_INT(acq1(st, 0, 0, &r, &err), 0); /* 0 becomes most recent: order 1,2,3,0 */
    xs_release(st, 0, &r, 1);
    CHECK_EQ_INT(acq1(st, 0, 9, &r, &err), 0); /* evicts 1 */
    xs_release(st, 0, &r, 1);
    CHECK_EQ_INT(xs_store_slot_of(st, 0, 1), -1);
    CHECK(xs_store_slot_of(st, 0, 0) >= 0 && xs_store_slot_of(st, 0, 2) >= 0 && xs_store_slot_of(st, 0, 9) >= 0);
    CHECK_EQ_INT(acq1(st, 0, 10, &r, &err), 0); /* evicts 2 */
    xs_release(st, 0, &r, 1);
    CHECK_EQ_INT(xs_store_slot_of(st, 0, 2), -1);
    CHECK(xs_store_slot_of(st, 0, 3) >= 0);
    /* layers are independent banks */
    CHECK_EQ_INT(xs_store_slot_of(st, 1, 0), -1);
    xs_stats s;
    xs_store_stats(st, &s);
    CHECK_EQ_INT(s.hits, 1);
    CHECK_EQ_INT(s.misses, 6);
    CHECK_EQ_INT(s.evictions, 2);
    xs_store_free(st);
}

TEST(experts, in_use_never_evicted) {
    synth sy;
    synth_make(&sy, "inuse.rec");
    xs_policy_params p = lru_params();
    xs_store *st = open_store(&sy, 4, XS_IO_AUTO, XS_BACKEND_AUTO, &p);
    if (!st) return;
    petrel_error err = {0};
    int32_t a[2] = {0, 1}, b[2] = {2, 3}, c[1] = {4}, big[5] = {5, 6, 7, 8, 9};
    xs_expert_ref ra[2], rb[2], rc[1], rbig[5];
    CHECK_EQ_INT(xs_acquire(st, 0, a, 2, ra, &err), 0);
    CHECK_EQ_INT(xs_acquire(st, 0, b, 2, rb, &err), 0);
    CHECK_EQ_INT(xs_acquire(st, 0, c, 1, rc, &err), PETREL_ERANGE); /* every slot in use */
    CHECK(strstr(err.msg, "chunks") != NULL);
    for (int i = 0; i < 2; i++) CHECK(bytes_ok(&sy, 0, a[i], &ra[i]) && bytes_ok(&sy, 0, b[i], &rb[i]));
    xs_release(st, 0, ra, 2);
    CHECK_EQ_INT(xs_acquire(st, 0, c, 1, rc, &err), 0); /* evicts 0 (LRU among unreferenced) */
    CHECK_EQ_INT(xs_store_slot_of(st, 0, 0), -1);
    CHECK(xs_store_slot_of(st, 0, 2) >= 0 && xs_store_slot_of(st, 0, 3) >= 0);
    for (int i = 0; i < 2; i++) CHECK(bytes_ok(&sy, 0, b[i], &rb[i])); /* still intact */
    xs_release(st, 0, rb, 2);
    xs_release(st, 0, rc, 1);
    CHECK_EQ_INT(xs_acquire(st, 0, big, 5, rbig, &err), PETREL_ERANGE); /* more than the bank */
    /* the failed call left nothing referenced: a full-bank acquire works */
    CHECK_EQ_INT(xs_acquire(st, 0, big, 4, rbig, &err), 0);
    for (int i = 0; i < 4; i++) CHECK(bytes_ok(&sy, 0, big[i], &rbig[i]));
    xs_release(st, 0, rbig, 4);
    xs_store_free(st);
}

TEST(experts, pins_and_usage_roundtrip) {
    synth sy;
    synth_make(&sy, "pins.rec");
    char upath[600];
    snprintf(upath, sizeof upath, "%s/model.pack", test_tmpdir());
    char ufile[700];
    xs_usage_path(upath, ufile, sizeof ufile);
    CHECK(strstr(ufile, "model.pack.petrel-usage") != NULL);
    xs_policy_params p = lru_params();
    p.pin_frac = 0.5; /* 2 of 4 slots */
    p.repin_every = 1000000;
    petrel_error err = {0};
    /* run 1: expert 7 and 11 of layer 2 are used most */
    xs_store *st = open_store(&sy, 4, XS_IO_AUTO, XS_BACKEND_AUTO, &p);
    if (!st) return;
    int loaded = -1;
    CHECK_EQ_INT(xs_usage_load(st, ufile, &loaded, &err), 0); /* missing file: fine */
    CHECK_EQ_INT(loaded, 0);
    xs_expert_ref r;
    for (int k = 0; k < 5; k++)
        for (int e = 0; e < 12; e++) {
            int ee = (e % 3 == 0) ? 7 : (e % 3 == 1 ? 11 : e);
            CHECK_EQ_INT(acq1(st, 2, ee, &r, &err), 0);
            xs_release(st, 2, &r, 1);
        }
    uint64_t u7 = xs_store_policy(st, 2)->uses[7];
    CHECK(u7 >= 20);
    CHECK_EQ_INT(xs_usage_save(st, ufile, &err), 0);
    xs_store_free(st);
    /* run 2: loads the counts, pins 7 and 11, keeps them through a stream of other experts */
    st = open_store(&sy, 4, XS_IO_AUTO, XS_BACKEND_AUTO, &p);
    if (!st) return;
    CHECK_EQ_INT(xs_usage_load(st, ufile, &loaded, &err), 0);
    CHECK_EQ_INT(loaded, 1);
    CHECK_EQ_INT(xs_store_policy(st, 2)->uses[7], u7);
    CHECK(xs_store_pinned(st, 2, 7) && xs_store_pinned(st, 2, 11));
    CHECK(!xs_store_pinned(st, 2, 0) && !xs_store_pinned(st, 0, 7));
    CHECK_EQ_INT(xs_store_warm_pins(st, &err), 0);
    CHECK(xs_store_slot_of(st, 2, 7) >= 0 && xs_store_slot_of(st, 2, 11) >= 0);
    for (int e = 0; e < SE; e++) {
        if (e == 7 || e == 11) continue;
        CHECK_EQ_INT(acq1(st, 2, e, &r, &err), 0);
        CHECK(bytes_ok(&sy, 2, e, &r));
        xs_release(st, 2, &r, 1);
        CHECK(xs_store_slot_of(st, 2, 7) >= 0 && xs_store_slot_of(st, 2, 11) >= 0);
    }
    xs_stats s;
    xs_store_stats(st, &s);
    CHECK_EQ_INT(s.prefetch_issued, 2);
    xs_store_free(st);
    /* malformed or mismatched files are reported, never fatal */
    FILE *f = fopen(ufile, "w");
    fprintf(f, "# petrel-usage v1 layers=3 experts=16\n0 1 2 x\n");
    fclose(f);
    st = open_store(&sy, 4, XS_IO_AUTO, XS_BACKEND_AUTO, &p);
    if (!st) return;
    CHECK_EQ_INT(xs_usage_load(st, ufile, &loaded, &err), PETREL_EFORMAT);
    CHECK_EQ_INT(loaded, 0);
    CHECK_EQ_INT(acq1(st, 0, 3, &r, &err), 0);
    xs_release(st, 0, &r, 1);
    xs_store_free(st);
}

TEST(experts, prefetch_hits) {
    synth sy;
    synth_make(&sy, "prefetch.rec");
    xs_store *st = open_store(&sy, 6, XS_IO_AUTO, XS_BACKEND_AUTO, NULL);
    if (!st) return;
    petrel_error err = {0};
    int32_t ids[3] = {3, 5, 8};
    CHECK_EQ_INT(xs_prefetch(st, 1, ids, 3), 3);
    CHECK_EQ_INT(xs_prefetch(st, 1, ids, 3), 0); /* already there or in flight */
    xs_expert_ref r[3];
    CHECK_EQ_INT(xs_acquire(st, 1, ids, 3, r, &err), 0); /* may still be loading: waits */
    for (int i = 0; i < 3; i++) CHECK(bytes_ok(&sy, 1, ids[i], &r[i]));
    xs_release(st, 1, r, 3);
    int32_t more[6] = {0, 1, 2, 4, 6, 7};
    CHECK_EQ_INT(xs_prefetch(st, 1, more, 6), 6);
    xs_store_drain(st);
    xs_stats s;
    xs_store_stats(st, &s);
    CHECK_EQ_INT(s.hits, 3);
    CHECK_EQ_INT(s.misses, 0);
    CHECK_EQ_INT(s.prefetch_issued, 9);
    CHECK_EQ_INT(s.prefetch_used, 3);
    CHECK_EQ_INT(s.prefetch_wasted, 0); /* the second hint evicted 3, 5, 8 (used, not wasted) */
    CHECK_EQ_INT(xs_store_slot_of(st, 1, 3), -1);
    /* the bank now holds six pending hints: another hint evicts none of them */
    int32_t late[2] = {10, 11};
    CHECK_EQ_INT(xs_prefetch(st, 1, late, 2), 0);
    CHECK(xs_store_slot_of(st, 1, 0) >= 0 && xs_store_slot_of(st, 1, 7) >= 0);
    xs_expert_ref r9;
    CHECK_EQ_INT(acq1(st, 1, 9, &r9, &err), 0); /* demand does evict an unused prefetched expert */
    xs_release(st, 1, &r9, 1);
    xs_store_stats(st, &s);
    CHECK_EQ_INT(s.prefetch_wasted, 1);
    CHECK_EQ_INT(s.prefetch_issued, 9);
    /* once used, a hint's expert is ordinary and a later hint may take its slot */
    xs_expert_ref r0;
    CHECK_EQ_INT(acq1(st, 1, 0, &r0, &err), 0);
    xs_release(st, 1, &r0, 1);
    CHECK_EQ_INT(xs_prefetch(st, 1, late, 1), 1);
    xs_store_drain(st);
    char line[512];
    xs_store_note_tokens(st, 1);
    xs_stats_format(&s, line, sizeof line);
    CHECK(strstr(line, "hit") != NULL);
    xs_store_free(st);
}

/* ---------------------------------------------------------------- faults */
typedef struct fault_plan {
    int layer, expert;
    int kind, fail_attempts; /* attempts < fail_attempts are faulted */
    uint64_t short_bytes, delay_ns;
    int calls;
} fault_plan;

static void fault_fn(void *ctx, int layer, int expert, int attempt, xs_fault *f) {
    fault_plan *fp = ctx;
    if (layer != fp->layer || expert != fp->expert) return;
    fp->calls++;
    if (attempt < fp->fail_attempts) {
        f->kind = fp->kind;
        f->short_bytes = fp->short_bytes;
    }
    f->delay_ns = fp->delay_ns;
}

TEST(experts, faults_injected) {
    synth sy;
    synth_make(&sy, "faults.rec");
    int backs[2] = {XS_BACKEND_URING, XS_BACKEND_PREAD};
    for (int bi = 0; bi < 2; bi++) {
        xs_source src = {.ctx = &sy, .path = sy.path, .fd = -1, .n_layers = SL, .n_experts = SE,
                         .record = synth_record, .views = synth_views};
        xs_plan_in in = {.expert_slots = 4, .record_bytes = sy.max_bytes, .n_layers = SL, .n_experts = SE};
        xs_plan plan;
        petrel_error err = {0};
        CHECK_EQ_INT(xs_plan_make(&in, &plan, &err), 0);
        xs_store_opts o = {.backend = backs[bi], .retries = 2};
        xs_store *st = NULL;
        if (xs_store_create(&src, &plan, &o, &st, &err) == PETREL_EUNSUPPORTED) continue;
        CHECK(st != NULL);
        if (!st) return;
        fault_plan fp = {.layer = 1, .expert = 3, .kind = XS_FAULT_ERROR, .fail_attempts = 100};
        xs_io_fault_ctx = &fp;
        xs_io_fault_hook = fault_fn;
        int32_t ids[3] = {2, 3, 4};
        xs_expert_ref r[4];
        /* error on every attempt: fails after 1 + 2 retries, clear message, nothing stale */
        CHECK_EQ_INT(xs_acquire(st, 1, ids, 3, r, &err), PETREL_EIO);
        CHECK_MSG(strstr(err.msg, "layer 1 expert 3: read failed") != NULL, "msg: %s", err.msg);
        CHECK_EQ_INT(fp.calls, 3);
        CHECK_EQ_INT(xs_store_slot_of(st, 1, 3), -1);
        /* short read on every attempt */
        fp.kind = XS_FAULT_SHORT;
        fp.short_bytes = 100;
        CHECK_EQ_INT(xs_acquire(st, 1, ids, 3, r, &err), PETREL_EIO);
        CHECK_MSG(strstr(err.msg, "layer 1 expert 3: short read") && strstr(err.msg, "100 of"), "msg: %s", err.msg);
        /* short read once: the retry succeeds */
        fp.fail_attempts = 1;
        fp.calls = 0;
        CHECK_EQ_INT(xs_acquire(st, 1, ids, 3, r, &err), 0);
        CHECK_EQ_INT(fp.calls, 2);
        for (int i = 0; i < 3; i++) CHECK(bytes_ok(&sy, 1, ids[i], &r[i]));
        xs_release(st, 1, r, 3);
        /* delay: the read completes and the wait is measured */
        fp.expert = 9;
        fp.fail_attempts = 0;
        fp.delay_ns = 30 * 1000 * 1000;
        xs_stats s0, s1;
        xs_store_stats(st, &s0);
        CHECK_EQ_INT(acq1(st, 1, 9, r, &err), 0);
        CHECK(bytes_ok(&sy, 1, 9, &r[0]));
        xs_release(st, 1, r, 1);
        xs_store_stats(st, &s1);
        CHECK(s1.io_wait_ns - s0.io_wait_ns >= 20 * 1000 * 1000);
        /* a failing prefetch frees its slot silently */
        fp.expert = 12;
        fp.kind = XS_FAULT_ERROR;
        fp.fail_attempts = 100;
        fp.delay_ns = 0;
        int32_t pf = 12;
        CHECK_EQ_INT(xs_prefetch(st, 1, &pf, 1), 1);
        xs_store_drain(st);
        CHECK_EQ_INT(xs_store_slot_of(st, 1, 12), -1);
        xs_io_fault_hook = NULL;
        xs_io_fault_ctx = NULL;
        /* the store is fully usable: a whole bank of fresh experts */
        int32_t four[4] = {12, 13, 14, 15};
        CHECK_EQ_INT(xs_acquire(st, 1, four, 4, r, &err), 0);
        for (int i = 0; i < 4; i++) CHECK(bytes_ok(&sy, 1, four[i], &r[i]));
        xs_release(st, 1, r, 4);
        xs_store_stats(st, &s1);
        CHECK(s1.read_failures >= 3 && s1.read_retries >= 5);
        xs_store_free(st);
    }
}

/* Once a layer's routing is known, queued wrong guesses are dropped; reads that started land.
 * One read in flight (depth 1, one pread thread) held 50 ms by the fault seam keeps the rest
 * queued. Also: xs_store_state and its queue order, the disk-busy clock. */
TEST(experts, prefetch_cancel) {
    synth sy;
    synth_make(&sy, "cancel.rec");
    int backs[2] = {XS_BACKEND_URING, XS_BACKEND_PREAD};
    for (int bi = 0; bi < 2; bi++) {
        xs_source src = {.ctx = &sy, .path = sy.path, .fd = -1, .n_layers = SL, .n_experts = SE,
                         .record = synth_record, .views = synth_views};
        xs_plan_in in = {.expert_slots = 6, .record_bytes = sy.max_bytes, .n_layers = SL, .n_experts = SE};
        xs_plan plan;
        petrel_error err = {0};
        CHECK_EQ_INT(xs_plan_make(&in, &plan, &err), 0);
        xs_store_opts o = {.backend = backs[bi], .io_threads = 1, .io_depth = 1};
        xs_store *st = NULL;
        if (xs_store_create(&src, &plan, &o, &st, &err) == PETREL_EUNSUPPORTED) continue;
        CHECK(st != NULL);
        if (!st) return;
        fault_plan fp = {.layer = 1, .expert = 0, .delay_ns = 50 * 1000 * 1000};
        xs_io_fault_ctx = &fp;
        xs_io_fault_hook = fault_fn;
        int32_t ids[4] = {0, 1, 2, 3};
        CHECK_EQ_INT(xs_prefetch(st, 1, ids, 4), 4);
        uint64_t q0 = 0, q1 = 0;
        CHECK_EQ_INT(xs_store_state(st, 1, 0, &q0), XS_LOADING);
        CHECK_EQ_INT(xs_store_state(st, 1, 1, &q1), XS_LOADING);
        CHECK(q0 < q1);
        CHECK_EQ_INT(xs_store_state(st, 1, 5, NULL), XS_ABSENT);
        uint8_t keep[SE] = {0};
        keep[0] = keep[1] = 1;
        CHECK_EQ_INT(xs_cancel_prefetches(st, 1, keep), 2); /* 2 and 3 had not started */
        CHECK_EQ_INT(xs_store_state(st, 1, 2, NULL), XS_ABSENT);
        CHECK_EQ_INT(xs_store_state(st, 1, 3, NULL), XS_ABSENT);
        xs_store_drain(st);
        xs_io_fault_hook = NULL;
        xs_io_fault_ctx = NULL;
        CHECK_EQ_INT(xs_store_state(st, 1, 0, NULL), XS_READY);
        CHECK_EQ_INT(xs_store_state(st, 1, 1, NULL), XS_READY);
        CHECK_EQ_INT(xs_cancel_prefetches(st, 1, keep), 0); /* nothing queued any more */
        /* the freed slots are usable, and the kept guesses are hits */
        int32_t four[4] = {0, 1, 2, 3};
        xs_expert_ref r[4];
        CHECK_EQ_INT(xs_acquire(st, 1, four, 4, r, &err), 0);
        for (int i = 0; i < 4; i++) CHECK(bytes_ok(&sy, 1, four[i], &r[i]));
        xs_release(st, 1, r, 4);
        xs_stats s;
        xs_store_stats(st, &s);
        CHECK_EQ_INT(s.prefetch_cancelled, 2);
        CHECK_EQ_INT(s.prefetch_used, 2);
        CHECK_EQ_INT(s.hits, 2);
        CHECK_EQ_INT(s.misses, 2);
        CHECK(s.io_busy_ns > 0);
        xs_store_free(st);
    }
}

TEST(experts, checksum_mismatch) {
    synth sy;
    synth_make(&sy, "corrupt.rec");
    int fd = open(sy.path, O_RDWR);
    CHECK(fd >= 0);
    uint64_t at = sy.off[0][2] + sy.bytes[0][2] / 2;
    uint8_t b;
    CHECK_EQ_INT(pread(fd, &b, 1, (off_t)at), 1);
    b ^= 0x20;
    CHECK_EQ_INT(pwrite(fd, &b, 1, (off_t)at), 1);
    fsync(fd);
    close(fd);
    xs_store *st = open_store(&sy, 4, XS_IO_AUTO, XS_BACKEND_AUTO, NULL);
    if (!st) return;
    petrel_error err = {0};
    xs_expert_ref r;
    CHECK_EQ_INT(acq1(st, 0, 2, &r, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "layer 0 expert 2: checksum mismatch") != NULL, "msg: %s", err.msg);
    CHECK_EQ_INT(xs_store_slot_of(st, 0, 2), -1);
    CHECK_EQ_INT(acq1(st, 0, 1, &r, &err), 0);
    CHECK(bytes_ok(&sy, 0, 1, &r));
    xs_release(st, 0, &r, 1);
    xs_stats s;
    xs_store_stats(st, &s);
    CHECK_EQ_INT(s.checksum_failures, 1);
    xs_store_free(st);
}

/* ---------------------------------------------------------------- traces */
/* One access of a bare policy: begin, then every expert of the access. */
static void pol_access(xs_pol *p, const int *ids, int n) {
    xs_pol_begin(p);
    for (int i = 0; i < n; i++) xs_pol_use(p, ids[i]);
}

TEST(experts, policy_freq_eviction_order) {
    /* Hand-made sequence, one expert per access: 0 0 0 1 2. Decayed counts: 0 ~3 uses, 1 and 2
     * one each (2 the more recent). FREQ/ADAPT evict 1 (lowest count, then least recent) before
     * 2 before 0; LRU evicts 0 (least recent) first; a tiny half-life turns FREQ into LRU. */
    int seq[5] = {0, 0, 0, 1, 2};
    int kinds[3] = {XS_POL_FREQ, XS_POL_ADAPT, XS_POL_LRU};
    for (int ki = 0; ki < 3; ki++) {
        xs_policy_params prm;
        xs_policy_defaults(&prm);
        prm.kind = kinds[ki];
        prm.pin_frac = 0;
        xs_pol p;
        CHECK_EQ_INT(xs_pol_init(&p, 8, 2, &prm), 0);
        for (int i = 0; i < 5; i++) pol_access(&p, &seq[i], 1);
        if (kinds[ki] == XS_POL_LRU) {
            CHECK(xs_pol_evict_before(&p, 0, 1) && xs_pol_evict_before(&p, 1, 2));
        } else {
            CHECK(xs_pol_evict_before(&p, 1, 2) && xs_pol_evict_before(&p, 2, 0));
            CHECK(!xs_pol_evict_before(&p, 0, 1) && !xs_pol_evict_before(&p, 0, 2));
        }
        CHECK(!xs_pol_evict_before(&p, 1, 1));
        xs_pol_deinit(&p);
    }
    xs_policy_params prm;
    xs_policy_defaults(&prm);
    prm.kind = XS_POL_FREQ;
    prm.halflife = 0.25; /* each access weighs 16x the one before: recency decides */
    prm.pin_frac = 0;
    xs_pol p;
    CHECK_EQ_INT(xs_pol_init(&p, 8, 2, &prm), 0);
    for (int i = 0; i < 5; i++) pol_access(&p, &seq[i], 1);
    CHECK(xs_pol_evict_before(&p, 0, 1) && xs_pol_evict_before(&p, 1, 2));
    xs_pol_deinit(&p);
}

TEST(experts, policy_adapt_picks_halflife) {
    /* ADAPT's shadows pick the half-life by their own hit rates. (a) The working set jumps every
     * 48 accesses between 4 disjoint pairs (0 1 / 2 3 / 4 5 / 6 7, each pair alternating): old
     * counts are stale at once, so a short half-life must win. (b) A fixed skewed popularity
     * (16 experts, P(e) ~ 1/(e+1), drawn by a fixed LCG), 4 slots: nothing drifts, so the longest
     * half-lives estimate the popularity best. The chosen half-life drives the eviction order. */
    xs_policy_params prm;
    xs_policy_defaults(&prm);
    prm.pin_frac = 0;
    CHECK_EQ_INT(prm.kind, XS_POL_ADAPT);
    xs_pol p;
    CHECK_EQ_INT(xs_pol_init(&p, 8, 2, &prm), 0);
    CHECK(xs_pol_halflife(&p) == prm.halflife);
    for (int i = 0; i < 48 * 40; i++) {
        int e = ((i / 48) % 4) * 2 + (i & 1);
        pol_access(&p, &e, 1);
    }
    CHECK_MSG(xs_pol_halflife(&p) <= 32, "half-life %g", xs_pol_halflife(&p));
    xs_pol_deinit(&p);
    CHECK_EQ_INT(xs_pol_init(&p, 16, 4, &prm), 0);
    uint32_t x = 12345;
    for (int i = 0; i < 8000; i++) {
        x = x * 1664525u + 1013904223u;
        double u = (x >> 8) / 16777216.0 * 3.3807; /* H(16) = sum 1/(e+1): P(e) ~ 1/(e+1) */
        int e = 0;
        while (e < 15 && (u -= 1.0 / (e + 1)) > 0) e++;
        pol_access(&p, &e, 1);
    }
    CHECK_MSG(xs_pol_halflife(&p) >= 128, "half-life %g", xs_pol_halflife(&p));
    xs_pol_deinit(&p);
}

TEST(experts, trace_roundtrip) {
    xs_trace t, u;
    petrel_error err = {0};
    CHECK_EQ_INT(xs_trace_init(&t, 2, 10, 3), 0);
    int32_t a[3] = {7, 1, 4}, b[3] = {0, 9, 2};
    CHECK_EQ_INT(xs_trace_add(&t, 0, 0, a, 3, &err), 0);
    CHECK_EQ_INT(xs_trace_add(&t, 0, 1, b, 3, &err), 0);
    CHECK_EQ_INT(xs_trace_add(&t, 1, 1, a, 3, &err), 0);
    CHECK(xs_trace_add(&t, 5, 0, a, 3, &err) != 0);
    char path[600];
    snprintf(path, sizeof path, "%s/t.txt", test_tmpdir());
    CHECK_EQ_INT(xs_trace_write(&t, path, &err), 0);
    CHECK_EQ_INT(xs_trace_read(&u, path, &err), 0);
    CHECK_EQ_INT(u.n_tokens, 2);
    CHECK_EQ_INT(u.n_layers, 2);
    CHECK(memcmp(t.ids, u.ids, sizeof(int16_t) * 2 * 2 * 3) == 0);
    CHECK_EQ_INT(u.ids[0], 1); /* ascending */
    xs_trace_deinit(&u);
    FILE *f = fopen(path, "w");
    fprintf(f, "# petrel-trace v1 layers=2 experts=10 topk=3 tokens=2\n0 0 1 2 99\n");
    fclose(f);
    CHECK_EQ_INT(xs_trace_read(&u, path, &err), PETREL_EFORMAT);
    CHECK(strstr(err.msg, ":2:") != NULL);
    xs_trace_deinit(&t);
}

/* Traces are outside input (bench --route-trace / --trace, plan --route-trace): a header may ask
 * for any top-k or size, a line may hold any count of numbers. */
TEST(experts, trace_read_hostile) {
    char path[600];
    snprintf(path, sizeof path, "%s/hostile.txt", test_tmpdir());
    petrel_error err = {0};
    xs_trace u;
    /* top-k wider than any fixed line buffer: a full line is read, one number more is refused */
    FILE *f = fopen(path, "w");
    fprintf(f, "# petrel-trace v1 layers=1 experts=300 topk=100 tokens=1\n0 0");
    for (int e = 0; e < 100; e++) fprintf(f, " %d", e * 3);
    fprintf(f, "\n");
    fclose(f);
    CHECK_MSG(xs_trace_read(&u, path, &err) == 0, "%s", err.msg);
    CHECK(u.ids && u.ids[99] == 297);
    xs_trace_deinit(&u);
    f = fopen(path, "w");
    fprintf(f, "# petrel-trace v1 layers=1 experts=300 topk=100 tokens=1\n0 0");
    for (int e = 0; e < 101; e++) fprintf(f, " %d", e);
    fprintf(f, "\n");
    fclose(f);
    CHECK_EQ_INT(xs_trace_read(&u, path, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, ":2:") != NULL, "%s", err.msg);
    /* sizes that do not fit: refused by the header, nothing allocated for them */
    static const char *big[] = {"layers=100000000 experts=32767 topk=32767 tokens=100000000",
                                "layers=75 experts=256 topk=8 tokens=100000000", "layers=4096 experts=30000 topk=30000 tokens=4"};
    for (int i = 0; i < 3; i++) {
        f = fopen(path, "w");
        fprintf(f, "# petrel-trace v1 %s\n0 0 1\n", big[i]);
        fclose(f);
        CHECK_EQ_INT(xs_trace_read(&u, path, &err), PETREL_EFORMAT);
        CHECK_MSG(strstr(err.msg, "entries") != NULL, "%s: %s", big[i], err.msg);
        CHECK(u.ids == NULL);
    }
    /* a header of many layers and few tokens: room for its tokens only (the fuzzer's 194-byte file of
     * 6666662 layers and 3 tokens once asked for 256 tokens' room, 10 GB) */
    f = fopen(path, "w");
    fprintf(f, "# petrel-trace v1 layers=100000 experts=10 topk=2 tokens=3\n0 0 1 2\n1 99999 3\n2 5 4 9\n");
    fclose(f);
    CHECK_MSG(xs_trace_read(&u, path, &err) == 0, "%s", err.msg);
    CHECK_MSG(u.n_tokens == 3 && u.cap_tokens == 3, "tokens %d, room for %d", u.n_tokens, u.cap_tokens);
    CHECK(u.ids && u.ids[((size_t)1 * 100000 + 99999) * 2] == 3 && u.ids[((size_t)2 * 100000 + 5) * 2 + 1] == 9);
    xs_trace_deinit(&u);
    /* refused with one line naming it, nothing kept: a header promising more tokens than the lines
     * hold (it once sized the allocation: 77 M tokens filled 537 MB for a two-line file), a line
     * that jumps ahead of token order, a (token, layer) listed twice */
    static const char *bad[][3] = {
        {"# petrel-trace v1 layers=2 experts=10 topk=1 tokens=77777729\n0 0 9\n0 1 2\n", "tokens=77777729", "end at token 0"},
        {"# petrel-trace v1 layers=1 experts=10 topk=1 tokens=3000000\n0 0 9\n2999999 0 1\n", ":3:", "token order"},
        {"# petrel-trace v1 layers=1 experts=8 topk=3 tokens=1\n0 0 1 2 3\n0 0 5\n", ":3:", "twice"},
        {"# petrel-trace v1 layers=1 experts=8 topk=3 tokens=5\n# only a comment\n", "tokens=5", "no line follows"}};
    for (int i = 0; i < 4; i++) {
        f = fopen(path, "w");
        fputs(bad[i][0], f);
        fclose(f);
        CHECK_EQ_INT(xs_trace_read(&u, path, &err), PETREL_EFORMAT);
        CHECK_MSG(strstr(err.msg, bad[i][1]) && strstr(err.msg, bad[i][2]), "%s", err.msg);
        CHECK(u.ids == NULL);
    }
    /* an empty file, and gzip data damaged in the middle: one line each, nothing kept */
    f = fopen(path, "w");
    fclose(f);
    CHECK_EQ_INT(xs_trace_read(&u, path, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "line 1") != NULL, "%s", err.msg);
    char gz[700], cmd[1500];
    snprintf(gz, sizeof gz, "%s/hostile.txt.gz", test_tmpdir());
    f = fopen(path, "w");
    fprintf(f, "# petrel-trace v1 layers=2 experts=64 topk=2 tokens=4000\n");
    for (int tok = 0; tok < 4000; tok++)
        for (int l = 0; l < 2; l++) fprintf(f, "%d %d %d %d\n", tok, l, (tok * 7 + l) % 32, 32 + (tok * 13 + l) % 32);
    fclose(f);
    snprintf(cmd, sizeof cmd, "gzip -c '%s' > '%s'", path, gz);
    CHECK(system(cmd) == 0);
    CHECK_MSG(xs_trace_read(&u, gz, &err) == 0, "%s", err.msg);
    CHECK(u.ids && u.n_tokens == 4000 && u.ids[(3999 * 2 + 1) * 2 + 1] == 32 + (3999 * 13 + 1) % 32);
    xs_trace_deinit(&u);
    f = fopen(gz, "r+b");
    CHECK(f && fseek(f, 0, SEEK_END) == 0);
    long sz = f ? ftell(f) : 0;
    if (f) {
        fseek(f, sz / 2, SEEK_SET);
        for (int i = 0; i < 64; i++) fputc(0x55 ^ i, f);
        fclose(f);
    }
    CHECK_EQ_INT(xs_trace_read(&u, gz, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "hostile.txt.gz") != NULL && !strchr(err.msg, '\n'), "%s", err.msg);
    CHECK(u.ids == NULL);
}

TEST(experts, belady_textbook) {
    /* The classic reference string with 3 frames: OPT 9 faults, LRU 12 (of 20). */
    int ref[20] = {7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1};
    xs_trace t;
    petrel_error err = {0};
    CHECK_EQ_INT(xs_trace_init(&t, 1, 8, 1), 0);
    for (int i = 0; i < 20; i++) {
        int32_t e = ref[i];
        CHECK_EQ_INT(xs_trace_add(&t, i, 0, &e, 1, &err), 0);
    }
    xs_replay_stats st;
    xs_policy_params p = lru_params();
    CHECK_EQ_INT(xs_trace_replay(&t, &p, 3, &st, &err), 0);
    CHECK_EQ_INT(st.accesses, 20);
    CHECK_EQ_INT(st.belady_hits, 11);
    CHECK_EQ_INT(st.lru_hits, 8);
    CHECK_EQ_INT(st.policy_hits, 8); /* the store's policy in LRU mode is LRU */
    CHECK(xs_trace_replay(&t, &p, 0, &st, &err) != 0);
    xs_trace_deinit(&t);
}

TEST(experts, replay_glm5_trace_vs_belady) {
    char txt[600], cmd[1400];
    snprintf(txt, sizeof txt, "%s/glm5-like-2048.txt", test_tmpdir());
    snprintf(cmd, sizeof cmd, "gzip -dc '%s' > '%s'", test_data("traces/glm5-like-2048.txt.gz"), txt);
    if (system(cmd) != 0) {
        CHECK_MSG(0, "could not gunzip the trace: %s", cmd);
        return;
    }
    xs_trace t, z;
    petrel_error err = {0};
    CHECK_MSG(xs_trace_read(&t, txt, &err) == 0, "%s", err.msg);
    if (!t.ids) return;
    /* the .gz itself reads as the same trace (zlib) */
    CHECK_MSG(xs_trace_read(&z, test_data("traces/glm5-like-2048.txt.gz"), &err) == 0, "%s", err.msg);
    CHECK(z.ids && z.n_tokens == t.n_tokens && z.n_layers == t.n_layers && z.topk == t.topk &&
          !memcmp(z.ids, t.ids, sizeof(int16_t) * (size_t)t.n_tokens * t.n_layers * t.topk));
    xs_trace_deinit(&z);
    CHECK_EQ_INT(t.n_layers, 75);
    CHECK_EQ_INT(t.n_experts, 256);
    CHECK_EQ_INT(t.n_tokens, 2048);
    xs_policy_params p;
    xs_policy_defaults(&p);
    xs_replay_stats st;
    /* The stated target: >= 90% of Belady's hits at 96 of 256 slots per layer (default policy,
     * measured 0.916). At 16 and 32 slots no online policy reaches 90% on this trace family
     * (bench/POLICY.md: even an oracle of the true routing distribution gets ~0.82/0.86); the
     * default measures 0.802 and 0.831 there, the old fixed half-life 128 + 25% pins 0.786/0.824. */
    CHECK_EQ_INT(xs_trace_replay(&t, &p, 96, &st, &err), 0);
    CHECK_EQ_INT(st.accesses, 2048ull * 75 * 8);
    CHECK_MSG(st.policy_vs_belady >= 0.90, "policy %.4f belady %.4f ratio %.4f", st.policy_rate, st.belady_rate,
              st.policy_vs_belady);
    CHECK(st.policy_hits > st.lru_hits && st.belady_hits >= st.policy_hits);
    if (getenv("PETREL_TEST_VERBOSE"))
        fprintf(stderr, "replay cap 96: policy %.4f lru %.4f belady %.4f (policy/belady %.4f)\n", st.policy_rate,
                st.lru_rate, st.belady_rate, st.policy_vs_belady);
    CHECK_EQ_INT(xs_trace_replay(&t, &p, 16, &st, &err), 0);
    CHECK_MSG(st.policy_vs_belady >= 0.795, "cap 16: policy %.4f belady %.4f ratio %.4f", st.policy_rate,
              st.belady_rate, st.policy_vs_belady);
    CHECK(st.policy_hits > st.lru_hits && st.belady_hits >= st.policy_hits);
    xs_trace_deinit(&t);
}

/* Replay with a usage history: NULL is the cold replay; a history of another shape is refused;
 * a history counts into the policy (a replay of a trace with itself as history is no worse). */
TEST(experts, replay_with_history) {
    xs_trace t, h, bad;
    petrel_error err = {0};
    CHECK(xs_trace_init(&t, 2, 32, 4) == 0 && xs_trace_init(&h, 2, 32, 4) == 0 && xs_trace_init(&bad, 3, 32, 4) == 0);
    uint64_t x = 7;
    for (int tok = 0; tok < 200; tok++)
        for (int l = 0; l < 2; l++) {
            int32_t ids[4];
            for (int k = 0; k < 4; k++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                ids[k] = (int32_t)((x >> 33) % (k < 2 ? 6 : 32)); /* two popular choices, two spread */
                for (int q = 0; q < k; q++)
                    if (ids[q] == ids[k]) { ids[k] = (ids[k] + 1 + k) % 32; q = -1; }
            }
            CHECK(xs_trace_add(&t, tok, l, ids, 4, &err) == 0);
            CHECK(xs_trace_add(&h, tok, l, ids, 4, &err) == 0);
        }
    xs_policy_params prm;
    xs_policy_defaults(&prm);
    xs_replay_stats a, b, c;
    CHECK(xs_trace_replay(&t, &prm, 8, &a, &err) == 0);
    CHECK(xs_trace_replay_hist(&t, NULL, &prm, 8, &b, &err) == 0);
    CHECK(a.policy_hits == b.policy_hits && a.belady_hits == b.belady_hits);
    CHECK(xs_trace_replay_hist(&t, &h, &prm, 8, &c, &err) == 0);
    CHECK(c.policy_hits + c.accesses / 100 >= a.policy_hits); /* no worse than cold (within 1 %) */
    CHECK_EQ_INT(xs_trace_replay_hist(&t, &bad, &prm, 8, &c, &err), PETREL_EINVAL);
    xs_trace_deinit(&t);
    xs_trace_deinit(&h);
    xs_trace_deinit(&bad);
}

/* the disk probe through the store's I/O pool: reads the records it is given (GB/s > 0 and
 * bounded by its limit), and a record it cannot read makes it report 0, not a figure */
TEST(experts, read_probe) {
    char path[600];
    snprintf(path, sizeof path, "%s/probe.bin", test_tmpdir());
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f) return;
    static uint8_t block[1 << 20];
    for (size_t i = 0; i < sizeof block; i++) block[i] = (uint8_t)(i * 31 + 7);
    for (int i = 0; i < 8; i++) CHECK(fwrite(block, 1, sizeof block, f) == sizeof block);
    fclose(f);
    uint64_t off[4] = {0, 2u << 20, 4u << 20, 6u << 20}, len[4] = {2u << 20, 2u << 20, 2u << 20, 2u << 20};
    uint64_t t0 = pt_now_ns();
    double g = xs_read_probe(path, off, len, 4, 0, 64u << 20, 5.0);
    CHECK_MSG(g > 0, "probe of a readable file: %.3f GB/s", g);
    CHECK_MSG(pt_now_ns() - t0 < 5000000000ull, "the probe ran past its byte limit's time");
    uint64_t bad_off[1] = {1ull << 30}; /* past the end: the read comes up short */
    CHECK_EQ_INT(xs_read_probe(path, bad_off, len, 1, 0, 8u << 20, 2.0) > 0, 0);
    CHECK_EQ_INT(xs_read_probe("/nonexistent/probe.bin", off, len, 4, 0, 8u << 20, 1.0) > 0, 0);
}
