/* The non-linear and grid block types read as stored: a 32-value chunk decoded to floats with
 * ggml's operations in ggml's order (compiled with -ffp-contract=off, so bit-exact to its
 * dequantize_row_*), for the GEMM's panels (iq_span) and the decode GEMV (iq_gemv). MXFP4, IQ4_NL
 * and IQ4_XS decode in vectors (a 16-entry table lookup with pshufb, then one multiply a value,
 * the same bits as the scalar code); the grid types decode in scalar code into a buffer.
 *
 * The grids are facts of the formats that the Python side owns (kernels/quant/iq_grids.py); it
 * hands them over once at load (ub_iq_init), so there is one copy of them. */
#include "quant_iq.h"
#include "quant_i16.h"

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const float IQ1_DELTA = 0.125f;

/* the grids, entries of 8 (IQ2, IQ1) or 4 (IQ3) bytes */
static const uint8_t *G_IQ2XXS, *G_IQ2XS, *G_IQ2S, *G_IQ3XXS, *G_IQ3S;
static const int8_t *G_IQ1S;

void ub_iq_init(const uint8_t *iq2xxs, const uint8_t *iq2xs, const uint8_t *iq2s, const uint8_t *iq3xxs,
                const uint8_t *iq3s, const int8_t *iq1s) {
    G_IQ2XXS = iq2xxs, G_IQ2XS = iq2xs, G_IQ2S = iq2s, G_IQ3XXS = iq3xxs, G_IQ3S = iq3s, G_IQ1S = iq1s;
}

/* ggml's ksigns_iq2xs: a 7-bit index with the parity of its set bits as bit 7 */
static inline uint8_t ksigns(uint32_t k) { return (uint8_t)(k | ((uint32_t)__builtin_parity(k) << 7)); }

/* eight values d * g[j], negated where bit j of s is set (ggml's `* -1.f`, which compilers
 * fold into a negation: a flipped sign bit, so no branch on random signs), as o[0..8) */
static inline void put8(float *o, uint64_t g, float d, uint8_t s) {
#if UB_AVX2
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)g))));
    __m256i bit = _mm256_and_si256(_mm256_set1_epi32(s), _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128));
    __m256i neg = _mm256_slli_epi32(_mm256_cmpeq_epi32(bit, _mm256_setzero_si256()), 31); /* sign bit where clear */
    neg = _mm256_xor_si256(neg, _mm256_set1_epi32((int)0x80000000u));
    _mm256_storeu_ps(o, _mm256_xor_ps(v, _mm256_castsi256_ps(neg)));
#else
    for (int j = 0; j < 8; j++) {
        float v = d * (float)((g >> 8 * j) & 255);
        uint32_t u;
        memcpy(&u, &v, 4);
        u ^= (uint32_t)((s >> j) & 1) << 31;
        memcpy(o + j, &u, 4);
    }
#endif
}

/* eight IQ1 values d * (g[j] + delta), g signed bytes */
static inline void put8_iq1(float *o, const int8_t *g, float d, float delta) {
#if UB_AVX2
    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)g)));
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_add_ps(q, _mm256_set1_ps(delta))));
#else
    for (int j = 0; j < 8; j++) o[j] = d * ((float)g[j] + delta);
#endif
}

static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* 2^(e - 128): half of an E8M0 scale, as MXFP4's doubled values want it */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static const int BLOCK_BYTES_256[40] = {[T_IQ2_XXS] = 66, [T_IQ2_XS] = 74, [T_IQ3_XXS] = 98, [T_IQ1_S] = 50,
                                        [T_IQ3_S] = 110, [T_IQ2_S] = 82, [T_IQ4_XS] = 136, [T_IQ1_M] = 56,
                                        [T_TQ1_0] = 54, [T_TQ2_0] = 66};

