/* Decode-shaped attention straight from the f16/f32 KV cells. */
#include "common.h"

/* ---- attention of a few query rows over f16/f32 KV cells, straight from the cache ----------- */

static inline float load_kv(const void *p, int f16, int64_t i) {
    return f16 ? h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static float dot_kv(const float *q, const void *k, int f16, int64_t d) {
#if UB_AVX512
    /* the same four chains in zmm: a head of 128 values is two turns of four FMAs */
    if (d % 64 == 0) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t i = 0; i < d; i += 64)
            for (int j = 0; j < 4; j++) {
                const int64_t o = i + 16 * j;
                __m512 kv = f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + o)))
                                : _mm512_loadu_ps((const float *)k + o);
                a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + o), kv, a[j]);
            }
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    }
#endif
#if UB_AVX2
    /* four independent chains: one chain of d / 8 FMAs waits on each FMA's latency (a head of 256
     * values: 32 x 4 cycles a cell, where the loads and FMAs need about 16) */
    if (d % 32 == 0) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < d; i += 32)
            for (int j = 0; j < 4; j++) {
                const int64_t o = i + 8 * j;
                __m256 kv = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)k + o)))
                                : _mm256_loadu_ps((const float *)k + o);
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + o), kv, a[j]);
            }
        return hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    }
#endif
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
#if UB_AVX512
    if (d % 16 == 0) {
        __m512 av = _mm512_set1_ps(a);
        for (int64_t i = 0; i < d; i += 16) {
            __m512 vv = f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i)))
                            : _mm512_loadu_ps((const float *)v + i);
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(av, vv, _mm512_loadu_ps(acc + i)));
        }
        return;
    }
#endif
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
 * g's stream; mask (g, t, n_kv) f16 additive (-inf hides a cell); softcap > 0: each score
 * becomes softcap * tanh(score / softcap) before the scale (gemma2); out (g * t, h * dv).
 * One online-softmax pass per (group, token, head): each visible cell is read once per head. */
void ub_attn(const float *q, int64_t g, int64_t t, int64_t h, int64_t d, const void *k, int k_f16,
             const void *v, int v_f16, int64_t hkv, int64_t dv, const int64_t *starts, int64_t n_kv,
             const uint16_t *mask, float scale, float softcap, float *out, int nth) {
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
            float s = dot_kv(qr, kc, k_f16, d);
            if (softcap > 0) s = softcap1(s, softcap); /* llama.cpp's order: cap, scale, mask */
            s = s * scale + (mr[c] ? h2f(mr[c]) : 0.0f);
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

/* ---- the softmax step of prefill's chunked attention ---------------------------------------- */

#define UB_MASKED (-1e30f) /* kernels/ops.py MASKED: the running max never drops below it */

/* One row of flash attention's online-softmax step, in place: x (cc scores) becomes
 * s * scale + mask, the running max *mp and sum *lp are updated, the accumulator row a (dv
 * floats) is rescaled by exp(m_old - m_new), and x is left holding exp(x - m_new) for the P.V
 * product that follows. torch needs ten passes over a tile for this; here it is two. */
void ub_softmax_row(float *x, int64_t cc, const uint16_t *mr, float scale, float softcap, float *mp, float *lp,
                    float *a, int64_t dv) {
    float mx = -INFINITY, sum = 0.0f;
    int64_t c = 0;
    if (softcap > 0) softcap_span(x, cc, softcap, x); /* gemma2: the raw scores capped first */
#if UB_AVX512
    __m512 ws = _mm512_set1_ps(scale), wmx = _mm512_set1_ps(-INFINITY);
    for (; c + 16 <= cc; c += 16) {
        __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), ws, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mr + c))));
        _mm512_storeu_ps(x + c, v);
        wmx = _mm512_max_ps(wmx, v);
    }
    mx = _mm512_reduce_max_ps(wmx);
#endif
#if UB_AVX2
    __m256 vs = _mm256_set1_ps(scale), vmx = _mm256_set1_ps(mx);
    for (; c + 8 <= cc; c += 8) {
        __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), vs, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr + c))));
        _mm256_storeu_ps(x + c, v);
        vmx = _mm256_max_ps(vmx, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int k = 0; k < 8; k++) mx = fmaxf(mx, lanes[k]);
