/* quant.c: scalar quantizers (offline work: clarity over speed). The dequantizer they must
 * agree with is pt_dequant_row in qtypes.c; tests/test_quant.c checks both directions. */
#include "quant/quant.h"

#include <math.h>
#include <string.h>

int64_t pt_qtype_row_bytes(pt_qtype q, int64_t cols) {
    switch (q) {
    case PT_F32: return cols * 4;
    case PT_BF16: case PT_F16: return cols * 2;
    case PT_FP8_E4M3: case PT_Q8_ROW: case PT_Q8_G32: return cols;
    case PT_Q4_G64: return (cols + 1) / 2;
    default: return 0;
    }
}

int64_t pt_qtype_group(pt_qtype q, int64_t cols) {
    switch (q) {
    case PT_Q8_ROW: return cols;
    case PT_Q8_G32: return 32;
    case PT_Q4_G64: return 64;
    default: return 0;
    }
}

int64_t pt_qtype_scales_per_row(pt_qtype q, int64_t cols) {
    int64_t g = pt_qtype_group(q, cols);
    if (q == PT_Q8_ROW) return 1;
    return g ? (cols + g - 1) / g : 0;
}

int pt_scale_dtype_bytes(int scale_dtype) {
    return scale_dtype == PT_F32 ? 4 : (scale_dtype == PT_BF16 || scale_dtype == PT_F16) ? 2 : 0;
}

/* Stores s in dtype and returns the value as read back (what dequantization will use). */
static float put_scale(void *scales, int64_t i, int dtype, float s) {
    switch (dtype) {
    case PT_BF16: {
        uint16_t h = pt_f32_to_bf16(s);
        ((uint16_t *)scales)[i] = h;
        return pt_bf16_to_f32(h);
    }
    case PT_F16: {
        uint16_t h = pt_f32_to_f16(s);
        ((uint16_t *)scales)[i] = h;
        return pt_f16_to_f32(h);
    }
    default: ((float *)scales)[i] = s; return s;
    }
}

/* q = clamp(round_half_even(w / s), lo, hi); a zero or non-finite stored scale gives q = 0. */
static int quant_one(float w, float s, int lo, int hi) {
    if (!(s > 0.f) || isinf(s)) return 0;
    float v = nearbyintf(w / s); /* default rounding mode: nearest, ties to even */
    if (!(v >= (float)lo)) v = (float)lo; /* also maps NaN w to lo; weights are finite */
    if (v > (float)hi) v = (float)hi;
    return (int)v;
}

int pt_quant_row(pt_qtype q, const float *w, int64_t cols, uint8_t *out, void *scales,
                 int scale_dtype) {
    switch (q) {
    case PT_F32: memcpy(out, w, (size_t)cols * 4); return 0;
    case PT_BF16:
        for (int64_t j = 0; j < cols; j++) ((uint16_t *)out)[j] = pt_f32_to_bf16(w[j]);
        return 0;
    case PT_F16:
        for (int64_t j = 0; j < cols; j++) ((uint16_t *)out)[j] = pt_f32_to_f16(w[j]);
        return 0;
    case PT_Q8_ROW: case PT_Q8_G32: case PT_Q4_G64: break;
    default: return -1;
    }
    if (!scales || pt_scale_dtype_bytes(scale_dtype) == 0) return -1;
    int64_t g = pt_qtype_group(q, cols);
    int qmax = q == PT_Q4_G64 ? 7 : 127, qmin = q == PT_Q4_G64 ? -8 : -128;
    if (q == PT_Q4_G64) memset(out, 0x88, (size_t)pt_qtype_row_bytes(q, cols)); /* pad nibble q=0 */
    for (int64_t j0 = 0, gi = 0; j0 < cols; j0 += g, gi++) {
        int64_t j1 = j0 + g < cols ? j0 + g : cols;
        float amax = 0.f;
        for (int64_t j = j0; j < j1; j++) amax = fmaxf(amax, fabsf(w[j]));
        float s = amax / (float)qmax;
        if (s < 1e-8f) s = 1e-8f;
        s = put_scale(scales, gi, scale_dtype, s);
        for (int64_t j = j0; j < j1; j++) {
            int v = quant_one(w[j], s, qmin, qmax);
            if (q == PT_Q4_G64) {
                uint8_t nib = (uint8_t)(v + 8), *b = &out[j >> 1];
                *b = (j & 1) ? (uint8_t)((*b & 0x0f) | (nib << 4)) : (uint8_t)((*b & 0xf0) | nib);
            } else {
                out[j] = (uint8_t)(int8_t)v;
            }
        }
    }
    return 0;
}

pt_wview pt_wview_make(pt_qtype q, int64_t rows, int64_t cols, const void *data,
                       const void *scales, int scale_dtype) {
    pt_wview v;
    memset(&v, 0, sizeof v);
    v.qtype = q;
    v.rows = rows;
    v.cols = cols;
    v.data = data;
    v.row_bytes = pt_qtype_row_bytes(q, cols);
    v.scale = scales;
    v.scale_dtype = scale_dtype;
    v.block_rows = 1;
    v.block_cols = (int)pt_qtype_group(q, cols);
    v.scale_cols = pt_qtype_scales_per_row(q, cols);
    return v;
}

uint8_t pt_f32_to_fp8e4m3(float f) {
    if (isnan(f)) return 0x7f;
    uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.f) return sign | 0x7e; /* saturate: 0x7f is NaN in e4m3fn */
    if (a < 0x1p-6f) { /* subnormal: units of 2^-9 */
        long m = lrintf(a * 512.f);
        return sign | (uint8_t)m; /* m == 8 encodes the smallest normal, which is right */
    }
    int e;
    float m = frexpf(a, &e);           /* a = m * 2^e, m in [0.5, 1) */
    long qm = lrintf(ldexpf(m, 4));    /* [8, 16] */
    if (qm == 16) { qm = 8; e++; }
    int be = e - 1 + 7;                /* biased exponent */
    if (be > 15 || (be == 15 && qm - 8 == 7)) return sign | 0x7e;
    return sign | (uint8_t)((be << 3) | (qm - 8));
}
