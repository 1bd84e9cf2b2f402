/* Mixtures of experts: the router's choice and weights, and llama.cpp's mul_mat_id.
 *
 * mul_mat_id groups a ubatch's (token, chosen expert) rows by expert and multiplies each group
 * with its expert's matrix as one product: the GEMV for up to MMID_GEMV_ROWS rows, the GEMM past
 * that, both reading the expert's 2-D slice of the 3-D tensor as stored (a slice is itself a
 * valid quantised matrix). An expert no row chose is never read. */
#include "common.h"

void ub_gemv(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t, float *, int);
int64_t ub_gemv_scratch(int, int64_t, int64_t);
int ub_gemm(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t, float *, int);
int64_t ub_gemm_scratch(int, int64_t, int64_t, int);
int ub_gemv_takes_vnni(int, int64_t);
int64_t ub_vnni_scratch(int, int64_t, int64_t);
void ub_vnni_round(int64_t, int64_t, const float *, int64_t, float *);
void ub_vnni_rows(int, const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, int64_t,
                  float *, int64_t);

enum { MMID_GEMV_ROWS = 16 }; /* as kernels/cpu/bind.py GEMV_MAX_ROWS */
enum { G_SOFTMAX = 0, G_SIGMOID = 1, G_SOFTMAX_WEIGHT = 2 };

static inline int use_gemm(int type, int64_t m) { return m > MMID_GEMV_ROWS && type != T_F32 && UB_AVX2; }

enum { MMID_RB = 64 }; /* weight rows a work item of the one-region path takes */

static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

/* rows of gathered x (and of products) the scratch holds: a group of up to m_max rows, or every
 * (token, expert) row of a decode-sized ubatch (<= MMID_GEMV_ROWS tokens) */
static inline int64_t gathered_rows(int64_t m_max, int64_t K) {
    return imax(m_max, (m_max < MMID_GEMV_ROWS ? m_max : MMID_GEMV_ROWS) * K);
}

/* floats of scratch for n_tok tokens choosing K experts each: their x rows gathered, their
 * products, and the GEMV's (per thread) or the GEMM's own */
int64_t ub_mul_mat_id_scratch(int type, int64_t n_rows, int64_t k, int64_t n_tok, int64_t K, int nth) {
    int64_t rows = gathered_rows(n_tok, K);
    int64_t gv = ub_gemv_scratch(type, n_tok < MMID_GEMV_ROWS ? n_tok : MMID_GEMV_ROWS, k) * nth;
    int64_t gm = use_gemm(type, n_tok) ? ub_gemm_scratch(type, n_tok, k, nth) : 0;
    if (n_tok > MMID_GEMV_ROWS && !use_gemm(type, n_tok)) gv = imax(gv, ub_gemv_scratch(type, n_tok, k));
    if (n_tok <= MMID_GEMV_ROWS && ub_gemv_takes_vnni(type, k)) gv = imax(gv, ub_vnni_scratch(type, rows, k));
    return rows * k + rows * n_rows + imax(gv, gm) + 16;
}

static inline const float *x_row(const float *x, int64_t r, int64_t K, int64_t x_per, int64_t ldx) {
    int64_t t = r / K, j = r % K;
    return x + (t * x_per + (x_per > 1 ? j : 0)) * ldx;
}

/* y[t·K + j] = W[ids[t·K + j]] · x[t·x_per + (x_per > 1 ? j : 0)] (+ bias[ids[t·K + j]]).
 * W: n_expert matrices of n_rows rows (row_bytes each), expert_bytes apart; y rows ldy apart.
 * A decode-sized ubatch (<= MMID_GEMV_ROWS tokens) is one parallel region over (expert, row
 * block) items, each a one-thread GEMV: on a busy machine every region's wake-up costs a
 * scheduler slice, and eight experts a layer would be eight. Larger ones: per expert, the GEMV
 * or the GEMM, each threaded. */
