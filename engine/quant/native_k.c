/* Integer CPU kernels for the GGUF block types on their stored rows (Q8_0, Q4_1, Q5_0, Q5_1, IQ4_NL, and Q4_0
for a layer mixing it with those or a CPU without AVX2 (native_q4.c's interleaved Q4_0 kernel is the main
Q4_0 path), with 8-bit
activations in 32-blocks; Q4_K, Q5_K, Q6_K, IQ4_XS with 8-bit activations in 256-blocks), loaded with
ctypes by engine/quant/native_k.py. AVX2 + FMA + F16C bodies when built with them, plain C otherwise
(the same source; see native_k_dots.h for the block layouts and the arithmetic).

Weights are read in place in their GGUF form (rows of blocks, a view of the file mapping): nothing is
repacked. Activations are quantized per call, per row: ggml's Q8_0 recipe for the 32-weight types
(d = fp16(amax / 127), q = round(x / d)) and a Q8_K-like one for the super-block types (fp32
d = amax / 127 per 256, q = round(x * 127 / amax), int16 code sums per 16 for the minima / offsets).
*/
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_k_dots.h"
#include "native_k_multi.h"
#include "native_moe.h"

int swa_k_abi(void) { return 1; }

#ifdef __AVX2__
int swa_k_simd(void) { return 1; }
#else
int swa_k_simd(void) { return 0; }
#endif

typedef float (*DotFn)(const uint8_t*, const int8_t*, const float*, const int16_t*, int64_t);
/* up to MULTI activation rows against one weight row: out[r] for rows q[r], d[r], s[r] (r < mt) */
typedef void (*MultiFn)(const uint8_t*, int64_t, const int8_t* const*, const float* const*, const int16_t* const*,
                        int, float*);

/* type ids shared with native_k.py (TYPES there) */
typedef struct {
    DotFn dot;
    MultiFn multi;  /* NULL: row by row with `dot` */
    int elems;   /* weights per block */
    int bytes;   /* stored bytes per block */
    int act;     /* activation block: 32 (Q8_0 kind) or 256 (Q8_K kind) */
} TypeInfo;
#ifdef __AVX2__
#define M_(f) f
#define D_(avx, plain) avx
#else
#define M_(f) NULL
#define D_(avx, plain) plain
#endif
static const TypeInfo TYPES[] = {
    {dot_q8_0, M_(multi_q8_0), 32, 34, 32},      {dot_q4_1, M_(multi_q4_1), 32, 20, 32},
    {dot_q5_0, M_(multi_q5_0), 32, 22, 32},      {dot_q5_1, M_(multi_q5_1), 32, 24, 32},
    {dot_iq4_nl, M_(multi_iq4_nl), 32, 18, 32},  {dot_q4_k, M_(multi_q4_k), 256, 144, 256},
    {dot_q5_k, M_(multi_q5_k), 256, 176, 256},   {dot_q6_k, M_(multi_q6_k), 256, 210, 256},
    {D_(one_iq4_xs, dot_iq4_xs), M_(multi_iq4_xs), 256, 136, 256},           {dot_q4_0, M_(multi_q4_0), 32, 18, 32},
    {D_(one_q2_k, dot_q2_k), M_(multi_q2_k), 256, 84, 256},
    {D_(one_q3_k, dot_q3_k), M_(multi_q3_k), 256, 110, 256},
};
#define NTYPES ((int)(sizeof(TYPES) / sizeof(TYPES[0])))

int swa_k_ntypes(void) { return NTYPES; }

/* sums per activation row: one per 32 (Q8_0 kind) or per 16 (Q8_K kind) */
static inline int64_t nsums(int act, int64_t K) { return act == 32 ? K / 32 : K / 16; }
static inline float round_fp16(float v) {
#ifdef __F16C__
    return _cvtsh_ss(_cvtss_sh(v, 0));
#else
    return (float)(_Float16)v;
#endif
}

/* one row of K floats -> codes q[K], scales d[K / act], code sums s (nsums) */
static void quant_row(const float* x, int64_t K, int act, int8_t* q, float* d, int16_t* s) {
    for (int64_t b = 0; b < K / act; ++b) {
        const float* xb = x + b * act;
        int8_t* qb = q + b * act;
        float amax = 0.f;
#ifdef __AVX2__
        const __m256 signbit = _mm256_set1_ps(-0.0f);
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < act; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, _mm256_loadu_ps(xb + j)));
        __m128 mm = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        mm = _mm_max_ps(mm, _mm_movehl_ps(mm, mm));
        mm = _mm_max_ss(mm, _mm_movehdup_ps(mm));
        amax = _mm_cvtss_f32(mm);
#else
        for (int j = 0; j < act; ++j) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
