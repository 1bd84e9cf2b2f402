/* The GEMV of decode straight from the GGUF blocks (dequantised rows and spans: dequant.c). Dot
 * products accumulate in f32 with FMA; in the AVX2 build a block type's codes meet x as 16-bit
 * integers (quant_i16.h). Threads come from the OpenMP runtime torch already loaded (the same
 * libgomp), so the two never run two pools at once. */
#include "common.h"
#include "quant_scalar.h"
#include "quant_codes.h"
#include "quant_i16.h"
#include "quant_iq.h"

int ub_abi_version(void) { return 21; }

/* the AVX-512 build's integer GEMV for the K-quants (gemv_vnni.c) */
int64_t ub_vnni_scratch(int type, int64_t m, int64_t k);
int ub_gemv_vnni(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x,
                 int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int64_t rb, int nth);
/* 0: every GEMV this build has; 1: the f32 (AVX2: 16-bit x) ones only, for comparison */
static int ub_gemv_path = 0;
void ub_set_gemv_path(int path) { ub_gemv_path = path; }
int ub_simd(void) { return UB_AVX512 ? 3 : UB_AVX2 ? 2 : 0; } /* 3: AVX-512F, 2: AVX2+FMA+F16C, 0: portable */

#if UB_AVX2
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
#define G_HSUM hsum
#define G_ADD _mm256_add_ps
#endif
enum { GW = 32 / GQ }; /* floats per GEMV vector */

#if UB_AVX512
/* a chunk's decoded codes times M rows of x (at xc): 32 registers hold the chunk's weights
 * d * q + m once (two FMAs), then two FMAs a row (the codes-times-x form costs three a row) */
static inline __attribute__((always_inline)) void codes_dot(const int M, codes_t *k, const float *xc, int64_t ldx,
                                                            gvec_t *acc) {
    k->q[0] = _mm512_fmadd_ps(k->q[0], G_SET1(k->da), G_SET1(k->m));
    k->q[1] = _mm512_fmadd_ps(k->q[1], G_SET1(k->db), G_SET1(k->m));
    for (int r = 0; r < M; r++) {
        const float *xr = xc + r * ldx;
        acc[r] = G_FMA(k->q[0], G_LOAD(xr), acc[r]);
        acc[r] = G_FMA(k->q[1], G_LOAD(xr + 16), acc[r]);
    }
}

/* one 32-value block type chunk times M rows */
static inline __attribute__((always_inline)) void chunk_dot(const int type, const int M, const uint8_t *row,
                                                            int64_t c, const float *x, int64_t ldx, gvec_t *acc) {
    codes_t k;
    codes_avx2(type, row, c, &k);
    codes_dot(M, &k, x + c * 32, ldx, acc);
}
#endif

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

/* M (1..8) activation rows against one weight row in f32, all accumulators in registers. Float
 * weights (tiles of at most 4): FMA straight into two chains per row. Block types (the AVX-512
 * build; tiles of 8, so that a 16-row product decodes each weight row twice, not four times):
 * even chunks into one chain, odd into the other, whatever M is, so that a row's result does not
 * depend on how many rows share its call (a drafted batch and a one-row decode give the same
 * bits); the min is built into the weights. */
static inline __attribute__((always_inline)) void row_dot_m(const int type, const int M, const uint8_t *row,
                                                            int64_t nc, const float *x, int64_t ldx, float *res) {
    gvec_t ea[8], oa[8];
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
    }
#if UB_AVX512
    else if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
        for (int64_t sb = 0; sb < nc / 8; sb++) {
            const uint8_t *b = row + sb * bs;
            float da[8], db[8], mn[8];
            k_scales(type, b, da, db, mn);
            for (int j = 0; j < 8; j += 2) { /* even chunks into ea, odd into oa: both chains stay in registers */
                codes_t k0, k1;
                k_codes_g(type, b, j, k0.q);
                k_codes_g(type, b, j + 1, k1.q);
                k0.da = da[j], k0.db = db[j], k0.m = mn[j];
                k1.da = da[j + 1], k1.db = db[j + 1], k1.m = mn[j + 1];
                int64_t c = sb * 8 + j;
                codes_dot(M, &k0, x + c * 32, ldx, ea);
                codes_dot(M, &k1, x + (c + 1) * 32, ldx, oa);
            }
        }
    } else {
        int64_t c = 0;
        for (; c + 1 < nc; c += 2) {
            chunk_dot(type, M, row, c, x, ldx, ea);
            chunk_dot(type, M, row, c + 1, x, ldx, oa);
        }
        if (c < nc) chunk_dot(type, M, row, c, x, ldx, ea);
    }
#endif
    for (int r = 0; r < M; r++) res[r] = G_HSUM(G_ADD(ea[r], oa[r]));
}

