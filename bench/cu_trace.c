/* cu_trace.c: where a GPU decode step's time goes, on the GPU's own clock. CUPTI's activity
 * records give every kernel's start and end, those replayed from the step's CUDA graph included
 * (ncu times each launch alone with its caches flushed; the profile of `petrel bench` puts events
 * between parts and so runs without the graph, PDL or the side stream). Built by `make cuda`
 * (build/cu_trace); run on the accelerator machine:
 *
 *   cu_trace MODEL [PROMPT [STEPS]]
 *
 * opens MODEL on cuda:0, reads a PROMPT-token prompt (default 2048: DSA selects past index_topk)
 * and decodes STEPS tokens (default 8), then prints the last step's kernels in start order: start
 * (us from the step's first kernel), duration, how far it moves the step's end past every kernel
 * started before it (its share of the span: with programmatic dependent launch a kernel starts
 * early and waits, so durations overlap), the idle gap before it (no kernel of the step running),
 * CUDA stream and name; then the step's span, its busy and idle time, the last step's API call
 * (its host <-> device copies, and its wall time split into before the first copy or kernel, the
 * kernels, after the last), every step's call wall time (min / median / max: what `petrel bench`
 * times, without bench's probes between steps), and the shares and durations summed by name. Tracing starts before the engine opens (CUPTI instruments a graph when it
 * is instantiated). A benchmark tool: it prints, and exits on errors. */
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "petrel.h"

typedef struct {
    uint64_t start, end;
    uint32_t stream;
    char name[96];
} krec;

static krec *recs;
static size_t nrec, caprec;
/* copies (host <-> device), for the step's host-side account: the latest 65536 (a ring: the
 * open's weight uploads come first) */
typedef struct {
    uint64_t start, end, bytes;
    int kind; /* CUpti_ActivityMemcpyKind */
} mrec;
static mrec mrecs[1 << 16];
static size_t nmrec;

static void CUPTIAPI buf_request(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = 8u << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buf_complete(CUcontext ctx, uint32_t stream_id, uint8_t *buf, size_t size, size_t valid) {
    (void)ctx, (void)stream_id, (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            mrecs[nmrec++ % (sizeof mrecs / sizeof mrecs[0])] = (mrec){m->start, m->end, m->bytes, m->copyKind};
            continue;
        }
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        if (nrec == caprec) {
            caprec = caprec ? 2 * caprec : 4096;
            recs = realloc(recs, caprec * sizeof *recs);
            if (!recs) {
                fprintf(stderr, "cu_trace: out of memory\n");
                exit(1);
            }
        }
        krec *o = &recs[nrec++];
        o->start = k->start, o->end = k->end, o->stream = k->streamId;
        snprintf(o->name, sizeof o->name, "%s", k->name ? k->name : "?");
    }
    free(buf);
}

