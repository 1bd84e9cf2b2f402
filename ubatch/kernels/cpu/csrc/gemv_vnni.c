/* The AVX-512 build's decode GEMV for the K-quants (Q4_K, Q5_K, Q6_K): integer products with
 * x as 16-bit integers, `vpdpwssd` (AVX512-VNNI; `vpmaddwd` + `vpaddd` without it, the same
 * exact sums).
 *
 * Why: the f32 GEMV (matmul.c row_dot_m) widens each chunk's codes to floats and builds its 32
 * weights with two FMAs before the two FMAs a row; one row of a 1-2B model's layers ran at half
 * llama.cpp's speed per core, bound by those instructions, not by memory. Here a super-block's
 * codes are widened to 16 bits (one `vpmovzxbw` per 64 values and a mask or shift per 32) and
 * multiplied by their 6-bit (Q6_K: 8-bit) sub-block scales (`vpmullw`: |code * scale| <= 4096
 * fits 16 bits), once for all rows of x; then per row `vpdpwssd` sums the whole super-block into
 * 16 exact 32-bit lanes, and a conversion and an FMA scale them by d times x's scale.
 *
 * x: one scale per 256 values (a super-block, so that its eight sub-blocks' integer sums add
 * before any f32 step), in two 16-bit planes: q = round(x * 32767 / max|x|) and the rest times
 * 2^15 (vn_round), eight `vpdpwssd` a plane and row. One plane alone (x to 2^-16 of its block's
 * largest |x|) gave the right KLD but turned 1e-7 differences upstream (f32 sums in another
 * order, as between prefill's GEMM and this GEMV) into whole rounding steps, ~1e-4 of a logit;
 * with the two, x is as exact as f32 makes it (prefill's GEMM below reads it to 2^-24). The lanes
 * cannot overflow: a lane sums 16 products of |q| <= 32767 (|lo| <= 2^14) and |code * scale| <=
 * 945 (Q4_K), 1953 (Q5_K), 4096 (Q6_K): at most 2^31 - 65535. The min term of Q4_K/Q5_K, -dmin *
 * m_j * sum(x of sub-block j), takes x's per-32 sums in one FMA a super-block. Every row takes
 * the same steps whatever the row count, and x is rounded row by row, so a row's bits never
 * depend on the rows sharing its call.
 */
#include "common.h"
#include "quant_avx2.h"
#include "tile.h"

#if UB_AVX512 && defined(__AVX512BW__)
#define UB_VNNI 1

int ub_vnni(void) {
#ifdef __AVX512VNNI__
    return 2;
#else
    return 1;
#endif
}

static inline __m512i vn_dp(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

static inline int vn_type(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* 256 values of x as two planes of int16 (in order): q = round(x * 32767 / max|x|) and the rest
 * lo = round((x * 32767 / max|x| - q) * 2^15), |lo| <= 2^14, so x = d (q + lo 2^-15) to about
 * 2^-30 of the super-block's largest |x| (f32's own rounding of x * 32767 / max|x| dominates);
 * its scale d = max|x| / 32767 and the eight per-32 sums of x, d (sum q + 2^-15 sum lo) */
/* 256 values of x loaded into v, and the first plane's scale: x * vid rounds to q with |q| <=
 * 32767, d = max|x| / 32767 (the GEMV's and the GEMM's rounding share it, so both read x alike) */
static inline __attribute__((always_inline)) __m512 vn_scale(const float *x, __m512 v[16], float *d) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < 16; i++) {
        v[i] = _mm512_loadu_ps(x + 16 * i);
        a = _mm512_max_ps(a, _mm512_abs_ps(v[i]));
    }
    const float amax = _mm512_reduce_max_ps(a);
    *d = amax / 32767.0f;
    return _mm512_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
}

