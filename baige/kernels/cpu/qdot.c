/* Integer-dot quantized linears for x86-64 (AVX2 baseline; AVX-512 VNNI / AVX-VNNI when the variant
 * is compiled with them): y = x @ W^T + bias where the activations are quantized on the fly to int8
 * in blocks of QB = 32 columns, so each 32-column block of a weight row is one u8 x s8 dot product
 * with int32 accumulation (llama.cpp's scheme for its Q8_0 / Q4_0 dot products, ggml-cpu's
 * quants.c), and scales are applied per block in fp32.
 *
 * Weights come repacked (baige/kernels/cpu/qlinear.py: repack_int8 / repack_int4) into tiles of RT = 16
 * rows interleaved 4 bytes at a time, so one vector holds the same 4 bytes of 16 (512-bit) or 8
 * (256-bit) rows: a dot-product instruction against a broadcast group of 4 activations advances 16
 * rows at once, each lane one output row, and no horizontal sum is needed (the layout of llama.cpp's
 * repacked Q4_0x8 GEMV, ggml-cpu/arch/x86/repack.cpp). A tile's bytes are contiguous, read in address order.
 *   int8: wr uint8 (T, nb, 8, RT, 4), T = ceil(N / 16), nb = ceil(K / 32):
 *         byte [t][b][j][r][i] = w[16t + r][32b + 4j + i] + 128 (128 = 0 past N or K); scale fp32 (N).
 *   int4: wr int32 words (T, nb, 4, RT): word [t][b][j][r] = compressed-tensors word 4b + j of row 16t + r
 *         (8 nibbles, element e in bits 4e, stored q + 8; 0x88888888 past N or K); sr fp32, or bf16 when
 *         the scales are bf16 (a bf16 model's: read as they are, half the bytes), (T, G, RT) group scales (0 past N); zr fp32 (T, G, RT) scale * zero point, or NULL (symmetric).
 *         K a multiple of 8, group size gs a multiple of 32.
 *
 * Activation quantization (per x row m and block b = columns 32b..32b+31, zero-padded past K):
 *   amax = max |x|, d = amax / 127, q = rint(x * (d ? 1 / d : 0)) (round half to even), all fp32,
 * so |q| <= 127. With two passes (the default, BAIGE_CPU_INT_DOT_PASSES=2) the residual r = x - q * d
 * (fp32 product, fp32 difference) is quantized the same way to (q2, d2) and becomes the next activation
 * row, dotted with the same weight tiles (x ~ q d + q2 d2: |error| <= d2 / 2 <= amax / 64516, about
 * 16-bit activations for twice the dot products; one pass is llama.cpp's Q8_0 rounding, whose
 * perplexity cost on the embedded model exceeded the +0.2% target; measured: docs/benchmarks/archive.md,
 * "CPU against llama.cpp at equal bits").
 * kernels/reference.py (quantize_activation_residual, quantized_linear_int_dot) does the same fp32 ops,
 * so q and d are bit-identical there and the tests compare the rest of the math against fp64. For int4 each
 * group of 8 columns is stored as its 4 even columns then its 4 odd ones, the order of a word's low
 * and high nibbles.
 *
 * int8:  y = scale[n] * sum_b d_b * (q_b . w_b) + bias. The stored bytes are u = w + 128 (unsigned), so
 *        q . w = q . u - 128 * sum(q): the int32 accumulator of a block starts at -128 * sum(q_b).
 *        Without VNNI (maddubs would saturate at 255 * 127 * 2) the bytes go back to w = u ^ 0x80 and
 *        llama.cpp's sign trick multiplies |w| (unsigned, <= 128) by sign(w) * q (|.| <= 127).
 * int4:  with the stored nibbles u = q_w + 8 and s, z the group's scale and zero point:
 *        y = sum_b d_b * s_g(b) * (q_b . u_b - 8 * sum(q_b)) - sum_g s_g z_g C_g + bias,
 *        C_g = sum_{b in g} d_b * sum(q_b); the 8 is taken off in int32 per block (accumulator start).
 * Without VNNI the u8 x s8 dot is maddubs (pairs to int16) + madd with ones. Each output row's
 * arithmetic is the same whatever the tile, the batch or the thread count, so a row's result does
 * not depend on the other rows of the batch.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_convert.h"
#include "qdot.h"
#include "vec_math.h"
/* The software prefetch distance in bytes along the tile stream (past a tile's end it reads the next
 * tile or the next matrix's neighbour: a prefetch never faults). On an AMD EPYC (Zen 4) an int4 matrix
 * streams faster with it and an int8 one slower, while on an Intel Xeon (Sapphire Rapids class) int8
 * decode is faster with it (the int8 measurements: docs/benchmarks/archive.md, "AMX attention scores,
 * int8 prefetch on Intel"): int4 always prefetches, int8 where baige_set_int8_prefetch switched it on
 * (isa.int8_prefetch, per CPU vendor). */
