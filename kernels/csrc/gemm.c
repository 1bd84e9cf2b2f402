/* Prefill's matrix product straight from the blocks: y = x . W^T for more rows than the GEMV
 * takes. MKL's f32 GEMM reaches about half of this CPU's FMA peak on prefill's shapes (measured
 * 98-131 of 218 GFLOP/s on 2 Zen 3 cores); a register-blocked kernel that dequantises each weight
 * panel straight into the layout it consumes does better and needs no dequantised tile of rows.
 *
 * Blocking: each thread takes blocks of NC weight rows; per KC-long slice of k it dequantises the
 * block into panels of NR rows stored k-major (panel[k][NR], L2-resident), then for every MR rows
 * of x runs the MR x NR kernel (12 accumulators in registers, x broadcast from L1) over the
 * panels. Each output accumulates in one FMA chain over k. */
#include "common.h"

void ub_dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, int64_t k, float *out);

#if UB_AVX512
/* 512-bit: panels of 32 rows (two zmm), 12 x rows a strip: 24 accumulators of the 32 registers */
enum { NR = 32, MR = 12, KC = 256, NC = 64, MC = 96 };
#else
enum { NR = 16, MR = 6, KC = 256, NC = 64, MC = 96 };
#endif

/* floats of scratch ub_gemm needs for nth threads */
int64_t ub_gemm_scratch(int nth) { return (int64_t)nth * (NC * KC + NR * KC); }

#if UB_AVX2
#if UB_AVX512
typedef __m512 vec_t;
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_ZERO _mm512_setzero_ps
#define V_FMA _mm512_fmadd_ps
#define V_SET1 _mm512_set1_ps
#else
typedef __m256 vec_t;
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_ZERO _mm256_setzero_ps
#define V_FMA _mm256_fmadd_ps
#define V_SET1 _mm256_set1_ps
#endif
enum { VW = NR / 2 }; /* floats per vector: a panel row is two vectors */

/* c[M][NR] (+)= x[M][kc] . wp[kc][NR] (panel rows ldw floats apart) */
static inline __attribute__((always_inline)) void kernel(const int M, int64_t kc, const float *x, int64_t ldx,
                                                         const float *wp, int64_t ldw, float *c, int64_t ldc,
                                                         int acc) {
    vec_t a0[MR], a1[MR];
    for (int r = 0; r < M; r++) {
        a0[r] = acc ? V_LOAD(c + r * ldc) : V_ZERO();
        a1[r] = acc ? V_LOAD(c + r * ldc + VW) : V_ZERO();
    }
    for (int64_t k = 0; k < kc; k++) {
        vec_t w0 = V_LOAD(wp + ldw * k), w1 = V_LOAD(wp + ldw * k + VW);
        for (int r = 0; r < M; r++) {
            vec_t b = V_SET1(x[r * ldx + k]); /* a broadcast load */
            a0[r] = V_FMA(w0, b, a0[r]);
            a1[r] = V_FMA(w1, b, a1[r]);
        }
    }
    for (int r = 0; r < M; r++) {
        V_STORE(c + r * ldc, a0[r]);
        V_STORE(c + r * ldc + VW, a1[r]);
    }
}

#define K_CASE(n) case n: kernel(n, kc, x, ldx, wp, ldw, c, ldc, acc); break;
static void kernel_m(int m, int64_t kc, const float *x, int64_t ldx, const float *wp, int64_t ldw, float *c,
                     int64_t ldc, int acc) {
    switch (m) {
    K_CASE(1) K_CASE(2) K_CASE(3) K_CASE(4) K_CASE(5)
#if UB_AVX512
    K_CASE(6) K_CASE(7) K_CASE(8) K_CASE(9) K_CASE(10) K_CASE(11)
#endif
    default: kernel(MR, kc, x, ldx, wp, ldw, c, ldc, acc); break;
    }
}
#undef K_CASE

/* 8 x 8 floats: rows of src (stride ls) become columns of dst (stride ld) */
static inline void transpose8(const float *src, int64_t ls, float *dst, int64_t ld) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ls);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

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

/* y[r, n] = sum_k x[r, k] W[n, k]; scratch holds ub_gemm_scratch(nth) floats.
 * Returns 0 where this build has no such kernel (the caller then takes the BLAS path). */
int ub_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
            int64_t ldx, float *y, int64_t ldy, float *scratch, int nth) {
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
                        if (nr == NR) {
                            kernel_m(mr, kc, xr, ldx, wp, NR, yc, ldy, k0 > 0);
                            continue;
                        }
                        float tile[MR * NR] = {0}; /* a partial panel: through a full-width tile */
                        for (int r = 0; r < mr && k0 > 0; r++) memcpy(tile + r * NR, yc + r * ldy, sizeof(float) * nr);
                        kernel_m(mr, kc, xr, ldx, wp, NR, tile, NR, k0 > 0);
                        for (int r = 0; r < mr; r++) memcpy(yc + r * ldy, tile + r * NR, sizeof(float) * nr);
                    }
                }
            }
        }
    }
    return 1;
#else
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)m, (void)ldx, (void)y, (void)ldy;
    (void)scratch, (void)nth;
    return 0;
#endif
}

/* y[m][n] (+)= x[m][k] . b[k][n] for f32 b stored k-major (row l of b at b + l * ldb): prefill
 * attention's P . V, where V's rows already are the kernel's panels, so nothing is packed; a
 * partial last panel goes through a zero-padded copy. Returns 0 where this build has no kernel. */
int ub_gemm_kn(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const float *b, int64_t ldb,
               float *y, int64_t ldy, int accumulate, int nth) {
#if UB_AVX2
    int64_t n_panels = (n + NR - 1) / NR, n_strips = (m + MR - 1) / MR;
#pragma omp parallel for num_threads(nth) schedule(static) collapse(2)
    for (int64_t p = 0; p < n_panels; p++) {
        for (int64_t s = 0; s < n_strips; s++) {
            int64_t c0 = p * NR, nr = n - c0 < NR ? n - c0 : NR, m0 = s * MR;
            int mr = (int)(m - m0 < MR ? m - m0 : MR);
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t kc = k - k0 < KC ? k - k0 : KC;
                int acc = accumulate || k0 > 0;
                const float *xr = x + m0 * ldx + k0;
                float *yc = y + m0 * ldy + c0;
                if (nr == NR) {
                    kernel_m(mr, kc, xr, ldx, b + k0 * ldb + c0, ldb, yc, ldy, acc);
                    continue;
                }
                float panel[KC * NR], tile[MR * NR] = {0};
                for (int64_t l = 0; l < kc; l++) {
                    memcpy(panel + l * NR, b + (k0 + l) * ldb + c0, sizeof(float) * nr);
                    memset(panel + l * NR + nr, 0, sizeof(float) * (NR - nr));
                }
                for (int r = 0; r < mr && acc; r++) memcpy(tile + r * NR, yc + r * ldy, sizeof(float) * nr);
                kernel_m(mr, kc, xr, ldx, panel, NR, tile, NR, acc);
                for (int r = 0; r < mr; r++) memcpy(yc + r * ldy, tile + r * NR, sizeof(float) * nr);
            }
        }
    }
    return 1;
#else
    (void)m, (void)n, (void)k, (void)x, (void)ldx, (void)b, (void)ldb, (void)y, (void)ldy, (void)accumulate;
    (void)nth;
    return 0;
#endif
}
