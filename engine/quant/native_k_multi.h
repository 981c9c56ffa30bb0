/* Multi-row dot products of native_k.c (included after native_k_dots.h, whose helpers they use). */

/* ---- several activation rows per weight row (AVX2): each weight block is unpacked once for up to
   MULTI rows. Same arithmetic as the one-row functions above (the tests compare both to float64). ---- */
#define MULTI 4
#ifdef __AVX2__
/* 32-weight types: codes of block b once, then each row's d_w * d_x * dot (+ m * d_x * sum x) */
#define LEGACY_MULTI(NAME, BYTES, HAS_M, CODES_AVX)                                                     \
static void NAME(const uint8_t* w, int64_t nb, const int8_t* const* q, const float* const* d,          \
                 const int16_t* const* s, int mt, float* out) {                                         \
    __m256 acc[MULTI];                                                                                  \
    float accm[MULTI] = {0.f, 0.f, 0.f, 0.f};                                                           \
    for (int r = 0; r < mt; ++r) acc[r] = _mm256_setzero_ps();                                          \
    for (int64_t b = 0; b < nb; ++b, w += BYTES) {                                                      \
        const __m256i c = CODES_AVX;                                                                    \
        const __m256i ac = HAS_M ? c : _mm256_sign_epi8(c, c);                                          \
        const float dw = fp16(w), mw = HAS_M ? fp16(w + 2) : 0.f;                                       \
        for (int r = 0; r < mt; ++r) {                                                                  \
            __m256i x = _mm256_loadu_si256((const __m256i*)(q[r] + 32 * b));                          \
            if (!HAS_M) x = _mm256_sign_epi8(x, c);                                                     \
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, x), _mm256_set1_epi16(1));           \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * d[r][b]), acc[r]);      \
            if (HAS_M) accm[r] += mw * d[r][b] * (float)s[r][b];                                        \
        }                                                                                               \
    }                                                                                                   \
    for (int r = 0; r < mt; ++r) out[r] = hsum256(acc[r]) + accm[r];                                    \
}
LEGACY_MULTI(multi_q8_0, 34, 0, _mm256_loadu_si256((const __m256i*)(w + 2)))
LEGACY_MULTI(multi_q4_0, 18, 0, _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8)))
LEGACY_MULTI(multi_q4_1, 20, 1, nibbles32(w + 4))
LEGACY_MULTI(multi_q5_0, 22, 0, _mm256_sub_epi8(_mm256_or_si256(nibbles32(w + 6), q5_high(w + 2)), _mm256_set1_epi8(16)))
LEGACY_MULTI(multi_q5_1, 24, 1, _mm256_or_si256(nibbles32(w + 8), q5_high(w + 4)))
LEGACY_MULTI(multi_iq4_nl, 18, 0, iq4_levels(w + 2))

/* Q4_K (kind 0), Q5_K (1), Q6_K (2), Q2_K (3), Q3_K (4): a super-block becomes 8 vectors of 32 unsigned codes (code k holds
   weights 32k .. 32k + 31) and 8 int16 scale vectors (per 32, or per 16 for Q6_K: low lanes = first 16);
   then per row sum_k madd(maddubs(code_k, x_k), scale_k), and the minimum / offset term from the sums */
