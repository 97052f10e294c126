/* Causal prefill attention of a bf16 model over its bf16 paged KV cache on the AMX tiles (the avx512_amx
 * variant): q . K and P . V both as tile products, the softmax in fp32 AVX-512 lanes.
 *
 * Why: torch's flash SDPA, which these chunks took before, runs one call per sequence and layer far below
 * the AMX matmul rate, most of its time outside its matrix products, and was a large share of a bf16
 * prefill step (measured: docs/benchmarks/archive.md, "bf16 prefill on AMX: attention, RoPE, K/V stores,
 * quantized prefill").
 *
 * Work items are (sequence, KV head, block of 16 query columns), a column being one (token, query head)
 * pair of the group that shares the KV head. Per item, with every key up to the block's last position:
 *   1. scores: C (16 keys x 16 columns, fp32) += A (16 K rows x 32 of d, read in place from the cache,
 *      TDPBF16PS) x B (the 16 query columns' same 32 values in TDPBF16PS's pairs layout), stored straight
 *      to a (keys, 16) buffer: row r holds key r's score for the 16 columns;
 *   2. softmax down that buffer, 16 columns per vector (no lane reductions): scaled, keys past a
 *      column's position masked out, max, e = exp(s - max), l = sum of e in fp32;
 *   3. P . V: C (16 columns x 16 of d) += A (the columns' e rounded to bf16, 32 keys per tile row,
 *      transposed out of the buffer 16 x 16 at a time) x B (V's rows interleaved in key pairs: repacked
 *      once per (sequence, KV head) into a zero-padded scratch), 4 accumulators at a time;
 *   4. out = C / l, rounded to bf16 once.
 * This is the arithmetic of flash attention on bf16 (Dao et al. 2022; torch's CPU kernel rounds P to bf16
 * for its P . V products too) with the whole score row held, so no rescaling pass: the scratch is 96 bytes
 * per key per thread. Items are spread over OpenMP threads, each summed in one order: results do not depend
 * on the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BAIGE_PREFILL_UNSUPPORTED (-1)
#define BAIGE_PREFILL_NOMEM (-2)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16_convert.h"
#include "vec_math.h"

/* V rows 0 .. C of one KV head (read through the block table: pool vh (num_blocks, bs, d)) interleaved in
 * key pairs: vp[(kp * d + j) * 2 + e] = V[2 kp + e][j], keys from C up to cpad zero */