#ifndef PF_AHEAD
#define PF_AHEAD 4096
#endif
#ifdef PF_NONE
#define PREFETCH(p, n) ((void)0)
#else
#define PREFETCH(p, n) for (int i_ = 0; i_ < (n); i_ += 64) _mm_prefetch((const char *)((p) + PF_AHEAD + i_), _MM_HINT_T0)
#endif

static int int8_prefetch;  /* set once when the library is loaded (build.py) */

/* qdot_amx.c: the same dot products on AMX-INT8 tiles (bit for bit the 512-bit kernel's results), taken by
 * calls of at least AMX_QDOT_MIN_ROWS activation rows (passes x rows) where the variant has the tiles and
 * the OS grants them */
#ifndef AMX_QDOT_MIN_ROWS
#define AMX_QDOT_MIN_ROWS 32
#endif

/* the fewest activation rows (passes x rows) a call needs to take the AMX tiles here; 0 where it never does */
int baige_qdot_amx_rows(void) { return baige_qdot_amx_ready() ? AMX_QDOT_MIN_ROWS : 0; }

void baige_set_int8_prefetch(int on) { int8_prefetch = on; }

static inline int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One block of 32 fp32 values t -> o (32 int8; int4 order when perm), *d and *qsum (the sum of the q);
 * resid (32 fp32, or NULL): t - q * d, each product and difference rounded to fp32 (no FMA). */
static void quantize_block(const float *t, int perm, int8_t *o, float *d, int32_t *qsum, float *resid) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same fp32 operations 16 lanes at a time; the int8 bytes leave through vpmovdb (exact: |q| <= 127)
     * and, for int4's order, one byte shuffle per 8 columns (even columns, then odd) */
    const __m512 v0 = _mm512_loadu_ps(t), v1 = _mm512_loadu_ps(t + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    if (resid) {
        _mm512_storeu_ps(resid, _mm512_sub_ps(v0, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), _mm512_set1_ps(db))));
        _mm512_storeu_ps(resid + 16, _mm512_sub_ps(v1, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(db))));
    }
    __m256i b = _mm256_set_m128i(_mm512_cvtepi32_epi8(q1), _mm512_cvtepi32_epi8(q0));
    if (perm)
        b = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                                    0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    _mm256_storeu_si256((__m256i *)o, b);
    *d = db;
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(t + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
    }
    const float amax = hmax256(mx), db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    __m256i q[4];
    for (int i = 0; i < 4; i++) {  /* cvtps rounds to nearest even (the default MXCSR mode) */
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        if (resid)
            _mm256_storeu_ps(resid + 8 * i, _mm256_sub_ps(v[i], _mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(db))));
    }
    /* int32 -> int8 (exact: |q| <= 127): the two packs leave 4-byte runs in the 128-bit lane order
     * q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] q1[4:8] q2[4:8] q3[4:8]; one dword permute restores columns */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (perm)
        b = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                                    0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    _mm256_storeu_si256((__m256i *)o, b);
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *d = db;
    *qsum = _mm_cvtsi128_si32(s4);
#endif
}

