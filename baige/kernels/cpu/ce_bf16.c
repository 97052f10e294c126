/* The row pass of the fused linear + cross-entropy on bf16 logits (kernels/ce_cpu.py; the PyTorch twin is
 * _ce_rows_torch in kernels/reference.py): for each row of a (n, vocab) bf16 logit chunk, its loss
 * lse - z[target] in fp32 and, in place of the logits, the bf16 gradient scale * (softmax(z) - one_hot(target)).
 * PyTorch spends six full passes on this (the cast to fp32, logsumexp's max and sum, the subtraction, exp, the
 * scale and the cast back), each over an fp32 (n, vocab) tensor that leaves the cache; here each row makes
 * three passes over its own bf16 values while they stay in L2: the max, the sum of exp(z - max), and the
 * gradient exp(z - lse) * scale (lse = max + log(sum)), the target's element taking (p - 1) * scale.
 *
 * Numbers: the exp is vec_math.h's (relative error < 2e-7, torch's is Sleef's), the sum is taken in 16 (or 8)
 * fp32 lanes and then across them, so the loss and the gradient agree with the PyTorch twin to a few fp32 ulps
 * before the gradient's rounding to bf16 (nearest even). A row whose target is ignore_index has loss 0 and a
 * zero gradient. Rows are split over OpenMP threads; each row's arithmetic does not depend on the thread count. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16_convert.h"
#include "vec_math.h"

static float row_max(const uint16_t *z, int64_t V) {
    int64_t j = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= V; j += 16) m16 = _mm512_max_ps(m16, bf16x16_to_f32(z + j));
    m = _mm512_reduce_max_ps(m16);
#endif
    __m256 m8 = _mm256_set1_ps(m);
    for (; j + 8 <= V; j += 8) m8 = _mm256_max_ps(m8, bf16x8_to_f32(z + j));
    m = hmax256(m8);
    for (; j < V; j++) m = fmaxf(m, bf16_to_f32(z[j]));
    return m;
}

/* sum over the row of exp(z - m) */
static float row_sumexp(const uint16_t *z, int64_t V, float m) {
    int64_t j = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    const __m512 m16 = _mm512_set1_ps(m);
    __m512 s16 = _mm512_setzero_ps();
    for (; j + 16 <= V; j += 16) s16 = _mm512_add_ps(s16, exp512(_mm512_sub_ps(bf16x16_to_f32(z + j), m16)));
    s = _mm512_reduce_add_ps(s16);
#endif
    const __m256 m8 = _mm256_set1_ps(m);
    __m256 s8 = _mm256_setzero_ps();
    for (; j + 8 <= V; j += 8) s8 = _mm256_add_ps(s8, exp256(_mm256_sub_ps(bf16x8_to_f32(z + j), m8)));
    s += hsum256(s8);
    for (; j < V; j++) s += expf(bf16_to_f32(z[j]) - m);
    return s;
}

/* z[j] = bf16(exp(z[j] - lse) * scale) over the row, in place */
static void row_grad(uint16_t *z, int64_t V, float lse, float scale) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 l16 = _mm512_set1_ps(lse), c16 = _mm512_set1_ps(scale);
    for (; j + 16 <= V; j += 16)
        store_bf16x16(z + j, _mm512_mul_ps(exp512(_mm512_sub_ps(bf16x16_to_f32(z + j), l16)), c16));
#endif
    const __m256 l8 = _mm256_set1_ps(lse), c8 = _mm256_set1_ps(scale);
    for (; j + 8 <= V; j += 8) store_bf16x8(z + j, _mm256_mul_ps(exp256(_mm256_sub_ps(bf16x8_to_f32(z + j), l8)), c8));
    for (; j < V; j++) z[j] = f32_to_bf16(expf(bf16_to_f32(z[j]) - lse) * scale);
}

/* logits: (n, V) bf16, row-major, overwritten with the gradient when want_grad (left as they are otherwise);
 * targets: (n,) int64 in [0, V) or ignore_index; scale: (n,) fp32, d(loss) / d(row loss); loss: (n,) fp32 out. */
void baige_ce_rows_bf16(uint16_t *logits, int64_t n, int64_t V, const int64_t *targets, int64_t ignore_index,
                        const float *scale, int want_grad, float *loss, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n > 1) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint16_t *z = logits + i * V;
        const int64_t t = targets[i];
        if (t == ignore_index) {
            loss[i] = 0.0f;
            if (want_grad)
                for (int64_t j = 0; j < V; j++) z[j] = 0;
            continue;
        }
        const float m = row_max(z, V);
        const float lse = m + logf(row_sumexp(z, V, m));
        const float zt = bf16_to_f32(z[t]);
        loss[i] = lse - zt;
        if (want_grad) {
            row_grad(z, V, lse, scale[i]);
            z[t] = f32_to_bf16((expf(zt - lse) - 1.0f) * scale[i]);
        }
    }
}