#if UB_X16
/* M (1..8) rows of x as 16-bit integers (xq: per 32 values the even then the odd ones, rows ldq
 * int16 apart; xd, xs: per-32 scales and scaled sums, rows nc apart) against one weight row of a
 * block type. Per chunk and row: two vpmaddwd and an add give eight exact 32-bit sums of four
 * products each (lanes 0..3 values 0..15, lanes 4..7 16..31, so Q6_K's two scales fall on the two
 * halves), converted and scaled. Chunks go in pairs: the pair's two scaled sums are added off the
 * row's chain, so its one f32 chain takes an add every two chunks (an FMA a chunk bound the
 * one-row GEMV at its 4-cycle latency); then the min term as in row_dot_m. Every row takes the
 * same steps whatever M is, so a row's bits do not depend on the rows sharing its call. */
#define X16_SUM(C, E, O, r)                                                                             \
    _mm256_cvtepi32_ps(_mm256_add_epi32(                                                               \
        _mm256_madd_epi16(E, _mm256_loadu_si256((const __m256i *)(xq + r * ldq + (C) * 32))),          \
        _mm256_madd_epi16(O, _mm256_loadu_si256((const __m256i *)(xq + r * ldq + (C) * 32 + 16)))))
#define X16_SCALE(DV, C, r) _mm256_mul_ps(DV, _mm256_set1_ps(xd[r * nc + (C)]))
/* chunks C and C + 1 (codes E0/O0, E1/O1, weight scales DV0, DV1) into every row's chain */
#define X16_PAIR(C, E0, O0, DV0, E1, O1, DV1)                                                          \
    for (int r = 0; r < M; r++) {                                                                      \
        __m256 t = _mm256_mul_ps(X16_SUM(C, E0, O0, r), X16_SCALE(DV0, C, r));                         \
        acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(X16_SUM(C + 1, E1, O1, r), X16_SCALE(DV1, C + 1, r), t)); \
    }

/* four chunks' codes (e[i], o[i]: chunks C..C+3 of a row) into every row's chain. Per row the
 * four chunks' sums are folded by two rounds of vphaddd into one vector [c0 c1 c2 c3 | c0 c1 c2
 * c3] (low half: each chunk's values 0..15, high half: 16..31; each lane an exact sum of 16
 * products), then one conversion and one FMA with the weight scales dw (per half, so Q6_K's two
 * scales a chunk fit) times x's four scales: a quarter of X16_PAIR's f32 work a chunk
 * (conversion, scale, add); 10-20% less time a chunk and row (docs/backends.md). */
static inline __attribute__((always_inline)) void x16_quad(const int M, const __m256i *e, const __m256i *o,
        __m256 dw, int64_t c, const int16_t *xq, int64_t ldq, const float *xd, int64_t nc, __m256 *acc) {
    for (int r = 0; r < M; r++) {
        const int16_t *xr = xq + r * ldq + c * 32;
        __m256i s[4];
        for (int i = 0; i < 4; i++)
            s[i] = _mm256_add_epi32(_mm256_madd_epi16(e[i], _mm256_loadu_si256((const __m256i *)(xr + 32 * i))),
                                    _mm256_madd_epi16(o[i], _mm256_loadu_si256((const __m256i *)(xr + 32 * i + 16))));
        __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ps((const __m128 *)(xd + r * nc + c)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, acc[r]);
    }
}

/* chunks C..C+3 of a Q8_0 row (at b): codes widened from memory, the four f16 scales converted at once */
static inline __attribute__((always_inline)) void x16_quad_q8(const int M, const uint8_t *b, int64_t c,
        const int16_t *xq, int64_t ldq, const float *xd, int64_t nc, __m256 *acc) {
    __m256i e[4], o[4];
    for (int i = 0; i < 4; i++) q8_i16(b + 34 * i, &e[i], &o[i]);
    __m128i h = _mm_cvtsi32_si128(rd16(b));
    h = _mm_insert_epi16(h, rd16(b + 34), 1);
    h = _mm_insert_epi16(h, rd16(b + 68), 2);
    h = _mm_insert_epi16(h, rd16(b + 102), 3);
    const __m128 dw = _mm_cvtph_ps(h);
    x16_quad(M, e, o, _mm256_set_m128(dw, dw), c, xq, ldq, xd, nc, acc);
}