/* Block b of one x row (K fp32) -> per pass its xq bytes (32 int8, zero past K; int4 order when perm), d and
 * qsum (the sum of the q): pass 0 at xq + 32 b, d + b, qsum + b and, when passes == 2, the quantized
 * residual x - q * d at offset `next` rows further (xq + (next * nb + b) * 32, d + next * nb + b, ...). */
static void quantize_at(const float *x, int64_t K, int64_t nb, int64_t b, int perm, int passes, int64_t next,
                        int8_t *xq, float *d, int32_t *qsum) {
    float t[QB], r[QB];
    const int64_t k0 = b * QB, n = K - k0 < QB ? (K > k0 ? K - k0 : 0) : QB;
    memcpy(t, x + k0, sizeof(float) * (size_t)n);
    for (int64_t i = n; i < QB; i++) t[i] = 0.0f;
    quantize_block(t, perm, xq + k0, d + b, qsum + b, passes == 2 ? r : NULL);
    if (passes == 2) quantize_block(r, perm, xq + next * nb * QB + k0, d + next * nb + b, qsum + next * nb + b, NULL);
}

/* 8 group scales from sr (as qdot.h's scales16, for the 256-bit kernels) starting at element i. */
static inline __m256 scales8(const void *sr, int sbf, int64_t i) {
    if (sbf) return bf16x8_to_f32((const uint16_t *)sr + i);
    return _mm256_loadu_ps((const float *)sr + i);
}

/* The tile kernels: rows 16t..16t+15 of W against mr activation rows (xq row stride nb * 32, d and qs
 * row stride nb), for bits 8 or 4; out (mr, RT) gets sum_b d_b * s_g(b) * (block dot) per lane (int8:
 * s = 1), minus the zero points' share when zr. bpg: blocks per group; cg (mr, G): C_g. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QDOT_512 1
#define MR 4
static inline __attribute__((always_inline)) void tile(
    int bits, const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *qs, int mr,
    const void *sr, int sbf, const float *zr, const float *cg, int64_t G, int64_t bpg, float *out)
{
    __m512 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int off = bits == 8 ? 128 : 8;
    const int64_t step = bits == 8 ? 8 * 64 : 4 * 64, ldq = nb * QB;
    int64_t g = 0, left = bpg;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * step;
        const int8_t *xb = xq + b * QB;
        if (bits == 4 || int8_prefetch) PREFETCH(wb, step);
        __m512i t[MR];
        for (int m = 0; m < mr; m++) t[m] = _mm512_set1_epi32(-off * qs[m * nb + b]);
        if (bits == 8) {
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * j));
                for (int m = 0; m < mr; m++)
                    t[m] = _mm512_dpbusd_epi32(t[m], v, _mm512_set1_epi32(ld32(xb + m * ldq + 4 * j)));
            }
            for (int m = 0; m < mr; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), _mm512_set1_ps(d[m * nb + b]), acc[m]);
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * j));
                const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                for (int m = 0; m < mr; m++) {
                    t[m] = _mm512_dpbusd_epi32(t[m], lo, _mm512_set1_epi32(ld32(xb + m * ldq + 8 * j)));
                    t[m] = _mm512_dpbusd_epi32(t[m], hi, _mm512_set1_epi32(ld32(xb + m * ldq + 8 * j + 4)));
                }
            }
            const __m512 sv = scales16(sr, sbf, g * RT);
            for (int m = 0; m < mr; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), _mm512_mul_ps(sv, _mm512_set1_ps(d[m * nb + b])), acc[m]);
            if (--left == 0) { g++; left = bpg; }
        }
    }
    if (zr)
        for (int64_t gg = 0; gg < G; gg++) {
            const __m512 zv = _mm512_loadu_ps(zr + gg * RT);
            for (int m = 0; m < mr; m++) acc[m] = _mm512_fnmadd_ps(zv, _mm512_set1_ps(cg[m * G + gg]), acc[m]);
        }
    for (int m = 0; m < mr; m++) _mm512_storeu_ps(out + m * RT, acc[m]);
}
#else
#define MR 2
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define QDOT_VNNI 1
#endif
/* t + the 8 lanes' sums of 4 products u (unsigned bytes) x s (signed bytes); int8 without VNNI: u holds
 * w + 128 and the sign trick computes the signed w x s sums instead (accumulator start 0, see top). */