static void multi_k(int kind, const uint8_t* w, int64_t nb, const int8_t* const* q, const float* const* d,
                    const int16_t* const* s, int mt, float* out) {
    static const int BYTES[5] = {144, 176, 210, 84, 110};
    const int bytes = BYTES[kind];
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256 acc[MULTI];
    float accm[MULTI] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < mt; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, w += bytes) {
        __m256i c[8], scv[8];
        int mn[16] = {0}, sc6[16] = {0};
        float dw, dmin = 0.f;
        if (kind < 2) {
            const uint8_t* qs = w + (kind ? 48 : 16);
            __m256i hb = kind ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * k));
                c[2 * k] = _mm256_and_si256(v, m4);
                c[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (kind) {
                    c[2 * k] = _mm256_or_si256(c[2 * k], _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                    c[2 * k + 1] = _mm256_or_si256(
                        c[2 * k + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
                    hb = _mm256_srli_epi16(hb, 2);
                }
            }
            for (int j = 0; j < 8; ++j) {
                int sc;
                scale_min_k4(w + 4, j, &sc, &mn[j]);
                scv[j] = _mm256_set1_epi16((short)sc);
            }
            dw = fp16(w);
            dmin = fp16(w + 2);
        } else if (kind >= 3) {  /* Q2_K / Q3_K: code k = 2-bit field j of the 32 bytes of half h */
            const __m256i hm = _mm256_loadu_si256((const __m256i*)w);
            if (kind == 4) q3_scales(w + 96, sc6);
            for (int k = 0; k < 8; ++k) {
                const int h = k >> 2, j = k & 3;
                __m256i v = _mm256_loadu_si256((const __m256i*)(w + (kind == 3 ? 16 : 32) + 32 * h));
                c[k] = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * j)), m3);
                if (kind == 4) {  /* the 3rd bit: code + 4 (the -4 offset goes through the sums) */
                    __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(4 * h + j)), one);
                    c[k] = _mm256_or_si256(c[k], _mm256_slli_epi16(hb, 2));
                }
                const int s0 = kind == 3 ? w[2 * k] & 15 : sc6[2 * k], s1 = kind == 3 ? w[2 * k + 1] & 15 : sc6[2 * k + 1];
                scv[k] = _mm256_setr_m128i(_mm_set1_epi16((short)s0), _mm_set1_epi16((short)s1));
            }
            if (kind == 3)
                for (int g = 0; g < 16; ++g) mn[g] = w[g] >> 4;
            dw = fp16(w + (kind == 3 ? 80 : 108));
            dmin = kind == 3 ? fp16(w + 82) : 0.f;
        } else {
            const int8_t* sc = (const int8_t*)(w + 192);
            for (int h = 0; h < 2; ++h) {
                const uint8_t* ql = w + 64 * h;
                __m256i l0 = _mm256_loadu_si256((const __m256i*)ql), l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * h));
                c[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
                c[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
                c[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
                c[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            }
            for (int k = 0; k < 8; ++k) scv[k] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * k]), _mm_set1_epi16(sc[2 * k + 1]));
            for (int g = 0; g < 16; ++g) sc6[g] = sc[g];
            dw = fp16(w + 208);
        }
        for (int r = 0; r < mt; ++r) {
            const int8_t* x = q[r] + 256 * i;
            const int16_t* sr = s[r] + 16 * i;
            __m256i sumi = _mm256_setzero_si256();
            for (int k = 0; k < 8; ++k)
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(c[k], _mm256_loadu_si256((const __m256i*)(x + 32 * k))), scv[k]));
            int32_t extra = 0;
            if (kind < 2) {
                for (int j = 0; j < 8; ++j) extra += mn[j] * (sr[2 * j] + sr[2 * j + 1]);
                accm[r] += dmin * d[r][i] * (float)extra;
            } else if (kind == 3) {
                for (int g = 0; g < 16; ++g) extra += mn[g] * sr[g];
                accm[r] += dmin * d[r][i] * (float)extra;
            } else {
                for (int g = 0; g < 16; ++g) extra += sc6[g] * sr[g];
                sumi = _mm256_sub_epi32(sumi, _mm256_setr_epi32((kind == 2 ? 32 : 4) * extra, 0, 0, 0, 0, 0, 0, 0));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(dw * d[r][i]), acc[r]);
        }
    }
    for (int r = 0; r < mt; ++r) out[r] = hsum256(acc[r]) - accm[r];
}
#define K_MULTI(NAME, KIND)                                                                             \
static void NAME(const uint8_t* w, int64_t nb, const int8_t* const* q, const float* const* d,          \
                 const int16_t* const* s, int mt, float* out) { multi_k(KIND, w, nb, q, d, s, mt, out); }
K_MULTI(multi_q4_k, 0)
K_MULTI(multi_q5_k, 1)
K_MULTI(multi_q6_k, 2)
K_MULTI(multi_q2_k, 3)
K_MULTI(multi_q3_k, 4)
/* one row through the multi-row body (Q2_K / Q3_K have no separate AVX2 one-row function) */
#define K_ONE(NAME, MULTI_FN)                                                                           \
static float NAME(const uint8_t* w, const int8_t* q, const float* d, const int16_t* s, int64_t nb) {  \
    float o;                                                                                            \
    MULTI_FN(w, nb, &q, &d, &s, 1, &o);                                                                 \
    return o;                                                                                           \
}
K_ONE(one_q2_k, multi_q2_k)
K_ONE(one_q3_k, multi_q3_k)

/* IQ4_XS: 8 vectors of 32 signed levels and the 8 sub-block scales (ls - 32) once, then per row
   sum_k madd(maddubs(|level_k|, x_k * sign(level_k)), scale_k) (|level| <= 127: no saturation) */
static void multi_iq4_xs(const uint8_t* w, int64_t nb, const int8_t* const* q, const float* const* d,
                         const int16_t* const* s, int mt, float* out) {
    (void)s;
    __m256 acc[MULTI];
    for (int r = 0; r < mt; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, w += 136) {
        __m256i c[8], ac[8], scv[8];
        uint16_t sh;
        memcpy(&sh, w + 2, 2);
        for (int j = 0; j < 8; ++j) {
            const int ls = ((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            c[j] = iq4_levels(w + 8 + 16 * j);
            ac[j] = _mm256_sign_epi8(c[j], c[j]);
            scv[j] = _mm256_set1_epi16((short)(ls - 32));
        }
        const float dw = fp16(w);
        for (int r = 0; r < mt; ++r) {
            const int8_t* x = q[r] + 256 * i;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x + 32 * j)), c[j]);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(ac[j], xs), scv[j]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(dw * d[r][i]), acc[r]);
        }
    }
    for (int r = 0; r < mt; ++r) out[r] = hsum256(acc[r]);
}
K_ONE(one_iq4_xs, multi_iq4_xs)
#endif
