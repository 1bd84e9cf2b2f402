/* The AVX2 build's integer products: activations as 16-bit integers with one f32 scale per 32
 * values (X16), weights as their integer codes widened to 16 bits, multiplied with `vpmaddwd`
 * (16 exact products a vector, summed in pairs into 32-bit lanes).
 *
 * Why: a 256-bit core does two 8-lane f32 FMAs a cycle; `vpmaddwd` does two 16-product
 * instructions a cycle on the same pipes, and a code widens to 16 bits in one or two integer
 * instructions where an f32 operand costs a shift and a conversion per lane. The price is x's
 * rounding: 2^-16 of the largest |x| of its 32 values, ~1.5e-5 (the fidelity this keeps is in
 * docs/backends.md). The 32-value sums are exact integers; what is f32 is the same in the GEMV and
 * the GEMM: each 32-value (Q6_K: 16-value) sum times the weight's scale times x's, accumulated
 * chunk after chunk, plus the min term of types with a min.
 */
#ifndef UB_QUANT_I16_H
#define UB_QUANT_I16_H
#include "quant_codes.h"
#if UB_AVX2 && !UB_AVX512
#define UB_X16 1

/* block types the integer path covers (float weights keep the f32 kernels) */
static inline int x16_type(int type) {
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}
static inline int x16_has_min(int type) {
    return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
}

/* 32 values of x as int16 q, with scale d (x ~ d q) and s = d * sum(q): the round to nearest of
 * x * (32767 / max|x|), so |q| <= 32767 and the 32-bit sums of 32 products with codes of at most
 * 8 bits cannot overflow. In order, or (eo) the even values then the odd ones. */
static inline void x16_chunk(const float *x, int eo, int16_t *q, float *d, float *s) {
    __m256 v[4], a = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        a = _mm256_max_ps(a, _mm256_and_ps(v[i], abs));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float amax = _mm_cvtss_f32(h);
    float id = amax > 0 ? 32767.0f / amax : 0.0f;
    __m256 vid = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vid)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vid));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vid)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vid));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    /* packs interleaves 128-bit halves: [0..3 8..11 | 4..7 12..15]; permute back to order */
    __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
    __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
    if (eo) { /* the GEMV's order: even values, then odd ones (bytes_i16's e and o) */
        const __m256i sh = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p0, sh), 0xD8); /* q0 q2 .. q14 | q1 .. q15 */
        __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p1, sh), 0xD8);
        p0 = _mm256_permute2x128_si256(a, b, 0x20);
        p1 = _mm256_permute2x128_si256(a, b, 0x31);
    }
    _mm256_storeu_si256((__m256i *)q, p0);
    _mm256_storeu_si256((__m256i *)(q + 16), p1);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *d = amax / 32767.0f;
    *s = *d * (float)_mm_cvtsi128_si32(s4);
}

/* 16 bytes of packed nibbles as 32 codes in one ymm: the low nibbles (values 0..15) in the low
 * half, the high ones (16..31) in the high half */
static inline __m256i nibble_bytes(const uint8_t *q) {
    __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi64(y, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0xF));
}

/* the 32 code bytes of a 32-value block type's chunk c (byte l = value l), its scale d and min
 * term m (w = d q + m); returns whether the codes are signed. Q5_0 on AVX2 is repacked to Q8_0
 * (quant/repack.py) but decodes here too. */
static inline __attribute__((always_inline)) int block_bytes(const int type, const uint8_t *row, int64_t c,
                                                             __m256i *y, float *d, float *m) {
    *m = 0;
    switch (type) {
    case T_Q8_0: {
        const uint8_t *b = row + c * 34;
        *d = h2f(rd16(b));
        *y = _mm256_loadu_si256((const __m256i *)(b + 2));
        return 1;
    }
    case T_Q4_0: case T_Q4_1: {
        const int one = type == T_Q4_1;
        const uint8_t *b = row + c * (one ? 20 : 18);
        __m256i v = nibble_bytes(b + (one ? 4 : 2));
        *d = h2f(rd16(b));
        if (one) *m = h2f(rd16(b + 2));
        *y = one ? v : _mm256_sub_epi8(v, _mm256_set1_epi8(8));
        return !one;
    }
    default: { /* Q5_0, Q5_1 */
        const int one = type == T_Q5_1;
        const uint8_t *b = row + c * (one ? 24 : 22);
        __m256i hb = bits_to_bytes(rd32(b + (one ? 4 : 2))), v = nibble_bytes(b + (one ? 8 : 6));
        *d = h2f(rd16(b));
        if (one) {
            *m = h2f(rd16(b + 2));
            *y = _mm256_or_si256(v, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
        } else { /* (code | bit << 4) - 16 == code | (bit ? 0 : 0xF0) as a signed byte */
            *y = _mm256_or_si256(v, _mm256_andnot_si256(hb, _mm256_set1_epi8((char)0xF0)));
        }
        return !one;
    }
    }
}

/* 32 code bytes as 16-bit lanes: e holds the even bytes of each 16-bit word, o the odd ones
 * (e: values 0,2,..,14 | 16,..,30; o: 1,3,..,15 | 17,..,31); two or three in-lane shifts */
static inline __attribute__((always_inline)) void bytes_i16(__m256i y, int sign, __m256i *e, __m256i *o) {
    if (sign) {
        *e = _mm256_srai_epi16(_mm256_slli_epi16(y, 8), 8);
        *o = _mm256_srai_epi16(y, 8);
    } else {
        *e = _mm256_and_si256(y, _mm256_set1_epi16(0xFF));
        *o = _mm256_srli_epi16(y, 8);
    }
}

/* a Q8_0 block's 32 codes as 16-bit lanes straight from memory, in order (e: values 0..15, o:
 * 16..31; x is then rounded in order too): two widening loads, where the byte form costs a load
 * and three shifts */
static inline __attribute__((always_inline)) void q8_i16(const uint8_t *b, __m256i *e, __m256i *o) {
    *e = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
    *o = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
}
#else
#define UB_X16 0
#endif
#endif
