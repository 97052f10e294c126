/* Paged attention over the KV cache on the CPU (decode steps, and prefill chunks passed as one query
 * row per token): K/V blocks are read in place through the block tables, fp32 / fp16 / bf16 caches
 * converted in registers, fp32 math throughout. Two code paths with the same arithmetic up to the
 * order of the fp32 sums: 8-lane AVX2 (every variant; any head size), and, in the AVX-512 variants
 * for head sizes that are a multiple of 16, 16-lane kernels that score four keys for up to four query
 * heads of a GQA group per K load (the 16 partial sums of a 4 x 4 tile reduced by one shuffle tree)
 * and sum V for up to four heads per V load. In the avx512_amx variant the scores of bf16 caches (head
 * sizes a multiple of 32, blocks of a multiple of 16) come from the AMX tiles instead (attention_amx.c,
 * the query rounded to bf16 there).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_convert.h"
#include "kv_cache.h"
#include "vec_math.h"

/* In place: p[0..n) <- softmax(p[0..n)) (max subtracted; vector exp above). */
static void softmax_inplace(float *p, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + i));
    float m = hmax256(mv);
    for (; i < n; i++) m = p[i] > m ? p[i] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), mb));
        _mm256_storeu_ps(p + i, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum256(sv);
    for (; i < n; i++) {
        const __m256 e = exp256(_mm256_set1_ps(p[i] - m));
        p[i] = _mm256_cvtss_f32(e);
        sum += p[i];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), inv));
    for (; i < n; i++) p[i] *= 1.0f / sum;
}

