/* Prefill's matrix product straight from the blocks: y = x . W^T for more rows than the GEMV
 * takes. MKL's f32 GEMM reaches about half of this CPU's FMA peak on prefill's shapes (measured
 * 98-131 of 218 GFLOP/s on 2 Zen 3 cores); a register-blocked kernel that dequantises each weight
 * panel straight into the layout it consumes does better and needs no dequantised tile of rows.
 *
 * Blocking: each thread takes blocks of NC weight rows; per KC-long slice of k it dequantises the
 * block into panels of NR rows stored k-major (panel[k][NR], L2-resident), then for every MR rows
 * of x runs the MR x NR kernel (12 accumulators in registers, x broadcast from L1) over the
 * panels. Each output accumulates in one FMA chain over k.
 *
 * The AVX2 build's block types take the same blocking with integers (x16_gemm below): x rounded
 * to 16-bit integers once per call, the panels 16-bit codes in k-pairs, `vpmaddwd` into 32-bit
 * sums scaled into the f32 outputs every 32 values (quant_i16.h; 1.4x the f32 kernel). The
 * AVX-512 build's K-quants take an integer GEMM with x as 16 + 8 bits (gemv_vnni.c). */
#include "tile.h"

void ub_dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, int64_t k, float *out);

#include "quant_i16.h"

/* the AVX-512 build's K-quant GEMM on 16-bit integers (gemv_vnni.c; -1 / 0 where it does not apply) */
int64_t ub_gemm_vnni_scratch(int type, int64_t m, int64_t k, int nth);
int ub_gemm_vnni(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                 int64_t ldx, float *y, int64_t ldy, float *scratch, int nth);

#if UB_X16
/* the integer GEMM's per-thread panels: NC rows x KC 16-bit codes laid out as k-pairs of NR
 * columns, their scales and mins per 16 values, and the rows of one panel as decoded */
enum { X16_PANELS = NC * KC / 2, X16_SCALES = 2 * NC * (KC / 16), X16_ROWS = NR * KC / 2 + 2 * NR * (KC / 16) };
enum { X16_THREAD = X16_PANELS + X16_SCALES + X16_ROWS };
#endif

/* floats of scratch ub_gemm needs for an m x k product of type on nth threads: per thread a
 * block of weight panels; on AVX2, for block types, x as 16-bit integers with its scales first */
int64_t ub_gemm_scratch(int type, int64_t m, int64_t k, int nth) {
    const int64_t vnni = ub_gemm_vnni_scratch(type, m, k, nth);
    if (vnni >= 0) return vnni;
#if UB_X16
    if (x16_type(type)) return round_up(m * k / 2 + 2 * m * (k / 32), 16) + (int64_t)nth * X16_THREAD;
#else
    (void)type, (void)m, (void)k;
#endif
    return (int64_t)nth * (NC * KC + NR * KC);
}

#if UB_AVX2
/* rows [n0, n0 + nr) (nr <= NR; missing rows are zero) values [k0, k0 + kc) into panel[kc][NR] */
static void pack_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nr, int64_t k0,
                       int64_t kc, int64_t k, float *rows, float *panel) {
    int64_t kc8 = (kc + 7) / 8 * 8;
    for (int64_t i = 0; i < NR; i++) {
        float *dst = rows + i * KC;
        if (i < nr) {
            ub_dequant_span(type, w + (n0 + i) * row_bytes, k0, kc, k, dst);
            for (int64_t l = kc; l < kc8; l++) dst[l] = 0.0f;
        } else {
            memset(dst, 0, sizeof(float) * kc8);
        }
    }
    for (int64_t l = 0; l < kc8; l += 8)
        for (int i = 0; i < NR; i += 8) transpose8(rows + i * KC + l, KC, panel + l * NR + i, NR);
}
#endif

#if UB_X16
/* rows [n0, n0 + nr) (missing rows are zero) values [k0, k0 + kc) as 16-bit codes into a panel:
 * k-pair p of column i is the 32-bit word panel[p * NR + i] (two codes, as vpmaddwd pairs them),
 * then per 16 values the NR columns' scales and mins (sc[s * NR + i], mn[s * NR + i]) */
