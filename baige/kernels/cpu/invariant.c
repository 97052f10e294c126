/* Batch-invariant kernels (baige/kernels/invariant.py): every output value is computed by one thread in
 * a reduction order fixed by its own operands alone -- never by how many rows share the call, where a row sits
 * in it, how a context is split into KV blocks, or how many threads run -- so a token's result is the same bit
 * for bit alone, in a batch, in any prefill chunk, as a decode step, and in the trainer's forward (He & Thinking
 * Machines Lab 2025, "Defeating Nondeterminism in LLM Inference": split work over rows and columns, never over
 * the reduction).
 *
 * The fixed orders (8-lane AVX2 code, built with -ffp-contract=off, so the scalar tails are a multiply and an add,
 * two roundings):
 *   dot products (attention scores, sums of squares; linear y[m][n] in the AVX2 variants): one 8-lane FMA
 *     accumulator over the first K & ~7 terms in order, its lanes summed by hsum256 (vec_math.h), then the
 *     K % 8 last terms added one by one; linear y[m][n] in the AVX-512 variants: one 16-lane FMA accumulator
 *     over K in steps of 16 (the last step's missing lanes zero), its lanes summed by _mm512_reduce_add_ps
 *     (under AVX-512 BF16, bf16 weights: vdpbf16ps over 32-element steps; each variant is invariant on its own,
 *     the variants differ from each other in the last bits);
 *   softmax over a row's L keys: scores s_j = dot * scale; m = max_j s_j; p_j = exp256(s_j - m) lane by lane
 *     (one polynomial per value, whatever its lane); l = p_0 + p_1 + ... in key order;
 *     out[c] = (sum_j p_j v_j[c] in key order, one FMA chain per column) / l;
 *   silu(g) = g / (1 + exp256(-g)) lane by lane.
 * Tiles (rows x columns of a linear, columns of an attention output processed together) only decide which
 * chains run side by side; each chain is the same. Threads split output tiles (linear), (row, head) pairs
 * (attention), rows (sums of squares) and 8-value chunks (silu).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16_convert.h"
#include "kv_cache.h"
#include "vec_math.h"

#define BI_NR 4   /* output columns (weight rows) per linear tile */
#define BI_MB 48  /* input rows kept hot (in L2) while a thread sweeps its weight tiles */

/* 8 (one) weights from element i of an fp32 (bf16 == 0) or bf16 (bf16 == 1) matrix, as fp32 (exact). */
static inline __attribute__((always_inline)) __m256 ldw8(const void *w, int bf16, int64_t i) {
    return bf16 ? bf16x8_to_f32((const uint16_t *)w + i) : _mm256_loadu_ps((const float *)w + i);
}

