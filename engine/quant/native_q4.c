/* Q4_0 x Q8_0 CPU kernels (AVX2 + FMA + F16C, OpenMP), loaded with ctypes by engine/quant/native.py.

Numerics (the ggml recipe, so results match llama.cpp's CPU path up to summation order): each row of
activations is quantized per 32-block to Q8_0 (d = amax / 127 rounded to fp16, q = round(x / d)); the
dot of the 4-bit weight codes (q - 8) with the int8 codes is exact in int32; blocks accumulate in fp32
as d_w * d_x * dot.

Weight layout ("interleaved"): rows in groups of ROWS = 4; for group g and block b, 72 bytes =
the 4 rows' fp16 scales (8 B) then the 4 rows' 16 nibble bytes (4 x 16 B), nibbles exactly as GGUF
stores them (low nibble of byte j = element j, high = element j + 16). Lossless: the same bytes as
the GGUF rows (18 per block), reordered; a last partial group is padded with zero rows.
Group g starts at g * nb * 72 (nb = K / 32). Every function releases nothing itself: ctypes drops
the GIL around each call.
*/
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define BQ4 18
#define ROWS 4
#define GBYTES (ROWS * BQ4)  /* 72 bytes: one block of each row of a group */
#define MAX_TILE 4

int swa_q4_abi(void) { return 3; }

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* one row of K floats -> Q8_0 codes q [K] and fp32 scales d [K / 32] (values of fp16 numbers) */
static void quant_row_q8(const float* x, int64_t K, int8_t* q, float* d) {
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; ++b) {
        const float* xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_andnot_ps(signbit, v0);
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, v1));
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, v2));
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, v3));
        __m128 mm = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        mm = _mm_max_ps(mm, _mm_movehl_ps(mm, mm));
        mm = _mm_max_ss(mm, _mm_movehdup_ps(mm));
        float amax = _mm_cvtss_f32(mm);
        d[b] = _cvtsh_ss(_cvtss_sh(amax / 127.f, 0));  /* stored as fp16 by ggml: same rounding */
        __m256 mul = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        _mm256_storeu_si256((__m256i*)(q + b * QK), _mm256_permutevar8x32_epi32(i0, perm));
    }
}

/* 32 signed weights (code - 8) of one block's 16 nibble bytes */
static inline __m256i unpack_q4(const uint8_t* qs) {
    __m128i t = _mm_loadu_si128((const __m128i*)qs);
    __m256i v = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}

/* 8 fp32 partial sums of w . x (w signed in [-8, 7], x int8), exact */
static inline __m256 dot_i8(__m256i abs_w, __m256i w, __m256i x, __m256i ones) {
    __m256i p16 = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
}

/* Activation rows by pointer (MoE groups rows without copying): codes, scales, output row. */
typedef struct {
    const int8_t* const* xq;
    const float* const* xd;
    float* const* y;
} Rows;

/* the 4 rows of group g (outputs n0 .. n0 + valid) for one activation row m: 4 accumulators */
static void tile_r4_m1(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, float* y,
                       int64_t n0, int valid) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = grp + b * GBYTES;
        _mm_prefetch((const char*)(blk + 4 * GBYTES), _MM_HINT_T0);
        _mm_prefetch((const char*)(blk + 4 * GBYTES + 64), _MM_HINT_T0);
        __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)blk));  /* 4 row scales */
        __m128 s = _mm_mul_ps(dw, _mm_set1_ps(xd[b]));
        float sc[ROWS];
        _mm_storeu_ps(sc, s);
        __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
        for (int r = 0; r < ROWS; ++r) {
            __m256i w = unpack_q4(blk + 8 + 16 * r);
            __m256 p = dot_i8(_mm256_sign_epi8(w, w), w, x, ones);
            acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(sc[r]), acc[r]);
        }
    }
    for (int r = 0; r < valid; ++r) y[n0 + r] = hsum256(acc[r]);
}

