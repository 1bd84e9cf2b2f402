/* LoRA adapters' low-rank products, segmented (Punica's BGMV): one call per targeted matrix for
 * every adapter a ubatch applies. Each row gathers its own adapters' A and Bᵀ from the stack
 * (n_adapters, r_max, ·) and adds y[r] + Σ_slots c_k · scale · Bᵀ_kᵀ (A_k x[r]); rows applying no
 * adapter are copied (nothing when in place). Every row runs the same code on its own inputs, so
 * its result never depends on which rows share the call. The factors are f32, f16 or bf16. */
#include "common.h"

/* multiply-adds below which one thread does the whole call: on a busy machine a parallel region's
 * barrier costs more than a decode step's products (126 of them on a 270M model) */
enum { LORA_PAR = 1 << 20 };

#if UB_AVX2
#define FMA1(a, b, c) fmaf((a), (b), (c))
#else
#define FMA1(a, b, c) ((a) * (b) + (c))
#endif

static inline float ld1(int type, const uint8_t *p, int64_t i) {
    if (type == T_F16) return h2f(((const uint16_t *)p)[i]);
    if (type == T_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

#if UB_AVX512
static inline __m512 ld16(int type, const uint8_t *p, int64_t i) {
    if (type == T_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i)));
    if (type == T_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 2 * i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}
#endif
#if UB_AVX2
static inline __m256 ld8(int type, const uint8_t *p, int64_t i) {
    if (type == T_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i)));
    if (type == T_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

/* a · x over n values: two vector chains, their sum, then the tail */
static float lora_dot(int type, const uint8_t *a, const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if UB_AVX512
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        p0 = _mm512_fmadd_ps(ld16(type, a, i), _mm512_loadu_ps(x + i), p0);
        p1 = _mm512_fmadd_ps(ld16(type, a, i + 16), _mm512_loadu_ps(x + i + 16), p1);
    }
    for (; i + 16 <= n; i += 16) p0 = _mm512_fmadd_ps(ld16(type, a, i), _mm512_loadu_ps(x + i), p0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
#elif UB_AVX2
    __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        p0 = _mm256_fmadd_ps(ld8(type, a, i), _mm256_loadu_ps(x + i), p0);
        p1 = _mm256_fmadd_ps(ld8(type, a, i + 8), _mm256_loadu_ps(x + i + 8), p1);
    }
    for (; i + 8 <= n; i += 8) p0 = _mm256_fmadd_ps(ld8(type, a, i), _mm256_loadu_ps(x + i), p0);
    s = hsum(_mm256_add_ps(p0, p1));
#endif
    for (; i < n; i++) s = FMA1(ld1(type, a, i), x[i], s);
    return s;
}

/* one row: t = f · A_k x for each applied slot, then out = y + Σ t_q Bᵀ_k[q] column block by block */
static void lora_row(const float *yr, const float *xr, int64_t n_in, int64_t n_out, int type, const uint8_t *a,
                     const uint8_t *bt, int64_t r_max, const int32_t *rank, const float *c, const int32_t *idx,
                     const float *scale, int64_t m, float *o, float *t, const uint8_t **bk, int *rs) {
    const int64_t esz = type == T_F32 ? 4 : 2;
    int used = 0;
    for (int64_t j = 0; j < m; j++) {
        int32_t k = idx[j];
        if (k < 0) continue;
        int rk = rank[k];
        float f = scale[j] * c[k];
        if (rk == 0 || f == 0.0f) continue;
        const uint8_t *ak = a + (int64_t)k * r_max * n_in * esz;
        for (int q = 0; q < rk; q++) t[used * r_max + q] = f * lora_dot(type, ak + q * n_in * esz, xr, n_in);
        bk[used] = bt + (int64_t)k * r_max * n_out * esz;
        rs[used++] = rk;
    }
    if (!used) {
        if (o != yr) memcpy(o, yr, sizeof(float) * n_out);
        return;
    }
    int64_t j = 0;
#if UB_AVX512
    for (; j + 16 <= n_out; j += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int u = 0; u < used; u++)
            for (int q = 0; q < rs[u]; q++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(t[u * r_max + q]), ld16(type, bk[u], q * n_out + j), acc);
        _mm512_storeu_ps(o + j, _mm512_add_ps(_mm512_loadu_ps(yr + j), acc));
    }
#endif
#if UB_AVX2
    for (; j + 8 <= n_out; j += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int u = 0; u < used; u++)
            for (int q = 0; q < rs[u]; q++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(t[u * r_max + q]), ld8(type, bk[u], q * n_out + j), acc);
        _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(yr + j), acc));
    }
#endif
    for (; j < n_out; j++) {
        float acc = 0.0f;
        for (int u = 0; u < used; u++)
            for (int q = 0; q < rs[u]; q++) acc = FMA1(t[u * r_max + q], ld1(type, bk[u], q * n_out + j), acc);
        o[j] = yr[j] + acc;
    }
}

/* out (n, n_out) = y + each row's adapters' products on x (n, n_in); a (n_adapters, r_max, n_in)
 * and bt (n_adapters, r_max, n_out) of ggml type `type`; per adapter rank (0: not targeted) and c;
 * idx/scale (·, m): each row's adapters and user scales, row r reading row sel[r] of them (sel
 * NULL: row r). out may be y. */
void ub_lora(const float *y, const float *x, int64_t n, int64_t n_in, int64_t n_out, int type, const void *a,
             const void *bt, int64_t r_max, const int32_t *rank, const float *c, const int32_t *idx,
             const float *scale, int64_t m, const int64_t *sel, float *out, int nth) {
    const int64_t work = n * m * r_max * (n_in + n_out);
#pragma omp parallel num_threads(nth) if (work >= LORA_PAR && n > 1)
    {
        float t[m * r_max > 0 ? m * r_max : 1];
        const uint8_t *bk[m > 0 ? m : 1];
        int rs[m > 0 ? m : 1];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const int64_t s = sel ? sel[r] : r;
            lora_row(y + r * n_out, x + r * n_in, n_in, n_out, type, (const uint8_t *)a, (const uint8_t *)bt, r_max,
                     rank, c, idx + s * m, scale + s * m, m, out + r * n_out, t, bk, rs);
        }
    }
}
