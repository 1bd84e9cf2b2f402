/* Activations of the block-type GEMV as 16-bit integers: per 32-value chunk, x[l] ~= s * q[l] with
 * s = amax / 32767 and q = x * (32767 / amax) rounded to nearest even. The weights' codes then
 * multiply q in integer pairs (16 products per instruction, exact in int32), and d * s scales each
 * chunk once. The relative error of a dot product is ~2e-5, far below what the 4-6-bit weights
 * carry; both builds compute the same q and s, so the native and portable kernels agree. */
#ifndef UB_ACT16_H
#define UB_ACT16_H
#include "common.h"

/* one row of k = 32 * nc values into q[k], s[nc], and (if sums) the chunks' sums of s * q */
static void act16_row(const float *x, int64_t nc, int16_t *q, float *s, float *sums) {
    for (int64_t c = 0; c < nc; c++) {
        const float *xc = x + 32 * c;
        int16_t *qc = q + 32 * c;
        int32_t isum = 0;
#if UB_AVX2
        __m256 v[4], am = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xc + 8 * i);
            am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float inv = amax > 0 ? 32767.0f / amax : 0.0f;
        __m256 iv = _mm256_set1_ps(inv);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], iv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], iv));
        _mm256_storeu_si256((__m256i *)qc, _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
        _mm256_storeu_si256((__m256i *)(qc + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
        if (sums) {
            __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
            isum = _mm_cvtsi128_si32(u);
        }
#else
        float amax = 0;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xc[l]));
        float inv = amax > 0 ? 32767.0f / amax : 0.0f;
        for (int l = 0; l < 32; l++) {
            qc[l] = (int16_t)fmaxf(-32767.0f, fminf(32767.0f, rintf(xc[l] * inv)));
            isum += qc[l];
        }
#endif
        s[c] = amax / 32767.0f;
        if (sums) sums[c] = s[c] * (float)isum; /* exact integer sum: the min term sees the same x */
    }
}
#endif
