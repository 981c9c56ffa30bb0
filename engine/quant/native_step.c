/* A decode step of every decoder layer in one call (engine/quant/native_step.py, models/gemma4_decode.py).

Why: at batch 1 the step is weight streaming plus ~20 small calls a layer. Driven from Python, each call
paid its ctypes crossing, tensor allocations and an OpenMP region, ~1.5-2 ms a `small` step, none of it
parallel (docs/benchmarks.md, "Batch-1 decode"). Here the layer loop runs in C over descriptors built once
per model (StepLayer) and per step (Step), on scratch buffers the caller owns, and the linears that read
the same input share one quantization and one OpenMP region (q / k / v, then gate / up).

The calls are native_q4.c's and native_ops.c's, in models/gemma4_decode.py's order on the same values,
so the same bits (tests/models/test_decode_path.py); the new K/V rows are written here (fp32 / fp16 /
bf16 rounded to nearest even as torch converts, q8_0 by swa_kv_store_q8: the same bytes). Only Q4_0 interleaved linears and Q4_0
experts in host memory; the caller checks (models/gemma4_step.py `NativeStep.ok`).
*/
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_q4.h"

void swa_rms_norm(const float* x, int64_t M, int64_t N, const float* w, float eps, float* out, float* res);
void swa_norm_rope(float* x, int64_t T, int64_t nh, int64_t D, const float* w, float eps, const float* cos_t,
                   const float* sin_t, int64_t n, int64_t half);
void swa_ffn_tail(float* m1, float* m2, const float* w1, const float* w2, const float* w, float eps,
                  float scalar, float* h, int64_t M, int64_t N);
void swa_router(const float* x, int64_t T, int64_t H, const float* rw, float eps, const float* W, int64_t E,
                int64_t k, const float* pes, int64_t* ids, float* wts);
void swa_decode_attn(const float* q, const int64_t* rows, int64_t B, int64_t H, int64_t KVH, int64_t D,
                     const void* K, int64_t k_rs, int64_t k_hs, int kt, const void* V, int64_t v_rs,
                     int64_t v_hs, int vt, const int64_t* slots, int64_t S, const int64_t* counts, float* out,
                     int nthreads);
void swa_kv_store_q8(const float* x, int64_t T, int64_t KVH, int64_t D, uint8_t* dst, int64_t rs, int64_t hs,
                     const int64_t* slots, int nthreads);
void swa_q4_moe(const float* x, int64_t T, int64_t H, const uint8_t* gate_up, const uint8_t* down,
                int64_t E, int64_t I, const int64_t* ids, const float* weights, int64_t k, float* out,
                int nthreads);

/* One layer. Every field is 8 bytes, in native_step.py's ctypes order. */
typedef struct {
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *pre_ffw_norm_2;
    const float *post_ffw_norm_1, *post_ffw_norm_2, *post_ffw_norm;
    const float *router_rw, *router_w, *expert_scale;   /* the router's folded scales, [E, H], [E] */
    const uint8_t *wq, *wk, *wv, *wo, *wgate, *wup, *wdown;  /* interleaved Q4_0; wv NULL: V = K */
    const uint8_t *moe_gu, *moe_dn;                        /* E interleaved [2I, H] / [H, I] */
    uint8_t *kc, *vc;                                      /* the layer's K / V pool views */
    int64_t k_rs, k_hs, kt, v_rs, v_hs, vt;                /* byte strides (slot, head); load_kv types */
    int64_t kind, D, KVH;                                  /* kind 0 sliding, 1 full */
    double scalar;
} StepLayer;

/* One step: T decode rows. Per kind (0 sliding, 1 full): rope tables [T, n], the slots the new K/V rows go
   to [T], and the decode attention's plan (rows [T], slots [T, S], counts [T]). Scratch fp32 buffers:
   x [T, H], q and a [T, NH * Dmax], k and v [T, KVHmax * Dmax], gu [T, 2 FF], m1 and m2 [T, H]; ids int64
   and wts fp32 [T, TOPK]. h [T, H] is the residual stream, updated in place. */
typedef struct {
    float* h;
    int64_t T, H, NH, FF, MI, E, TOPK, nthreads;
    double eps;
    const float *cos[2], *sin[2];
    int64_t rope_n[2], rope_half[2];
    const int64_t *store_slots[2], *rows[2], *slots[2], *counts[2];
    int64_t S[2];
    float *x, *q, *k, *v, *a, *gu, *m1, *m2, *wts;
    int64_t* ids;
} Step;

