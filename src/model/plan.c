/* plan.c: what `petrel plan` adds to the memory plan (stream_plan, stream.c): the expected hit
 * rate from a usage history, this machine's speeds (probes and their cache), and the predicted
 * decode / prefill speed.
 *
 * The decode prediction follows the structure measured on GLM-5.2 slices (bench/RESULTS.md,
 * 2026-12-03 08:20): resident decode is the bytes a token reads over the memory bandwidth times
 * PLAN_RESIDENT_RATIO; streamed decode pays the head and everything before the first routing
 * serially (a token's reads can start only once it is routed), then per MoE layer its attention,
 * then max(the misses' reads + the last expert's compute, the hits' and shared expert's compute).
 * Prefill: per chunk, every matrix is read once and multiplied by the chunk's rows, so each
 * costs max(flops / kernel throughput, bytes / memory bandwidth); under a budget the experts a
 * span misses are read from the SSD while the MoE phase computes. Library code: no printing,
 * no environment; the probes run on the engine's kernel pool (kn_*). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "base/clock.h"
#include "base/err.h"
#include "base/mem.h"
#include "base/outfile.h"
#include "experts/xs.h"
#include "io/pack.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/plan.h"

/* ---------------------------------------------------------------- usage history */
static int cmp_u64_desc(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

int plan_usage_hit_rate(const char *path, int n_layers, int n_experts, int slots, double *rate, uint64_t *accesses, int *found,
                        petrel_error *err) {
    *found = 0;
    *rate = 0;
    *accesses = 0;
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT ? 0 : pt_err(err, PETREL_EIO, "usage history %s: %s", path, strerror(errno));
    int L = 0, E = 0, rc = 0;
    char line[256];
    if (!fgets(line, sizeof line, f) || sscanf(line, "# petrel-usage v1 layers=%d experts=%d", &L, &E) != 2 || L < 1 || E < 1 ||
        E > XS_MAX_EXPERTS) {
        fclose(f);
        return pt_err(err, PETREL_EFORMAT, "usage history %s: not a \"# petrel-usage v1 layers=L experts=E\" file", path);
    }
    if (L != n_layers || E != n_experts) {
        fclose(f);
        return pt_err(err, PETREL_EFORMAT, "usage history %s: %d layers x %d experts, but the model streams %d layers x %d experts", path,
                      L, E, n_layers, n_experts);
    }
    uint64_t *cnt = malloc(sizeof(uint64_t) * (size_t)E), hit = 0, all = 0;
    if (!cnt) { fclose(f); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
    for (int l = 0; l < L && !rc; l++) {
        int id;
        if (fscanf(f, "%d", &id) != 1 || id != l) rc = pt_err(err, PETREL_EFORMAT, "usage history %s: line %d is not layer %d", path, l + 2, l);
        for (int e = 0; e < E && !rc; e++) {
            unsigned long long v;
            if (fscanf(f, "%llu", &v) != 1) rc = pt_err(err, PETREL_EFORMAT, "usage history %s: layer %d has fewer than %d counts", path, l, E);
            else cnt[e] = v;
        }
        if (rc) break;
        qsort(cnt, (size_t)E, sizeof *cnt, cmp_u64_desc);
        for (int e = 0; e < E; e++) {
            all += cnt[e];
            if (e < slots) hit += cnt[e];
        }
    }
    free(cnt);
    fclose(f);
    if (rc) return rc;
    *found = 1;
    *accesses = all;
    *rate = all ? (double)hit / (double)all : 0;
    return 0;
}

/* ---------------------------------------------------------------- machine */
void plan_cpu_model(char *out, size_t n) {
    snprintf(out, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ') c++;
                c[strcspn(c, "\n")] = 0;
                snprintf(out, n, "%s", c);
            }
            break;
        }
    fclose(f);
}

/* Memory: the buffer sits in transparent huge pages like the resident weights and is read with
 * AVX-512 loads and a 4 KiB-ahead prefetch where the CPU has them, as the kernels read weights
 * (the same probe as petrel bench's floor). */
typedef struct { const uint64_t *p; size_t n; int kind; uint64_t sum; } bwjob;
#if defined(__x86_64__)
#include <immintrin.h>
/* kind 0: every other line prefetched; 1: every line; 2: every line, the thread's range read as
 * two interleaved streams (256 bytes of each in turn), as the R16 kernels read a block pair */
__attribute__((target("avx512f"))) static uint64_t bw_sum_avx512(const uint64_t *p, size_t n, int kind) {
    const int all = kind != 0, S = kind == 2 ? 2 : 1;
    const size_t per = n * 8 / (size_t)S / 256 * 256;
    __m512i a = _mm512_setzero_si512(), b = a, d = a, e = a;
    for (size_t o = 0; o < per; o += 256)
        for (int k = 0; k < S; k++) {
            const char *c = (const char *)p + (size_t)k * per + o;
            _mm_prefetch(c + 4096, _MM_HINT_T0);
            if (all) _mm_prefetch(c + 4096 + 64, _MM_HINT_T0);
            _mm_prefetch(c + 4096 + 128, _MM_HINT_T0);
            if (all) _mm_prefetch(c + 4096 + 192, _MM_HINT_T0);
            a = _mm512_add_epi64(a, _mm512_loadu_si512((const void *)c));
            b = _mm512_add_epi64(b, _mm512_loadu_si512((const void *)(c + 64)));
            d = _mm512_add_epi64(d, _mm512_loadu_si512((const void *)(c + 128)));
            e = _mm512_add_epi64(e, _mm512_loadu_si512((const void *)(c + 192)));
        }
    uint64_t lanes[8], sum = 0; /* an unsigned sum: the intrinsic's reduction adds signed (overflow) */
    _mm512_storeu_si512((void *)lanes, _mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(d, e)));
    for (int i = 0; i < 8; i++) sum += lanes[i];
    return sum;
}
#endif
static void *bw_thread(void *a) {
    bwjob *j = a;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) {
        j->sum = bw_sum_avx512(j->p, j->n, j->kind);
        return NULL;
    }