static void repack_v(const uint16_t *vh, const int64_t *table, int64_t bs, int64_t d, int64_t C, int64_t cpad,
                     uint16_t *vp) {
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                         0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t kp = 0; kp < cpad / 2; kp++) {
        const int64_t k0 = 2 * kp, k1 = 2 * kp + 1;
        const uint16_t *r0 = k0 < C ? vh + (table[k0 / bs] * bs + k0 % bs) * d : 0;
        const uint16_t *r1 = k1 < C ? vh + (table[k1 / bs] * bs + k1 % bs) * d : 0;
        uint16_t *o = vp + kp * d * 2;
        for (int64_t j = 0; j < d; j += 32) {
            const __m512i a = r0 ? _mm512_loadu_si512(r0 + j) : _mm512_setzero_si512();
            const __m512i b = r1 ? _mm512_loadu_si512(r1 + j) : _mm512_setzero_si512();
            _mm512_storeu_si512(o + 2 * j, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(o + 2 * j + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* One item: columns c0 .. c0 + n (n <= 16) of sequence chunk (T tokens at q rows q0.., context C) and KV
 * head g; group G query heads per KV head, hq in all. sc: (cpad, 16) fp32, pt: (16, cpad) bf16 scratch. */
static void item(const uint16_t *q, int64_t hq, const uint16_t *kh, const uint16_t *vp, const int64_t *table,
                 int64_t bs, int64_t d, int64_t T, int64_t C, int64_t G, int64_t g, int64_t c0, int64_t n, float scale,
                 float *sc, uint16_t *pt, uint16_t *out) {
    const int64_t first = C - T;                  /* position of the chunk's token 0 */
    const int64_t last_tok = (c0 + n - 1) / G;    /* the block's last token */
    const int64_t L = first + last_tok + 1;       /* keys the block needs */
    const int64_t Lp = (L + 31) / 32 * 32, nch = d / 32;
    /* B: the columns' query rows in bf16, pairs layout per 32-wide chunk (bq[ch][pair][column]) */
    uint16_t qb[16 * 256] __attribute__((aligned(64)));
    uint32_t bq[8][16][16] __attribute__((aligned(64)));
    int32_t posv[16] __attribute__((aligned(64)));
    for (int64_t c = 0; c < 16; c++) {
        if (c < n) {
            const int64_t tok = (c0 + c) / G, head = g * G + (c0 + c) % G;
            memcpy(qb + c * d, q + (tok * hq + head) * d, (size_t)d * 2);
            posv[c] = (int32_t)(first + tok);
        } else {
            memset(qb + c * d, 0, (size_t)d * 2);
            posv[c] = (int32_t)(L - 1);
        }
    }
    b_pairs(qb, d, bq);
    /* 1. scores, 16 keys per tile product, into sc rows: two groups of 16 keys in flight (accumulators 0
     * and 1), the query chunks resident in tiles 6 and 7 when d <= 64 */
    const int resident = nch <= 2;
    if (resident) {
        _tile_loadd(6, bq[0], 64);
        if (nch > 1) _tile_loadd(7, bq[1], 64);
    }
    for (int64_t k0 = 0; k0 < L; k0 += 32) {
        const uint16_t *a = kh + (table[k0 / bs] * bs + k0 % bs) * d;
        const int two = k0 + 16 < L;
        const uint16_t *b = two ? kh + (table[(k0 + 16) / bs] * bs + (k0 + 16) % bs) * d : a;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t ch = 0; ch < nch; ch++) {
            _tile_loadd(4, a + 32 * ch, (int)(d * 2));
            if (two) _tile_loadd(5, b + 32 * ch, (int)(d * 2));
            if (resident && ch == 0) {
                _tile_dpbf16ps(0, 4, 6);
                if (two) _tile_dpbf16ps(1, 5, 6);
            } else if (resident) {
                _tile_dpbf16ps(0, 4, 7);
                if (two) _tile_dpbf16ps(1, 5, 7);
            } else {
                _tile_loadd(6, bq[ch], 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) _tile_dpbf16ps(1, 5, 6);
            }
        }
        _tile_stored(0, sc + k0 * 16, 64);
        if (two) _tile_stored(1, sc + (k0 + 16) * 16, 64);
    }
    /* 2. softmax down the columns; rows from L to Lp zeroed (they pad the last 32-key tile) */
    const __m512i pos = _mm512_load_si512(posv);
    const __m512 sv = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-__builtin_inff());
    __m512 m = ninf;
    for (int64_t r = 0; r < L; r++) {
        const __mmask16 ok = _mm512_cmp_epi32_mask(_mm512_set1_epi32((int32_t)r), pos, _MM_CMPINT_LE);
        const __m512 s = _mm512_mask_mov_ps(ninf, ok, _mm512_mul_ps(_mm512_load_ps(sc + r * 16), sv));
        _mm512_store_ps(sc + r * 16, s);
        m = _mm512_max_ps(m, s);
    }
    __m512 l = _mm512_setzero_ps();
    for (int64_t r = 0; r < L; r++) {
        const __m512 s = _mm512_load_ps(sc + r * 16);
        const __mmask16 live = _mm512_cmp_ps_mask(s, ninf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, m)));
        _mm512_store_ps(sc + r * 16, e);
        l = _mm512_add_ps(l, e);
    }
    for (int64_t r = L; r < Lp; r++) _mm512_store_ps(sc + r * 16, _mm512_setzero_ps());
    /* P^T in bf16: pt[c][k] = e of key k for column c */
    for (int64_t k0 = 0; k0 < Lp; k0 += 32) {
        __m512 x[16], y[16];
        for (int i = 0; i < 16; i++) x[i] = _mm512_load_ps(sc + (k0 + i) * 16);
        for (int i = 0; i < 16; i++) y[i] = _mm512_load_ps(sc + (k0 + 16 + i) * 16);
        transpose16(x);
        transpose16(y);
        for (int c = 0; c < 16; c++) _mm512_store_si512(pt + c * Lp + k0, (__m512i)_mm512_cvtne2ps_pbh(y[c], x[c]));
    }
    /* 3. P . V, up to 4 blocks of 16 output columns at a time; 4. scaled by 1 / l into bf16 rows */
    float acc[16][16] __attribute__((aligned(64)));
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t j0 = 0; j0 < d; j0 += 64) {
        const int nb = d - j0 >= 64 ? 4 : (int)((d - j0) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < Lp; k0 += 32) {
            _tile_loadd(4, pt + k0, (int)(Lp * 2));
            const uint16_t *b = vp + (k0 / 2) * d * 2 + 2 * j0;
            _tile_loadd(5, b, (int)(d * 4));
            _tile_dpbf16ps(0, 4, 5);
            if (nb > 1) { _tile_loadd(6, b + 32, (int)(d * 4)); _tile_dpbf16ps(1, 4, 6); }
            if (nb > 2) { _tile_loadd(7, b + 64, (int)(d * 4)); _tile_dpbf16ps(2, 4, 7); }
            if (nb > 3) { _tile_loadd(5, b + 96, (int)(d * 4)); _tile_dpbf16ps(3, 4, 5); }
        }
        for (int t = 0; t < nb; t++) {
            store_acc(t, acc);
            for (int64_t c = 0; c < n; c++) {
                const int64_t tok = (c0 + c) / G, head = g * G + (c0 + c) % G;
                store_bf16x16(out + (tok * hq + head) * d + j0 + 16 * t,
                              _mm512_mul_ps(_mm512_load_ps(acc[c]), _mm512_set1_ps(inv[c])));
            }
        }
    }
}

