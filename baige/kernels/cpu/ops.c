/* fp32 CPU kernels for the small per-layer ops of a decode step. Each replaces 5-15 eager PyTorch
 * ops (each paying PyTorch's per-op dispatch) with one call; the arithmetic follows the reference in
 * baige/kernels/reference.py operation by operation (built with -ffp-contract=off so no FMA merges
 * two roundings where the reference has two). Single-threaded; the caller passes contiguous rows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#include "bf16_convert.h"
#include "kv_cache.h"
#include "vec_math.h"

/* The instruction-set variant this copy was compiled for (baige/kernels/cpu/isa.py's names), from the
 * compiler's own feature macros: what the library really targets, whatever its file is called. */
const char *baige_isa(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return "avx512_amx";
#elif defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512VNNI__)
    return "avx512_vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return "avx512";
#elif defined(__AVXVNNI__)
    return "avx2_vnni";
#else
    return "avx2";
#endif
}

/* sum of a[i] * b[i], 8 fp32 lanes then a scalar tail */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float r = hsum256(acc);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* out[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) for rows x[r] of n values (row stride n). */
void baige_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        const float inv = 1.0f / sqrtf(dot_f32(xr, xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* sum = x + res; out = rms_norm(sum). */
void baige_add_rms_norm(const float *x, const float *res, int64_t rows, int64_t n, const float *w, float eps,
                        float *out, float *sum) {
    for (int64_t r = 0; r < rows; r++) {
        float *s = sum + r * n;
        for (int64_t i = 0; i < n; i++) s[i] = x[r * n + i] + res[r * n + i];
    }
    baige_rms_norm(sum, rows, n, w, eps, out);
}

/* Rotate-half RoPE of one (heads, d) token block: with h = d / 2,
 * out[i] = x[i] * c[i] + (-x[i + h]) * s[i], out[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h]. */
static void rope_heads(const float *x, int64_t heads, int64_t d, const float *c, const float *s, float *out) {
    const int64_t h = d / 2;
    for (int64_t j = 0; j < heads; j++) {
        const float *xj = x + j * d;
        float *oj = out + j * d;
        for (int64_t i = 0; i < h; i++) {
            const float a = xj[i] * c[i], b = -xj[i + h] * s[i];
            oj[i] = a + b;
        }
        for (int64_t i = h; i < d; i++) {
            const float a = xj[i] * c[i], b = xj[i - h] * s[i];
            oj[i] = a + b;
        }
    }
}

/* q: (tokens, hq, d), k: (tokens, hk, d), cos/sin: (tokens, d); all contiguous. */
void baige_rope(const float *q, const float *k, int64_t tokens, int64_t hq, int64_t hk, int64_t d,
                const float *cos_, const float *sin_, float *q_out, float *k_out) {
    for (int64_t t = 0; t < tokens; t++) {
        rope_heads(q + t * hq * d, hq, d, cos_ + t * d, sin_ + t * d, q_out + t * hq * d);
        rope_heads(k + t * hk * d, hk, d, cos_ + t * d, sin_ + t * d, k_out + t * hk * d);
    }
}

/* k, v: (tokens, hk, d) contiguous fp32; caches (hk, slots, d) with slots = num_blocks * block_size,
 * fp32 (kv_dtype KV_F32), IEEE fp16 (KV_F16) or bf16 (KV_BF16), both rounded to nearest even as
 * torch's .to(float16 / bfloat16); token t goes to slot slot_mapping[t] (negative: skipped, the
 * padding convention). */
void baige_store_kv(const float *k, const float *v, int64_t tokens, int64_t hk, int64_t d, void *k_cache,
                    void *v_cache, int64_t slots, const int64_t *slot_mapping, int kv_dtype) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        for (int64_t j = 0; j < hk; j++) {
            const float *ks = k + (t * hk + j) * d, *vs = v + (t * hk + j) * d;
            const int64_t at = (j * slots + slot) * d;
            if (kv_dtype == KV_BF16) {
                uint16_t *kd = (uint16_t *)k_cache + at, *vd = (uint16_t *)v_cache + at;
                int64_t i = 0;
                for (; i + 8 <= d; i += 8) {
                    store_bf16x8(kd + i, _mm256_loadu_ps(ks + i));
                    store_bf16x8(vd + i, _mm256_loadu_ps(vs + i));
                }
                for (; i < d; i++) { kd[i] = f32_to_bf16(ks[i]); vd[i] = f32_to_bf16(vs[i]); }
            } else if (kv_dtype == KV_F16) {
                uint16_t *kd = (uint16_t *)k_cache + at, *vd = (uint16_t *)v_cache + at;
                int64_t i = 0;
                for (; i + 8 <= d; i += 8) {
                    _mm_storeu_si128((__m128i *)(kd + i), _mm256_cvtps_ph(_mm256_loadu_ps(ks + i), _MM_FROUND_TO_NEAREST_INT));
                    _mm_storeu_si128((__m128i *)(vd + i), _mm256_cvtps_ph(_mm256_loadu_ps(vs + i), _MM_FROUND_TO_NEAREST_INT));
                }
                for (; i < d; i++) { kd[i] = _cvtss_sh(ks[i], 0); vd[i] = _cvtss_sh(vs[i], 0); }
            } else {
                float *kd = (float *)k_cache + at, *vd = (float *)v_cache + at;
                for (int64_t i = 0; i < d; i++) { kd[i] = ks[i]; vd[i] = vs[i]; }
            }
        }
    }
}