#endif
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= j->n; i += 4) { s0 += j->p[i]; s1 += j->p[i + 1]; s2 += j->p[i + 2]; s3 += j->p[i + 3]; }
    j->sum = s0 + s1 + s2 + s3;
    return NULL;
}
uint64_t plan_bw_checksum(const uint64_t *buf, size_t n, int kind) {
    bwjob j = {buf, n / 64 * 64, kind, 0};
    bw_thread(&j);
    return j.sum;
}
double plan_bw_pass(const uint64_t *buf, size_t n, int threads, int kind) {
    pthread_t th[64];
    bwjob jobs[64];
    if (threads > 64) threads = 64;
    size_t per = n / (size_t)threads / 64 * 64;
    uint64_t t0 = pt_now_ns();
    int started = 1;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (bwjob){buf + (size_t)t * per, per, kind, 0};
        if (t && pthread_create(&th[t], NULL, bw_thread, &jobs[t]) == 0) started = t + 1;
        else if (t) break;
    }
    bw_thread(&jobs[0]);
    for (int t = 1; t < started; t++) pthread_join(th[t], NULL);
    uint64_t dt = pt_now_ns() - t0;
    volatile uint64_t sink = 0;
    for (int t = 0; t < started; t++) sink += jobs[t].sum;
    (void)sink;
    return dt ? (double)(per * (size_t)started * 8) / (double)dt : 0;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double measure_mem(int threads, int mib) {
    size_t bytes = (size_t)mib << 20, n = bytes / 8;
    uint64_t *b = pt_alloc_big(bytes, 64);
    if (!b) return 0;
    for (size_t i = 0; i < n; i++) b[i] = i * 2654435761u;
    double r[7];
    for (int k = 0; k < 7; k++) r[k] = plan_bw_pass(b, n, threads, (2 + k) % 3); /* kinds 2, 0, 1, 2, ... */
    free(b);
    qsort(r, 7, sizeof r[0], cmp_double);
    return r[5]; /* the second best of 7: the bench's floor takes the median over steps of each step's best of 3 passes */
}

/* SSD: through the store's own I/O pool (xs_read_probe: io_uring, O_DIRECT, 4 whole records in
 * flight, each read as 4 concurrent pieces) over the pack's expert records at random; 16 pread
 * threads reading pieces measured about half of what the store's reads got on the virtio disk. */
double plan_ssd_probe(const petrel_engine *e, int threads, uint64_t limit, double secs) {
    (void)threads;
    const pack *pk = e->pack;
    if (!pk) return 0;
    int E = e->cfg.n_routed_experts, n = 0, cap = 4096;
    uint64_t *off = malloc(sizeof(uint64_t) * (size_t)cap), *len = malloc(sizeof(uint64_t) * (size_t)cap);
    for (int l = 0; off && len && l < e->cfg.num_hidden_layers && n < cap; l++)
        for (int x = 0; e->cfg.layer_is_moe[l] && x < E && n < cap; x++) {
            uint64_t h;
            if (pack_expert_record(pk, l, x, &off[n], &len[n], &h) == 0) n++;
        }
    double gbs = n && off && len ? xs_read_probe(pack_path(pk), off, len, n, 0, limit, secs) : 0;
    free(off), free(len);
    return gbs;
}

