/* The routed experts of a MoE layer on the CPU, fp32, for rows already sorted by expert:
 *
 *     ys[i] = W2_e @ (silu(W13_e[:I] @ xs[i]) * (W13_e[I:] @ xs[i]))   for offsets[e] <= i < offsets[e+1]
 *
 * (the weighted combine stays with the caller: baige/kernels/moe_cpu.py). AVX-512 F only; other
 * variants return BAIGE_MOE_UNSUPPORTED and the caller keeps oneDNN's matmuls.
 *
 * Layout: each expert's rows are taken in chunks of up to NB = 64 and transposed into XT (H x ldp,
 * ldp = the chunk's rows rounded up to 16, zero columns past them), so a column of 16 rows is one zmm
 * and the weights are read straight from their row-major storage as broadcast scalars: an output tile
 * is up to 6 weight rows x up to 4 zmm of rows (24 accumulators), each weight element loaded once per
 * chunk, each XT vector loaded once per 6 weight rows. The gate/up product keeps 3 gate rows and the
 * matching 3 up rows in one tile, so SwiGLU is applied in registers and the activations land
 * transposed (I x ldp) -- exactly the right operand of the down product -- without a round trip
 * through memory. The down product's tiles (6 rows of W2 x the chunk) are written into ys row-major.
 * The weight rows of the next tile are prefetched while this one computes (the weights of a MoE
 * layer rarely fit in the caches: every chunk streams its expert's 3 H I floats from memory).
 *
 * Why not oneDNN (PyTorch's mkldnn matmul): per expert it pads the rows to a multiple of 16 with
 * wasted columns and runs gate/up, SwiGLU and down as separate passes. Measured numbers are in
 * docs/benchmarks/archive.md (the "MoE forward vs transformers" sections).
 *
 * Threads: OpenMP over the output tiles of each product (static split), barriers between the packing,
 * the gate/up product and the down product of a chunk; results do not depend on the thread count
 * (every output element is summed in the same order by whichever thread owns it).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define BAIGE_MOE_UNSUPPORTED (-1)
#define BAIGE_MOE_NOMEM (-2)

#if defined(__AVX512F__)

#ifndef CHUNK_FLOATS
#define CHUNK_FLOATS (128 * 1024) /* XT + activations of a chunk: 512 KiB, half an L2 of Zen 4/5 */
#endif
#define MR 6  /* weight rows of a tile */

/* acc[r][v] = sum_k w[r][k] * xt[k * ldp + 16 v .. +16], r < nr, v < nv, k < K; the rows of the next
 * tile (next[r], nnext of them) are prefetched a cache line per 16 k. */
static inline __attribute__((always_inline)) void tile(const float *const *w, const int nr, const int nv,
                                                       const float *xt, int64_t ldp, int64_t K,
                                                       const float *const *next, int nnext, __m512 acc[MR][4]) {
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        for (int r = 0; r < nnext; r++) _mm_prefetch((const char *)(next[r] + k), _MM_HINT_T0);
        for (int kk = k; kk < k + 16; kk++) {
            __m512 xv[4];
            for (int v = 0; v < nv; v++) xv[v] = _mm512_load_ps(xt + kk * ldp + 16 * v);
            for (int r = 0; r < nr; r++) {
                const __m512 b = _mm512_set1_ps(w[r][kk]);
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(b, xv[v], acc[r][v]);
            }
        }
    }
    for (; k < K; k++) {
        __m512 xv[4];
        for (int v = 0; v < nv; v++) xv[v] = _mm512_load_ps(xt + k * ldp + 16 * v);
        for (int r = 0; r < nr; r++) {
            const __m512 b = _mm512_set1_ps(w[r][k]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(b, xv[v], acc[r][v]);
        }
    }
}

/* gate/up tile: np (1..3) gate rows p.. and the up rows I + p.. over xt's columns j0 .. j0 + 16 nv;
 * act[(p + r) * ldp + j0 ..] = silu(gate) * up */