static inline __m256i dp(__m256i t, __m256i u, __m256i s, int bits) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)bits;
    return _mm256_dpbusd_epi32(t, u, s);
#elif defined(__AVXVNNI__)
    (void)bits;
    return _mm256_dpbusd_avx_epi32(t, u, s);
#else
    if (bits == 8) {
        const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
        u = _mm256_sign_epi8(w, w);
        s = _mm256_sign_epi8(s, w);
    }  /* int4 (|u| <= 15, |s| <= 127: each int16 pair sum below 32767); tile() itself adds int4's in int16 */
    return _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void tile(
    int bits, const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *qs, int mr,
    const void *sr, int sbf, const float *zr, const float *cg, int64_t G, int64_t bpg, float *out)
{
    __m256 acc[MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
#ifdef QDOT_VNNI
    const int off = bits == 8 ? 128 : 8;
#else
    const int off = bits == 8 ? 0 : 8;
#endif
    const int64_t step = bits == 8 ? 8 * 64 : 4 * 64, ldq = nb * QB;
    int64_t g = 0, left = bpg;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * step;
        const int8_t *xb = xq + b * QB;
        if (bits == 4 || int8_prefetch) PREFETCH(wb, step);
        __m256i t[MR][2];
        for (int m = 0; m < mr; m++) t[m][0] = t[m][1] = _mm256_set1_epi32(-off * qs[m * nb + b]);
        if (bits == 8) {
            for (int j = 0; j < 8; j++)
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
                    for (int m = 0; m < mr; m++)
                        t[m][h] = dp(t[m][h], v, _mm256_set1_epi32(ld32(xb + m * ldq + 4 * j)), 8);
                }
            for (int m = 0; m < mr; m++)
                for (int h = 0; h < 2; h++)
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m][h]), _mm256_set1_ps(d[m * nb + b]), acc[m][h]);
        } else {
#ifndef QDOT_VNNI
            /* the block's 8 maddubs pair sums per lane added in int16, then one madd to int32: each pair is at
             * most 2 * 15 * 127 = 3810 in magnitude (u <= 15, |q| <= 127), so the 8 sum to at most 30480 <
             * 32767, exact (the int32 result is that of a madd per maddubs): per weight vector and activation
             * row 2 maddubs + 2 adds instead of 2 x (maddubs + madd + add) */
            __m256i s16[MR][2];
            for (int m = 0; m < mr; m++) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
#endif
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                    for (int m = 0; m < mr; m++) {
#ifdef QDOT_VNNI
                        t[m][h] = dp(t[m][h], lo, _mm256_set1_epi32(ld32(xb + m * ldq + 8 * j)), 4);
                        t[m][h] = dp(t[m][h], hi, _mm256_set1_epi32(ld32(xb + m * ldq + 8 * j + 4)), 4);
#else
                        const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ld32(xb + m * ldq + 8 * j)));
                        const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ld32(xb + m * ldq + 8 * j + 4)));
                        s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_add_epi16(pl, ph));
#endif
                    }
                }
#ifndef QDOT_VNNI
            for (int m = 0; m < mr; m++)
                for (int h = 0; h < 2; h++)
                    t[m][h] = _mm256_add_epi32(t[m][h], _mm256_madd_epi16(s16[m][h], _mm256_set1_epi16(1)));
#endif
            for (int h = 0; h < 2; h++) {
                const __m256 sv = scales8(sr, sbf, g * RT + 8 * h);
                for (int m = 0; m < mr; m++)
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m][h]), _mm256_mul_ps(sv, _mm256_set1_ps(d[m * nb + b])),
                                                acc[m][h]);
            }
            if (--left == 0) { g++; left = bpg; }
        }
    }
    if (zr)
        for (int64_t gg = 0; gg < G; gg++)
            for (int h = 0; h < 2; h++) {
                const __m256 zv = _mm256_loadu_ps(zr + gg * RT + 8 * h);
                for (int m = 0; m < mr; m++) acc[m][h] = _mm256_fnmadd_ps(zv, _mm256_set1_ps(cg[m * G + gg]), acc[m][h]);
            }
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + m * RT + 8 * h, acc[m][h]);
}
#endif