static inline __attribute__((always_inline)) float ldw1(const void *w, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#if defined(__AVX512F__)
#define BI_MR 4  /* input rows per linear tile: 16 accumulators of 32 registers */

/* 16 weights from element i of an fp32 / bf16 matrix as fp32, lanes at or past `left` zero. */
static inline __attribute__((always_inline)) __m512 ldw16(const void *w, int bf16, int64_t i, int64_t left) {
    const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    if (!bf16) return _mm512_maskz_loadu_ps(mk, (const float *)w + i);
    const __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* y[m * ldy + n] = dot(x row m, w row n) (+ bias[n]) for m < mr, n < nr (AVX-512 variants: one 16-lane FMA
 * chain per dot product over K in steps of 16, the last step's missing lanes zero, its lanes summed by
 * _mm512_reduce_add_ps; bf16 weights under AVX-512 BF16: x rounded to bf16 -- exact for a bf16 model's
 * activations -- and one vdpbf16ps chain over K in steps of 32, each lane adding its two products, the same
 * final sum); x and w rows K apart. pf: as the AVX2 version below. */
static inline __attribute__((always_inline)) void lin_tile(const float *x, int64_t K, int mr, const void *w, int bf16,
                                                           int nr, const float *bias, float *y, int64_t ldy,
                                                           const char *pf) {
    const int64_t es = bf16 ? 2 : 4;
    __m512 acc[BI_MR][BI_NR];
    for (int m = 0; m < BI_MR; m++)
        for (int n = 0; n < BI_NR; n++) acc[m][n] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (bf16) {
        for (int64_t k = 0; k < K; k += 32) {
            if (pf)
                for (int64_t l = 0; l < BI_NR * 32 * 2; l += 64) _mm_prefetch(pf + BI_NR * k * 2 + l, _MM_HINT_T0);
            const int64_t left = K - k;
            const __mmask32 mk = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
            __m512bh wv[BI_NR];
            for (int n = 0; n < BI_NR; n++)
                if (n < nr) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mk, (const uint16_t *)w + n * K + k);
            for (int m = 0; m < BI_MR; m++) {
                if (m < mr) {
                    const __m512 lo = ldw16(x + m * K, 0, k, left), hi = ldw16(x + m * K, 0, k + 16, left - 16);
                    const __m512bh xv = _mm512_cvtne2ps_pbh(hi, lo);
                    for (int n = 0; n < BI_NR; n++)
                        if (n < nr) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
                }
            }
        }
    }
    for (int64_t k = 0; !bf16 && k < K; k += 16) {
#else
    for (int64_t k = 0; k < K; k += 16) {
#endif
        if (pf)  /* the next tile (BI_NR rows back to back) at BI_NR times this tile's pace: read by the end */
            for (int64_t l = 0; l < BI_NR * 16 * es; l += 64) _mm_prefetch(pf + BI_NR * k * es + l, _MM_HINT_T0);
        __m512 wv[BI_NR];
        for (int n = 0; n < BI_NR; n++)
            if (n < nr) wv[n] = ldw16(w, bf16, n * K + k, K - k);
        for (int m = 0; m < BI_MR; m++) {
            if (m < mr) {
                const __m512 xv = ldw16(x + m * K, 0, k, K - k);
                for (int n = 0; n < BI_NR; n++)
                    if (n < nr) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            float s = _mm512_reduce_add_ps(acc[m][n]);
            if (bias) s += bias[n];
            y[m * ldy + n] = s;
        }
}
#else
#define BI_MR 3  /* input rows per linear tile: 12 accumulators of 16 registers */

/* y[m * ldy + n] = dot(x row m, w row n) (+ bias[n]) for m < mr, n < nr (AVX2 variants: the 8-lane order of the
 * header); x and w rows K apart. pf: the next tile's weights, streamed into cache while this one computes (a
 * weight read from memory: the hardware prefetcher alone leaves the loads and the FMAs serialised, as qlinear.c
 * measured), or NULL. Always inlined with constant bf16 (and, for full tiles, constant mr / nr). */
static inline __attribute__((always_inline)) void lin_tile(const float *x, int64_t K, int mr, const void *w, int bf16,
                                                           int nr, const float *bias, float *y, int64_t ldy,
                                                           const char *pf) {
    const int64_t es = bf16 ? 2 : 4;
    __m256 acc[BI_MR][BI_NR];
    for (int m = 0; m < BI_MR; m++)
        for (int n = 0; n < BI_NR; n++) acc[m][n] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        if (pf && (k & 15) == 0)  /* the next tile (BI_NR rows back to back) at BI_NR times this tile's pace */
            for (int64_t l = 0; l < BI_NR * 16 * es; l += 64) _mm_prefetch(pf + BI_NR * k * es + l, _MM_HINT_T0);
        __m256 wv[BI_NR];
        for (int n = 0; n < BI_NR; n++)
            if (n < nr) wv[n] = ldw8(w, bf16, n * K + k);
        for (int m = 0; m < BI_MR; m++) {
            if (m < mr) {
                const __m256 xv = _mm256_loadu_ps(x + m * K + k);
                for (int n = 0; n < BI_NR; n++)
                    if (n < nr) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            float s = hsum256(acc[m][n]);
            for (int64_t k = K8; k < K; k++) s += x[m * K + k] * ldw1(w, bf16, n * K + k);
            if (bias) s += bias[n];
            y[m * ldy + n] = s;
        }
}
#endif

static void lin_tiles(const float *x, int64_t M, int64_t K, const void *w, int bf16, int64_t N, const float *bias,
                      float *y, int64_t t0, int64_t t1) {
    const size_t es = bf16 ? 2 : 4;
    for (int64_t mb = 0; mb < M; mb += BI_MB) {
        const int64_t me = M - mb < BI_MB ? M : mb + BI_MB;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n0 = t * BI_NR;
            const int nr = (int)(N - n0 < BI_NR ? N - n0 : BI_NR);
            const void *wt = (const char *)w + (size_t)(n0 * K) * es;
            const float *b = bias ? bias + n0 : NULL;
            for (int64_t m0 = mb; m0 < me; m0 += BI_MR) {
                const int mr = (int)(me - m0 < BI_MR ? me - m0 : BI_MR);
                const float *xm = x + m0 * K;
                float *ym = y + m0 * N + n0;
                /* the first rows read the tile from memory: they prefetch the next one (past the end: harmless) */
                const char *pf = m0 == mb ? (const char *)wt + (size_t)(BI_NR * K) * es : NULL;
                if (bf16) {
                    if (mr == BI_MR && nr == BI_NR) lin_tile(xm, K, BI_MR, wt, 1, BI_NR, b, ym, N, pf);
                    else if (mr == 1 && nr == BI_NR) lin_tile(xm, K, 1, wt, 1, BI_NR, b, ym, N, pf);
                    else lin_tile(xm, K, mr, wt, 1, nr, b, ym, N, pf);
                } else {
                    if (mr == BI_MR && nr == BI_NR) lin_tile(xm, K, BI_MR, wt, 0, BI_NR, b, ym, N, pf);
                    else if (mr == 1 && nr == BI_NR) lin_tile(xm, K, 1, wt, 0, BI_NR, b, ym, N, pf);
                    else lin_tile(xm, K, mr, wt, 0, nr, b, ym, N, pf);
                }
            }
        }
    }
}

/* y (M, N) fp32 = x (M, K) fp32 @ w^T + bias: w (N, K) fp32 (w_bf16 == 0) or bf16 (w_bf16 == 1), bias fp32 (N)
 * or NULL; all contiguous. Each thread takes a contiguous range of 4-column tiles. */
void baige_bi_linear(const float *x, int64_t M, int64_t K, const void *w, int w_bf16, int64_t N, const float *bias,
                     float *y, int nthreads) {
    const int64_t tiles = (N + BI_NR - 1) / BI_NR;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && tiles > 1)
    {
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int64_t nt = 1, id = 0;
#endif
        const int64_t per = (tiles + nt - 1) / nt, t0 = id * per, t1 = t0 + per < tiles ? t0 + per : tiles;
        if (t0 < t1) lin_tiles(x, M, K, w, w_bf16, N, bias, y, t0, t1);
    }
}

/* 8 (one) K/V values from element i of an fp32, fp16 or bf16 cache (KV_F32 | KV_F16 | KV_BF16), as fp32. */
static inline __attribute__((always_inline)) __m256 ldkv8(const void *base, int kv, int64_t i) {
    if (kv == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    if (kv == KV_BF16) return bf16x8_to_f32((const uint16_t *)base + i);
    return _mm256_loadu_ps((const float *)base + i);
}

static inline __attribute__((always_inline)) float ldkv1(const void *base, int kv, int64_t i) {
    if (kv == KV_F16) return _cvtsh_ss(((const uint16_t *)base)[i]);
    if (kv == KV_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/* out[c0 + 8 i ..] (nc chunks of 8 columns) = sum_j p[j] v_j (in key order) / l, v_j found through table. */
static inline __attribute__((always_inline)) void pv_chunks(const float *p, const void *vh, int kv,
                                                            const int64_t *table, int64_t bs, int64_t d, int64_t L,
                                                            int64_t c0, int nc, float l, float *out) {
    __m256 o[8];
    for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const int64_t at = (table[j / bs] * bs + j % bs) * d + c0;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < 8; i++)
            if (i < nc) o[i] = _mm256_fmadd_ps(pj, ldkv8(vh, kv, at + 8 * i), o[i]);
    }
    const __m256 lv = _mm256_set1_ps(l);
    for (int i = 0; i < nc; i++) _mm256_storeu_ps(out + c0 + 8 * i, _mm256_div_ps(o[i], lv));
}

/* One query head q (d) over its L keys (module comment's order); p: L + 8 floats of scratch. */
static inline __attribute__((always_inline)) void attend_row(const float *q, const void *kh, const void *vh, int kv,
                                                             const int64_t *table, int64_t bs, int64_t d, int64_t L,
                                                             float scale, float *p, float *out) {
    const int64_t d8 = d & ~(int64_t)7;
    float m = -INFINITY;
    for (int64_t j = 0; j < L; j++) {
        const int64_t at = (table[j / bs] * bs + j % bs) * d;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < d8; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), ldkv8(kh, kv, at + c), acc);
        float s = hsum256(acc);
        for (int64_t c = d8; c < d; c++) s += q[c] * ldkv1(kh, kv, at + c);
        s *= scale;
        p[j] = s;
        m = s > m ? s : m;
    }
    const __m256 mv = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) _mm256_storeu_ps(p + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv)));
    if (j < L) {  /* the last values through the same lanes' polynomial, padded */
        float t[8] = {0};
        memcpy(t, p + j, sizeof(float) * (size_t)(L - j));
        _mm256_storeu_ps(t, exp256(_mm256_sub_ps(_mm256_loadu_ps(t), mv)));
        memcpy(p + j, t, sizeof(float) * (size_t)(L - j));
    }
    float l = 0.0f;
    for (j = 0; j < L; j++) l += p[j];
    int64_t c0 = 0;
    for (; c0 + 64 <= d8; c0 += 64) pv_chunks(p, vh, kv, table, bs, d, L, c0, 8, l, out);
    for (; c0 < d8; c0 += 8) pv_chunks(p, vh, kv, table, bs, d, L, c0, 1, l, out);
    for (int64_t c = d8; c < d; c++) {
        float acc = 0.0f;
        for (j = 0; j < L; j++) acc += p[j] * ldkv1(vh, kv, (table[j / bs] * bs + j % bs) * d + c);
        out[c] = acc / l;
    }
}

