/* What qdot.c (the integer-dot kernels) and qdot_amx.c (the same dot products on AMX-INT8 tiles) share:
 * the block and tile sizes of the repacked layout (see qdot.c's header), the group-scale load, the last
 * step of every weight tile (a row's passes summed, the int8 scale, the bias), and qdot_amx.c's entry points. */
#ifndef BAIGE_QDOT_H
#define BAIGE_QDOT_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16_convert.h"

#define QB 32 /* activation block: columns per int8 block and per scale */
#define RT 16 /* weight rows per repacked tile */

/* 16 group scales from sr (fp32, or bf16 when sbf: widened exactly, bf16 being fp32's top half) starting at
 * element i */
#if defined(__AVX512F__)
static inline __m512 scales16(const void *sr, int sbf, int64_t i) {
    if (sbf) return bf16x16_to_f32((const uint16_t *)sr + i);
    return _mm512_loadu_ps((const float *)sr + i);
}
#endif

/* y rows (m + i) / passes, i < mr, columns n0 .. n0 + nr, from one weight tile's sums out (rows of RT): a
 * row's passes added (side by side in out), times the int8 scale (bits 8), plus the bias (or NULL) */
static inline void store_rows(int bits, int passes, const float *out, int64_t m, int64_t mr, int64_t n0, int64_t nr,
                              const float *scale, const float *bias, float *y, int64_t ldy) {
    for (int64_t i = 0; i < mr; i += passes)
        for (int64_t r = 0; r < nr; r++) {
            float v = out[i * RT + r];
            if (passes == 2) v += out[(i + 1) * RT + r];
            if (bits == 8) v *= scale[n0 + r];
            y[(m + i) / passes * ldy + n0 + r] = v + (bias ? bias[n0 + r] : 0.0f);
        }
}

/* qdot_amx.c: whether the tiles are there (the variant has AMX-INT8 and the OS granted them), and qdot.c's
 * run() on them for R activation rows allocated up to a multiple of 32 (the rows past R zero), called inside
 * qdot.c's parallel region */
int baige_qdot_amx_ready(void);
void baige_qdot_amx_run(int bits, int passes, const int8_t *xq, const float *d, const int32_t *qs, const float *cg,
                        int64_t R, int64_t nb, const uint8_t *wr, int64_t N, const float *scale, const void *sr,
                        int sbf, const float *zr, int64_t G, int64_t bpg, const float *bias, float *y, int64_t ldy);

#endif
