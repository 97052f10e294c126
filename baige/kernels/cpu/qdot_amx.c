/* qdot.c's integer dot products on AMX-INT8 tiles, for calls of many activation rows (the batched decode
 * steps and prefill chunks of int8 / int4 checkpoints under the ``avx512_amx`` variant).
 *
 * Same inputs and the same arithmetic as qdot.c's tile kernels (see its header: weights repacked into
 * tiles of 16 rows interleaved 4 bytes at a time, activations quantized in blocks of 32 columns), only
 * the block dot products move to the tiles: per 16 weight rows (a tile t), 16 activation rows and one
 * 32-column block b, one TDPBSUD (Intel SDM vol. 1 ch. 18; signed activation bytes x unsigned weight
 * bytes, exact int32 sums of 4 products) computes the 16 x 16 block dots at once, where the VNNI kernel
 * needs 8 vpdpbusd per activation row. A = 16 activation rows x the block's 32 bytes, read in place
 * (row stride nb * 32); B = 8 rows x 64 bytes, row j holding bytes 4j..4j+3 of the block for 16 weight
 * rows -- exactly one int8 block of the repacked layout (512 contiguous bytes); for int4, a block's
 * four 64-byte words unpacked to their low and high nibbles (rows 2j and 2j + 1, the activation order
 * qdot.c's int4 quantization uses). Each block's int32 tile is stored, the zero offset taken off in
 * int32 (the VNNI kernel's accumulator start) and added into fp32 accumulators with the same FMA, in
 * the same block order, as qdot.c's 512-bit kernel -- so the results are bit for bit those of the
 * ``avx512_bf16`` variant (tested).
 *
 * The tiles are configured here (not amx_tiles.h's all-16x64 configuration): tiles 0-3 the int32
 * results (16 x 64 bytes), 4-5 A (16 rows x 32 bytes), 6-7 B (8 rows x 64 bytes): per block, two weight tiles
 * x 32 activation rows, four products from two A and two B loads. The tile work is short next to its
 * latency (load -> TDPBSUD -> store, in order); one weight tile x 32 rows, with or without the next block
 * issued before this one's store, ran no faster than the VNNI kernel; two weight tiles ran faster than it
 * at 16-64 rows (measured: docs/benchmarks/archive.md, "The least time any schedule needs, AMX-INT8
 * integer dots").
 */
#include <immintrin.h>
#include <stdint.h>

#include "qdot.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"

int baige_qdot_amx_ready(void) { return amx_permitted(); }

static inline void configure_int8_tiles(void) {
    /* in .rodata, as amx_tiles.h's configure_tiles (a stack copy has been seen optimised away) */
    static const tile_config cfg __attribute__((aligned(64))) = {
        .palette_id = 1,
        .colsb = {64, 64, 64, 64, 32, 32, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 8, 8},
    };
    _tile_loadconfig(&cfg);
}

/* block b's B operand of tile w: int8 in place; int4 unpacked into buf (8 rows of 64 bytes) */
static inline const uint8_t *b_operand(int bits, const uint8_t *w, int64_t b, uint8_t *buf) {
    if (bits == 8) return w + b * 8 * 64;
    const uint8_t *wb = w + b * 4 * 64;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * j));
        _mm512_store_si512((void *)(buf + 128 * j), _mm512_and_si512(v, lo4));
        _mm512_store_si512((void *)(buf + 128 * j + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
    }
    return buf;
}

/* for the 16 activation rows m of one row half and both weight tiles (stored int32 tiles c0, c1; fp32 sums
 * acc0, acc1 in memory, 16 rows of 16): acc[m] += d_b(m) * s_g (int4: sv0, sv1) * (c[m] - off * qs_b(m)) --
 * qdot.c's per-block step, its operations in its order */
static inline __attribute__((always_inline)) void fold2(float *acc0, float *acc1, const int32_t *c0, const int32_t *c1,
                                                        int off, const float *d, const int32_t *qs, int64_t nb,
                                                        int64_t b, int bits, __m512 sv0, __m512 sv1) {
    for (int m = 0; m < 16; m++) {
        const __m512i o = _mm512_set1_epi32(off * qs[m * nb + b]);
        const __m512 dm = _mm512_set1_ps(d[m * nb + b]);
        const __m512 t0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512((const void *)(c0 + 16 * m)), o));
        const __m512 t1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512((const void *)(c1 + 16 * m)), o));
        _mm512_store_ps(acc0 + 16 * m, _mm512_fmadd_ps(t0, bits == 8 ? dm : _mm512_mul_ps(sv0, dm),
                                                       _mm512_load_ps(acc0 + 16 * m)));
        _mm512_store_ps(acc1 + 16 * m, _mm512_fmadd_ps(t1, bits == 8 ? dm : _mm512_mul_ps(sv1, dm),
                                                       _mm512_load_ps(acc1 + 16 * m)));
    }
}

/* two weight tiles (w0, w1: 16 rows each, their int4 scales s0, s1 and zero-point sums z0, z1) against 32
 * activation rows (xq row stride nb * 32; d, qs row stride nb; cg row stride G) -> out0, out1 (32, RT) each:
 * qdot.c's tile() on the AMX tiles, four 16 x 16 products per block (tiles 0-3) from two A (4-5: the row
 * halves) and two B tiles (6-7: the weight tiles) */