/* Causal attention of S query rows over paged K/V: q, out (S, hq, d) fp32 contiguous; caches (hk, num_blocks, bs,
 * d) of kv_dtype (KV_F32 | KV_F16 | KV_BF16); row s reads block-table row table_of_row[s] (NULL: row s) of
 * tables (P, W) int64 and its first lens[s] >= 1 keys; query head h uses KV head h / (hq / hk). Returns 0, or -1
 * when a thread's score buffer cannot be allocated (out is then unspecified). */
int baige_bi_attention(const float *q, int64_t S, int64_t hq, int64_t hk, int64_t d, const void *k_cache,
                       const void *v_cache, int kv_dtype, int64_t num_blocks, int64_t bs, const int64_t *tables,
                       int64_t W, const int64_t *table_of_row, const int64_t *lens, float scale, float *out,
                       int nthreads) {
    const int64_t group = hq / hk;
    int64_t max_len = 1;
    for (int64_t s = 0; s < S; s++) max_len = lens[s] > max_len ? lens[s] : max_len;
    const size_t es = kv_dtype == KV_F32 ? 4 : 2;
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && S * hq > 1)
    {
        float *p = malloc(sizeof(float) * (size_t)(max_len + 8));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < S * hq; item++) {
            if (!p) {
#pragma omp atomic write
                rc = -1;
                continue;
            }
            const int64_t s = item / hq, h = item % hq;
            const int64_t *table = tables + (table_of_row ? table_of_row[s] : s) * W;
            const size_t base = (size_t)((h / group) * num_blocks * bs * d) * es;  /* this KV head's pool */
            const void *kh = (const char *)k_cache + base, *vh = (const char *)v_cache + base;
            const float *qh = q + item * d;
            float *oh = out + item * d;
            if (kv_dtype == KV_F16) attend_row(qh, kh, vh, KV_F16, table, bs, d, lens[s], scale, p, oh);
            else if (kv_dtype == KV_BF16) attend_row(qh, kh, vh, KV_BF16, table, bs, d, lens[s], scale, p, oh);
            else attend_row(qh, kh, vh, KV_F32, table, bs, d, lens[s], scale, p, oh);
        }
        free(p);
    }
    return rc;
}

/* out[r] = sum_i x[r, i]^2 for rows of n values (contiguous), the dot-product order above. */
void baige_bi_sumsq(const float *x, int64_t rows, int64_t n, float *out, int nthreads) {
    const int64_t n8 = n & ~(int64_t)7;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows * n > 65536) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float s = hsum256(acc);
        for (int64_t i = n8; i < n; i++) s += xr[i] * xr[i];
        out[r] = s;
    }
}

/* out[i] = g[i] / (1 + exp256(-g[i])) for n values, lane by lane (the last n % 8 through padded lanes). */
void baige_bi_silu(const float *g, int64_t n, float *out, int nthreads) {
    const int64_t chunks = (n + 7) / 8;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n > 65536) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i = 8 * c, left = n - i;
        float t[8] = {0};
        const float *src = g + i;
        if (left < 8) {
            memcpy(t, g + i, sizeof(float) * (size_t)left);
            src = t;
        }
        const __m256 v = _mm256_loadu_ps(src);
        const __m256 r = _mm256_div_ps(v, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, v))));
        if (left < 8) {
            _mm256_storeu_ps(t, r);
            memcpy(out + i, t, sizeof(float) * (size_t)left);
        } else {
            _mm256_storeu_ps(out + i, r);
        }
    }
}
