/* The AVX2 decoders. chunk_avx2: 32 values as four f32 vectors, exactly gguf's (prefill tiles,
 * the embedding); the K-quants' scales and code bytes, which the GEMV's decoders (quant_codes.h)
 * share. */
#ifndef UB_QUANT_AVX2_H
#define UB_QUANT_AVX2_H
#include "common.h"
#if UB_AVX2
/* ---- the AVX2 chunk dequantiser: the same 32 values as four vectors ------------------------ */
static inline __m256 cvt8u(__m128i b8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8)); }

/* 16 packed nibble bytes -> codes 0..31 as four int32x8 (low nibbles first, as ggml stores them) */
static inline void nibbles(const uint8_t *q, __m256i o[4]) {
    __m128i x = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(0xF);
    __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    o[0] = _mm256_cvtepu8_epi32(lo);
    o[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    o[2] = _mm256_cvtepu8_epi32(hi);
    o[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

/* bit (l) of a 32-bit mask for l = 8i .. 8i+7, shifted to bit 4 */
static inline __m256i qh_bits(uint32_t qh, int i) {
    const __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)qh), _mm256_add_epi32(sh, _mm256_set1_epi32(8 * i)));
    return _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(1)), 4);
}

static inline void bytes_to_f32(__m128i lo, __m128i hi, int sign, __m256 q[4]) {
    if (sign) {
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        q[0] = cvt8u(lo);
        q[1] = cvt8u(_mm_srli_si128(lo, 8));
        q[2] = cvt8u(hi);
        q[3] = cvt8u(_mm_srli_si128(hi, 8));
    }
}

/* 0xFF in byte l of the result where bit l of the 32-bit mask is set */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0x0000000000000000LL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* K-quants: the scales of chunk j of super-block b (da: values 0..15, db: 16..31; they differ
 * only for Q6_K) and its min term as an addend (-dmin * m) */
static inline void k_scale(const int type, const uint8_t *b, int j, float *da, float *db, float *mn) {
    if (type == T_Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192) + (j >> 2) * 8 + 2 * (j & 3);
        float d = h2f(rd16(b + 208));
        *da = d * (float)sc[0];
        *db = d * (float)sc[1];
        *mn = 0;
        return;
    }
    int sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    *da = *db = h2f(rd16(b)) * (float)sc;
    *mn = -(h2f(rd16(b + 2)) * (float)m);
}

/* ... and of all eight chunks at once (the GEMV reads a super-block at a time), vectorised: the
 * same products d * sc as k_scale's, so the same bits */
static inline void k_scales(const int type, const uint8_t *b, float *da, float *db, float *mn) {
    if (type == T_Q6_K) { /* 16 int8 scales: even ones for values 0..15 of a chunk, odd for 16..31 */
        __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        __m256 d = _mm256_set1_ps(h2f(rd16(b + 208)));
        float f[16];
        _mm256_storeu_ps(f, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(f + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
        for (int j = 0; j < 8; j++) da[j] = f[2 * j], db[j] = f[2 * j + 1], mn[j] = 0;
        return;
    }
    /* the 12 packed bytes as 8 six-bit scales then 8 six-bit mins (ggml's layout, in words) */
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u, mins_lo = u[1] & m6;
    u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
    u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    u[2] = mins_lo;
    u[0] &= m6;
    __m128i v = _mm_loadu_si128((const __m128i *)u);
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    __m256 d = _mm256_mul_ps(_mm256_set1_ps(h2f(rd16(b))), sc);
    _mm256_storeu_ps(da, d);
    _mm256_storeu_ps(db, d);
    /* -(dmin * m): the sign flip is exact */
    _mm256_storeu_ps(mn, _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(_mm256_set1_ps(h2f(rd16(b + 2))), m)));
}

/* the codes of chunk j of a K-quant super-block b as 32 bytes (signed for Q6_K, else unsigned;
 * scales come from k_scales) */
static inline __attribute__((always_inline)) __m256i k_bytes(const int type, const uint8_t *b, int j) {
    const __m256i m4y = _mm256_set1_epi8(0xF);
    if (type == T_Q6_K) {
        int h = j >> 2, g = j & 3;
        __m256i x = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (g & 1) * 32));
        x = (g >= 2) ? _mm256_and_si256(_mm256_srli_epi16(x, 4), m4y) : _mm256_and_si256(x, m4y);
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
        hb = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(x, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
    }
    const int five = type == T_Q5_K;
    __m256i x = _mm256_loadu_si256((const __m256i *)(b + (five ? 48 : 16) + (j >> 1) * 32));
    x = (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(x, 4), m4y) : _mm256_and_si256(x, m4y);
    if (five) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        h = _mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1));
        x = _mm256_or_si256(x, _mm256_slli_epi16(h, 4));
    }
    return x;
}

