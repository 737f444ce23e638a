/* r16.c: the row-interleaved layout PT_LAYOUT_R16 (quant/qtypes.h) for PT_Q8_G32 and PT_Q4_G64:
 * in-place repacking, activation preparation, and the scalar kernel that defines the math the
 * AVX-512 VNNI kernel (r16_avx512.c) reproduces bit for bit.
 *
 * Why: decode reads every weight once per token, so a matmul should be one sequential stream
 * with almost no arithmetic per byte. In the plain layout each row is a separate dot product
 * (per 16 weights: widen, convert, scale, fma; then a horizontal sum per row). In R16 one
 * 64-byte load holds 4 columns of 16 rows and one vpdpbusd multiplies them with 4 int8
 * activations broadcast to all lanes: 16 rows advance at once, lanes never need reducing, and a
 * group (512 bytes) costs 8 vpdpbusd + one convert and one fma.
 *
 * Math (the same activation quantization as kn_actq_*, kn_internal.h): each x row is quantized
 * per weight group (32 columns for q8, 64 for q4): d_g = max|x_g| / 127, q = round(x / d_g).
 * Per row and group the integer dot I_g = sum (u_j - off) q_j is exact (u = stored unsigned
 * byte or nibble, off = 128 or 8, folded in as the start value bias_g = -off * sum q_j), then
 *     acc = fmaf((float)I_g, s_g * d_g, acc)      for g ascending, acc starting at 0,
 * with s_g the row's weight scale. |I_g| < 2^24, so the convert is exact; per row the order
 * is fixed, so results do not depend on n, batching or threads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/pool.h"
#include "kernels/kernels.h"
#include "kernels/kn_internal.h"

static int r16_group(const pt_wview *W) { return W->qtype == PT_Q8_G32 ? 32 : 64; }

int kn_r16_supported(const pt_wview *W) {
    if (W->layout != PT_LAYOUT_PLAIN || (W->qtype != PT_Q8_G32 && W->qtype != PT_Q4_G64) || !W->scale) return 0;
    int g = r16_group(W);
    return W->rows > 0 && W->rows % 16 == 0 && W->cols > 0 && W->cols % g == 0 && W->scale_cols == W->cols / g &&
           W->row_bytes == (W->qtype == PT_Q8_G32 ? W->cols : W->cols / 2) &&
           (W->scale_dtype == PT_BF16 || W->scale_dtype == PT_F16 || W->scale_dtype == PT_F32);
}

/* Blocks [b0, b1) of W laid out in place; tmp holds one block and its scales. */
static void repack_blocks(const pt_wview *W, int64_t b0, int64_t b1, uint8_t *tmp) {
    const int64_t rb = W->row_bytes, ng = W->scale_cols, blk = 16 * rb;
    const size_t es = W->scale_dtype == PT_F32 ? 4 : 2;
    uint8_t *data = (uint8_t *)W->data, *sc = (uint8_t *)W->scale, *tsc = tmp + blk;
    const int q8 = W->qtype == PT_Q8_G32;
    for (int64_t b = b0; b < b1; b++) {
        uint8_t *d = data + b * blk, *s = sc + (size_t)(b * 16 * ng) * es;
        memcpy(tmp, d, (size_t)blk);
        memcpy(tsc, s, (size_t)(16 * ng) * es);
        /* group g, step k, row i: the 4 bytes d[g * 512 + k * 64 + i * 4 + t], t = 0..3, come
         * from one 4-byte word of row i (q8: columns 32g + 4k + t, each w + 128; q4: the word at
         * byte 32g + 4k holds columns 64g + 8k .. +7, two per byte, the even one low, and byte t
         * pairs column 64g + 8k + t (low nibble) with column 64g + 8k + t + 4 (high nibble));
         * the word's bytes read little-endian, as on every CPU petrel builds for (x86-64) */
        for (int64_t g = 0; g < ng; g++)
            for (int k = 0; k < 8; k++)
                for (int i = 0; i < 16; i++) {
                    uint32_t w, o;
                    memcpy(&w, tmp + i * rb + 32 * g + 4 * k, 4);
                    if (q8) o = w ^ 0x80808080u;
                    else {
                        uint32_t c0 = w & 0xFF, c1 = (w >> 8) & 0xFF, c2 = (w >> 16) & 0xFF, c3 = w >> 24;
                        o = ((c0 & 15) | (c2 & 15) << 4) | ((c0 >> 4) | (c2 & 0xF0)) << 8 | ((c1 & 15) | (c3 & 15) << 4) << 16 |
                            (uint32_t)((c1 >> 4) | (c3 & 0xF0)) << 24;
                    }
                    memcpy(d + g * 512 + k * 64 + i * 4, &o, 4);
                }
        for (int64_t g = 0; g < ng; g++)
            for (int i = 0; i < 16; i++) memcpy(s + (size_t)(g * 16 + i) * es, tsc + (size_t)(i * ng + g) * es, es);
    }
}