/* One output of mm_shared: y[m * ldy + n] for n < N of the interleaved [N, K] weight W. */
typedef struct {
    const uint8_t* W;
    int64_t N, ldy;
    float* y;
} Out;

/* Every output of `outs` (n <= 4 weights of the same K) for the M rows x[m * ldx ..]: the rows quantized
   once, then all the weights' group chunks in one OpenMP region (static: each thread streams its share). */
static void mm_shared(const float* x, int64_t ldx, int64_t M, int64_t K, const Out* outs, int n, int nthreads) {
    const int64_t nb = K / QK;
    int8_t* xq = (int8_t*)malloc((size_t)M * K);
    float* xd = (float*)malloc((size_t)M * nb * sizeof(float));
    int32_t* xs = (int32_t*)malloc((size_t)M * nb * sizeof(int32_t));
    const void** ptrs = (const void**)malloc((size_t)(3 + n) * M * sizeof(void*));
    const int8_t** xqs = (const int8_t**)ptrs;
    const float** xds = (const float**)(ptrs + M);
    const int32_t** xss = (const int32_t**)(ptrs + 2 * M);
    int64_t first[5] = {0};  /* chunk index where output i starts */
    Rows rows[4];
    for (int64_t m = 0; m < M; ++m) {
        xqs[m] = xq + m * K; xds[m] = xd + m * nb; xss[m] = xs + m * nb;
    }
    for (int i = 0; i < n; ++i) {
        float** ys = (float**)(ptrs + (3 + i) * M);
        for (int64_t m = 0; m < M; ++m) ys[m] = outs[i].y + m * outs[i].ldy;
        rows[i] = (Rows){xqs, xds, xss, ys};
        first[i + 1] = first[i] + ((outs[i].N + ROWS - 1) / ROWS + GROUP_CHUNK - 1) / GROUP_CHUNK;
    }
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) swa_i_quant_row(x + m * ldx, K, xq + m * K, xd + m * nb, xs + m * nb);
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < first[n]; ++c) {
            int i = 0;
            while (c >= first[i + 1]) ++i;
            const int64_t G = (outs[i].N + ROWS - 1) / ROWS, g0 = (c - first[i]) * GROUP_CHUNK;
            swa_i_gemm_groups(outs[i].W, nb, outs[i].N, g0, g0 + GROUP_CHUNK < G ? g0 + GROUP_CHUNK : G, M,
                              &rows[i]);
        }
    }
    free(xq); free(xd); free(xs); free(ptrs);
}

static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN, as torch writes it */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* dst[slots[t]] = the T x KVH head rows of x [T, KVH, D] in the pool's type kt (0 fp32, 1 fp16, 2 bf16,
   3 q8_0) at byte strides rs (slot) and hs (head) */