/* TQ1_0: value l (0..255) of a block: base-3 digits of 48 bytes then 4, as ggml walks them */
static inline float tq1_value(const uint8_t *b, int l, float d) {
    static const uint8_t pow3[6] = {1, 3, 9, 27, 81, 243};
    uint8_t q;
    if (l < 160) q = (uint8_t)(b[l % 32] * pow3[l / 32]);
    else if (l < 240) q = (uint8_t)(b[32 + (l - 160) % 16] * pow3[(l - 160) / 16]);
    else q = (uint8_t)(b[48 + (l - 240) % 4] * pow3[(l - 240) / 4]);
    int16_t xi = (int16_t)(((uint16_t)q * 3) >> 8);
    return (float)(xi - 1) * d;
}

/* values [32c, 32c + 32) of a row into o, in scalar code */
static void chunk_iq(int type, const uint8_t *row, int64_t c, float *o) {
    if (type == T_MXFP4 || type == T_IQ4_NL) {
        const uint8_t *b = row + c * (type == T_MXFP4 ? 17 : 18);
        if (type == T_MXFP4) {
            float d = e8m0_half(b[0]);
            for (int j = 0; j < 16; j++) {
                o[j] = (float)KV_MXFP4[b[1 + j] & 15] * d;
                o[j + 16] = (float)KV_MXFP4[b[1 + j] >> 4] * d;
            }
        } else {
            float d = h2f(rd16(b));
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)KV_IQ4NL[b[2 + j] & 15];
                o[j + 16] = d * (float)KV_IQ4NL[b[2 + j] >> 4];
            }
        }
        return;
    }
    const uint8_t *b = row + (c >> 3) * BLOCK_BYTES_256[type];
    const int ib = (int)(c & 7);
    switch (type) {
    case T_IQ4_XS: {
        int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xf) | (((rd16(b + 2) >> 2 * ib) & 3) << 4);
        float dl = h2f(rd16(b)) * (float)(ls - 32);
        const uint8_t *qs = b + 8 + 16 * ib;
        for (int j = 0; j < 16; j++) {
            o[j] = dl * (float)KV_IQ4NL[qs[j] & 15];
            o[j + 16] = dl * (float)KV_IQ4NL[qs[j] >> 4];
        }
        return;
    }
    case T_IQ2_XXS: {
        uint32_t a0 = rd32(b + 2 + 8 * ib), a1 = rd32(b + 6 + 8 * ib);
        float db = h2f(rd16(b)) * (0.5f + (float)(a1 >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) put8(o + 8 * l, rd64(G_IQ2XXS + 8 * ((a0 >> 8 * l) & 255)), db, ksigns((a1 >> 7 * l) & 127));
        return;
    }
    case T_IQ2_XS: case T_IQ2_S: {
        float d = h2f(rd16(b));
        uint8_t sc = b[(type == T_IQ2_XS ? 66 : 74) + ib];
        float db[2] = {d * (0.5f + (float)(sc & 0xf)) * 0.25f, d * (0.5f + (float)(sc >> 4)) * 0.25f};
        for (int l = 0; l < 4; l++) {
            const uint8_t *g;
            uint8_t s;
            if (type == T_IQ2_XS) {
                uint16_t q = rd16(b + 2 + 2 * (4 * ib + l));
                g = G_IQ2XS + 8 * (q & 511), s = ksigns(q >> 9);
            } else {
                g = G_IQ2S + 8 * (b[2 + 4 * ib + l] | ((b[66 + ib] << (8 - 2 * l)) & 0x300));
                s = b[34 + 4 * ib + l];
            }
            put8(o + 8 * l, rd64(g), db[l / 2], s);
        }
        return;
    }
    case T_IQ3_XXS: {
        const uint8_t *qs = b + 2 + 8 * ib;
        uint32_t aux = rd32(b + 66 + 4 * ib);
        float db = h2f(rd16(b)) * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            uint8_t s = ksigns((aux >> 7 * l) & 127);
            uint64_t g = rd32(G_IQ3XXS + 4 * qs[2 * l]) | (uint64_t)rd32(G_IQ3XXS + 4 * qs[2 * l + 1]) << 32;
            put8(o + 8 * l, g, db, s);
        }
        return;
    }
    case T_IQ3_S: {
        const uint8_t *qs = b + 2 + 8 * ib, qh = b[66 + ib], *signs = b + 74 + 4 * ib;
        float db = h2f(rd16(b)) * (float)(1 + 2 * ((b[106 + ib / 2] >> 4 * (ib % 2)) & 0xf));
        for (int l = 0; l < 4; l++) {
            uint64_t g = rd32(G_IQ3S + 4 * (qs[2 * l] | ((qh << (8 - 2 * l)) & 256))) |
                         (uint64_t)rd32(G_IQ3S + 4 * (qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256))) << 32;
            put8(o + 8 * l, g, db, signs[l]);
        }
        return;
    }
    case T_IQ1_S: {
        uint16_t qh = rd16(b + 34 + 2 * ib);
        float dl = h2f(rd16(b)) * (float)(2 * ((qh >> 12) & 7) + 1);
        float delta = qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
        for (int l = 0; l < 4; l++) {
            put8_iq1(o + 8 * l, G_IQ1S + 8 * (b[2 + 4 * ib + l] | (((qh >> 3 * l) & 7) << 8)), dl, delta);
        }
        return;
    }
    case T_IQ1_M: {
        uint16_t sc[4] = {rd16(b + 48), rd16(b + 50), rd16(b + 52), rd16(b + 54)};
        uint16_t bits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
        float d = h2f(bits);
        float dl[2] = {d * (float)(2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 7) + 1),
                       d * (float)(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 7) + 1)};
        const uint8_t *qs = b + 4 * ib, *qh = b + 32 + 2 * ib;
        for (int l = 0; l < 4; l++) {
            uint8_t h = qh[l / 2] >> (4 * (l % 2));
            put8_iq1(o + 8 * l, G_IQ1S + 8 * (qs[l] | ((h & 7) << 8)), dl[l / 2], h & 8 ? -IQ1_DELTA : IQ1_DELTA);
        }
        return;
    }
    case T_TQ1_0: {
        float d = h2f(rd16(b + 52));
        for (int j = 0; j < 32; j++) o[j] = tq1_value(b, 32 * ib + j, d);
        return;
    }
    case T_TQ2_0: {
        float d = h2f(rd16(b + 64));
        const uint8_t *qs = b + 32 * (ib / 4);
        for (int j = 0; j < 32; j++) o[j] = (float)(((qs[j] >> 2 * (ib % 4)) & 3) - 1) * d;
        return;
    }
    }
}