static void vn_round(const float *x, int16_t *q, float *d, float *s) {
    __m512 v[16];
    const __m512 vid = vn_scale(x, v, d), two15 = _mm512_set1_ps(32768.0f);
    for (int j = 0; j < 8; j++) {
        __m512i hi[2], lo[2];
        for (int h = 0; h < 2; h++) {
            const __m512 t = _mm512_mul_ps(v[2 * j + h], vid);
            hi[h] = _mm512_cvtps_epi32(t);
            lo[h] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(hi[h])), two15)); /* exact difference */
            _mm256_storeu_si256((__m256i *)(q + 32 * j + 16 * h), _mm512_cvtsepi32_epi16(hi[h]));
            _mm256_storeu_si256((__m256i *)(q + 256 + 32 * j + 16 * h), _mm512_cvtsepi32_epi16(lo[h]));
        }
        const float sh = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(hi[0], hi[1]));
        const float sl = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(lo[0], lo[1]));
        s[j] = *d * (sh + sl * (1.0f / 32768.0f));
    }
}

/* a super-block's 256 codes times their sub-block scales as 16-bit integers (w[j]: sub-block j,
 * values in order), its d, and (Q4_K, Q5_K) the eight min terms -dmin * m_j in mn's low half */
static inline __attribute__((always_inline)) void vn_codes(const int type, const uint8_t *b, __m512i w[8], float *d,
                                                           __m512 *mn) {
    const __m512i m4 = _mm512_set1_epi16(0xF);
    if (type == T_Q6_K) {
        /* the 16 int8 scales as words; chunk j takes scale 2j for values 0..15, 2j + 1 for 16..31 */
        const __m512i sc = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 192))));
        const __m512i m30 = _mm512_set1_epi16(0x30), c32 = _mm512_set1_epi16(32);
        *d = h2f(rd16(b + 208));
        *mn = _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
            const __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
            const __m512i hb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            __m512i c[4];
            c[0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30));
            c[1] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30));
            c[2] = _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(hb, m30));
            c[3] = _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(hb, 2), m30));
            for (int g = 0; g < 4; g++) {
                const int j = 4 * h + g;
                const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)), _mm256_set1_epi16((short)(2 * j + 1)), 1);
                w[j] = _mm512_mullo_epi16(_mm512_sub_epi16(c[g], c32), _mm512_permutexvar_epi16(idx, sc));
            }
        }
        return;
    }
    /* Q4_K, Q5_K: the 12 packed bytes as 8 six-bit scales, then 8 six-bit mins (as k_scales) */
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3fu, q4 = 0x0f0f0f0fu, m2 = 0x03030303u, mins_lo = u[1] & m6;
    u[3] = ((u[2] >> 4) & q4) | (((u[1] >> 6) & m2) << 4);
    u[1] = (u[2] & q4) | (((u[0] >> 6) & m2) << 4);
    u[2] = mins_lo;
    u[0] &= m6;
    const __m128i v = _mm_loadu_si128((const __m128i *)u);
    const uint8_t *sc = (const uint8_t *)u;
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    /* -(dmin * m): the sign flip is exact; the same products as k_scales' */
    *mn = _mm512_zextps256_ps512(_mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(_mm256_set1_ps(h2f(rd16(b + 2))), m)));
    *d = h2f(rd16(b));
    const int five = type == T_Q5_K;
    const uint8_t *qs = b + (five ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if (five) qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)));
    const __m512i m10 = _mm512_set1_epi16(0x10);
    for (int p = 0; p < 4; p++) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * p)));
        __m512i c[2] = {_mm512_and_si512(x, m4), _mm512_srli_epi16(x, 4)};
        for (int i = 0; i < 2; i++) {
            const int j = 2 * p + i;
            if (five) { /* bit j of each qh byte as the code's bit 4 */
                const __m512i hj = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
                c[i] = _mm512_or_si512(c[i], _mm512_and_si512(hj, m10));
            }
            w[j] = _mm512_mullo_epi16(c[i], _mm512_set1_epi16(sc[j]));
        }
    }
}

/* rows of x a span meets each weight row with: at 6 to 8 the tile's accumulators and the x it
 * reads no longer fit the registers beside the decoded super-block, and a row-super-block cost
 * 7.5-9.4 ns against 5.1 at 4 (Zen 5, 2 threads, a 32768 x 2048 Q4_K matrix, 1 to 16 rows) */
enum { VN_TILE = 4 };

/* M (1..VN_TILE) rows of rounded x against one weight row of nsb super-blocks: xq rows ldq int16 apart,
 * xd (per super-block) and xs (per 32 values) rows ldd and 8 * ldd floats apart */
