/* qtypes.c: scalar format conversions and row dequantization: the slow, obviously right path
 * that kernels are tested against. */
#include "quant/qtypes.h"

#include <math.h>
#include <string.h>

const char *pt_qtype_name(pt_qtype t) {
    static const char *names[] = {"f32", "bf16", "f16", "fp8_e4m3", "q8_row", "q8_g32", "q4_g64"};
    return (unsigned)t < PT_QTYPE_COUNT ? names[t] : "?";
}

float pt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    union { float f; uint32_t u; } u = { v };
    u.u |= sign;
    return u.f;
}

uint16_t pt_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = { f };
    uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000);
    float a = fabsf(f);
    if (isnan(f)) return sign | 0x7e00;
    if (a >= 65520.0f) return sign | 0x7c00;
    if (a < ldexpf(1.0f, -14)) { /* subnormal: units of 2^-24, round half even */
        float q = a * 16777216.0f;
        return sign | (uint16_t)lrintf(q);
    }
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5,1) */
    float q = ldexpf(m, 11); /* [1024, 2048) */
    long qi = lrintf(q);
    if (qi == 2048) { qi = 1024; e++; }
    if (e + 14 >= 31) return sign | 0x7c00;
    return sign | (uint16_t)(((e + 14) << 10) | (qi - 1024));
}

float pt_fp8e4m3_to_f32(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
    float v;
    if (exp == 15 && man == 7) v = NAN; /* e4m3fn: no infinities, one NaN pattern */
    else if (exp == 0) v = ldexpf((float)man, -9);
    else v = ldexpf((float)(8 + man), exp - 10);
    return sign ? -v : v;
}

static float scale_at(const pt_wview *W, int64_t i) {
    switch (W->scale_dtype) {
    case PT_BF16: return pt_bf16_to_f32(((const uint16_t *)W->scale)[i]);
    case PT_F16: return pt_f16_to_f32(((const uint16_t *)W->scale)[i]);
    default: return ((const float *)W->scale)[i];
    }
}

/* Row r of a PT_LAYOUT_R16 view (qtypes.h). */
static void dequant_row_r16(const pt_wview *W, int64_t r, float *out) {
    const int64_t b = r / 16, i = r % 16, n = W->cols, ng = W->scale_cols;
    const uint8_t *blk = W->data + b * 16 * W->row_bytes;
    if (W->qtype == PT_Q8_G32) {
        for (int64_t j = 0; j < n; j++) {
            int64_t g = j / 32, k = (j % 32) / 4, t = j % 4;
            out[j] = (float)((int)blk[g * 512 + k * 64 + i * 4 + t] - 128) * scale_at(W, (b * ng + g) * 16 + i);
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            int64_t g = j / 64, u = j % 64, k = u / 8, t = u % 4, hi = (u % 8) / 4;
            int nib = (blk[g * 512 + k * 64 + i * 4 + t] >> (hi * 4)) & 0xf;
            out[j] = (float)(nib - 8) * scale_at(W, (b * ng + g) * 16 + i);
        }
    }
}

void pt_dequant_row(const pt_wview *W, int64_t r, float *out) {
    if (W->layout == PT_LAYOUT_R16) { dequant_row_r16(W, r, out); return; }
    const uint8_t *row = W->data + r * W->row_bytes;
    int64_t n = W->cols;
    switch (W->qtype) {
    case PT_F32: memcpy(out, row, (size_t)n * 4); break;
    case PT_BF16: {
        const uint16_t *p = (const uint16_t *)row;
        for (int64_t j = 0; j < n; j++) out[j] = pt_bf16_to_f32(p[j]);
        break;
    }
    case PT_F16: {
        const uint16_t *p = (const uint16_t *)row;
        for (int64_t j = 0; j < n; j++) out[j] = pt_f16_to_f32(p[j]);
        break;
    }
    case PT_FP8_E4M3: {
        int64_t sb = (r / W->block_rows) * W->scale_cols;
        for (int64_t j = 0; j < n; j++)
            out[j] = pt_fp8e4m3_to_f32(row[j]) * scale_at(W, sb + j / W->block_cols);
        break;
    }
    case PT_Q8_ROW: {
        float s = scale_at(W, r);
        for (int64_t j = 0; j < n; j++) out[j] = (float)(int8_t)row[j] * s;
        break;
    }
    case PT_Q8_G32: {
        int64_t sb = r * W->scale_cols;
        for (int64_t j = 0; j < n; j++) out[j] = (float)(int8_t)row[j] * scale_at(W, sb + j / 32);
        break;
    }
    case PT_Q4_G64: { /* nibble q+8, even column in the low nibble */
        int64_t sb = r * W->scale_cols;
        for (int64_t j = 0; j < n; j++) {
            int nib = (row[j >> 1] >> ((j & 1) * 4)) & 0xf;
            out[j] = (float)(nib - 8) * scale_at(W, sb + j / 64);
        }
        break;
    }
    default: memset(out, 0, (size_t)n * 4); break;
    }
}

uint64_t pt_wview_bytes(const pt_wview *W) {
    uint64_t b = (uint64_t)W->rows * (uint64_t)W->row_bytes;
    uint64_t es = W->scale_dtype == PT_F32 ? 4 : 2;
    if (W->qtype == PT_FP8_E4M3 && W->block_rows)
        b += (uint64_t)((W->rows + W->block_rows - 1) / W->block_rows) * (uint64_t)W->scale_cols * es;
    else if (W->qtype == PT_Q8_ROW)
        b += (uint64_t)W->rows * es;
    else if (W->qtype == PT_Q8_G32 || W->qtype == PT_Q4_G64)
        b += (uint64_t)W->rows * (uint64_t)W->scale_cols * es;
    return b;
}
