/* CPU glue kernels of the decoder layer (AVX2 + FMA, OpenMP), built into the same library as
native_q4.c and called through engine/quant/native.py: fp32 RMS norms (optionally added into the
residual stream), the per-head q/k norm + NeoX rope in place, the layer tail after the two FFN branches,
decode attention straight from the paged KV pool (no gathered copy; fp32 / fp16 / bf16 / q8_0 K and V)
the prefill's gather + dequantize of pool rows and the q8_0 write of new K/V rows. Each replaces 5-20 small torch
ops per call. Numerics are fp32 like the torch code they replace; sums run in a different order (8
lanes, then the lanes), so results differ from it in the last bits: models/gemma4.py uses them on the
native CPU path only (which already quantizes activations), the exact path keeps the torch ops.
*/
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_avx.h"

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* sum of x[i] * y[i], i < n (n a multiple of 8) */
static inline float dot8(const float* x, const float* y, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
    }
    for (; i < n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
    return hsum8(_mm256_add_ps(a0, a1));
}

/* 1 / sqrt(mean(x^2) + eps) of one row (n a multiple of 8) */
static inline float rms_inv(const float* x, int64_t n, float eps) {
    return 1.f / sqrtf(dot8(x, x, n) / (float)n + eps);
}

/* y = x * r * w (w NULL: no weight), elementwise; y may be x */
static inline void scale_row(const float* x, float r, const float* w, float* y, int64_t n) {
    __m256 rv = _mm256_set1_ps(r);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
        if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(y + i, v);
    }
}

/* x [M, N] -> out = rms_norm(x) * w (out may be x); with res != NULL, res += that instead (out unused) */
void swa_rms_norm(const float* x, int64_t M, int64_t N, const float* w, float eps, float* out, float* res) {
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * N;
        float r = rms_inv(xr, N, eps);
        __m256 rv = _mm256_set1_ps(r);
        if (res == NULL) {
            scale_row(xr, r, w, out + m * N, N);
            continue;
        }
        float* hr = res + m * N;
        for (int64_t i = 0; i < N; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), rv);
            if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
            _mm256_storeu_ps(hr + i, _mm256_add_ps(_mm256_loadu_ps(hr + i), v));
        }
    }
}

/* In place on x [T, nh, D]: per head rms_norm(x) * w (w NULL: none), then NeoX rope on the pairs
   (i, half + i), i < n, with cos/sin [T, n] (n = 0: no rope). */
void swa_norm_rope(float* x, int64_t T, int64_t nh, int64_t D, const float* w, float eps,
                   const float* cos_t, const float* sin_t, int64_t n, int64_t half) {
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos_t + t * n;
        const float* s = sin_t + t * n;
        for (int64_t h = 0; h < nh; ++h) {
            float* xr = x + (t * nh + h) * D;
            scale_row(xr, rms_inv(xr, D, eps), w, xr, D);
            for (int64_t i = 0; i < n; ++i) {
                float x1 = xr[i], x2 = xr[half + i];
                xr[i] = x1 * c[i] - x2 * s[i];
                xr[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* The layer tail: h = (h + norm(norm(m1, w1) + norm(m2, w2), w)) * scalar, rows of N; m1, m2 are
   overwritten (scratch). */
void swa_ffn_tail(float* m1, float* m2, const float* w1, const float* w2, const float* w, float eps,
                  float scalar, float* h, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; ++m) {
        float *a = m1 + m * N, *b = m2 + m * N, *hr = h + m * N;
        scale_row(a, rms_inv(a, N, eps), w1, a, N);
        scale_row(b, rms_inv(b, N, eps), w2, b, N);
        for (int64_t i = 0; i < N; i += 8)
            _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        float r = rms_inv(a, N, eps);
        __m256 rv = _mm256_set1_ps(r), sv = _mm256_set1_ps(scalar);
        for (int64_t i = 0; i < N; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(a + i), rv), _mm256_loadu_ps(w + i));
            _mm256_storeu_ps(hr + i, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(hr + i), v), sv));
        }
    }
}

/* 8 values at value offset i (a multiple of 8) of one head row of the KV pool, stored as kt: 0 fp32,
   1 fp16, 2 bf16, 3 q8_0 (llama.cpp's block_q8_0: an fp16 scale d, then 32 int8 q; value = d * q, exact
   in fp32) */
static inline __m256 load_kv(const uint8_t* row, int64_t i, int kt) {
    if (kt == 0) return _mm256_loadu_ps((const float*)row + i);
    if (kt == 3) {
        const uint8_t* blk = row + (i >> 5) * 34;
        uint16_t h;
        memcpy(&h, blk, 2);
        __m128i q = _mm_loadl_epi64((const __m128i*)(blk + 2 + (i & 31)));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + i));
    if (kt == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* bytes of one head row of D values stored as kt */
static inline int64_t kv_row_bytes(int kt, int64_t D) {
    return kt == 0 ? 4 * D : kt == 3 ? D / 32 * 34 : 2 * D;
}

/* p[0 .. n) = softmax(p[0 .. n)) in place */
static void softmax_row(float* p, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t s = 0; s < n; ++s) mx = p[s] > mx ? p[s] : mx;
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), m));
        _mm256_storeu_ps(p + s, e);
        acc = _mm256_add_ps(acc, e);
    }
    for (; s < n; ++s) { p[s] = expf(p[s] - mx); sum += p[s]; }
    const float inv = 1.f / (sum + hsum8(acc));
    for (s = 0; s < n; ++s) p[s] *= inv;
}