static inline __attribute__((always_inline)) void vn_dot_m(const int type, const int M, const uint8_t *row,
        int64_t nsb, const int16_t *xq, int64_t ldq, const float *xd, const float *xs, int64_t ldd, float *res) {
    const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const int has_min = type != T_Q6_K;
    __m512 acc[VN_TILE];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i w[8];
        __m512 mn;
        float d;
        vn_codes(type, row + sb * bs, w, &d, &mn);
        for (int r = 0; r < M; r++) {
            const __m512i *xr = (const __m512i *)(xq + r * ldq + sb * 512); /* q, then lo */
            /* two chains a plane (the sums are exact integers: any order gives the same bits) */
            __m512i h0 = _mm512_madd_epi16(w[0], _mm512_loadu_si512(xr));
            __m512i h1 = _mm512_madd_epi16(w[1], _mm512_loadu_si512(xr + 1));
            __m512i l0 = _mm512_madd_epi16(w[0], _mm512_loadu_si512(xr + 8));
            __m512i l1 = _mm512_madd_epi16(w[1], _mm512_loadu_si512(xr + 9));
            for (int j = 2; j < 8; j += 2) {
                h0 = vn_dp(h0, w[j], _mm512_loadu_si512(xr + j));
                h1 = vn_dp(h1, w[j + 1], _mm512_loadu_si512(xr + j + 1));
                l0 = vn_dp(l0, w[j], _mm512_loadu_si512(xr + 8 + j));
                l1 = vn_dp(l1, w[j + 1], _mm512_loadu_si512(xr + 9 + j));
            }
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(l0, l1)), _mm512_set1_ps(1.0f / 32768.0f),
                                             _mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)));
            acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(d * xd[r * ldd + sb]), acc[r]);
            if (has_min)
                acc[r] = _mm512_fmadd_ps(mn, _mm512_zextps256_ps512(_mm256_loadu_ps(xs + (r * ldd + sb) * 8)), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}

/* vn_dot_m over weight rows [n0, n1) for a tile of M rows of x; the tile that reads a row first
 * prefetches the row eight ahead into L1, as the AVX2 GEMV does */
static inline __attribute__((always_inline)) void vn_span_m(const int type, const int M, const uint8_t *w,
        int64_t row_bytes, int64_t n0, int64_t n1, int first, int64_t nsb, const int16_t *xq, int64_t ldq,
        const float *xd, const float *xs, int64_t ldd, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float res[VN_TILE];
        if (first) prefetch_row(row + 8 * row_bytes, row_bytes);
        vn_dot_m(type, M, row, nsb, xq, ldq, xd, xs, ldd, res);
        for (int r = 0; r < M; r++) y[r * ldy + n] = res[r];
    }
}

#define VN_CASE(T, n) case n: vn_span_m(T, n, w, row_bytes, n0, n1, first, nsb, xq, ldq, xd, xs, ldd, y, ldy); break;
#define VN_SPAN(T)                                                                                         \
    static void vn_span_##T(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int first,         \
                            int64_t nsb, const int16_t *xq, int64_t ldq, const float *xd, const float *xs,  \
                            int64_t ldd, int mt, float *y, int64_t ldy) {                                  \
        switch (mt) {                                                                                      \
        VN_CASE(T, 1) VN_CASE(T, 2) VN_CASE(T, 3)                                                          \
        default: vn_span_m(T, VN_TILE, w, row_bytes, n0, n1, first, nsb, xq, ldq, xd, xs, ldd, y, ldy); break; \
        }                                                                                                  \
    }
VN_SPAN(T_Q4_K) VN_SPAN(T_Q5_K) VN_SPAN(T_Q6_K)

typedef void (*vn_span_fn)(const uint8_t *, int64_t, int64_t, int64_t, int, int64_t, const int16_t *, int64_t,
                           const float *, const float *, int64_t, int, float *, int64_t);

/* floats of scratch for m rows of k values: x as int16, then per super-block its scale, then per
 * 32 values its sums (-1: not a type this path takes) */
int64_t ub_vnni_scratch(int type, int64_t m, int64_t k) {
    if (!vn_type(type) || k % 256) return -1;
    return m * k + m * (k / 256) * 9;
}

/* m rows of x (ldx apart) rounded into scratch (ub_vnni_scratch(type, m, k) floats): x as int16
 * planes, then per super-block its scale, then per 32 values its sums */
