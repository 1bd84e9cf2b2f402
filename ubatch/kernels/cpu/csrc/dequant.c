/* Weight values straight from the GGUF blocks, bit-exact to gguf-py's dequantize (compiled with
 * -ffp-contract=off: gguf's multiplies and adds in gguf's order, none fused): the panels of
 * prefill's GEMM (ub_dequant_span), tiles for the portable build's BLAS GEMM, embedding rows. */
#include "common.h"
#include "quant_scalar.h"
#include "quant_codes.h"
#include "quant_iq.h"

#if UB_AVX512
/* 32 values of a 32-value block type as two zmm from the GEMV's integer codes: d * q (+ min),
 * the same products and sums as the 8-lane decoder in half the instructions (the GEMM's packing
 * spent 0.14 ns a value on the 8-lane one, ~5% of a prefill GEMM); K-quants: k_span below */
static inline __attribute__((always_inline)) void chunk_avx512(const int type, const uint8_t *row, int64_t c,
                                                               __m512 v[2]) {
    codes_t k;
    codes_avx2(type, row, c, &k);
    for (int i = 0; i < 2; i++) {
        __m512 y = _mm512_mul_ps(_mm512_set1_ps(i ? k.db : k.da), k.q[i]);
        v[i] = type == T_Q4_1 || type == T_Q5_1 ? _mm512_add_ps(y, _mm512_set1_ps(k.m)) : y;
    }
}
#endif

#if UB_AVX2
static void chunk_store(int type, const uint8_t *row, int64_t c, float *o) {
#if UB_AVX512
    __m512 w[2];
    switch (type) {
#define CASE(T) case T: chunk_avx512(T, row, c, w); _mm512_storeu_ps(o, w[0]); _mm512_storeu_ps(o + 16, w[1]); return;
    CASE(T_Q8_0) CASE(T_Q4_0) CASE(T_Q4_1) CASE(T_Q5_0) CASE(T_Q5_1)
#undef CASE
    }
#endif
    __m256 v[4];
    switch (type) {
#define CASE(T) case T: chunk_avx2(T, row, c, v); break;
    CASE(T_F32) CASE(T_F16) CASE(T_BF16) CASE(T_Q8_0) CASE(T_Q4_0) CASE(T_Q4_1) CASE(T_Q5_0)
    CASE(T_Q5_1) CASE(T_Q4_K) CASE(T_Q5_K) CASE(T_Q6_K)
#undef CASE
    default: return;
    }
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, v[i]);
}
#else
static void chunk_store(int type, const uint8_t *row, int64_t c, float *o) { chunk_scalar(type, row, c, o); }
#endif

#if UB_AVX512
/* chunks [c0, c1) of a K-quant row: the eight chunks of a super-block share one k_scales (the
 * same products as k_scale's, so the same bits) */
static void k_span(const int type, const uint8_t *row, int64_t c0, int64_t c1, float *o) {
    const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    float da[8], db[8], mn[8];
    for (int64_t c = c0; c < c1; c++, o += 32) {
        const uint8_t *b = row + (c >> 3) * bs;
        int j = (int)(c & 7);
        if (c == c0 || j == 0) k_scales(type, b, da, db, mn);
        gvec_t q[GQ];
        k_codes_g(type, b, j, q);
        for (int i = 0; i < 2; i++) {
            __m512 y = _mm512_mul_ps(_mm512_set1_ps(i ? db[j] : da[j]), q[i]);
            _mm512_storeu_ps(o + 16 * i, type == T_Q6_K ? y : _mm512_sub_ps(y, _mm512_set1_ps(-mn[j])));
        }
    }
}
#endif

/* values [k0, k0 + n) of one weight row of k values (k0 a multiple of 32, k0 + n one too or k):
 * the GEMM's packing, and (k0 = 0, n = k) every whole row below */
void ub_dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, int64_t k, float *out) {
    if (iq_type(type)) { /* MXFP4, the IQ and TQ types: quant_iq.c */
        iq_span(type, row, k0, n, out);
        return;
    }
    int64_t end = k0 + n, nc = k / 32, c1 = end / 32 < nc ? end / 32 : nc;
#if UB_AVX512
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        if (type == T_Q4_K) k_span(T_Q4_K, row, k0 / 32, c1, out);
        else if (type == T_Q5_K) k_span(T_Q5_K, row, k0 / 32, c1, out);
        else k_span(T_Q6_K, row, k0 / 32, c1, out);
    } else
#endif
        for (int64_t c = k0 / 32; c < c1; c++) chunk_store(type, row, c, out + 32 * c - k0);
    for (int64_t l = c1 * 32; l < end; l++) out[l - k0] = tail_value(type, row, l);
}

/* rows r0 .. r0 + n of W dequantised into out (n, k): a tile for the BLAS GEMM of prefill */
void ub_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t n,
                     int64_t k, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t i = 0; i < n; i++) ub_dequant_span(type, w + (r0 + i) * row_bytes, 0, k, k, out + i * k);
}

/* rows ids[i] of W into out (n, k): the embedding lookup, straight from the blocks */
void ub_get_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *ids, int64_t n,
                 int64_t k, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (n > 8)
    for (int64_t i = 0; i < n; i++) ub_dequant_span(type, w + ids[i] * row_bytes, 0, k, k, out + i * k);
}
