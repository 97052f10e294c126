/* Attention scores of bf16 K caches on the AMX tiles (the avx512_amx variant): attention.c's 16-lane
 * kernel hands each (sequence, KV head) item of a bf16 cache here for q . K, then takes the softmax and
 * the V sums itself (fp32, as for every cache type).
 *
 * The query rows are rounded to bf16 (nearest even) for the tile products, as llama.cpp converts Q to
 * its K cache's type before the dot products and as a bf16 model's q already is in HF transformers;
 * the products of bf16 pairs are exact in fp32 and accumulate in fp32 (TDPBF16PS). Why: the fp32 path
 * reduces every 4 keys x 4 heads of partial sums across lanes, which costs as much as the products;
 * a tile computes 16 keys x 16 heads with no reduction at all.
 */
#include <stdint.h>
#include <string.h>

#include "bf16_convert.h"
#include "kv_cache.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"

/* B tiles 4..7 hold query chunks 0..3 when they stay resident; else chunk ch is loaded into tile 4 */
#define DP_CHUNK(acc, a, ch, resident, bq)                                  \
    do {                                                                    \
        if (!(resident)) {                                                  \
            _tile_loadd(4, (bq)[ch], 64);                                   \
            _tile_dpbf16ps(acc, a, 4);                                      \
        } else if ((ch) == 0) _tile_dpbf16ps(acc, a, 4);                    \
        else if ((ch) == 1) _tile_dpbf16ps(acc, a, 5);                      \
        else if ((ch) == 2) _tile_dpbf16ps(acc, a, 6);                      \
        else _tile_dpbf16ps(acc, a, 7);                                     \
    } while (0)

/* head h's scores of 16 keys (column h of c, scaled) into p_h[0..n) */
static inline void copy_scores(float c[16][16], int64_t group, int64_t n, float scale, float *p, int64_t L) {
    const __m512i rows16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    for (int64_t h = 0; h < group; h++)
        _mm512_mask_storeu_ps(p + h * L, keep, _mm512_mul_ps(_mm512_i32gather_ps(rows16, &c[0][h], 4), _mm512_set1_ps(scale)));
}

/* p[h * L + pos] = scale * q_h . K[pos] for the group's query heads h < group (q: (group, d) fp32) and
 * the L keys of one KV head's bf16 pool kh (num_blocks, bs, d), read in place through table (V's
 * pool vh only prefetched: its first blocks, once K's are all asked for). Per 16 keys: C (16 keys x 16
 * heads, fp32) += A (the 16 K rows, 32 columns at a time, straight from the cache) x B (the same 32
 * columns of the bf16 query rows in TDPBF16PS's pairs layout; heads past the group zero); C's first
 * `group` columns are scaled into p. Two groups of 16 keys at a time (accumulators 0 and 1, so one's
 * products run while the other's wait), the query chunks resident in tiles 4-7 for d <= 128. A block's
 * rows past the context are multiplied too (a C row depends on its A row alone) and never copied out.
 * Configures the tiles and releases them. Returns -1 having done nothing where it does not apply: a
 * block size that is not a multiple of 16, more than 16 query heads per KV head, d not a multiple of
 * 32 or over 256, or tiles refused by the OS; else 0. */
int baige_attention_scores_amx(const float *q, int64_t group, const uint16_t *kh, const uint16_t *vh,
                               const int64_t *table, int64_t bs, int64_t d, int64_t L, float scale, float *p) {
    if (bs % 16 || group > 16 || d % 32 || d > 256 || !amx_permitted()) return -1;
    uint32_t bq[8][16][16] __attribute__((aligned(64)));  /* [32-column chunk][column pair][head] */
    uint16_t qb[16 * 256] __attribute__((aligned(64)));   /* the query rows in bf16, rows past the group zero */
    float c[2][16][16] __attribute__((aligned(64)));
    const int64_t nch = d / 32, nblk = (L + bs - 1) / bs;
    memset(qb, 0, sizeof(uint16_t) * 16 * (size_t)d);
    for (int64_t i = 0; i < group * d; i += 16) store_bf16x16(qb + i, _mm512_loadu_ps(q + i));
    b_pairs(qb, d, bq);
    const int resident = nch <= 4;
    configure_tiles();
    if (resident) {
        _tile_loadd(4, bq[0], 64);
        if (nch > 1) _tile_loadd(5, bq[1], 64);
        if (nch > 2) _tile_loadd(6, bq[2], 64);
        if (nch > 3) _tile_loadd(7, bq[3], 64);
    }
    for (int64_t k0 = 0; k0 < L; k0 += 32) {
        const uint16_t *ka, *kb = 0;
        for (int g = 0; g < 2 && k0 + 16 * g < L; g++) {
            const int64_t pos = k0 + 16 * g, blk = pos / bs, ahead = blk + PF_BLOCKS;
            if (pos % bs == 0) {
                if (ahead < nblk) prefetch_block(kh, KV_BF16, table[ahead] * bs * d, bs * d);
                else if (ahead - nblk < nblk) prefetch_block(vh, KV_BF16, table[ahead - nblk] * bs * d, bs * d);
            }
            const uint16_t *rows = kh + (table[blk] * bs + pos % bs) * d;
            if (g == 0) ka = rows;
            else kb = rows;
        }
        _tile_zero(0);
        if (kb) _tile_zero(1);
        for (int64_t ch = 0; ch < nch; ch++) {
            _tile_loadd(2, ka + 32 * ch, (int)(d * 2));
            DP_CHUNK(0, 2, ch, resident, bq);
            if (kb) {
                _tile_loadd(3, kb + 32 * ch, (int)(d * 2));
                DP_CHUNK(1, 3, ch, resident, bq);
            }
        }
        _tile_stored(0, c[0], 64);
        if (kb) _tile_stored(1, c[1], 64);
        copy_scores(c[0], group, L - k0 < 16 ? L - k0 : 16, scale, p + k0, L);
        if (kb) copy_scores(c[1], group, L - k0 - 16 < 16 ? L - k0 - 16 : 16, scale, p + k0 + 16, L);
    }
    _tile_release();
    return 0;
}
#endif