/* tile() for the mr rows of run()'s loop, mr (1..MR) passed as a constant */
#if MR > 2
#define TILE_MR(BITS, ST, SBF, ZT, CM, GG, BPG) do { switch (mr) { \
    case 1: tile(BITS, w, nb, xm, dm, qm, 1, ST, SBF, ZT, CM, GG, BPG, out); break; \
    case 2: tile(BITS, w, nb, xm, dm, qm, 2, ST, SBF, ZT, CM, GG, BPG, out); break; \
    case 3: tile(BITS, w, nb, xm, dm, qm, 3, ST, SBF, ZT, CM, GG, BPG, out); break; \
    default: tile(BITS, w, nb, xm, dm, qm, MR, ST, SBF, ZT, CM, GG, BPG, out); } } while (0)
#else
#define TILE_MR(BITS, ST, SBF, ZT, CM, GG, BPG) do { switch (mr) { \
    case 1: tile(BITS, w, nb, xm, dm, qm, 1, ST, SBF, ZT, CM, GG, BPG, out); break; \
    default: tile(BITS, w, nb, xm, dm, qm, MR, ST, SBF, ZT, CM, GG, BPG, out); } } while (0)
#endif

/* All N rows against all M activation rows (passes * the x rows, a row's passes adjacent), MR rows at a
 * time, tiles split over the threads of the enclosing parallel region (an orphaned `omp for`); y row
 * m / passes gets the sum of its passes. */
static void run(int bits, int passes, const int8_t *xq, const float *d, const int32_t *qs, const float *cg,
                int64_t M, int64_t nb, const uint8_t *wr, int64_t N, const float *scale, const void *sr, int sbf,
                const float *zr, int64_t G, int64_t bpg, const float *bias, float *y, int64_t ldy)
{
    const int64_t T = (N + RT - 1) / RT, step = (bits == 8 ? 8 : 4) * 64 * nb;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float out[MR * RT];
        const uint8_t *w = wr + t * step;
        const void *st = bits == 4 ? (const char *)sr + (sbf ? 2 : 4) * t * G * RT : NULL;
        const float *zt = zr ? zr + t * G * RT : NULL;
        const int64_t n0 = t * RT, nr = N - n0 < RT ? N - n0 : RT;
        for (int64_t m = 0; m < M; m += MR) {
            const int mr = M - m >= MR ? MR : (int)(M - m);
            const int8_t *xm = xq + m * nb * QB;
            const float *dm = d + m * nb, *cm = cg ? cg + m * G : NULL;
            const int32_t *qm = qs + m * nb;
            /* each call site inlined with its constants, mr included: with a constant row count the
             * accumulators stay in registers (a run-time mr kept them on the stack, and a one-row
             * decode's two passes are mr = 2 < MR) */
            if (bits == 8) TILE_MR(8, NULL, 0, NULL, NULL, 0, 1);
            else if (sbf) TILE_MR(4, st, 1, zt, cm, G, bpg);
            else TILE_MR(4, st, 0, zt, cm, G, bpg);
            store_rows(bits, passes, out, m, mr, n0, nr, scale, bias, y, ldy);
        }
    }
}

/* Quantize x, then run. bits 8: scale (N); bits 4: sr, zr (see top), G groups of gs columns. passes 1:
 * x rounded to int8 blocks (llama.cpp's Q8_0 activations); 2: also the residual x - q d rounded to its
 * own int8 blocks and dotted with the same weights (x ~ q d + q2 d2, |x - q d - q2 d2| <= amax / 64516
 * per block: about 16-bit activations for twice the dot products). Returns 0, or -1 when gs is not a
 * multiple of 32 or passes is not 1 or 2 (y untouched) or scratch memory cannot be allocated (y filled
 * with NaN). */