#if UB_AVX2
#if UB_AVX512
typedef __m512 ivec_t;
enum { IQ = 2, IW = 16 };
#define I_LOAD _mm512_loadu_ps
#define I_FMA _mm512_fmadd_ps
#define I_ZERO _mm512_setzero_ps
#define I_HSUM _mm512_reduce_add_ps
#define I_ADD _mm512_add_ps
#else
typedef __m256 ivec_t;
enum { IQ = 4, IW = 8 };
#define I_LOAD _mm256_loadu_ps
#define I_FMA _mm256_fmadd_ps
#define I_ZERO _mm256_setzero_ps
#define I_HSUM hsum
#define I_ADD _mm256_add_ps
#endif

/* IQ4_XS: the eight 32-value scales of a super-block, d * (ls - 32) as chunk_iq computes them */
static inline void iq4_xs_scales(const uint8_t *b, float dl[8]) {
    const float d = h2f(rd16(b));
    const uint16_t sh = rd16(b + 2);
    for (int ib = 0; ib < 8; ib++)
        dl[ib] = d * (float)((((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xf) | (((sh >> 2 * ib) & 3) << 4)) - 32);
}

/* 32 table values (the low nibbles of 16 bytes, then the high ones) times d, as vectors: the
 * same single products as chunk_iq's */
static inline __attribute__((always_inline)) void table_chunk(const uint8_t *qs, const int8_t *table, float d,
                                                              ivec_t v[IQ]) {
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0xF);
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    __m128i q[2] = {_mm_shuffle_epi8(t, _mm_and_si128(x, m4)), _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(x, 4), m4))};
#if UB_AVX512
    for (int i = 0; i < 2; i++) v[i] = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q[i])));
