/* The register-blocked MR x NR tile product shared by prefill's GEMM (gemm.c) and its fused
 * attention (flash.c): one FMA chain over k per output, x broadcast, weight panels k-major. */
#ifndef UB_TILE_H
#define UB_TILE_H
#include "common.h"

#if UB_AVX512
/* 512-bit: panels of 32 rows (two zmm), 12 x rows a strip: 24 accumulators of the 32 registers */
enum { NR = 32, MR = 12, KC = 256, NC = 64, MC = 96 };
#else
enum { NR = 16, MR = 6, KC = 256, NC = 64, MC = 96 };
#endif

#if UB_AVX2
#if UB_AVX512
typedef __m512 vec_t;
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_ZERO _mm512_setzero_ps
#define V_FMA _mm512_fmadd_ps
#define V_SET1 _mm512_set1_ps
#else
typedef __m256 vec_t;
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_ZERO _mm256_setzero_ps
#define V_FMA _mm256_fmadd_ps
#define V_SET1 _mm256_set1_ps
#endif
enum { VW = NR / 2 }; /* floats per vector: a panel row is two vectors */

/* c[M][NR] (+)= x[M][kc] . wp[kc][NR] (panel rows ldw floats apart) */
static inline __attribute__((always_inline)) void kernel(const int M, int64_t kc, const float *x, int64_t ldx,
                                                         const float *wp, int64_t ldw, float *c, int64_t ldc,
                                                         int acc) {
    vec_t a0[MR], a1[MR];
    for (int r = 0; r < M; r++) {
        a0[r] = acc ? V_LOAD(c + r * ldc) : V_ZERO();
        a1[r] = acc ? V_LOAD(c + r * ldc + VW) : V_ZERO();
    }
    /* k unrolled by 8: +4-5% on the Intel Xeon, AVX-512 and AVX2 builds alike (the same FMAs in
     * the same order, so the same bits) */
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            vec_t w0 = V_LOAD(wp + ldw * (k + u)), w1 = V_LOAD(wp + ldw * (k + u) + VW);
            for (int r = 0; r < M; r++) {
                vec_t b = V_SET1(x[r * ldx + k + u]); /* a broadcast load */
                a0[r] = V_FMA(w0, b, a0[r]);
                a1[r] = V_FMA(w1, b, a1[r]);
            }
        }
    }
    for (; k < kc; k++) {
        vec_t w0 = V_LOAD(wp + ldw * k), w1 = V_LOAD(wp + ldw * k + VW);
        for (int r = 0; r < M; r++) {
            vec_t b = V_SET1(x[r * ldx + k]);
            a0[r] = V_FMA(w0, b, a0[r]);
            a1[r] = V_FMA(w1, b, a1[r]);
        }
    }
    for (int r = 0; r < M; r++) {
        V_STORE(c + r * ldc, a0[r]);
        V_STORE(c + r * ldc + VW, a1[r]);
    }
}

#define K_CASE(n) case n: kernel(n, kc, x, ldx, wp, ldw, c, ldc, acc); break;
static void kernel_m(int m, int64_t kc, const float *x, int64_t ldx, const float *wp, int64_t ldw, float *c,
                     int64_t ldc, int acc) {
    switch (m) {
    K_CASE(1) K_CASE(2) K_CASE(3) K_CASE(4) K_CASE(5)
#if UB_AVX512
    K_CASE(6) K_CASE(7) K_CASE(8) K_CASE(9) K_CASE(10) K_CASE(11)
#endif
    default: kernel(MR, kc, x, ldx, wp, ldw, c, ldc, acc); break;
    }
}
#undef K_CASE

/* 8 x 8 floats: rows of src (stride ls) become columns of dst (stride ld) */
static inline void transpose8(const float *src, int64_t ls, float *dst, int64_t ld) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ls);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* kernel_m into c when only nr < NR of its columns exist: through a full-width tile */
static inline void kernel_part(int m, int64_t nr, int64_t kc, const float *x, int64_t ldx, const float *wp,
                               int64_t ldw, float *c, int64_t ldc, int acc) {
    float tile[MR * NR] = {0};
    for (int r = 0; r < m && acc; r++) memcpy(tile + r * NR, c + r * ldc, sizeof(float) * nr);
    kernel_m(m, kc, x, ldx, wp, ldw, tile, NR, acc);
    for (int r = 0; r < m; r++) memcpy(c + r * ldc, tile + r * NR, sizeof(float) * nr);
}
#endif /* UB_AVX2 */
#endif