static inline __attribute__((always_inline)) void k_codes(const int type, const uint8_t *b, int j, __m256 q[4]) {
    __m256i x = k_bytes(type, b, j);
    bytes_to_f32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1), type == T_Q6_K, q);
}

static inline __attribute__((always_inline)) void chunk_avx2(const int type, const uint8_t *row,
                                                             int64_t c, __m256 v[4]) {
    switch (type) {
    case T_F32: {
        const float *p = (const float *)(row + c * 128);
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(p + 8 * i);
        return;
    }
    case T_F16: {
        const uint8_t *p = row + c * 64;
        for (int i = 0; i < 4; i++) v[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
        return;
    }
    case T_BF16: {
        const uint8_t *p = row + c * 64;
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i))), 16));
        return;
    }
    case T_Q8_0: {
        const uint8_t *b = row + c * 34;
        __m256 d = _mm256_set1_ps(h2f(rd16(b)));
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                        _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)))));
        return;
    }
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *b = row + c * (type == T_Q4_0 ? 18 : 20);
        __m256i q[4];
        nibbles(b + (type == T_Q4_0 ? 2 : 4), q);
        __m256 d = _mm256_set1_ps(h2f(rd16(b)));
        if (type == T_Q4_0) {
            for (int i = 0; i < 4; i++)
                v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8))));
        } else {
            __m256 m = _mm256_set1_ps(h2f(rd16(b + 2)));
            for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[i])), m);
        }
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        const int one = type == T_Q5_1;
        const uint8_t *b = row + c * (one ? 24 : 22);
        uint32_t qh = rd32(b + (one ? 4 : 2));
        __m256i q[4];
        nibbles(b + (one ? 8 : 6), q);
        __m256 d = _mm256_set1_ps(h2f(rd16(b)));
        for (int i = 0; i < 4; i++) {
            /* codes 0..15 take bits 0..15 of qh, codes 16..31 (the high nibbles) bits 16..31 */
            __m256i x = _mm256_or_si256(q[i], qh_bits(qh, i));
            if (!one) {
                v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(x, _mm256_set1_epi32(16))));
            } else {
                v[i] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(x)), _mm256_set1_ps(h2f(rd16(b + 2))));
            }
        }
        return;
    }
    case T_Q4_K: case T_Q5_K: case T_Q6_K: {
        const uint8_t *b = row + (c >> 3) * (type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210);
        int j = (int)(c & 7);
        float da, db, mn;
        k_scale(type, b, j, &da, &db, &mn);
        __m256 q[4];
        k_codes(type, b, j, q);
        for (int i = 0; i < 4; i++) { /* gguf's order: (d * sc) * q - dmin * m */
            __m256 y = _mm256_mul_ps(_mm256_set1_ps(i < 2 ? da : db), q[i]);
            v[i] = type == T_Q6_K ? y : _mm256_sub_ps(y, _mm256_set1_ps(-mn));
        }
        return;
    }
    }
}

#endif
#endif
