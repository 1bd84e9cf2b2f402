/* Matrix products and lookups on GGUF blocks: the GEMV of decode, the dequantised tiles of
 * prefill's GEMM, the embedding rows. Dequantisation is bit-exact to gguf-py (compiled with
 * -ffp-contract=off); dot products accumulate in f32 with FMA. Threads come from the OpenMP
 * runtime torch already loaded (the same libgomp), so the two never run two pools at once. */
#include "common.h"
#include "quant_scalar.h"
#include "quant_avx2.h"
#include "act16.h"

int ub_abi_version(void) { return 6; }
int ub_simd(void) { return UB_AVX2 ? 2 : 0; } /* 2: AVX2+FMA+F16C, 0: portable */

static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K; }
static inline int is_float(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }
#if UB_AVX2

/* one chunk's codes times M rows of 16-bit activations (xq: rows of k, sx: their chunk scales):
 * integer pair products into int32, then one FMA by d * s per row (two for Q6_K's two scales) */
static inline __attribute__((always_inline)) void codes_dot(const int type, const int M,
        const codes_t *k, const int16_t *xq, int64_t ldq, const float *sx, const float *xs,
        int64_t nc, int64_t c, __m256 *acc, float *mins) {
    const int sg = codes_signed(type);
    const __m256i c0 = sg ? _mm256_cvtepi8_epi16(k->lo) : _mm256_cvtepu8_epi16(k->lo);
    const __m256i c1 = sg ? _mm256_cvtepi8_epi16(k->hi) : _mm256_cvtepu8_epi16(k->hi);
    for (int r = 0; r < M; r++) {
        const __m256i *xr = (const __m256i *)(xq + r * ldq + c * 32);
        __m256i p0 = _mm256_madd_epi16(c0, _mm256_loadu_si256(xr));
        __m256i p1 = _mm256_madd_epi16(c1, _mm256_loadu_si256(xr + 1));
        float s = sx[r * nc + c];
        if (type == T_Q6_K) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(k->da * s), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(k->db * s), acc[r]);
        } else {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(k->da * s), acc[r]);
        }
        if (has_min(type)) mins[r] += k->m * xs[r * nc + c];
    }
}

/* M (1..8) activation rows against one weight row, all accumulators in registers. Float weights:
 * f32 x, FMA straight into two chains per row. Block types: the 16-bit activations, even and odd
 * chunks into separate chains when M <= 4. `xs` holds the 32-value sums of x (types with a min). */
static inline __attribute__((always_inline)) void row_dot_m(const int type, const int M,
        const uint8_t *row, int64_t nc, const float *x, int64_t ldx, const int16_t *xq,
        const float *sx, const float *xs, float *res) {
    __m256 ea[8], oa[8];
    float mins[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < 8; r++) ea[r] = oa[r] = _mm256_setzero_ps();
    const int two = M <= 4;
    if (is_float(type)) {
        for (int64_t c = 0; c < nc; c++) {
            __m256 v[4];
            chunk_avx2(type, row, c, v);
            const float *xc = x + c * 32;
            for (int r = 0; r < M; r++) {
                const float *xr = xc + r * ldx;
                ea[r] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xr), ea[r]);
                oa[r] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xr + 8), oa[r]);
                ea[r] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xr + 16), ea[r]);
                oa[r] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xr + 24), oa[r]);
            }
        }
    } else if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
        for (int64_t sb = 0; sb < nc / 8; sb++) {
            const uint8_t *b = row + sb * bs;
            float da[8], db[8], mn[8];
            k_scales(type, b, da, db, mn);
            for (int j = 0; j < 8; j++) {
                codes_t k;
                __m256i q = k_bytes(type, b, j);
                k.lo = _mm256_castsi256_si128(q), k.hi = _mm256_extracti128_si256(q, 1);
                k.da = da[j], k.db = db[j], k.m = mn[j];
                codes_dot(type, M, &k, xq, nc * 32, sx, xs, nc, sb * 8 + j, (two && (j & 1)) ? oa : ea, mins);
            }
        }
    } else {
        int64_t c = 0;
        for (; c + 1 < nc; c += 2) { /* unrolled so that each chain stays in registers */
            codes_t k0, k1;
            codes_avx2(type, row, c, &k0);
            codes_avx2(type, row, c + 1, &k1);
            codes_dot(type, M, &k0, xq, nc * 32, sx, xs, nc, c, ea, mins);
            codes_dot(type, M, &k1, xq, nc * 32, sx, xs, nc, c + 1, two ? oa : ea, mins);
        }
        if (c < nc) {
            codes_t k;
            codes_avx2(type, row, c, &k);
            codes_dot(type, M, &k, xq, nc * 32, sx, xs, nc, c, ea, mins);
        }
    }
    for (int r = 0; r < M; r++) res[r] = hsum(_mm256_add_ps(ea[r], oa[r])) + mins[r];
}

