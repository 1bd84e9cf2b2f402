/* A run of bound kernel calls as one call: a decode step is a few hundred small kernels, and one
 * ctypes call each costs more than many of them take. The program is a flat int64 array: per node
 * its op code, then its arguments in the kernel's order (pointers and sizes as integers; a float
 * argument as its IEEE bits in the low 32 bits). The codes and arities are kernels/cpu_program.py's
 * table; ub_program_arity lets it check them against this file. */
#include "common.h"

void ub_gemv(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t, float *, int);
void ub_get_rows(int, const uint8_t *, int64_t, const int64_t *, int64_t, int64_t, float *, int);
void ub_rms_norm(const float *, int64_t, const float *, int64_t, int64_t, float, float *, int64_t, int);
void ub_rope(const float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, int, float *, int);
void ub_glu(const float *, const float *, int64_t, int, float *, int);
void ub_add(const float *, const float *, int64_t, float *, int);
void ub_scale(const float *, float, int64_t, float *, int);
void ub_rows(const float *, const int64_t *, int64_t, int64_t, float *);
void ub_kv_store(const float *, int64_t, int64_t, const int64_t *, int, void *);
void ub_attn(const float *, int64_t, int64_t, int64_t, int64_t, const void *, int, const void *, int, int64_t,
             int64_t, const int64_t *, int64_t, const uint16_t *, float, float, float *, int);
void ub_add_bias(const float *, const float *, int64_t, int64_t, float *, int);
void ub_softcap(const float *, float, int64_t, int64_t, float *, int);
int ub_gemm(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t,
            float *, int);
int ub_gemm_amx(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                float *, int);
void ub_mul_mat_id(int, const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *, int64_t, int64_t,
                   const int32_t *, int64_t, int64_t, int64_t, const float *, float *, int64_t, float *, int);
void ub_moe_topk(const float *, int64_t, int64_t, int64_t, int, const float *, int64_t, int64_t, int32_t *);
void ub_moe_weights(const float *, const int32_t *, int64_t, int64_t, int64_t, int, int, float, float *);
void ub_moe_sum(const float *, const float *, int64_t, int64_t, int64_t, float *, int);
void ub_lora(const float *, const float *, int64_t, int64_t, int64_t, int, const void *, const void *, int64_t,
             const int32_t *, const float *, const int32_t *, const float *, int64_t, const int64_t *, float *, int);

enum { P_GEMV, P_GET_ROWS, P_RMS_NORM, P_ROPE, P_GLU, P_ADD, P_SCALE, P_ROWS, P_KV_STORE, P_ATTN, P_GEMM, P_GEMM_AMX,
       P_ADD_BIAS, P_SOFTCAP, P_MUL_MAT_ID, P_MOE_TOPK, P_MOE_WEIGHTS, P_MOE_SUM, P_LORA, P_N };
static const int ARITY[P_N] = {12, 8, 9, 10, 6, 5, 5, 5, 6, 18, 12, 12, 6, 6, 18, 9, 9, 7, 17};

int ub_program_arity(int op) { return op >= 0 && op < P_N ? ARITY[op] : -1; }

static inline float fbits(int64_t v) {
    uint32_t u = (uint32_t)v;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define PTR(i) ((void *)(intptr_t)a[i])
#define FPTR(i) ((float *)(intptr_t)a[i])
#define I64P(i) ((const int64_t *)(intptr_t)a[i])

/* runs n nodes of prog in order; returns the number run (n, or the index of a bad op code) */
int64_t ub_run(const int64_t *prog, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int op = (int)prog[0];
        const int64_t *a = prog + 1;
        switch (op) {
        case P_GEMV:
            ub_gemv((int)a[0], PTR(1), a[2], a[3], a[4], FPTR(5), a[6], a[7], FPTR(8), a[9], FPTR(10), (int)a[11]);
            break;
        case P_GET_ROWS: ub_get_rows((int)a[0], PTR(1), a[2], I64P(3), a[4], a[5], FPTR(6), (int)a[7]); break;
        case P_RMS_NORM:
            ub_rms_norm(FPTR(0), a[1], FPTR(2), a[3], a[4], fbits(a[5]), FPTR(6), a[7], (int)a[8]);
            break;
        case P_ROPE:
            ub_rope(FPTR(0), FPTR(1), FPTR(2), a[3], a[4], a[5], a[6], (int)a[7], FPTR(8), (int)a[9]);
            break;
        case P_GLU: ub_glu(FPTR(0), FPTR(1), a[2], (int)a[3], FPTR(4), (int)a[5]); break;
        case P_ADD: ub_add(FPTR(0), FPTR(1), a[2], FPTR(3), (int)a[4]); break;
        case P_SCALE: ub_scale(FPTR(0), fbits(a[1]), a[2], FPTR(3), (int)a[4]); break;
        case P_ROWS: ub_rows(FPTR(0), I64P(1), a[2], a[3], FPTR(4)); break;
        case P_KV_STORE: ub_kv_store(FPTR(0), a[1], a[2], I64P(3), (int)a[4], PTR(5)); break;
        case P_ATTN:
            ub_attn(FPTR(0), a[1], a[2], a[3], a[4], PTR(5), (int)a[6], PTR(7), (int)a[8], a[9], a[10], I64P(11),
                    a[12], (const uint16_t *)PTR(13), fbits(a[14]), fbits(a[15]), FPTR(16), (int)a[17]);
            break;
        case P_ADD_BIAS: ub_add_bias(FPTR(0), FPTR(1), a[2], a[3], FPTR(4), (int)a[5]); break;
        case P_SOFTCAP: ub_softcap(FPTR(0), fbits(a[1]), a[2], a[3], FPTR(4), (int)a[5]); break;
        case P_GEMM:
            if (!ub_gemm((int)a[0], PTR(1), a[2], a[3], a[4], FPTR(5), a[6], a[7], FPTR(8), a[9], FPTR(10), (int)a[11]))
                return i;
            break;
        case P_GEMM_AMX:
            if (!ub_gemm_amx((int)a[0], PTR(1), a[2], a[3], a[4], FPTR(5), a[6], a[7], FPTR(8), a[9], FPTR(10),
                             (int)a[11]))
                return i;
            break;
        case P_MUL_MAT_ID:
            ub_mul_mat_id((int)a[0], PTR(1), a[2], a[3], a[4], a[5], FPTR(6), a[7], a[8], (const int32_t *)PTR(9), a[10],
                          a[11], a[12], FPTR(13), FPTR(14), a[15], FPTR(16), (int)a[17]);
            break;
        case P_MOE_TOPK:
            ub_moe_topk(FPTR(0), a[1], a[2], a[3], (int)a[4], FPTR(5), a[6], a[7], (int32_t *)PTR(8));
            break;
        case P_MOE_WEIGHTS:
            ub_moe_weights(FPTR(0), (const int32_t *)PTR(1), a[2], a[3], a[4], (int)a[5], (int)a[6], fbits(a[7]), FPTR(8));
            break;
        case P_MOE_SUM: ub_moe_sum(FPTR(0), FPTR(1), a[2], a[3], a[4], FPTR(5), (int)a[6]); break;
        case P_LORA:
            ub_lora(FPTR(0), FPTR(1), a[2], a[3], a[4], (int)a[5], PTR(6), PTR(7), a[8], (const int32_t *)PTR(9), FPTR(10),
                    (const int32_t *)PTR(11), FPTR(12), a[13], I64P(14), FPTR(15), (int)a[16]);
            break;
        default: return i;
        }
        prog += 1 + ARITY[op];
    }
    return n;
}