/* Kernels: one matrix of a routed expert's shape (q4 group-64, laid out for the int8 kernels
 * where the CPU has them) and one of attention's kind with exact f32 activations (q8 per 32), a
 * 256-row batch each (a prefill chunk's rows); GOP/s = 2 rows cols n / time, best of 3. */
static double measure_kernel(int q4, int rows, int cols, int n) {
    int gs = q4 ? 64 : 32;
    int64_t rb = q4 ? cols / 2 : cols;
    uint8_t *data = NULL;
    float *sc = malloc(sizeof(float) * (size_t)rows * (size_t)(cols / gs)), *x = malloc(sizeof(float) * (size_t)n * cols),
          *y = malloc(sizeof(float) * (size_t)n * rows);
    if (posix_memalign((void **)&data, 64, (size_t)rows * (size_t)rb) || !sc || !x || !y) {
        free(data); free(sc); free(x); free(y);
        return 0;
    }
    uint32_t s = 12345;
    for (size_t i = 0; i < (size_t)rows * (size_t)rb; i++) { s = s * 1664525u + 1013904223u; data[i] = (uint8_t)(s >> 24); }
    for (size_t i = 0; i < (size_t)rows * (size_t)(cols / gs); i++) sc[i] = 0.01f;
    for (size_t i = 0; i < (size_t)n * cols; i++) { s = s * 1664525u + 1013904223u; x[i] = (float)((int)(s >> 20) - 2048) / 2048.0f; }
    pt_wview W = {.qtype = q4 ? PT_Q4_G64 : PT_Q8_G32, .rows = rows, .cols = cols, .data = data, .row_bytes = rb, .scale = sc,
                  .scale_dtype = PT_F32, .block_rows = 1, .block_cols = gs, .scale_cols = cols / gs, .layout = PT_LAYOUT_PLAIN};
    /* the engines' default kernels (int8 activations for q4, exact f32 for q8: the attention
     * path), in a table of its own: the process default is not touched */
    kn_table t;
    if (kn_table_init(&t, NULL, 0, 0)) kn_table_init(&t, "scalar", 0, 0);
    if (q4 && kt_r16_available(&t) && kn_r16_supported(&W)) kn_r16_repack(&W);
    double best = 0;
    for (int k = 0; k < 4; k++) {
        uint64_t t0 = pt_now_ns();
        kt_matmul(&t, &W, x, n, y);
        double dt = (double)(pt_now_ns() - t0);
        double g = 2.0 * rows * cols * n / dt;
        if (k && g > best) best = g; /* the first call warms up */
    }
    free(data); free(sc); free(x); free(y);
    return best;
}

int plan_measure(const petrel_engine *e, int threads, int mem_mib, pt_machine *m, petrel_error *err) {
    memset(m, 0, sizeof *m);
    if (threads < 1) return pt_err(err, PETREL_EINVAL, "plan_measure: threads %d < 1", threads);
    plan_cpu_model(m->cpu, sizeof m->cpu);
    m->threads = threads;
    m->mem_gbs = measure_mem(threads, mem_mib > 0 ? mem_mib : 512);
    if (m->mem_gbs <= 0) return pt_err(err, PETREL_ENOMEM, "plan_measure: no memory for the %d MiB bandwidth probe", mem_mib);
    if (e && e->pack) {
        for (int k = 0; k < 2; k++) { /* the better of two short probes, as the bench takes the better of its own (a shared disk swings) */
            double g = plan_ssd_probe(e, 16, 1ull << 30, 1.5);
            if (g > m->ssd_gbs) m->ssd_gbs = g;
        }
        snprintf(m->ssd_file, sizeof m->ssd_file, "%s", pack_path(e->pack));
    }
    m->int8_gops = measure_kernel(1, 2048, 6144, 256);
    m->f32_gflops = measure_kernel(0, 2048, 6144, 256);
    m->when = (int64_t)time(NULL);
    return 0;
}

