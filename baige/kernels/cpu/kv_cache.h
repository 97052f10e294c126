/* KV cache element types as baige/kernels/cpu/ops.py numbers them (ops.c stores, attention.c reads). */
#ifndef BAIGE_KV_CACHE_H
#define BAIGE_KV_CACHE_H

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

#endif