#else
    for (int i = 0; i < 2; i++) {
        v[2 * i] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[i])));
        v[2 * i + 1] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q[i], 8))));
    }
#endif
}

/* chunk c of a row as vectors: in vectors for the table types, through chunk_iq for the others */
static inline __attribute__((always_inline)) void chunk_vec(const int type, const uint8_t *row, int64_t c,
                                                            ivec_t v[IQ]) {
    if (type == T_MXFP4) {
        const uint8_t *b = row + c * 17;
        table_chunk(b + 1, KV_MXFP4, e8m0_half(b[0]), v);
    } else if (type == T_IQ4_NL) {
        const uint8_t *b = row + c * 18;
        table_chunk(b + 2, KV_IQ4NL, h2f(rd16(b)), v);
    } else if (type == T_IQ4_XS) {
        const uint8_t *b = row + (c >> 3) * 136;
        const int ib = (int)(c & 7);
        int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xf) | (((rd16(b + 2) >> 2 * ib) & 3) << 4);
        table_chunk(b + 8 + 16 * ib, KV_IQ4NL, h2f(rd16(b)) * (float)(ls - 32), v);
    } else {
        float buf[32] __attribute__((aligned(64)));
        chunk_iq(type, row, c, buf);
        for (int i = 0; i < IQ; i++) v[i] = I_LOAD(buf + IW * i);
    }
}

/* M (1..IQ_TILE) rows of x against one weight row: even chunks into one chain, odd into the other
 * (whatever M is, so a row's result does not depend on the rows sharing its call) */
static inline __attribute__((always_inline)) void iq_dot_m(const int type, const int M, const uint8_t *row,
                                                           int64_t nc, const float *x, int64_t ldx, float *res) {
    ivec_t ea[8], oa[8]; /* two chains, indexed by constants only: they stay in registers */
    for (int r = 0; r < M; r++) ea[r] = oa[r] = I_ZERO();
    int64_t c = 0;
    if (type == T_IQ4_XS) /* a super-block's eight scales once (1.46 -> 1.2 ns a chunk) */
        for (; c < nc; c += 8) {
            const uint8_t *b = row + (c >> 3) * 136;
            float dl[8];
            iq4_xs_scales(b, dl);
            for (int j = 0; j < 8; j += 2) {
                ivec_t v[IQ], u[IQ];
                table_chunk(b + 8 + 16 * j, KV_IQ4NL, dl[j], v);
                table_chunk(b + 24 + 16 * j, KV_IQ4NL, dl[j + 1], u);
                const float *xc = x + 32 * (c + j);
                for (int r = 0; r < M; r++)
                    for (int i = 0; i < IQ; i++) {
                        ea[r] = I_FMA(v[i], I_LOAD(xc + r * ldx + IW * i), ea[r]);
                        oa[r] = I_FMA(u[i], I_LOAD(xc + 32 + r * ldx + IW * i), oa[r]);
                    }
            }
        }
    for (; c + 1 < nc; c += 2) {
        ivec_t v[IQ], u[IQ];
        chunk_vec(type, row, c, v);
        chunk_vec(type, row, c + 1, u);
        const float *xc = x + 32 * c;
        for (int r = 0; r < M; r++)
            for (int i = 0; i < IQ; i++) {
                ea[r] = I_FMA(v[i], I_LOAD(xc + r * ldx + IW * i), ea[r]);
                oa[r] = I_FMA(u[i], I_LOAD(xc + 32 + r * ldx + IW * i), oa[r]);
            }
    }
    if (c < nc) {
        ivec_t v[IQ];
        chunk_vec(type, row, c, v);
        for (int r = 0; r < M; r++)
            for (int i = 0; i < IQ; i++) ea[r] = I_FMA(v[i], I_LOAD(x + 32 * c + r * ldx + IW * i), ea[r]);
    }
    for (int r = 0; r < M; r++) res[r] = I_HSUM(I_ADD(ea[r], oa[r]));
}