static void x16_pack(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nr, int64_t k0,
                     int64_t kc, int32_t *rows, int32_t *panel, float *sc, float *mn) {
    const int64_t nsub = kc / 16, half = KC / 2; /* rows: NR rows of KC codes (half as many words) */
    float *rsc = (float *)(rows + NR * half), *rmn = rsc + NR * (KC / 16);
    for (int64_t i = 0; i < NR; i++) {
        int16_t *dst = (int16_t *)(rows + i * half);
        float *ds = rsc + i * (KC / 16), *dm = rmn + i * (KC / 16);
        if (i >= nr) {
            memset(dst, 0, 2 * kc);
            for (int64_t s = 0; s < nsub; s++) ds[s] = dm[s] = 0;
            continue;
        }
        const uint8_t *row = w + (n0 + i) * row_bytes;
        for (int64_t c = k0 / 32; c < (k0 + kc) / 32; c++, dst += 32, ds += 2, dm += 2) {
            __m256i yb;
            int sign;
            float d, db, m;
            if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
                const uint8_t *b = row + (c >> 3) * (type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210);
                k_scale(type, b, (int)(c & 7), &d, &db, &m);
                yb = k_bytes(type, b, (int)(c & 7));
                sign = type == T_Q6_K;
            } else {
                sign = block_bytes(type, row, c, &yb, &d, &m);
                db = d;
            }
            __m128i lo = _mm256_castsi256_si128(yb), hi = _mm256_extracti128_si256(yb, 1);
            _mm256_storeu_si256((__m256i *)dst, sign ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo));
            _mm256_storeu_si256((__m256i *)(dst + 16), sign ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi));
            ds[0] = d, ds[1] = db, dm[0] = dm[1] = m; /* per 16 values: the chunk's twice but Q6_K's */
        }
    }
    for (int64_t p = 0; p < kc / 2; p += 8)
        for (int i = 0; i < NR; i += 8)
            transpose8((const float *)(rows + i * half + p), half, (float *)(panel + p * NR + i), NR);
    for (int64_t s = 0; s < nsub; s++)
        for (int i = 0; i < NR; i++) sc[s * NR + i] = rsc[i * (KC / 16) + s], mn[s * NR + i] = rmn[i * (KC / 16) + s];
}

/* c[M][NR] (+)= the product of M rows of 16-bit x (xq, words of k-pairs; scales xd, scaled sums xs
 * per 32 values, rows ldd apart) with a panel over kc values. Per output and per SUB values: the
 * exact 32-bit sum of the products, converted, times (weight scale * x scale) into the f32 sum,
 * then the min term; the f32 sums live in c (L1), the 32-bit ones in registers. */
static inline __attribute__((always_inline)) void x16_kernel(const int M, const int SUB, const int MIN, int64_t kc,
        const int32_t *xq, int64_t ldq, const float *xd, const float *xs, int64_t ldd, const int32_t *wp,
        const float *sc, const float *mn, float *c, int64_t ldc, int acc) {
    if (!acc)
        for (int r = 0; r < M; r++) {
            _mm256_storeu_ps(c + r * ldc, _mm256_setzero_ps());
            _mm256_storeu_ps(c + r * ldc + 8, _mm256_setzero_ps());
        }
    const int P = SUB / 2; /* k-pairs a scale covers */
    for (int64_t s = 0; s < kc / SUB; s++) {
        __m256i a0[MR], a1[MR];
        for (int r = 0; r < M; r++) a0[r] = a1[r] = _mm256_setzero_si256();
        const int32_t *w0 = wp + s * P * NR, *x0 = xq + s * P;
#pragma GCC unroll 16
        for (int p = 0; p < P; p++) {
            __m256i wa = _mm256_loadu_si256((const __m256i *)(w0 + p * NR));
            __m256i wb = _mm256_loadu_si256((const __m256i *)(w0 + p * NR + 8));
            for (int r = 0; r < M; r++) {
                __m256i b = _mm256_set1_epi32(x0[r * ldq + p]);
                a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(wa, b));
                a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(wb, b));
                /* kept as running sums in registers: gcc would otherwise reassociate the integer
                 * adds of the unrolled loop into trees and spill the products */
                __asm__("" : "+x"(a0[r]), "+x"(a1[r]));
            }
        }
        const int64_t cx = s * SUB / 32; /* x's scale index */
        const float *ss = sc + s * (SUB / 16) * NR, *sm = mn + s * (SUB / 16) * NR; /* kept per 16 values */
        __m256 s0 = _mm256_loadu_ps(ss), s1 = _mm256_loadu_ps(ss + 8);
        for (int r = 0; r < M; r++) {
            __m256 dx = _mm256_set1_ps(xd[r * ldd + cx]);
            float *cr = c + r * ldc;
            __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[r]), _mm256_mul_ps(s0, dx), _mm256_loadu_ps(cr));
            __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[r]), _mm256_mul_ps(s1, dx), _mm256_loadu_ps(cr + 8));
            if (MIN) {
                __m256 xsr = _mm256_set1_ps(xs[r * ldd + cx]);
                f0 = _mm256_fmadd_ps(_mm256_loadu_ps(sm), xsr, f0);
                f1 = _mm256_fmadd_ps(_mm256_loadu_ps(sm + 8), xsr, f1);
            }
            _mm256_storeu_ps(cr, f0);
            _mm256_storeu_ps(cr + 8, f1);
        }
    }
}