#define PF_KEYS 8  /* K and V rows prefetched this many keys ahead */
#define V_KEYS 16  /* keys per block of the weighted sum */
#define CONVERT_ONCE 4  /* query heads per KV head from which a K / V row is converted to fp32 once (into a
                           per-thread buffer) rather than read from the pool by each head */

/* Decode attention (one query token per sequence, scale 1): for decode row b (token row rows[b] of q
   and out, both [*, H, D] fp32) and query head j (KV head j / (H / KVH)): softmax over the keys at slots
   slots[b, 0 .. counts[b]) of q . K[slot], times V[slot]. K and V are the pool's strided views: the head
   row (slot, kv head) starts at byte slot * k_rs + kv_head * k_hs (V: v_rs, v_hs), stored as kt / vt
   (load_kv's types; read as fp32). Work items (b, kv head) run in parallel. Scores take 4 keys at a time
   (4 independent accumulator chains); the weighted sum keeps 64 output floats in registers over a block
   of V_KEYS keys. */
void swa_decode_attn(const float* q, const int64_t* rows, int64_t B, int64_t H, int64_t KVH, int64_t D,
                     const void* K, int64_t k_rs, int64_t k_hs, int kt, const void* V, int64_t v_rs,
                     int64_t v_hs, int vt, const int64_t* slots, int64_t S, const int64_t* counts, float* out,
                     int nthreads) {
    const int64_t G = H / KVH, k_row = kv_row_bytes(kt, D), v_row = kv_row_bytes(vt, D);
    const uint8_t *Kb = (const uint8_t*)K, *Vb = (const uint8_t*)V;
    #pragma omp parallel num_threads(nthreads) if (B * KVH > 1)
    {
        float* p = (float*)malloc((size_t)G * S * sizeof(float));
        /* with G >= CONVERT_ONCE each K / V row is converted to fp32 once for the G query heads of its KV
           head (load_kv's values: the same sums in the same order as reading the pool G times) */
        float* kf = (float*)malloc((size_t)4 * D * sizeof(float));
        float* vf = (float*)malloc((size_t)V_KEYS * D * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < B * KVH; ++it) {
            const int64_t b = it / KVH, kh = it % KVH, n = counts[b];
            const int64_t* sl = slots + b * S;
            const uint8_t *kb = Kb + kh * k_hs, *vb = Vb + kh * v_hs;
            const float* qb = q + (rows[b] * H + kh * G) * D;
            float* ob = out + (rows[b] * H + kh * G) * D;
            for (int64_t s = 0; s < n; s += 4) {
                const uint8_t* kr[4];
                int kl = kt;  /* how the score loop reads kr: the pool's type, or fp32 rows in kf */
                for (int j = 0; j < 4; ++j) kr[j] = kb + sl[s + j < n ? s + j : s] * k_rs;
                if (kt != 0 && G >= CONVERT_ONCE) {
                    for (int j = 0; j < 4; ++j) {
                        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kf + j * D + d, load_kv(kr[j], d, kt));
                        kr[j] = (const uint8_t*)(kf + j * D);
                    }
                    kl = 0;
                }
                for (int64_t j = s + PF_KEYS; j < s + PF_KEYS + 4 && j < n; ++j) {  /* rows are scattered */
                    for (int64_t off = 0; off < k_row; off += 64)
                        _mm_prefetch((const char*)(kb + sl[j] * k_rs + off), _MM_HINT_T0);
                    for (int64_t off = 0; off < v_row; off += 64)
                        _mm_prefetch((const char*)(vb + sl[j] * v_rs + off), _MM_HINT_T0);
                }
                for (int64_t g = 0; g < G; ++g) {
                    const float* qg = qb + g * D;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int64_t d = 0; d < D; d += 8) {
                        __m256 qv = _mm256_loadu_ps(qg + d);
                        a0 = _mm256_fmadd_ps(qv, load_kv(kr[0], d, kl), a0);
                        a1 = _mm256_fmadd_ps(qv, load_kv(kr[1], d, kl), a1);
                        a2 = _mm256_fmadd_ps(qv, load_kv(kr[2], d, kl), a2);
                        a3 = _mm256_fmadd_ps(qv, load_kv(kr[3], d, kl), a3);
                    }
                    float sc[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
                    for (int j = 0; j < 4 && s + j < n; ++j) p[g * n + s + j] = sc[j];
                }
            }
            for (int64_t g = 0; g < G; ++g) softmax_row(p + g * n, n);
            /* out = sum_s p[s] V[s], keys in blocks of V_KEYS: each output float is still one fma per key in
               key order (its partial sum waits in `out` between blocks) */
            memset(ob, 0, (size_t)G * D * sizeof(float));
            for (int64_t s0 = 0; s0 < n; s0 += V_KEYS) {
                const int64_t m = n - s0 < V_KEYS ? n - s0 : V_KEYS;
                const uint8_t* vr[V_KEYS];
                int vl = vt;
                for (int64_t j = 0; j < m; ++j) vr[j] = vb + sl[s0 + j] * v_rs;
                if (vt != 0 && G >= CONVERT_ONCE) {
                    for (int64_t j = 0; j < m; ++j) {
                        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vf + j * D + d, load_kv(vr[j], d, vt));
                        vr[j] = (const uint8_t*)(vf + j * D);
                    }
                    vl = 0;
                }
                for (int64_t g = 0; g < G; ++g) {
                    const float* pg = p + g * n + s0;
                    float* o = ob + g * D;
                    int64_t d0 = 0;
                    for (; d0 + 64 <= D; d0 += 64) {
                        __m256 acc[8];
                        for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_ps(o + d0 + 8 * r);
                        for (int64_t j = 0; j < m; ++j) {
                            __m256 pv = _mm256_set1_ps(pg[j]);
                            for (int r = 0; r < 8; ++r)
                                acc[r] = _mm256_fmadd_ps(pv, load_kv(vr[j], d0 + 8 * r, vl), acc[r]);
                        }
                        for (int r = 0; r < 8; ++r) _mm256_storeu_ps(o + d0 + 8 * r, acc[r]);
                    }
                    for (; d0 < D; d0 += 8) {
                        __m256 acc = _mm256_loadu_ps(o + d0);
                        for (int64_t j = 0; j < m; ++j)
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(pg[j]), load_kv(vr[j], d0, vl), acc);
                        _mm256_storeu_ps(o + d0, acc);
                    }
                }
            }
        }
        free(p);
        free(kf);
        free(vf);
    }
}

