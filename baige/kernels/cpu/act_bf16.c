/* The elementwise ops of a bf16 model's prefill on bf16 tensors: SwiGLU's silu(gate) * up, RMSNorm,
 * residual add + RMSNorm and rotate-half RoPE. Each replaces 4-8 eager PyTorch ops, each a full pass over a (tokens, hidden
 * or intermediate) bf16 tensor (together a visible share of a bf16 offline-throughput run in the profiles:
 * docs/benchmarks/archive.md, "Start-up, page faults and bf16 prefill ops" and "bf16 prefill on AMX:
 * attention, RoPE, K/V stores, quantized prefill"), with one pass in fp32 registers.
 *
 * Roundings follow baige/kernels/reference.py on bf16 tensors, which rounds each torch op's fp32 result
 * to bf16 (nearest even): silu(g) is rounded before the multiply by u; the norm rounds x * inv before
 * the weight multiply; the residual sum is rounded before its statistics; RoPE rounds x * cos and
 * rotate_half(x) * sin, then their sum. A product of two bf16 values
 * is exact in fp32, so those multiplies round exactly as torch's do; silu's exp and the mean square's
 * summation order differ from torch's in the last fp32 bits, below one bf16 rounding step.
 * Large tensors are split over OpenMP threads (elements of silu_mul, rows of the norms) with results
 * independent of the thread count; contiguous rows. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16_convert.h"
#include "vec_math.h"

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* out[j] = bf16(bf16(silu(g[j])) * u[j]) for j < n; silu(x) = x / (1 + exp(-x)). The AVX-512 variants
 * take 16 lanes at a time with the same arithmetic per lane (exp512 is exp256's scheme), so every
 * variant writes the same bits; on AVX2 the 8-lane loop does it all. */
static void silu_mul_span(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *out) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16)
        store_bf16x16(out + j, _mm512_mul_ps(round_bf16x16(silu512(bf16x16_to_f32(g + j))), bf16x16_to_f32(u + j)));
#endif
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 x = bf16x8_to_f32(g + j);
        const __m256 s = round_bf16x8(_mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)))));
        store_bf16x8(out + j, _mm256_mul_ps(s, bf16x8_to_f32(u + j)));
    }
    for (; j < n; j++) {
        const float x = bf16_to_f32(g[j]);
        out[j] = f32_to_bf16(round_bf16(x / (1.0f + expf(-x))) * bf16_to_f32(u[j]));
    }
}

/* Work below this many elements stays on one thread (an OpenMP fork costs more than it saves). */
#define PAR_MIN 65536
/* Elements per thread chunk of silu_mul: a multiple of 8, so only the last n % 8 elements take the
 * scalar tail, as on one thread: the result does not depend on the thread count. */
#define SPAN 8192

/* silu_mul_span over n elements, in SPAN chunks on up to nthreads OpenMP threads. */
void baige_silu_mul_bf16(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *out, int nthreads) {
    const int64_t chunks = (n + SPAN - 1) / SPAN;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n >= PAR_MIN) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t j0 = c * SPAN, len = n - j0 < SPAN ? n - j0 : SPAN;
        silu_mul_span(g + j0, u + j0, len, out + j0);
    }
}

/* One row of n: out = bf16(w * bf16(x * inv)), inv = 1 / sqrt(mean(x^2) + eps), statistics in fp32. */
static void norm_row(const uint16_t *x, int64_t n, const uint16_t *w, float eps, uint16_t *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = bf16x8_to_f32(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float ss = hsum256(acc);
    for (int64_t t = i; t < n; t++) ss += bf16_to_f32(x[t]) * bf16_to_f32(x[t]);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        store_bf16x8(out + i, _mm256_mul_ps(bf16x8_to_f32(w + i), round_bf16x8(_mm256_mul_ps(bf16x8_to_f32(x + i), iv))));
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * inv));
}

/* RMSNorm of rows x[r] of n bf16 values (row stride n), weight w bf16 (n), into out; rows spread over up to
 * nthreads OpenMP threads. */
