/* The routed experts of a layer in one call (swa_q4_moe) and the FFNs' gated activation, on native_q4.c's
Q4_0 x Q8_0 group matmul (engine/quant/native.py, engine/moe/cpu_backend.py). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_avx.h"
#include "native_moe.h"
#include "native_q4.h"

int64_t swa_q4_packed_bytes(int64_t N, int64_t K);

static inline int64_t groups_of_(int64_t n) { return (n + ROWS - 1) / ROWS; }

/* out[i] = gelu_tanh(g[i]) * u[i], i < I (I a multiple of 8; out may be g); gelu_tanh(g) = 0.5 g (1 +
   tanh(v)) = g / (1 + exp(-2v)), v = sqrt(2 / pi) (g + 0.044715 g^3). The routed experts', the dense MLP's
   on the native path (swa_gelu_mul) and native_step.c's: the same bits everywhere. */
void swa_i_gelu_mul(const float* g, const float* u, float* out, int64_t I) {
    const __m256 c1 = _mm256_set1_ps(-2.f * 0.7978845608028654f), c3 = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t i = 0; i < I; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 v = _mm256_mul_ps(c1, _mm256_fmadd_ps(_mm256_mul_ps(c3, x), _mm256_mul_ps(x, x), x));
        __m256 gelu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(v)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
    }
}

/* out [T, I] = gelu_tanh(g) * u for g, u [T, I] (the dense MLP's activation on the native path) */
void swa_gelu_mul(const float* g, const float* u, float* out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; ++t) swa_i_gelu_mul(g + t * I, u + t * I, out + t * I, I);
}

/* Routed-MoE layer, all tokens grouped by expert in one call:
   out [T, H] = sum_j w[t, j] * down_e(gelu_tanh(gate_e x_t) * up_e x_t), e = ids[t, j] (I a multiple of 32).
   gate_up: E interleaved [2I, H] weights back to back (gate rows [0, I), up rows [I, 2I));
   down: E interleaved [H, I] weights. Work items (expert, group chunk) share one OpenMP region. */
void swa_q4_moe(const float* x, int64_t T, int64_t H, const uint8_t* gate_up, const uint8_t* down,
                int64_t E, int64_t I, const int64_t* ids, const float* weights, int64_t k, float* out,
                int nthreads) {
    const int64_t A = T * k, I2 = 2 * I, nbH = H / QK, nbI = I / QK;
    const size_t gu_stride = (size_t)swa_q4_packed_bytes(I2, H), dn_stride = (size_t)swa_q4_packed_bytes(H, I);
    ExpertSort es = expert_sort(ids, A, E);  /* sorted slot s holds assignment es.order[s] */
    const int64_t *start = es.start, *order = es.order, *active = es.active, nact = es.nact;
    int8_t* xq = (int8_t*)malloc((size_t)T * H);
    float* xd = (float*)malloc((size_t)T * nbH * sizeof(float));
    int32_t* xs = (int32_t*)malloc((size_t)T * nbH * sizeof(int32_t));
    float* hbuf = (float*)malloc((size_t)A * I2 * sizeof(float));  /* gate_up outputs, sorted slots */
    int8_t* hq = (int8_t*)malloc((size_t)A * I);
    float* hd = (float*)malloc((size_t)A * nbI * sizeof(float));
    int32_t* hs = (int32_t*)malloc((size_t)A * nbI * sizeof(int32_t));
    float* ybuf = (float*)malloc((size_t)A * H * sizeof(float));   /* down outputs, sorted slots */
    const int8_t** xqs = (const int8_t**)malloc(A * sizeof(void*));
    const float** xds = (const float**)malloc(A * sizeof(void*));
    const int32_t** xss = (const int32_t**)malloc(A * sizeof(void*));
    const int8_t** hqs = (const int8_t**)malloc(A * sizeof(void*));
    const float** hds = (const float**)malloc(A * sizeof(void*));
    const int32_t** hss = (const int32_t**)malloc(A * sizeof(void*));
    float** hps = (float**)malloc(A * sizeof(void*));
    float** yps = (float**)malloc(A * sizeof(void*));
    for (int64_t s = 0; s < A; ++s) {
        int64_t t = order[s] / k;
        xqs[s] = xq + t * H; xds[s] = xd + t * nbH; xss[s] = xs + t * nbH;
        hps[s] = hbuf + s * I2; yps[s] = ybuf + s * H;
        hqs[s] = hq + s * I; hds[s] = hd + s * nbI; hss[s] = hs + s * nbI;
    }
    const int64_t G1 = groups_of_(I2), G2 = groups_of_(H);
    const int64_t c1 = GROUP_CHUNK, c2 = GROUP_CHUNK;
    const int64_t n1 = (G1 + c1 - 1) / c1, n2 = (G2 + c2 - 1) / c2;
    /* every active expert with the same rows (a decode step of one token: one row each): contiguous
       shares of the items stream each weight without a break; otherwise items are taken one by one */
    int balanced = 1;
    for (int64_t j = 1; j < nact; ++j)
        balanced &= start[active[j] + 1] - start[active[j]] == start[active[0] + 1] - start[active[0]];
    omp_set_schedule(balanced ? omp_sched_static : omp_sched_dynamic, balanced ? 0 : 1);
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) swa_i_quant_row(x + t * H, H, xq + t * H, xd + t * nbH, xs + t * nbH);
        #pragma omp for schedule(runtime)
        for (int64_t it = 0; it < nact * n1; ++it) {
            int64_t e = active[it / n1], c = it % n1, s0 = start[e];
            Rows rows = {xqs + s0, xds + s0, xss + s0, hps + s0};
            int64_t g1 = (c + 1) * c1 < G1 ? (c + 1) * c1 : G1;
            swa_i_gemm_groups(gate_up + e * gu_stride, nbH, I2, c * c1, g1, start[e + 1] - s0, &rows);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < A; ++s) {
            float* h = hps[s];
            swa_i_gelu_mul(h, h + I, h, I);  /* in place: [0, I) */
            swa_i_quant_row(h, I, hq + s * I, hd + s * nbI, hs + s * nbI);
        }
        #pragma omp for schedule(runtime)
        for (int64_t it = 0; it < nact * n2; ++it) {
            int64_t e = active[it / n2], c = it % n2, s0 = start[e];
            Rows rows = {hqs + s0, hds + s0, hss + s0, yps + s0};
            int64_t g1 = (c + 1) * c2 < G2 ? (c + 1) * c2 : G2;
            swa_i_gemm_groups(down + e * dn_stride, nbI, H, c * c2, g1, start[e + 1] - s0, &rows);
        }
        moe_combine(out, ybuf, es.slot, weights, T, k, H);
    }
    expert_sort_free(&es); free(xq); free(xd); free(hbuf);
    free(hq); free(hd); free(ybuf); free(xqs); free(xds); free(hqs); free(hds); free(hps); free(yps);
    free(xs); free(hs); free(xss); free(hss);
}