#endif
        d[b] = act == 32 ? round_fp16(amax / 127.f) : amax / 127.f;
        const float mul = amax != 0.f ? 127.f / amax : 0.f;
#ifdef __AVX2__
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256 mv = _mm256_set1_ps(mul);
        for (int j = 0; j < act; j += 32) {
            __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j), mv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), mv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 16), mv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 24), mv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            i0 = _mm256_packs_epi32(i0, i1);
            i2 = _mm256_packs_epi32(i2, i3);
            _mm256_storeu_si256((__m256i*)(qb + j), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i0, i2), perm));
        }
#else
        for (int j = 0; j < act; ++j) qb[j] = (int8_t)nearbyintf(xb[j] * mul);
#endif
    }
    const int group = act == 32 ? 32 : 16;
    for (int64_t g = 0; g < nsums(act, K); ++g) {
        int t = 0;
        for (int j = 0; j < group; ++j) t += q[g * group + j];
        s[g] = (int16_t)t;
    }
}

/* Activation rows by pointer (the MoE groups rows without copying) and output rows. */
typedef struct {
    const int8_t* const* q;
    const float* const* d;
    const int16_t* const* s;
    float* const* y;
} Rows;

#define ROW_CHUNK 16  /* weight rows per work item */
#define M_TILE 8      /* activation rows passing over one weight row while it is in L1 */

/* y[m][n] for weight rows [n0, n1) of W (row stride rb bytes, nb blocks per row), all M rows */
static void gemm_rows(const TypeInfo* t, const uint8_t* W, size_t rb, int64_t nb, int64_t n0, int64_t n1,
                      int64_t M, const Rows* r) {
    for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
        const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* w = W + n * rb;
            if (t->multi == NULL || m1 - m0 == 1) {
                for (int64_t m = m0; m < m1; ++m) r->y[m][n] = t->dot(w, r->q[m], r->d[m], r->s[m], nb);
                continue;
            }
            for (int64_t m = m0; m < m1; m += MULTI) {
                const int mt = (int)(m1 - m < MULTI ? m1 - m : MULTI);
                float out[MULTI];
                t->multi(w, nb, r->q + m, r->d + m, r->s + m, mt, out);
                for (int i = 0; i < mt; ++i) r->y[m + i][n] = out[i];
            }
        }
    }
}

typedef struct {  /* quantized activations of R rows of K: contiguous buffers */
    int8_t* q;
    float* d;
    int16_t* s;
    int64_t K, act;
} QBuf;

static QBuf qbuf_new(int64_t R, int64_t K, int act) {
    QBuf b = {(int8_t*)malloc((size_t)(R * K > 0 ? R * K : 1)), (float*)malloc((size_t)(R * (K / act) + 1) * sizeof(float)),
              (int16_t*)malloc((size_t)(R * nsums(act, K) + 1) * sizeof(int16_t)), K, act};
    return b;
}
static void qbuf_free(QBuf* b) { free(b->q); free(b->d); free(b->s); }
static inline int8_t* qb_q(const QBuf* b, int64_t r) { return b->q + r * b->K; }
static inline float* qb_d(const QBuf* b, int64_t r) { return b->d + r * (b->K / b->act); }
static inline int16_t* qb_s(const QBuf* b, int64_t r) { return b->s + r * nsums((int)b->act, b->K); }

/* x [M, K] -> codes q [M, K], scales d [M, K / act], sums s [M, nsums] of type `type`'s activations */
void swa_k_quant(int type, const float* x, int64_t M, int64_t K, int8_t* q, float* d, int16_t* s) {
    const int act = TYPES[type].act;
    for (int64_t m = 0; m < M; ++m)
        quant_row(x + m * K, K, act, q + m * K, d + m * (K / act), s + m * nsums(act, K));
}

/* y [M, N] = x [M, K] @ W^T, W the stored rows [N, K / elems * bytes] of type `type` */
void swa_k_mm(int type, const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y,
              int nthreads) {
    const TypeInfo* t = &TYPES[type];
    const int64_t nb = K / t->elems, nchunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
    const size_t rb = (size_t)nb * t->bytes;
    QBuf qb = qbuf_new(M, K, t->act);
    const int8_t** qs = (const int8_t**)malloc((M + 1) * sizeof(void*));
    const float** ds = (const float**)malloc((M + 1) * sizeof(void*));
    const int16_t** ss = (const int16_t**)malloc((M + 1) * sizeof(void*));
    float** ys = (float**)malloc((M + 1) * sizeof(void*));
    for (int64_t m = 0; m < M; ++m) { qs[m] = qb_q(&qb, m); ds[m] = qb_d(&qb, m); ss[m] = qb_s(&qb, m); ys[m] = y + m * N; }
    Rows rows = {qs, ds, ss, ys};
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quant_row(x + m * K, K, t->act, qb_q(&qb, m), qb_d(&qb, m), qb_s(&qb, m));
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t n1 = (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N;
            gemm_rows(t, W, rb, nb, c * ROW_CHUNK, n1, M, &rows);
        }
    }
    qbuf_free(&qb); free(qs); free(ds); free(ss); free(ys);
}