static int by_start(const void *a, const void *b) {
    const krec *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

typedef struct {
    const char *name;
    double us, adds; /* summed durations; summed shares of the span (adds) */
    int n;
} byname;

static void check(CUptiResult rc, const char *what) {
    if (rc == CUPTI_SUCCESS) return;
    const char *msg = NULL;
    cuptiGetResultString(rc, &msg);
    fprintf(stderr, "cu_trace: %s: %s\n", what, msg ? msg : "CUPTI error");
    exit(1);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: cu_trace MODEL [PROMPT [STEPS]]: the kernels of a GPU decode step after a PROMPT-token prompt\n");
        return argc < 2 ? 2 : 0;
    }
    const int prompt = argc > 2 ? atoi(argv[2]) : 2048, steps = argc > 3 ? atoi(argv[3]) : 8;
    if (prompt < 1 || steps < 1) {
        fprintf(stderr, "cu_trace: PROMPT and STEPS must be positive\n");
        return 2;
    }
    check(cuptiActivityRegisterCallbacks(buf_request, buf_complete), "register callbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copy records");
    petrel_open_opts opts = {0};
    opts.device = "cuda";
    petrel_engine *eng = NULL;
    petrel_session *s = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(argv[1], &opts, &eng, &err) || petrel_session_create(eng, prompt + steps + 1, &s, &err)) {
        fprintf(stderr, "cu_trace: %s\n", err.msg);
        return 1;
    }
    const int V = petrel_engine_vocab_size(eng);
    int32_t *ids = malloc(sizeof(int32_t) * prompt);
    float *lg = malloc(sizeof(float) * V);
    if (!ids || !lg) {
        fprintf(stderr, "cu_trace: out of memory\n");
        return 1;
    }
    for (int i = 0; i < prompt; i++) ids[i] = (int32_t)((i * 7919u + 13u) % (unsigned)V);
    if (petrel_session_forward(s, ids, prompt, lg, 0, &err)) {
        fprintf(stderr, "cu_trace: prompt: %s\n", err.msg);
        return 1;
    }
    /* each step's API call on CUPTI's clock (the records' clock): its wall time, as `petrel bench`
     * times a step, and for the last one where it went outside the kernels */
    uint64_t *call0 = calloc((size_t)steps, sizeof(uint64_t)), *call1 = calloc((size_t)steps, sizeof(uint64_t));
    if (!call0 || !call1) {
        fprintf(stderr, "cu_trace: out of memory\n");
        return 1;
    }
    for (int t = 0; t < steps; t++) {
        int32_t best = 0;
        for (int v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v;
        cuptiGetTimestamp(&call0[t]);
        if (petrel_session_forward(s, &best, 1, lg, 0, &err)) {
            fprintf(stderr, "cu_trace: step %d: %s\n", t, err.msg);
            return 1;
        }
        cuptiGetTimestamp(&call1[t]);
    }
    petrel_session_free(s);
    petrel_engine_close(eng);
    check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");
    qsort(recs, nrec, sizeof *recs, by_start);
    size_t first = nrec; /* the last step: from the last embedding kernel on */
    for (size_t i = 0; i < nrec; i++)
        if (strstr(recs[i].name, "k_embed")) first = i; /* its mangled name holds it */
    if (first == nrec) {
        fprintf(stderr, "cu_trace: no kernel records (%zu in all)\n", nrec);
        return 1;
    }
    const uint64_t t0 = recs[first].start;
    uint64_t reach = t0, busy = 0, idle = 0;
    printf("decode step %d after a %d-token prompt: %zu kernels\n", steps, prompt, nrec - first);
    /* with programmatic dependent launch a kernel starts before its predecessor ends and waits,
     * so its duration overstates it: "adds us" is how far it moves the step's end past every
     * kernel started before it (its share of the span; idle gaps count to nobody) */
    printf("%9s %8s %8s %8s %6s  %s\n", "start us", "us", "adds us", "idle us", "stream", "kernel");
    byname *bn = calloc(nrec - first, sizeof *bn);
    int nbn = 0;
    for (size_t i = first; i < nrec; i++) {
        const krec *k = &recs[i];
        uint64_t gap = k->start > reach ? k->start - reach : 0, adds = 0;
        idle += gap;
        if (k->end > reach) adds = k->end - (k->start > reach ? k->start : reach), busy += adds, reach = k->end;
        printf("%9.1f %8.1f %8.1f %8.1f %6u  %.80s\n", (k->start - t0) / 1e3, (k->end - k->start) / 1e3, adds / 1e3, gap / 1e3, k->stream, k->name);
        int j = 0;
        while (j < nbn && strcmp(bn[j].name, k->name)) j++;
        if (j == nbn) bn[nbn++].name = k->name;
        bn[j].us += (k->end - k->start) / 1e3, bn[j].adds += adds / 1e3, bn[j].n++;
    }
    printf("step span %.1f us: kernels running %.1f us, none running %.1f us\n", (reach - t0) / 1e3, busy / 1e3, idle / 1e3);
    /* the last step's API call: before its first copy or kernel, its copies, after its last (with CUPTI
     * recording every kernel, the graph's launch takes ~0.23 ms more than without: RESULTS 2026-12-07 21:10) */
    const uint64_t c0 = call0[steps - 1], c1 = call1[steps - 1];
    uint64_t g0 = t0, g1 = reach;
    for (size_t i = 0; i < nmrec && i < sizeof mrecs / sizeof mrecs[0]; i++)
        if (mrecs[i].start >= c0 && mrecs[i].end <= c1) {
            if (mrecs[i].start < g0) g0 = mrecs[i].start;
            if (mrecs[i].end > g1) g1 = mrecs[i].end;
            printf("  copy %s %8llu bytes: at %+8.1f us from the call, %6.1f us\n", mrecs[i].kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD ? "HtoD" : mrecs[i].kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH" : "other",
                   (unsigned long long)mrecs[i].bytes, ((double)mrecs[i].start - (double)c0) / 1e3, (mrecs[i].end - mrecs[i].start) / 1e3);
        }
    printf("the last step's call %.1f us: %.1f before its first copy or kernel, %.1f from it to the first kernel, kernels %.1f, %.1f from the last kernel's end to the last copy's, %.1f after\n",
           (c1 - c0) / 1e3, ((double)g0 - (double)c0) / 1e3, ((double)t0 - (double)g0) / 1e3, (reach - t0) / 1e3, ((double)g1 - (double)reach) / 1e3,
           ((double)c1 - (double)g1) / 1e3);
    double *w = calloc((size_t)steps, sizeof(double));
    for (int t = 0; w && t < steps; t++) {
        w[t] = (call1[t] - call0[t]) / 1e6;
        for (int j = t; j > 0 && w[j] < w[j - 1]; j--) {
            double x = w[j];
            w[j] = w[j - 1], w[j - 1] = x;
        }
    }
    if (w) printf("decode calls (ms, wall, CUPTI recording: ~0.25 ms slower than bench's steps on an H100, RESULTS 2026-12-07 21:10): min %.3f, median %.3f, max %.3f over %d steps\n", w[0], w[steps / 2], w[steps - 1], steps);
    free(w), free(call0), free(call1);
    for (int i = 1; i < nbn; i++) /* by their share of the span, largest first */
        for (int j = i; j > 0 && bn[j].adds > bn[j - 1].adds; j--) {
            byname x = bn[j];
            bn[j] = bn[j - 1], bn[j - 1] = x;
        }
    printf("%9s %9s %8s  %s\n", "adds us", "us", "launches", "kernel (summed by name)");
    for (int i = 0; i < nbn; i++) printf("%9.1f %9.1f %8d  %.80s\n", bn[i].adds, bn[i].us, bn[i].n, bn[i].name);
    free(bn), free(recs), free(ids), free(lg);
    return 0;
}
