/* Row dot products of native_k.c: one stored GGUF weight row (nb blocks, GGUF byte layout, read in place)
against one quantized activation row. Included by native_k.c only.

Activation rows (made by native_k.c's quantizers):
  "Q8_0" kind (weights with 32-weight blocks): int8 codes q[K], fp32 scales d[K/32] (fp16 values, as
         ggml's Q8_0), int16 code sums s[K/32] (used by the types with an offset: Q4_1, Q5_1).
  "Q8_K" kind (256-weight super-blocks): int8 codes q[K], fp32 scales d[K/256], int16 sums s[K/16].
Integer products are exact (int32); blocks accumulate in fp32 as (weight scale * activation scale) * dot,
and the types with a minimum/offset subtract it through the code sums, so no weight is ever rounded.
Every kernel has an AVX2 body (compiled when __AVX2__ is defined) and a plain C one (the fallback, also
built by the tests to check the AVX2 one).

Stored blocks (GGUF): Q8_0 34 B = d, 32 int8.  Q4_0 18 B = d, 16 nibble bytes (w = d (q - 8)).  Q4_1 20 B = d, m, 16 nibble bytes (w = d q + m).
Q5_0 22 B = d, qh[4], 16 nibble bytes (w = d (q - 16), 5th bit of element j = bit j of qh).
Q5_1 24 B = d, m, qh[4], 16 B.  IQ4_NL 18 B = d, 16 B (w = d LEVEL[q]).  Nibble byte j holds
element j (low) and j + 16 (high).
Q4_K 144 B = d, dmin, 12 B of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 B codes (chunk c of
64 weights: 32 bytes, low nibbles = sub-block 2c, high = 2c + 1); w = d sc q - dmin m.
Q5_K 176 B = Q4_K's header, qh[32] (bit 2c / 2c + 1 of byte l: 5th bit of element l of sub-block 2c /
2c + 1), 128 B codes.  Q6_K 210 B = ql[128], qh[64], int8 scales[16] (per 16 weights), d;
w = d sc (q - 32).  IQ4_XS 136 B = d, scales_h (u16), scales_l[4], 128 B codes: sub-block j of 32 has the
6-bit scale ls (low 4 bits from scales_l, high 2 from scales_h), w = d (ls - 32) LEVEL[q].
*/

static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float fp16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}

/* the (scale, min) pair j of a Q4_K / Q5_K super-block's 12 scale bytes */
static inline void scale_min_k4(const uint8_t* q, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
/* 8 int32 partial sums of a . b for signed int8 a (|a| <= 127) and int8 b, exact */
static inline __m256i dot_s8(__m256i a, __m256i b) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
/* same for unsigned codes a (0..63) */
static inline __m256i dot_u8(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
/* 32 nibble codes of 16 bytes: low nibbles (elements 0..15) then high (16..31) */
static inline __m256i nibbles32(const uint8_t* qs) {
    __m128i t = _mm_loadu_si128((const __m128i*)qs);
    __m256i v = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
/* the 32 fifth bits of Q5_0 / Q5_1 (bit j of the little-endian u32 -> byte j), as 0 or 16 */
static inline __m256i q5_high(const uint8_t* qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}
#endif

/* ---- 32-weight blocks x Q8_0 activations ---- */

static float dot_q8_0(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
    (void)s;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, w += 34) {
        __m256i p = dot_s8(_mm256_loadu_si256((const __m256i*)(w + 2)), _mm256_loadu_si256((const __m256i*)(q + 32 * b)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16(w) * d[b]), acc);
    }
    return hsum256(acc);
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b, w += 34) {
        int32_t t = 0;
        for (int j = 0; j < 32; ++j) t += (int8_t)w[2 + j] * q[32 * b + j];
        acc += fp16(w) * d[b] * (float)t;
    }
    return acc;
#endif
}

/* the shared body of Q4_1 / Q5_0 / Q5_1 / IQ4_NL: codes of block b, then d * dx * dot (+ m * dx * sum x) */
#define LEGACY_DOT(NAME, BYTES, HAS_M, CODES_AVX, CODE_C)                                              \
static float NAME(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {  \
    float accm = 0.f;                                                                                  \
    LEGACY_BODY(BYTES, HAS_M, CODES_AVX, CODE_C)                                                       \
}
#ifdef __AVX2__
#define LEGACY_BODY(BYTES, HAS_M, CODES_AVX, CODE_C)                                                   \
    __m256 acc = _mm256_setzero_ps();                                                                  \
    for (int64_t b = 0; b < nb; ++b, w += BYTES) {                                                     \
        __m256i c = CODES_AVX;                                                                         \
        __m256i x = _mm256_loadu_si256((const __m256i*)(q + 32 * b));                                 \
        __m256i p = HAS_M ? dot_u8(c, x) : dot_s8(c, x);                                               \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16(w) * d[b]), acc);             \
        if (HAS_M) accm += fp16(w + 2) * d[b] * (float)s[b];                                          \
    }                                                                                                  \
    return hsum256(acc) + accm;
