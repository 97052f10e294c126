/* Weight-only quantized linear layers for x86-64 CPUs with AVX2 + FMA: y = x @ W^T + bias with the
 * integer weight dequantized in registers, so a memory-bound decode step reads 1 byte (int8) or half
 * a byte (int4) per weight instead of 4.
 *
 * Layouts (compressed-tensors, see baige/runtime/quant/scheme.py):
 *   int8: w int8 (N, K) row-major with row stride ldw, scale fp32 (N): W[n,k] = w[n,k] * scale[n].
 *   int4: wp int32 (N, ldw) with ldw >= K / 8 words per row, element j of a word in bits 4j..4j+3
 *         stored as q + 8; scale fp32 (N, G), zp int32 (N, G) or NULL; groups of gs columns
 *         (gs a multiple of 8): W[n,k] = (q - zp[n, k / gs]) * scale[n, k / gs].
 *   x fp32 (M, K) with row stride ldx, y fp32 (M, N) with row stride ldy, bias fp32 (N) or NULL.
 * For int4, K must be a multiple of 8 (the caller pads x with zeros to whole words).
 *
 * Tiling: NR = 4 output rows at a time share each loaded x vector; MR = 2 input rows at a time share
 * each dequantized weight vector (8 accumulators), so a weight row is read from memory once per
 * call and from L1 by the later input rows. Output tiles are split over `nthreads` OpenMP threads.
 * Accumulation is fp32 in 8 lanes, reduced at the end: the sum order differs from a BLAS sgemm, the
 * dequantized weights are the reference's bit for bit ((q - zp) * scale rounded once in fp32).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>

#include "bf16_convert.h"
#include "vec_math.h"

#define NR 4

/* 8 int8 -> 8 fp32 */
static inline __m256 cvt_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* ---------------------------------------------------------------- int8 and fp32 rows */

static inline __m256 ld_f32(const float *p) { return _mm256_loadu_ps(p); }
/* the 8 nibbles of one int4 word, element e from bits 4e, as int32 lanes 0..7 */
static inline __m256i nibbles8(int32_t word) {
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                            _mm256_set1_epi32(0xF));
}
/* 8 IEEE fp16 -> 8 fp32 (F16C) */
static inline __m256 cvt_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }


/* The same register tiles for int8 weights (converted in registers, per-row scale applied to the
 * dot product) and fp32 weights (scale NULL): W is any row-major (N, K) matrix with row stride ldw.
 * The next tile is prefetched at sizeof(T) cache lines per 16 columns (4 rows x 16 x sizeof(T) bytes). */
#define BAIGE_DEFINE_TILES(SUF, T, LOADW, TO_F32)                                                              \
/* One output row against x rows 0..mr-1: the tail tiles (N % NR rows), any mr. */                     \
static void row_##SUF(const float *x, int64_t ldx, int mr, const T *w, int64_t K,                     \
                      const float *scale, const float *bias, float *y, int64_t ldy)                   \
{                                                                                                      \
    const int64_t K8 = K & ~(int64_t)7;                                                                \
    for (int m = 0; m < mr; m++) {                                                                     \
        __m256 acc = _mm256_setzero_ps();                                                              \
        for (int64_t k = 0; k < K8; k += 8)                                                            \
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), LOADW(w + k), acc);                \
        float s = hsum256(acc);                                                                        \
        for (int64_t k = K8; k < K; k++) s += x[m * ldx + k] * TO_F32(w[k]);                            \
        y[m * ldy] = (scale ? s * *scale : s) + (bias ? *bias : 0.0f);                                 \
    }                                                                                                  \
}                                                                                                      \
                                                                                                       \
/* NR = 4 output rows against one x row; k unrolled by 16 (8 independent accumulators). The next     \
 * tile is streamed into cache while this one computes: the hardware prefetcher alone left the        \
 * DRAM reads and the convert/FMA work serialised, at a fraction of the bandwidth. */                  \
