/* cu_gemv_bench.cu: the decode step's GEMVs at GLM-5.2's shapes on the GPU, timed against a
 * read probe in the same run (bench tool, not part of petrel). Weights are random bytes with
 * small f32 scales, several copies of each so that a pass never finds its weight in L2 (as in a
 * decode step, where every other product evicts it); routed experts are 8 random experts of a
 * stacked 256. Times are of back-to-back launches on one stream (the step's serial chain).
 * Built by `make cuda` (build/cu_gemv_bench); run: build/cu_gemv_bench [iterations] (default 40). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "cuda/cu_kernels.h"

#define CK(x)                                                                                                                                 \
    do {                                                                                                                                      \
        cudaError_t e_ = (x);                                                                                                                 \
        if (e_ != cudaSuccess) {                                                                                                              \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                                                       \
            exit(1);                                                                                                                          \
        }                                                                                                                                     \
    } while (0)

enum { QQ8G = 5, QQ4G = 6 };

static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(void) { rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17; return (uint32_t)rs; }

struct wt {
    dw W;
    int64_t bytes; /* what one pass reads of one expert / matrix (data + f32 scales) */
};

/* ncopy stacked matrices [rows][cols] (as experts) */
static wt make(int q4, int64_t rows, int64_t cols, int ncopy) {
    wt w;
    memset(&w, 0, sizeof w);
    w.W.qt = q4 ? QQ4G : QQ8G, w.W.rows = rows, w.W.cols = cols, w.W.g = q4 ? 64 : 32;
    w.W.rb = q4 ? cols / 2 : cols, w.W.sc = cols / w.W.g;
    w.W.estride = w.W.rb * rows, w.W.sstride = w.W.sc * rows;
    size_t nd = (size_t)w.W.estride * ncopy, ns = (size_t)w.W.sstride * ncopy;
    std::vector<uint8_t> hd(nd);
    for (size_t i = 0; i < nd; i++) hd[i] = (uint8_t)rnd();
    std::vector<float> hs(ns);
    for (size_t i = 0; i < ns; i++) hs[i] = 1e-3f * (1 + rnd() % 7);
    uint8_t *d;
    float *s;
    CK(cudaMalloc(&d, nd));
    CK(cudaMalloc(&s, ns * 4));
    CK(cudaMemcpy(d, hd.data(), nd, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s, hs.data(), ns * 4, cudaMemcpyHostToDevice));
    w.W.d = d, w.W.s = s;
    w.bytes = w.W.estride + w.W.sstride * 4;
    return w;
}