static inline __attribute__((always_inline)) void x16_dot_m(const int type, const int M, const uint8_t *row,
        int64_t nc, const int16_t *xq, int64_t ldq, const float *xd, const float *xs, float *res) {
    __m256 acc[8];
    float mins[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
        for (int64_t sb = 0; sb < nc / 8; sb++) {
            const uint8_t *b = row + sb * bs;
            float da[8], db[8], mn[8];
            k_scales(type, b, da, db, mn);
#pragma GCC unroll 2
            for (int j = 0; j < 8; j += 4) { /* unrolled: each chunk's shifts by constants */
                __m256i e[4], o[4];
                for (int i = 0; i < 4; i++) bytes_i16(k_bytes(type, b, j + i), type == T_Q6_K, &e[i], &o[i]);
                __m128 lo = _mm_loadu_ps(da + j); /* Q6_K: values 0..15 of each chunk; 16..31 take db */
                __m256 dw = type == T_Q6_K ? _mm256_setr_m128(lo, _mm_loadu_ps(db + j)) : _mm256_set_m128(lo, lo);
                x16_quad(M, e, o, dw, sb * 8 + j, xq, ldq, xd, nc, acc);
            }
            if (x16_has_min(type)) { /* the eight chunks' min terms, m . (scaled sums of x), in one FMA */
                __m256 mv = _mm256_loadu_ps(mn);
                for (int r = 0; r < M; r++) acc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + r * nc + sb * 8), acc[r]);
            }
        }
    } else {
        int64_t c = 0;
        /* four chunks a step for Q8_0, Q4_0 and Q4_1; Q5_0 and Q5_1 keep pairs (their fifth bits
         * spill registers: one row 4% and 15% slower in quads) */
        if (type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1)
            for (; c + 3 < nc; c += 4) {
                if (type == T_Q8_0) {
                    x16_quad_q8(M, row + c * 34, c, xq, ldq, xd, nc, acc);
                    continue;
                }
                __m256i e[4], o[4];
                float d[4], m[4];
                for (int i = 0; i < 4; i++) {
                    __m256i y;
                    int sign = block_bytes(type, row, c + i, &y, &d[i], &m[i]);
                    bytes_i16(y, sign, &e[i], &o[i]);
                }
                const __m128 dw = _mm_loadu_ps(d);
                x16_quad(M, e, o, _mm256_set_m128(dw, dw), c, xq, ldq, xd, nc, acc);
                if (type == T_Q4_1) { /* the four min terms, m . (x's scaled sums), in the low half */
                    const __m256 mv = _mm256_setr_m128(_mm_loadu_ps(m), _mm_setzero_ps());
                    for (int r = 0; r < M; r++)
                        acc[r] = _mm256_fmadd_ps(mv, _mm256_castps128_ps256(_mm_loadu_ps(xs + r * nc + c)), acc[r]);
                }
            }
        for (; c + 1 < nc; c += 2) { /* the last two or three chunks */
            __m256i y0, y1, e0, o0, e1, o1;
            float d0, d1, m0 = 0, m1 = 0;
            if (type == T_Q8_0) { /* in order, as x16_gemv rounds x for Q8_0 */
                q8_i16(row + c * 34, &e0, &o0);
                q8_i16(row + (c + 1) * 34, &e1, &o1);
                d0 = h2f(rd16(row + c * 34)), d1 = h2f(rd16(row + (c + 1) * 34));
            } else {
                int sign = block_bytes(type, row, c, &y0, &d0, &m0);
                block_bytes(type, row, c + 1, &y1, &d1, &m1);
                bytes_i16(y0, sign, &e0, &o0);
                bytes_i16(y1, sign, &e1, &o1);
            }
            __m256 dv0 = _mm256_set1_ps(d0), dv1 = _mm256_set1_ps(d1);
            X16_PAIR(c, e0, o0, dv0, e1, o1, dv1)
            if (type == T_Q4_1 || type == T_Q5_1)
                for (int r = 0; r < M; r++) mins[r] += m0 * xs[r * nc + c] + m1 * xs[r * nc + c + 1];
        }
        if (c < nc) { /* an odd chunk count's last chunk */
            __m256i y, e, o;
            float d, m = 0;
            if (type == T_Q8_0) {
                q8_i16(row + c * 34, &e, &o);
                d = h2f(rd16(row + c * 34));
            } else {
                int sign = block_bytes(type, row, c, &y, &d, &m);
                bytes_i16(y, sign, &e, &o);
            }
            __m256 dv = _mm256_set1_ps(d);
            for (int r = 0; r < M; r++) acc[r] = _mm256_fmadd_ps(X16_SUM(c, e, o, r), X16_SCALE(dv, c, r), acc[r]);
            if (type == T_Q4_1 || type == T_Q5_1)
                for (int r = 0; r < M; r++) mins[r] += m * xs[r * nc + c];
        }
    }
    for (int r = 0; r < M; r++) res[r] = hsum(acc[r]) + mins[r];
}
#undef X16_PAIR
#undef X16_SCALE
#undef X16_SUM

/* Rows in lanes: the AVX2 GEMV for 7 (K-quants: 10) to 16 rows of x.
 *
 * x16_dot_m holds one row of x per accumulator and folds its four chunks' sums with two rounds
 * of vphaddd, a horizontal step per row; above eight rows it runs as two tiles, each decoding
 * the weight row again. Here the rows of x sit in the lanes instead: x is laid out once per call
 * as a panel (for each 32-bit word of a chunk's codes, the matching pair of x values of four
 * rows, twice: the word w of the low 128 bits, then w + 4 of the high), so one in-lane broadcast
 * of a code word (vpshufd) meets four rows in one vpmaddwd, and a chunk's codes are decoded once
 * for all rows.
 *
 * It computes the same bits as x16_dot_m. Lane h of a row's pair of lanes in the panel is the
 * half h of x16_quad's sums (low: the words of the codes' low 128 bits), so each lane holds the
 * exact integer x16_quad folds into its lane q + 4h for chunk c = 4i + q. The f32 steps per lane
 * are x16_quad's: the same scale product, the same FMA, chunk after chunk in the same order
 * (a pass per q, so every accumulator stays in a register), then the same min terms where the
 * type has them, and a 4 x 4 transpose gives each row x16_dot_m's eight lanes for its hsum. So
 * a row's result still does not depend on how many rows share the call. It covers the types and
 * shapes that x16_dot_m takes in quads only (chunk counts divisible by 4; not Q5_1, whose pairs
 * sum differently). It starts at 7 rows for the 32-value types (at 5 and 6 a group of four is
 * half empty, and the tiles did better) and at 10 for the K-quants, whose longer decode the
 * tiles' folds hid better at 7 to 9 (measurements in docs/backends.md). */