static void tile_m1_##SUF(const float *x, const T *w, int64_t ldw, int64_t K,                          \
                          const float *scale, const float *bias, float *y)                             \
{                                                                                                      \
    const T *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;                              \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;    \
    const int64_t K16 = K & ~(int64_t)15, K8 = K & ~(int64_t)7;                                        \
    const char *next = (const char *)(w + NR * ldw);                                                   \
    int64_t k = 0;                                                                                     \
    for (; k < K16; k += 16) {                                                                         \
        for (int l = 0; l < (int)sizeof(T); l++)                                                       \
            _mm_prefetch(next + 4 * k * (int64_t)sizeof(T) + 64 * l, _MM_HINT_T0);                     \
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);                           \
        a0 = _mm256_fmadd_ps(x0, LOADW(w0 + k), a0);                                                   \
        a1 = _mm256_fmadd_ps(x0, LOADW(w1 + k), a1);                                                   \
        a2 = _mm256_fmadd_ps(x0, LOADW(w2 + k), a2);                                                   \
        a3 = _mm256_fmadd_ps(x0, LOADW(w3 + k), a3);                                                   \
        b0 = _mm256_fmadd_ps(x1, LOADW(w0 + k + 8), b0);                                               \
        b1 = _mm256_fmadd_ps(x1, LOADW(w1 + k + 8), b1);                                               \
        b2 = _mm256_fmadd_ps(x1, LOADW(w2 + k + 8), b2);                                               \
        b3 = _mm256_fmadd_ps(x1, LOADW(w3 + k + 8), b3);                                               \
    }                                                                                                  \
    for (; k < K8; k += 8) {                                                                           \
        __m256 x0 = _mm256_loadu_ps(x + k);                                                            \
        a0 = _mm256_fmadd_ps(x0, LOADW(w0 + k), a0);                                                   \
        a1 = _mm256_fmadd_ps(x0, LOADW(w1 + k), a1);                                                   \
        a2 = _mm256_fmadd_ps(x0, LOADW(w2 + k), a2);                                                   \
        a3 = _mm256_fmadd_ps(x0, LOADW(w3 + k), a3);                                                   \
    }                                                                                                  \
    float s[NR] = {hsum256(_mm256_add_ps(a0, b0)), hsum256(_mm256_add_ps(a1, b1)),                     \
                   hsum256(_mm256_add_ps(a2, b2)), hsum256(_mm256_add_ps(a3, b3))};                    \
    for (int n = 0; n < NR; n++) {                                                                     \
        for (int64_t kk = K8; kk < K; kk++) s[n] += x[kk] * TO_F32(w[n * ldw + kk]);                    \
        y[n] = (scale ? s[n] * scale[n] : s[n]) + (bias ? bias[n] : 0.0f);                             \
    }                                                                                                  \
}                                                                                                      \
                                                                                                       \
/* NR = 4 output rows against two x rows (8 accumulators): each weight vector is loaded once. */      \
static void tile_m2_##SUF(const float *x, int64_t ldx, const T *w, int64_t ldw, int64_t K,             \
                          const float *scale, const float *bias, float *y, int64_t ldy)                \
{                                                                                                      \
    const T *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;                              \
    const float *xa = x, *xb = x + ldx;                                                                \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;    \
    const int64_t K8 = K & ~(int64_t)7;                                                                \
    const char *next = (const char *)(w + NR * ldw);                                                   \
    for (int64_t k = 0; k < K8; k += 8) {                                                              \
        for (int l = 0; l < (int)sizeof(T); l += 2)                                                    \
            _mm_prefetch(next + 4 * k * (int64_t)sizeof(T) + 32 * l, _MM_HINT_T0);                     \
        __m256 x0 = _mm256_loadu_ps(xa + k), x1 = _mm256_loadu_ps(xb + k), v;                          \
        v = LOADW(w0 + k); a0 = _mm256_fmadd_ps(x0, v, a0); b0 = _mm256_fmadd_ps(x1, v, b0);           \
        v = LOADW(w1 + k); a1 = _mm256_fmadd_ps(x0, v, a1); b1 = _mm256_fmadd_ps(x1, v, b1);           \
        v = LOADW(w2 + k); a2 = _mm256_fmadd_ps(x0, v, a2); b2 = _mm256_fmadd_ps(x1, v, b2);           \
        v = LOADW(w3 + k); a3 = _mm256_fmadd_ps(x0, v, a3); b3 = _mm256_fmadd_ps(x1, v, b3);           \
    }                                                                                                  \
    float s[2][NR] = {{hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)},                            \
                      {hsum256(b0), hsum256(b1), hsum256(b2), hsum256(b3)}};                           \
    for (int m = 0; m < 2; m++) {                                                                      \
        for (int n = 0; n < NR; n++) {                                                                 \
            for (int64_t kk = K8; kk < K; kk++) s[m][n] += x[m * ldx + kk] * TO_F32(w[n * ldw + kk]);   \
            y[m * ldy + n] = (scale ? s[m][n] * scale[n] : s[m][n]) + (bias ? bias[n] : 0.0f);         \
        }                                                                                              \
    }                                                                                                  \
}