static inline __attribute__((always_inline)) void gate_up_tile(const float *w13, int64_t H, int64_t I, int64_t p,
                                                               const int np, const int nv, const float *xt,
                                                               int64_t ldp, int64_t j0, float *act) {
    const float *w[MR], *next[MR];
    int nnext = 0;
    for (int r = 0; r < np; r++) {
        w[r] = w13 + (p + r) * H;
        w[np + r] = w13 + (I + p + r) * H;
    }
    if (j0 == 0)  /* the first column group brings the rows into the caches: prefetch the next tile's */
        for (int r = 0; r < 3 && p + np + r < I; r++) {
            next[nnext++] = w13 + (p + np + r) * H;
            next[nnext++] = w13 + (I + p + np + r) * H;
        }
    __m512 acc[MR][4];
    tile(w, 2 * np, nv, xt + j0, ldp, H, next, nnext, acc);
    for (int r = 0; r < np; r++)
        for (int v = 0; v < nv; v++)
            _mm512_store_ps(act + (p + r) * ldp + j0 + 16 * v, _mm512_mul_ps(silu512(acc[r][v]), acc[np + r][v]));
}

/* down tile: nr (1..6) rows h.. of W2 (H x I) over act's columns j0 .. j0 + 16 nv; ys[j][h + r] for
 * the chunk's rows j0 <= j < nb */
static inline __attribute__((always_inline)) void down_tile(const float *w2, int64_t H, int64_t I, int64_t h,
                                                            const int nr, const int nv, const float *act,
                                                            int64_t ldp, int64_t j0, float *ys, int64_t ldy,
                                                            int64_t nb) {
    const float *w[MR], *next[MR];
    int nnext = 0;
    for (int r = 0; r < nr; r++) w[r] = w2 + (h + r) * I;
    if (j0 == 0)
        for (int r = 0; r < MR && h + nr + r < H; r++) next[nnext++] = w2 + (h + nr + r) * I;
    __m512 acc[MR][4];
    tile(w, nr, nv, act + j0, ldp, I, next, nnext, acc);
    float buf[MR][64] __attribute__((aligned(64)));
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) _mm512_store_ps(&buf[r][16 * v], acc[r][v]);
    const int64_t n = nb - j0 < 16 * nv ? nb - j0 : 16 * nv;
    for (int64_t j = 0; j < n; j++)
        for (int r = 0; r < nr; r++) ys[(j0 + j) * ldy + h + r] = buf[r][j];
}

/* the switch that turns (np, nv) / (nr, nv) into constants, so each combination is its own unrolled copy */
#define NV_CASES(CALL, N) \
    switch (nv) { case 1: CALL(N, 1); break; case 2: CALL(N, 2); break; case 3: CALL(N, 3); break; default: CALL(N, 4); }
#define GU(N, V) gate_up_tile(w13, H, I, p, N, V, xt, ldp, j0, act)
#define DN(N, V) down_tile(w2, H, I, h, N, V, act, ldp, j0, ys, ldy, nb)

static void gate_up_any(const float *w13, int64_t H, int64_t I, int64_t p, int np, int nv, const float *xt,
                        int64_t ldp, int64_t j0, float *act) {
    switch (np) {
    case 1: NV_CASES(GU, 1); break;
    case 2: NV_CASES(GU, 2); break;
    default: NV_CASES(GU, 3);
    }
}

static void down_any(const float *w2, int64_t H, int64_t I, int64_t h, int nr, int nv, const float *act,
                     int64_t ldp, int64_t j0, float *ys, int64_t ldy, int64_t nb) {
    switch (nr) {
    case 1: NV_CASES(DN, 1); break;
    case 2: NV_CASES(DN, 2); break;
    case 3: NV_CASES(DN, 3); break;
    case 4: NV_CASES(DN, 4); break;
    case 5: NV_CASES(DN, 5); break;
    default: NV_CASES(DN, 6);
    }
}

