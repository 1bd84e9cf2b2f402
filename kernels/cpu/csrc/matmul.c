/* The GEMV of decode straight from the GGUF blocks (dequantised rows and spans: dequant.c). Dot
 * products accumulate in f32 with FMA. Threads come from the OpenMP runtime torch already loaded
 * (the same libgomp), so the two never run two pools at once. */
#include "common.h"
#include "quant_scalar.h"
#include "quant_codes.h"

int ub_abi_version(void) { return 14; }
int ub_simd(void) { return UB_AVX512 ? 3 : UB_AVX2 ? 2 : 0; } /* 3: AVX-512F, 2: AVX2+FMA+F16C, 0: portable */

#if UB_AVX2
static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K; }
static inline int is_float(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

#if UB_AVX512
#define G_ZERO _mm512_setzero_ps
#define G_LOAD _mm512_loadu_ps
#define G_FMA _mm512_fmadd_ps
#define G_SET1 _mm512_set1_ps
#define G_HSUM _mm512_reduce_add_ps
#define G_ADD _mm512_add_ps
#else
#define G_ZERO _mm256_setzero_ps
#define G_LOAD _mm256_loadu_ps
#define G_FMA _mm256_fmadd_ps
#define G_SET1 _mm256_set1_ps
#define G_HSUM hsum
#define G_ADD _mm256_add_ps
#endif
enum { GW = 32 / GQ }; /* floats per GEMV vector */
/* the accumulators of a block type's odd chunks: with AVX2 the even ones' (one chain a row), so
 * that an 8-row tile's accumulators, a chunk's four code vectors and the temporaries fit the 16
 * ymm registers; a chain gets one FMA a chunk, which does not bound the decode */
#define ODD_ACC(ea, oa) (UB_AVX512 ? (oa) : (ea))

/* decoded codes times M rows of x (at xc) into acc[0..M), the min term into mins (AVX2) */
static inline __attribute__((always_inline)) void codes_dot(const int type, const int M,
        codes_t *k, const float *xc, int64_t ldx, const float *xs, int64_t nc, int64_t c,
        gvec_t *acc, float *mins) {
#if UB_AVX512 /* 32 registers: the chunk's weights d * q + m once (two FMAs), then two FMAs a row
               * (the codes-times-x form costs three a row); no chunk sums of x are needed */
    k->q[0] = _mm512_fmadd_ps(k->q[0], G_SET1(k->da), G_SET1(k->m));
    k->q[1] = _mm512_fmadd_ps(k->q[1], G_SET1(k->db), G_SET1(k->m));
#endif
    for (int r = 0; r < M; r++) {
        const float *xr = xc + r * ldx;
#if UB_AVX512
        (void)xs, (void)nc, (void)c, (void)mins; /* the min is in the weights (above) */
        acc[r] = G_FMA(k->q[0], G_LOAD(xr), acc[r]);
        acc[r] = G_FMA(k->q[1], G_LOAD(xr + 16), acc[r]);
        continue;
#else
        __m256 a = _mm256_fmadd_ps(k->q[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(k->q[0], _mm256_loadu_ps(xr)));
        __m256 b = _mm256_fmadd_ps(k->q[3], _mm256_loadu_ps(xr + 24), _mm256_mul_ps(k->q[2], _mm256_loadu_ps(xr + 16)));
        /* Q6_K's two scales: in lane order values 0..15 are lanes 0..3 of every vector */
        __m256 d = type == T_Q6_K ? _mm256_setr_m128(_mm_set1_ps(k->da), _mm_set1_ps(k->db)) : _mm256_set1_ps(k->da);
        acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(a, b), acc[r]);
#endif
        if (type == T_Q4_1 || type == T_Q5_1) mins[r] += k->m * xs[r * nc + c]; /* K-quants: per super-block */
    }
}

/* one 32-value block type chunk times M rows */
static inline __attribute__((always_inline)) void chunk_dot(const int type, const int M,
        const uint8_t *row, int64_t c, const float *x, int64_t ldx, const float *xs, int64_t nc,
        gvec_t *acc, float *mins) {
    codes_t k;
    codes_avx2(type, row, c, &k);
    codes_dot(type, M, &k, x + c * 32, ldx, xs, nc, c, acc, mins);
}

/* 32 float-type weights as GQ vectors */
static inline __attribute__((always_inline)) void float_chunk(const int type, const uint8_t *row, int64_t c,
                                                              gvec_t v[GQ]) {
#if UB_AVX512
    const uint8_t *p = row + c * (type == T_F32 ? 128 : 64);
    for (int i = 0; i < 2; i++) {
        if (type == T_F32) v[i] = _mm512_loadu_ps((const float *)p + 16 * i);
        else if (type == T_F16) v[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * i)));
        else v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32 * i))), 16));
    }
