/* Integer-dot quantized linears for x86-64 (AVX2 baseline; AVX-512 VNNI / AVX-VNNI when the variant
 * is compiled with them): y = x @ W^T + bias where the activations are quantized on the fly to int8
 * in blocks of QB = 32 columns, so each 32-column block of a weight row is one u8 x s8 dot product
 * with int32 accumulation (llama.cpp's scheme for its Q8_0 / Q4_0 dot products, ggml-cpu's
 * quants.c), and scales are applied per block in fp32.
 *
 * Same arguments and weight layouts as qlinear.c (compressed-tensors):
 *   int8: w int8 (N, K) row stride ldw, scale fp32 (N): W[n,k] = w[n,k] * scale[n].
 *   int4: wp int32 (N, ldw) words of 8 nibbles (element j in bits 4j, stored q + 8), scale fp32 (N, G),
 *         zp int32 (N, G) or NULL, groups of gs columns, gs a multiple of QB; K a multiple of 8.
 *
 * Activation quantization (per x row m and block b = columns 32b..32b+31, zero-padded past K):
 *   amax = max |x|, d = amax / 127, q = rint(x * (d ? 1 / d : 0)) (round half to even), all fp32,
 * so |q| <= 127. kernels/reference.py (quantized_linear_int_dot) does the same fp32 ops, so q and d
 * are bit-identical there and the tests compare the rest of the math against fp64.
 *
 * int8:  y = scale[n] * sum_b d_b * (q_b . w_b). The signed x signed dot uses llama.cpp's sign
 *        trick: |w| (0..128, unsigned) times sign(w) * q (|.| <= 127), exact for w = -128.
 * int4:  with the stored nibbles u = q_w + 8 and s, z the group's scale and zero point:
 *        y = sum_g s_g * (sum_{b in g} d_b * (q_b . u_b) - (8 + z_g) * C_g), C_g = sum_{b in g} d_b * sum(q_b).
 *        Blocks go in pairs: the 8 words of columns 64p..64p+63 are one 32-byte vector whose low nibbles
 *        are the even columns and high nibbles the odd ones, so the activations of a pair are stored
 *        as its 32 even columns then its 32 odd ones (pair_pos) and two dot products give the block
 *        sums of blocks 2p (lanes 0-3) and 2p + 1 (lanes 4-7), each scaled by d_b * s_g(b) in fp32.
 *        An odd block count is padded with an all-zero block (d = 0). The weights stay in the
 *        compressed-tensors layout (no repack): the nibble order already suits this scheme.
 * Without VNNI the u8 x s8 dot is maddubs (pairs to int16: 128 * 127 * 2 < 32767, no saturation)
 * + madd with ones. Each output row's arithmetic is the same whatever the tile, the batch or the
 * thread count, so a row's result does not depend on the other rows of the batch.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 32
#define QNR 4

/* 8 int32 lanes, each the sum of 4 products of u (unsigned bytes) and s (signed bytes) */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Offset, from the start of block b, of its element i in the int4 pair layout: blocks 2p and 2p + 1
 * form 64 columns c = 32 * (b & 1) + i stored as the 32 even columns then the 32 odd ones. */
static inline int64_t pair_pos(int64_t b, int i) {
    const int c = (int)(b & 1) * QB + i;
    return (c & 1) * QB + c / 2 - (int)(b & 1) * QB;
}

/* One x row (K fp32) -> nb blocks: xq (nb * 32 int8, zero past K; int4 order when perm), d (nb), and
 * qsum (nb, sum of the block's q; may be NULL). */
static void quantize_row(const float *x, int64_t K, int64_t nb, int perm, int8_t *xq, float *d, int32_t *qsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < nb; b++) {
        float t[QB];
        const int64_t k0 = b * QB, n = K - k0 < QB ? (K > k0 ? K - k0 : 0) : QB;
        memcpy(t, x + k0, sizeof(float) * (size_t)n);
        for (int64_t i = n; i < QB; i++) t[i] = 0.0f;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(t + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4), db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t qi[QB];
        for (int i = 0; i < 4; i++)  /* cvtps rounds to nearest even (the default MXCSR mode) */
            _mm256_storeu_si256((__m256i *)(qi + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))));
        int8_t *o = xq + k0;
        int32_t s = 0;
        for (int i = 0; i < QB; i++) {
            o[perm ? pair_pos(b, i) : i] = (int8_t)qi[i];
            s += qi[i];
        }
        d[b] = db;
        if (qsum) qsum[b] = s;
    }
}