#else
#define LEGACY_BODY(BYTES, HAS_M, CODES_AVX, CODE_C)                                                   \
    float acc = 0.f;                                                                                   \
    for (int64_t b = 0; b < nb; ++b, w += BYTES) {                                                     \
        int32_t t = 0;                                                                                 \
        for (int j = 0; j < 32; ++j) t += (CODE_C) * q[32 * b + j];                                   \
        acc += fp16(w) * d[b] * (float)t;                                                              \
        if (HAS_M) accm += fp16(w + 2) * d[b] * (float)s[b];                                          \
    }                                                                                                  \
    return acc + accm;
#endif
/* scalar code of element j of the block at w (Q4_1: qs at 4; Q5_*: qh at QH, qs at QS) */
#define NIB(QS) ((j < 16 ? w[(QS) + j] : w[(QS) + j - 16] >> 4) & 15)
static inline int q5bit(const uint8_t* qh, int j) { return ((qh[j >> 3] >> (j & 7)) & 1) << 4; }
#ifdef __AVX2__
static inline __m256i iq4_levels(const uint8_t* qs) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_LEVELS));
    return _mm256_shuffle_epi8(lut, nibbles32(qs));
}
#endif
LEGACY_DOT(dot_q4_0, 18, 0, _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8)), NIB(2) - 8)
LEGACY_DOT(dot_q4_1, 20, 1, nibbles32(w + 4), NIB(4))
LEGACY_DOT(dot_q5_0, 22, 0, _mm256_sub_epi8(_mm256_or_si256(nibbles32(w + 6), q5_high(w + 2)), _mm256_set1_epi8(16)),
           (int)(NIB(6) | q5bit(w + 2, j)) - 16)
LEGACY_DOT(dot_q5_1, 24, 1, _mm256_or_si256(nibbles32(w + 8), q5_high(w + 4)), (int)(NIB(8) | q5bit(w + 4, j)))
LEGACY_DOT(dot_iq4_nl, 18, 0, iq4_levels(w + 2), IQ4_LEVELS[NIB(2)])

/* ---- 256-weight super-blocks x Q8_K activations ---- */

/* Q4_K (HI = 0) and Q5_K (HI = 1): d * sum_j sc_j (q . x)_j - dmin * sum_j m_j (sum x)_j, times dx */
static inline float dot_q45_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb,
                              int hi) {
    const int bytes = hi ? 176 : 144;
    float accm = 0.f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t i = 0; i < nb; ++i, w += bytes) {
        const uint8_t* qs = w + (hi ? 48 : 16);
        const uint8_t* qh = w + 16;
        const int8_t* x = q + 256 * i;
        int sc[8], mn[8], summ = 0;
        for (int j = 0; j < 8; ++j) {
            scale_min_k4(w + 4, j, &sc[j], &mn[j]);
            summ += mn[j] * (s[16 * i + 2 * j] + s[16 * i + 2 * j + 1]);
        }
        accm += fp16(w + 2) * d[i] * (float)summ;
#ifdef __AVX2__
        __m256i sumi = _mm256_setzero_si256();
        const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        __m256i hb = hi ? _mm256_loadu_si256((const __m256i*)qh) : _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(v, m4), up = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (hi) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                up = _mm256_or_si256(up, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
                hb = _mm256_srli_epi16(hb, 2);
            }
            __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(x + 64 * c)));
            __m256i pu = _mm256_maddubs_epi16(up, _mm256_loadu_si256((const __m256i*)(x + 64 * c + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pl, _mm256_set1_epi16((short)sc[2 * c])));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pu, _mm256_set1_epi16((short)sc[2 * c + 1])));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(fp16(w) * d[i]), acc);
#else
        int32_t sumi = 0;
        for (int c = 0; c < 4; ++c)
            for (int h = 0; h < 2; ++h) {
                int32_t t = 0;
                for (int l = 0; l < 32; ++l) {
                    int code = (h ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15);
                    if (hi) code |= ((qh[l] >> (2 * c + h)) & 1) << 4;
                    t += code * x[64 * c + 32 * h + l];
                }
                sumi += sc[2 * c + h] * t;
            }
        acc += fp16(w) * d[i] * (float)sumi;
#endif
    }
#ifdef __AVX2__
    return hsum256(acc) - accm;
#else
    return acc - accm;
#endif
}
static float dot_q4_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
    return dot_q45_k(w, q, d, s, nb, 0);
}
static float dot_q5_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
    return dot_q45_k(w, q, d, s, nb, 1);
}