#endif
    for (; c < cc; c++) {
        x[c] = x[c] * scale + h2f(mr[c]);
        mx = fmaxf(mx, x[c]);
    }
    float mnew = fmaxf(fmaxf(mx, *mp), UB_MASKED), corr = expf(*mp - mnew);
    c = 0;
#if UB_AVX512
    __m512 wm = _mm512_set1_ps(mnew), wfloor = _mm512_set1_ps(-87.0f), wsum = _mm512_setzero_ps();
    for (; c + 16 <= cc; c += 16) {
        __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + c), wm);
        __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, wfloor, _CMP_GE_OQ), exp_avx512(d));
        _mm512_storeu_ps(x + c, p);
        wsum = _mm512_add_ps(wsum, p);
    }
    sum = _mm512_reduce_add_ps(wsum);
#endif
#if UB_AVX2
    __m256 vm = _mm256_set1_ps(mnew), floor = _mm256_set1_ps(-87.0f), vsum = _mm256_setzero_ps();
    for (; c + 8 <= cc; c += 8) {
        __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + c), vm);
        /* below -87 exp is under 2^-125: a hidden cell (-inf) must add exactly nothing */
        __m256 p = _mm256_and_ps(exp_avx2(d), _mm256_cmp_ps(d, floor, _CMP_GE_OQ));
        _mm256_storeu_ps(x + c, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    sum += hsum(vsum);
#endif
    for (; c < cc; c++) {
        x[c] = expf(x[c] - mnew);
        sum += x[c];
    }
    *lp = *lp * corr + sum;
    for (int64_t k = 0; k < dv; k++) a[k] *= corr;
    *mp = mnew;
}

/* The step on a score tile s of nb x rows score rows of cc cells (batch bi = group x KV head;
 * row j is token j / r, query head j % r); m, l and acc rows as in ub_softmax_row. */
void ub_softmax_tile(float *s, int64_t nb, int64_t rows, int64_t cc, const uint16_t *mask, int64_t hkv,
                     int64_t r, int64_t mask_sg, int64_t mask_st, float scale, float softcap, float *m, float *l,
                     int64_t ml_sb, float *acc, int64_t acc_sb, int64_t dv, int nth) {
    int64_t n = nb * rows;
#pragma omp parallel for num_threads(nth) schedule(static) if (n * cc > 16384)
    for (int64_t i = 0; i < n; i++) {
        int64_t bi = i / rows, j = i % rows;
        ub_softmax_row(s + i * cc, cc, mask + (bi / hkv) * mask_sg + (j / r) * mask_st, scale, softcap,
                       m + bi * ml_sb + j, l + bi * ml_sb + j, acc + bi * acc_sb + j * dv, dv);
    }
}

/* [lo, hi) of the cells in a mask tile (g x tb rows of c cells; row strides sg, st) that some
 * row sees, as lo | hi << 32 (lo >= hi: none). A causal prefill's early query blocks see a
 * prefix of a later chunk or none of it; the chunked attention narrows or skips those tiles. */
#define HIDDEN4 0xFC00FC00FC00FC00ull /* four f16 -inf */
int64_t ub_mask_span(const uint16_t *mask, int64_t g, int64_t tb, int64_t c, int64_t sg, int64_t st) {
    int64_t lo = c, hi = 0;
    for (int64_t gi = 0; gi < g; gi++)
        for (int64_t t = 0; t < tb; t++) {
            const uint16_t *row = mask + gi * sg + t * st;
            int64_t a = 0, b = c;
            uint64_t w;
            while (a + 4 <= lo && (memcpy(&w, row + a, 8), w == HIDDEN4)) a += 4; /* four cells a step */
            while (a < lo && row[a] == 0xFC00u) a++;
            if (a < lo) lo = a;
            while (b - 4 >= hi && (memcpy(&w, row + b - 4, 8), w == HIDDEN4)) b -= 4;
            while (b > hi && row[b - 1] == 0xFC00u) b--;
            if (b > hi) hi = b;
        }
    return lo < hi ? lo | (hi << 32) : 0;
}
