/* Row-wise and elementwise ops (RMSNorm, RoPE, gated activation, add, scale, row gather, KV
 * write): one call each instead of several torch ops on tiny tensors. */
#include "common.h"

/* ---- row-wise ops that torch would run as several kernels each ------------------------------ */

/* out = x / sqrt(mean(x^2) + eps) * w over rows of n (the sum of squares in double, as ggml) */
void ub_rms_norm(const float *x, int64_t ldx, const float *w, int64_t rows, int64_t n, float eps,
                 float *out, int64_t ldo, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        double ss = 0;
        int64_t i0 = 0;
#if UB_AVX2 /* four chains of four doubles: the serial sum would cost ~4 cycles a value */
        __m256d sq[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
        for (; i0 + 16 <= n; i0 += 16)
            for (int j = 0; j < 4; j++) {
                __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(xr + i0 + 4 * j));
                sq[j] = _mm256_fmadd_pd(v, v, sq[j]);
            }
        __m256d t = _mm256_add_pd(_mm256_add_pd(sq[0], sq[1]), _mm256_add_pd(sq[2], sq[3]));
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
        ss = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
#endif
        for (int64_t i = i0; i < n; i++) ss += (double)xr[i] * (double)xr[i];
        float s = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * s) * w[i];
    }
}

/* RoPE over x (n_tok, n_head, d): the first 2*half dims rotate by cos/sin (n_tok, half), pairs
 * (i, i + half) for NEOX, (2i, 2i + 1) otherwise; the rest are copied */
void ub_rope(const float *x, const float *cs, const float *sn, int64_t n_tok, int64_t n_head,
             int64_t d, int64_t half, int neox, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (n_tok > 8)
    for (int64_t t = 0; t < n_tok; t++) {
        const float *c = cs + t * half, *s = sn + t * half;
        for (int64_t h = 0; h < n_head; h++) {
            const float *a = x + (t * n_head + h) * d;
            float *o = out + (t * n_head + h) * d;
            for (int64_t i = 0; i < half; i++) {
                int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                float x0 = a[i0], x1 = a[i1];
                o[i0] = x0 * c[i] - x1 * s[i];
                o[i1] = x0 * s[i] + x1 * c[i];
            }
            for (int64_t i = 2 * half; i < d; i++) o[i] = a[i];
        }
    }
}

/* ---- elementwise ops: one call instead of a torch op per tiny tensor ------------------------ */

/* gate * act(gate) * up with act = GELU (tanh form: x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)),
 * which is 0.5 x (1 + tanh(...)) without its cancellation) or SiLU (x * sigmoid(x)) */
