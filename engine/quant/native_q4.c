/* Q4_0 x Q8_0 CPU kernels (AVX2 + FMA + F16C, AVX-VNNI when the build host has it; OpenMP), loaded
with ctypes by engine/quant/native.py.

Numerics (ggml's Q8_0 recipe for the activations, so results match llama.cpp's CPU path up to
summation order): each row of activations is quantized per 32-block to Q8_0 (d = amax / 127 rounded to
fp16, q = round(x / d)); the block dot of the 4-bit codes c (weight = c - 8) with the int8 codes is
exact in int32 (sum c * q - 8 * sum q, the code sum kept beside the codes); each output accumulates over
the blocks in fp32, one fused multiply-add per block: acc = fma(dot, fp32(d_w * d_x), acc). Every
output sees exactly these operations whatever M, the tile it falls in, or the ISA path (VNNI or
maddubs + madd give the same integers), so a row's result does not depend on the batch around it.

Weight layout ("interleaved"): rows in groups of ROWS = 8. Group g (at g * nb * 144, nb = K / 32) is
nb blocks of 128 nibble bytes, then nb x 8 fp16 scales (16 B per block). In a block's 128 bytes,
chunk c (0..3) is 32 bytes = for each of the 8 rows its GGUF nibble bytes 4c .. 4c + 3 (low nibble of
byte j = element j, high = element j + 16). One 256-bit load is then 8 rows x 4 bytes: an int32 lane
per row, so a broadcast of 4 activation codes and a u8 x s8 dot give 8 rows' partial dots in 8 lanes
(no horizontal sums). Lossless: the GGUF bytes (18 per row-block), reordered; a last partial group is
padded with zero rows. Every function releases nothing itself: ctypes drops the GIL around each call.
*/
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_avx.h"
#include "native_q4.h"

#define BQ4 18
#define NIB 128      /* nibble bytes of one block of a group: 8 rows x 16 */
#define SCB 16       /* scale bytes of one block of a group: 8 fp16 */
#define GBYTES 144   /* NIB + SCB = 8 x 18: the same bytes as the 8 GGUF row-blocks */
#ifndef PF_BLOCKS
#define PF_BLOCKS 24  /* software prefetch distance in blocks (3 KB ahead: weights stream from DRAM) */
#endif
#ifndef PF1_BLOCKS
#define PF1_BLOCKS 160  /* the same for one activation row (tile1x4), into L2: 20 KB ahead of each stream */
#endif
#define MAX_TILE 4   /* activation rows per tile: 4 fp32 + 4-8 int32 accumulators stay in registers */

int swa_q4_abi(void) { return 5; }

/* 1 when the integer dots use VNNI (vpdpbusd), 0 for maddubs + madd: same integers either way */
#if defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#endif
#ifdef DPBUSD
int swa_q4_vnni(void) { return 1; }
#else
int swa_q4_vnni(void) { return 0; }
#endif

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline int32_t load_i32(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

/* one row of K floats -> Q8_0 codes q [K], fp32 scales d [K / 32] (values of fp16 numbers) and, when
   s is not NULL, 8 x the sum of each block's codes (the -8 offset of the Q4_0 codes, folded in once) */
static void quant_row_q8(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) {
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
        if (s) s[b] = 8 * hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        _mm256_storeu_si256((__m256i*)(q + b * QK), _mm256_permutevar8x32_epi32(i0, perm));
    }
}


/* The 8 rows of one group (outputs n0 .. n0 + valid) for MT activation rows m0 .. m0 + MT: per block,
   8 lanes = 8 rows' exact sum(c * q) (c the 4-bit codes), minus 8 sum(q), then one fma per output.
   MT is a constant at every call site, so the loops over i unroll and the accumulators stay in
   registers; MT <= 2 keeps two integer chains per row for latency (exact sums: same integers). */