/* Q6_K: d * dx * (sum_g sc_g (q . x)_g - 32 sum_g sc_g (sum x)_g) over the 16 groups of 16 */
static float dot_q6_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.f;
#endif
    for (int64_t i = 0; i < nb; ++i, w += 210) {
        const int8_t* sc = (const int8_t*)(w + 192);
        const int8_t* x = q + 256 * i;
        int32_t off = 0;
        for (int g = 0; g < 16; ++g) off += sc[g] * s[16 * i + g];
#ifdef __AVX2__
        __m256i sumi = _mm256_setzero_si256();
        const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = w + 64 * h;
            __m256i l0 = _mm256_loadu_si256((const __m256i*)ql), l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * h));
            __m256i c[4];
            c[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            c[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            for (int k = 0; k < 4; ++k) {
                const int g = 8 * h + 2 * k;
                __m256i p = _mm256_maddubs_epi16(c[k], _mm256_loadu_si256((const __m256i*)(x + 128 * h + 32 * k)));
                __m256i scv = _mm256_setr_m128i(_mm_set1_epi16(sc[g]), _mm_set1_epi16(sc[g + 1]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scv));
            }
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(fp16(w + 208) * d[i]), acc);
#else
        int32_t sumi = 0;
        for (int h = 0; h < 2; ++h)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < 32; ++l) {
                    const uint8_t lq = w[64 * h + l + (k & 1) * 32], hq = w[128 + 32 * h + l];
                    int code = ((k < 2 ? lq : lq >> 4) & 15) | (((hq >> (2 * k)) & 3) << 4);
                    sumi += sc[8 * h + 2 * k + l / 16] * code * x[128 * h + 32 * k + l];
                }
        acc += fp16(w + 208) * d[i] * (float)(sumi - 32 * off);
#endif
    }
#ifdef __AVX2__
    return hsum256(acc);
#else
    return acc;
#endif
}

/* IQ4_XS: per sub-block j of 32, d (ls_j - 32) * (LEVEL[q] . x)_j, times dx */
static inline float dot_iq4_xs(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
    (void)s;
    float acc = 0.f;
    for (int64_t i = 0; i < nb; ++i, w += 136) {
        const int8_t* x = q + 256 * i;
        uint16_t sh;
        memcpy(&sh, w + 2, 2);
        int32_t sumi = 0;
        for (int j = 0; j < 8; ++j) {
            const int ls = ((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            const uint8_t* qs = w + 8 + 16 * j;
#ifdef __AVX2__
            __m256i p = dot_s8(iq4_levels(qs), _mm256_loadu_si256((const __m256i*)(x + 32 * j)));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
            t = _mm_hadd_epi32(t, t);
            t = _mm_hadd_epi32(t, t);
            const int32_t dot = _mm_cvtsi128_si32(t);
#else
            int32_t dot = 0;
            for (int l = 0; l < 16; ++l)
                dot += IQ4_LEVELS[qs[l] & 15] * x[32 * j + l] + IQ4_LEVELS[qs[l] >> 4] * x[32 * j + l + 16];
#endif
            sumi += (ls - 32) * dot;
        }
        acc += fp16(w) * d[i] * (float)sumi;
    }
    return acc;
}


/* Q2_K 84 B = scales[16] (low nibble: scale, high: minimum, per 16 weights), qs[64] (2-bit codes), d, dmin;
   Q3_K 110 B = hmask[32] (3rd bit), qs[64], 12 B of 6-bit scales (stored + 32), d. Group g = 8h + 2j + t
   of 16 weights (half h, shift 2j, t = first / second 16 of the 32 code bytes qs[32h ..]) has scale g;
   Q3_K's 3rd bit of weight l of the group is bit 4h + j of hmask[16t + l] (set: code, clear: code - 4).
   Plain C in both builds (gcc vectorizes the inner loops); no multi-row form. */
static inline void q3_scales(const uint8_t* p, int* sc) {
    for (int g = 0; g < 16; ++g) {
        const int low = g < 8 ? p[g] & 15 : p[g - 8] >> 4;
        const int high = (p[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
        sc[g] = (low | (high << 4)) - 32;
    }
}
static float dot_q23_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb, int three) {
    float acc = 0.f, accm = 0.f;
    for (int64_t i = 0; i < nb; ++i, w += three ? 110 : 84) {
        const uint8_t* qs = w + (three ? 32 : 16);
        const int8_t* x = q + 256 * i;
        int sc[16], summ = 0;
        int32_t sumi = 0;
        if (three) q3_scales(w + 96, sc);
        for (int g = 0; g < 16; ++g) {
            const int h = g >> 3, j = (g >> 1) & 3, t = g & 1;
            const uint8_t* c = qs + 32 * h + 16 * t;
            int32_t dot = 0;
            if (three) {
                const uint8_t* hm = w + 16 * t;
                for (int l = 0; l < 16; ++l)
                    dot += (((c[l] >> (2 * j)) & 3) - (((hm[l] >> (4 * h + j)) & 1) ? 0 : 4)) * x[16 * g + l];
                sumi += sc[g] * dot;
            } else {
                for (int l = 0; l < 16; ++l) dot += ((c[l] >> (2 * j)) & 3) * x[16 * g + l];
                sumi += (w[g] & 15) * dot;
                summ += (w[g] >> 4) * s[16 * i + g];
            }
        }
        acc += fp16(w + (three ? 108 : 80)) * d[i] * (float)sumi;
        if (!three) accm += fp16(w + 82) * d[i] * (float)summ;
    }
    return acc - accm;
}
static inline float dot_q2_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
    return dot_q23_k(w, q, d, s, nb, 0);
}
static inline float dot_q3_k(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {
    return dot_q23_k(w, q, d, s, nb, 1);
}