/* Quantize M rows (row stride ldx) into xq (M, nb * 32), d (M, nb), qsum (M, nb) or NULL. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t nb, int perm,
                          int8_t *xq, float *d, int32_t *qsum, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && M > 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, nb, perm, xq + m * nb * QB, d + m * nb, qsum ? qsum + m * nb : NULL);
}

/* ---------------------------------------------------------------- int8 per channel */

/* nr (<= 4) weight rows against mr (1 or 2) activation rows; w rows of stride ldw, K columns. */
static inline __attribute__((always_inline)) void i8_tile(
    const int8_t *xq, const float *d, int64_t nb, int mr, const int8_t *w, int64_t ldw, int nr, int64_t K,
    const float *scale, const float *bias, float *y, int64_t ldy)
{
    __m256 acc[2][QNR];
    for (int m = 0; m < 2; m++)
        for (int n = 0; n < QNR; n++) acc[m][n] = _mm256_setzero_ps();
    const int64_t nbf = K / QB;  /* whole blocks; a tail block is read through a zero-padded copy */
    const char *next = (const char *)(w + QNR * ldw);
    for (int64_t b = 0; b < nb; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QB));
        const __m256i x1 = mr > 1 ? _mm256_loadu_si256((const __m256i *)(xq + nb * QB + b * QB)) : x0;
        const __m256 d0 = _mm256_set1_ps(d[b]), d1 = _mm256_set1_ps(mr > 1 ? d[nb + b] : 0.0f);
        for (int n = 0; n < QNR; n++) {
            if (n >= nr) break;
            __m256i wv;
            if (b < nbf) {
                if (n < 2) _mm_prefetch(next + 4 * QB * b + 64 * n, _MM_HINT_T0);  /* the next tile, in address order */
                wv = _mm256_loadu_si256((const __m256i *)(w + n * ldw + b * QB));
            } else {
                int8_t t[QB] = {0};
                memcpy(t, w + n * ldw + b * QB, (size_t)(K - b * QB));
                wv = _mm256_loadu_si256((const __m256i *)t);
            }
            const __m256i au = _mm256_sign_epi8(wv, wv);  /* |w| as unsigned bytes (-128 -> 128) */
            acc[0][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(au, _mm256_sign_epi8(x0, wv))), d0, acc[0][n]);
            if (mr > 1)
                acc[1][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(au, _mm256_sign_epi8(x1, wv))), d1, acc[1][n]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            y[m * ldy + n] = hsum8(acc[m][n]) * scale[n] + (bias ? bias[n] : 0.0f);
}

void baige_qdot_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, int64_t N, int64_t ldw,
                     const float *scale, const float *bias, float *y, int64_t ldy, int nthreads)
{
    const int64_t nb = (K + QB - 1) / QB, tiles = (N + QNR - 1) / QNR;
    int8_t *xq = malloc((size_t)(M * nb * QB));
    float *d = malloc(sizeof(float) * (size_t)(M * nb));
    if (!xq || !d) {  /* out of memory: nothing sane to compute */
        free(xq); free(d);
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = __builtin_nanf("");
        return;
    }
    quantize_rows(x, M, K, ldx, nb, 0, xq, d, NULL, nthreads);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * QNR;
        const int nr = (int)(N - n0 < QNR ? N - n0 : QNR);
        const int8_t *wn = w + n0 * ldw;
        const float *b = bias ? bias + n0 : NULL;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            if (nr == QNR) i8_tile(xq + m * nb * QB, d + m * nb, nb, 2, wn, ldw, QNR, K, scale + n0, b, y + m * ldy + n0, ldy);
            else i8_tile(xq + m * nb * QB, d + m * nb, nb, 2, wn, ldw, nr, K, scale + n0, b, y + m * ldy + n0, ldy);
        }
        if (m < M) {
            if (nr == QNR) i8_tile(xq + m * nb * QB, d + m * nb, nb, 1, wn, ldw, QNR, K, scale + n0, b, y + m * ldy + n0, ldy);
            else i8_tile(xq + m * nb * QB, d + m * nb, nb, 1, wn, ldw, nr, K, scale + n0, b, y + m * ldy + n0, ldy);
        }
    }
    free(xq);
    free(d);
}

/* ---------------------------------------------------------------- int4 group-wise */

/* Two u8 x s8 dot products summed: 8 int32 lanes, lane j the sum over bytes 4j..4j+3 of u0*s0 + u1*s1 */
static inline __m256i dot2_u8s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else  /* |u| <= 15, |s| <= 127: each int16 sum of 4 products stays below 32767 */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
#endif
}

