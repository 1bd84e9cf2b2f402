/* The portable decoder: 32 values of a row as floats, computed in gguf-py's order. */
#ifndef UB_QUANT_SCALAR_H
#define UB_QUANT_SCALAR_H
#include "common.h"

/* ---- the portable chunk dequantiser: values [32c, 32c + 32) of a row into o[32] ---------- */
static inline void chunk_scalar(int type, const uint8_t *row, int64_t c, float *o) {
    switch (type) {
    case T_F32: memcpy(o, row + c * 128, 128); return;
    case T_F16: for (int l = 0; l < 32; l++) o[l] = h2f(rd16(row + c * 64 + 2 * l)); return;
    case T_BF16:
        for (int l = 0; l < 32; l++) {
            uint32_t b = (uint32_t)rd16(row + c * 64 + 2 * l) << 16;
            memcpy(o + l, &b, 4);
        }
        return;
    case T_Q8_0: {
        const uint8_t *b = row + c * 34;
        float d = h2f(rd16(b));
        for (int l = 0; l < 32; l++) o[l] = d * (float)(int8_t)b[2 + l];
        return;
    }
    case T_Q4_0: {
        const uint8_t *b = row + c * 18;
        float d = h2f(rd16(b));
        for (int l = 0; l < 16; l++) {
            o[l] = d * (float)((b[2 + l] & 0xF) - 8);
            o[l + 16] = d * (float)((b[2 + l] >> 4) - 8);
        }
        return;
    }
    case T_Q4_1: {
        const uint8_t *b = row + c * 20;
        float d = h2f(rd16(b)), m = h2f(rd16(b + 2));
        for (int l = 0; l < 16; l++) {
            o[l] = d * (float)(b[4 + l] & 0xF) + m;
            o[l + 16] = d * (float)(b[4 + l] >> 4) + m;
        }
        return;
    }
    case T_Q5_0: {
        const uint8_t *b = row + c * 22;
        float d = h2f(rd16(b));
        uint32_t qh = rd32(b + 2);
        for (int l = 0; l < 16; l++) {
            int lo = (b[6 + l] & 0xF) | (((qh >> l) & 1) << 4);
            int hi = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
            o[l] = d * (float)(lo - 16);
            o[l + 16] = d * (float)(hi - 16);
        }
        return;
    }
    case T_Q5_1: {
        const uint8_t *b = row + c * 24;
        float d = h2f(rd16(b)), m = h2f(rd16(b + 2));
        uint32_t qh = rd32(b + 4);
        for (int l = 0; l < 16; l++) {
            int lo = (b[8 + l] & 0xF) | (((qh >> l) & 1) << 4);
            int hi = (b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
            o[l] = d * (float)lo + m;
            o[l + 16] = d * (float)hi + m;
        }
        return;
    }
    case T_Q4_K: {
        const uint8_t *b = row + (c >> 3) * 144;
        int j = (int)(c & 7), sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        float d1 = h2f(rd16(b)) * (float)sc, m1 = h2f(rd16(b + 2)) * (float)mn;
        const uint8_t *q = b + 16 + (j >> 1) * 32;
        for (int l = 0; l < 32; l++) {
            int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0xF);
            o[l] = d1 * (float)v - m1;
        }
        return;
    }
    case T_Q5_K: {
        const uint8_t *b = row + (c >> 3) * 176;
        int j = (int)(c & 7), sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        float d1 = h2f(rd16(b)) * (float)sc, m1 = h2f(rd16(b + 2)) * (float)mn;
        const uint8_t *qh = b + 16, *q = b + 48 + (j >> 1) * 32;
        for (int l = 0; l < 32; l++) {
            int v = ((j & 1) ? (q[l] >> 4) : (q[l] & 0xF)) | (((qh[l] >> j) & 1) << 4);
            o[l] = d1 * (float)v - m1;
        }
        return;
    }
    case T_Q6_K: {
        const uint8_t *b = row + (c >> 3) * 210;
        int j = (int)(c & 7), h = j >> 2, g = j & 3;
        const uint8_t *ql = b + h * 64 + (g & 1) * 32, *qh = b + 128 + h * 32;
        const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * g;
        float d = h2f(rd16(b + 208));
        float ds0 = d * (float)sc[0], ds1 = d * (float)sc[1];
        for (int l = 0; l < 32; l++) {
            int v = ((g >= 2) ? (ql[l] >> 4) : (ql[l] & 0xF)) | (((qh[l] >> (2 * g)) & 3) << 4);
            o[l] = (l < 16 ? ds0 : ds1) * (float)(v - 32);
        }
        return;
    }
    }
}

/* values past the last whole chunk of a float row (k % 32 != 0; block types never have one) */
static float tail_value(int type, const uint8_t *row, int64_t l) {
    if (type == T_F32) { float f; memcpy(&f, row + 4 * l, 4); return f; }
    if (type == T_F16) return h2f(rd16(row + 2 * l));
    uint32_t b = (uint32_t)rd16(row + 2 * l) << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
#endif
