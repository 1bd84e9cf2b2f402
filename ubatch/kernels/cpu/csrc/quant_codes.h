/* The AVX-512 GEMV's decoders: a chunk's integer codes as floats plus its scales, from which the
 * GEMV builds the chunk's weights once for all its rows; the prefill packing builds its weights
 * from them too. (The AVX2 build multiplies the integer codes themselves: quant_i16.h.) */
#ifndef UB_QUANT_CODES_H
#define UB_QUANT_CODES_H
#include "quant_avx2.h"
#if UB_AVX2
/* ---- integer codes as floats plus the chunk's scales ---------------------------------------
 * w[l] = d_a * q[l] + m (l < 16), d_b * q[l] + m (l >= 16); d_a == d_b except for Q6_K. The codes
 * are GQ vectors: two zmm in the chunk's order. (With AVX2, gvec_t is the f32 GEMV's vector.) */
#if UB_AVX512
typedef __m512 gvec_t;
enum { GQ = 2 };
static inline void bytes_to_codes(__m128i lo, __m128i hi, int sign, gvec_t q[GQ]) {
    q[0] = _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo));
    q[1] = _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi));
}
typedef struct { gvec_t q[GQ]; float da, db, m; } codes_t;

/* the GEMV's codes of chunk j of a K-quant super-block */
static inline __attribute__((always_inline)) void k_codes_g(const int type, const uint8_t *b, int j, gvec_t q[GQ]) {
    __m256i x = k_bytes(type, b, j);
    bytes_to_codes(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1), type == T_Q6_K, q);
}

static inline __attribute__((always_inline)) void codes_avx2(const int type, const uint8_t *row,
                                                             int64_t c, codes_t *o) {
    o->m = 0;
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
}
#else
typedef __m256 gvec_t;
enum { GQ = 4 };
#endif

#endif
#endif