#else
    chunk_avx2(type, row, c, v);
#endif
}

/* M (1..8) activation rows against one weight row, all accumulators in registers. Float weights
 * (tiles of at most 4): FMA straight into two chains per row. Block types (tiles of 8, so that a
 * 16-row product decodes each weight row twice, not four times): one chain per row whatever M
 * is, so that a row's result does not depend on how many rows share its call (a drafted batch
 * and a one-row decode give the same bits). `xs` holds the 32-value sums of x (AVX2, types with
 * a min; the AVX-512 path builds the min into the weights). */
static inline __attribute__((always_inline)) void row_dot_m(const int type, const int M,
        const uint8_t *row, int64_t nc, const float *x, int64_t ldx, const float *xs, float *res) {
    gvec_t ea[8], oa[8];
    float mins[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < 8; r++) ea[r] = oa[r] = G_ZERO();
    if (is_float(type)) {
        for (int64_t c = 0; c < nc; c++) {
            gvec_t v[GQ];
            float_chunk(type, row, c, v);
            const float *xc = x + c * 32;
            for (int r = 0; r < M; r++)
                for (int i = 0; i < GQ; i++) {
                    gvec_t *a = (i & 1) ? oa : ea;
                    a[r] = G_FMA(v[i], G_LOAD(xc + r * ldx + GW * i), a[r]);
                }
        }
    } else if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
        for (int64_t sb = 0; sb < nc / 8; sb++) {
            const uint8_t *b = row + sb * bs;
            float da[8], db[8], mn[8];
            k_scales(type, b, da, db, mn);
            for (int j = 0; j < 8; j += 2) { /* even chunks into ea, odd into oa: both chains stay in registers */
                codes_t k0, k1;
                k_codes_g(type, b, j, k0.q);
                k_codes_g(type, b, j + 1, k1.q);
                k0.da = da[j], k0.db = db[j], k0.m = UB_AVX512 ? mn[j] : 0; /* else added per super-block below */
                k1.da = da[j + 1], k1.db = db[j + 1], k1.m = UB_AVX512 ? mn[j + 1] : 0;
                int64_t c = sb * 8 + j;
                codes_dot(type, M, &k0, x + c * 32, ldx, xs, nc, c, ea, mins);
                codes_dot(type, M, &k1, x + (c + 1) * 32, ldx, xs, nc, c + 1, ODD_ACC(ea, oa), mins);
            }
#if !UB_AVX512
            if (has_min(type)) { /* the eight chunks' min terms, m . (chunk sums of x), in one FMA */
                __m256 mv = _mm256_loadu_ps(mn);
                for (int r = 0; r < M; r++) ea[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + r * nc + sb * 8), ea[r]);
            }
#endif
        }
    } else {
        int64_t c = 0;
        for (; c + 1 < nc; c += 2) {
            chunk_dot(type, M, row, c, x, ldx, xs, nc, ea, mins);
            chunk_dot(type, M, row, c + 1, x, ldx, xs, nc, ODD_ACC(ea, oa), mins);
        }
        if (c < nc) chunk_dot(type, M, row, c, x, ldx, xs, nc, ea, mins);
    }
    for (int r = 0; r < M; r++) res[r] = G_HSUM(G_ADD(ea[r], oa[r])) + mins[r];
}

