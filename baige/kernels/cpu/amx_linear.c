/* bf16-weight linear layers on AMX tiles: y = x @ W^T + bias, W bf16 (N, K) row-major (row stride ldw), x fp32
 * (M, K) (row stride ldx) rounded to bf16 (nearest even, as bf16.c's vdpbf16ps path: a bf16 PyTorch model
 * rounds its activations the same way), y fp32 (M, N) (row stride ldy), bias fp32 (N) or NULL; the bf16
 * products exact, summed in fp32 (TDPBF16PS; AMX basics in amx_tiles.h). bf16.c's baige_linear_bf16 hands
 * calls of at least AMX_MIN_ROWS rows here under the ``avx512_amx`` variant.
 *
 * The transposed product, as moe_amx.c: the weights are the tiles' A operand, read in place (16 output
 * rows x 32 of K per tile, zero-padded copies at the N and K edges), the rows of x the B operand, rounded
 * and packed once per call into blocks of 16 rows (K/2 rows of 16 bf16 pairs each). Each (32 outputs,
 * 32 rows) step keeps 4 accumulator tiles; its 16 x 16 results are transposed back into rows of y.
 * Threads: OpenMP over the 32-output column blocks after packing; each output is summed in one fixed
 * order, so results do not depend on the thread count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx_tiles.h"

#define BAIGE_AMX_UNSUPPORTED (-1)
#define BAIGE_AMX_NOMEM (-2)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

/* XP block: rows 0 .. nr (nr <= 16; the rest zero) of x (fp32, row stride ldx), columns k0 .. k0 + 32
 * (zero past K), rounded to bf16 and transposed into 16 rows of 16 pairs at xp + (k0 / 2) * 32 */
static void pack_rows_f32(const float *x, int64_t ldx, int64_t nr, int64_t K, int64_t k0, uint16_t *xp) {
    const int64_t left = K - k0;
    const __mmask16 lo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
    const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
    __m512 r[16];
    for (int64_t j = 0; j < 16; j++) {
        if (j < nr) {
            const __m512 a = _mm512_maskz_loadu_ps(lo, x + j * ldx + k0), b = _mm512_maskz_loadu_ps(hi, x + j * ldx + k0 + 16);
            r[j] = (__m512)_mm512_cvtne2ps_pbh(b, a); /* 32 bf16 of row j: 16 pairs */
        } else {
            r[j] = _mm512_setzero_ps();
        }
    }
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(xp + (k0 / 2 + i) * 32), r[i]);
}

/* outputs n .. n + 16 (and n + 16 .. n + 32 when nn2 = 2) x row blocks 0 (and 1 when nb2 = 2) of xp (block
 * stride xs_b): y[j][n..] = sum + bias for the nrows valid rows; the next call's weight rows (next, nnext
 * of them) fetched meanwhile */
static inline __attribute__((always_inline)) void block(const uint16_t *w, int64_t ldw, int64_t N, int64_t K,
                                                        int64_t n, const int nn2, const uint16_t *xp, const int nb2,
                                                        int64_t xs_b, const float *bias, float *y, int64_t ldy,
                                                        int64_t nrows, uint16_t *pad, const uint16_t *next,
                                                        int64_t nnext) {
    product_2x2(w, n, w, n + 16, nn2, ldw, N, K, xp, xs_b, nb2, pad, next, nnext, next ? next + 16 * ldw : 0,
                nnext - 16);
    for (int t = 0; t < 2 * nn2; t++) {
        const int b = t & 1, half = t >> 1;
        if (b >= nb2) continue;
        __m512 r[16];
        acc_rows(t, r); /* r[j]: row j of the block, its 16 outputs */
        const int64_t n0 = n + 16 * half, nv = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 m = (__mmask16)((1u << nv) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
        for (int64_t j = 0, i = 16 * b; j < 16 && i < nrows; j++, i++)
            _mm512_mask_storeu_ps(y + i * ldy + n0, m, _mm512_add_ps(r[j], bv));
    }
}

int baige_linear_bf16_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                          int64_t ldw, const float *bias, float *y, int64_t ldy, int nthreads) {
    if (!amx_permitted()) return BAIGE_AMX_UNSUPPORTED;
    if (M == 0 || N == 0) return 0;
    const int64_t kp = (K + 31) / 32 * 32, xs_b = kp * 16, blocks = (M + 15) / 16;
    uint16_t *xp = aligned_alloc(64, (size_t)(xs_b * blocks) * sizeof(uint16_t) + 64);
    if (!xp) return BAIGE_AMX_NOMEM;
    const int64_t kchunks = kp / 32, npairs = (N + 31) / 32;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        uint16_t pad[2 * 16 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < blocks * kchunks; t++) {
            const int64_t b = t / kchunks, k0 = t % kchunks * 32;
            const int64_t nr = M - 16 * b < 16 ? M - 16 * b : 16;
            pack_rows_f32(x + 16 * b * ldx, ldx, nr, K, k0, xp + b * xs_b);
        }
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npairs; p++) {
            const int64_t n = 32 * p;
            const int64_t nn = N - n - 32;  /* rows of the next column block, fetched during the first row pair */
            for (int64_t b = 0; b < blocks; b += 2) {
                const uint16_t *xb = xp + b * xs_b, *next = b == 0 && nn > 0 ? w + (n + 32) * ldw : 0;
                float *yb = y + 16 * b * ldy;
                const int64_t nrows = M - 16 * b;
                if (n + 16 < N) {
                    if (b + 1 < blocks) block(w, ldw, N, K, n, 2, xb, 2, xs_b, bias, yb, ldy, nrows, pad, next, nn);
                    else block(w, ldw, N, K, n, 2, xb, 1, xs_b, bias, yb, ldy, nrows, pad, next, nn);
                } else {
                    if (b + 1 < blocks) block(w, ldw, N, K, n, 1, xb, 2, xs_b, bias, yb, ldy, nrows, pad, next, nn);
                    else block(w, ldw, N, K, n, 1, xb, 1, xs_b, bias, yb, ldy, nrows, pad, next, nn);
                }
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}

#else

int baige_linear_bf16_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                          int64_t ldw, const float *bias, float *y, int64_t ldy, int nthreads) {
    (void)x, (void)M, (void)K, (void)ldx, (void)w, (void)N, (void)ldw, (void)bias, (void)y, (void)ldy, (void)nthreads;
    return BAIGE_AMX_UNSUPPORTED;
}

#endif