#define IQ_CASE(T, n) case n: iq_dot_m(T, n, row, nc, x, ldx, res); break;
#define IQ_DOT(T)                                                                                       \
    static void iq_dot_##T(const uint8_t *row, int64_t nc, const float *x, int64_t ldx, int m, float *res) { \
        switch (m) {                                                                                    \
        IQ_CASE(T, 1) IQ_CASE(T, 2) IQ_CASE(T, 3) IQ_CASE(T, 4)                                         \
        IQ_CASE(T, 5) IQ_CASE(T, 6) IQ_CASE(T, 7)                                                       \
        default: iq_dot_m(T, 8, row, nc, x, ldx, res); break;                                           \
        }                                                                                               \
    }
IQ_DOT(T_MXFP4) IQ_DOT(T_IQ4_NL) IQ_DOT(T_IQ4_XS)
/* the grid types: one instance, the type a runtime value (their decoding is scalar anyway) */
static void iq_dot_grid(int type, const uint8_t *row, int64_t nc, const float *x, int64_t ldx, int m, float *res) {
    switch (m) {
    case 1: iq_dot_m(type, 1, row, nc, x, ldx, res); break;
    case 2: iq_dot_m(type, 2, row, nc, x, ldx, res); break;
    case 3: iq_dot_m(type, 3, row, nc, x, ldx, res); break;
    case 4: iq_dot_m(type, 4, row, nc, x, ldx, res); break;
    default: iq_dot_m(type, 8, row, nc, x, ldx, res); break; /* 5..8: unused rows cost only time */
    }
}
#endif

static void iq_dot(int type, const uint8_t *row, int64_t nc, const float *x, int64_t ldx, int m, float *res) {
#if UB_AVX2
    switch (type) {
    case T_MXFP4: iq_dot_T_MXFP4(row, nc, x, ldx, m, res); return;
    case T_IQ4_NL: iq_dot_T_IQ4_NL(row, nc, x, ldx, m, res); return;
    case T_IQ4_XS: iq_dot_T_IQ4_XS(row, nc, x, ldx, m, res); return;
    }
    if (m > 4 && m < 8) { /* the grid instance's 8-row case reads rows m..7 of x: keep them in range */
        iq_dot_grid(type, row, nc, x, ldx, 4, res);
        iq_dot_grid(type, row, nc, x + 4 * ldx, ldx, m - 4, res + 4);
        return;
    }
    iq_dot_grid(type, row, nc, x, ldx, m, res);
#else
    float buf[32];
    for (int r = 0; r < m; r++) res[r] = 0;
    for (int64_t c = 0; c < nc; c++) {
        chunk_iq(type, row, c, buf);
        for (int r = 0; r < m; r++) {
            float s = 0;
            for (int l = 0; l < 32; l++) s += buf[l] * x[r * ldx + 32 * c + l];
            res[r] += s;
        }
    }
#endif
}

void iq_span(int type, const uint8_t *row, int64_t k0, int64_t n, float *out) {
    for (int64_t c = k0 / 32; c < (k0 + n) / 32; c++, out += 32) {
#if UB_AVX2
        ivec_t v[IQ];
        chunk_vec(type, row, c, v);
        for (int i = 0; i < IQ; i++)
#if UB_AVX512
            _mm512_storeu_ps(out + IW * i, v[i]);
#else
            _mm256_storeu_ps(out + IW * i, v[i]);
#endif
#else
        chunk_iq(type, row, c, out);
#endif
    }
}

