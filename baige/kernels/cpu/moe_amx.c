/* The routed experts of a MoE layer on the CPU in bf16 with AMX tiles, gather and weighted combine included,
 * for (token, expert) pairs already sorted by expert:
 *
 *     out[tok[i]] += wts[i] * W2_e @ (silu(W13_e[:I] @ x[tok[i]]) * (W13_e[I:] @ x[tok[i]]))
 *                                                    for offsets[e] <= i < offsets[e+1]
 *
 * for every expert e with more than skip_rows pairs (the caller adds the others). bf16 x and weights,
 * fp32 accumulation (TDPBF16PS), SwiGLU in fp32 with the activations rounded once to bf16 (the down
 * product's input), the expert's output kept in fp32 and added into the fp32 out (each token's experts
 * in ascending order). No two pairs of one expert share a token (top-k picks distinct experts), the
 * experts run one after another and each thread owns its own hidden columns, so the adds never race.
 * Only the ``avx512_amx`` variant has
 * it (AVX-512 BF16 + AMX-TILE/BF16); elsewhere, or where Linux refuses the tile state
 * (arch_prctl(ARCH_REQ_XCOMP_PERM), kernels before 5.16), it returns BAIGE_MOE_UNSUPPORTED and writes
 * nothing.
 *
 * AMX basics: amx_tiles.h.
 *
 * Layout, the transposed products (as moe.c's fp32 kernel): the weights are the A operand, read straight
 * from their row-major (out, in) storage -- 16 weight rows x 32 of K per tile, no repacked copy --, and
 * the rows are the B operand, so they are gathered and packed once per chunk (XP: for each block of 16
 * rows, K/2 rows of 16 pairs; a 16 x 16 transposition of 32-bit pairs). The gate/up product's tiles hold 16 features x
 * 16 rows; SwiGLU runs on them in fp32 and writes the activations straight into the down product's B
 * layout (AP: pairs of features per row), and the down product's 16 hidden x 16 rows tiles are transposed
 * back into rows, weighted and added into out. Edges (H or I not a multiple of 32, feature or hidden blocks past the end, a last
 * block of fewer than 16 rows) read zero-padded copies of the weight tiles and zero rows of XP, so no
 * load runs past a tensor and padded lanes add exact zeros.
 *
 * Threads: OpenMP over the output tiles of each product, barriers between packing, gate/up and down of
 * a chunk (as moe.c); every output element is summed in the same order by whichever thread owns it, so
 * results do not depend on the thread count or on the other experts' rows.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "vec_math.h"

#define BAIGE_MOE_UNSUPPORTED (-1)
#define BAIGE_MOE_NOMEM (-2)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#ifndef CHUNK_BYTES
#define CHUNK_BYTES (1024 * 1024) /* XP + AP of a chunk: half of a Sapphire Rapids core's 2 MiB L2 */
#endif

/* XP block: rows tok[0 .. nr] (nr <= 16; the rest zero) of x (row stride ldx) transposed into kp / 2
 * rows of 16 bf16 pairs, columns k0 .. k0 + 32 of them (zero past K) */
static void pack_rows(const uint16_t *x, int64_t ldx, const int64_t *tok, int64_t nr, int64_t K, int64_t k0,
                      uint16_t *xp) {
    const int64_t nk = K - k0 < 32 ? K - k0 : 32;
    const __mmask32 m = nk == 32 ? 0xffffffffu : (((__mmask32)1 << nk) - 1);
    __m512 r[16];
    for (int64_t j = 0; j < 16; j++)
        r[j] = j < nr ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, x + tok[j] * ldx + k0)) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(xp + (k0 / 2 + i) * 32), r[i]);
}

/* interleave two feature rows of 16 fp32 (one per row of the block) into 16 bf16 pairs (f, f + 1) */
static inline __m512i pair_rows(__m512 f0, __m512 f1) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)); /* [f0 | f1] -> pairs */
}

/* gate/up: features f .. f + 16 (gate rows f.., up rows I + f..) x row blocks b0 (and b0 + 1 when nb2 = 2)
 * of XP (block stride xs_b); SwiGLU in fp32, written into AP (rows f / 2 .. f / 2 + 8 of each block) */