void ub_vnni_round(int64_t m, int64_t k, const float *x, int64_t ldx, float *scratch) {
    const int64_t nsb = k / 256;
    int16_t *xq = (int16_t *)scratch;
    float *xd = scratch + m * k, *xs = xd + m * nsb;
    for (int64_t r = 0; r < m; r++)
        for (int64_t s = 0; s < nsb; s++)
            vn_round(x + r * ldx + 256 * s, xq + 2 * (r * k + 256 * s), xd + r * nsb + s, xs + (r * nsb + s) * 8);
}

/* weight rows [n0, n1) against rows [r0, r0 + m) of the m_all rows ub_vnni_round rounded into
 * `rounded`, on the calling thread: y rows ldy apart, row r0's first */
void ub_vnni_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k,
                  const float *rounded, int64_t m_all, int64_t r0, int64_t m, float *y, int64_t ldy) {
    const int64_t nsb = k / 256;
    const int16_t *xq = (const int16_t *)rounded;
    const float *xd = rounded + m_all * k, *xs = xd + m_all * nsb;
    vn_span_fn span = type == T_Q4_K ? vn_span_T_Q4_K : type == T_Q5_K ? vn_span_T_Q5_K : vn_span_T_Q6_K;
    for (int64_t t = 0; t < m; t += VN_TILE) {
        const int64_t r = r0 + t;
        span(w, row_bytes, n0, n1, t == 0, nsb, xq + 2 * r * k, 2 * k, xd + r * nsb, xs + r * nsb * 8, nsb,
             (int)(m - t < VN_TILE ? m - t : VN_TILE), y + t * ldy, ldy);
    }
}

/* ub_gemv for the types ub_vnni_scratch takes (returns 0 for the others): x rounded once,
 * then weight rows in blocks of rb, each block meeting every tile of VN_TILE rows of x in turn */
int ub_gemv_vnni(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x,
                 int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int64_t rb, int nth) {
    const int64_t need = ub_vnni_scratch(type, m, k);
    if (need < 0) return 0;
    float *own = scratch ? 0 : (float *)malloc(sizeof(float) * need);
    if (own) scratch = own;
    ub_vnni_round(m, k, x, ldx, scratch);
    const int64_t n_blocks = (n_rows + rb - 1) / rb;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        int64_t n1 = (nb + 1) * rb < n_rows ? (nb + 1) * rb : n_rows;
        ub_vnni_rows(type, w, row_bytes, nb * rb, n1, k, scratch, m, 0, m, y, ldy);
    }
    free(own);
    return 1;
}

/* ---- prefill: the same products as a GEMM ---------------------------------------------------
 * The f32 GEMM (gemm.c) dequantises each weight panel to floats and runs FMAs; here a K-quant
 * panel is its raw codes (k-pairs of NR = 32 weight rows as 16-bit words for `vpdpwssd`, k-quads
 * as bytes for `vpdpbusd`), packed once per super-block of a block of weight rows and reused by
 * every row of x. Lanes are weight rows, so the f32 steps are per sub-block and vectorised over
 * the panel: each sub-block's exact 32-bit sums are converted and scaled by the weight's
 * d * scale_j into a per-super-block f32 sum, which is scaled by x's d and joins the output with
 * the min terms.
 *
 * x per 256 values: q = round(x * 32767 / max|x|) as int16, as the GEMV's first plane, and the
 * rest as a byte, lo = round((x * 32767 / max|x| - q) * 256): x = d (q + lo / 256) to 2^-24 of
 * the super-block's largest |x| (the GEMV's second plane keeps 2^-30). One 16-bit plane alone
 * (x to 2^-16) is 1.6-1.8x faster but turned the 1e-7 differences between a row's prefill and
 * decode into ~1e-2 of a logit (tests/test_isolation.py); the byte plane costs half a 16-bit
 * plane (`vpdpbusd` multiplies 64 pairs where `vpdpwssd` multiplies 32). Bytes of codes are
 * unsigned (Q6_K's before its -32, taken back by x's per-16 sums of lo), and |lo| <= 127.
 * x is rounded once per call row by row, so a row's bits never depend on the rows sharing its
 * call. No sum can overflow: a sub-block sums at most 32 products of 32767 * 32. */