static void glu_span(const float *gate, const float *up, int64_t i, int64_t n, int gelu, float *out) {
#if UB_AVX512 /* the 8-lane loop's steps on 16 lanes: the same value in every lane */
    const __m512 one16 = _mm512_set1_ps(1.0f), c016 = _mm512_set1_ps(-2.0f * 0.7978845608028654f),
                 c116 = _mm512_set1_ps(0.044715f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(gate + i), z;
        if (gelu)
            z = _mm512_mul_ps(c016, _mm512_fmadd_ps(c116, _mm512_mul_ps(_mm512_mul_ps(x, x), x), x));
        else
            z = _mm512_sub_ps(_mm512_setzero_ps(), x);
        __m512 g = _mm512_div_ps(x, _mm512_add_ps(one16, exp_avx512(z)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(g, _mm512_loadu_ps(up + i)));
    }
#endif
#if UB_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), c0 = _mm256_set1_ps(-2.0f * 0.7978845608028654f),
                 c1 = _mm256_set1_ps(0.044715f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(gate + i), z;
        if (gelu) {
            __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            z = _mm256_mul_ps(c0, _mm256_fmadd_ps(c1, x3, x));
        } else {
            z = _mm256_sub_ps(_mm256_setzero_ps(), x);
        }
        __m256 g = _mm256_div_ps(x, _mm256_add_ps(one, exp_avx2(z)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(g, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        float x = gate[i];
        float z = gelu ? -2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x) : -x;
        z = z > 88.0f ? 88.0f : z;
        out[i] = x / (1.0f + expf(z)) * up[i];
    }
}

/* prefill's gate is 512 x 2048 values a layer: split over the threads in spans of GLU_SPAN
 * (a multiple of 8, so every value takes the same vector or scalar path whatever the split) */
enum { GLU_SPAN = 16384 };
void ub_glu(const float *gate, const float *up, int64_t n, int gelu, float *out, int nth) {
    int64_t spans = (n + GLU_SPAN - 1) / GLU_SPAN;
#pragma omp parallel for num_threads(nth) schedule(static) if (spans > 1)
    for (int64_t sp = 0; sp < spans; sp++) {
        int64_t e = (sp + 1) * GLU_SPAN < n ? (sp + 1) * GLU_SPAN : n;
        glu_span(gate, up, sp * GLU_SPAN, e, gelu, out);
    }
}

/* residual adds and scales: a prefill's are 512 x 640 values, worth both cores (a decode's
 * few rows run on the calling thread) */
enum { ELT_PAR = 65536 };
void ub_add(const float *a, const float *b, int64_t n, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (n >= ELT_PAR)
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void ub_scale(const float *x, float s, int64_t n, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (n >= ELT_PAR)
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * s;
}

/* out (rows, n) = x + b with b (n) on every row: a projection's bias (qwen2's Q/K/V, phi's) */
void ub_add_bias(const float *x, const float *b, int64_t rows, int64_t n, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (rows * n >= ELT_PAR)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = xr[i] + b[i];
    }
}

/* out (rows, n) = c * tanh(x / c), row by row (gemma2's final logits: each row's values are the
 * same whatever other rows share the call) */
void ub_softcap(const float *x, float c, int64_t rows, int64_t n, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (rows * n >= ELT_PAR)
    for (int64_t r = 0; r < rows; r++) softcap_span(x + r * n, n, c, out + r * n);
}

/* out[i] = x[idx[i]] for rows of n floats (the rows that produce outputs) */
void ub_rows(const float *x, const int64_t *idx, int64_t n_idx, int64_t n, float *out) {
    for (int64_t i = 0; i < n_idx; i++) memcpy(out + i * n, x + idx[i] * n, sizeof(float) * n);
}

/* KV write: rows x (n_tok, width) f32 into cache rows cells[i], as f16 (round to nearest even,
 * as torch's .half()) or f32 */
void ub_kv_store(const float *x, int64_t n_tok, int64_t width, const int64_t *cells, int f16, void *cache) {
    for (int64_t t = 0; t < n_tok; t++) {
        const float *src = x + t * width;
        if (!f16) {
            memcpy((float *)cache + cells[t] * width, src, sizeof(float) * width);
            continue;
        }
        uint16_t *dst = (uint16_t *)cache + cells[t] * width;
        int64_t i = 0;
#if UB_AVX2
        for (; i + 8 <= width; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < width; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
#else
        for (; i < width; i++) {
            float f = src[i];
            uint32_t b; memcpy(&b, &f, 4);
            uint32_t s = (b >> 16) & 0x8000u, e = (b >> 23) & 0xffu, m = b & 0x7fffffu;
            uint16_t h;
            if (e == 0xff) h = (uint16_t)(s | 0x7c00u | (m ? 0x200u : 0));
            else {
                int ee = (int)e - 127 + 15;
                if (ee >= 31) h = (uint16_t)(s | 0x7c00u);
                else if (ee <= 0) {
                    if (ee < -10) h = (uint16_t)s;
                    else {
                        m |= 0x800000u;
                        int shift = 14 - ee;
                        uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
                        if (rem > half || (rem == half && (hm & 1))) hm++;
                        h = (uint16_t)(s | hm);
                    }
                } else {
                    uint32_t hm = m >> 13, rem = m & 0x1fffu;
                    uint32_t v = ((uint32_t)ee << 10) | hm;
                    if (rem > 0x1000u || (rem == 0x1000u && (hm & 1))) v++;
                    h = (uint16_t)(s | v);
                }
            }
            dst[i] = h;
        }
#endif
    }
}

/* ---- greedy sampling's argmax --------------------------------------------------------------- */

enum { ARGMAX_BLOCK = 16 }; /* the decode GEMV's rows per block (matmul.c GEMV_RB) */

/* the first maximum of y[a, b) as numpy's argmax finds it: the lowest index of the largest value,
 * a NaN larger than everything (the first NaN wins) */
static int64_t argmax_span(const float *y, int64_t a, int64_t b, float *best) {
    int64_t at = a, i = a;
    float m = y[a];
    if (m != m) return *best = m, a;
#if UB_AVX512 /* four chains of 16 lanes, each keeping its own first maximum; NaNs checked apart */
    if (b - a >= 64) {
        __m512 mv[4];
        __m512i iv[4], step = _mm512_set1_epi32(64);
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan = 0;
        for (int j = 0; j < 4; j++) {
            mv[j] = _mm512_set1_ps(m);
            iv[j] = _mm512_set1_epi32(0);
        }
        __m512i cur[4];
        for (int j = 0; j < 4; j++) cur[j] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * j));
        for (; i + 64 <= b; i += 64) {
            for (int j = 0; j < 4; j++) {
                __m512 v = _mm512_loadu_ps(y + i + 16 * j);
                __mmask16 gt = _mm512_cmp_ps_mask(v, mv[j], _CMP_GT_OQ);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                mv[j] = _mm512_mask_blend_ps(gt, mv[j], v);
                iv[j] = _mm512_mask_blend_epi32(gt, iv[j], cur[j]);
                cur[j] = _mm512_add_epi32(cur[j], step);
            }
        }
        if (nan) /* rare: the scalar scan below finds the first NaN */
            for (int64_t k = a; k < i; k++)
                if (y[k] != y[k]) return *best = y[k], k;
        float mx[64];
        int32_t ix[64];
        for (int j = 0; j < 4; j++) {
            _mm512_storeu_ps(mx + 16 * j, mv[j]);
            _mm512_storeu_si512(ix + 16 * j, iv[j]);
        }
        for (int l = 0; l < 64; l++) { /* offsets from a: a lane that never moved holds 0 (y[a] itself) */
            if (mx[l] > m || (mx[l] == m && a + ix[l] < at)) m = mx[l], at = a + ix[l];
        }
    }
#endif
    for (; i < b; i++) {
        float v = y[i];
        if (v != v) return *best = v, i;
        if (v > m) m = v, at = i;
    }
    *best = m;
    return at;
}

/* out[r] = the first maximum of row r of y (m rows of n floats, ldy apart), numpy's argmax. A
 * row splits between the threads as the decode GEMV's blocks of rows did (static, in order): the
 * lines still cached are in the core that wrote them. After a step of the default model most of
 * the 262144-wide row has left the caches (the head's 170 MiB streamed through since): in situ
 * this takes 37-40 us on two Zen 5 threads where numpy's pass took 42-46 (7 and 12 us warm). */
void ub_argmax_rows(const float *y, int64_t m, int64_t n, int64_t ldy, int32_t *out, int nth) {
    const int64_t n_blocks = (n + ARGMAX_BLOCK - 1) / ARGMAX_BLOCK;
    if (nth < 1 || n < 8192) nth = 1;
    float *best = (float *)malloc(sizeof(float) * m * nth);
    int64_t *at = (int64_t *)malloc(sizeof(int64_t) * m * nth);
    int used = nth;
#pragma omp parallel num_threads(nth)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        /* OpenMP's static split of n_blocks iterations: the first n_blocks % T threads take one more */
        const int64_t q = n_blocks / T, extra = n_blocks % T;
        const int64_t b0 = t * q + (t < extra ? t : extra), b1 = b0 + q + (t < extra);
        const int64_t a = b0 * ARGMAX_BLOCK, b = b1 * ARGMAX_BLOCK < n ? b1 * ARGMAX_BLOCK : n;
        for (int64_t r = 0; r < m; r++)
            at[r * nth + t] = a < b ? argmax_span(y + r * ldy, a, b, &best[r * nth + t]) : -1;
        if (t == 0) used = T;
    }
    for (int64_t r = 0; r < m; r++) {
        int64_t win = -1;
        float mx = 0;
        for (int t = 0; t < used; t++) { /* in order: a later equal value is not the first */
            const int64_t i = at[r * nth + t];
            const float v = best[r * nth + t];
            if (i < 0) continue;
            if (v != v) { /* the first NaN */
                win = i;
                break;
            }
            if (win < 0 || v > mx) win = i, mx = v;
        }
        out[r] = (int32_t)win;
    }
    free(best);
    free(at);
}