/* [v[0] x4 | v[1] x4] from two consecutive floats */
static inline __m256 pair_bcast(const float *v) {
    const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)v));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* sum_g s[g] * z[g] * c[g]: the zero points' share of the offset (the 8 of the stored nibbles is taken
 * off in int32 inside the dot products, see nib_off) */
static inline float group_offsets(const float *s, const int32_t *z, const float *c, int64_t G) {
    __m256 a = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 zf = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(z + g)));
        a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + g), zf), _mm256_loadu_ps(c + g), a);
    }
    float r = hsum8(a);
    for (; g < G; g++) r += s[g] * (float)z[g] * c[g];
    return r;
}

/* 8 * sum(q) of blocks 2p and 2p + 1 in lanes 0 and 4 (0 elsewhere): subtracted from a pair's dot
 * products of the stored nibbles u = q_w + 8 and the activations q, it leaves the dot with q_w + 0
 * per block, so only asymmetric weights need a correction after the loop (group_offsets) */
static inline __m256i nib_off(const int32_t *qs, int64_t p) {
    return _mm256_setr_epi32(8 * qs[2 * p], 0, 0, 0, 8 * qs[2 * p + 1], 0, 0, 0);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QDOT_512 1
/* [lo | hi]: two 256-bit halves as one 512-bit vector */
static inline __m512i cat256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* [v[0] x4 | v[1] x4 | v[2] x4 | v[3] x4] from four consecutive floats */
static inline __m512 quad_bcast(const float *v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(_mm_loadu_ps(v)));
}

/* The AVX-512 VNNI part of i4_dot_tile: pairs p0, p0 + 2, .. < p1 (p1 - p0 even, all whole words)
 * two at a time, 128 columns per 512-bit vector: lanes 0-7 pair p, 8-15 pair p + 1 (each as in the
 * 256-bit loop). Half the instructions per weight of the 256-bit loop. mode 0 or 1 (see i4_dot_tile).
 * Adds into acc (the 256-bit accumulators: the two halves of each 512-bit sum). */
static inline __attribute__((always_inline)) void i4_dot_512(
    const int8_t *xq, const float *d, const int32_t *qs, int64_t np, int mr, const int32_t *wp, int64_t ldw, int nr,
    int64_t p1, const float *scale, int64_t G, int64_t gs, int mode, const char *next, __m256 acc[2][QNR])
{
    __m512 a[2][QNR];
    for (int m = 0; m < 2; m++)
        for (int n = 0; n < QNR; n++) a[m][n] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int64_t ldq = np * 2 * QB;
    for (int64_t p = 0; p + 2 <= p1; p += 2) {
        const int8_t *x0 = xq + p * 2 * QB, *x1 = mr > 1 ? x0 + ldq : x0;
        /* pair layout: [p even | p odd | p+1 even | p+1 odd], 32 bytes each */
        const __m512i xl0 = cat256(_mm256_loadu_si256((const __m256i *)x0), _mm256_loadu_si256((const __m256i *)(x0 + 2 * QB)));
        const __m512i xh0 = cat256(_mm256_loadu_si256((const __m256i *)(x0 + QB)), _mm256_loadu_si256((const __m256i *)(x0 + 3 * QB)));
        const __m512i xl1 = cat256(_mm256_loadu_si256((const __m256i *)x1), _mm256_loadu_si256((const __m256i *)(x1 + 2 * QB)));
        const __m512i xh1 = cat256(_mm256_loadu_si256((const __m256i *)(x1 + QB)), _mm256_loadu_si256((const __m256i *)(x1 + 3 * QB)));
        const __m512 dd0 = quad_bcast(d + 2 * p), dd1 = quad_bcast(d + (mr > 1 ? 2 * np : 0) + 2 * p);
        const int32_t *qs1 = qs + (mr > 1 ? 2 * np : 0);
        const __m512i o0 = cat256(nib_off(qs, p), nib_off(qs, p + 1)), o1 = cat256(nib_off(qs1, p), nib_off(qs1, p + 1));
        const int64_t ga = (2 * p * QB) / gs, gb = ((2 * p + 2) * QB) / gs;  /* mode 1: the two pairs' groups */
        for (int n = 0; n < QNR; n++) {
            if (n >= nr) break;
            if (n < 4) _mm_prefetch(next + 128 * p + 64 * n, _MM_HINT_T0);  /* the next tile, in address order */
            const __m512i v = _mm512_loadu_si512((const void *)(wp + n * ldw + 8 * p));
            const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            const float *s = scale + n * G;
            const __m512 sv = mode == 0 ? quad_bcast(s + 2 * p)
                                        : _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(s[ga])),
                                                                          _mm256_castps_pd(_mm256_set1_ps(s[gb])), 1));
            const __m512i t0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), o0), lo, xl0), hi, xh0);
            a[0][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t0), _mm512_mul_ps(dd0, sv), a[0][n]);
            if (mr > 1) {
                const __m512i t1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), o1), lo, xl1), hi, xh1);
                a[1][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t1), _mm512_mul_ps(dd1, sv), a[1][n]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            acc[m][n] = _mm256_add_ps(acc[m][n], _mm256_add_ps(_mm512_castps512_ps256(a[m][n]), _mm256_castpd_ps(
                _mm512_extractf64x4_pd(_mm512_castps_pd(a[m][n]), 1))));
}
#endif

