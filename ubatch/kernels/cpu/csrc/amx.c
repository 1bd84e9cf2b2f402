/* Prefill's matrix product on AMX tiles (Intel Sapphire Rapids and later), to f32 accuracy.
 *
 * A tile product (TDPBF16PS) multiplies bf16 values, which hold 8 of f32's 24 significant bits,
 * but it multiplies them exactly and adds in f32. Each f32 value v is split into three bf16
 * parts that sum to it exactly, v = v0 + v1 + v2 (|v1| <= 2^-8 |v|, |v2| <= 2^-16 |v|), and
 * x . w is the sum of the six part products whose orders add up to at most 2 (x0w0; x0w1, x1w0;
 * x0w2, x1w1, x2w0). What is dropped (x1w2, x2w1, x2w2) is at most 2^-23 of each product and
 * typically far less, at f32's own rounding, so the result is as accurate as the f32 FMA
 * kernel's (other bits, not worse ones: measured against f64, more accurate). Six tile products
 * cost less than one f32 FMA pass: one core does ~3 TFLOP/s of bf16 tile products against
 * ~236 GFLOP/s of 512-bit f32 FMAs.
 *
 * Blocking, per slice of k (up to 1024 values, slice_len): all threads split that slice of x
 * into its three parts, laid out as A tiles (16 rows x 32 k); then each thread takes blocks of
 * ANC weight rows, dequantises the block into split B tiles (32 k x 16 rows, pairs of k
 * interleaved), and runs every 32-row strip of x against it, a 2 x 2 tile block of outputs at a
 * time, accumulating into y. Scratch is m x slice x 6 bytes of split x plus one block of tiles a
 * thread. */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "common.h"

#if UB_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define UB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define UB_AMX 0
#endif

void ub_dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, int64_t k, float *out);

enum { ANC = 64, TROWS = 16, TK = 32, TILE = TROWS * TK /* bf16 values */ };

/* 1 where this build has the AMX GEMM and the kernel lets the process use the tile registers */
int ub_amx_init(void) {
#if UB_AMX
    static int state = -1;
    if (state < 0) /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux hands out tile state on request */
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
#else
    return 0;
#endif
}

static inline int64_t pad32(int64_t v) { return round_up(v, 32); }

/* The k slice for m rows. Storing an output tile stalls the tile unit for ~1000 cycles (one
 * store or four cost the same; measured against ~17 a tile product), so a tile should sum as
 * much of k as it can between stores: 1024 values, 1.5x the f32 GEMM on a layer, against 256,
 * 1.35x. Fewer rows take shorter slices, so that the scratch stays under the rest of the
 * compute buffer's peak, as with 256 before. */
static int64_t slice_len(int64_t m) { return m >= 256 ? 1024 : m >= 128 ? 512 : 256; }

/* floats of scratch each thread needs beside the split x: one block's B tiles, its dequantised
 * rows and an edge tile */
static int64_t thread_floats(int64_t kcm) { return 3 * ANC * kcm / 2 + TROWS * kcm + TROWS * TROWS; }

/* floats of scratch ub_gemm_amx needs for m rows of x on nth threads */
int64_t ub_gemm_amx_scratch(int64_t m, int nth) {
    int64_t kcm = slice_len(m);
    return 3 * pad32(m) * kcm / 2 + (int64_t)nth * thread_floats(kcm);
}

#if UB_AMX
typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg_t;

/* v rounded to 8 significant bits, the nearest (ties away from zero), its low 16 bits zero: an
 * integer add on the bits carries into the exponent exactly where the rounding should */
static inline __m512 round_bf(__m512 v) {
    __m512i b = _mm512_add_epi32(_mm512_castps_si512(v), _mm512_set1_epi32(0x8000));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000)));
}

/* the three bf16 parts of 32 floats (v0: the first 16), each as 32 bf16 in order. The parts sum
 * to v exactly: v - p0 (exact) keeps at most 16 significant bits, and its residual after p1 at
 * most 8, which bf16 holds as they are; p1 is at most 2^-8 of v and p2 at most 2^-16. Each part
 * has zero low bits, so its conversion to bf16 is exact. */