static cJSON *read_json_file(const char *path, int *missing, petrel_error *err) {
    *missing = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) { *missing = 1; return NULL; }
        pt_err(err, PETREL_EIO, "machine cache %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (!buf) { pt_err(err, PETREL_ENOMEM, "out of memory"); return NULL; }
    buf[n] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    if (!j || !cJSON_IsObject(j)) {
        cJSON_Delete(j);
        pt_err(err, PETREL_EFORMAT, "machine cache %s: not a JSON object (delete it or run --measure)", path);
        return NULL;
    }
    return j;
}

int plan_machine_load(const char *path, const char *cpu, pt_machine *m, int *found, petrel_error *err) {
    *found = 0;
    memset(m, 0, sizeof *m);
    int missing;
    cJSON *j = read_json_file(path, &missing, err);
    if (!j) return missing ? 0 : err->code;
    cJSON *o = cJSON_GetObjectItemCaseSensitive(j, cpu);
    if (cJSON_IsObject(o)) {
        cJSON *v;
        snprintf(m->cpu, sizeof m->cpu, "%s", cpu);
        /* a rate that is not positive (a hand-edited or damaged file) counts as not measured */
#define NUM(field, key) if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(o, key)) && v->valuedouble > 0 && v->valuedouble < 1e12) m->field = v->valuedouble
        NUM(mem_gbs, "mem_gbs");
        NUM(ssd_gbs, "ssd_gbs");
        NUM(int8_gops, "int8_gops");
        NUM(f32_gflops, "f32_gflops");
        if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(o, "threads")) && v->valuedouble >= 1 && v->valuedouble <= 1 << 20) m->threads = v->valueint;
        if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(o, "when"))) m->when = (int64_t)v->valuedouble;
        if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(o, "ssd_file"))) snprintf(m->ssd_file, sizeof m->ssd_file, "%s", v->valuestring);
#undef NUM
        *found = m->mem_gbs > 0;
    }
    cJSON_Delete(j);
    return 0;
}

int plan_machine_save(const char *path, const pt_machine *m, petrel_error *err) {
    int missing;
    petrel_error ig = {0};
    cJSON *j = read_json_file(path, &missing, &ig);
    if (!j) j = cJSON_CreateObject(); /* missing or unreadable: start a fresh one */
    if (!j) return pt_err(err, PETREL_ENOMEM, "out of memory");
    cJSON_DeleteItemFromObjectCaseSensitive(j, m->cpu);
    cJSON *o = cJSON_AddObjectToObject(j, m->cpu);
    if (o) {
        cJSON_AddNumberToObject(o, "threads", m->threads);
        cJSON_AddNumberToObject(o, "mem_gbs", m->mem_gbs);
        cJSON_AddNumberToObject(o, "ssd_gbs", m->ssd_gbs);
        cJSON_AddNumberToObject(o, "int8_gops", m->int8_gops);
        cJSON_AddNumberToObject(o, "f32_gflops", m->f32_gflops);
        cJSON_AddStringToObject(o, "ssd_file", m->ssd_file);
        cJSON_AddNumberToObject(o, "when", (double)m->when);
    }
    char *txt = o ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!txt) return pt_err(err, PETREL_ENOMEM, "out of memory");
    pt_outfile f;
    int rc = pt_out_open(&f, path, NULL, err);
    if (rc == 0) {
        pt_out_printf(&f, "%s\n", txt);
        rc = pt_out_commit(&f, err);
    }
    free(txt);
    return rc < 0 ? pt_err_ctx(err, "machine cache") : 0;
}

/* ---------------------------------------------------------------- prediction */
static double vb(const pt_wview *W) { return (double)pt_wview_bytes(W); }
static double velems(const pt_wview *W) { return (double)W->rows * (double)W->cols; }
/* The int8 kernels run q4 matrices, matrices laid out R16 (which an open does where the CPU has
 * VNNI, even though an inspect-only engine keeps the plain layout) and what act_quant selects. */
static int is_int8_path(const pt_wview *W) {
    return W->qtype == PT_Q4_G64 || W->layout == PT_LAYOUT_R16 || (kn_r16_available() && kn_r16_supported(W)) || kn_act_quant_active(W);
}