/* one row r of group g for MT activation rows: each weight block unpacked once for MT rows */
#define DEFINE_TILE_R1(MT)                                                                             \
static void tile_r1_m##MT(const uint8_t* grp, int64_t nb, int r, const Rows* rows, int64_t m0,        \
                          int64_t n) {                                                                 \
    const __m256i ones = _mm256_set1_epi16(1);                                                        \
    __m256 acc[MT];                                                                                    \
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();                                        \
    for (int64_t b = 0; b < nb; ++b) {                                                                 \
        const uint8_t* blk = grp + b * GBYTES;                                                         \
        if (r == 0) _mm_prefetch((const char*)(blk + 4 * GBYTES), _MM_HINT_T0);                        \
        if (r == 0) _mm_prefetch((const char*)(blk + 4 * GBYTES + 64), _MM_HINT_T0);                   \
        float dw = _cvtsh_ss(((const uint16_t*)blk)[r]);                                               \
        __m256i w = unpack_q4(blk + 8 + 16 * r);                                                       \
        __m256i aw = _mm256_sign_epi8(w, w);                                                           \
        for (int i = 0; i < MT; ++i) {                                                                 \
            __m256i x = _mm256_loadu_si256((const __m256i*)(rows->xq[m0 + i] + b * QK));              \
            __m256 p = dot_i8(aw, w, x, ones);                                                         \
            acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * rows->xd[m0 + i][b]), acc[i]);             \
        }                                                                                              \
    }                                                                                                  \
    for (int i = 0; i < MT; ++i) rows->y[m0 + i][n] = hsum256(acc[i]);                                \
}
DEFINE_TILE_R1(4)

/* outputs of groups [g0, g1) for all M activation rows */
static void gemm_groups(const uint8_t* W, int64_t nb, int64_t N, int64_t g0, int64_t g1, int64_t M,
                        const Rows* rows) {
    const size_t gstride = (size_t)nb * GBYTES;
    int64_t m = 0;
    for (; m + MAX_TILE <= M; m += MAX_TILE)
        for (int64_t g = g0; g < g1; ++g) {
            int valid = (int)(N - g * ROWS < ROWS ? N - g * ROWS : ROWS);
            for (int r = 0; r < valid; ++r) tile_r1_m4(W + g * gstride, nb, r, rows, m, g * ROWS + r);
        }
    for (; m < M; ++m)
        for (int64_t g = g0; g < g1; ++g) {
            int valid = (int)(N - g * ROWS < ROWS ? N - g * ROWS : ROWS);
            tile_r4_m1(W + g * gstride, nb, rows->xq[m], rows->xd[m], rows->y[m], g * ROWS, valid);
        }
}

static inline int64_t groups_of(int64_t n) { return (n + ROWS - 1) / ROWS; }

/* bytes of the interleaved form of an [N, K] weight */
int64_t swa_q4_packed_bytes(int64_t N, int64_t K) { return groups_of(N) * (K / QK) * GBYTES; }

/* GGUF rows src [N, K/32 * 18] -> interleaved dst (swa_q4_packed_bytes); zero rows pad the last group */
void swa_q4_repack(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, int nthreads) {
    const int64_t nb = K / QK, G = groups_of(N);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t g = 0; g < G; ++g) {
        uint8_t* out = dst + (size_t)g * nb * GBYTES;
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* blk = out + b * GBYTES;
            for (int r = 0; r < ROWS; ++r) {
                int64_t n = g * ROWS + r;
                if (n < N) {
                    const uint8_t* s = src + ((size_t)n * nb + b) * BQ4;
                    memcpy(blk + 2 * r, s, 2);
                    memcpy(blk + 8 + 16 * r, s + 2, 16);
                } else {
                    memset(blk + 2 * r, 0, 2);
                    memset(blk + 8 + 16 * r, 0x88, 16);  /* codes 8: value 0 */
                }
            }
        }
    }
}

/* interleaved -> GGUF rows (the inverse of swa_q4_repack; dst [N, K/32 * 18]) */
void swa_q4_unpack(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t nb = K / QK;
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* grp = src + (size_t)(n / ROWS) * nb * GBYTES;
        int r = (int)(n % ROWS);
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* o = dst + ((size_t)n * nb + b) * BQ4;
            memcpy(o, grp + b * GBYTES + 2 * r, 2);
            memcpy(o + 2, grp + b * GBYTES + 8 + 16 * r, 16);
        }
    }
}