static inline __attribute__((always_inline)) void tile(const uint8_t* grp, int64_t nb, const Rows* rows,
                                                       int64_t m0, const int MT, int64_t n0, int valid) {
    const uint8_t* scales = grp + nb * NIB;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#ifndef DPBUSD
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[MAX_TILE];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* nib = grp + b * NIB;
        /* weights stream from DRAM in decode: ask for them PF_BLOCKS blocks ahead (beyond the group's
           end it is the next group's first blocks, which the next tile reads) */
        _mm_prefetch((const char*)(nib + PF_BLOCKS * NIB), _MM_HINT_T0);
        _mm_prefetch((const char*)(nib + PF_BLOCKS * NIB + 64), _MM_HINT_T0);
        if ((b & 3) == 0) _mm_prefetch((const char*)(scales + (b + PF_BLOCKS) * SCB), _MM_HINT_T0);
        __m256i ia[MAX_TILE], ib[MAX_TILE];
        for (int i = 0; i < MT; ++i) ia[i] = ib[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            __m256i p = _mm256_loadu_si256((const __m256i*)(nib + 32 * c));
            __m256i lo = _mm256_and_si256(p, m4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
            for (int i = 0; i < MT; ++i) {
                const int8_t* xb = rows->xq[m0 + i] + b * QK;
                __m256i xl = _mm256_set1_epi32(load_i32(xb + 4 * c));
                __m256i xh = _mm256_set1_epi32(load_i32(xb + 16 + 4 * c));
#ifdef DPBUSD
                if (MT <= 2) {
                    ia[i] = DPBUSD(ia[i], lo, xl);
                    ib[i] = DPBUSD(ib[i], hi, xh);
                } else {
                    ia[i] = DPBUSD(DPBUSD(ia[i], lo, xl), hi, xh);
                }
#else
                /* int16 lanes: 16 products of |c| <= 15, |q| <= 127 each: <= 30480, no overflow */
                ia[i] = _mm256_add_epi16(ia[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                                 _mm256_maddubs_epi16(hi, xh)));
#endif
            }
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + b * SCB)));
        for (int i = 0; i < MT; ++i) {
#ifdef DPBUSD
            __m256i dot = MT <= 2 ? _mm256_add_epi32(ia[i], ib[i]) : ia[i];
#else
            __m256i dot = _mm256_madd_epi16(ia[i], ones);
#endif
            dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(rows->xs[m0 + i][b]));
            __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(rows->xd[m0 + i][b]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[i]);
        }
    }
    for (int i = 0; i < MT; ++i) {
        float* y = rows->y[m0 + i] + n0;
        if (valid == ROWS) {
            _mm256_storeu_ps(y, acc[i]);
        } else {
            float t[ROWS];
            _mm256_storeu_ps(t, acc[i]);
            for (int r = 0; r < valid; ++r) y[r] = t[r];
        }
    }
}

/* One activation row against 4 consecutive full groups (32 outputs from n0), block by block: the
   batch-1 decode case. Four weight streams in flight and an L2 prefetch PF1_BLOCKS blocks ahead of
   each let one core pull ~16 GB/s from DRAM here where a group at a time got ~9 (tools/cpu/gemv_bench.py).
   The same integer dots and the same fma per output and block as `tile`: the same bits. */
static inline void tile1x4(const uint8_t* grp0, int64_t nb, size_t gstride, const Rows* rows, int64_t m,
                           int64_t n0) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#ifndef DPBUSD
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const int8_t* xq = rows->xq[m];
    const float* xd = rows->xd[m];
    const int32_t* xs = rows->xs[m];
    __m256 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xb = xq + b * QK;
        __m256i xl[4], xh[4];
        for (int c = 0; c < 4; ++c) {
            xl[c] = _mm256_set1_epi32(load_i32(xb + 4 * c));
            xh[c] = _mm256_set1_epi32(load_i32(xb + 16 + 4 * c));
        }
        const __m256 sx = _mm256_set1_ps(xd[b]);
        const __m256i sq = _mm256_set1_epi32(xs[b]);
        for (int r = 0; r < 4; ++r) {
            const uint8_t* grp = grp0 + r * gstride;
            const uint8_t* nib = grp + b * NIB;
            _mm_prefetch((const char*)(nib + PF1_BLOCKS * NIB), _MM_HINT_T1);
            _mm_prefetch((const char*)(nib + PF1_BLOCKS * NIB + 64), _MM_HINT_T1);
            __m256i ia = _mm256_setzero_si256(), ib = ia;
            for (int c = 0; c < 4; ++c) {
                __m256i p = _mm256_loadu_si256((const __m256i*)(nib + 32 * c));
                __m256i lo = _mm256_and_si256(p, m4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
#ifdef DPBUSD
                ia = DPBUSD(ia, lo, xl[c]);
                ib = DPBUSD(ib, hi, xh[c]);
#else
                ia = _mm256_add_epi16(ia, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[c]),
                                                           _mm256_maddubs_epi16(hi, xh[c])));
#endif
            }
#ifdef DPBUSD
            __m256i dot = _mm256_add_epi32(ia, ib);
#else
            __m256i dot = _mm256_madd_epi16(ia, ones);
#endif
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(grp + nb * NIB + b * SCB)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, sq)), _mm256_mul_ps(dw, sx),
                                     acc[r]);
        }
    }
    for (int r = 0; r < 4; ++r) _mm256_storeu_ps(rows->y[m] + n0 + ROWS * r, acc[r]);
}

/* outputs of groups [g0, g1) for all M activation rows: tiles of 4 rows, then one tile of the rest
   (a last single row takes 4 full groups at a time) */