enum { X16_ROWS_MAX = 16, X16_ROWS_NC = 1024 }; /* rows of x; K-quant chunks a row (k <= 32768) */

/* whether m rows of x against a weight of this type and chunk count take x16_rows_dot */
static inline int x16_rows_for_m(int type, int64_t nc, int64_t m) {
    const int kq = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
    const int quads = kq || type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1;
    return quads && nc % 4 == 0 && m >= (kq ? 10 : 7) && m <= X16_ROWS_MAX && (!kq || nc <= X16_ROWS_NC);
}

/* floats of panel for m rows (groups of four) of nc chunks: codes' x pairs, scales, scaled sums */
static int64_t x16_rows_scratch(int64_t m, int64_t nc) {
    int64_t g = (m + 3) / 4;
    return nc * g * (64 + 8 + 8);
}

/* the panel from x16_chunk's output (xq: rows nc * 32 int16 apart; xd, xs: nc floats apart);
 * the rows of the last group past m are zero */
static void x16_rows_panel(const int16_t *xq, const float *xd, const float *xs, int64_t m, int64_t nc,
                           __m256i *xp, __m256 *xdp, __m256 *xsp) {
    const int64_t G = (m + 3) / 4;
    for (int64_t c = 0; c < nc; c++)
        for (int64_t g = 0; g < G; g++) {
            for (int v = 0; v < 2; v++) {
                __m256 R[4];
                for (int p = 0; p < 4; p++) {
                    int64_t r = 4 * g + p;
                    R[p] = r < m ? _mm256_loadu_ps((const float *)(xq + (r * nc + c) * 32 + v * 16)) : _mm256_setzero_ps();
                }
                __m256 t0 = _mm256_unpacklo_ps(R[0], R[1]), t1 = _mm256_unpackhi_ps(R[0], R[1]);
                __m256 t2 = _mm256_unpacklo_ps(R[2], R[3]), t3 = _mm256_unpackhi_ps(R[2], R[3]);
                __m256i *dst = xp + (c * 2 + v) * 4 * G + g; /* word i of the pair: dst[i * G] */
                dst[0] = _mm256_castps_si256(_mm256_shuffle_ps(t0, t2, 0x44));
                dst[G] = _mm256_castps_si256(_mm256_shuffle_ps(t0, t2, 0xEE));
                dst[2 * G] = _mm256_castps_si256(_mm256_shuffle_ps(t1, t3, 0x44));
                dst[3 * G] = _mm256_castps_si256(_mm256_shuffle_ps(t1, t3, 0xEE));
            }
            float d[4], s[4];
            for (int p = 0; p < 4; p++) {
                int64_t r = 4 * g + p;
                d[p] = r < m ? xd[r * nc + c] : 0.0f;
                s[p] = r < m ? xs[r * nc + c] : 0.0f;
            }
            __m128 d4 = _mm_loadu_ps(d), s4 = _mm_loadu_ps(s);
            xdp[c * G + g] = _mm256_set_m128(d4, d4);
            xsp[c * G + g] = _mm256_set_m128(s4, s4);
        }
}

/* chunk c's codes (e, o) against every group's x: the exact sums, in group order, into ia */
#define X16_ROWS_WORD(V, v, i)                                                                             \
    {                                                                                                      \
        const __m256i s = _mm256_shuffle_epi32(V, (i) * 0x55);                                             \
        const __m256i *xv = xp + ((c * 2 + (v)) * 4 + (i)) * G;                                            \
        for (int g = 0; g < G; g++) {                                                                      \
            __m256i t = _mm256_madd_epi16(s, xv[g]);                                                       \
            ia[g] = (v) + (i) ? _mm256_add_epi32(ia[g], t) : t; /* the first word starts the sum */        \
            __asm__("" : "+x"(ia[g])); /* running sums: no reassociated trees, no spills */                \
        }                                                                                                  \
    }
