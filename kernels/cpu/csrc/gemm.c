/* Prefill's matrix product straight from the blocks: y = x . W^T for more rows than the GEMV
 * takes. MKL's f32 GEMM reaches about half of this CPU's FMA peak on prefill's shapes (measured
 * 98-131 of 218 GFLOP/s on 2 Zen 3 cores); a register-blocked kernel that dequantises each weight
 * panel straight into the layout it consumes does better and needs no dequantised tile of rows.
 *
 * Blocking: each thread takes blocks of NC weight rows; per KC-long slice of k it dequantises the
 * block into panels of NR rows stored k-major (panel[k][NR], L2-resident), then for every MR rows
 * of x runs the MR x NR kernel (12 accumulators in registers, x broadcast from L1) over the
 * panels. Each output accumulates in one FMA chain over k. */
#include "tile.h"

void ub_dequant_span(int type, const uint8_t *row, int64_t k0, int64_t n, int64_t k, float *out);

/* floats of scratch ub_gemm needs for nth threads */
int64_t ub_gemm_scratch(int nth) { return (int64_t)nth * (NC * KC + NR * KC); }

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