void ub_mul_mat_id(int type, const uint8_t *w, int64_t expert_bytes, int64_t row_bytes, int64_t n_rows, int64_t k,
                   const float *x, int64_t x_per, int64_t ldx, const int32_t *ids, int64_t n_tok, int64_t K,
                   int64_t n_expert, const float *bias, float *y, int64_t ldy, float *scratch, int nth) {
    int64_t n = n_tok * K;
    int64_t *count = calloc((size_t)n_expert + 1, sizeof(int64_t)), *order = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    int64_t *at = malloc((size_t)(n_expert ? n_expert : 1) * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) count[ids[i] + 1]++;
    for (int64_t e = 0; e < n_expert; e++) count[e + 1] += count[e]; /* count[e]: where expert e's rows start */
    memcpy(at, count, (size_t)n_expert * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) order[at[ids[i]]++] = i;
    int64_t rows_cap = gathered_rows(n_tok, K);
    float *xs = scratch, *ys = xs + rows_cap * k, *ks = ys + rows_cap * n_rows;
    if (n_tok <= MMID_GEMV_ROWS) {
        int64_t n_used = 0, *used = at; /* the chosen experts, in order */
        for (int64_t e = 0; e < n_expert; e++)
            if (count[e + 1] > count[e]) used[n_used++] = e;
        for (int64_t i = 0; i < n; i++) memcpy(xs + i * k, x_row(x, order[i], K, x_per, ldx), (size_t)k * sizeof(float));
        int64_t rbs = (n_rows + MMID_RB - 1) / MMID_RB, items = n_used * rbs;
        if (ub_gemv_takes_vnni(type, k)) {
            /* the integer path: every gathered row rounded once here, not once per work item
             * (a 768-row expert is 12 items), and the items call its row spans directly */
            ub_vnni_round(n, k, xs, k, ks);
#pragma omp parallel for num_threads(nth) schedule(static)
            for (int64_t it = 0; it < items; it++) {
                int64_t e = used[it / rbs], r0 = it % rbs * MMID_RB, nr = n_rows - r0 < MMID_RB ? n_rows - r0 : MMID_RB;
                int64_t g0 = count[e], m = count[e + 1] - g0;
                ub_vnni_rows(type, w + e * expert_bytes, row_bytes, r0, r0 + nr, k, ks, n, g0, m, ys + g0 * n_rows, n_rows);
            }
        } else {
            int64_t gv = ub_gemv_scratch(type, n_tok < MMID_GEMV_ROWS ? n_tok : MMID_GEMV_ROWS, k);
#pragma omp parallel for num_threads(nth) schedule(static)
            for (int64_t it = 0; it < items; it++) {
#ifdef _OPENMP
                int tid = omp_get_thread_num();
#else
                int tid = 0;
#endif
                int64_t e = used[it / rbs], r0 = it % rbs * MMID_RB, nr = n_rows - r0 < MMID_RB ? n_rows - r0 : MMID_RB;
                int64_t g0 = count[e], m = count[e + 1] - g0;
                ub_gemv(type, w + e * expert_bytes + r0 * row_bytes, row_bytes, nr, k, xs + g0 * k, m, k,
                        ys + g0 * n_rows + r0, n_rows, gv ? ks + tid * gv : 0, 1);
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const float *be = bias ? bias + (int64_t)ids[order[i]] * n_rows : 0;
            float *yr = y + order[i] * ldy;
            const float *src = ys + i * n_rows;
            if (be)
                for (int64_t c = 0; c < n_rows; c++) yr[c] = src[c] + be[c];
            else
                memcpy(yr, src, (size_t)n_rows * sizeof(float));
        }
    } else {
        for (int64_t e = 0; e < n_expert; e++) {
            int64_t m = count[e + 1] - count[e];
            if (!m) continue;
            const int64_t *rows = order + count[e];
            const uint8_t *we = w + e * expert_bytes;
            const float *be = bias ? bias + e * n_rows : 0;
            for (int64_t i = 0; i < m; i++) memcpy(xs + i * k, x_row(x, rows[i], K, x_per, ldx), (size_t)k * sizeof(float));
            if (!(use_gemm(type, m) && ub_gemm(type, we, row_bytes, n_rows, k, xs, m, k, ys, n_rows, ks, nth)))
                ub_gemv(type, we, row_bytes, n_rows, k, xs, m, k, ys, n_rows, ks, nth);
            for (int64_t i = 0; i < m; i++) {
                float *yr = y + rows[i] * ldy;
                const float *src = ys + i * n_rows;
                if (be)
                    for (int64_t c = 0; c < n_rows; c++) yr[c] = src[c] + be[c];
                else
                    memcpy(yr, src, (size_t)n_rows * sizeof(float));
            }
        }
    }
    free(at);
    free(order);
    free(count);
}

/* the router's probabilities of one row (softmax_weight: the raw logits) */
static void gating_row(const float *l, int64_t n_expert, int gating, float *p) {
    if (gating == G_SOFTMAX) {
        float mx = l[0], s = 0;
        for (int64_t e = 1; e < n_expert; e++) mx = l[e] > mx ? l[e] : mx;
        for (int64_t e = 0; e < n_expert; e++) s += p[e] = expf(l[e] - mx);
        for (int64_t e = 0; e < n_expert; e++) p[e] /= s;
    } else if (gating == G_SIGMOID) {
        for (int64_t e = 0; e < n_expert; e++) p[e] = 1.0f / (1.0f + expf(-l[e]));
    } else {
        memcpy(p, l, (size_t)n_expert * sizeof(float));
    }
}

/* the index of the largest of p[0..n) (NaN never wins; -1 if every value is NaN) */
static int64_t argmax_of(const float *p, int64_t n) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; e++)
        if (p[e] == p[e] && (best < 0 || p[e] > p[best])) best = e;
    return best;
}