#define X16_ROWS_CHUNK(E, O, DW)                                                                            \
    {                                                                                                      \
        __m256i ia[4];                                                                                     \
        X16_ROWS_WORD(E, 0, 0) X16_ROWS_WORD(E, 0, 1) X16_ROWS_WORD(E, 0, 2) X16_ROWS_WORD(E, 0, 3)        \
        X16_ROWS_WORD(O, 1, 0) X16_ROWS_WORD(O, 1, 1) X16_ROWS_WORD(O, 1, 2) X16_ROWS_WORD(O, 1, 3)        \
        for (int g = 0; g < G; g++)                                                                        \
            a[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[g]), _mm256_mul_ps(DW, xdp[c * G + g]), a[g]);    \
    }

/* one weight row against G groups of four rows: res[0 .. 4G) (rows past m hold junk) */
static inline __attribute__((always_inline)) void x16_rows_dot(const int type, const int G, const uint8_t *row,
        int64_t nc, const __m256i *xp, const __m256 *xdp, const __m256 *xsp, float *res) {
    __m256 acc[4][4];
    const int kq = (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K);
    const int bs = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    float da[X16_ROWS_NC], db[X16_ROWS_NC], mn[X16_ROWS_NC]; /* the row's scales, decoded once for the four passes */
    if (kq)
        for (int64_t sb = 0; sb < nc / 8; sb++) k_scales(type, row + sb * bs, da + sb * 8, db + sb * 8, mn + sb * 8);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        __m256 a[4];
        for (int g = 0; g < G; g++) a[g] = _mm256_setzero_ps();
        if (kq) {
            for (int64_t sb = 0; sb < nc / 8; sb++) {
                const uint8_t *b = row + sb * bs;
                for (int j = q; j < 8; j += 4) { /* x16_dot_m's quads: chunk q, then 4 + q */
                    const int64_t c = sb * 8 + j;
                    __m256i e, o;
                    bytes_i16(k_bytes(type, b, j), type == T_Q6_K, &e, &o);
                    const __m256 dw = _mm256_setr_m128(_mm_set1_ps(da[c]), _mm_set1_ps(db[c]));
                    X16_ROWS_CHUNK(e, o, dw)
                }
                if (x16_has_min(type)) { /* lane h: the min of chunk q + 4h, as x16_dot_m's one FMA */
                    const __m256 mv = _mm256_setr_m128(_mm_set1_ps(mn[sb * 8 + q]), _mm_set1_ps(mn[sb * 8 + q + 4]));
                    for (int g = 0; g < G; g++) {
                        __m256 s = _mm256_blend_ps(xsp[(sb * 8 + q) * G + g], xsp[(sb * 8 + q + 4) * G + g], 0xF0);
                        a[g] = _mm256_fmadd_ps(mv, s, a[g]);
                    }
                }
            }
        } else {
            for (int64_t c = q; c < nc; c += 4) {
                __m256i e, o;
                float d, m = 0;
                if (type == T_Q8_0) {
                    q8_i16(row + c * 34, &e, &o);
                    d = h2f(rd16(row + c * 34));
                } else {
                    __m256i y;
                    int sign = block_bytes(type, row, c, &y, &d, &m);
                    bytes_i16(y, sign, &e, &o);
                }
                const __m256 dw = _mm256_set1_ps(d);
                X16_ROWS_CHUNK(e, o, dw)
                if (type == T_Q4_1) { /* the low lanes' min term, as x16_dot_m's quad adds it */
                    const __m256 mv = _mm256_setr_m128(_mm_set1_ps(m), _mm_setzero_ps());
                    for (int g = 0; g < G; g++)
                        a[g] = _mm256_fmadd_ps(mv, _mm256_blend_ps(xsp[c * G + g], _mm256_setzero_ps(), 0xF0), a[g]);
                }
            }
        }
        for (int g = 0; g < G; g++) acc[q][g] = a[g];
    }
    for (int g = 0; g < G; g++) { /* per row: lanes [q0 q1 q2 q3 | the same, high half], as x16_quad's */
        __m256 t0 = _mm256_unpacklo_ps(acc[0][g], acc[1][g]), t1 = _mm256_unpackhi_ps(acc[0][g], acc[1][g]);
        __m256 t2 = _mm256_unpacklo_ps(acc[2][g], acc[3][g]), t3 = _mm256_unpackhi_ps(acc[2][g], acc[3][g]);
        res[4 * g] = hsum(_mm256_shuffle_ps(t0, t2, 0x44)) + 0.0f; /* + x16_dot_m's (zero) pair mins */
        res[4 * g + 1] = hsum(_mm256_shuffle_ps(t0, t2, 0xEE)) + 0.0f;
        res[4 * g + 2] = hsum(_mm256_shuffle_ps(t1, t3, 0x44)) + 0.0f;
        res[4 * g + 3] = hsum(_mm256_shuffle_ps(t1, t3, 0xEE)) + 0.0f;
    }
}
#undef X16_ROWS_CHUNK
#undef X16_ROWS_WORD