/* nr (<= 4) weight rows against mr (1 or 2) activation rows over np pairs of blocks. One pair is 8
 * words (64 columns) loaded as one vector: low nibbles = even columns, high nibbles = odd columns, lanes
 * 0-3 block 2p and lanes 4-7 block 2p + 1, matching the pair layout of xq. mode 0: gs == 32 (the two
 * blocks have adjacent groups); 1: gs % 64 == 0 (one group per pair); 2: any other multiple of 32.
 * cg: (mr, G) the rows' C_g. */
static inline __attribute__((always_inline)) void i4_dot_tile(
    const int8_t *xq, const float *d, const float *cg, const int32_t *qs, int64_t np, int mr, const int32_t *wp, int64_t ldw, int nr,
    int64_t words, const float *scale, const int32_t *zp, int64_t G, int64_t gs, int mode, const float *bias,
    float *y, int64_t ldy)
{
    __m256 acc[2][QNR];
    for (int m = 0; m < 2; m++)
        for (int n = 0; n < QNR; n++) acc[m][n] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const int64_t npf = words / 8, ldq = np * 2 * QB, ppg = gs / (2 * QB);
    const char *next = (const char *)(wp + QNR * ldw);
    int64_t p = 0;
#ifdef QDOT_512
    if (mode != 2) {  /* whole pairs of pairs in 512-bit vectors; the rest below (the sums' order per lane is the same) */
        p = npf & ~(int64_t)1;
        i4_dot_512(xq, d, qs, np, mr, wp, ldw, nr, p, scale, G, gs, mode, next, acc);
    }
#endif
    int64_t g1 = (2 * p * QB) / gs, left = ppg ? ppg - p % ppg : 0;  /* mode 1: the pair's group and how many pairs it has left */
    for (; p < np; p++) {
        const int8_t *x0 = xq + p * 2 * QB, *x1 = mr > 1 ? x0 + ldq : x0;
        const __m256i xl0 = _mm256_loadu_si256((const __m256i *)x0), xh0 = _mm256_loadu_si256((const __m256i *)(x0 + QB));
        const __m256i xl1 = _mm256_loadu_si256((const __m256i *)x1), xh1 = _mm256_loadu_si256((const __m256i *)(x1 + QB));
        const __m256 dd0 = pair_bcast(d + 2 * p), dd1 = pair_bcast(d + (mr > 1 ? 2 * np : 0) + 2 * p);
        const __m256i o0 = nib_off(qs, p), o1 = nib_off(qs + (mr > 1 ? 2 * np : 0), p);
        for (int n = 0; n < QNR; n++) {
            if (n >= nr) break;
            __m256i v;
            if (p < npf) {
                if (n < 2) _mm_prefetch(next + 128 * p + 64 * n, _MM_HINT_T0);  /* the next tile, in address order */
                v = _mm256_loadu_si256((const __m256i *)(wp + n * ldw + 8 * p));
            } else {
                int32_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                memcpy(t, wp + n * ldw + 8 * p, sizeof(int32_t) * (size_t)(words - 8 * p));
                v = _mm256_loadu_si256((const __m256i *)t);
            }
            const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            const float *s = scale + n * G;
            __m256 sv;
            if (mode == 0 && 2 * p + 1 < G) sv = pair_bcast(s + 2 * p);
            else if (mode == 1) sv = _mm256_set1_ps(s[g1]);
            else {
                const int64_t ga = 2 * p * QB / gs, gb = (2 * p + 1) * QB / gs;
                sv = _mm256_set_m128(_mm_set1_ps(s[gb < G ? gb : G - 1]), _mm_set1_ps(s[ga]));
            }
            acc[0][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot2_u8s8(lo, xl0, hi, xh0), o0)),
                                        _mm256_mul_ps(dd0, sv), acc[0][n]);
            if (mr > 1)
                acc[1][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot2_u8s8(lo, xl1, hi, xh1), o1)),
                                            _mm256_mul_ps(dd1, sv), acc[1][n]);
        }
        if (mode == 1 && --left == 0) { g1++; left = ppg; }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            y[m * ldy + n] = (hsum8(acc[m][n]) - (zp ? group_offsets(scale + n * G, zp + n * G, cg + m * G, G) : 0.0f))
                             + (bias ? bias[n] : 0.0f);
}