#define X16_KERNEL(SUB, MIN)                                                                                  \
    static void x16_kernel_##SUB##_##MIN(int m, int64_t kc, const int32_t *xq, int64_t ldq, const float *xd,   \
                                         const float *xs, int64_t ldd, const int32_t *wp, const float *sc,   \
                                         const float *mn, float *c, int64_t ldc, int acc) {                  \
        switch (m) {                                                                                          \
        case 1: x16_kernel(1, SUB, MIN, kc, xq, ldq, xd, xs, ldd, wp, sc, mn, c, ldc, acc); break;            \
        case 2: x16_kernel(2, SUB, MIN, kc, xq, ldq, xd, xs, ldd, wp, sc, mn, c, ldc, acc); break;            \
        case 3: x16_kernel(3, SUB, MIN, kc, xq, ldq, xd, xs, ldd, wp, sc, mn, c, ldc, acc); break;            \
        case 4: x16_kernel(4, SUB, MIN, kc, xq, ldq, xd, xs, ldd, wp, sc, mn, c, ldc, acc); break;            \
        case 5: x16_kernel(5, SUB, MIN, kc, xq, ldq, xd, xs, ldd, wp, sc, mn, c, ldc, acc); break;            \
        default: x16_kernel(MR, SUB, MIN, kc, xq, ldq, xd, xs, ldd, wp, sc, mn, c, ldc, acc); break;         \
        }                                                                                                     \
    }
X16_KERNEL(32, 0) X16_KERNEL(32, 1) X16_KERNEL(16, 0)
typedef void (*x16_kernel_fn)(int, int64_t, const int32_t *, int64_t, const float *, const float *, int64_t,
                              const int32_t *, const float *, const float *, float *, int64_t, int);

/* the integer GEMM: x quantised once by all threads, then each thread's blocks of NC weight rows
 * packed per KC slice as 16-bit codes and multiplied like the f32 GEMM below */
static void x16_gemm(const int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                     int64_t m, int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    const int64_t nc = k / 32, ldq = k / 2; /* x's words a row */
    int32_t *xq = (int32_t *)scratch;
    float *xd = scratch + m * k / 2, *xs = xd + m * nc, *own = scratch + round_up(m * k / 2 + 2 * m * nc, 16);
    const x16_kernel_fn kern = type == T_Q6_K ? x16_kernel_16_0 : x16_has_min(type) ? x16_kernel_32_1 : x16_kernel_32_0;
    const int64_t n_blocks = (n + NC - 1) / NC;
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < nc; c++)
                x16_chunk(x + r * ldx + 32 * c, 0, (int16_t *)(xq + r * ldq) + 32 * c, xd + r * nc + c, xs + r * nc + c);
#ifdef _OPENMP
        int tid = omp_get_thread_num();
#else
        int tid = 0;