BAIGE_DEFINE_TILES(i8, int8_t, cvt_i8, (float))
BAIGE_DEFINE_TILES(f32, float, ld_f32, (float))
BAIGE_DEFINE_TILES(f16, uint16_t, cvt_f16, _cvtsh_ss)
BAIGE_DEFINE_TILES(bf16, uint16_t, bf16x8_to_f32, bf16_to_f32)

/* NR = 4 fp32 output rows (row stride ldw) against three x rows: 12 accumulators + 3 x vectors + 1
 * weight vector fill the 16 registers (batches of 3+ rows; int8/int4 weights are first converted to
 * an fp32 panel once per call, so the conversion is not paid per x row). */
static void tile_m3_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                        const float *scale, const float *bias, float *y, int64_t ldy)
{
    const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
    const float *xa = x, *xb = x + ldx, *xc = x + 2 * ldx;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const int64_t K8 = K & ~(int64_t)7;
    /* the next 4-row tile streamed in while this one computes, as tile_m1/m2 do (at 3-5 rows, e.g. a
     * sequence verifying draft tokens, this tile is the one that reads W from memory) */
    const char *next = (const char *)(w + NR * ldw);
    for (int64_t k = 0; k < K8; k += 8) {
        _mm_prefetch(next + 16 * k, _MM_HINT_T0);
        _mm_prefetch(next + 16 * k + 64, _MM_HINT_T0);
        const __m256 xa_ = _mm256_loadu_ps(xa + k), xb_ = _mm256_loadu_ps(xb + k), xc_ = _mm256_loadu_ps(xc + k);
        __m256 v;
        v = _mm256_loadu_ps(w0 + k); a0 = _mm256_fmadd_ps(xa_, v, a0); b0 = _mm256_fmadd_ps(xb_, v, b0); c0 = _mm256_fmadd_ps(xc_, v, c0);
        v = _mm256_loadu_ps(w1 + k); a1 = _mm256_fmadd_ps(xa_, v, a1); b1 = _mm256_fmadd_ps(xb_, v, b1); c1 = _mm256_fmadd_ps(xc_, v, c1);
        v = _mm256_loadu_ps(w2 + k); a2 = _mm256_fmadd_ps(xa_, v, a2); b2 = _mm256_fmadd_ps(xb_, v, b2); c2 = _mm256_fmadd_ps(xc_, v, c2);
        v = _mm256_loadu_ps(w3 + k); a3 = _mm256_fmadd_ps(xa_, v, a3); b3 = _mm256_fmadd_ps(xb_, v, b3); c3 = _mm256_fmadd_ps(xc_, v, c3);
    }
    float s[3][NR] = {{hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)},
                      {hsum256(b0), hsum256(b1), hsum256(b2), hsum256(b3)},
                      {hsum256(c0), hsum256(c1), hsum256(c2), hsum256(c3)}};
    for (int m = 0; m < 3; m++) {
        for (int n = 0; n < NR; n++) {
            for (int64_t kk = K8; kk < K; kk++) s[m][n] += x[m * ldx + kk] * w[n * ldw + kk];
            y[m * ldy + n] = (scale ? s[m][n] * scale[n] : s[m][n]) + (bias ? bias[n] : 0.0f);
        }
    }
}