void baige_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w, float eps, uint16_t *out,
                         int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows > 1 && rows * n >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, n, w, eps, out + r * n);
}

/* sum = bf16(x + res); out = RMSNorm(sum), row by row (the sum still in cache for its statistics); rows
 * spread over up to nthreads OpenMP threads. */
void baige_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, int64_t rows, int64_t n, const uint16_t *w,
                             float eps, uint16_t *out, uint16_t *sum, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows > 1 && rows * n >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *a = x + r * n, *b = res + r * n;
        uint16_t *s = sum + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) store_bf16x8(s + i, _mm256_add_ps(bf16x8_to_f32(a + i), bf16x8_to_f32(b + i)));
        for (; i < n; i++) s[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
        norm_row(s, n, w, eps, out + r * n);
    }
}

/* out[i] = bf16(bf16(x[i] * c[i]) + bf16(sign * x[i + off] * s[i])) for i in [i0, i1): one half of a
 * rotate-half RoPE head (sign -1, off +h for the first half; +1, -h for the second). Every variant
 * does the same exact products and the same two roundings per lane, so all write the same bits. */
static void rope_span(const uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t i0, int64_t i1,
                      int64_t off, float sign, uint16_t *out) {
    int64_t i = i0;
#if defined(__AVX512F__)
    const __m512 sg16 = _mm512_set1_ps(sign);
    for (; i + 16 <= i1; i += 16) {
        const __m512 a = round_bf16x16(_mm512_mul_ps(bf16x16_to_f32(x + i), bf16x16_to_f32(c + i)));
        const __m512 b = round_bf16x16(_mm512_mul_ps(_mm512_mul_ps(sg16, bf16x16_to_f32(x + i + off)), bf16x16_to_f32(s + i)));
        store_bf16x16(out + i, _mm512_add_ps(a, b));
    }
#endif
    const __m256 sg = _mm256_set1_ps(sign);
    for (; i + 8 <= i1; i += 8) {
        const __m256 a = round_bf16x8(_mm256_mul_ps(bf16x8_to_f32(x + i), bf16x8_to_f32(c + i)));
        const __m256 b = round_bf16x8(_mm256_mul_ps(_mm256_mul_ps(sg, bf16x8_to_f32(x + i + off)), bf16x8_to_f32(s + i)));
        store_bf16x8(out + i, _mm256_add_ps(a, b));
    }
    for (; i < i1; i++)
        out[i] = f32_to_bf16(round_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])) +
                             round_bf16(sign * bf16_to_f32(x[i + off]) * bf16_to_f32(s[i])));
}

/* Rotate-half RoPE (HF's convention; reference.apply_rope) on bf16 q: (tokens, hq, d) and k: (tokens, hk, d),
 * cos/sin: (tokens, d), all contiguous, d even: with h = d / 2, out[i] = x[i] cos[i] - x[i + h] sin[i] and
 * out[i + h] = x[i + h] cos[i + h] + x[i] sin[i + h], rounded as the reference's bf16 ops (see the top).
 * Tokens spread over up to nthreads OpenMP threads; the result does not depend on the thread count. */
void baige_rope_bf16(const uint16_t *q, const uint16_t *k, int64_t tokens, int64_t hq, int64_t hk, int64_t d,
                     const uint16_t *cos_, const uint16_t *sin_, uint16_t *q_out, uint16_t *k_out, int nthreads) {
    const int64_t h = d / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && tokens > 1 && tokens * (hq + hk) * d >= PAR_MIN) \
    schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos_ + t * d, *s = sin_ + t * d;
        for (int64_t j = 0; j < hq + hk; j++) {
            const uint16_t *x = j < hq ? q + (t * hq + j) * d : k + (t * hk + j - hq) * d;
            uint16_t *o = j < hq ? q_out + (t * hq + j) * d : k_out + (t * hk + j - hq) * d;
            rope_span(x, c, s, 0, h, h, -1.0f, o);
            rope_span(x, c, s, h, d, -h, 1.0f, o);
        }
    }
}
