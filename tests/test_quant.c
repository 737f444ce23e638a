/* test_quant.c: the quantizers (src/quant/quant.c) against an independent scalar spelling of
 * the math in quant.h, quantize -> dequantize error bounds, layout helpers and the fp8 codec.
 * Fresh random inputs at odd sizes each run (seeded from the clock; the seed is printed on
 * failure). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant/quant.h"
#include "test.h"

static uint64_t rng_state;
static void rng_seed(void) { rng_state = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull | 1; }
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}
static float frand(void) { return (float)rnd() / 4294967296.0f * 2.f - 1.f; } /* [-1, 1) */

static const int64_t COLS[] = {1, 7, 31, 33, 63, 64, 65, 127, 129, 1000, 6144};
#define NCOLS (int)(sizeof COLS / sizeof COLS[0])
static const int SDT[] = {PT_F32, PT_BF16, PT_F16};

static float sc_read(const void *s, int dt, int64_t i) {
    if (dt == PT_BF16) return pt_bf16_to_f32(((const uint16_t *)s)[i]);
    if (dt == PT_F16) return pt_f16_to_f32(((const uint16_t *)s)[i]);
    return ((const float *)s)[i];
}

/* Independent reference: q for w given stored scale s. */
static int ref_q(float w, float s, int lo, int hi) {
    if (s == 0.f) return 0;
    long q = lrintf(w / s); /* round half even in the default mode */
    return q < lo ? lo : q > hi ? hi : (int)q;
}

TEST(quant, layout_helpers) {
    CHECK_EQ_INT(pt_qtype_row_bytes(PT_F32, 7), 28);
    CHECK_EQ_INT(pt_qtype_row_bytes(PT_BF16, 7), 14);
    CHECK_EQ_INT(pt_qtype_row_bytes(PT_Q8_G32, 33), 33);
    CHECK_EQ_INT(pt_qtype_row_bytes(PT_Q4_G64, 7), 4);
    CHECK_EQ_INT(pt_qtype_row_bytes(PT_Q4_G64, 64), 32);
    CHECK_EQ_INT(pt_qtype_scales_per_row(PT_Q8_ROW, 100), 1);
    CHECK_EQ_INT(pt_qtype_scales_per_row(PT_Q8_G32, 33), 2);
    CHECK_EQ_INT(pt_qtype_scales_per_row(PT_Q4_G64, 129), 3);
    CHECK_EQ_INT(pt_qtype_scales_per_row(PT_BF16, 129), 0);
    pt_wview v = pt_wview_make(PT_Q4_G64, 3, 129, NULL, NULL, PT_BF16);
    CHECK_EQ_INT(v.row_bytes, 65);
    CHECK_EQ_INT(v.scale_cols, 3);
    CHECK_EQ_INT(v.block_cols, 64);
    float w[4] = {1, 2, 3, 4};
    uint8_t out[4];
    float s[4];
    CHECK(pt_quant_row(PT_FP8_E4M3, w, 4, out, s, PT_F32) < 0);
    CHECK(pt_quant_row(PT_Q8_G32, w, 4, out, NULL, PT_F32) < 0);
}

/* Exact match with the reference spelling, and the dequantized error bound, for every int
 * format, scale dtype and odd size. */
