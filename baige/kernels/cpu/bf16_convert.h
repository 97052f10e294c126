/* bf16 <-> fp32 for the native kernels (ops.c, qlinear.c): bf16 is the upper 16 bits of an IEEE fp32,
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

#endif