enum { VG_MR = 6, VG_NC = 64 };
/* x per row and super-block: 128 words of q, 64 of lo; then per row and super-block its d,
 * 8 per-32 sums of x, 16 per-16 sums of lo */
enum { VG_XW = 192, VG_XF = VG_XW + 1 + 8 + 16 };
/* a panel: 128 k-pair words x NR, 64 k-quad words x NR, per sub-block NR scales (16), NR mins (8);
 * per thread VG_NC rows of panels, then one panel's rows as decoded */
enum { VG_PANEL = (192 + 24) * NR, VG_THREAD = (VG_NC / NR) * VG_PANEL + NR * (192 + 24) };

static inline __m512i vg_dpb(__m512i acc, __m512i u8, __m512i s8) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u8, s8);
#else /* codes <= 63 and |lo| <= 127: the pair sums of vpmaddubsw cannot saturate */
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}

/* 256 values of x: q (in order), lo (in order), d, the 8 per-32 sums of x as rounded, d (sum q +
 * sum lo / 256), and the 16 per-16 sums of lo */
static void vg_round(const float *x, int16_t *q, int8_t *lo, float *d, float *s, int32_t *ls) {
    __m512 v[16];
    const __m512 vid = vn_scale(x, v, d), two8 = _mm512_set1_ps(256.0f);
    for (int j = 0; j < 8; j++) {
        __m512i hi[2], lw[2];
        for (int h = 0; h < 2; h++) {
            const __m512 t = _mm512_mul_ps(v[2 * j + h], vid);
            hi[h] = _mm512_cvtps_epi32(t);
            lw[h] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(hi[h])), two8)); /* exact difference */
            lw[h] = _mm512_min_epi32(lw[h], _mm512_set1_epi32(127)); /* +128 only at an exact tie */
            _mm256_storeu_si256((__m256i *)(q + 32 * j + 16 * h), _mm512_cvtsepi32_epi16(hi[h]));
            _mm_storeu_si128((__m128i *)(lo + 32 * j + 16 * h), _mm512_cvtsepi32_epi8(lw[h]));
            ls[2 * j + h] = _mm512_reduce_add_epi32(lw[h]);
        }
        const float sh = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(hi[0], hi[1]));
        s[j] = *d * (sh + (float)(ls[2 * j] + ls[2 * j + 1]) * (1.0f / 256.0f));
    }
}

/* a super-block's 256 raw codes as int16 (Q6_K: minus 32), d times each sub-block's scale
 * (Q6_K: 16 of them, else 8) and (Q4_K, Q5_K) the 8 min terms -dmin * m_j */
static inline __attribute__((always_inline)) void vg_raw(const int type, const uint8_t *b, int16_t *c16, float *sc,
                                                         float *mn) {
    const __m512i m4 = _mm512_set1_epi16(0xF);
    if (type == T_Q6_K) {
        const __m512i m30 = _mm512_set1_epi16(0x30), c32 = _mm512_set1_epi16(32);
        const float d = h2f(rd16(b + 208));
        for (int i = 0; i < 16; i++) sc[i] = d * (float)(int8_t)b[192 + i];
        for (int h = 0; h < 2; h++) {
            const __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
            const __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
            const __m512i hb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            __m512i c[4];
            c[0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30));
            c[1] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30));
            c[2] = _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(hb, m30));
            c[3] = _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(hb, 2), m30));
            for (int g = 0; g < 4; g++) _mm512_storeu_si512(c16 + 32 * (4 * h + g), _mm512_sub_epi16(c[g], c32));
        }
        return;
    }
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t m6 = 0x3f3f3f3fu, q4 = 0x0f0f0f0fu, m2 = 0x03030303u, mins_lo = u[1] & m6;
    u[3] = ((u[2] >> 4) & q4) | (((u[1] >> 6) & m2) << 4);
    u[1] = (u[2] & q4) | (((u[0] >> 6) & m2) << 4);
    u[2] = mins_lo;
    u[0] &= m6;
    const uint8_t *s8 = (const uint8_t *)u;
    const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
    for (int j = 0; j < 8; j++) sc[j] = d * (float)s8[j], mn[j] = -(dmin * (float)s8[8 + j]);
    const int five = type == T_Q5_K;
    const uint8_t *qs = b + (five ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if (five) qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)));
    const __m512i m10 = _mm512_set1_epi16(0x10);
    for (int p = 0; p < 4; p++) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * p)));
        __m512i c[2] = {_mm512_and_si512(x, m4), _mm512_srli_epi16(x, 4)};
        for (int i = 0; i < 2; i++) {
            const int j = 2 * p + i;
            if (five) {
                const __m512i hj = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
                c[i] = _mm512_or_si512(c[i], _mm512_and_si512(hj, m10));
            }
            _mm512_storeu_si512(c16 + 32 * j, c[i]);
        }
    }
}