/* y = x @ W^T * scale + bias for int8 (scale per row), fp32 or fp16 (scale NULL) W. */
#define BAIGE_DEFINE_LINEAR(NAME, SUF, T, LOADW, TO_F32, PANEL_MIN_ROWS)                                              \
void NAME(const float *x, int64_t M, int64_t K, int64_t ldx, const T *w, int64_t N, int64_t ldw,       \
          const float *scale, const float *bias, float *y, int64_t ldy, int nthreads)                  \
{                                                                                                      \
    const int64_t tiles = (N + NR - 1) / NR;                                                           \
    const int panel = sizeof(T) != sizeof(float) && M >= (PANEL_MIN_ROWS);                                    \
    _Pragma("omp parallel num_threads(nthreads) if (nthreads > 1)")                                    \
    {                                                                                                  \
        float *wf = panel ? malloc(sizeof(float) * (size_t)(NR * K)) : NULL;                           \
        _Pragma("omp for schedule(static)")                                                            \
        for (int64_t t = 0; t < tiles; t++) {                                                          \
            const int64_t n0 = t * NR;                                                                 \
            const T *wn = w + n0 * ldw;                                                                \
            const float *sc = scale ? scale + n0 : NULL, *b = bias ? bias + n0 : NULL;                 \
            if (N - n0 < NR) {                                                                         \
                for (int64_t n = n0; n < N; n++)                                                       \
                    row_##SUF(x, ldx, (int)M, w + n * ldw, K, scale ? scale + n : NULL,                \
                              bias ? bias + n : NULL, y + n, ldy);                                     \
                continue;                                                                              \
            }                                                                                          \
            int64_t m0 = 0;                                                                            \
            const float *wm3 = (const float *)wn;                                                      \
            int64_t ldm3 = ldw;                                                                        \
            if (wf) {                                                                                  \
                for (int n = 0; n < NR; n++) {                                                         \
                    int64_t k = 0;                                                                     \
                    for (; k + 8 <= K; k += 8)                                                         \
                        _mm256_storeu_ps(wf + n * K + k, LOADW(wn + n * ldw + k));                     \
                    for (; k < K; k++) wf[n * K + k] = TO_F32(wn[n * ldw + k]);                        \
                }                                                                                      \
                wm3 = wf;                                                                              \
                ldm3 = K;                                                                              \
            }                                                                                          \
            if (wf || sizeof(T) == sizeof(float))                                                      \
                for (; m0 + 3 <= M; m0 += 3)                                                           \
                    tile_m3_f32(x + m0 * ldx, ldx, wm3, ldm3, K, sc, b, y + m0 * ldy + n0, ldy);       \
            for (; m0 + 2 <= M; m0 += 2)                                                               \
                tile_m2_##SUF(x + m0 * ldx, ldx, wn, ldw, K, sc, b, y + m0 * ldy + n0, ldy);           \
            if (m0 < M)                                                                                \
                tile_m1_##SUF(x + m0 * ldx, wn, ldw, K, sc, b, y + m0 * ldy + n0);                     \
        }                                                                                              \
        free(wf);                                                                                      \
    }                                                                                                  \
}

/* int8 per output channel; batches of 6+ rows convert each 4-row tile to an fp32 panel first. */
BAIGE_DEFINE_LINEAR(baige_qlinear_int8, i8, int8_t, cvt_i8, (float), 6)
/* fp32 weights (the decode step's unquantized linears); scale NULL. */
BAIGE_DEFINE_LINEAR(baige_linear_f32, f32, float, ld_f32, (float), 1 << 30)
/* fp16 weights, fp32 math (--quantization fp16-weight); scale NULL. */
BAIGE_DEFINE_LINEAR(baige_linear_f16, f16, uint16_t, cvt_f16, _cvtsh_ss, 6)
/* bf16 weights widened in registers, fp32 math and activations: the bf16 linear of variants without
 * AVX-512 BF16 (bf16.c's baige_linear_bf16 calls it there); scale NULL. */
BAIGE_DEFINE_LINEAR(baige_linear_bf16_widen, bf16, uint16_t, bf16x8_to_f32, bf16_to_f32, 6)

/* ---------------------------------------------------------------- int4, group-wise */

