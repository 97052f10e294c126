/* KV cache element types as baige/kernels/cpu/ops.py numbers them (ops.c stores, attention.c and
 * attention_amx.c read), and the prefetch of one cache block. */
#ifndef BAIGE_KV_CACHE_H
#define BAIGE_KV_CACHE_H

#include <immintrin.h>
#include <stdint.h>

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* How many blocks ahead the 16-lane attention (attention.c) and the AMX scores (attention_amx.c)
 * prefetch K (then V's first blocks) and V. On an AMD EPYC (Zen 4) VM 0, 1, 2, 4 and 8 all measured the
 * same within the noise (the kernel is bound by the scattered blocks' memory reads, not by how far
 * ahead they are asked for), and on an Intel Xeon (Sapphire Rapids class) VM 2 and 4 blocks, T0 or
 * T1/T2 hints, measured the same too: 2 is a choice, not a tuned optimum. */
enum { PF_BLOCKS = 2 };

/* Ask for the n values of a cache block at offset to be brought into cache (one prefetch per 64-byte
 * line): blocks are scattered pages, where the hardware prefetcher has to start over each time. */
static inline void prefetch_block(const void *cache, int kv_dtype, int64_t offset, int64_t n) {
    const char *p = (const char *)cache + offset * (kv_dtype ? 2 : 4);
    const int64_t bytes = n * (kv_dtype ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

#endif