TEST(quant, int_formats_exact_and_bounded) {
    rng_seed();
    uint64_t seed = rng_state;
    const pt_qtype Q[] = {PT_Q8_ROW, PT_Q8_G32, PT_Q4_G64};
    for (int qi = 0; qi < 3; qi++)
        for (int di = 0; di < 3; di++)
            for (int ci = 0; ci < NCOLS; ci++) {
                pt_qtype q = Q[qi];
                int dt = SDT[di];
                int64_t cols = COLS[ci];
                float *w = malloc((size_t)cols * 4), *deq = malloc((size_t)cols * 4);
                uint8_t *out = malloc((size_t)cols + 1);
                float sc[256];
                for (int64_t j = 0; j < cols; j++) w[j] = frand() * (j % 5 == 0 ? 3.f : 0.5f);
                if (cols > 40) for (int64_t j = 32; j < 40; j++) w[j] = 0.f; /* zeros */
                if (cols >= 64 && q == PT_Q4_G64) for (int64_t j = 0; j < 64; j++) w[j] = 0.f; /* zero group */
                CHECK(pt_quant_row(q, w, cols, out, sc, dt) == 0);
                int64_t g = pt_qtype_group(q, cols);
                int qmax = q == PT_Q4_G64 ? 7 : 127;
                int bad = 0;
                for (int64_t j = 0; j < cols; j++) {
                    float s = sc_read(sc, dt, j / g);
                    int want = ref_q(w[j], s, -qmax - 1, qmax), got;
                    if (q == PT_Q4_G64) got = ((out[j >> 1] >> ((j & 1) * 4)) & 15) - 8;
                    else got = (int8_t)out[j];
                    if (got != want) bad++;
                }
                if (q == PT_Q4_G64 && (cols & 1)) bad += (out[cols >> 1] >> 4) != 8; /* pad nibble */
                CHECK_MSG(bad == 0, "%s sdt %d cols %lld: %d mismatches (seed %llu)",
                          pt_qtype_name(q), dt, (long long)cols, bad, (unsigned long long)seed);
                /* the scale is max|w| / qmax rounded to dtype (floored at 1e-8) */
                for (int64_t gi = 0; gi * g < cols; gi++) {
                    float amax = 0.f;
                    for (int64_t j = gi * g; j < cols && j < (gi + 1) * g; j++)
                        amax = fmaxf(amax, fabsf(w[j]));
                    float s = fmaxf(amax / (float)qmax, 1e-8f);
                    float rs = dt == PT_BF16 ? pt_bf16_to_f32(pt_f32_to_bf16(s))
                               : dt == PT_F16 ? pt_f16_to_f32(pt_f32_to_f16(s)) : s;
                    CHECK(sc_read(sc, dt, gi) == rs);
                }
                pt_wview v = pt_wview_make(q, 1, cols, out, sc, dt);
                pt_dequant_row(&v, 0, deq);
                double worst = 0;
                for (int64_t j = 0; j < cols; j++) {
                    float s = sc_read(sc, dt, j / g);
                    /* half a step, plus the clamp excess when the rounded scale is smaller than
                     * max|w| / qmax (bf16: 2^-9 relative; f16 subnormal scales: more) */
                    double bound = 0.5 * s + fmax(0.0, fabs(w[j]) - qmax * (double)s) + 1e-7 * fabs(w[j]);
                    double e = fabs((double)w[j] - deq[j]);
                    if (e > bound) worst = fmax(worst, e - bound);
                }
                CHECK_MSG(worst == 0, "%s sdt %d cols %lld: bound exceeded by %g (seed %llu)",
                          pt_qtype_name(q), dt, (long long)cols, worst, (unsigned long long)seed);
                free(w); free(deq); free(out);
            }
}

TEST(quant, float_formats) {
    rng_seed();
    for (int ci = 0; ci < NCOLS; ci++) {
        int64_t cols = COLS[ci];
        float *w = malloc((size_t)cols * 4), *deq = malloc((size_t)cols * 4);
        uint8_t *out = malloc((size_t)cols * 4);
        for (int64_t j = 0; j < cols; j++) w[j] = frand() * 100.f;
        const pt_qtype Q[] = {PT_F32, PT_BF16, PT_F16};
        for (int qi = 0; qi < 3; qi++) {
            CHECK(pt_quant_row(Q[qi], w, cols, out, NULL, 0) == 0);
            pt_wview v = pt_wview_make(Q[qi], 1, cols, out, NULL, 0);
            pt_dequant_row(&v, 0, deq);
            for (int64_t j = 0; j < cols; j++) {
                float want = Q[qi] == PT_F32 ? w[j]
                             : Q[qi] == PT_BF16 ? pt_bf16_to_f32(pt_f32_to_bf16(w[j]))
                                                : pt_f16_to_f32(pt_f32_to_f16(w[j]));
                CHECK(deq[j] == want);
                CHECK(fabsf(deq[j] - w[j]) <= fabsf(w[j]) * (Q[qi] == PT_BF16 ? 0x1p-8f : 0x1p-11f));
            }
        }
        free(w); free(deq); free(out);
    }
}

TEST(quant, fp8_codec) {
    for (int b = 0; b < 256; b++) {
        float f = pt_fp8e4m3_to_f32((uint8_t)b);
        if ((b & 0x7f) == 0x7f) { CHECK(isnan(f)); continue; }
        CHECK_EQ_INT(pt_f32_to_fp8e4m3(f), b);
    }
    CHECK_EQ_INT(pt_f32_to_fp8e4m3(1e9f), 0x7e);
    CHECK_EQ_INT(pt_f32_to_fp8e4m3(-1e9f), 0xfe);
    CHECK_EQ_INT(pt_f32_to_fp8e4m3(0x1p-10f), 0);     /* half the smallest subnormal: ties to 0 */
    CHECK_EQ_INT(pt_f32_to_fp8e4m3(0x1.8p-9f), 2);    /* 1.5 units: ties to even (2) */
    CHECK(pt_fp8e4m3_to_f32(0x7e) == 448.f);
}