/* weight rows [n0, n0 + nr) (missing rows are zero) of super-block sb into a panel: k-pair p of
 * row i is word panel[p * NR + i], k-quad p its bytes word panel[(128 + p) * NR + i], then per
 * sub-block the NR rows' scales (16), then their mins (8) */
static void vg_pack(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nr, int64_t sb,
                    int32_t *rows, int32_t *panel) {
    const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const __m512i off = _mm512_set1_epi16(type == T_Q6_K ? 32 : 0);
    float *rsc = (float *)(rows + NR * 192), *psc = (float *)(panel + 192 * NR);
    for (int64_t i = 0; i < NR; i++) {
        float *s = rsc + 24 * i;
        int32_t *r = rows + 192 * i;
        if (i >= nr) {
            memset(r, 0, 4 * 192);
            for (int j = 0; j < 24; j++) s[j] = 0;
            continue;
        }
        vg_raw(type, w + (n0 + i) * row_bytes + sb * bs, (int16_t *)r, s, s + 16);
        for (int j = 0; j < 8; j++) /* the same codes as unsigned bytes */
            _mm256_storeu_si256((__m256i *)((uint8_t *)(r + 128) + 32 * j),
                                _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_loadu_si512(r + 16 * j), off)));
    }
    for (int p = 0; p < 192; p += 8)
        for (int i = 0; i < NR; i += 8) transpose8((const float *)(rows + 192 * i + p), 192, (float *)(panel + p * NR + i), NR);
    for (int j = 0; j < 24; j++)
        for (int i = 0; i < NR; i++) psc[j * NR + i] = rsc[24 * i + j];
}

/* c[M][NR] (+)= M rows of x (super-block words xq, rows ldq words apart; d xd, per-32 sums xs and
 * per-16 sums of lo ls, rows ldd floats apart) times a panel over one super-block */
static inline __attribute__((always_inline)) void vg_kernel(const int M, const int SUB, const int Q6,
        const int32_t *xq, int64_t ldq, const float *xd, const float *xs, const int32_t *ls, int64_t ldd,
        const int32_t *wp, float *c, int64_t ldc, int acc) {
    const float *sc = (const float *)(wp + 192 * NR), *mn = sc + 16 * NR;
    __m512 f0[VG_MR], f1[VG_MR];
    for (int r = 0; r < M; r++) f0[r] = f1[r] = _mm512_setzero_ps();
    for (int s = 0; s < 256 / SUB; s++) {
        const __m512 s0 = _mm512_loadu_ps(sc + s * NR), s1 = _mm512_loadu_ps(sc + s * NR + 16);
        __m512i a0[VG_MR], a1[VG_MR];
        for (int r = 0; r < M; r++) a0[r] = a1[r] = _mm512_setzero_si512();
        const int32_t *w0 = wp + s * (SUB / 2) * NR, *x0 = xq + s * (SUB / 2);
#pragma GCC unroll 16
        for (int p = 0; p < SUB / 2; p++) { /* q: 16-bit pairs */
            const __m512i wa = _mm512_loadu_si512(w0 + p * NR), wb = _mm512_loadu_si512(w0 + p * NR + 16);
            for (int r = 0; r < M; r++) {
                const __m512i b = _mm512_set1_epi32(x0[r * ldq + p]);
                a0[r] = vn_dp(a0[r], wa, b);
                a1[r] = vn_dp(a1[r], wb, b);
                __asm__("" : "+v"(a0[r]), "+v"(a1[r])); /* running sums in registers, not trees */
            }
        }
        for (int r = 0; r < M; r++) {
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), s0, f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), s1, f1[r]);
            /* lo against Q6_K's unsigned codes: minus 32 times the sub-block's sum of lo */
            a0[r] = a1[r] = Q6 ? _mm512_set1_epi32(-32 * ls[r * ldd + s]) : _mm512_setzero_si512();
        }
        const int32_t *v0 = wp + (128 + s * (SUB / 4)) * NR, *y0 = xq + 128 + s * (SUB / 4);