/* One 4-row tile of weights (nr rows) against all M activation rows, two at a time. */
static void i4_rows(const int8_t *xq, const float *d, const float *cg, const int32_t *qs, int64_t M, int64_t np, const int32_t *wn,
                    int64_t ldw, int nr, int64_t words, const float *sc, const int32_t *z, int64_t G, int64_t gs,
                    const float *b, float *y, int64_t ldy)
{
    const int mode = gs == QB ? 0 : gs % (2 * QB) == 0 ? 1 : 2;
    for (int64_t m = 0; m < M; m += 2) {
        const int mr = M - m >= 2 ? 2 : 1;
        const int8_t *xm = xq + m * np * 2 * QB;
        const float *dm = d + m * np * 2, *cm = cg + m * G;
        float *ym = y + m * ldy;
#define I4_CALL(MR, NR, MODE) i4_dot_tile(xm, dm, cm, qs + m * np * 2, np, MR, wn, ldw, NR, words, sc, z, G, gs, MODE, b, ym, ldy)
        if (nr == QNR && mr == 2) {
            if (mode == 0) I4_CALL(2, QNR, 0); else if (mode == 1) I4_CALL(2, QNR, 1); else I4_CALL(2, QNR, 2);
        } else if (nr == QNR) {
            if (mode == 0) I4_CALL(1, QNR, 0); else if (mode == 1) I4_CALL(1, QNR, 1); else I4_CALL(1, QNR, 2);
        } else {
            I4_CALL(mr, nr, mode);
        }
#undef I4_CALL
    }
}

/* Returns 0, or -1 when gs is not a multiple of 32 (call baige_qlinear_int4 instead; y untouched) or
 * scratch memory cannot be allocated (y filled with NaN). */
int baige_qdot_int4(const float *x, int64_t M, int64_t K, int64_t ldx,
                    const int32_t *wp, int64_t N, int64_t ldw, const float *scale, const int32_t *zp,
                    int64_t G, int64_t gs, const float *bias, float *y, int64_t ldy, int nthreads)
{
    if (gs % QB || gs <= 0) return -1;
    const int64_t words = K / 8, nb = (K + QB - 1) / QB, nbp = nb + (nb & 1), np = nbp / 2, bpg = gs / QB;
    const int64_t tiles = (N + QNR - 1) / QNR;
    int8_t *xq = malloc((size_t)(M * nbp * QB));
    float *d = malloc(sizeof(float) * (size_t)(M * nbp)), *cg = malloc(sizeof(float) * (size_t)(M * G));
    int32_t *qs = malloc(sizeof(int32_t) * (size_t)(M * nbp));
    if (!xq || !d || !cg || !qs) {
        free(xq); free(d); free(cg); free(qs);
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = __builtin_nanf("");
        return -1;
    }
    quantize_rows(x, M, K, ldx, nbp, 1, xq, d, qs, nthreads);  /* a padding block has d = 0, qsum = 0 */
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t b1 = (g + 1) * bpg < nb ? (g + 1) * bpg : nb;
            float c = 0.0f;
            for (int64_t b = g * bpg; b < b1; b++) c += d[m * nbp + b] * (float)qs[m * nbp + b];
            cg[m * G + g] = c;
        }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * QNR;
        const int nr = (int)(N - n0 < QNR ? N - n0 : QNR);
        i4_rows(xq, d, cg, qs, M, np, wp + n0 * ldw, ldw, nr, words, scale + n0 * G, zp ? zp + n0 * G : NULL, G, gs,
                bias ? bias + n0 : NULL, y + n0, ldy);
    }
    free(xq); free(d); free(cg); free(qs);
    return 0;
}