#define ROW_DOT(T)                                                                              \
    static void row_dot_##T(const uint8_t *row, int64_t nc, const float *x, int64_t ldx,        \
                            const int16_t *xq, const float *sx, const float *xs, int m,         \
                            float *res) {                                                       \
        switch (m) {                                                                            \
        case 1: row_dot_m(T, 1, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        case 2: row_dot_m(T, 2, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        case 3: row_dot_m(T, 3, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        case 4: row_dot_m(T, 4, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        case 5: row_dot_m(T, 5, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        case 6: row_dot_m(T, 6, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        case 7: row_dot_m(T, 7, row, nc, x, ldx, xq, sx, xs, res); break;                       \
        default: row_dot_m(T, 8, row, nc, x, ldx, xq, sx, xs, res); break;                      \
        }                                                                                       \
    }
ROW_DOT(T_F32) ROW_DOT(T_F16) ROW_DOT(T_BF16) ROW_DOT(T_Q8_0) ROW_DOT(T_Q4_0) ROW_DOT(T_Q4_1)
ROW_DOT(T_Q5_0) ROW_DOT(T_Q5_1) ROW_DOT(T_Q4_K) ROW_DOT(T_Q5_K) ROW_DOT(T_Q6_K)

typedef void (*row_dot_fn)(const uint8_t *, int64_t, const float *, int64_t, const int16_t *,
                           const float *, const float *, int, float *);

static row_dot_fn row_dot_for(int type) {
    switch (type) {
    case T_F32: return row_dot_T_F32;   case T_F16: return row_dot_T_F16;
    case T_BF16: return row_dot_T_BF16; case T_Q8_0: return row_dot_T_Q8_0;
    case T_Q4_0: return row_dot_T_Q4_0; case T_Q4_1: return row_dot_T_Q4_1;
    case T_Q5_0: return row_dot_T_Q5_0; case T_Q5_1: return row_dot_T_Q5_1;
    case T_Q4_K: return row_dot_T_Q4_K; case T_Q5_K: return row_dot_T_Q5_K;
    case T_Q6_K: return row_dot_T_Q6_K;
    }
    return 0;
}

static void chunk_store(int type, const uint8_t *row, int64_t c, float *o) {
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
static void dequant_row(int type, const uint8_t *row, int64_t k, float *o) {
    int64_t nc = k / 32;
    for (int64_t c = 0; c < nc; c++) chunk_store(type, row, c, o + 32 * c);
    for (int64_t l = nc * 32; l < k; l++) o[l] = tail_value(type, row, l);
}

/* y[r, n] = sum_k x[r, k] * W[n, k] for r < m, n < n_rows: each weight row is read once for all
 * m activation rows (in tiles of up to eight from L1) and never written out. Block types multiply
 * the 16-bit activations of act16.h; float types the f32 x itself. */
void ub_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k,
             const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int nth) {
    const int64_t nc = k / 32;
    const int quant = !is_float(type), tile = quant ? 8 : 4;
    /* the activations' 16-bit codes, chunk scales and (types with a min) chunk sums */
    int16_t q_stack[16 * 2048], *xq = q_stack; /* 64 KiB: 16 rows of 2048 on the stack */
    float s_stack[2 * 16 * 64], *sx = s_stack, *xs = s_stack + 16 * 64;
    if (quant && (m * k > 16 * 2048 || m * nc > 16 * 64)) {
        xq = (int16_t *)malloc(sizeof(int16_t) * m * k);
        sx = (float *)malloc(sizeof(float) * 2 * m * nc);
        xs = sx + m * nc;
    }
    if (quant)
        for (int64_t r = 0; r < m; r++)
            act16_row(x + r * ldx, nc, xq + r * k, sx + r * nc, has_min(type) ? xs + r * nc : 0);
#if UB_AVX2
    row_dot_fn dot = row_dot_for(type);
#endif
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t n = 0; n < n_rows; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t r0 = 0; r0 < m; r0 += tile) {
            int mt = (int)(m - r0 < tile ? m - r0 : tile);
            float res[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float *xr = x + r0 * ldx;
#if UB_AVX2
            dot(row, nc, xr, ldx, xq + r0 * k, sx + r0 * nc, xs + r0 * nc, mt, res);
#else
            float buf[32];
            for (int64_t c = 0; c < nc; c++) {
                chunk_scalar(type, row, c, buf);
                for (int r = 0; r < mt; r++) {
                    float t = 0;
                    if (quant) { /* the same 16-bit activations as the AVX2 build */
                        const int16_t *qc = xq + (r0 + r) * k + 32 * c;
                        const float sc = sx[(r0 + r) * nc + c];
                        for (int l = 0; l < 32; l++) t += buf[l] * ((float)qc[l] * sc);
                    } else {
                        const float *xc = xr + r * ldx + 32 * c;
                        for (int l = 0; l < 32; l++) t += buf[l] * xc[l];
                    }
                    res[r] += t;
                }
            }
#endif
            for (int64_t l = nc * 32; l < k; l++) {
                float wv = tail_value(type, row, l);
                for (int r = 0; r < mt; r++) res[r] += wv * xr[r * ldx + l];
            }
            for (int r = 0; r < mt; r++) y[(r0 + r) * ldy + n] = res[r];
        }
    }
    if (xq != q_stack) {
        free(xq);
        free(sx);
    }
}

/* rows r0 .. r0 + n of W dequantised into out (n, k): a tile for the BLAS GEMM of prefill */
void ub_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t n,
                     int64_t k, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + (r0 + i) * row_bytes, k, out + i * k);
}

/* rows ids[i] of W into out (n, k): the embedding lookup, straight from the blocks */
void ub_get_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *ids, int64_t n,
                 int64_t k, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (n > 8)
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + ids[i] * row_bytes, k, out + i * k);
}