/* k, v: (tokens, hk, d) contiguous, already in the caches' dtype (elem bytes per value: a bf16 model's K/V
 * into its bf16 cache); caches and slot_mapping as baige_store_kv. Row copies: what the reference's
 * index_copy_ writes, without its per-call dispatch. */
void baige_store_kv_same(const void *k, const void *v, int64_t tokens, int64_t hk, int64_t d, int64_t elem,
                         void *k_cache, void *v_cache, int64_t slots, const int64_t *slot_mapping) {
    const size_t row = (size_t)(d * elem);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        for (int64_t j = 0; j < hk; j++) {
            const size_t from = (size_t)(t * hk + j) * row, at = (size_t)(j * slots + slot) * row;
            memcpy((char *)k_cache + at, (const char *)k + from, row);
            memcpy((char *)v_cache + at, (const char *)v + from, row);
        }
    }
}

/* out[j] = silu(g[j]) * u[j] = g[j] / (1 + exp(-g[j])) * u[j] for j < n, the vector exp above. */
void baige_silu_mul(const float *g, const float *u, int64_t n, float *out) {
    int64_t j = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(g + j);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
    for (; j < n; j++) out[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* Greedy sampling's argmax: out[r] = the first index of the largest of row r's n values (x row stride
 * ld, n >= 1), a NaN counting as larger than any number, so a row with NaNs gets its first NaN:
 * torch.argmax's result (its reduction treats NaN as the maximum; ties go to the first index).
 * Two passes of 8 lanes (the row's maximum, then where it first occurs) instead of PyTorch's
 * index-tracking reduction, which is several times slower on a vocabulary-wide row (measured:
 * docs/benchmarks/archive.md, "Native MoE decode step, few-row per-op linears, constant tile rows"). */
void baige_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ld;
        __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 a = _mm256_loadu_ps(v + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, a);
        }
        float lanes[8], m = -INFINITY;
        _mm256_storeu_ps(lanes, mx);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (; i < n; i++) {
            if (v[i] != v[i]) has_nan = 1;
            else if (v[i] > m) m = v[i];
        }
        int64_t at = -1;
        if (has_nan) {
            for (at = 0; v[at] == v[at]; at++) {}
        } else {  /* m is one of the values: where it first occurs, 8 at a time, then in the tail */
            const __m256 mv = _mm256_set1_ps(m);
            for (int64_t b = 0; b + 8 <= n && at < 0; b += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + b), mv, _CMP_EQ_OQ));
                if (hit) at = b + __builtin_ctz((unsigned)hit);
            }
            if (at < 0)
                for (at = n & ~(int64_t)7; v[at] != m; at++) {}
        }
        out[r] = at;
    }
}

/* Inverse-transform sampling's draw (runtime/infer/sampling.py, _inverse_transform): for row r of p
 * (rows x n, row stride ld, non-negative fp32), the running sums c_i = p_0 + ... + p_i in float64,
 * added one at a time in vocabulary order (so bitwise torch's CPU cumsum of p.double(), which adds
 * sequentially), x = (1 - u[r]) * c_{n-1}, and out[r] = the first i with c_i >= x (torch.searchsorted's
 * left side on the non-decreasing c), n - 1 if none. Rows go ICDF_ROWS at a time, one independent
 * float64 chain per row (a single chain is bound by the add's latency), and nothing n-wide is stored.
 * Returns 1 when some row's total is not finite (a NaN or infinite mass: the caller takes torch's
 * path, whose searchsorted places NaNs its own way), else 0. */
#define ICDF_ROWS 8
int baige_inverse_cdf_rows(const float *p, int64_t rows, int64_t n, int64_t ld, const double *u, int64_t *out) {
    int bad = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += ICDF_ROWS) {
        const int m = rows - r0 < ICDF_ROWS ? (int)(rows - r0) : ICDF_ROWS;
        const float *v[ICDF_ROWS];
        double c[ICDF_ROWS], x[ICDF_ROWS];
        int64_t at[ICDF_ROWS];
        for (int k = 0; k < ICDF_ROWS; k++) {  /* a short last block repeats its first row */
            v[k] = p + (r0 + (k < m ? k : 0)) * ld;
            c[k] = 0.0;
            at[k] = -1;
        }
        for (int64_t i = 0; i < n; i++)
            for (int k = 0; k < ICDF_ROWS; k++) c[k] += (double)v[k][i];
        for (int k = 0; k < m; k++) {
            if (!isfinite(c[k])) bad = 1;
            x[k] = (1.0 - u[r0 + k]) * c[k];
            c[k] = 0.0;
        }
        int left = m;
        for (int64_t i = 0; i < n && left > 0; i++)
            for (int k = 0; k < m; k++) {
                c[k] += (double)v[k][i];
                if (at[k] < 0 && c[k] >= x[k]) {
                    at[k] = i;
                    left--;
                }
            }
        for (int k = 0; k < m; k++) out[r0 + k] = at[k] < 0 ? n - 1 : at[k];
    }
    return bad;
}