enum { IQ_RB = 16 }; /* weight rows a thread takes at a time (as ub_gemv's GEMV_RB) */
/* rows of x a weight row meets per decode: 2 x 8 accumulators fill 16 of AVX-512's 32 registers,
 * AVX2 has 16 in all (8 rows spilled: 8.6 ns a chunk against 6.3 with one chain) */
#if UB_AVX512
enum { IQ_TILE = 8 };
#else
enum { IQ_TILE = 4 };
#endif

#if UB_X16
/* The AVX2 build's GEMV for the table types: their 32 int8 values of a chunk widened to 16 bits
 * meet x rounded to 16-bit integers (quant_i16.h's x16_chunk, in order) in `vpmaddwd`, exact
 * 32-bit sums scaled once a chunk, as the other block types' x16 path (one row, one thread:
 * IQ4_NL 1.80 -> 1.02 ns a chunk; x's rounding is quant_i16.h's, ~1.5e-5). */
static inline int iq_x16(int type) { return type == T_MXFP4 || type == T_IQ4_NL || type == T_IQ4_XS; }

/* a chunk's 16 bytes of nibbles as table values, widened: values 0..15, then 16..31 */
static inline __attribute__((always_inline)) void table_i16(const uint8_t *qs, const int8_t *table, __m256i v[2]) {
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0xF);
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    v[0] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(x, m4)));
    v[1] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
}

/* chunk c's codes and scale (IQ4_XS: dl, its super-block's scales, read at c % 8) */
static inline __attribute__((always_inline)) float table_codes(const int type, const uint8_t *row, int64_t c,
                                                               const float *dl, __m256i v[2]) {
    if (type == T_MXFP4) {
        table_i16(row + c * 17 + 1, KV_MXFP4, v);
        return e8m0_half(row[c * 17]);
    }
    if (type == T_IQ4_NL) {
        table_i16(row + c * 18 + 2, KV_IQ4NL, v);
        return h2f(rd16(row + c * 18));
    }
    table_i16(row + (c >> 3) * 136 + 8 + 16 * (c & 7), KV_IQ4NL, v);
    return dl[c & 7];
}

/* M (1..4) rows of x (xq: rows nc * 32 int16 apart, xd: their per-chunk scales, nc apart) against
 * one weight row: even chunks into one chain, odd into the other, whatever M is */
static inline __attribute__((always_inline)) void iq_x16_dot_m(const int type, const int M, const uint8_t *row,
        int64_t nc, const int16_t *xq, const float *xd, float *res) {
    __m256 ea[4], oa[4];
    float dl[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < M; r++) ea[r] = oa[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c += 2) {
        if (type == T_IQ4_XS && (c & 7) == 0) iq4_xs_scales(row + (c >> 3) * 136, dl);
        __m256i v[2], u[2];
        const float d0 = table_codes(type, row, c, dl, v);
        const int two = type == T_IQ4_XS || c + 1 < nc; /* IQ4_XS: eight chunks a block */
        const float d1 = two ? table_codes(type, row, c + 1, dl, u) : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < M; r++) {
            const int16_t *xr = xq + (r * nc + c) * 32;
            __m256i s = _mm256_add_epi32(_mm256_madd_epi16(v[0], _mm256_loadu_si256((const __m256i *)xr)),
                                         _mm256_madd_epi16(v[1], _mm256_loadu_si256((const __m256i *)(xr + 16))));
            ea[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d0 * xd[r * nc + c]), ea[r]);
            if (two) {
                s = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256((const __m256i *)(xr + 32))),
                                     _mm256_madd_epi16(u[1], _mm256_loadu_si256((const __m256i *)(xr + 48))));
                oa[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d1 * xd[r * nc + c + 1]), oa[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) res[r] = hsum(_mm256_add_ps(ea[r], oa[r]));
}