#pragma GCC unroll 8
        for (int p = 0; p < SUB / 4; p++) { /* lo: byte quads */
            const __m512i wa = _mm512_loadu_si512(v0 + p * NR), wb = _mm512_loadu_si512(v0 + p * NR + 16);
            for (int r = 0; r < M; r++) {
                const __m512i b = _mm512_set1_epi32(y0[r * ldq + p]);
                a0[r] = vg_dpb(a0[r], wa, b);
                a1[r] = vg_dpb(a1[r], wb, b);
                __asm__("" : "+v"(a0[r]), "+v"(a1[r]));
            }
        }
        const __m512 t0 = _mm512_mul_ps(s0, _mm512_set1_ps(1.0f / 256.0f)), t1 = _mm512_mul_ps(s1, _mm512_set1_ps(1.0f / 256.0f));
        for (int r = 0; r < M; r++) {
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), t0, f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), t1, f1[r]);
        }
    }
    for (int r = 0; r < M; r++) {
        const __m512 dx = _mm512_set1_ps(xd[r * ldd]);
        float *cr = c + r * ldc;
        __m512 c0 = _mm512_fmadd_ps(f0[r], dx, acc ? _mm512_loadu_ps(cr) : _mm512_setzero_ps());
        __m512 c1 = _mm512_fmadd_ps(f1[r], dx, acc ? _mm512_loadu_ps(cr + 16) : _mm512_setzero_ps());
        if (!Q6)
            for (int j = 0; j < 8; j++) {
                const __m512 xj = _mm512_set1_ps(xs[r * ldd + j]);
                c0 = _mm512_fmadd_ps(_mm512_loadu_ps(mn + j * NR), xj, c0);
                c1 = _mm512_fmadd_ps(_mm512_loadu_ps(mn + j * NR + 16), xj, c1);
            }
        _mm512_storeu_ps(cr, c0);
        _mm512_storeu_ps(cr + 16, c1);
    }
}

#define VG_CASE(n, SUB, Q6) case n: vg_kernel(n, SUB, Q6, xq, ldq, xd, xs, ls, ldd, wp, c, ldc, acc); break;
#define VG_KERNEL(SUB, Q6)                                                                                    \
    static void vg_kernel_##SUB(int m, const int32_t *xq, int64_t ldq, const float *xd, const float *xs,      \
                                const int32_t *ls, int64_t ldd, const int32_t *wp, float *c, int64_t ldc,      \
                                int acc) {                                                                    \
        switch (m) {                                                                                          \
        VG_CASE(1, SUB, Q6) VG_CASE(2, SUB, Q6) VG_CASE(3, SUB, Q6) VG_CASE(4, SUB, Q6) VG_CASE(5, SUB, Q6)   \
        default: vg_kernel(VG_MR, SUB, Q6, xq, ldq, xd, xs, ls, ldd, wp, c, ldc, acc); break;                 \
        }                                                                                                     \
    }
VG_KERNEL(32, 0) VG_KERNEL(16, 1)
typedef void (*vg_kernel_fn)(int, const int32_t *, int64_t, const float *, const float *, const int32_t *, int64_t,
                             const int32_t *, float *, int64_t, int);

/* floats of scratch ub_gemm_vnni needs (-1: not a type or shape it takes): x rounded (VG_XF
 * words a row and super-block), then per thread its panels */
int64_t ub_gemm_vnni_scratch(int type, int64_t m, int64_t k, int nth) {
    if (!vn_type(type) || k % 256) return -1;
    return round_up(m * (k / 256) * VG_XF, 16) + (int64_t)nth * VG_THREAD;
}