static void gemm_groups(const uint8_t* W, int64_t nb, int64_t N, int64_t g0, int64_t g1, int64_t M,
                        const Rows* rows) {
    const size_t gstride = (size_t)nb * GBYTES;
    int64_t m = 0;
#define GROUPS_LOOP(MT)                                                                                \
    for (int64_t g = g0; g < g1; ++g)                                                                  \
        tile(W + g * gstride, nb, rows, m, MT, g * ROWS, (int)(N - g * ROWS < ROWS ? N - g * ROWS : ROWS))
    for (; m + MAX_TILE <= M; m += MAX_TILE) GROUPS_LOOP(4);
    switch (M - m) {
        case 3: GROUPS_LOOP(3); break;
        case 2: GROUPS_LOOP(2); break;
        case 1: {
            for (; g0 + 4 <= g1 && (g0 + 4) * ROWS <= N; g0 += 4)
                tile1x4(W + g0 * gstride, nb, gstride, rows, m, g0 * ROWS);
            GROUPS_LOOP(1);
            break;
        }
        default: break;
    }
#undef GROUPS_LOOP
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
            uint8_t* nib = out + b * NIB;
            uint8_t* sc = out + nb * NIB + b * SCB;
            for (int r = 0; r < ROWS; ++r) {
                int64_t n = g * ROWS + r;
                const uint8_t* s = n < N ? src + ((size_t)n * nb + b) * BQ4 : NULL;
                if (s) memcpy(sc + 2 * r, s, 2); else memset(sc + 2 * r, 0, 2);
                for (int c = 0; c < 4; ++c) {
                    if (s) memcpy(nib + 32 * c + 4 * r, s + 2 + 4 * c, 4);
                    else memset(nib + 32 * c + 4 * r, 0x88, 4);  /* codes 8: value 0 */
                }
            }
        }
    }
}

/* row n, block b of an interleaved weight -> its GGUF block (18 bytes) */
static inline void gguf_block(const uint8_t* W, int64_t nb, int64_t n, int64_t b, uint8_t* o) {
    const uint8_t* grp = W + (size_t)(n / ROWS) * nb * GBYTES;
    int r = (int)(n % ROWS);
    memcpy(o, grp + nb * NIB + b * SCB + 2 * r, 2);
    for (int c = 0; c < 4; ++c) memcpy(o + 2 + 4 * c, grp + b * NIB + 32 * c + 4 * r, 4);
}

/* interleaved -> GGUF rows (the inverse of swa_q4_repack; dst [N, K/32 * 18]) */
void swa_q4_unpack(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t nb = K / QK;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < nb; ++b) gguf_block(src, nb, n, b, dst + ((size_t)n * nb + b) * BQ4);
}

/* rows ids [R] of the interleaved weight, dequantized: out [R, K] fp32 (embedding lookup) */
void swa_q4_rows(const uint8_t* W, int64_t N, int64_t K, const int64_t* ids, int64_t R, float* out) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < R; ++i) {
        float* o = out + i * K;
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t blk[BQ4];
            gguf_block(W, nb, ids[i], b, blk);
            uint16_t h;
            memcpy(&h, blk, 2);
            float d = _cvtsh_ss(h);
            for (int j = 0; j < 16; ++j) {
                o[b * QK + j] = (float)((blk[2 + j] & 0x0F) - 8) * d;
                o[b * QK + j + 16] = (float)((blk[2 + j] >> 4) - 8) * d;
            }
        }
    }
    (void)N;
}

/* x [M, K] fp32 -> Q8_0 codes q [M, K] and scales d [M, K / 32] */
void swa_q8_quant(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; ++m) quant_row_q8(x + m * K, K, q + m * K, d + m * (K / QK), NULL);
}


/* y [M, N] = x [M, K] @ W^T, W interleaved [N, K] */
void swa_q4_mm(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t N, float* y, int nthreads) {
    const int64_t nb = K / QK, G = groups_of(N);
    int8_t* xq = (int8_t*)malloc((size_t)M * K);
    float* xd = (float*)malloc((size_t)M * nb * sizeof(float));
    int32_t* xs = (int32_t*)malloc((size_t)M * nb * sizeof(int32_t));
    const int8_t** xqs = (const int8_t**)malloc(M * sizeof(void*));
    const float** xds = (const float**)malloc(M * sizeof(void*));
    const int32_t** xss = (const int32_t**)malloc(M * sizeof(void*));
    float** ys = (float**)malloc(M * sizeof(void*));
    for (int64_t m = 0; m < M; ++m) {
        xqs[m] = xq + m * K; xds[m] = xd + m * nb; xss[m] = xs + m * nb; ys[m] = y + m * N;
    }
    Rows rows = {xqs, xds, xss, ys};
    const int64_t chunk = GROUP_CHUNK, nchunks = (G + chunk - 1) / chunk;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quant_row_q8(x + m * K, K, xq + m * K, xd + m * nb, xs + m * nb);
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            int64_t g1 = (c + 1) * chunk < G ? (c + 1) * chunk : G;
            gemm_groups(W, nb, N, c * chunk, g1, M, &rows);
        }
    }
    free(xq); free(xd); free(xs); free(xqs); free(xds); free(xss); free(ys);
}

/* native_q4.h's entry points for native_q4_moe.c and native_step.c (the same code, not inlined there) */
void swa_i_quant_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) { quant_row_q8(x, K, q, d, s); }
void swa_i_gemm_groups(const uint8_t* W, int64_t nb, int64_t N, int64_t g0, int64_t g1, int64_t M,
                       const Rows* rows) {
    gemm_groups(W, nb, N, g0, g1, M, rows);
}
