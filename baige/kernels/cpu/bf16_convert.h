/* bf16 <-> fp32 for the native kernels (ops.c, qlinear.c, act_bf16.c): bf16 is the upper 16 bits of an IEEE fp32,
 * so widening is exact; narrowing rounds to nearest even as torch does (c10::BFloat16's
 * round_to_nearest_even), a NaN staying a quiet NaN. */
#ifndef BAIGE_BF16_CONVERT_H
#define BAIGE_BF16_CONVERT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 8 bf16 at p -> 8 fp32: widened to 32 bits and shifted into the upper half */
static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 fp32 rounded to bf16 (nearest even; NaN -> quiet NaN, as f32_to_bf16), still as fp32 bit patterns */
static inline __m256i bf16_bits(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                                       _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

/* x rounded to bf16 and back, in 8 lanes */
static inline __m256 round_bf16x8(__m256 x) { return _mm256_castsi256_ps(bf16_bits(x)); }

/* 8 fp32 -> 8 bf16 at p, rounded as above */
static inline void store_bf16x8(uint16_t *p, __m256 x) {
    const __m256i r = _mm256_srli_epi32(bf16_bits(x), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#if defined(__AVX512F__)
/* The 16-lane twins of the three above: the same bits lane by lane. */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512i bf16_bits16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
                                       _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

static inline __m512 round_bf16x16(__m512 x) { return _mm512_castsi512_ps(bf16_bits16(x)); }

static inline void store_bf16x16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(x), 16)));
}
#endif

#endif