/* Lane i of the result is the sum of the 8 lanes of a_i. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* 8 K/V values from element i of an fp32 (KV_F32), fp16 (KV_F16) or bf16 (KV_BF16) cache, as fp32;
 * and one. The readers below are always inlined and every call site passes a constant kv, so each
 * gets its own loop: 16-bit values are converted in registers, never through a buffer. */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int kv, int64_t i) {
    if (kv == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    if (kv == KV_BF16) return bf16x8_to_f32((const uint16_t *)base + i);
    return _mm256_loadu_ps((const float *)base + i);
}

static inline __attribute__((always_inline)) float load1(const void *base, int kv, int64_t i) {
    if (kv == KV_F16) return _cvtsh_ss(((const uint16_t *)base)[i]);
    if (kv == KV_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/* sc[i] = scale * q . kb[i] for the rows i < rows of one block (rows contiguous, d apart). Head dims
 * that are a multiple of 8: four rows at a time, each q vector loaded once for the four. */
static inline __attribute__((always_inline)) void qk_rows(const float *q, const void *kb, int kv, int64_t rows,
                                                          int64_t d, float scale, float *sc) {
    int64_t i = 0;
    if ((d & 7) == 0) {
        for (; i + 4 <= rows; i += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < d; c += 8) {
                const __m256 qv = _mm256_loadu_ps(q + c);
                a0 = _mm256_fmadd_ps(qv, load8(kb, kv, i * d + c), a0);
                a1 = _mm256_fmadd_ps(qv, load8(kb, kv, (i + 1) * d + c), a1);
                a2 = _mm256_fmadd_ps(qv, load8(kb, kv, (i + 2) * d + c), a2);
                a3 = _mm256_fmadd_ps(qv, load8(kb, kv, (i + 3) * d + c), a3);
            }
            _mm_storeu_ps(sc + i, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        }
    }
    for (; i < rows; i++) {
        float acc = 0.0f;
        for (int64_t c = 0; c < d; c++) acc += q[c] * load1(kb, kv, i * d + c);
        sc[i] = acc * scale;
    }
}

/* qk_rows for three query heads sharing one K block (a GQA group), d a multiple of 8, the block fp32
 * or fp16 (converted in registers, once for the three heads): two rows x three heads per step, so
 * each K vector is loaded once for the three (5 loads per 6 FMAs instead of 5 per 4). Always
 * inlined like the readers above. */
static inline __attribute__((always_inline)) void qk_rows3(const float *const q[3], const void *kb, int kv,
                                                           int64_t rows, int64_t d, float scale, float *const sc[3]) {
    const __m128 sv = _mm_set1_ps(scale);
    int64_t i = 0;
    for (; i + 2 <= rows; i += 2) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        for (int64_t c = 0; c < d; c += 8) {
            const __m256 x0 = load8(kb, kv, i * d + c), x1 = load8(kb, kv, (i + 1) * d + c);
            __m256 qv = _mm256_loadu_ps(q[0] + c);
            a00 = _mm256_fmadd_ps(qv, x0, a00);
            a01 = _mm256_fmadd_ps(qv, x1, a01);
            qv = _mm256_loadu_ps(q[1] + c);
            a10 = _mm256_fmadd_ps(qv, x0, a10);
            a11 = _mm256_fmadd_ps(qv, x1, a11);
            qv = _mm256_loadu_ps(q[2] + c);
            a20 = _mm256_fmadd_ps(qv, x0, a20);
            a21 = _mm256_fmadd_ps(qv, x1, a21);
        }
        float r[8];
        _mm_storeu_ps(r, _mm_mul_ps(hsum4(a00, a01, a10, a11), sv));
        _mm_storeu_ps(r + 4, _mm_mul_ps(hsum4(a20, a21, a20, a21), sv));
        sc[0][i] = r[0], sc[0][i + 1] = r[1], sc[1][i] = r[2], sc[1][i + 1] = r[3];
        sc[2][i] = r[4], sc[2][i + 1] = r[5];
    }
    for (; i < rows; i++)
        for (int j = 0; j < 3; j++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < d; c++) acc += q[j][c] * load1(kb, kv, i * d + c);
            sc[j][i] = acc * scale;
        }
}

/* out[0..d) = sum_pos w[pos] * V[pos] for pos < L, V's rows found block by block through table.
 * Accumulators stay in registers across all blocks: 64 columns at a time in eight 8-lane registers,
 * then 8 at a time, then a scalar tail. */
static inline __attribute__((always_inline)) void pv_sum(const float *w, const void *vh, int kv,
                                                         const int64_t *table, int64_t bs, int64_t d, int64_t L,
                                                         float *out) {
    int64_t c0 = 0;
    for (; c0 + 64 <= d; c0 += 64) {
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
        for (int64_t b0 = 0; b0 < L; b0 += bs) {
            const int64_t at = table[b0 / bs] * bs * d + c0;  /* this block's first row */
            const int64_t rows = L - b0 < bs ? L - b0 : bs;
            for (int64_t i = 0; i < rows; i++) {
                const int64_t r = at + i * d;
                const __m256 wb = _mm256_set1_ps(w[b0 + i]);
                o0 = _mm256_fmadd_ps(wb, load8(vh, kv, r), o0);
                o1 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 8), o1);
                o2 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 16), o2);
                o3 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 24), o3);
                o4 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 32), o4);
                o5 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 40), o5);
                o6 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 48), o6);
                o7 = _mm256_fmadd_ps(wb, load8(vh, kv, r + 56), o7);
            }
        }
        _mm256_storeu_ps(out + c0, o0); _mm256_storeu_ps(out + c0 + 8, o1);
        _mm256_storeu_ps(out + c0 + 16, o2); _mm256_storeu_ps(out + c0 + 24, o3);
        _mm256_storeu_ps(out + c0 + 32, o4); _mm256_storeu_ps(out + c0 + 40, o5);
        _mm256_storeu_ps(out + c0 + 48, o6); _mm256_storeu_ps(out + c0 + 56, o7);
    }
    for (; c0 + 8 <= d; c0 += 8) {
        __m256 o0 = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 < L; b0 += bs) {
            const int64_t at = table[b0 / bs] * bs * d + c0;
            const int64_t rows = L - b0 < bs ? L - b0 : bs;
            for (int64_t i = 0; i < rows; i++)
                o0 = _mm256_fmadd_ps(_mm256_set1_ps(w[b0 + i]), load8(vh, kv, at + i * d), o0);
        }
        _mm256_storeu_ps(out + c0, o0);
    }
    for (; c0 < d; c0++) {
        float acc = 0.0f;
        for (int64_t pos = 0; pos < L; pos++) acc += w[pos] * load1(vh, kv, (table[pos / bs] * bs + pos % bs) * d + c0);
        out[c0] = acc;
    }
}

/* pv_sum for three query heads sharing one V (a GQA group), V fp32 or fp16 (converted in registers,
 * once for the three heads): 16 columns x three heads per pass over the rows, so each V vector is
 * loaded once for the three; remaining columns one at a time. */