/* row_dot_m instantiated per row count: tiles of 8 rows for block types, 4 for float weights
 * (ub_gemv's tile) */
#define ROW_CASE(T, n) case n: row_dot_m(T, n, row, nc, x, ldx, xs, res); break;
#define ROW_DOT_HEAD(T)                                                                         \
    static void row_dot_##T(const uint8_t *row, int64_t nc, const float *x, int64_t ldx,        \
                            const float *xs, int m, float *res)
#define ROW_DOT(T)                                                                              \
    ROW_DOT_HEAD(T) {                                                                           \
        switch (m) {                                                                            \
        ROW_CASE(T, 1) ROW_CASE(T, 2) ROW_CASE(T, 3) ROW_CASE(T, 4)                             \
        ROW_CASE(T, 5) ROW_CASE(T, 6) ROW_CASE(T, 7)                                            \
        default: row_dot_m(T, 8, row, nc, x, ldx, xs, res); break;                              \
        }                                                                                       \
    }
#define ROW_DOT_FLOAT(T)                                                                        \
    ROW_DOT_HEAD(T) {                                                                           \
        switch (m) {                                                                            \
        ROW_CASE(T, 1) ROW_CASE(T, 2) ROW_CASE(T, 3)                                            \
        default: row_dot_m(T, 4, row, nc, x, ldx, xs, res); break;                              \
        }                                                                                       \
    }
ROW_DOT_FLOAT(T_F32) ROW_DOT_FLOAT(T_F16) ROW_DOT_FLOAT(T_BF16) ROW_DOT(T_Q8_0) ROW_DOT(T_Q4_0)
ROW_DOT(T_Q4_1) ROW_DOT(T_Q5_0) ROW_DOT(T_Q5_1) ROW_DOT(T_Q4_K) ROW_DOT(T_Q5_K) ROW_DOT(T_Q6_K)

typedef void (*row_dot_fn)(const uint8_t *, int64_t, const float *, int64_t, const float *, int, float *);

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
#endif

#if UB_AVX2
/* x's whole chunks in lane order (quant_avx2.h): xp[32c + 8v + L] = x[32c + 4L + v]. A 4 x 4
 * transpose within each 128-bit half after pairing the halves: 12 shuffles a chunk and row. */
static void gemv_permute(const float *x, int64_t m, int64_t ldx, int64_t nc, float *xp) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < nc; c++) {
            const float *s = x + r * ldx + 32 * c;
            float *o = xp + (r * nc + c) * 32;
            __m256 x0 = _mm256_loadu_ps(s), x1 = _mm256_loadu_ps(s + 8);
            __m256 x2 = _mm256_loadu_ps(s + 16), x3 = _mm256_loadu_ps(s + 24);
            /* rows of the 4 x 4 blocks: values 0..3 | 16..19, 4..7 | 20..23, 8..11 | 24..27, ... */
            __m256 a = _mm256_permute2f128_ps(x0, x2, 0x20), b = _mm256_permute2f128_ps(x0, x2, 0x31);
            __m256 cc = _mm256_permute2f128_ps(x1, x3, 0x20), d = _mm256_permute2f128_ps(x1, x3, 0x31);
            __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
            __m256 t2 = _mm256_unpacklo_ps(cc, d), t3 = _mm256_unpackhi_ps(cc, d);
            _mm256_storeu_ps(o, _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2))));
            _mm256_storeu_ps(o + 8, _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2))));
            _mm256_storeu_ps(o + 16, _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3))));
            _mm256_storeu_ps(o + 24, _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3))));
        }
}
#endif