#endif
        int32_t *panels = (int32_t *)(own + (int64_t)tid * X16_THREAD);
        float *sc = (float *)(panels + X16_PANELS), *mn = sc + X16_SCALES / 2;
        int32_t *rows = (int32_t *)(sc + X16_SCALES);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n_blocks; b++) {
            int64_t n0 = b * NC, nb = n - n0 < NC ? n - n0 : NC, n_panels = (nb + NR - 1) / NR;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t kc = k - k0 < KC ? k - k0 : KC;
                for (int64_t p = 0; p < n_panels; p++) {
                    int64_t nr = nb - p * NR < NR ? nb - p * NR : NR;
                    x16_pack(type, w, row_bytes, n0 + p * NR, nr, k0, kc, rows, panels + p * (KC / 2) * NR,
                             sc + p * (KC / 16) * NR, mn + p * (KC / 16) * NR);
                }
                for (int64_t mc0 = 0; mc0 < m; mc0 += MC) {
                    int64_t mc1 = m < mc0 + MC ? m : mc0 + MC;
                    for (int64_t p = 0; p < n_panels; p++) {
                        int64_t c0 = n0 + p * NR, nr = n - c0 < NR ? n - c0 : NR;
                        const int32_t *wp = panels + p * (KC / 2) * NR;
                        const float *ps = sc + p * (KC / 16) * NR, *pm = mn + p * (KC / 16) * NR;
                        for (int64_t m0 = mc0; m0 < mc1; m0 += MR) {
                            int mr = (int)(mc1 - m0 < MR ? mc1 - m0 : MR);
                            const int32_t *xr = xq + m0 * ldq + k0 / 2;
                            const float *dr = xd + m0 * nc + k0 / 32, *sr = xs + m0 * nc + k0 / 32;
                            if (nr == NR) {
                                kern(mr, kc, xr, ldq, dr, sr, nc, wp, ps, pm, y + m0 * ldy + c0, ldy, k0 > 0);
                            } else { /* through a full-width tile */
                                float tile[MR * NR] = {0};
                                float *yc = y + m0 * ldy + c0;
                                for (int r = 0; r < mr && k0 > 0; r++) memcpy(tile + r * NR, yc + r * ldy, 4 * nr);
                                kern(mr, kc, xr, ldq, dr, sr, nc, wp, ps, pm, tile, NR, k0 > 0);
                                for (int r = 0; r < mr; r++) memcpy(yc + r * ldy, tile + r * NR, 4 * nr);
                            }
                        }
                    }
                }
            }
        }
    }
}
#endif

/* y[r, n] = sum_k x[r, k] W[n, k]; scratch holds ub_gemm_scratch(type, m, k, nth) floats.
 * Returns 0 where this build has no such kernel (the caller then takes the BLAS path). */
int ub_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
            int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
    if (ub_gemm_vnni(type, w, row_bytes, n, k, x, m, ldx, y, ldy, scratch, nth)) return 1;
#if UB_X16
    if (x16_type(type)) {
        x16_gemm(type, w, row_bytes, n, k, x, m, ldx, y, ldy, scratch, nth);
        return 1;
    }
#endif
#if UB_AVX2
    int64_t n_blocks = (n + NC - 1) / NC;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
#ifdef _OPENMP
        int tid = omp_get_thread_num();
#else
        int tid = 0;
#endif
        float *panels = scratch + (int64_t)tid * (NC * KC + NR * KC), *rows = panels + NC * KC;
        int64_t n0 = b * NC, nb = n - n0 < NC ? n - n0 : NC, n_panels = (nb + NR - 1) / NR;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            int64_t kc = k - k0 < KC ? k - k0 : KC;
            for (int64_t p = 0; p < n_panels; p++) {
                int64_t nr = nb - p * NR < NR ? nb - p * NR : NR;
                pack_panel(type, w, row_bytes, n0 + p * NR, nr, k0, kc, k, rows, panels + p * KC * NR);
            }
            /* an MC-row slice of x stays in L2 while each panel, in L1, meets all its strips */
            for (int64_t mc0 = 0; mc0 < m; mc0 += MC) {
                int64_t mc1 = m < mc0 + MC ? m : mc0 + MC;
                for (int64_t p = 0; p < n_panels; p++) {
                    int64_t c0 = n0 + p * NR, nr = n - c0 < NR ? n - c0 : NR;
                    const float *wp = panels + p * KC * NR;
                    for (int64_t m0 = mc0; m0 < mc1; m0 += MR) {
                        int mr = (int)(mc1 - m0 < MR ? mc1 - m0 : MR);
                        const float *xr = x + m0 * ldx + k0;
                        float *yc = y + m0 * ldy + c0;
                        if (nr == NR)
                            kernel_m(mr, kc, xr, ldx, wp, NR, yc, ldy, k0 > 0);
                        else
                            kernel_part(mr, nr, kc, xr, ldx, wp, NR, yc, ldy, k0 > 0);
                    }
                }
            }
        }
    }
    return 1;
#else /* no such kernel in this build: the caller keeps its other path */
    return 0;
#endif
}
