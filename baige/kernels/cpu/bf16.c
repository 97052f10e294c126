/* bf16-weight linear layers: y = x @ W^T + bias with W bf16 (N, K) row-major (row stride ldw), x fp32
 * (M, K) (row stride ldx), y fp32 (M, N) (row stride ldy), bias fp32 (N) or NULL; fp32 accumulation.
 *
 * With AVX-512 BF16 (the avx512_bf16 variant, Zen 4 / Sapphire Rapids) the rows of x are first rounded
 * to bf16 (nearest even, vcvtne2ps2bf16) and each 32 weights of a row take one vdpbf16ps, which
 * multiplies bf16 pairs exactly and adds them into 16 fp32 lanes (Intel SDM, VDPBF16PS; the same
 * activation rounding a bf16 PyTorch model applies before every matmul). A 64-byte load and one
 * instruction per 32 weights, against a widening load, a shift and two FMAs per 16 on the other
 * variants, where baige_linear_bf16_widen (qlinear.c) keeps x in fp32 and widens the weights exactly.
 *
 * Tiling (AVX-512 BF16): NR = 4 output rows x up to MR = 4 input rows share each loaded vector (16
 * zmm accumulators), so a weight row is read from memory once per call (the ceil(M / MR) passes over a
 * tile after the first find it in cache). A tile ahead (rows contiguous) is prefetched in address order,
 * its lines spread evenly over this tile's passes, so memory streams while the passes compute instead
 * of in a burst during the first: with one pass (up to MR rows) two tiles ahead into L1, with several
 * four tiles ahead into L2 (picked in a sweep of distances 1-8 and both hints over huge-page weights;
 * the commit before against this: docs/benchmarks/records/bf16_linear-20261208-0024*.json).
 * A full tile's 16 sums leave through one tree of shuffles (reduce16, faster than 16 separate
 * reductions; measured: docs/benchmarks/archive.md, "Start-up, page faults and bf16 prefill ops").
 * K is covered in steps of 32 with a masked load for the tail
 * (x is padded with zeros to a multiple of 32). Output tiles are split over `nthreads` OpenMP threads.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

void baige_linear_bf16_widen(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                             int64_t ldw, const float *scale, const float *bias, float *y, int64_t ldy, int nthreads);
int baige_linear_bf16_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                          int64_t ldw, const float *bias, float *y, int64_t ldy, int nthreads);

/* calls of at least this many rows take the AMX tiles (amx_linear.c) under the avx512_amx variant; elsewhere
 * that function reports itself unsupported and the code below runs */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 4
#endif

#if defined(__AVX512BF16__)

#define NR 4
#define MR 4

/* The horizontal sums of 16 vectors in one: out[4 i + j] = sum of the 16 lanes of v[4 j + i]. A tree of
 * lane shuffles and adds (15 adds, 30 shuffles) instead of 16 separate reductions (~8 dependent
 * instructions each): 256-bit halves pairwise, then 128-bit quarters, then within 128-bit lanes. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 v[16]) {
    __m512 s1[8], s2[4];
    for (int p = 0; p < 8; p++)  /* lanes 0-1: v[2p]'s halves summed, lanes 2-3: v[2p+1]'s */
        s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int q = 0; q < 4; q++)  /* 128-bit lane L: a 4-float partial of v[4q + L] */
        s2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], 0x88),
                              _mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], 0xDD));
    const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(s2[0], s2[1]), _mm512_unpackhi_ps(s2[0], s2[1]));
    const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(s2[2], s2[3]), _mm512_unpackhi_ps(s2[2], s2[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));
}

/* Rows 0..mr-1 of xb (bf16, row stride K32) against output rows 0..nr-1 of w (bf16, row stride ldw):
 * y[m, n] = sum_k xb[m, k] w[n, k] + bias[n]. Inlined with constant mr/nr at each call site. */
static inline __attribute__((always_inline)) void tile(const uint16_t *xb, int64_t K32, int mr, const uint16_t *w,
                                                       int64_t ldw, int nr, int64_t K, const float *bias, float *y,
                                                       int64_t ldy, int64_t pass, int64_t passes, int near) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = _mm512_setzero_ps();
    const char *ahead = (const char *)(w + (near ? 2 : 4) * NR * ldw);
    const int64_t steps = K32 / 32, rate = ((int64_t)NR << 16) / passes;  /* lines per step, 16.16 fixed point */
    for (int64_t k = 0; k < K32; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        /* this step's share of the tile ahead: lines [lo, hi) of its NR * steps, spread evenly over the
         * `passes` calls that read this tile */
        const int64_t step = pass * steps + k / 32;
        const int64_t lo = (step * rate) >> 16, hi = ((step + 1) * rate) >> 16;
        for (int j = 0; j < NR; j++) {
            if (lo + j < hi) {
                if (near) _mm_prefetch(ahead + 64 * (lo + j), _MM_HINT_T0);
                else _mm_prefetch(ahead + 64 * (lo + j), _MM_HINT_T1);
            }
        }
        __m512bh wv[NR];
        for (int n = 0; n < NR; n++)
            if (n < nr) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * ldw + k);
        for (int m = 0; m < MR; m++) {
            if (m < mr) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K32 + k);
                for (int n = 0; n < NR; n++)
                    if (n < nr) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
            }
        }
    }
    if (mr == MR && nr == NR) {  /* full tile: the 16 sums in one vector, then 4 floats per row */
        __m512 v[16];
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NR; n++) v[4 * n + m] = acc[m][n];
        const __m512 r = reduce16(v);  /* r[4m + n] = y[m, n] */
        const __m512 b = bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(bias)) : _mm512_setzero_ps();
        const __m512 out = _mm512_add_ps(r, b);
        _mm_storeu_ps(y, _mm512_extractf32x4_ps(out, 0));
        _mm_storeu_ps(y + ldy, _mm512_extractf32x4_ps(out, 1));
        _mm_storeu_ps(y + 2 * ldy, _mm512_extractf32x4_ps(out, 2));
        _mm_storeu_ps(y + 3 * ldy, _mm512_extractf32x4_ps(out, 3));
        return;
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]) + (bias ? bias[n] : 0.0f);
}

