/* The non-linear and grid block types (MXFP4, IQ4_NL/XS, IQ3/IQ2/IQ1, TQ1_0/TQ2_0): their
 * type ids and the entry points dequant.c and matmul.c hand them to (quant_iq.c). */
#ifndef UB_QUANT_IQ_H
#define UB_QUANT_IQ_H
#include "common.h"

enum { T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22,
       T_IQ4_XS = 23, T_IQ1_M = 29, T_TQ1_0 = 34, T_TQ2_0 = 35, T_MXFP4 = 39 };

static inline int iq_type(int type) {
    return (type >= T_IQ2_XXS && type <= T_IQ4_XS) || type == T_IQ1_M || type == T_TQ1_0 || type == T_TQ2_0 ||
           type == T_MXFP4;
}

/* values [k0, k0 + n) of a row (k0 and n multiples of 32), bit-exact to ggml's dequantize_row_* */
void iq_span(int type, const uint8_t *row, int64_t k0, int64_t n, float *out);
/* ub_gemv for these types: y[r, n] = x[r, :] . W[n, :], weights decoded a chunk at a time;
 * scratch: iq_gemv_scratch(type, m, k) floats (NULL: allocated here) */
int64_t iq_gemv_scratch(int type, int64_t m, int64_t k);
void iq_gemv(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x, int64_t m,
             int64_t ldx, float *y, int64_t ldy, float *scratch, int nth);
#endif