static inline void split_vec(__m512 v0, __m512 v1, __m512i out[3]) {
    __m512 a0 = round_bf(v0), a1 = round_bf(v1);
    __m512 r0 = _mm512_sub_ps(v0, a0), r1 = _mm512_sub_ps(v1, a1);
    __m512 b0 = round_bf(r0), b1 = round_bf(r1);
    out[0] = (__m512i)_mm512_cvtne2ps_pbh(a1, a0);
    out[1] = (__m512i)_mm512_cvtne2ps_pbh(b1, b0);
    out[2] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(r1, b1), _mm512_sub_ps(r0, b0));
}

/* the parts of 32 floats at src, n of them valid (the rest zero) */
static inline void split32(const float *src, int n, __m512i out[3]) {
    __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    __mmask16 m1 = n >= 32 ? 0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
    split_vec(_mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16), out);
}

/* r[i][j] -> r[j][i] for 8 x 8 64-bit values (pairs of floats; tile.h's transpose8 moves floats) */
static inline void transpose_pairs(__m512i r[8]) {
    __m512i t[8];
    for (int p = 0; p < 4; p++) { /* t[2p + c], 128-bit lane L: column 2L + c of rows 2p, 2p + 1 */
        t[2 * p] = _mm512_unpacklo_epi64(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_epi64(r[2 * p], r[2 * p + 1]);
    }
    for (int c = 0; c < 2; c++) {
        __m512i v0 = _mm512_shuffle_i64x2(t[c], t[2 + c], 0x44), v1 = _mm512_shuffle_i64x2(t[c], t[2 + c], 0xee);
        __m512i w0 = _mm512_shuffle_i64x2(t[4 + c], t[6 + c], 0x44), w1 = _mm512_shuffle_i64x2(t[4 + c], t[6 + c], 0xee);
        r[c] = _mm512_shuffle_i64x2(v0, w0, 0x88);
        r[2 + c] = _mm512_shuffle_i64x2(v0, w0, 0xdd);
        r[4 + c] = _mm512_shuffle_i64x2(v1, w1, 0x88);
        r[6 + c] = _mm512_shuffle_i64x2(v1, w1, 0xdd);
    }
}

/* The tiles of a pair of 16-row tiles, for each k block, each part, each tile of the pair: the
 * kernel then reads one pair's tiles as one sequential stream (a stream per tile, crossing a page
 * every few k blocks, starved the prefetcher) */
static inline int64_t tile_at(int64_t pair, int64_t nkb, int64_t kb, int q, int64_t half) {
    return (((pair * nkb + kb) * 3 + q) * 2 + half) * TILE;
}

/* A tiles of x rows [16 rt, 16 rt + 16), values [0, kc) of x's rows */
static void split_x(const float *x, int64_t ldx, int64_t m, int64_t kc, int64_t rt, uint16_t *xs) {
    int64_t nkb = pad32(kc) / TK;
    for (int r = 0; r < TROWS; r++) {
        int64_t row = rt * TROWS + r;
        for (int64_t kb = 0; kb < nkb; kb++) {
            __m512i p[3];
            int n = row < m ? (int)(kc - kb * TK < TK ? kc - kb * TK : TK) : 0;
            split32(x + row * ldx + kb * TK, n, p);
            for (int q = 0; q < 3; q++)
                _mm512_storeu_si512(xs + tile_at(rt / 2, nkb, kb, q, rt % 2) + r * TK, p[q]);
        }
    }
}

/* B tiles of weight rows [n0, n0 + nr) (the rest zero), values [k0, k0 + kc), as tile `half` of the
 * pair at panel. A tile row is one k pair of 16 weight rows: a transpose of pairs (64-bit units)
 * of the dequantised rows, then the split, so that the three parts share one transpose. */
static void pack_tiles(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nr, int64_t k0,
                       int64_t kc, int64_t k, float *rows, int64_t ldr, uint16_t *panel, int64_t half) {
    int64_t nkb = pad32(kc) / TK;
    for (int64_t i = 0; i < TROWS; i++) {
        float *dst = rows + i * ldr;
        if (i < nr) {
            ub_dequant_span(type, w + (n0 + i) * row_bytes, k0, kc, k, dst);
            for (int64_t l = kc; l < pad32(kc); l++) dst[l] = 0.0f;
        } else {
            memset(dst, 0, sizeof(float) * pad32(kc));
        }
    }
    for (int64_t kb = 0; kb < nkb; kb++) {
        for (int h = 0; h < 2; h++) { /* pairs 8h .. 8h + 7: two 8 x 8 blocks of pairs, 16 registers */
            __m512i lo[8], hi[8];
            for (int i = 0; i < 8; i++) {
                lo[i] = _mm512_loadu_si512(rows + i * ldr + kb * TK + 16 * h);
                hi[i] = _mm512_loadu_si512(rows + (i + 8) * ldr + kb * TK + 16 * h);
            }
            transpose_pairs(lo); /* lo[j]: pair 8h + j of rows 0-7 */
            transpose_pairs(hi);
            for (int j = 0; j < 8; j++) {
                __m512i p[3];
                split_vec(_mm512_castsi512_ps(lo[j]), _mm512_castsi512_ps(hi[j]), p);
                for (int s = 0; s < 3; s++)
                    _mm512_storeu_si512(panel + tile_at(0, nkb, kb, s, half) + (8 * h + j) * TK, p[s]);
            }
        }
    }
}

/* C tile T from y[r0.., c0..] (vr x vc valid; zero for the first k slice) and back, through tmp at
 * the edges */
#define C_LOAD(T, yp, vr, vc, acc)                                                                   \
    do {                                                                                              \
        if (!(acc)) _tile_zero(T);                                                                    \
        else if ((vr) == TROWS && (vc) == TROWS) _tile_loadd(T, yp, ldy * 4);                        \
        else {                                                                                        \
            memset(tmp, 0, sizeof(float) * TROWS * TROWS);                                            \
            for (int _r = 0; _r < (vr); _r++) memcpy(tmp + _r * TROWS, (yp) + _r * ldy, 4 * (vc));    \
            _tile_loadd(T, tmp, 64);                                                                  \
        }                                                                                             \
    } while (0)
#define C_STORE(T, yp, vr, vc)                                                                       \
    do {                                                                                              \
        if ((vr) == TROWS && (vc) == TROWS) _tile_stored(T, yp, ldy * 4);                            \
        else if ((vr) > 0 && (vc) > 0) {                                                              \
            _tile_stored(T, tmp, 64);                                                                 \
            for (int _r = 0; _r < (vr); _r++) memcpy((yp) + _r * ldy, tmp + _r * TROWS, 4 * (vc));    \
        }                                                                                             \
    } while (0)
/* the next part of w (B tiles of both column tiles) times the x part in tiles 4 and 5 */
#define DP4(b0, b1)                                                                                  \
    do {                                                                                              \
        _tile_loadd(6, b0, 64);                                                                       \
        _tile_loadd(7, b1, 64);                                                                       \
        _tile_dpbf16ps(0, 4, 6);                                                                      \
        _tile_dpbf16ps(1, 4, 7);                                                                      \
        _tile_dpbf16ps(2, 5, 6);                                                                      \
        _tile_dpbf16ps(3, 5, 7);                                                                      \
    } while (0)

static inline int64_t clampv(int64_t v) { return v < 0 ? 0 : v > TROWS ? TROWS : v; }

/* y[s.., c..] (+)= x strips . one block's panel, a 2 x 2 tile block at a time */
static void block_product(const uint16_t *xs, int64_t nrt, int64_t nkb, const uint16_t *panel, int64_t n_ct,
                          int64_t m, int64_t c0, int64_t n, float *y, int64_t ldy, int acc, float *tmp) {
    for (int64_t rt = 0; rt < nrt; rt += 2) {
        int64_t vr0 = clampv(m - rt * TROWS), vr1 = clampv(m - (rt + 1) * TROWS);
        for (int64_t ct = 0; ct < n_ct; ct += 2) {
            int64_t cc = c0 + ct * TROWS, vc0 = clampv(n - cc), vc1 = clampv(n - cc - TROWS);
            float *y00 = y + rt * TROWS * ldy + cc, *y10 = y00 + TROWS * ldy;
            C_LOAD(0, y00, vr0, vc0, acc);
            C_LOAD(1, y00 + TROWS, vr0, vc1, acc);
            C_LOAD(2, y10, vr1, vc0, acc);
            C_LOAD(3, y10 + TROWS, vr1, vc1, acc);
            for (int64_t kb = 0; kb < nkb; kb++) {
                const uint16_t *a = xs + tile_at(rt / 2, nkb, kb, 0, 0), *b = panel + tile_at(ct / 2, nkb, kb, 0, 0);
                _tile_loadd(4, a, 64);
                _tile_loadd(5, a + TILE, 64);
                DP4(b, b + TILE);                 /* x0 w0 */
                DP4(b + 2 * TILE, b + 3 * TILE);  /* x0 w1 */
                DP4(b + 4 * TILE, b + 5 * TILE);  /* x0 w2 */
                _tile_loadd(4, a + 2 * TILE, 64);
                _tile_loadd(5, a + 3 * TILE, 64);
                DP4(b, b + TILE);                 /* x1 w0 */
                DP4(b + 2 * TILE, b + 3 * TILE);  /* x1 w1 */
                _tile_loadd(4, a + 4 * TILE, 64);
                _tile_loadd(5, a + 5 * TILE, 64);
                DP4(b, b + TILE);                 /* x2 w0 */
            }
            C_STORE(0, y00, vr0, vc0);
            C_STORE(1, y00 + TROWS, vr0, vc1);
            C_STORE(2, y10, vr1, vc0);
            C_STORE(3, y10 + TROWS, vr1, vc1);
        }
    }
}
#endif

/* y[r, n] = sum_k x[r, k] W[n, k] on AMX tiles; scratch holds ub_gemm_amx_scratch(m, nth) floats.
 * Returns 0 where this build or process has no AMX (the caller then takes the f32 GEMM). */
int ub_gemm_amx(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
#if UB_AMX
    if (ub_amx_init() != 1) return 0;
    int64_t nrt = pad32(m) / TROWS, n_blocks = (n + ANC - 1) / ANC;
    uint16_t *xs = (uint16_t *)scratch;
    int64_t kcm = slice_len(m);
    float *per_thread = scratch + 3 * pad32(m) * kcm / 2;
#pragma omp parallel num_threads(nth)
    {
#ifdef _OPENMP
        int tid = omp_get_thread_num();
#else
        int tid = 0;
#endif
        uint16_t *panel = (uint16_t *)(per_thread + (int64_t)tid * thread_floats(kcm));
        float *rows = (float *)(panel + 3 * ANC * kcm), *tmp = rows + TROWS * kcm;
        tilecfg_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = TROWS;
        _tile_loadconfig(&cfg);
        for (int64_t k0 = 0; k0 < k; k0 += kcm) {
            int64_t kc = k - k0 < kcm ? k - k0 : kcm, nkb = pad32(kc) / TK;
#pragma omp for schedule(static)
            for (int64_t rt = 0; rt < nrt; rt++) split_x(x + k0, ldx, m, kc, rt, xs);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < n_blocks; b++) {
                int64_t n0 = b * ANC, nb = n - n0 < ANC ? n - n0 : ANC, n_ct = (nb + TROWS - 1) / TROWS;
                n_ct += n_ct & 1; /* tiles go in pairs; a padding tile is zero rows */
                for (int64_t ct = 0; ct < n_ct; ct++) {
                    int64_t c = n0 + ct * TROWS;
                    pack_tiles(type, w, row_bytes, c, clampv(n - c), k0, kc, k, rows, kcm,
                               panel + tile_at(ct / 2, nkb, 0, 0, 0), ct % 2);
                }
                block_product(xs, nrt, nkb, panel, n_ct, m, n0, n, y, ldy, k0 > 0, tmp);
            }
        }
        _tile_release();
    }
    return 1;
#else /* no such kernel in this build: the caller keeps its other path */
    return 0;
#endif
}