static dw at(const wt &w, int i) { /* copy i as a matrix of its own */
    dw W = w.W;
    W.d += (int64_t)i * w.W.estride, W.s += (int64_t)i * w.W.sstride;
    return W;
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 40;
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("device %s, %d SMs\n", p.name, p.multiProcessorCount);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    /* probe */
    size_t pn = (size_t)1 << 30;
    uint4 *pb;
    unsigned int *sink;
    CK(cudaMalloc(&pb, pn));
    CK(cudaMemset(pb, 1, pn));
    CK(cudaMalloc(&sink, 4));
    double probe = 0;
    for (int r = 0; r < 5; r++) {
        CK(cudaEventRecord(e0, st));
        cuk_read(st, pb, pn / 16, sink);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        double bw = pn / (ms * 1e-3) / 1e12;
        if (bw > probe) probe = bw;
    }
    printf("probe %.3f TB/s (1 GiB read, best of 5)\n", probe);
    CK(cudaFree(pb));
    /* activations */
    const int H = 6144, MAXC = 16384;
    float *x, *y, *ub;
    CK(cudaMalloc(&x, (size_t)8 * MAXC * 4));
    CK(cudaMalloc(&y, (size_t)8 * 160000 * 4));
    CK(cudaMalloc(&ub, (size_t)8 * 160000 * 4));
    {
        std::vector<float> hx((size_t)8 * MAXC);
        for (auto &v : hx) v = (float)((int)(rnd() % 2001) - 1000) / 1000.f;
        CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    }
    cu_xq X8, X4;
    CK(cudaMalloc(&X8.q, (size_t)8 * MAXC));
    CK(cudaMalloc(&X8.d, (size_t)8 * MAXC / 32 * 4));
    X8.s = nullptr, X8.ldq = MAXC, X8.ldd = MAXC / 32, X8.lds = 0;
    CK(cudaMalloc(&X4.q, (size_t)8 * MAXC));
    CK(cudaMalloc(&X4.d, (size_t)8 * MAXC / 64 * 4));
    CK(cudaMalloc(&X4.s, (size_t)8 * MAXC / 32 * 4));
    X4.ldq = MAXC, X4.ldd = MAXC / 64, X4.lds = MAXC / 32;
    struct shape { const char *name; int q4, fuse; int64_t rows, cols; int slots; };
    const shape sh[] = {
        {"q_a [2048x6144] q8", 0, 0, 2048, H, 0},
        {"kv_a [576x6144] q8", 0, 0, 576, H, 0},
        {"x stack: q_a | kv_a | wk | wp [2784x6144] q8", 0, 0, 2784, H, 0},
        {"q_a stack: q_b | wq_b [20480x2048] q8", 0, 0, 20480, 2048, 0},
        {"q_b [16384x2048] q8", 0, 0, 16384, 2048, 0},
        {"o_proj [6144x16384] q8", 0, 0, H, 16384, 0},
        {"shared gate+up 2x[2048x6144] q8", 0, 1, 2048, H, 0},
        {"shared down [6144x2048] q8", 0, 0, H, 2048, 0},
        {"dense gate+up 2x[12288x6144] q8", 0, 1, 12288, H, 0},
        {"dense down [6144x12288] q8", 0, 0, H, 12288, 0},
        {"lm_head [154880x6144] q8", 0, 0, 154880, H, 0},
        {"experts gate+up 8x2x[2048x6144] q4", 1, 1, 2048, H, 8},
        {"experts down 8x[6144x2048] q4", 1, 0, H, 2048, 8},
    };
    int32_t *se, *sx;
    CK(cudaMalloc(&se, 64 * 4));
    CK(cudaMalloc(&sx, 64 * 4));
    {
        int32_t hx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        CK(cudaMemcpy(sx, hx, sizeof hx, cudaMemcpyHostToDevice));
    }
    for (const shape &s : sh) {
        int64_t one = (s.q4 ? s.rows * s.cols / 2 : s.rows * s.cols) + s.rows * (s.cols / (s.q4 ? 64 : 32)) * 4;
        int ncopy = s.slots ? 256 : (int)((400ll << 20) / one + 1);
        if (!s.slots && ncopy < 2) ncopy = 2;
        wt g = make(s.q4, s.rows, s.cols, ncopy), u;
        if (s.fuse) u = make(s.q4, s.rows, s.cols, ncopy);
        int64_t bytes = g.bytes * (s.fuse ? 2 : 1) * (s.slots ? s.slots : 1);
        cu_xq &X = s.q4 ? X4 : X8;
        printf("%-36s %7.1f MB, floor %6.2f us:", s.name, bytes / 1e6, bytes / (probe * 1e12) * 1e6);
        fflush(stdout);
        float best = 1e30f;
        for (int rep = 0; rep < 3; rep++) {
            /* slot lists for each iteration: 8 distinct random experts */
            std::vector<int32_t> hse((size_t)iters * 8);
            for (int it = 0; it < iters; it++)
                for (int j = 0; j < 8; j++) {
                    int e;
                    for (;;) {
                        e = (int)(rnd() % 256);
                        int dup = 0;
                        for (int q = 0; q < j; q++) dup |= hse[(size_t)it * 8 + q] == e;
                        if (!dup) break;
                    }
                    hse[(size_t)it * 8 + j] = e;
                }
            int32_t *dse;
            CK(cudaMalloc(&dse, hse.size() * 4));
            CK(cudaMemcpy(dse, hse.data(), hse.size() * 4, cudaMemcpyHostToDevice));
            cuk_actq(st, x, MAXC, 1, (int)s.cols, s.q4, X);
            CK(cudaEventRecord(e0, st));
            for (int it = 0; it < iters; it++) {
                int c = s.slots ? 0 : it % ncopy;
                dw G = at(g, c);
                if (s.slots) {
                    if (s.fuse) cuk_gemv_swiglu_q(st, G, at(u, c), X, y, s.rows, s.slots, dse + it * 8, sx, ub);
                    else cuk_gemv_q(st, G, X, y, s.rows, s.slots, dse + it * 8, sx);
                } else {
                    if (s.fuse) cuk_gemv_swiglu_q(st, G, at(u, c), X, y, s.rows, 1, nullptr, nullptr, ub);
                    else cuk_gemv_q(st, G, X, y, s.rows, 1, nullptr, nullptr);
                }
            }
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            CK(cudaGetLastError());
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            CK(cudaFree(dse));
            if (ms < best) best = ms;
        }
        double us = best * 1e3 / iters;
        printf(" %.1f us (%.0f%% of the probe)", us, bytes / (us * 1e-6) / (probe * 1e12) * 100);
        fflush(stdout);
        printf("\n");
        CK(cudaFree((void *)g.W.d));
        CK(cudaFree((void *)g.W.s));
        if (s.fuse) {
            CK(cudaFree((void *)u.W.d));
            CK(cudaFree((void *)u.W.s));
        }
    }
    /* the quantization of x itself */
    for (int q4 = 0; q4 < 2; q4++) {
        CK(cudaEventRecord(e0, st));
        for (int it = 0; it < iters; it++) cuk_actq(st, x, MAXC, 1, H, q4, q4 ? X4 : X8);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("actq %s 1 x [6144]: %.2f us\n", q4 ? "q4" : "q8", ms * 1e3 / iters);
    }
    return 0;
}