/* floats of scratch ub_gemv needs for m rows of k values: x in lane order (AVX2, types whose
 * codes are built in a register), then the 32-value sums of x (AVX2, types with a min) */
static int64_t gemv_scratch_parts(int type, int64_t m, int64_t k, int64_t *sums_at) {
    int64_t lanes = 0, sums = 0;
#if UB_AVX2
    if (gemv_lanes(type)) lanes = round_up(m * (k / 32) * 32, 16); /* 64-byte aligned parts */
    if (has_min(type) && !UB_AVX512) sums = m * (k / 32);
#else
    (void)type, (void)m, (void)k;
#endif
    if (sums_at) *sums_at = lanes;
    return lanes + sums;
}

int64_t ub_gemv_scratch(int type, int64_t m, int64_t k) { return gemv_scratch_parts(type, m, k, 0); }

/* y[r, n] = sum_k x[r, k] * W[n, k] for r < m, n < n_rows: each weight row is read once for all
 * m activation rows (in tiles of eight, four for float weights, from L1) and never written out.
 * scratch: ub_gemv_scratch(type, m, k) floats, planned by the caller (NULL: allocated here). */
enum { GEMV_RB = 16 };

void ub_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k,
             const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    int64_t nc = k / 32, sums_at = 0, need = gemv_scratch_parts(type, m, k, &sums_at);
    const int tile = (type == T_F32 || type == T_F16 || type == T_BF16) ? 4 : 8;
    float *own = need && !scratch ? (float *)malloc(sizeof(float) * need) : 0;
    if (own) scratch = own;
#if UB_AVX2
    row_dot_fn dot = row_dot_for(type);
    float *xp = scratch, *xs = scratch + sums_at;
    if (gemv_lanes(type)) gemv_permute(x, m, ldx, nc, xp); /* x in the decoders' lane order */
    if (has_min(type) && !UB_AVX512) { /* per 32-value chunk sums of x: the min term of every weight row */
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < nc; c++) {
                const float *xc = x + r * ldx + 32 * c;
                float s = 0;
                for (int l = 0; l < 32; l++) s += xc[l];
                xs[r * nc + c] = s;
            }
    }
#endif
    /* blocks of GEMV_RB weight rows: each block meets every tile of x in turn, so a tile's x
     * rows stay in L1 (16 rows of 640 floats are 40 KiB) and the block is re-read from L2 */
    int64_t n_blocks = (n_rows + GEMV_RB - 1) / GEMV_RB;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        int64_t n1 = (nb + 1) * GEMV_RB < n_rows ? (nb + 1) * GEMV_RB : n_rows;
        for (int64_t r0 = 0; r0 < m; r0 += tile) {
            int mt = (int)(m - r0 < tile ? m - r0 : tile);
            const float *xr = x + r0 * ldx;
#if UB_AVX2
            const float *xd = gemv_lanes(type) ? xp + r0 * nc * 32 : xr; /* what the decoders read */
            const int64_t ldd = gemv_lanes(type) ? nc * 32 : ldx;
#endif
            for (int64_t n = nb * GEMV_RB; n < n1; n++) {
                const uint8_t *row = w + n * row_bytes;
                float res[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#if UB_AVX2 /* the row four ahead into L1: measured +20% tg128 (the head streams 170 MiB a token) */
                if (r0 == 0)
                    for (int64_t o = 0; o < row_bytes; o += 64)
                        _mm_prefetch((const char *)row + 4 * row_bytes + o, _MM_HINT_T0);
                dot(row, nc, xd, ldd, xs + r0 * nc, mt, res);
#else
                float buf[32];
                for (int64_t c = 0; c < nc; c++) {
                    chunk_scalar(type, row, c, buf);
                    for (int r = 0; r < mt; r++) {
                        const float *xc = xr + r * ldx + 32 * c;
                        float s = 0;
                        for (int l = 0; l < 32; l++) s += buf[l] * xc[l];
                        res[r] += s;
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
    }
    free(own);
}