static inline __attribute__((always_inline)) void pv_sum3(const float *const w[3], const void *vh, int kv,
                                                          const int64_t *table, int64_t bs, int64_t d, int64_t L,
                                                          float *const out[3]) {
    int64_t c0 = 0;
    for (; c0 + 16 <= d; c0 += 16) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        for (int64_t b0 = 0; b0 < L; b0 += bs) {
            const int64_t at = table[b0 / bs] * bs * d + c0;  /* this block's first row */
            const int64_t rows = L - b0 < bs ? L - b0 : bs;
            for (int64_t i = 0; i < rows; i++) {
                const __m256 v0 = load8(vh, kv, at + i * d), v1 = load8(vh, kv, at + i * d + 8);
                __m256 x = _mm256_set1_ps(w[0][b0 + i]);
                a00 = _mm256_fmadd_ps(x, v0, a00);
                a01 = _mm256_fmadd_ps(x, v1, a01);
                x = _mm256_set1_ps(w[1][b0 + i]);
                a10 = _mm256_fmadd_ps(x, v0, a10);
                a11 = _mm256_fmadd_ps(x, v1, a11);
                x = _mm256_set1_ps(w[2][b0 + i]);
                a20 = _mm256_fmadd_ps(x, v0, a20);
                a21 = _mm256_fmadd_ps(x, v1, a21);
            }
        }
        _mm256_storeu_ps(out[0] + c0, a00); _mm256_storeu_ps(out[0] + c0 + 8, a01);
        _mm256_storeu_ps(out[1] + c0, a10); _mm256_storeu_ps(out[1] + c0 + 8, a11);
        _mm256_storeu_ps(out[2] + c0, a20); _mm256_storeu_ps(out[2] + c0 + 8, a21);
    }
    for (; c0 < d; c0++)
        for (int j = 0; j < 3; j++) {
            float acc = 0.0f;
            for (int64_t pos = 0; pos < L; pos++)
                acc += w[j][pos] * load1(vh, kv, (table[pos / bs] * bs + pos % bs) * d + c0);
            out[j][c0] = acc;
        }
}

#if defined(__AVX512F__)
/* 16 K/V values from element i of an fp32, fp16 or bf16 cache, as fp32 (load8's 16-lane twin). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int kv, int64_t i) {
    if (kv == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    if (kv == KV_BF16) return bf16x16_to_f32((const uint16_t *)base + i);
    return _mm512_loadu_ps((const float *)base + i);
}

/* Within each 128-bit lane l: [sum of a0's 4 values in l, a1's, a2's, a3's]. */
static inline __m512 lane_sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);  /* moved as pairs, added as floats */
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
}

/* Lanes 4h..4h+3 of the result: the four lanes-of-128 of u_h summed (u_h from lane_sums4), so lane
 * 4h + r is the full 16-lane sum of head h's accumulator for row r. */
static inline __m512 across_lanes4(__m512 u0, __m512 u1, __m512 u2, __m512 u3) {
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, 0x88), _mm512_shuffle_f32x4(u2, u3, 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

/* sc[h * ss + i] = scale * q_h . kb[i] for the hb <= 4 query heads q_h = q + h * d and the rows i < rows
 * of one block (rows d apart), d a multiple of 16: four rows at a time (a short last group repeats its
 * last row), each K vector loaded and converted once for the hb heads. Always inlined with constant
 * hb and kv, so the 4 x 4 accumulators stay in registers. */
static inline __attribute__((always_inline)) void qk512(const float *q, int hb, const void *kb, int kv,
                                                        int64_t rows, int64_t d, float scale, float *sc, int64_t ss) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < rows; i += 4) {
        const int64_t n = rows - i < 4 ? rows - i : 4;
        int64_t r[4];
        for (int k = 0; k < 4; k++) r[k] = (i + (k < n ? k : n - 1)) * d;
        __m512 a[4][4];
        for (int h = 0; h < 4; h++)
            for (int k = 0; k < 4; k++) a[h][k] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            __m512 x[4];
            for (int k = 0; k < 4; k++) x[k] = load16(kb, kv, r[k] + c);
            for (int h = 0; h < hb; h++) {
                const __m512 qv = _mm512_loadu_ps(q + h * d + c);
                for (int k = 0; k < 4; k++) a[h][k] = _mm512_fmadd_ps(qv, x[k], a[h][k]);
            }
        }
        __m512 u[4];
        for (int h = 0; h < 4; h++) u[h] = h < hb ? lane_sums4(a[h][0], a[h][1], a[h][2], a[h][3]) : _mm512_setzero_ps();
        float t[16];
        _mm512_storeu_ps(t, _mm512_mul_ps(across_lanes4(u[0], u[1], u[2], u[3]), sv));
        for (int h = 0; h < hb; h++)
            for (int64_t k = 0; k < n; k++) sc[h * ss + i + k] = t[h * 4 + k];
    }
}