static inline __attribute__((always_inline)) void gate_up(const uint16_t *w13, int64_t H, int64_t I, int64_t f,
                                                          const uint16_t *xp0, const int nb2, int64_t xs_b,
                                                          uint16_t *ap0, int64_t as_b, uint16_t *pad,
                                                          const uint16_t *next, int64_t nnext) {
    product_2x2(w13, f, w13 + I * H, f, 2, H, I, H, xp0, xs_b, nb2, pad, next, nnext, next ? next + I * H : 0, nnext);
    float c[4][16][16] __attribute__((aligned(64)));
    for (int t = 0; t < 4; t++)
        if ((t & 1) < nb2) store_acc(t, c[t]); /* c[b]: gate of block b, c[2 + b]: its up */
    for (int b = 0; b < nb2; b++) {
        uint16_t *ap = ap0 + b * as_b + (f / 2) * 32;
        for (int q = 0; q < 8; q++) {
            const __m512 a0 = _mm512_mul_ps(silu512_rcp(_mm512_load_ps(c[b][2 * q])), _mm512_load_ps(c[2 + b][2 * q]));
            const __m512 a1 = _mm512_mul_ps(silu512_rcp(_mm512_load_ps(c[b][2 * q + 1])),
                                            _mm512_load_ps(c[2 + b][2 * q + 1]));
            _mm512_store_si512(ap + q * 32, pair_rows(a0, a1));
        }
    }
}

/* down: hidden rows h .. h + 16 (and h + 16 .. h + 32 when nh2 = 2) of W2 (H x I) x row blocks b0 (and
 * b0 + 1 when nb2 = 2) of AP; transposed back into rows and added, times wts[j], into out[tok[j]]'s
 * columns h.. (nrows valid rows from block b0 on) */
static inline __attribute__((always_inline)) void down(const uint16_t *w2, int64_t H, int64_t I, int64_t h,
                                                       const int nh2, const uint16_t *ap0, const int nb2, int64_t as_b,
                                                       const int64_t *tok, const float *wts, float *out,
                                                       int64_t ldo, int64_t nrows, uint16_t *pad,
                                                       const uint16_t *next, int64_t nnext) {
    product_2x2(w2, h, w2, h + 16, nh2, I, H, I, ap0, as_b, nb2, pad, next, nnext, next ? next + 16 * I : 0, nnext - 16);
    for (int t = 0; t < 2 * nh2; t++) {
        const int b = t & 1, hh = t >> 1;
        if (b >= nb2) continue;
        __m512 r[16];
        acc_rows(t, r); /* r[j]: row j of the block, its 16 hidden values */
        const int64_t h0 = h + 16 * hh, nh = H - h0 < 16 ? H - h0 : 16;
        const __mmask16 m = (__mmask16)((1u << nh) - 1);
        for (int64_t j = 0, i = 16 * b; j < 16 && i < nrows; j++, i++) {
            float *dst = out + tok[i] * ldo + h0;
            const __m512 y = _mm512_mul_ps(r[j], _mm512_set1_ps(wts[i]));
            _mm512_mask_storeu_ps(dst, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), y));
        }
    }
}