/* y = x . W^T for the K-quants with x rounded once per call (returns 0 where it does not apply) */
int ub_gemm_vnni(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                 int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    if (ub_gemm_vnni_scratch(type, m, k, nth) < 0) return 0;
    const int64_t nsb = k / 256, n_blocks = (n + VG_NC - 1) / VG_NC, ldq = nsb * VG_XW, ldd = nsb * 25;
    int32_t *xq = (int32_t *)scratch;
    float *xf = scratch + m * ldq, *own = scratch + round_up(m * nsb * VG_XF, 16); /* per row: d, 8 sums, 16 lo sums */
    const vg_kernel_fn kern = type == T_Q6_K ? vg_kernel_16 : vg_kernel_32;
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t s = 0; s < nsb; s++) {
                int32_t *xw = xq + r * ldq + s * VG_XW;
                float *f = xf + r * ldd + s * 25;
                vg_round(x + r * ldx + 256 * s, (int16_t *)xw, (int8_t *)(xw + 128), f, f + 1, (int32_t *)(f + 9));
            }
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        int32_t *panels = (int32_t *)(own + (int64_t)tid * VG_THREAD), *rows = panels + (VG_NC / NR) * VG_PANEL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n_blocks; b++) {
            const int64_t n0 = b * VG_NC, nb = n - n0 < VG_NC ? n - n0 : VG_NC, n_panels = (nb + NR - 1) / NR;
            for (int64_t sb = 0; sb < nsb; sb++) {
                for (int64_t p = 0; p < n_panels; p++) {
                    const int64_t nr = nb - p * NR < NR ? nb - p * NR : NR;
                    vg_pack(type, w, row_bytes, n0 + p * NR, nr, sb, rows, panels + p * VG_PANEL);
                }
                for (int64_t mc0 = 0; mc0 < m; mc0 += MC) {
                    const int64_t mc1 = m < mc0 + MC ? m : mc0 + MC;
                    for (int64_t p = 0; p < n_panels; p++) {
                        const int64_t c0 = n0 + p * NR, nr = n - c0 < NR ? n - c0 : NR;
                        const int32_t *wp = panels + p * VG_PANEL;
                        for (int64_t m0 = mc0; m0 < mc1; m0 += VG_MR) {
                            const int mr = (int)(mc1 - m0 < VG_MR ? mc1 - m0 : VG_MR);
                            const int32_t *xr = xq + m0 * ldq + sb * VG_XW;
                            const float *fr = xf + m0 * ldd + sb * 25;
                            const int32_t *lr = (const int32_t *)(fr + 9);
                            if (nr == NR) {
                                kern(mr, xr, ldq, fr, fr + 1, lr, ldd, wp, y + m0 * ldy + c0, ldy, sb > 0);
                            } else { /* through a full-width tile */
                                float tile[VG_MR * NR];
                                float *yc = y + m0 * ldy + c0;
                                for (int r = 0; r < mr && sb > 0; r++) memcpy(tile + r * NR, yc + r * ldy, 4 * nr);
                                kern(mr, xr, ldq, fr, fr + 1, lr, ldd, wp, tile, NR, sb > 0);
                                for (int r = 0; r < mr; r++) memcpy(yc + r * ldy, tile + r * NR, 4 * nr);
                            }
                        }
                    }
                }
            }
        }
    }
    return 1;
}

#else
int ub_vnni(void) { return 0; }
int64_t ub_vnni_scratch(int type, int64_t m, int64_t k) { (void)type, (void)m, (void)k; return -1; }
void ub_vnni_round(int64_t m, int64_t k, const float *x, int64_t ldx, float *scratch) {
    (void)m, (void)k, (void)x, (void)ldx, (void)scratch;
}
void ub_vnni_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k,
                  const float *rounded, int64_t m_all, int64_t r0, int64_t m, float *y, int64_t ldy) {
    (void)type, (void)w, (void)row_bytes, (void)n0, (void)n1, (void)k, (void)rounded, (void)m_all, (void)r0, (void)m;
    (void)y, (void)ldy;
}
int ub_gemv_vnni(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x,
                 int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int64_t rb, int nth) {
    (void)type, (void)w, (void)row_bytes, (void)n_rows, (void)k, (void)x, (void)m, (void)ldx, (void)y, (void)ldy;
    (void)scratch, (void)rb, (void)nth;
    return 0;
}
int64_t ub_gemm_vnni_scratch(int type, int64_t m, int64_t k, int nth) { (void)type, (void)m, (void)k, (void)nth; return -1; }
int ub_gemm_vnni(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                 int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)m, (void)ldx, (void)y, (void)ldy;
    (void)scratch, (void)nth;
    return 0;
}
#endif