/* out[h * os + c0 + c] = sum_pos w[h * ws + pos] * V[pos][c0 + c] for the hb <= 4 heads and the
 * 16 * nc columns from c0 (nc <= 4), V's rows found block by block through table: each V vector is
 * loaded and converted once for the hb heads, the hb x nc sums stay in registers across all blocks.
 * Always inlined with constant hb, nc and kv. */
static inline __attribute__((always_inline)) void pv512(const float *w, int64_t ws, int hb, int nc, const void *vh,
                                                        int kv, const int64_t *table, int64_t bs, int64_t d,
                                                        int64_t L, int64_t c0, float *out, int64_t os) {
    __m512 o[4][4];
    for (int h = 0; h < 4; h++)
        for (int c = 0; c < 4; c++) o[h][c] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < L; b0 += bs) {
        const int64_t at = table[b0 / bs] * bs * d + c0;
        const int64_t rows = L - b0 < bs ? L - b0 : bs;
        if (c0 == 0 && b0 + PF_BLOCKS * bs < L) prefetch_block(vh, kv, table[b0 / bs + PF_BLOCKS] * bs * d, bs * d);
        for (int64_t i = 0; i < rows; i++) {
            __m512 v[4];
            for (int c = 0; c < nc; c++) v[c] = load16(vh, kv, at + i * d + 16 * c);
            for (int h = 0; h < hb; h++) {
                const __m512 wb = _mm512_set1_ps(w[h * ws + b0 + i]);
                for (int c = 0; c < nc; c++) o[h][c] = _mm512_fmadd_ps(wb, v[c], o[h][c]);
            }
        }
    }
    for (int h = 0; h < hb; h++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(out + h * os + c0 + 16 * c, o[h][c]);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
int baige_attention_scores_amx(const float *q, int64_t group, const uint16_t *kh, const uint16_t *vh,
                               const int64_t *table, int64_t bs, int64_t d, int64_t L, float scale,
                               float *p);  /* attention_amx.c */
#endif

/* One (sequence, KV head) item on the 16-lane kernels (d a multiple of 16): the group's scores into
 * p (group rows of L), softmax per head, then the weighted V sums into out (group rows of d). kv is a
 * constant at every call site. A function of its own, not inlined into the OpenMP region's outlined
 * body, where GCC compiled it slower (measured: the message of the commit that made it so, 1a9083a). */
static __attribute__((noinline)) void attend512(const float *q, const void *kh, const void *vh, int kv,
                                                            const int64_t *table, int64_t bs, int64_t d, int64_t L,
                                                            int64_t group, float scale, float *p, float *out) {
    int scored = -1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (kv == KV_BF16) scored = baige_attention_scores_amx(q, group, kh, vh, table, bs, d, L, scale, p);
#endif
    for (int64_t b0 = 0; scored != 0 && b0 < L; b0 += bs) {
        const int64_t rows = L - b0 < bs ? L - b0 : bs;
        const void *kb = kv ? (const void *)((const uint16_t *)kh + table[b0 / bs] * bs * d)
                            : (const void *)((const float *)kh + table[b0 / bs] * bs * d);
        const int64_t ahead = b0 / bs + PF_BLOCKS, nblk = (L + bs - 1) / bs;  /* K, then V's first blocks */
        if (ahead < nblk) prefetch_block(kh, kv, table[ahead] * bs * d, bs * d);
        else if (ahead - nblk < nblk) prefetch_block(vh, kv, table[ahead - nblk] * bs * d, bs * d);
        for (int64_t j = 0; j < group; j += 4) {
            const float *qj = q + j * d;
            float *sj = p + j * L + b0;
            switch (group - j < 4 ? group - j : 4) {
                case 1: qk512(qj, 1, kb, kv, rows, d, scale, sj, L); break;
                case 2: qk512(qj, 2, kb, kv, rows, d, scale, sj, L); break;
                case 3: qk512(qj, 3, kb, kv, rows, d, scale, sj, L); break;
                default: qk512(qj, 4, kb, kv, rows, d, scale, sj, L); break;
            }
        }
    }
    for (int64_t j = 0; j < group; j++) softmax_inplace(p + j * L, L);
    for (int64_t j = 0; j < group; j += 4) {
        const float *wj = p + j * L;
        float *oj = out + j * d;
        const int hb = group - j < 4 ? (int)(group - j) : 4;
        int64_t c0 = 0;
        for (; c0 + 64 <= d; c0 += 64)
            switch (hb) {
                case 1: pv512(wj, L, 1, 4, vh, kv, table, bs, d, L, c0, oj, d); break;
                case 2: pv512(wj, L, 2, 4, vh, kv, table, bs, d, L, c0, oj, d); break;
                case 3: pv512(wj, L, 3, 4, vh, kv, table, bs, d, L, c0, oj, d); break;
                default: pv512(wj, L, 4, 4, vh, kv, table, bs, d, L, c0, oj, d); break;
            }
        for (; c0 < d; c0 += 16)
            switch (hb) {
                case 1: pv512(wj, L, 1, 1, vh, kv, table, bs, d, L, c0, oj, d); break;
                case 2: pv512(wj, L, 2, 1, vh, kv, table, bs, d, L, c0, oj, d); break;
                case 3: pv512(wj, L, 3, 1, vh, kv, table, bs, d, L, c0, oj, d); break;
                default: pv512(wj, L, 4, 1, vh, kv, table, bs, d, L, c0, oj, d); break;
            }
    }
}
#endif

/* Decode attention over paged K/V read in place (no gather). q, out: (S, hq, d) fp32; caches
 * (hk, num_blocks, bs, d), fp32, fp16 or bf16 (kv_dtype: KV_F32 | KV_F16 | KV_BF16); block_tables (P, W) int64,
 * row s reading table row table_of_row[s] (NULL: row s; P = S); context_lens (S,) int64.
 * Query head j uses KV head j / (hq / hk). Work item = (sequence, KV head), spread over nthreads
 * OpenMP threads: every block of that head's K is read (and converted from fp16) once for each
 * three query heads of its group (scores by qk_rows3 / qk_rows), softmax per query head with the max
 * subtracted (exact up to the vector exp), then the heads' outputs summed over V three heads at a
 * time by pv_sum3 (the rest by pv_sum). fp16 K/V are converted in registers as they are read;
 * under avx512_amx the scores of bf16 K come from attention_amx.c (q rounded to bf16). Any
 * row may be any query of any sequence, so a prefill chunk can be passed as one row per token (its
 * own length). Returns 0, or -1 when a scratch buffer cannot be allocated (out is then
 * unspecified). */
int baige_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int64_t S,
                                 int64_t hq, int64_t hk, int64_t d, int64_t num_blocks, int64_t bs,
                                 const int64_t *block_tables, int64_t W, const int64_t *table_of_row,
                                 const int64_t *context_lens, float scale, float *out, int kv_dtype, int nthreads) {
    const int64_t group = hq / hk;
    int64_t max_len = 1;
    for (int64_t s = 0; s < S; s++) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && S * hk > 1)
    {
        float *p = malloc(sizeof(float) * (size_t)(group * max_len));  /* this thread's score rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < S * hk; item++) {
            if (!p) {
#pragma omp atomic write
                rc = -1;
                continue;
            }
            const int64_t s = item / hk, g = item % hk, L = context_lens[s];
            const int64_t *table = block_tables + (table_of_row ? table_of_row[s] : s) * W;
            if (item + 1 < S * hk) {  /* the next item's first K blocks, while this one computes */
                const int64_t s1 = (item + 1) / hk, g1 = (item + 1) % hk;
                const int64_t *t1 = block_tables + (table_of_row ? table_of_row[s1] : s1) * W;
                for (int64_t b = 0; b < PF_BLOCKS && b * bs < context_lens[s1]; b++)
                    prefetch_block(k_cache, kv_dtype, (g1 * num_blocks + t1[b]) * bs * d, bs * d);
            }
            const int64_t head0 = s * hq + g * group;  /* first query row of this group */
            const int64_t base = g * num_blocks * bs * d;  /* this KV head's pool, in elements */
            const void *kh = kv_dtype ? (const void *)((const uint16_t *)k_cache + base) : (const float *)k_cache + base;
            const void *vh = kv_dtype ? (const void *)((const uint16_t *)v_cache + base) : (const float *)v_cache + base;