int baige_moe_experts_bf16(const uint16_t *x, int64_t ldx, const int64_t *tok, const float *wts,
                           const int64_t *offsets, int64_t E, const uint16_t *w13, const uint16_t *w2, int64_t H,
                           int64_t I, int64_t skip_rows, float *out, int64_t ldo, int nthreads) {
    if (!amx_permitted()) return BAIGE_MOE_UNSUPPORTED;
    if (H == 0 || I == 0) return 0; /* every expert's output is empty or zero: nothing to add */
    const int64_t kp = (H + 31) / 32 * 32, ip = (I + 31) / 32 * 32;
    const int64_t xs_b = kp * 16, as_b = ip * 16; /* bf16 elements per block of 16 rows in XP / AP */
    /* a chunk's rows: XP and AP within CHUNK_BYTES, 32..512 rows (whole blocks) */
    int64_t nbmax = CHUNK_BYTES / (2 * (xs_b + as_b)) * 16 / 32 * 32;
    nbmax = nbmax < 32 ? 32 : nbmax > 512 ? 512 : nbmax;
    uint16_t *xp = aligned_alloc(64, (size_t)(xs_b * (nbmax / 16)) * sizeof(uint16_t));
    uint16_t *ap = aligned_alloc(64, (size_t)(as_b * (nbmax / 16)) * sizeof(uint16_t));
    if (!xp || !ap) {
        free(xp), free(ap);
        return BAIGE_MOE_NOMEM;
    }
    /* AP rows past the feature blocks (I rounded up to 16, then to 32) are never written: zero once */
    memset(ap, 0, (size_t)(as_b * (nbmax / 16)) * sizeof(uint16_t));
    const int64_t fblocks = (I + 15) / 16, hpairs = (H + 31) / 32;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        uint16_t pad[2 * 16 * 32] __attribute__((aligned(64)));
        configure_tiles();
        for (int64_t e = 0; e < E; e++) {
            const uint16_t *w13e = w13 + e * 2 * I * H, *w2e = w2 + e * H * I;
            const int64_t count = offsets[e + 1] - offsets[e];
            const int64_t chunks = count > skip_rows ? (count + nbmax - 1) / nbmax : 0;
            for (int64_t c = 0; c < chunks; c++) { /* chunks of near-equal size */
                const int64_t c0 = offsets[e] + count * c / chunks, nb = offsets[e] + count * (c + 1) / chunks - c0;
                const int64_t blocks = (nb + 15) / 16, kchunks = kp / 32;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < blocks * kchunks; t++) {
                    const int64_t b = t / kchunks, k0 = t % kchunks * 32;
                    const int64_t nr = nb - 16 * b < 16 ? nb - 16 * b : 16;
                    pack_rows(x, ldx, tok + c0 + 16 * b, nr, H, k0, xp + b * xs_b);
                }
#pragma omp for schedule(static)
                for (int64_t fb = 0; fb < fblocks; fb++)
                    for (int64_t b = 0; b < blocks; b += 2) {
                        /* the first pass over this block's weight rows also fetches the next block's */
                        const int64_t f = 16 * fb, nf = I - f - 16;
                        const uint16_t *next = b == 0 && nf > 0 ? w13e + (f + 16) * H : 0;
                        if (b + 1 < blocks)
                            gate_up(w13e, H, I, f, xp + b * xs_b, 2, xs_b, ap + b * as_b, as_b, pad, next, nf);
                        else
                            gate_up(w13e, H, I, f, xp + b * xs_b, 1, xs_b, ap + b * as_b, as_b, pad, next, nf);
                    }
#pragma omp for schedule(static)
                for (int64_t hp = 0; hp < hpairs; hp++) {
                    const int64_t h = 32 * hp, nn = H - h - 32;
                    for (int64_t b = 0; b < blocks; b += 2) {
                        const int64_t *tk = tok + c0 + 16 * b;
                        const float *wt = wts + c0 + 16 * b;
                        const int64_t nrows = nb - 16 * b;
                        const uint16_t *next = b == 0 && nn > 0 ? w2e + (h + 32) * I : 0;
                        if (h + 16 < H) {
                            if (b + 1 < blocks)
                                down(w2e, H, I, h, 2, ap + b * as_b, 2, as_b, tk, wt, out, ldo, nrows, pad, next, nn);
                            else
                                down(w2e, H, I, h, 2, ap + b * as_b, 1, as_b, tk, wt, out, ldo, nrows, pad, next, nn);
                        } else {
                            if (b + 1 < blocks)
                                down(w2e, H, I, h, 1, ap + b * as_b, 2, as_b, tk, wt, out, ldo, nrows, pad, next, nn);
                            else
                                down(w2e, H, I, h, 1, ap + b * as_b, 1, as_b, tk, wt, out, ldo, nrows, pad, next, nn);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    free(xp), free(ap);
    return 0;
}

#else

int baige_moe_experts_bf16(const uint16_t *x, int64_t ldx, const int64_t *tok, const float *wts,
                           const int64_t *offsets, int64_t E, const uint16_t *w13, const uint16_t *w2, int64_t H,
                           int64_t I, int64_t skip_rows, float *out, int64_t ldo, int nthreads) {
    (void)x, (void)ldx, (void)tok, (void)wts, (void)offsets, (void)E, (void)w13, (void)w2, (void)H, (void)I,
        (void)skip_rows, (void)out, (void)ldo, (void)nthreads;
    return BAIGE_MOE_UNSUPPORTED;
}

#endif