/* A layer's matrices without its routed experts: bytes, and flops per row on the int8 / f32 paths. */
typedef struct { double bytes, fl8, fl32; } mats;
static void add(mats *m, const pt_wview *W) {
    if (!W->rows) return;
    m->bytes += vb(W);
    if (is_int8_path(W)) m->fl8 += 2 * velems(W);
    else m->fl32 += 2 * velems(W);
}
static mats attn_mats(const petrel_config *c, const layer_w *lw) {
    mats m = {0};
    add(&m, &lw->q_a_proj); add(&m, &lw->q_b_proj); add(&m, &lw->kv_a_proj_with_mqa); add(&m, &lw->kv_b_proj); add(&m, &lw->o_proj);
    m.bytes += 4.0 * (2 * (double)c->hidden_size + c->q_lora_rank + c->kv_lora_rank);
    if (lw->has_indexer) { add(&m, &lw->idx_wq_b); add(&m, &lw->idx_wk); add(&m, &lw->idx_weights_proj); }
    return m;
}
static mats mlp_mats(const petrel_config *c, const layer_w *lw) {
    mats m = {0};
    if (!lw->is_moe) { add(&m, &lw->gate_proj); add(&m, &lw->up_proj); add(&m, &lw->down_proj); return m; }
    add(&m, &lw->router);
    m.bytes += 4.0 * c->n_routed_experts;
    if (lw->has_shared) { add(&m, &lw->sh_gate); add(&m, &lw->sh_up); add(&m, &lw->sh_down); }
    return m;
}
static mats expert_mats(const layer_w *lw) {
    mats m = {0};
    add(&m, &lw->exp_gate[0]); add(&m, &lw->exp_up[0]); add(&m, &lw->exp_down[0]);
    return m;
}