static inline __attribute__((always_inline)) void i4_tile(
    const float *x, int64_t ldx, int mr, const int32_t *wp, int64_t ldw, int nr, int64_t K,
    const float *scale, const int32_t *zp, int64_t G, int64_t gs, const float *bias, float *y, int64_t ldy)
{
    __m256 acc[2][NR];
    for (int m = 0; m < 2; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
    const int64_t words = K / 8, gw = gs / 8;
    for (int64_t g = 0; g < G; g++) {
        __m256i off[NR];
        __m256 sc[NR];
        for (int n = 0; n < NR; n++) {
            if (n < nr) {
                off[n] = _mm256_set1_epi32(8 + (zp ? zp[n * G + g] : 0));
                sc[n] = _mm256_set1_ps(scale[n * G + g]);
            }
        }
        const int64_t j1 = (g + 1) * gw < words ? (g + 1) * gw : words;
        for (int64_t j = g * gw; j < j1; j++) {
            __m256 x0 = _mm256_loadu_ps(x + 8 * j);
            __m256 x1 = mr > 1 ? _mm256_loadu_ps(x + ldx + 8 * j) : x0;
            for (int n = 0; n < NR; n++) {
                if (n < nr) {
                    __m256i u = nibbles8(wp[n * ldw + j]);
                    __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, off[n])), sc[n]);
                    acc[0][n] = _mm256_fmadd_ps(x0, wv, acc[0][n]);
                    if (mr > 1) acc[1][n] = _mm256_fmadd_ps(x1, wv, acc[1][n]);
                }
            }
        }
    }
    for (int m = 0; m < mr; m++) {
        for (int n = 0; n < nr; n++) {
            float v = hsum256(acc[m][n]);
            if (bias) v += bias[n];
            y[m * ldy + n] = v;
        }
    }
}

/* NR = 4 output rows against one x row. Per group g the integer dot products d = sum_k x_k u_k of
 * the stored nibbles u = q + 8 accumulate in fp32 lanes, then y += s_g * (d - (8 + zp_g) * xsum_g)
 * with xsum_g the group's sum of x (precomputed): 5 vector ops per 8 weights instead of 7. */
static void i4_tile_m1(const float *x, const float *xsum, const int32_t *wp, int64_t ldw, int64_t words,
                       const float *scale, const int32_t *zp, int64_t G, int64_t gw, const float *bias, float *y)
{
    const int32_t *w0 = wp, *w1 = wp + ldw, *w2 = wp + 2 * ldw, *w3 = wp + 3 * ldw;
    const char *next = (const char *)(wp + NR * ldw);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float corr[NR] = {0.0f, 0.0f, 0.0f, 0.0f};
#define BAIGE_NIB(word) _mm256_cvtepi32_ps(nibbles8(word))
    for (int64_t g = 0; g < G; g++) {
        const int64_t j0 = g * gw, j1 = (g + 1) * gw < words ? (g + 1) * gw : words;
        __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t j = j0; j < j1; j++) {
            if ((j & 3) == 0) _mm_prefetch(next + 16 * j, _MM_HINT_T0);  /* 4 rows x 4 bytes per word */
            __m256 xv = _mm256_loadu_ps(x + 8 * j);
            d0 = _mm256_fmadd_ps(xv, BAIGE_NIB(w0[j]), d0);
            d1 = _mm256_fmadd_ps(xv, BAIGE_NIB(w1[j]), d1);
            d2 = _mm256_fmadd_ps(xv, BAIGE_NIB(w2[j]), d2);
            d3 = _mm256_fmadd_ps(xv, BAIGE_NIB(w3[j]), d3);
        }
        const float *sg = scale + g;
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(sg[0]), d0, a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(sg[G]), d1, a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(sg[2 * G]), d2, a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(sg[3 * G]), d3, a3);
        for (int n = 0; n < NR; n++)
            corr[n] += sg[n * G] * (float)(8 + (zp ? zp[n * G + g] : 0)) * xsum[g];
    }
#undef BAIGE_NIB
    float d[NR] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};
    for (int n = 0; n < NR; n++) y[n] = d[n] - corr[n] + (bias ? bias[n] : 0.0f);
}