#if defined(__AVX512F__)
            if ((d & 15) == 0) {
                float *oq = out + head0 * d;
                if (kv_dtype == KV_F16) attend512(q + head0 * d, kh, vh, KV_F16, table, bs, d, L, group, scale, p, oq);
                else if (kv_dtype == KV_BF16) attend512(q + head0 * d, kh, vh, KV_BF16, table, bs, d, L, group, scale, p, oq);
                else attend512(q + head0 * d, kh, vh, KV_F32, table, bs, d, L, group, scale, p, oq);
                continue;
            }
#endif
            for (int64_t b0 = 0; b0 < L; b0 += bs) {
                const int64_t rows = L - b0 < bs ? L - b0 : bs;
                if (b0 + bs < L) prefetch_block(k_cache, kv_dtype, base + table[b0 / bs + 1] * bs * d, bs * d);
                else prefetch_block(v_cache, kv_dtype, base + table[0] * bs * d, (L < bs ? L : bs) * d);
                const int64_t at = table[b0 / bs] * bs * d;
                int64_t j = 0;
                for (; (d & 7) == 0 && j + 3 <= group; j += 3) {
                    const float *qs[3] = {q + (head0 + j) * d, q + (head0 + j + 1) * d, q + (head0 + j + 2) * d};
                    float *const sc[3] = {p + j * L + b0, p + (j + 1) * L + b0, p + (j + 2) * L + b0};
                    if (kv_dtype == KV_F16) qk_rows3(qs, (const uint16_t *)kh + at, KV_F16, rows, d, scale, sc);
                    else if (kv_dtype == KV_BF16) qk_rows3(qs, (const uint16_t *)kh + at, KV_BF16, rows, d, scale, sc);
                    else qk_rows3(qs, (const float *)kh + at, KV_F32, rows, d, scale, sc);
                }
                for (; j < group; j++) {
                    const float *qj = q + (head0 + j) * d;
                    float *sj = p + j * L + b0;
                    if (kv_dtype == KV_F16) qk_rows(qj, (const uint16_t *)kh + at, KV_F16, rows, d, scale, sj);
                    else if (kv_dtype == KV_BF16) qk_rows(qj, (const uint16_t *)kh + at, KV_BF16, rows, d, scale, sj);
                    else qk_rows(qj, (const float *)kh + at, KV_F32, rows, d, scale, sj);
                }
            }
            for (int64_t j = 0; j < group; j++) softmax_inplace(p + j * L, L);
            int64_t j = 0;
            for (; j + 3 <= group; j += 3) {
                const float *ws[3] = {p + j * L, p + (j + 1) * L, p + (j + 2) * L};
                float *const os[3] = {out + (head0 + j) * d, out + (head0 + j + 1) * d, out + (head0 + j + 2) * d};
                if (kv_dtype == KV_F16) pv_sum3(ws, vh, KV_F16, table, bs, d, L, os);
                else if (kv_dtype == KV_BF16) pv_sum3(ws, vh, KV_BF16, table, bs, d, L, os);
                else pv_sum3(ws, vh, KV_F32, table, bs, d, L, os);
            }
            for (; j < group; j++) {
                float *oj = out + (head0 + j) * d;
                if (kv_dtype == KV_F16) pv_sum(p + j * L, vh, KV_F16, table, bs, d, L, oj);
                else if (kv_dtype == KV_BF16) pv_sum(p + j * L, vh, KV_BF16, table, bs, d, L, oj);
                else pv_sum(p + j * L, vh, KV_F32, table, bs, d, L, oj);
            }
        }
        free(p);
    }
    return rc;
}