#define IQ16_CASE(T, n) case n: iq_x16_dot_m(T, n, row, nc, xq, xd, res); break;
#define IQ16_DOT(T)                                                                                      \
    static void iq16_dot_##T(const uint8_t *row, int64_t nc, const int16_t *xq, const float *xd, int m,  \
                             float *res) {                                                               \
        switch (m) {                                                                                     \
        IQ16_CASE(T, 1) IQ16_CASE(T, 2) IQ16_CASE(T, 3)                                                  \
        default: iq_x16_dot_m(T, 4, row, nc, xq, xd, res); break;                                        \
        }                                                                                                \
    }
IQ16_DOT(T_MXFP4) IQ16_DOT(T_IQ4_NL) IQ16_DOT(T_IQ4_XS)
#endif

/* floats of scratch iq_gemv needs (AVX2 table types: x as 16-bit integers, then its scales and
 * sums, laid out as quant_i16.h's GEMV lays them out; otherwise none) */
int64_t iq_gemv_scratch(int type, int64_t m, int64_t k) {
#if UB_X16
    if (iq_x16(type)) return round_up(m * (k / 32) * 16, 16) + 2 * m * (k / 32);
#endif
    (void)type, (void)m, (void)k;
    return 0;
}

void iq_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x, int64_t m,
             int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    const int64_t nc = k / 32, n_blocks = (n_rows + IQ_RB - 1) / IQ_RB;
#if UB_X16
    if (iq_x16(type)) {
        float *own = scratch ? 0 : (float *)malloc(sizeof(float) * iq_gemv_scratch(type, m, k));
        if (own) scratch = own;
        int16_t *xq = (int16_t *)scratch;
        float *xd = scratch + round_up(m * nc * 16, 16), *xs = xd + m * nc;
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < nc; c++)
                x16_chunk(x + r * ldx + 32 * c, 0, xq + (r * nc + c) * 32, xd + r * nc + c, xs + r * nc + c);
        void (*dot)(const uint8_t *, int64_t, const int16_t *, const float *, int, float *) =
            type == T_MXFP4 ? iq16_dot_T_MXFP4 : type == T_IQ4_NL ? iq16_dot_T_IQ4_NL : iq16_dot_T_IQ4_XS;
#pragma omp parallel for num_threads(nth) schedule(static)
        for (int64_t nb = 0; nb < n_blocks; nb++) {
            int64_t n1 = (nb + 1) * IQ_RB < n_rows ? (nb + 1) * IQ_RB : n_rows;
            for (int64_t r0 = 0; r0 < m; r0 += 4) {
                int mt = (int)(m - r0 < 4 ? m - r0 : 4);
                for (int64_t n = nb * IQ_RB; n < n1; n++) {
                    float res[4];
                    dot(w + n * row_bytes, nc, xq + r0 * nc * 32, xd + r0 * nc, mt, res);
                    for (int r = 0; r < mt; r++) y[(r0 + r) * ldy + n] = res[r];
                }
            }
        }
        free(own);
        return;
    }
#endif
    (void)scratch;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t nb = 0; nb < n_blocks; nb++) {
        int64_t n1 = (nb + 1) * IQ_RB < n_rows ? (nb + 1) * IQ_RB : n_rows;
        for (int64_t r0 = 0; r0 < m; r0 += IQ_TILE) {
            int mt = (int)(m - r0 < IQ_TILE ? m - r0 : IQ_TILE);
            for (int64_t n = nb * IQ_RB; n < n1; n++) {
                float res[8];
                iq_dot(type, w + n * row_bytes, nc, x + r0 * ldx, ldx, mt, res);
                for (int r = 0; r < mt; r++) y[(r0 + r) * ldy + n] = res[r];
            }
        }
    }
}