static void kv_store(const float* x, int64_t T, int64_t KVH, int64_t D, uint8_t* dst, int64_t rs, int64_t hs,
                     int64_t kt, const int64_t* slots) {
    if (kt == 3) {
        swa_kv_store_q8(x, T, KVH, D, dst, rs, hs, slots, 1);
        return;
    }
    for (int64_t it = 0; it < T * KVH; ++it) {
        const float* src = x + it * D;
        uint8_t* row = dst + slots[it / KVH] * rs + (it % KVH) * hs;
        if (kt == 0) {
            memcpy(row, src, (size_t)D * 4);
        } else if (kt == 1) {
            for (int64_t i = 0; i < D; i += 8)
                _mm_storeu_si128((__m128i*)((uint16_t*)row + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        } else {
            for (int64_t i = 0; i < D; ++i) ((uint16_t*)row)[i] = bf16_rne(src[i]);
        }
    }
}

/* Built with -DSTEP_TIMERS (tools/cpu/profile_native_step.py): wall seconds per part, summed over calls. */
#ifdef STEP_TIMERS
enum { P_NORMS, P_QKV, P_ROPE_STORE, P_ATTN, P_O, P_GATE_UP, P_DOWN, P_ROUTER, P_MOE, P_TAIL, NPARTS };
static double step_times[NPARTS];
static double t_last;
#define MARK(part) do { double t_ = omp_get_wtime(); step_times[part] += t_ - t_last; t_last = t_; } while (0)
void swa_step_times(double* out) { for (int i = 0; i < NPARTS; ++i) { out[i] = step_times[i]; step_times[i] = 0; } }
#else
#define MARK(part) do { } while (0)
#endif

static void layer(const StepLayer* L, const Step* s) {
    const int64_t T = s->T, H = s->H, NH = s->NH, D = L->D, KVH = L->KVH, FF = s->FF, kd = L->kind;
    const int nt = (int)s->nthreads;
    const float eps = (float)s->eps;
    float *h = s->h, *x = s->x, *q = s->q, *k = s->k, *v = s->v, *a = s->a, *gu = s->gu;
    /* attention: q / k / v from one normed input, V = K where the layer has no v weight */
    swa_rms_norm(h, T, H, L->attn_norm, eps, x, NULL);
    MARK(P_NORMS);
    const Out qkv[3] = {{L->wq, NH * D, NH * D, q}, {L->wk, KVH * D, KVH * D, k}, {L->wv, KVH * D, KVH * D, v}};
    mm_shared(x, H, T, H, qkv, L->wv ? 3 : 2, nt);
    MARK(P_QKV);
    if (!L->wv) memcpy(v, k, (size_t)T * KVH * D * sizeof(float));
    swa_rms_norm(v, T * KVH, D, NULL, eps, v, NULL);
    swa_norm_rope(q, T, NH, D, L->q_norm, eps, s->cos[kd], s->sin[kd], s->rope_n[kd], s->rope_half[kd]);
    swa_norm_rope(k, T, KVH, D, L->k_norm, eps, s->cos[kd], s->sin[kd], s->rope_n[kd], s->rope_half[kd]);
    kv_store(k, T, KVH, D, L->kc, L->k_rs, L->k_hs, L->kt, s->store_slots[kd]);
    kv_store(v, T, KVH, D, L->vc, L->v_rs, L->v_hs, L->vt, s->store_slots[kd]);
    MARK(P_ROPE_STORE);
    swa_decode_attn(q, s->rows[kd], T, NH, KVH, D, L->kc, L->k_rs, L->k_hs, (int)L->kt, L->vc, L->v_rs,
                    L->v_hs, (int)L->vt, s->slots[kd], s->S[kd], s->counts[kd], a, nt);
    MARK(P_ATTN);
    const Out o = {L->wo, H, H, s->m1};
    mm_shared(a, NH * D, T, NH * D, &o, 1, nt);
    MARK(P_O);
    swa_rms_norm(s->m1, T, H, L->post_attn_norm, eps, NULL, h);  /* h += norm(o) * w */
    /* dense MLP: gate and up from one normed input, down over gelu_tanh(gate) * up */
    swa_rms_norm(h, T, H, L->ffn_norm, eps, x, NULL);
    const Out gate_up[2] = {{L->wgate, FF, 2 * FF, gu}, {L->wup, FF, 2 * FF, gu + FF}};
    MARK(P_NORMS);
    mm_shared(x, H, T, H, gate_up, 2, nt);
    MARK(P_GATE_UP);
    for (int64_t t = 0; t < T; ++t) {
        float* r = gu + t * 2 * FF;
        swa_i_gelu_mul(r, r + FF, r, FF);
    }
    const Out down = {L->wdown, H, H, s->m1};
    mm_shared(gu, 2 * FF, T, FF, &down, 1, nt);
    MARK(P_DOWN);
    /* routed experts on the same residual */
    swa_router(h, T, H, L->router_rw, eps, L->router_w, s->E, s->TOPK, L->expert_scale, s->ids, s->wts);
    MARK(P_ROUTER);
    swa_rms_norm(h, T, H, L->pre_ffw_norm_2, eps, x, NULL);
    MARK(P_NORMS);
    swa_q4_moe(x, T, H, L->moe_gu, L->moe_dn, s->E, s->MI, s->ids, s->wts, s->TOPK, s->m2, nt);
    MARK(P_MOE);
    swa_ffn_tail(s->m1, s->m2, L->post_ffw_norm_1, L->post_ffw_norm_2, L->post_ffw_norm, eps, (float)L->scalar,
                 h, T, H);
    MARK(P_TAIL);
}

/* every layer of `layers` [n] over the step's rows */
void swa_decode_step(const StepLayer* layers, int64_t n, const Step* s) {
#ifdef STEP_TIMERS
    t_last = omp_get_wtime();
#endif
    for (int64_t i = 0; i < n; ++i) layer(&layers[i], s);
}

int64_t swa_step_sizes(void) { return (int64_t)(sizeof(StepLayer) * 1000 + sizeof(Step)); }