/* In place over p[0..n): scores of positions < off masked (weight 0), the others soft-capped
 * (softcap > 0: c * tanh(x / c)), then the softmax with an optional sink logit in the denominator (sink
 * NULL: none). */
static void softmax_ext(float *p, int64_t n, int64_t off, float softcap, const float *sink) {
    float m = sink ? *sink : -INFINITY;
    for (int64_t i = off; i < n; i++) {
        if (softcap > 0.0f) p[i] = softcap * tanhf(p[i] / softcap);
        m = p[i] > m ? p[i] : m;
    }
    float sum = sink ? expf(*sink - m) : 0.0f;
    for (int64_t i = 0; i < off; i++) p[i] = 0.0f;
    for (int64_t i = off; i < n; i++) {
        p[i] = expf(p[i] - m);
        sum += p[i];
    }
    const float inv = 1.0f / sum;
    for (int64_t i = off; i < n; i++) p[i] *= inv;
}

/* One (sequence, KV head) item of baige_paged_attention_ext: the group's n scores per head from the n
 * keys at table (offset already applied), softmax_ext, the weighted V sums. kv is a constant at every
 * call site. */
static inline __attribute__((always_inline)) void attend_ext(const float *q, const void *kh, const void *vh, int kv,
                                                             const int64_t *table, int64_t bs, int64_t d, int64_t n,
                                                             int64_t off, int64_t group, float scale, float softcap,
                                                             const float *sinks, float *p, float *out) {
    for (int64_t b0 = 0; b0 < n; b0 += bs) {
        const int64_t rows = n - b0 < bs ? n - b0 : bs;
        const int64_t at = table[b0 / bs] * bs * d;
        const void *kb = kv ? (const void *)((const uint16_t *)kh + at) : (const void *)((const float *)kh + at);
        for (int64_t j = 0; j < group; j++) qk_rows(q + j * d, kb, kv, rows, d, scale, p + j * n + b0);
    }
    for (int64_t j = 0; j < group; j++) {
        softmax_ext(p + j * n, n, off, softcap, sinks ? sinks + j : NULL);
        pv_sum(p + j * n, vh, kv, table, bs, d, n, out + j * d);
    }
}

