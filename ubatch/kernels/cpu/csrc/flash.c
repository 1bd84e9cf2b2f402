/* Prefill attention over one chunk of KV cells in one call: Q.K^T, the online softmax and P.V
 * for a block of query rows run back to back on one core, so the score rows never leave it.
 * As three separate tile products (score GEMM, softmax, P.V GEMM) each op split the tile its
 * own way between threads and each core read half of the previous op's output from the other
 * core's cache; and a causal prefill's tiles of 128 tokens still computed 25% more scores than
 * the triangle holds, where blocks of RB query rows (12 tokens of Gemma 3) compute about 8% more.
 *
 * The chunk's K and V (f32 rows, as kv_chunk wrote them) are packed once, by all threads, into
 * the tile kernel's panels: K transposed (panel[d][NR] of NR cells), V as NR-column strips. */
#include "tile.h"

void ub_softmax_row(float *x, int64_t cc, const uint16_t *mr, float scale, float softcap, float *mp, float *lp, float *a,
                    int64_t dv);
int64_t ub_mask_span(const uint16_t *mask, int64_t g, int64_t tb, int64_t c, int64_t sg, int64_t st);

enum { RB = 4 * MR }; /* query rows (token x query head) per task */

/* floats of scratch ub_attn_chunk needs: packed K and V of c cells, a score block per thread */
int64_t ub_attn_chunk_scratch(int64_t c, int64_t d, int64_t dv, int nth) {
#if UB_AVX2
    int64_t cp = round_up(c, NR);
    return cp * d + round_up(dv, NR) * cp + (int64_t)nth * RB * cp;
#else
    (void)c, (void)d, (void)dv, (void)nth;
    return 0;
#endif
}

#if UB_AVX2
/* cells [p * NR, p * NR + NR) of k (c rows of d floats) as panel[d][NR]; missing cells are zero */
static void pack_k(const float *k, int64_t c, int64_t d, int64_t p, float *panel) {
    int64_t c0 = p * NR, l = 0;
    if (c0 + NR <= c) /* a full panel: 8 x 8 transposes, then any tail of d */
        for (; l + 8 <= d; l += 8)
            for (int i = 0; i < NR; i += 8) transpose8(k + (c0 + i) * d + l, d, panel + l * NR + i, NR);
    for (; l < d; l++)
        for (int64_t i = 0; i < NR; i++) panel[l * NR + i] = c0 + i < c ? k[(c0 + i) * d + l] : 0.0f;
}

/* columns [q * NR, q * NR + NR) of v (c rows of dv floats) as panel[cp][NR]; the rest zero */
static void pack_v(const float *v, int64_t c, int64_t cp, int64_t dv, int64_t q, float *panel) {
    int64_t o0 = q * NR, nr = dv - o0 < NR ? dv - o0 : NR;
    for (int64_t i = 0; i < cp; i++) {
        if (i < c) memcpy(panel + i * NR, v + i * dv + o0, sizeof(float) * nr);
        memset(panel + i * NR + (i < c ? nr : 0), 0, sizeof(float) * (i < c ? NR - nr : NR));
    }
}
#endif

/* q (b, rows, d) rows d apart (batch stride q_sb); k, v: (b, c, d | dv), batch strides k_sb, v_sb;
 * mask: the chunk's columns of the (g, t, n_kv) f16 mask, row j of batch bi at token j / r of
 * group bi / hkv; m, l (b, rows) running max and sum; acc (b, rows, dv) unnormalised outputs.
 * Returns 0 where this build has no tile kernel (the caller then takes the tile products). */