/* x16_rows_dot over weight rows [n0, n1), the loop inside the instance (as x16_span_m) */
static inline __attribute__((always_inline)) void x16_rows_span(const int type, const int G, const uint8_t *w,
        int64_t row_bytes, int64_t n0, int64_t n1, int64_t nc, const __m256i *xp, const __m256 *xdp,
        const __m256 *xsp, int m, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float res[16];
        prefetch_row(row + 8 * row_bytes, row_bytes);
        x16_rows_dot(type, G, row, nc, xp, xdp, xsp, res);
        for (int r = 0; r < m; r++) y[r * ldy + n] = res[r];
    }
}
#define X16_ROWS(T)                                                                                       \
    static void x16_rows_##T(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nc,      \
                             const __m256i *xp, const __m256 *xdp, const __m256 *xsp, int m, float *y,      \
                             int64_t ldy) {                                                               \
        switch ((m + 3) / 4) { /* 7 to 16 rows: two to four groups of four */                             \
        case 2: x16_rows_span(T, 2, w, row_bytes, n0, n1, nc, xp, xdp, xsp, m, y, ldy); break;            \
        case 3: x16_rows_span(T, 3, w, row_bytes, n0, n1, nc, xp, xdp, xsp, m, y, ldy); break;            \
        default: x16_rows_span(T, 4, w, row_bytes, n0, n1, nc, xp, xdp, xsp, m, y, ldy); break;           \
        }                                                                                                 \
    }
X16_ROWS(T_Q8_0) X16_ROWS(T_Q4_0) X16_ROWS(T_Q4_1) X16_ROWS(T_Q4_K) X16_ROWS(T_Q5_K) X16_ROWS(T_Q6_K)

typedef void (*x16_rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const __m256i *, const __m256 *,
                            const __m256 *, int, float *, int64_t);

static x16_rows_fn x16_rows_for(int type) {
    switch (type) {
    case T_Q8_0: return x16_rows_T_Q8_0; case T_Q4_0: return x16_rows_T_Q4_0;
    case T_Q4_1: return x16_rows_T_Q4_1; case T_Q4_K: return x16_rows_T_Q4_K;
    case T_Q5_K: return x16_rows_T_Q5_K; case T_Q6_K: return x16_rows_T_Q6_K;
    }
    return 0;
}
#endif

/* row_dot_m instantiated per row count: tiles of 8 rows for block types, 4 for float weights
 * (ub_gemv's tile) */
#define ROW_CASE(T, n) case n: row_dot_m(T, n, row, nc, x, ldx, res); break;
#define ROW_DOT_HEAD(T)                                                                         \
    static void row_dot_##T(const uint8_t *row, int64_t nc, const float *x, int64_t ldx, int m, float *res)
#define ROW_DOT(T)                                                                              \
    ROW_DOT_HEAD(T) {                                                                           \
        switch (m) {                                                                            \
        ROW_CASE(T, 1) ROW_CASE(T, 2) ROW_CASE(T, 3) ROW_CASE(T, 4)                             \
        ROW_CASE(T, 5) ROW_CASE(T, 6) ROW_CASE(T, 7)                                            \
        default: row_dot_m(T, 8, row, nc, x, ldx, res); break;                                  \
        }                                                                                       \
    }
#define ROW_DOT_FLOAT(T)                                                                        \
    ROW_DOT_HEAD(T) {                                                                           \
        switch (m) {                                                                            \
        ROW_CASE(T, 1) ROW_CASE(T, 2) ROW_CASE(T, 3)                                            \
        default: row_dot_m(T, 4, row, nc, x, ldx, res); break;                                  \
        }                                                                                       \
    }
ROW_DOT_FLOAT(T_F32) ROW_DOT_FLOAT(T_F16) ROW_DOT_FLOAT(T_BF16)
#if UB_AVX512
ROW_DOT(T_Q8_0) ROW_DOT(T_Q4_0) ROW_DOT(T_Q4_1) ROW_DOT(T_Q5_0) ROW_DOT(T_Q5_1) ROW_DOT(T_Q4_K) ROW_DOT(T_Q5_K)
ROW_DOT(T_Q6_K)
#endif

typedef void (*row_dot_fn)(const uint8_t *, int64_t, const float *, int64_t, int, float *);

static row_dot_fn row_dot_for(int type) {
    switch (type) {
    case T_F32: return row_dot_T_F32;   case T_F16: return row_dot_T_F16;
    case T_BF16: return row_dot_T_BF16;
#if UB_AVX512
    case T_Q8_0: return row_dot_T_Q8_0;
    case T_Q4_0: return row_dot_T_Q4_0; case T_Q4_1: return row_dot_T_Q4_1;
    case T_Q5_0: return row_dot_T_Q5_0; case T_Q5_1: return row_dot_T_Q5_1;
    case T_Q4_K: return row_dot_T_Q4_K; case T_Q5_K: return row_dot_T_Q5_K;
    case T_Q6_K: return row_dot_T_Q6_K;
#endif
    }
    return 0;
}
#endif