/* baige_paged_decode_attention (same arguments and layout) with the attention variants of issue #47, on the
 * 8-lane kernels: window > 0: row s sees its last `window` keys only -- reading starts at the block holding
 * key L - window, so the blocks before it are never read (their table entries may be any id) and the keys
 * before L - window in that block get weight 0; sinks (hq,) fp32 or NULL: per query head a logit in the
 * softmax denominator with no value (gpt-oss); softcap > 0: scores c * tanh(score / c) before the mask
 * (Gemma 2). Returns 0, or -1 when a scratch buffer cannot be allocated. */
int baige_paged_attention_ext(const float *q, const void *k_cache, const void *v_cache, int64_t S, int64_t hq,
                              int64_t hk, int64_t d, int64_t num_blocks, int64_t bs, const int64_t *block_tables,
                              int64_t W, const int64_t *table_of_row, const int64_t *context_lens, float scale,
                              int64_t window, const float *sinks, float softcap, float *out, int kv_dtype,
                              int nthreads) {
    const int64_t group = hq / hk;
    int64_t max_len = 1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = context_lens[s], n = window > 0 && L > window ? window + bs : L;
        max_len = n > max_len ? n : max_len;
    }
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && S * hk > 1)
    {
        float *p = malloc(sizeof(float) * (size_t)(group * max_len));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < S * hk; item++) {
            if (!p) {
#pragma omp atomic write
                rc = -1;
                continue;
            }
            const int64_t s = item / hk, g = item % hk, L = context_lens[s];
            const int64_t start = window > 0 && L > window ? L - window : 0, first = start / bs;
            const int64_t *table = block_tables + (table_of_row ? table_of_row[s] : s) * W + first;
            const int64_t n = L - first * bs, off = start - first * bs, head0 = s * hq + g * group;
            const int64_t base = g * num_blocks * bs * d;
            const void *kh = kv_dtype ? (const void *)((const uint16_t *)k_cache + base) : (const float *)k_cache + base;
            const void *vh = kv_dtype ? (const void *)((const uint16_t *)v_cache + base) : (const float *)v_cache + base;
            const float *qs = q + head0 * d, *sk = sinks ? sinks + g * group : NULL;
            float *os = out + head0 * d;
            if (kv_dtype == KV_F16) attend_ext(qs, kh, vh, KV_F16, table, bs, d, n, off, group, scale, softcap, sk, p, os);
            else if (kv_dtype == KV_BF16)
                attend_ext(qs, kh, vh, KV_BF16, table, bs, d, n, off, group, scale, softcap, sk, p, os);
            else attend_ext(qs, kh, vh, KV_F32, table, bs, d, n, off, group, scale, softcap, sk, p, os);
        }
        free(p);
    }
    return rc;
}
