/* fp32 CPU kernels for the small per-layer ops of a decode step. Each replaces 5-15 eager PyTorch
 * ops (a few microseconds of dispatch each) with one call; the arithmetic follows the reference in
 * baige/kernels/reference.py operation by operation (built with -ffp-contract=off so no FMA merges
 * two roundings where the reference has two). Single-threaded; the caller passes contiguous rows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* sum of a[i] * b[i], 8 fp32 lanes then a scalar tail */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
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

/* k, v: (tokens, hk, d) contiguous; caches (hk, slots, d) with slots = num_blocks * block_size;
 * token t goes to slot slot_mapping[t] (negative: skipped, the padding convention). */
void baige_store_kv(const float *k, const float *v, int64_t tokens, int64_t hk, int64_t d, float *k_cache,
                    float *v_cache, int64_t slots, const int64_t *slot_mapping) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        for (int64_t j = 0; j < hk; j++) {
            const float *ks = k + (t * hk + j) * d, *vs = v + (t * hk + j) * d;
            float *kd = k_cache + (j * slots + slot) * d, *vd = v_cache + (j * slots + slot) * d;
            for (int64_t i = 0; i < d; i++) { kd[i] = ks[i]; vd[i] = vs[i]; }
        }
    }
}

/* Decode attention over paged K/V read in place (no gather). q, out: (S, hq, d); caches
 * (hk, num_blocks, bs, d); block_tables (S, W) int64; context_lens (S,) int64. Query head j uses KV
 * head j / (hq / hk). Softmax with the running max subtracted (exact, two passes over the scores).
 * Returns 0, or -1 when a scratch allocation fails (out is then unspecified). */
int baige_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, int64_t S,
                                 int64_t hq, int64_t hk, int64_t d, int64_t num_blocks, int64_t bs,
                                 const int64_t *block_tables, int64_t W, const int64_t *context_lens, float scale,
                                 float *out) {
    const int64_t group = hq / hk;
    int64_t max_len = 0;
    for (int64_t s = 0; s < S; s++) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    float *p = malloc(sizeof(float) * (size_t)(group * (max_len > 0 ? max_len : 1)));
    if (!p) return -1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = context_lens[s];
        const int64_t *table = block_tables + s * W;
        for (int64_t g = 0; g < hk; g++) {
            const float *kh = k_cache + g * num_blocks * bs * d, *vh = v_cache + g * num_blocks * bs * d;
            const float *qg = q + (s * hq + g * group) * d;
            float *og = out + (s * hq + g * group) * d;
            for (int64_t pos = 0; pos < L; pos++) {
                const float *kp = kh + (table[pos / bs] * bs + pos % bs) * d;
                for (int64_t j = 0; j < group; j++) p[j * L + pos] = dot_f32(qg + j * d, kp, d) * scale;
            }
            for (int64_t j = 0; j < group; j++) {
                float *pj = p + j * L, m = -INFINITY, sum = 0.0f;
                for (int64_t pos = 0; pos < L; pos++) m = pj[pos] > m ? pj[pos] : m;
                for (int64_t pos = 0; pos < L; pos++) { pj[pos] = expf(pj[pos] - m); sum += pj[pos]; }
                const float inv = 1.0f / sum;
                for (int64_t pos = 0; pos < L; pos++) pj[pos] *= inv;
                for (int64_t i = 0; i < d; i++) og[j * d + i] = 0.0f;
            }
            for (int64_t pos = 0; pos < L; pos++) {
                const float *vp = vh + (table[pos / bs] * bs + pos % bs) * d;
                for (int64_t j = 0; j < group; j++) {
                    const float w = p[j * L + pos];
                    float *o = og + j * d;
                    for (int64_t i = 0; i < d; i++) o[i] += w * vp[i];
                }
            }
        }
    }
    free(p);
    return 0;
}