#if UB_X16
/* x16_dot_m per block type and row count (tiles of 8 rows, as row_dot_m's) */
#define X16_CASE(T, n) case n: x16_dot_m(T, n, row, nc, xq, ldq, xd, xs, res); break;
#define X16_DOT(T)                                                                                  \
    static void x16_dot_##T(const uint8_t *row, int64_t nc, const int16_t *xq, int64_t ldq,        \
                            const float *xd, const float *xs, int m, float *res) {                \
        switch (m) {                                                                                \
        X16_CASE(T, 1) X16_CASE(T, 2) X16_CASE(T, 3) X16_CASE(T, 4)                                 \
        X16_CASE(T, 5) X16_CASE(T, 6) X16_CASE(T, 7)                                                \
        default: x16_dot_m(T, 8, row, nc, xq, ldq, xd, xs, res); break;                             \
        }                                                                                           \
    }
/* x16_dot_m over weight rows [n0, n1) against a tile of mt (1..8) rows of x, the row loop inside
 * the instance for the tile's row count: one call per block and tile, not per weight row (at one
 * row of x a row of the default model's matrices is ~70 cycles of work, and a call through a
 * pointer with its switch, prologue and epilogue was a fifth as much again). The next rows are
 * prefetched eight ahead into L1 on the tile that reads them first: the output head streams 170
 * MiB a token (one thread on Zen 5: 1.29-1.36 ns a chunk against 1.40-1.60 four rows ahead). */
static inline __attribute__((always_inline)) void x16_span_m(const int type, const int M, const uint8_t *w,
        int64_t row_bytes, int64_t n0, int64_t n1, int first, int64_t nc, const int16_t *xq, const float *xd,
        const float *xs, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float res[8];
        if (first) prefetch_row(row + 8 * row_bytes, row_bytes);
        x16_dot_m(type, M, row, nc, xq, nc * 32, xd, xs, res);
        for (int r = 0; r < M; r++) y[r * ldy + n] = res[r];
    }
}
#define X16_SPAN_CASE(T, n) case n: x16_span_m(T, n, w, row_bytes, n0, n1, first, nc, xq, xd, xs, y, ldy); break;
#define X16_SPAN(T)                                                                                       \
    static void x16_span_##T(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int first,       \
                             int64_t nc, const int16_t *xq, const float *xd, const float *xs, int mt,      \
                             float *y, int64_t ldy) {                                                     \
        switch (mt) {                                                                                     \
        X16_SPAN_CASE(T, 1) X16_SPAN_CASE(T, 2) X16_SPAN_CASE(T, 3) X16_SPAN_CASE(T, 4)                   \
        X16_SPAN_CASE(T, 5) X16_SPAN_CASE(T, 6) X16_SPAN_CASE(T, 7)                                       \
        default: x16_span_m(T, 8, w, row_bytes, n0, n1, first, nc, xq, xd, xs, y, ldy); break;            \
        }                                                                                                 \
    }
X16_SPAN(T_Q8_0) X16_SPAN(T_Q4_0) X16_SPAN(T_Q4_1) X16_SPAN(T_Q5_0) X16_SPAN(T_Q5_1) X16_SPAN(T_Q4_K)
X16_SPAN(T_Q5_K) X16_SPAN(T_Q6_K)

typedef void (*x16_span_fn)(const uint8_t *, int64_t, int64_t, int64_t, int, int64_t, const int16_t *, const float *,
                            const float *, int, float *, int64_t);

static x16_span_fn x16_span_for(int type) {
    switch (type) {
    case T_Q8_0: return x16_span_T_Q8_0; case T_Q4_0: return x16_span_T_Q4_0;
    case T_Q4_1: return x16_span_T_Q4_1; case T_Q5_0: return x16_span_T_Q5_0;
    case T_Q5_1: return x16_span_T_Q5_1; case T_Q4_K: return x16_span_T_Q4_K;
    case T_Q5_K: return x16_span_T_Q5_K; case T_Q6_K: return x16_span_T_Q6_K;
    }
    return 0;
}
#endif

/* y[r, n] = sum_k x[r, k] * W[n, k] for r < m, n < n_rows: each weight row is read once for all
 * m activation rows (in tiles of eight, four for float weights, from L1) and never written out.
 * Weight rows go in blocks of GEMV_RB: each block meets every tile of x in turn, so a tile's x
 * rows stay in L1 (16 rows of 640 floats are 40 KiB) and the block is re-read from L2. */
enum { GEMV_RB = 16 };

#if UB_X16
/* floats of scratch the integer GEMV needs: x as 16-bit integers, then its scales, then its
 * scaled sums (64-byte aligned parts), then where x16_rows_dot takes the rows its panel */
static int64_t x16_scratch(int type, int64_t m, int64_t k, int64_t *scales_at) {
    int64_t q = round_up(m * (k / 32) * 16, 16), n = q + 2 * m * (k / 32);
    if (scales_at) *scales_at = q;
    if (x16_rows_for_m(type, k / 32, m)) /* 8: its 32-byte alignment */
        n += 8 + x16_rows_scratch(m, k / 32);
    return n;
}

/* the AVX2 build's GEMV for block types: x rounded to 16-bit integers once per call, in the
 * decoders' order (x16_chunk's eo; Q8_0's codes widen in order), then as ub_gemv */