int ub_attn_chunk(const float *q, int64_t q_sb, int64_t b, int64_t rows, int64_t d, const float *k, int64_t k_sb,
                  const float *v, int64_t v_sb, int64_t c, int64_t dv, const uint16_t *mask, int64_t hkv, int64_t r,
                  int64_t mask_sg, int64_t mask_st, float scale, float softcap, float *m, float *l, int64_t ml_sb,
                  float *acc,
                  int64_t acc_sb, float *scratch, int nth) {
#if UB_AVX2
    int64_t cp = round_up(c, NR), n_kp = cp / NR, n_vp = (dv + NR - 1) / NR, n_tasks = (rows + RB - 1) / RB;
    float *kp = scratch, *vp = kp + cp * d, *sbase = vp + n_vp * NR * cp;
#pragma omp parallel num_threads(nth)
    {
#ifdef _OPENMP
        float *sb = sbase + (int64_t)omp_get_thread_num() * RB * cp;
#else
        float *sb = sbase;
#endif
        for (int64_t bi = 0; bi < b; bi++) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < n_kp + n_vp; p++) {
                if (p < n_kp)
                    pack_k(k + bi * k_sb, c, d, p, kp + p * d * NR);
                else
                    pack_v(v + bi * v_sb, c, cp, dv, p - n_kp, vp + (p - n_kp) * cp * NR);
            }
            const uint16_t *mk = mask + (bi / hkv) * mask_sg;
            /* the last rows see the most cells under a causal mask: hand them out first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t ti = n_tasks - 1; ti >= 0; ti--) {
                int64_t j0 = ti * RB, nrow = rows - j0 < RB ? rows - j0 : RB, t0 = j0 / r, t1 = (j0 + nrow - 1) / r + 1;
                int64_t span = ub_mask_span(mk + t0 * mask_st, 1, t1 - t0, c, 0, mask_st);
                int64_t lo = span & 0xFFFFFFFF, hi = span >> 32;
                if (lo >= hi) continue; /* no row of the block sees a cell of the chunk */
                int64_t cs = lo / NR * NR, cw = round_up(hi, NR) - cs;
                const float *qb = q + bi * q_sb + j0 * d;
                for (int64_t p = cs / NR; p < (cs + cw) / NR; p++)
                    for (int64_t m0 = 0; m0 < nrow; m0 += MR) {
                        int mr = (int)(nrow - m0 < MR ? nrow - m0 : MR);
                        for (int64_t k0 = 0; k0 < d; k0 += KC)
                            kernel_m(mr, d - k0 < KC ? d - k0 : KC, qb + m0 * d + k0, d, kp + p * d * NR + k0 * NR,
                                     NR, sb + m0 * cw + (p * NR - cs), cw, k0 > 0);
                    }
                for (int64_t i = 0; i < nrow; i++) {
                    int64_t j = j0 + i;
                    float *x = sb + i * cw;
                    ub_softmax_row(x, hi - cs, mk + (j / r) * mask_st + cs, scale, softcap, m + bi * ml_sb + j,
                                   l + bi * ml_sb + j, acc + bi * acc_sb + j * dv, dv);
                    memset(x + (hi - cs), 0, sizeof(float) * (cw - (hi - cs))); /* cells no row sees */
                }
                for (int64_t o = 0; o < n_vp; o++) {
                    int64_t nr = dv - o * NR < NR ? dv - o * NR : NR;
                    for (int64_t m0 = 0; m0 < nrow; m0 += MR) {
                        int mr = (int)(nrow - m0 < MR ? nrow - m0 : MR);
                        float *yc = acc + bi * acc_sb + (j0 + m0) * dv + o * NR;
                        for (int64_t k0 = 0; k0 < cw; k0 += KC) {
                            const float *wp = vp + o * cp * NR + (cs + k0) * NR, *xs = sb + m0 * cw + k0;
                            int64_t kc = cw - k0 < KC ? cw - k0 : KC;
                            if (nr == NR)
                                kernel_m(mr, kc, xs, cw, wp, NR, yc, dv, 1);
                            else
                                kernel_part(mr, nr, kc, xs, cw, wp, NR, yc, dv, 1);
                        }
                    }
                }
            }
        }
    }
    return 1;
#else
    (void)q, (void)q_sb, (void)b, (void)rows, (void)d, (void)k, (void)k_sb, (void)v, (void)v_sb, (void)c, (void)dv;
    (void)mask, (void)hkv, (void)r, (void)mask_sg, (void)mask_st, (void)scale, (void)softcap, (void)m, (void)l, (void)ml_sb;
    (void)acc, (void)acc_sb, (void)scratch, (void)nth;
    return 0;
#endif
}