static inline __attribute__((always_inline)) void amx_tile2(const int bits, const uint8_t *w0, const uint8_t *w1,
                                                            int64_t nb, const int8_t *xq, const float *d,
                                                            const int32_t *qs, const void *s0, const void *s1, int sbf,
                                                            const float *z0, const float *z1, const float *cg,
                                                            int64_t G, int64_t bpg, float *out0, float *out1) {
    int32_t c[4][16 * 16] __attribute__((aligned(64)));
    uint8_t buf[2][512] __attribute__((aligned(64)));
    for (int i = 0; i < 32 * RT; i += 16) {
        _mm512_store_ps(out0 + i, _mm512_setzero_ps());
        _mm512_store_ps(out1 + i, _mm512_setzero_ps());
    }
    const int off = bits == 8 ? 128 : 8;
    const int64_t ldq = nb * QB;
    int64_t g = 0, left = bpg;
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(6, b_operand(bits, w0, b, buf[0]), 64);
        _tile_loadd(7, b_operand(bits, w1, b, buf[1]), 64);
        _tile_loadd(4, xq + b * QB, ldq);
        _tile_loadd(5, xq + 16 * ldq + b * QB, ldq);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 5, 6);
        _tile_dpbsud(2, 4, 7);
        _tile_dpbsud(3, 5, 7);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        const __m512 sv0 = bits == 4 ? scales16(s0, sbf, g * RT) : _mm512_setzero_ps();
        const __m512 sv1 = bits == 4 ? scales16(s1, sbf, g * RT) : _mm512_setzero_ps();
        fold2(out0, out1, c[0], c[2], off, d, qs, nb, b, bits, sv0, sv1);
        fold2(out0 + 16 * RT, out1 + 16 * RT, c[1], c[3], off, d + 16 * nb, qs + 16 * nb, nb, b, bits, sv0, sv1);
        if (bits == 4 && --left == 0) { g++; left = bpg; }
    }
    if (z0)
        for (int64_t gg = 0; gg < G; gg++) {
            const __m512 zv0 = _mm512_loadu_ps(z0 + gg * RT), zv1 = _mm512_loadu_ps(z1 + gg * RT);
            for (int m = 0; m < 32; m++) {
                const __m512 cm = _mm512_set1_ps(cg[m * G + gg]);
                _mm512_store_ps(out0 + m * RT, _mm512_fnmadd_ps(zv0, cm, _mm512_load_ps(out0 + m * RT)));
                _mm512_store_ps(out1 + m * RT, _mm512_fnmadd_ps(zv1, cm, _mm512_load_ps(out1 + m * RT)));
            }
        }
}

/* qdot.c's run() on the tiles: R activation rows (allocated up to a multiple of 32, the rows past R zero),
 * called inside qdot.c's parallel region (an orphaned `omp for` over pairs of weight tiles; each thread
 * configures and releases its own tiles; an odd last tile is paired with itself). */
void baige_qdot_amx_run(int bits, int passes, const int8_t *xq, const float *d, const int32_t *qs, const float *cg,
                        int64_t R, int64_t nb, const uint8_t *wr, int64_t N, const float *scale, const void *sr,
                        int sbf, const float *zr, int64_t G, int64_t bpg, const float *bias, float *y, int64_t ldy) {
    const int64_t T = (N + RT - 1) / RT, step = (bits == 8 ? 8 : 4) * 64 * nb, pairs = (T + 1) / 2;
    configure_int8_tiles();
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        float out0[32 * RT] __attribute__((aligned(64))), out1[32 * RT] __attribute__((aligned(64)));
        const int64_t t0 = 2 * p, t1 = t0 + 1 < T ? t0 + 1 : t0;
        const uint8_t *w0 = wr + t0 * step, *w1 = wr + t1 * step;
        const int64_t es = sbf ? 2 : 4;
        const void *s0 = bits == 4 ? (const char *)sr + es * t0 * G * RT : NULL;
        const void *s1 = bits == 4 ? (const char *)sr + es * t1 * G * RT : NULL;
        const float *z0 = zr ? zr + t0 * G * RT : NULL, *z1 = zr ? zr + t1 * G * RT : NULL;
        for (int64_t m = 0; m < R; m += 32) {
            const int8_t *xm = xq + m * nb * QB;
            const float *dm = d + m * nb, *cm = cg ? cg + m * G : NULL;
            const int32_t *qm = qs + m * nb;
            if (bits == 8) amx_tile2(8, w0, w1, nb, xm, dm, qm, NULL, NULL, 0, NULL, NULL, NULL, 0, 1, out0, out1);
            else amx_tile2(4, w0, w1, nb, xm, dm, qm, s0, s1, sbf, z0, z1, cm, G, bpg, out0, out1);
            const int64_t mr = R - m < 32 ? R - m : 32;
            store_rows(bits, passes, out0, m, mr, t0 * RT, N - t0 * RT < RT ? N - t0 * RT : RT, scale, bias, y, ldy);
            if (t1 != t0)
                store_rows(bits, passes, out1, m, mr, t1 * RT, N - t1 * RT < RT ? N - t1 * RT : RT, scale, bias, y,
                           ldy);
        }
    }
    _tile_release();
}

#else

int baige_qdot_amx_ready(void) { return 0; }

/* never called: qdot.c asks baige_qdot_amx_ready() first */
void baige_qdot_amx_run(int bits, int passes, const int8_t *xq, const float *d, const int32_t *qs, const float *cg,
                        int64_t R, int64_t nb, const uint8_t *wr, int64_t N, const float *scale, const void *sr,
                        int sbf, const float *zr, int64_t G, int64_t bpg, const float *bias, float *y, int64_t ldy) {}

#endif