int baige_moe_experts_f32(const float *xs, int64_t ldx, const int64_t *offsets, int64_t E, const float *w13,
                          const float *w2, int64_t H, int64_t I, int64_t skip_rows, float *ys, int64_t ldy,
                          int nthreads) {
    if (H == 0 || I == 0) { /* every output is empty or zero (no scratch to size) */
        for (int64_t e = 0; e < E; e++)
            if (offsets[e + 1] - offsets[e] > skip_rows)
                for (int64_t i = offsets[e]; i < offsets[e + 1]; i++) memset(ys + i * ldy, 0, (size_t)H * sizeof(float));
        return 0;
    }
    /* a chunk's columns: XT and the activations (H + I floats per column) within CHUNK_FLOATS, 64..512 */
    int64_t nbmax = CHUNK_FLOATS / (H + I) / 16 * 16;
    nbmax = nbmax < 64 ? 64 : nbmax > 512 ? 512 : nbmax;
    float *xt = aligned_alloc(64, (size_t)(H * nbmax) * sizeof(float));
    float *act = aligned_alloc(64, (size_t)(I * nbmax) * sizeof(float));
    if (!xt || !act) {
        free(xt), free(act);
        return BAIGE_MOE_NOMEM;
    }
    const int64_t pairs = (I + 2) / 3, rows = (H + MR - 1) / MR;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    for (int64_t e = 0; e < E; e++) {
        const float *w13e = w13 + e * 2 * I * H, *w2e = w2 + e * H * I;
        const int64_t count = offsets[e + 1] - offsets[e];
        const int64_t chunks = count > skip_rows ? (count + nbmax - 1) / nbmax : 0;
        for (int64_t c = 0; c < chunks; c++) {  /* chunks of near-equal size */
            const int64_t c0 = offsets[e] + count * c / chunks, nb = offsets[e] + count * (c + 1) / chunks - c0;
            const int64_t ldp = (nb + 15) / 16 * 16;
#pragma omp for schedule(static)
            for (int64_t k0 = 0; k0 < H; k0 += 64) {  /* XT = the chunk's rows transposed, zero columns past nb */
                const int64_t k1 = k0 + 64 < H ? k0 + 64 : H;
                for (int64_t k = k0; k < k1; k++) memset(xt + k * ldp + nb, 0, (size_t)(ldp - nb) * sizeof(float));
                for (int64_t j = 0; j < nb; j++) {
                    const float *src = xs + (c0 + j) * ldx;
                    for (int64_t k = k0; k < k1; k++) xt[k * ldp + j] = src[k];
                }
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < pairs; t++) {
                const int64_t p = 3 * t;
                for (int64_t j0 = 0; j0 < ldp; j0 += 64) {
                    const int nv = (int)((ldp - j0) / 16 < 4 ? (ldp - j0) / 16 : 4);
                    gate_up_any(w13e, H, I, p, (int)(I - p < 3 ? I - p : 3), nv, xt, ldp, j0, act);
                }
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows; t++) {
                const int64_t h = MR * t;
                for (int64_t j0 = 0; j0 < ldp; j0 += 64) {
                    const int nv = (int)((ldp - j0) / 16 < 4 ? (ldp - j0) / 16 : 4);
                    down_any(w2e, H, I, h, (int)(H - h < MR ? H - h : MR), nv, act, ldp, j0, ys + c0 * ldy, ldy, nb);
                }
            }
        }
    }
    free(xt), free(act);
    return 0;
}

#else

int baige_moe_experts_f32(const float *xs, int64_t ldx, const int64_t *offsets, int64_t E, const float *w13,
                          const float *w2, int64_t H, int64_t I, int64_t skip_rows, float *ys, int64_t ldy,
                          int nthreads) {
    (void)xs, (void)ldx, (void)offsets, (void)E, (void)w13, (void)w2, (void)H, (void)I, (void)skip_rows, (void)ys,
        (void)ldy, (void)nthreads;
    return BAIGE_MOE_UNSUPPORTED;
}

#endif