/* rows ids [R] of the interleaved weight, dequantized: out [R, K] fp32 (embedding lookup) */
void swa_q4_rows(const uint8_t* W, int64_t N, int64_t K, const int64_t* ids, int64_t R, float* out) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < R; ++i) {
        int64_t n = ids[i];
        const uint8_t* grp = W + (size_t)(n / ROWS) * nb * GBYTES;
        int r = (int)(n % ROWS);
        float* o = out + i * K;
        for (int64_t b = 0; b < nb; ++b) {
            float d = _cvtsh_ss(((const uint16_t*)(grp + b * GBYTES))[r]);
            const uint8_t* qs = grp + b * GBYTES + 8 + 16 * r;
            for (int j = 0; j < 16; ++j) {
                o[b * QK + j] = (float)((qs[j] & 0x0F) - 8) * d;
                o[b * QK + j + 16] = (float)((qs[j] >> 4) - 8) * d;
            }
        }
    }
    (void)N;
}

/* x [M, K] fp32 -> Q8_0 codes q [M, K] and scales d [M, K / 32] */
void swa_q8_quant(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; ++m) quant_row_q8(x + m * K, K, q + m * K, d + m * (K / QK));
}

#define GROUP_CHUNK 8  /* groups per work item: 32 weight rows stay in L2 while M rows pass over them */

/* y [M, N] = x [M, K] @ W^T, W interleaved [N, K] */
void swa_q4_mm(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y, int nthreads) {
    const int64_t nb = K / QK, G = groups_of(N);
    int8_t* xq = (int8_t*)malloc((size_t)M * K);
    float* xd = (float*)malloc((size_t)M * nb * sizeof(float));
    const int8_t** xqs = (const int8_t**)malloc(M * sizeof(void*));
    const float** xds = (const float**)malloc(M * sizeof(void*));
    float** ys = (float**)malloc(M * sizeof(void*));
    for (int64_t m = 0; m < M; ++m) { xqs[m] = xq + m * K; xds[m] = xd + m * nb; ys[m] = y + m * N; }
    Rows rows = {xqs, xds, ys};
    const int64_t chunk = M == 1 ? 4 : GROUP_CHUNK, nchunks = (G + chunk - 1) / chunk;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quant_row_q8(x + m * K, K, xq + m * K, xd + m * nb);
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            int64_t g1 = (c + 1) * chunk < G ? (c + 1) * chunk : G;
            gemm_groups(W, nb, N, c * chunk, g1, M, &rows);
        }
    }
    free(xq); free(xd); free(xqs); free(xds); free(ys);
}

static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

/* Routed-MoE layer, all tokens grouped by expert in one call:
   out [T, H] = sum_j w[t, j] * down_e(gelu_tanh(gate_e x_t) * up_e x_t), e = ids[t, j].
   gate_up: E interleaved [2I, H] weights back to back (gate rows [0, I), up rows [I, 2I));
   down: E interleaved [H, I] weights. Work items (expert, group chunk) share one OpenMP region. */