void plan_predict(const petrel_engine *e, const pt_mem_plan *p, const pt_machine *mc, double hit, int at, int prompt, pt_predict *out) {
    const petrel_config *c = &e->cfg;
    memset(out, 0, sizeof *out);
    int L = c->num_hidden_layers, K = c->num_experts_per_tok, E = c->n_routed_experts;
    double bw = mc->mem_gbs * 1e9, ssd = mc->ssd_gbs * 1e9, R = PLAN_RESIDENT_RATIO * (p->streaming ? PLAN_STREAM_RATIO : 1);
    double g8 = (mc->int8_gops > 0 ? mc->int8_gops : 1) * 1e9, g32 = (mc->f32_gflops > 0 ? mc->f32_gflops : 1) * 1e9;
    if (bw <= 0) return;
    mats head = {0};
    add(&head, &e->w.lm_head);
    out->head_bytes = head.bytes;
    /* latent KV read per layer at the decode context: f32 c + k_pe of the attended keys (at most
     * index_topk), and on the indexer's full layers past index_topk its keys of the whole context */
    int sel = at < c->index_topk ? at : c->index_topk, scoring = at > c->index_topk;
    double kv_layer = 4.0 * (c->kv_lora_rank + c->qk_rope_head_dim) * sel, idx_layer = scoring ? 4.0 * c->index_head_dim * at : 0;
    /* the arithmetic that grows with the context, at the measured f32 rate: the absorbed attention
     * core (per head and attended key: kv_lora_rank + rope dims for the score, kv_lora_rank for
     * the latent sum) and the indexer's scores (heads x head dim per key, scoring layers only) */
    double attn_flop = 0;
    for (int l = 0; l < L; l++) {
        attn_flop += 2.0 * sel * c->num_attention_heads * (2.0 * c->kv_lora_rank + c->qk_rope_head_dim);
        if (c->layer_indexer_full[l]) {
            out->kv_read_bytes += idx_layer;
            if (scoring) attn_flop += 2.0 * at * c->index_n_heads * c->index_head_dim;
        }
    }
    out->kv_read_bytes += kv_layer * L;
    out->decode_attn_ms = attn_flop / g32 * 1e3;
    int first = -1;
    for (int l = 0; l < L && first < 0; l++)
        if (c->layer_is_moe[l]) first = l;
    double serial = head.bytes, ser_ms = 0, moe_ms = 0, rec = p->record_bytes ? (double)p->record_bytes : 0;
    double miss_rate = p->streaming ? 1 - hit : 0;
    if (miss_rate < 0) miss_rate = 0;
    double total_bytes = head.bytes;
    for (int l = 0; l < L; l++) {
        const layer_w *lw = &e->w.layers[l];
        mats a = attn_mats(c, lw), m = mlp_mats(c, lw);
        double ab = a.bytes + kv_layer + (c->layer_indexer_full[l] ? idx_layer : 0);
        total_bytes += ab + m.bytes;
        if (!lw->is_moe) {
            if (first < 0 || l < first) { serial += ab + m.bytes; out->pre_bytes += a.bytes + m.bytes; }
            else moe_ms += (ab + m.bytes) / bw * R * 1e3; /* a dense layer after routing starts: no reads to overlap */
            continue;
        }
        mats x = expert_mats(lw);
        double xb = x.bytes > 0 ? x.bytes : rec;
        total_bytes += K * xb;
        out->layer_bytes += (l == first ? 0 : a.bytes) + m.bytes;
        out->expert_bytes_tok += K * xb;
        if (l == first) { serial += ab; out->pre_bytes += a.bytes; }
        else moe_ms += ab / bw * R * 1e3;
        if (!p->streaming) continue;
        double misses = K * miss_rate, io_ms = misses * (rec > 0 ? rec : xb) / (ssd > 0 ? ssd : 1) * 1e3;
        double comp_ms = (m.bytes + K * xb) / bw * R * 1e3, tail_ms = misses > 0 ? xb / bw * R * 1e3 : 0;
        out->misses_tok += misses;
        out->decode_io_ms += io_ms;
        moe_ms += io_ms + tail_ms > comp_ms ? io_ms + tail_ms : comp_ms;
    }
    if (p->streaming && p->n_store_layers > p->n_moe_main) { /* the MTP layer's bank: not run by plain decode */ }
    out->disk_bytes_tok = out->misses_tok * rec;
    ser_ms = serial / bw * R * 1e3;
    out->decode_serial_ms = p->streaming ? ser_ms : 0;
    out->decode_ms = (p->streaming ? ser_ms + moe_ms : total_bytes / bw * R * 1e3) + out->decode_attn_ms;
    if (p->streaming && ssd <= 0) out->decode_ms = 0; /* unknown without the SSD figure */
    out->decode_tok_s = out->decode_ms > 0 ? 1e3 / out->decode_ms : 0;

    /* prefill: chunks of p->chunk rows; each matrix read once per chunk */
    if (prompt < 1) prompt = 1;
    int chunk = p->chunk > 0 ? p->chunk : PT_CHUNK_RESIDENT;
    double comp = 0, moe_comp = 0, io = 0;
    for (int done = 0; done < prompt; done += chunk) {
        int T = prompt - done < chunk ? prompt - done : chunk;
        double ctx_mid = done + T / 2.0;
        for (int l = 0; l < L; l++) {
            const layer_w *lw = &e->w.layers[l];
            mats a = attn_mats(c, lw), m = mlp_mats(c, lw);
            double fa = T * (a.fl8 / g8 + a.fl32 / g32), ma = a.bytes / bw;
            /* absorbed attention over the keys so far (at most index_topk of them): scores and values
             * per head, f32; past index_topk the indexer's full layers score every key */
            double keys = ctx_mid < c->index_topk ? ctx_mid : c->index_topk;
            double att = 2.0 * T * c->num_attention_heads * (2.0 * c->kv_lora_rank + c->qk_rope_head_dim) * keys / g32;
            if (ctx_mid > c->index_topk && c->layer_indexer_full[l]) att += 2.0 * T * c->index_n_heads * c->index_head_dim * ctx_mid / g32;
            comp += (fa > ma ? fa : ma) + att;
            double fm = T * (m.fl8 / g8 + m.fl32 / g32), mm = m.bytes / bw;
            comp += fm > mm ? fm : mm;
            if (!lw->is_moe) continue;
            mats x = expert_mats(lw);
            double distinct = E * (1 - pow(1 - (double)K / E, T)); /* experts a chunk's rows touch */
            double fx = T * K * (x.fl8 / g8 + x.fl32 / g32), mx = distinct * x.bytes / bw;
            moe_comp += fx > mx ? fx : mx;
        }
    }
    if (p->streaming && ssd > 0) { /* a span reads the experts it touches and misses, overlapped with the MoE phase */
        int span = p->pf_rows > 0 ? p->pf_rows : chunk;
        for (int done = 0; done < prompt; done += span) {
            int T = prompt - done < span ? prompt - done : span;
            double distinct = E * (1 - pow(1 - (double)K / E, T)), slots = p->xs.slots_per_layer;
            double missing = distinct * (1 - slots / E);
            io += p->n_moe_main * missing * rec / ssd;
        }
    }
    out->prefill_compute_s = comp + moe_comp;
    out->prefill_io_s = io;
    double pf_s = comp + (io > moe_comp ? io : moe_comp) + head.bytes / bw; /* logits of the last row */
    out->prefill_tok_s = pf_s > 0 && (!p->streaming || ssd > 0) ? prompt / pf_s : 0;
    out->open_s = e->pack && ssd > 0 ? (double)p->resident_bytes / ssd : 0;
}