static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

/* Routed-MoE layer, all tokens grouped by expert in one call (as native_q4.c's swa_q4_moe, any types here):
   out [T, H] = sum_j w[t, j] * down_e(gelu_tanh(gate_e x_t) * up_e x_t), e = ids[t, j].
   gate_up: E stored [2I, H] weights of type tgu back to back (gate rows [0, I), up rows [I, 2I));
   down: E stored [H, I] weights of type tdn. */
void swa_k_moe(int tgu, int tdn, const float* x, int64_t T, int64_t H, const uint8_t* gate_up,
               const uint8_t* down, int64_t E, int64_t I, const int64_t* ids, const float* weights, int64_t k,
               float* out, int nthreads) {
    const TypeInfo *t1 = &TYPES[tgu], *t2 = &TYPES[tdn];
    const int64_t A = T * k, I2 = 2 * I, nb1 = H / t1->elems, nb2 = I / t2->elems;
    const size_t rb1 = (size_t)nb1 * t1->bytes, rb2 = (size_t)nb2 * t2->bytes;
    const size_t gu_stride = rb1 * I2, dn_stride = rb2 * H;
    ExpertSort es = expert_sort(ids, A, E);
    const int64_t *start = es.start, *order = es.order, *active = es.active, nact = es.nact;
    QBuf xb = qbuf_new(T, H, t1->act), hb = qbuf_new(A, I, t2->act);
    float* hbuf = (float*)malloc((size_t)(A * I2 + 1) * sizeof(float));  /* gate_up outputs by sorted slot */
    float* ybuf = (float*)malloc((size_t)(A * H + 1) * sizeof(float));   /* down outputs by sorted slot */
    const int8_t** pq = (const int8_t**)malloc((2 * A + 1) * sizeof(void*));
    const float** pd = (const float**)malloc((2 * A + 1) * sizeof(void*));
    const int16_t** ps = (const int16_t**)malloc((2 * A + 1) * sizeof(void*));
    float** py = (float**)malloc((2 * A + 1) * sizeof(void*));
    for (int64_t s = 0; s < A; ++s) {
        const int64_t tk = order[s] / k;
        pq[s] = qb_q(&xb, tk); pd[s] = qb_d(&xb, tk); ps[s] = qb_s(&xb, tk); py[s] = hbuf + s * I2;
        pq[A + s] = qb_q(&hb, s); pd[A + s] = qb_d(&hb, s); ps[A + s] = qb_s(&hb, s); py[A + s] = ybuf + s * H;
    }
    const int64_t n1 = (I2 + ROW_CHUNK - 1) / ROW_CHUNK, n2 = (H + ROW_CHUNK - 1) / ROW_CHUNK;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t tk = 0; tk < T; ++tk) quant_row(x + tk * H, H, t1->act, qb_q(&xb, tk), qb_d(&xb, tk), qb_s(&xb, tk));
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nact * n1; ++it) {
            const int64_t e = active[it / n1], c = it % n1, s0 = start[e];
            const Rows rows = {pq + s0, pd + s0, ps + s0, py + s0};
            const int64_t r1 = (c + 1) * ROW_CHUNK < I2 ? (c + 1) * ROW_CHUNK : I2;
            gemm_rows(t1, gate_up + e * gu_stride, rb1, nb1, c * ROW_CHUNK, r1, start[e + 1] - s0, &rows);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < A; ++s) {
            float* h = hbuf + s * I2;
            for (int64_t i = 0; i < I; ++i) h[i] = gelu_tanh(h[i]) * h[I + i];  /* in place: [0, I) */
            quant_row(h, I, t2->act, qb_q(&hb, s), qb_d(&hb, s), qb_s(&hb, s));
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nact * n2; ++it) {
            const int64_t e = active[it / n2], c = it % n2, s0 = start[e];
            const Rows rows = {pq + A + s0, pd + A + s0, ps + A + s0, py + A + s0};
            const int64_t r1 = (c + 1) * ROW_CHUNK < H ? (c + 1) * ROW_CHUNK : H;
            gemm_rows(t2, down + e * dn_stride, rb2, nb2, c * ROW_CHUNK, r1, start[e + 1] - s0, &rows);
        }
        moe_combine(out, ybuf, es.slot, weights, T, k, H);
    }
    qbuf_free(&xb); qbuf_free(&hb);
    expert_sort_free(&es); free(hbuf); free(ybuf);
    free(pq); free(pd); free(ps); free(py);
}