void baige_qlinear_int4(const float *x, int64_t M, int64_t K, int64_t ldx,
                        const int32_t *wp, int64_t N, int64_t ldw, const float *scale, const int32_t *zp,
                        int64_t G, int64_t gs, const float *bias, float *y, int64_t ldy, int nthreads)
{
    const int64_t tiles = (N + NR - 1) / NR, words = K / 8, gw = gs / 8;
    float xsum[M == 1 ? G : 1];  /* M == 1: per-group sums of x for i4_tile_m1 */
    if (M == 1) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
            float acc = 0.0f;
            for (int64_t k = g * gs; k < k1; k++) acc += x[k];
            xsum[g] = acc;
        }
    }
    const int panel = M >= 12;  /* as for int8 (dequantize each 4-row tile to fp32 once, 3-row fp32 tiles); the
                                  * nibble unpacking costs more, so it pays from 12 rows (measured) */
    static const float ones[NR] = {1.0f, 1.0f, 1.0f, 1.0f};
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *wf = panel ? malloc(sizeof(float) * (size_t)(NR * K)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            const int32_t *wn = wp + n0 * ldw;
            const int32_t *z = zp ? zp + n0 * G : NULL;
            const float *b = bias ? bias + n0 : NULL;
            if (M == 1 && nr == NR) {
                i4_tile_m1(x, xsum, wn, ldw, words, scale + n0 * G, z, G, gw, b, y + n0);
                continue;
            }
            int64_t m0 = 0;
            if (wf && nr == NR) {
                for (int n = 0; n < NR; n++) {  /* (u - 8 - zp) * scale, the reference's rounding */
                    for (int64_t j = 0; j < words; j++) {
                        const int64_t g = (j * 8) / gs;
                        const __m256i u = nibbles8(wn[n * ldw + j]);
                        const __m256i off = _mm256_set1_epi32(8 + (z ? z[n * G + g] : 0));
                        _mm256_storeu_ps(wf + n * K + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, off)),
                                                                          _mm256_set1_ps(scale[(n0 + n) * G + g])));
                    }
                }
                for (; m0 + 3 <= M; m0 += 3)
                    tile_m3_f32(x + m0 * ldx, ldx, wf, K, K, ones, b, y + m0 * ldy + n0, ldy);
            }
            for (; m0 < M; m0 += 2) {
                const int mr = M - m0 >= 2 ? 2 : 1;
                const float *xm = x + m0 * ldx;
                float *yo = y + m0 * ldy + n0;
                if (nr == NR) {
                    if (mr == 2) i4_tile(xm, ldx, 2, wn, ldw, NR, K, scale + n0 * G, z, G, gs, b, yo, ldy);
                    else i4_tile(xm, ldx, 1, wn, ldw, NR, K, scale + n0 * G, z, G, gs, b, yo, ldy);
                } else {
                    i4_tile(xm, ldx, mr, wn, ldw, nr, K, scale + n0 * G, z, G, gs, b, yo, ldy);
                }
            }
        }
        free(wf);
    }
}

/* int4 weights dequantized to bf16 for a bf16 matmul (kernels.quantized_linear's many-row path on AMX):
 * out[n, k] = bf16((q - zp[n, g]) * scale[n, g]) for k < K, g = k / gs, with the int4 layout above (ldw
 * words per row, gs a multiple of 8), scale (N, G) bf16 (scale_bf16 = 1) or fp32, zp int32 (N, G) or
 * NULL; out (N, K) bf16 row-major. Bit for bit the reference's dequantize_weight(...).to(bfloat16):
 * q - zp is a small integer (exact), its product with a bf16 scale is exact in fp32 and rounded once,
 * with an fp32 scale rounded to fp32 and then to bf16, as torch's two steps. Rows over nthreads threads. */
void baige_dequant_int4_bf16(const int32_t *wp, int64_t N, int64_t K, int64_t ldw, const void *scale, int scale_bf16,
                             const int32_t *zp, int64_t G, int64_t gs, uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && N * K >= 65536) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int32_t *w = wp + n * ldw;
        uint16_t *o = out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += 8) {
            const int64_t g = k0 / gs;
            const float s = scale_bf16 ? bf16_to_f32(((const uint16_t *)scale)[n * G + g]) : ((const float *)scale)[n * G + g];
            const float z = zp ? (float)zp[n * G + g] : 0.0f;
            const __m256i nib = nibbles8(w[k0 / 8]);
            const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib, _mm256_set1_epi32(8))), _mm256_set1_ps(z));
            const __m256 v = _mm256_mul_ps(q, _mm256_set1_ps(s));
            if (k0 + 8 <= K) {
                store_bf16x8(o + k0, v);
            } else {
                uint16_t tmp[8];
                store_bf16x8(tmp, v);
                for (int64_t k = k0; k < K; k++) o[k] = tmp[k - k0];
            }
        }
    }
}
