/* Decode-shaped attention straight from the f16/f32 KV cells. */
#include "common.h"

/* ---- attention of a few query rows over f16/f32 KV cells, straight from the cache ----------- */

static inline float load_kv(const void *p, int f16, int64_t i) {
    return f16 ? h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static float dot_kv(const float *q, const void *k, int f16, int64_t d) {
#if UB_AVX2
    if (d % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            __m256 kv = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)k + i)))
                            : _mm256_loadu_ps((const float *)k + i);
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv, acc);
        }
        return hsum(acc);
    }
#endif
    float s = 0;
    for (int64_t i = 0; i < d; i++) s += q[i] * load_kv(k, f16, i);
    return s;
}

static void axpy_kv(float *acc, float a, const void *v, int f16, int64_t d) {
#if UB_AVX2
    if (d % 8 == 0) {
        __m256 av = _mm256_set1_ps(a);
        for (int64_t i = 0; i < d; i += 8) {
            __m256 vv = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i)))
                            : _mm256_loadu_ps((const float *)v + i);
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(av, vv, _mm256_loadu_ps(acc + i)));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) acc[i] += a * load_kv(v, f16, i);
}

/* q (g, t, h, d) f32; k, v: cells x (hkv, d | dv) in f32 or f16; starts[g]: first cell of group
 * g's stream; mask (g, t, n_kv) f16 additive (-inf hides a cell); out (g * t, h * dv).
 * One online-softmax pass per (group, token, head): each visible cell is read once per head. */
void ub_attn(const float *q, int64_t g, int64_t t, int64_t h, int64_t d, const void *k, int k_f16,
             const void *v, int v_f16, int64_t hkv, int64_t dv, const int64_t *starts, int64_t n_kv,
             const uint16_t *mask, float scale, float *out, int nth) {
    int64_t r = h / hkv, n_rows = g * t * h;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t row = 0; row < n_rows; row++) {
        int64_t gi = row / (t * h), ti = (row / h) % t, hi = row % h, kh = hi / r;
        const float *qr = q + row * d;
        const uint16_t *mr = mask + (gi * t + ti) * n_kv;
        float *acc = out + (gi * t + ti) * h * dv + hi * dv;
        float mx = -INFINITY, l = 0;
        for (int64_t i = 0; i < dv; i++) acc[i] = 0;
        for (int64_t c = 0; c < n_kv; c++) {
            if (mr[c] == 0xFC00u) continue; /* -inf: empty, other sequence, future, window */
            int64_t cell = starts[gi] + c;
            const uint8_t *kc = (const uint8_t *)k + (cell * hkv + kh) * d * (k_f16 ? 2 : 4);
            const uint8_t *vc = (const uint8_t *)v + (cell * hkv + kh) * dv * (v_f16 ? 2 : 4);
            float s = dot_kv(qr, kc, k_f16, d) * scale + (mr[c] ? h2f(mr[c]) : 0.0f);
            if (s > mx) {
                float corr = expf(mx - s);
                for (int64_t i = 0; i < dv; i++) acc[i] *= corr;
                l *= corr;
                mx = s;
            }
            float p = expf(s - mx);
            l += p;
            axpy_kv(acc, p, vc, v_f16, dv);
        }
        float inv = l > 0 ? 1.0f / l : 0.0f;
        for (int64_t i = 0; i < dv; i++) acc[i] *= inv;
    }
}