/* q, out: (N, hq, d) bf16 contiguous, the chunks of P sequences back to back (cu_seqlens (P + 1,)); K/V
 * pools kc, vc: (hk, slots, d) bf16 with slots = num_blocks * bs; block_tables (P, W) int64; context_lens
 * (P,): each sequence's context after its chunk (the chunk's K/V already stored). Token j of chunk i sits
 * at position context_lens[i] - T_i + j and sees keys 0 .. that position. Returns
 * BAIGE_PREFILL_UNSUPPORTED having done nothing where it does not apply (bs not a multiple of 16, d not a
 * multiple of 32 or over 256, hq not a multiple of hk, tiles refused by the OS), BAIGE_PREFILL_NOMEM
 * without scratch memory, else 0. */
int baige_prefill_attention_amx(const uint16_t *q, int64_t hq, int64_t hk, int64_t d, const uint16_t *kc,
                                const uint16_t *vc, int64_t slots, int64_t bs, const int64_t *block_tables, int64_t W,
                                const int64_t *cu_seqlens, const int64_t *context_lens, int64_t P, float scale,
                                uint16_t *out, int nthreads) {
    if (bs % 16 || d % 32 || d > 256 || hk <= 0 || hq % hk || !amx_permitted()) return BAIGE_PREFILL_UNSUPPORTED;
    const int64_t G = hq / hk;
    int64_t cmax = 0, vtotal = 0, items = 0;
    int64_t *voff = malloc(sizeof(int64_t) * (size_t)(P + 1));
    int64_t *ifirst = malloc(sizeof(int64_t) * (size_t)(P + 1));
    if (!voff || !ifirst) { free(voff); free(ifirst); return BAIGE_PREFILL_NOMEM; }
    for (int64_t i = 0; i < P; i++) {
        const int64_t C = context_lens[i], cpad = (C + 31) / 32 * 32, T = cu_seqlens[i + 1] - cu_seqlens[i];
        cmax = C > cmax ? C : cmax;
        voff[i] = vtotal;
        vtotal += hk * cpad * d;
        ifirst[i] = items;
        items += hk * ((T * G + 15) / 16);
    }
    voff[P] = vtotal;
    ifirst[P] = items;
    const int64_t cpmax = (cmax + 31) / 32 * 32;
    uint16_t *vp = aligned_alloc(64, sizeof(uint16_t) * (size_t)vtotal + 64);
    int failed = vp == 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && !failed)
    {
        float *sc = aligned_alloc(64, sizeof(float) * 16 * (size_t)cpmax + 64);
        uint16_t *pt = aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)cpmax + 64);
        if (!sc || !pt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < P * hk; t++) {
                const int64_t i = t / hk, g = t % hk, C = context_lens[i];
                repack_v(vc + g * slots * d, block_tables + i * W, bs, d, C, (C + 31) / 32 * 32,
                         vp + voff[i] + g * ((C + 31) / 32 * 32) * d);
            }
            configure_tiles();
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                int64_t i = 0, hi = P - 1;  /* the last sequence whose first item is at or before it */
                while (i < hi) {
                    const int64_t mid = (i + hi + 1) / 2;
                    if (ifirst[mid] <= it) i = mid;
                    else hi = mid - 1;
                }
                const int64_t T = cu_seqlens[i + 1] - cu_seqlens[i], C = context_lens[i];
                const int64_t per = (T * G + 15) / 16, g = (it - ifirst[i]) / per, c0 = (it - ifirst[i]) % per * 16;
                const int64_t n = T * G - c0 < 16 ? T * G - c0 : 16;
                item(q + cu_seqlens[i] * hq * d, hq, kc + g * slots * d, vp + voff[i] + g * ((C + 31) / 32 * 32) * d,
                     block_tables + i * W, bs, d, T, C, G, g, c0, n, scale, sc, pt, out + cu_seqlens[i] * hq * d);
            }
            _tile_release();
        }
        free(sc);
        free(pt);
    }
    free(vp);
    free(voff);
    free(ifirst);
    return failed ? BAIGE_PREFILL_NOMEM : 0;
}

#else

int baige_prefill_attention_amx(const uint16_t *q, int64_t hq, int64_t hk, int64_t d, const uint16_t *kc,
                                const uint16_t *vc, int64_t slots, int64_t bs, const int64_t *block_tables, int64_t W,
                                const int64_t *cu_seqlens, const int64_t *context_lens, int64_t P, float scale,
                                uint16_t *out, int nthreads) {
    (void)q, (void)hq, (void)hk, (void)d, (void)kc, (void)vc, (void)slots, (void)bs, (void)block_tables, (void)W;
    (void)cu_seqlens, (void)context_lens, (void)P, (void)scale, (void)out, (void)nthreads;
    return BAIGE_PREFILL_UNSUPPORTED;
}

#endif
