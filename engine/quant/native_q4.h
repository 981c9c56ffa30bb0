/* What native_q4.c shares with native_step.c: the Q8_0 activation rows, the group matmul and the gated
   activation of the FFNs (the same functions the matmul and MoE entry points run). */
#ifndef SWASERVE_NATIVE_Q4_H
#define SWASERVE_NATIVE_Q4_H
#include <stdint.h>

#define QK 32          /* values per Q4_0 / Q8_0 block */
#define ROWS 8         /* weight rows per interleaved group */
#define GROUP_CHUNK 4  /* groups per work item: 32 weight rows stay in L1/L2 while M rows pass over them */

/* Activation rows by pointer (MoE groups rows without copying): codes, scales, 8 x code sums, output. */
typedef struct {
    const int8_t* const* xq;
    const float* const* xd;
    const int32_t* const* xs;
    float* const* y;
} Rows;

/* one row of K floats -> Q8_0 codes, scales and 8 x the block code sums (s may be NULL) */
void swa_i_quant_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s);
/* outputs of the interleaved weight W's groups [g0, g1) for M activation rows (nb = K / QK blocks) */
void swa_i_gemm_groups(const uint8_t* W, int64_t nb, int64_t N, int64_t g0, int64_t g1, int64_t M,
                       const Rows* rows);
/* out[i] = gelu_tanh(g[i]) * u[i], i < I (I a multiple of 8; out may be g) */
void swa_i_gelu_mul(const float* g, const float* u, float* out, int64_t I);
#endif
