/* The GEMV's decoders (AVX2 / AVX-512): a chunk's integer codes as floats plus its scales, so the
 * GEMV multiplies codes by x and scales once per chunk; AVX-512's prefill packing builds its
 * weights from them too. */
#ifndef UB_QUANT_CODES_H
#define UB_QUANT_CODES_H
#include "quant_avx2.h"
#if UB_AVX2
/* ---- the GEMV's decoders: integer codes as floats plus the chunk's scales -------------------
 * w[l] = d_a * q[l] + m (l < 16), d_b * q[l] + m (l >= 16); d_a == d_b except for Q6_K. The dot
 * product then takes d out of the inner loop: sum_l w[l] x[l] = d * sum_l q[l] x[l] + m * sum x.
 * The codes are GQ vectors: two zmm with AVX-512, in the chunk's order; four ymm with AVX2, in
 * lane order (below) where the codes are computed in a register. */
#if UB_AVX512
typedef __m512 gvec_t;
enum { GQ = 2 };
static inline void bytes_to_codes(__m128i lo, __m128i hi, int sign, gvec_t q[GQ]) {
    q[0] = _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo));
    q[1] = _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi));
}
#else
typedef __m256 gvec_t;
enum { GQ = 4 };
/* Lane order: the 32 code bytes of a chunk sit in one ymm (byte l = value l), and vector v takes
 * byte v of each 32-bit lane, so lane L of q[v] is value 4L + v. Shifts within the lanes widen
 * them, where sign-extending each quarter of a register costs a cross-lane shuffle; the GEMV
 * reads x permuted to match (gemv_permute in matmul.c). Measured on Zen 3, one row, 512 x 640
 * Q5_0: 63.1 -> 53.5 us (docs/backends.md). */
static inline __attribute__((always_inline)) void lanes_to_codes(__m256i y, int sign, gvec_t q[4]) {
    if (sign) {
        q[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(y, 24), 24));
        q[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(y, 16), 24));
        q[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(y, 8), 24));
        q[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(y, 24));
    } else {
        const __m256i ff = _mm256_set1_epi32(0xFF);
        q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(y, ff));
        q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(y, 8), ff));
        q[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(y, 16), ff));
        q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(y, 24));
    }
}

/* 16 bytes of packed nibbles as 32 codes in one ymm: the low nibbles (values 0..15) in the low
 * half, the high ones (16..31) in the high half */
static inline __m256i nibble_bytes(const uint8_t *q) {
    __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi64(y, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0xF));
}
#endif
typedef struct { gvec_t q[GQ]; float da, db, m; } codes_t;

/* the GEMV's codes of chunk j of a K-quant super-block */
static inline __attribute__((always_inline)) void k_codes_g(const int type, const uint8_t *b, int j, gvec_t q[GQ]) {
    __m256i x = k_bytes(type, b, j);
#if UB_AVX512
    bytes_to_codes(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1), type == T_Q6_K, q);
#else
    lanes_to_codes(x, type == T_Q6_K, q);
#endif
}

/* does the AVX2 GEMV read this type's codes in lane order (x permuted)? Q8_0's bytes are widened
 * straight from memory, in order */
static inline int gemv_lanes(int type) {
    return !UB_AVX512 && type != T_Q8_0 && type != T_F32 && type != T_F16 && type != T_BF16;
}

static inline __attribute__((always_inline)) void codes_avx2(const int type, const uint8_t *row,
                                                             int64_t c, codes_t *o) {
    o->m = 0;
#if UB_AVX512
    const __m128i m4 = _mm_set1_epi8(0xF);
    switch (type) {
    case T_Q8_0: {
        const uint8_t *b = row + c * 34;
        o->da = o->db = h2f(rd16(b));
        bytes_to_codes(_mm_loadu_si128((const __m128i *)(b + 2)), _mm_loadu_si128((const __m128i *)(b + 18)), 1, o->q);
        return;
    }
    case T_Q4_0: case T_Q4_1: {
        const int one = type == T_Q4_1;
        const uint8_t *b = row + c * (one ? 20 : 18);
        __m128i x = _mm_loadu_si128((const __m128i *)(b + (one ? 4 : 2)));
        __m128i lo = _mm_and_si128(x, m4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m4);
        o->da = o->db = h2f(rd16(b));
        if (one) {
            o->m = h2f(rd16(b + 2));
            bytes_to_codes(lo, hi, 0, o->q);
        } else {
            __m128i e = _mm_set1_epi8(8);
            bytes_to_codes(_mm_sub_epi8(lo, e), _mm_sub_epi8(hi, e), 1, o->q);
        }
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        const int one = type == T_Q5_1;
        const uint8_t *b = row + c * (one ? 24 : 22);
        __m256i hb = bits_to_bytes(rd32(b + (one ? 4 : 2)));
        __m128i x = _mm_loadu_si128((const __m128i *)(b + (one ? 8 : 6)));
        __m128i lo = _mm_and_si128(x, m4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m4);
        __m128i hlo = _mm256_castsi256_si128(hb), hhi = _mm256_extracti128_si256(hb, 1);
        o->da = o->db = h2f(rd16(b));
        if (one) { /* code | 16 where the bit is set, unsigned */
            __m128i s16 = _mm_set1_epi8(0x10);
            o->m = h2f(rd16(b + 2));
            bytes_to_codes(_mm_or_si128(lo, _mm_and_si128(hlo, s16)), _mm_or_si128(hi, _mm_and_si128(hhi, s16)), 0, o->q);
        } else { /* (code | bit << 4) - 16 == code | (bit ? 0 : 0xF0) as a signed byte */
            __m128i f0 = _mm_set1_epi8((char)0xF0);
            bytes_to_codes(_mm_or_si128(lo, _mm_andnot_si128(hlo, f0)), _mm_or_si128(hi, _mm_andnot_si128(hhi, f0)), 1, o->q);
        }
        return;
    }
    }
#else /* AVX2: lane order (above), but for Q8_0 */
    switch (type) {
    case T_Q8_0: { /* in order: each quarter sign-extended straight from memory */
        const uint8_t *b = row + c * 34;
        o->da = o->db = h2f(rd16(b));
        for (int i = 0; i < 4; i++)
            o->q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i))));
        return;
    }
    case T_Q4_0: case T_Q4_1: {
        const int one = type == T_Q4_1;
        const uint8_t *b = row + c * (one ? 20 : 18);
        __m256i y = nibble_bytes(b + (one ? 4 : 2));
        o->da = o->db = h2f(rd16(b));
        if (one) o->m = h2f(rd16(b + 2));
        lanes_to_codes(one ? y : _mm256_sub_epi8(y, _mm256_set1_epi8(8)), !one, o->q);
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        const int one = type == T_Q5_1;
        const uint8_t *b = row + c * (one ? 24 : 22);
        __m256i hb = bits_to_bytes(rd32(b + (one ? 4 : 2))), y = nibble_bytes(b + (one ? 8 : 6));
        o->da = o->db = h2f(rd16(b));
        if (one) { /* code | 16 where the bit is set, unsigned */
            o->m = h2f(rd16(b + 2));
            y = _mm256_or_si256(y, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
        } else { /* (code | bit << 4) - 16 == code | (bit ? 0 : 0xF0) as a signed byte */
            y = _mm256_or_si256(y, _mm256_andnot_si256(hb, _mm256_set1_epi8((char)0xF0)));
        }
        lanes_to_codes(y, !one, o->q);
        return;
    }
    }
#endif
}

#endif
#endif