static void x16_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x,
                     int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    int64_t nc = k / 32, at = 0, need = x16_scratch(type, m, k, &at);
    float *own = scratch ? 0 : (float *)malloc(sizeof(float) * need);
    if (own) scratch = own;
    int16_t *xq = (int16_t *)scratch;
    float *xd = scratch + at, *xs = xd + m * nc;
    x16_span_fn span = x16_span_for(type);
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < nc; c++)
            x16_chunk(x + r * ldx + 32 * c, type != T_Q8_0, xq + (r * nc + c) * 32, xd + r * nc + c, xs + r * nc + c);
    int64_t n_blocks = (n_rows + GEMV_RB - 1) / GEMV_RB;
    if (x16_rows_for_m(type, nc, m)) {
        const int64_t groups = (m + 3) / 4;
        float *pan = (float *)(((uintptr_t)(xs + m * nc) + 31) & ~(uintptr_t)31); /* 32-byte aligned */
        __m256i *xp = (__m256i *)pan;
        __m256 *xdp = (__m256 *)(pan + nc * groups * 64), *xsp = xdp + nc * groups;
        x16_rows_panel(xq, xd, xs, m, nc, xp, xdp, xsp);
        x16_rows_fn rows = x16_rows_for(type);
#pragma omp parallel for num_threads(nth) schedule(static)
        for (int64_t nb = 0; nb < n_blocks; nb++) {
            int64_t n1 = (nb + 1) * GEMV_RB < n_rows ? (nb + 1) * GEMV_RB : n_rows;
            rows(w, row_bytes, nb * GEMV_RB, n1, nc, xp, xdp, xsp, (int)m, y, ldy);
        }
        free(own);
        return;
    }
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        int64_t n1 = (nb + 1) * GEMV_RB < n_rows ? (nb + 1) * GEMV_RB : n_rows;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            int mt = (int)(m - r0 < 8 ? m - r0 : 8);
            span(w, row_bytes, nb * GEMV_RB, n1, r0 == 0, nc, xq + r0 * nc * 32, xd + r0 * nc, xs + r0 * nc, mt,
                 y + r0 * ldy, ldy);
        }
    }
    free(own);
}
#endif

/* floats of scratch ub_gemv needs for m rows of k values (AVX2, block types: x as 16-bit
 * integers with its scales and sums; otherwise none) */
int64_t ub_gemv_scratch(int type, int64_t m, int64_t k) {
    if (iq_type(type)) return iq_gemv_scratch(type, m, k); /* quant_iq.c */
    const int64_t vn = ub_vnni_scratch(type, m, k);
    if (vn >= 0 && ub_gemv_path == 0) return vn;
#if UB_X16
    if (x16_type(type)) return x16_scratch(type, m, k, 0);
#endif
    (void)type, (void)m, (void)k;
    return 0;
}

/* whether ub_gemv takes the integer path of gemv_vnni.c for this type and width (mul_mat_id
 * then rounds its gathered rows once and calls that path's row spans itself) */
int ub_gemv_takes_vnni(int type, int64_t k) { return !iq_type(type) && ub_gemv_path == 0 && ub_vnni_scratch(type, 1, k) >= 0; }

/* scratch: ub_gemv_scratch(type, m, k) floats, planned by the caller (NULL: allocated here) */
void ub_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k,
             const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    if (iq_type(type)) { /* MXFP4, the IQ and TQ types: quant_iq.c */
        iq_gemv(type, w, row_bytes, n_rows, k, x, m, ldx, y, ldy, scratch, nth);
        return;
    }
    if (ub_gemv_path == 0 && ub_gemv_vnni(type, w, row_bytes, n_rows, k, x, m, ldx, y, ldy, scratch, GEMV_RB, nth))
        return;
#if UB_X16
    if (x16_type(type)) {
        x16_gemv(type, w, row_bytes, n_rows, k, x, m, ldx, y, ldy, scratch, nth);
        return;
    }
#endif
    (void)scratch;
    int64_t nc = k / 32;
    const int tile = (type == T_F32 || type == T_F16 || type == T_BF16) ? 4 : 8;
#if UB_AVX2
    row_dot_fn dot = row_dot_for(type);
#endif
    int64_t n_blocks = (n_rows + GEMV_RB - 1) / GEMV_RB;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        int64_t n1 = (nb + 1) * GEMV_RB < n_rows ? (nb + 1) * GEMV_RB : n_rows;
        for (int64_t r0 = 0; r0 < m; r0 += tile) {
            int mt = (int)(m - r0 < tile ? m - r0 : tile);
            const float *xr = x + r0 * ldx;
            for (int64_t n = nb * GEMV_RB; n < n1; n++) {
                const uint8_t *row = w + n * row_bytes;
                float res[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#if UB_AVX2 /* the row four ahead into L1: measured +20% tg128 (the head streams 170 MiB a token) */
                if (r0 == 0) prefetch_row(row + 4 * row_bytes, row_bytes);
                dot(row, nc, xr, ldx, mt, res);
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
}