void swa_q4_moe(const float* x, int64_t T, int64_t H, const uint8_t* gate_up, const uint8_t* down,
                int64_t E, int64_t I, const int64_t* ids, const float* weights, int64_t k, float* out,
                int nthreads) {
    const int64_t A = T * k, I2 = 2 * I, nbH = H / QK, nbI = I / QK;
    const size_t gu_stride = (size_t)swa_q4_packed_bytes(I2, H), dn_stride = (size_t)swa_q4_packed_bytes(H, I);
    /* counting sort of the assignments by expert: sorted slot s holds assignment order[s] */
    int64_t* start = (int64_t*)calloc(E + 1, sizeof(int64_t));
    int64_t* order = (int64_t*)malloc(A * sizeof(int64_t));
    int64_t* slot = (int64_t*)malloc(A * sizeof(int64_t));
    for (int64_t a = 0; a < A; ++a) start[ids[a] + 1]++;
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    int64_t* fill = (int64_t*)malloc(E * sizeof(int64_t));
    memcpy(fill, start, E * sizeof(int64_t));
    for (int64_t a = 0; a < A; ++a) { int64_t s = fill[ids[a]]++; order[s] = a; slot[a] = s; }
    int64_t* active = (int64_t*)malloc(E * sizeof(int64_t));
    int64_t nact = 0;
    for (int64_t e = 0; e < E; ++e) if (start[e + 1] > start[e]) active[nact++] = e;
    int8_t* xq = (int8_t*)malloc((size_t)T * H);
    float* xd = (float*)malloc((size_t)T * nbH * sizeof(float));
    float* hbuf = (float*)malloc((size_t)A * I2 * sizeof(float));  /* gate_up outputs, sorted slots */
    int8_t* hq = (int8_t*)malloc((size_t)A * I);
    float* hd = (float*)malloc((size_t)A * nbI * sizeof(float));
    float* ybuf = (float*)malloc((size_t)A * H * sizeof(float));   /* down outputs, sorted slots */
    const int8_t** xqs = (const int8_t**)malloc(A * sizeof(void*));
    const float** xds = (const float**)malloc(A * sizeof(void*));
    const int8_t** hqs = (const int8_t**)malloc(A * sizeof(void*));
    const float** hds = (const float**)malloc(A * sizeof(void*));
    float** hps = (float**)malloc(A * sizeof(void*));
    float** yps = (float**)malloc(A * sizeof(void*));
    for (int64_t s = 0; s < A; ++s) {
        int64_t t = order[s] / k;
        xqs[s] = xq + t * H; xds[s] = xd + t * nbH;
        hps[s] = hbuf + s * I2; yps[s] = ybuf + s * H;
        hqs[s] = hq + s * I; hds[s] = hd + s * nbI;
    }
    const int64_t G1 = groups_of(I2), G2 = groups_of(H);
    const int64_t c1 = GROUP_CHUNK, c2 = GROUP_CHUNK;
    const int64_t n1 = (G1 + c1 - 1) / c1, n2 = (G2 + c2 - 1) / c2;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) quant_row_q8(x + t * H, H, xq + t * H, xd + t * nbH);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nact * n1; ++it) {
            int64_t e = active[it / n1], c = it % n1, s0 = start[e];
            Rows rows = {xqs + s0, xds + s0, hps + s0};
            int64_t g1 = (c + 1) * c1 < G1 ? (c + 1) * c1 : G1;
            gemm_groups(gate_up + e * gu_stride, nbH, I2, c * c1, g1, start[e + 1] - s0, &rows);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < A; ++s) {
            float* h = hps[s];
            for (int64_t i = 0; i < I; ++i) h[i] = gelu_tanh(h[i]) * h[I + i];  /* in place: [0, I) */
            quant_row_q8(h, I, hq + s * I, hd + s * nbI);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nact * n2; ++it) {
            int64_t e = active[it / n2], c = it % n2, s0 = start[e];
            Rows rows = {hqs + s0, hds + s0, yps + s0};
            int64_t g1 = (c + 1) * c2 < G2 ? (c + 1) * c2 : G2;
            gemm_groups(down + e * dn_stride, nbI, H, c * c2, g1, start[e + 1] - s0, &rows);
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float* o = out + t * H;
            for (int64_t h = 0; h < H; ++h) o[h] = 0.f;
            for (int64_t j = 0; j < k; ++j) {
                const float wgt = weights[t * k + j];
                const float* yv = ybuf + slot[t * k + j] * H;
                for (int64_t h = 0; h < H; ++h) o[h] += wgt * yv[h];
            }
        }
    }
    free(start); free(order); free(slot); free(fill); free(active); free(xq); free(xd); free(hbuf);
    free(hq); free(hd); free(ybuf); free(xqs); free(xds); free(hqs); free(hds); free(hps); free(yps);
}