/* x rows (M, K) fp32 -> (M, K32) bf16 rounded to nearest even, zero padded to K32 = K rounded up to 32 */
static void round_rows(const float *x, int64_t M, int64_t K, int64_t ldx, uint16_t *xb, int64_t K32) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        uint16_t *o = xb + m * K32;
        for (int64_t k = 0; k < K32; k += 32) {
            const int64_t left = K - k;
            const __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
            const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
            const __m512 a = _mm512_maskz_loadu_ps(lo, xr + k), b = _mm512_maskz_loadu_ps(hi, xr + k + 16);
            _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* Output tiles [t_begin, t_end) of y = xb w^T + bias, each tile's rows of w read by ceil(M / MR) tile calls
 * (passes). A function of its own, not the body of an OpenMP loop: GCC compiles an outlined OpenMP body with
 * the shared variables behind a pointer, and there the loop ran slower (measured: the message of commit
 * 202d3b6). */
static __attribute__((noinline)) void run_tiles(const uint16_t *xb, int64_t M, int64_t K, int64_t K32,
                                                const uint16_t *w, int64_t N, int64_t ldw, const float *bias, float *y,
                                                int64_t ldy, int64_t t_begin, int64_t t_end) {
    const int64_t passes = (M + MR - 1) / MR;
    for (int64_t t = t_begin; t < t_end; t++) {
        const int64_t n0 = t * NR;
        const int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const uint16_t *wn = w + n0 * ldw;
        const float *b = bias ? bias + n0 : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            const uint16_t *xm = xb + m0 * K32;
            float *yo = y + m0 * ldy + n0;
            if (nr == NR && mr == MR && passes > 1) tile(xm, K32, MR, wn, ldw, NR, K, b, yo, ldy, m0 / MR, passes, 0);
            else if (nr == NR && mr == MR) tile(xm, K32, MR, wn, ldw, NR, K, b, yo, ldy, 0, 1, 1);
            else if (nr == NR && mr == 1) tile(xm, K32, 1, wn, ldw, NR, K, b, yo, ldy, 0, 1, 1);
            else if (nr == NR && mr == 2) tile(xm, K32, 2, wn, ldw, NR, K, b, yo, ldy, 0, 1, 1);
            else tile(xm, K32, mr, wn, ldw, nr, K, b, yo, ldy, m0 / MR, passes, passes == 1);
        }
    }
}

void baige_linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                       int64_t ldw, const float *scale, const float *bias, float *y, int64_t ldy, int nthreads) {
    (void)scale;
    if (M >= AMX_MIN_ROWS && baige_linear_bf16_amx(x, M, K, ldx, w, N, ldw, bias, y, ldy, nthreads) == 0) return;
    const int64_t K32 = (K + 31) & ~(int64_t)31, tiles = (N + NR - 1) / NR;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(M * K32) + 64);
    if (!xb) {  /* no scratch: the exact fp32 path needs none */
        baige_linear_bf16_widen(x, M, K, ldx, w, N, ldw, scale, bias, y, ldy, nthreads);
        return;
    }
    round_rows(x, M, K, ldx, xb, K32);
    if (nthreads <= 1 || tiles < 2) {
        run_tiles(xb, M, K, K32, w, N, ldw, bias, y, ldy, 0, tiles);
    } else {
#pragma omp parallel num_threads(nthreads)
        {  /* contiguous ranges of tiles, as schedule(static) splits them */
            const int64_t T = omp_get_num_threads(), i = omp_get_thread_num();
            run_tiles(xb, M, K, K32, w, N, ldw, bias, y, ldy, tiles * i / T, tiles * (i + 1) / T);
        }
    }
    free(xb);
}

int baige_bf16_dot(void) { return 1; }

#else

void baige_linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                       int64_t ldw, const float *scale, const float *bias, float *y, int64_t ldy, int nthreads) {
    baige_linear_bf16_widen(x, M, K, ldx, w, N, ldw, scale, bias, y, ldy, nthreads);
}

int baige_bf16_dot(void) { return 0; }

#endif