/* Large matrices (the head, o_proj: opening a model relays every resident q8/q4 projection) go
 * over the kernels' pool in ranges of blocks, each thread with its own block buffer (all of them
 * allocated before anything moves, so a failure leaves W as it was); inline inside a pool task. */
typedef struct {
    const pt_wview *W;
    int64_t nb, per;
    uint8_t **tmp;
} repack_job;
static void repack_task(void *ctx, int task, int thread) {
    const repack_job *j = ctx;
    int64_t b0 = (int64_t)task * j->per, b1 = b0 + j->per < j->nb ? b0 + j->per : j->nb;
    repack_blocks(j->W, b0, b1, j->tmp[thread]);
}

int kn_r16_repack(pt_wview *W) {
    if (!kn_r16_supported(W)) return -1;
    const int64_t nb = W->rows / 16;
    const size_t tb = (size_t)(16 * W->row_bytes) + (size_t)(16 * W->scale_cols) * (W->scale_dtype == PT_F32 ? 4 : 2);
    pt_pool *pool = kn_pool();
    int nt = nb >= 256 && !pool_in_task() ? pool_threads(pool) : 1;
    uint8_t **tmp = calloc((size_t)nt, sizeof *tmp);
    int ok = tmp != NULL;
    for (int t = 0; t < nt && ok; t++) ok = (tmp[t] = malloc(tb)) != NULL;
    if (ok && nt > 1) {
        repack_job j = {W, nb, (nb + 4 * nt - 1) / (4 * nt), tmp};
        pool_run(pool, (int)((nb + j.per - 1) / j.per), repack_task, &j);
    } else if (ok)
        repack_blocks(W, 0, nb, tmp[0]);
    for (int t = 0; tmp && t < nt; t++) free(tmp[t]);
    free(tmp);
    if (!ok) return -1;
    W->layout = PT_LAYOUT_R16;
    return 0;
}

/* Prepared row: [q: cols int8, padded to 64][d: ng f32, padded to 64][bias: ng int32, padded]. */
int64_t kn_r16_xs(const pt_wview *W) {
    int64_t ng = W->cols / r16_group(W);
    return (W->cols + 63) / 64 * 64 + 2 * ((ng * 4 + 63) / 64 * 64);
}

void kn_r16_prep(const pt_wview *W, const float *x, int n, uint8_t *xq) {
    const int g = r16_group(W), off = W->qtype == PT_Q8_G32 ? 128 : 8;
    const int64_t cols = W->cols, ng = cols / g, xs = kn_r16_xs(W), qb = (cols + 63) / 64 * 64,
                  fb = (ng * 4 + 63) / 64 * 64;
    for (int i = 0; i < n; i++) {
        uint8_t *row = xq + i * xs;
        int8_t *q = (int8_t *)row;
        float *d = (float *)(row + qb);
        int32_t *bias = (int32_t *)(row + qb + fb);
        kn_actq_quant_row(x + (int64_t)i * cols, cols, g, q, d);
        memset(q + cols, 0, (size_t)(qb - cols));
        for (int64_t gi = 0; gi < ng; gi++) {
            int32_t sum = 0;
            for (int j = 0; j < g; j++) sum += q[gi * g + j];
            bias[gi] = -off * sum;
        }
    }
}

static float r16_scale(const pt_wview *W, int64_t i) { return kn_scale_at(W, i); }

void kn_r16_rows_ref(const pt_wview *W, int64_t r0, int64_t r1, const uint8_t *xq, int64_t xs, int n, float *y) {
    const int g = r16_group(W), q4 = W->qtype == PT_Q4_G64;
    const int64_t cols = W->cols, ng = cols / g, qb = (cols + 63) / 64 * 64, fb = (ng * 4 + 63) / 64 * 64;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / 16, i = r % 16;
        const uint8_t *blk = W->data + b * 16 * W->row_bytes;
        for (int a = 0; a < n; a++) {
            const uint8_t *row = xq + a * xs;
            const int8_t *q = (const int8_t *)row;
            const float *d = (const float *)(row + qb);
            const int32_t *bias = (const int32_t *)(row + qb + fb);
            float acc = 0.f;
            for (int64_t gi = 0; gi < ng; gi++) {
                int32_t I = bias[gi];
                for (int k = 0; k < 8; k++)
                    for (int t = 0; t < 4; t++) {
                        uint8_t u = blk[gi * 512 + k * 64 + i * 4 + t];
                        if (!q4) I += (int32_t)u * q[gi * 32 + 4 * k + t];
                        else I += (int32_t)(u & 15) * q[gi * 64 + 8 * k + t] + (int32_t)(u >> 4) * q[gi * 64 + 8 * k + 4 + t];
                    }
                float c = r16_scale(W, (b * ng + gi) * 16 + i) * d[gi];
                acc = __builtin_fmaf((float)I, c, acc);
            }
            y[(int64_t)a * W->rows + r] = acc;
        }
    }
}