/* group-limited choice (DeepSeek-V3, llama.cpp's build_moe_ffn): each of n_group runs of experts
 * scored by the sum of its two largest values, every expert outside the n_used best groups set to
 * -inf; gs holds n_group scores */
static void keep_best_groups(float *p, int64_t n_expert, int64_t n_group, int64_t n_used, float *gs) {
    int64_t per = n_expert / n_group;
    for (int64_t g = 0; g < n_group; g++) {
        const float *q = p + g * per;
        int64_t a = argmax_of(q, per), b = -1;
        for (int64_t e = 0; e < per; e++)
            if (e != a && q[e] == q[e] && (b < 0 || q[e] > q[b])) b = e;
        gs[g] = (a < 0 ? -INFINITY : q[a]) + (b < 0 ? -INFINITY : q[b]);
    }
    for (int64_t j = 0; j < n_used; j++) { /* mark the kept groups NaN in gs: taken */
        int64_t g = argmax_of(gs, n_group);
        if (g < 0) break;
        gs[g] = NAN;
    }
    for (int64_t g = 0; g < n_group; g++)
        if (gs[g] == gs[g]) /* not taken */
            for (int64_t e = 0; e < per; e++) p[g * per + e] = -INFINITY;
}

/* ids[t, 0..K): the K largest probabilities (plus the selection bias) of row t, largest first,
 * within the n_group_used best groups where n_group > 1 */
void ub_moe_topk(const float *logits, int64_t n, int64_t n_expert, int64_t K, int gating, const float *bias,
                 int64_t n_group, int64_t n_group_used, int32_t *ids) {
    float *p = malloc((size_t)(n_expert + n_group) * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        gating_row(logits + t * n_expert, n_expert, gating, p);
        if (bias)
            for (int64_t e = 0; e < n_expert; e++) p[e] += bias[e];
        if (n_group > 1) keep_best_groups(p, n_expert, n_group, n_group_used, p + n_expert);
        int32_t *o = ids + t * K;
        for (int64_t j = 0; j < K; j++) { /* K is small (<= 8 of 128 typically): selection, not a sort */
            int64_t best = argmax_of(p, n_expert);
            if (best < 0) best = 0;
            o[j] = (int32_t)best;
            p[best] = -INFINITY; /* taken */
        }
    }
    free(p);
}

/* w[t, j]: the chosen experts' probabilities (softmax_weight: a softmax over the chosen logits),
 * divided by their sum where norm (clamped at f16's smallest normal, as llama.cpp), times scale */
void ub_moe_weights(const float *logits, const int32_t *ids, int64_t n, int64_t n_expert, int64_t K, int gating,
                    int norm, float scale, float *w) {
    float *p = malloc((size_t)n_expert * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        gating_row(logits + t * n_expert, n_expert, gating, p);
        float *o = w + t * K;
        for (int64_t j = 0; j < K; j++) o[j] = p[ids[t * K + j]];
        if (gating == G_SOFTMAX_WEIGHT) {
            float mx = o[0], s = 0;
            for (int64_t j = 1; j < K; j++) mx = o[j] > mx ? o[j] : mx;
            for (int64_t j = 0; j < K; j++) s += o[j] = expf(o[j] - mx);
            for (int64_t j = 0; j < K; j++) o[j] /= s;
        }
        if (norm) {
            float s = 0;
            for (int64_t j = 0; j < K; j++) s += o[j];
            s = s < 6.103515625e-5f ? 6.103515625e-5f : s;
            for (int64_t j = 0; j < K; j++) o[j] /= s;
        }
        for (int64_t j = 0; j < K; j++) o[j] *= scale;
    }
    free(p);
}

/* out[t] = sum_j w[t, j] · x[t, j] over d values */
void ub_moe_sum(const float *x, const float *w, int64_t n, int64_t K, int64_t d, float *out, int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (n * K * d > 65536)
    for (int64_t t = 0; t < n; t++) {
        float *o = out + t * d;
        const float *xt = x + t * K * d;
        for (int64_t c = 0; c < d; c++) o[c] = w[t * K] * xt[c];
        for (int64_t j = 1; j < K; j++) {
            float wj = w[t * K + j];
            const float *xj = xt + j * d;
            for (int64_t c = 0; c < d; c++) o[c] += wj * xj[c];
        }
    }
}