/* out [n, KVH, D] fp32 = the values of the pool rows at slots[0 .. n) (head row (slot, kv head) at byte
   slot * rs + kv_head * hs, stored as kt): the prefill's gather and dequantize in one pass. */
void swa_kv_gather(const void* src, int64_t rs, int64_t hs, int kt, const int64_t* slots, int64_t n,
                   int64_t KVH, int64_t D, float* out, int nthreads) {
    const uint8_t* base = (const uint8_t*)src;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * KVH * D > 32768)
    for (int64_t it = 0; it < n * KVH; ++it) {
        const uint8_t* row = base + slots[it / KVH] * rs + (it % KVH) * hs;
        float* o = out + it * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, load_kv(row, d, kt));
    }
}

/* The pool rows at slots[0 .. T) = q8_0 blocks of x [T, KVH, D] fp32 (head row (slot, kv head) at byte
   slot * rs + kv_head * hs): llama.cpp's reference quantizer (quantize_row_q8_0_ref), bit-exact with
   engine/quant/kv_quant.py quantize_q8_0: d = amax / 127, q = roundf(x * (1 / d)), d stored as fp16
   (round to nearest even). The decode step's K/V write, one call instead of ~12 torch ops per side. */
void swa_kv_store_q8(const float* x, int64_t T, int64_t KVH, int64_t D, uint8_t* dst, int64_t rs, int64_t hs,
                     const int64_t* slots, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * KVH * D > 65536)
    for (int64_t it = 0; it < T * KVH; ++it) {
        const float* src = x + it * D;
        uint8_t* row = dst + slots[it / KVH] * rs + (it % KVH) * hs;
        for (int64_t b = 0; b < D / 32; ++b) {
            const float* xb = src + b * 32;
            uint8_t* blk = row + b * 34;
            float amax = 0.f;
            for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.f;
            const float inv = d != 0.f ? 1.f / d : 0.f;
            const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
            memcpy(blk, &h, 2);
            for (int j = 0; j < 32; ++j) blk[2 + j] = (uint8_t)(int8_t)roundf(xb[j] * inv);
        }
    }
}

/* The MoE router of T rows: t = rms_norm(x) * rw; p = softmax(W t) over E experts; the k largest p
   (first index on ties), renormalised to sum 1, times pes[expert] -> ids [T, k] int64, wts [T, k]. */
void swa_router(const float* x, int64_t T, int64_t H, const float* rw, float eps, const float* W, int64_t E,
                int64_t k, const float* pes, int64_t* ids, float* wts) {
    float* t = (float*)malloc((size_t)H * sizeof(float));
    float* p = (float*)malloc((size_t)E * sizeof(float));
    for (int64_t r = 0; r < T; ++r) {
        scale_row(x + r * H, rms_inv(x + r * H, H, eps), rw, t, H);
        float mx = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; ++e) { p[e] = dot8(W + e * H, t, H); mx = p[e] > mx ? p[e] : mx; }
        for (int64_t e = 0; e < E; ++e) { p[e] = expf(p[e] - mx); sum += p[e]; }
        int64_t* id = ids + r * k;
        float* w = wts + r * k;
        float top = 0.f;
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
            id[j] = best;
            w[j] = p[best] / sum;
            top += w[j];
            p[best] = -1.f;  /* taken */
        }
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / top * pes[id[j]];
    }
    free(t); free(p);
}