static int qdot(int bits, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wr, int64_t N,
                const float *scale, const void *sr, int sbf, const float *zr, int64_t G, int64_t gs,
                const float *bias, float *y, int64_t ldy, int passes, int nthreads)
{
    if ((bits == 4 && (gs % QB || gs <= 0)) || (passes != 1 && passes != 2)) return -1;
    const int64_t nb = (K + QB - 1) / QB, bpg = bits == 4 ? gs / QB : 1, R = passes * M;
    /* many rows on the AMX-INT8 tiles (qdot_amx.c): the scratch rows padded to a multiple of 32, zero */
    const int amx = R >= AMX_QDOT_MIN_ROWS && baige_qdot_amx_ready();
    const int64_t Ra = amx ? (R + 31) / 32 * 32 : R;
    int8_t *xq = malloc((size_t)(Ra * nb * QB));
    float *d = malloc(sizeof(float) * (size_t)(Ra * nb));
    int32_t *qs = malloc(sizeof(int32_t) * (size_t)(Ra * nb));
    float *cg = zr ? malloc(sizeof(float) * (size_t)(Ra * G)) : NULL;
    if (!xq || !d || !qs || (zr && !cg)) {
        free(xq); free(d); free(qs); free(cg);
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = __builtin_nanf("");
        return -1;
    }
    if (Ra > R) {
        memset(xq + R * nb * QB, 0, (size_t)((Ra - R) * nb * QB));
        memset(d + R * nb, 0, sizeof(float) * (size_t)((Ra - R) * nb));
        memset(qs + R * nb, 0, sizeof(int32_t) * (size_t)((Ra - R) * nb));
        if (cg) memset(cg + R * G, 0, sizeof(float) * (size_t)((Ra - R) * G));
    }
    /* one parallel region: the activation blocks split over the threads (a one-row decode's too), then
     * the zero-point sums, then the tiles (each `omp for` ends in a barrier) */
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * nb; i++) {
            const int64_t m = i / nb;
            quantize_at(x + m * ldx, K, nb, i % nb, bits == 4, passes, 1, xq + passes * m * nb * QB,
                        d + passes * m * nb, qs + passes * m * nb);
        }
        if (cg) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < R; m++)
                for (int64_t g = 0; g < G; g++) {
                    const int64_t b1 = (g + 1) * bpg < nb ? (g + 1) * bpg : nb;
                    float c = 0.0f;
                    for (int64_t b = g * bpg; b < b1; b++) c += d[m * nb + b] * (float)qs[m * nb + b];
                    cg[m * G + g] = c;
                }
        }
        if (amx)
            baige_qdot_amx_run(bits, passes, xq, d, qs, cg, R, nb, wr, N, scale, sr, sbf, zr, G, bpg, bias, y, ldy);
        else
            run(bits, passes, xq, d, qs, cg, R, nb, wr, N, scale, sr, sbf, zr, G, bpg, bias, y, ldy);
    }
    free(xq); free(d); free(qs); free(cg);
    return 0;
}

/* int8 per channel: wr repacked (see top), scale fp32 (N), bias fp32 (N) or NULL; y (M, ldy); passes 1 or
 * 2 (see qdot). Returns 0, or -1 (see qdot). */
int baige_qdot_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wr, int64_t N,
                    const float *scale, const float *bias, float *y, int64_t ldy, int passes, int nthreads)
{
    return qdot(8, x, M, K, ldx, wr, N, scale, NULL, 0, NULL, 0, 0, bias, y, ldy, passes, nthreads);
}

/* int4 group-wise: wr, sr, zr repacked (see top; sr bf16 when scale_bf16, else fp32), G groups of gs columns
 * (a multiple of 32), K a multiple of 8; passes 1 or 2 (see qdot). Returns 0, or -1 (see qdot). */
int baige_qdot_int4(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wr, int64_t N,
                    const void *sr, int scale_bf16, const float *zr, int64_t G, int64_t gs, const float *bias,
                    float *y, int64_t ldy, int passes, int nthreads)
{
    return qdot(4, x, M, K, ldx, wr, N, NULL, sr, scale_bf16 != 0, zr, G, gs, bias, y, ldy, passes, nthreads);
}
