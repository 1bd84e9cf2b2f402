/* Shared by the CPU kernels: ggml type ids, f16 conversion, little-endian reads, the SIMD switch.
 *
 * The kernels read GGUF blocks as stored. They are built at first use for the running CPU: with
 * AVX2+FMA+F16C the intrinsics, otherwise the portable C path (UB_PORTABLE forces it).
 */
#ifndef UB_COMMON_H
#define UB_COMMON_H
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(UB_PORTABLE)
#include <immintrin.h>
#define UB_AVX2 1
#else
#define UB_AVX2 0
#endif
/* AVX-512F (built with -march=native where the CPU has it): the GEMV and GEMM use zmm vectors */
#if UB_AVX2 && defined(__AVX512F__)
#define UB_AVX512 1
#else
#define UB_AVX512 0
#endif

/* ggml type ids */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

static inline float h2f(uint16_t h) {
#if UB_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    float f;
    if (e == 0) {
        f = ldexpf((float)m, -24);
        memcpy(&bits, &f, 4);
        bits |= s;
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* K-quants: 6-bit scale and min of sub-block j from the 12 packed bytes (ggml's layout) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#if UB_AVX2
/* a weight row, a few rows ahead of the one being read, into L1 (the output head streams 170 MiB
 * a token; software prefetch measured faster than the hardware's alone, docs/backends.md) */
static inline void prefetch_row(const uint8_t *row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
}

static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x in [-87, 88]: 2^n * p(r), r = x - n ln2 (Cody-Waite), degree-6 polynomial; ~1 ulp.
 * One body for 8 and 16 lanes (W: the intrinsics' width; ROUND: to nearest): every lane gets the
 * same value either way. */
#define UB_EXP_BODY(W, ROUND)                                                                   \
    x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(-87.0f)), _mm##W##_set1_ps(88.0f)); \
    __m##W n = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)),                \
                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                            \
    __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x);                        \
    r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(-2.12194440e-4f), r);                            \
    __m##W p = _mm##W##_set1_ps(1.9875691500e-4f);                                              \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.3981999507e-3f));                            \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(8.3334519073e-3f));                            \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(4.1665795894e-2f));                            \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.6666665459e-1f));                            \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(5.0000001201e-1f));                            \
    p = _mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r, r), _mm##W##_add_ps(r, _mm##W##_set1_ps(1.0f)));  \
    __m##W##i e = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23); \
    return _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(e));

static inline __m256 exp_avx2(__m256 x) { UB_EXP_BODY(256, _mm256_round_ps) }
#if UB_AVX512
static inline __m512 exp_avx512(__m512 x) { UB_EXP_BODY(512, _mm512_roundscale_ps) }
#endif
#endif

/* Soft-capping c * tanh(x / c) (gemma2's attention scores and logits) as c - 2c / (exp(2x / c) + 1):
 * exp saturates at both ends, so large |x| give exactly +-c and nothing divides by zero. The
 * scalar form is the lanes' formula, so a row's values do not depend on where its vector loop ends. */
static inline float softcap1(float x, float c) {
    float z = 2.0f * x / c;
    z = z < -87.0f ? -87.0f : z > 88.0f ? 88.0f : z;
    return c - 2.0f * c / (expf(z) + 1.0f);
}
#if UB_AVX2
static inline __m256 softcap_avx2(__m256 x, float c) {
    __m256 vc = _mm256_set1_ps(c), one = _mm256_set1_ps(1.0f);
    __m256 e = exp_avx2(_mm256_mul_ps(x, _mm256_set1_ps(2.0f / c)));
    return _mm256_sub_ps(vc, _mm256_div_ps(_mm256_add_ps(vc, vc), _mm256_add_ps(e, one)));
}
#endif
#if UB_AVX512
static inline __m512 softcap_avx512(__m512 x, float c) {
    __m512 vc = _mm512_set1_ps(c), one = _mm512_set1_ps(1.0f);
    __m512 e = exp_avx512(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / c)));
    return _mm512_sub_ps(vc, _mm512_div_ps(_mm512_add_ps(vc, vc), _mm512_add_ps(e, one)));
}
#endif
/* n values capped in place or into out: 16, then 8 lanes, then the scalar form */
static inline void softcap_span(const float *x, int64_t n, float c, float *out) {
    int64_t i = 0;
#if UB_AVX512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, softcap_avx512(_mm512_loadu_ps(x + i), c));
#endif
#if UB_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, softcap_avx2(_mm256_loadu_ps(x + i), c));
#endif
    for (; i < n; i++) out[i] = softcap1(x[i], c);
}
#endif
