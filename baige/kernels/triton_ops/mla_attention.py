"""MLA decode attention over the paged latent cache in Triton (see :mod:`baige.kernels.mla`).

One program per (sequence, tile of ``BLOCK_H`` query heads): every head of a sequence reads the same
latent rows, so a program loads each cached row once for its whole tile of heads (the point of the
absorbed form: MQA with one wide shared head). The row splits into the latent part (``kv_lora_rank``
columns, the keys' first part and the values) and the rope part; scores are
``q_lat . c_kv + q_pe . k_pe``; an online softmax (Milakov & Gimelshein 2018) runs over tiles of
``BLOCK_N`` cached tokens gathered through the block table; fp32 accumulation, IEEE fp32 dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import block_for, new_empty


@triton.jit
def _mla_decode_kernel(
    Q,
    KV,
    TABLES,
    LENS,
    OUT,
    n_heads,
    kv_lora_rank,
    rope_dim,
    block_size,
    s_qs,
    s_qh,
    s_kb,
    s_kt,
    s_ts,
    s_os,
    s_oh,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < n_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_mask = offs_l < kv_lora_rank
    r_mask = offs_r < rope_dim
    q_row = Q + s * s_qs + h[:, None].to(tl.int64) * s_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0).to(tl.float32)
    q_pe = tl.load(q_row + kv_lora_rank + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = q_pe.to(tl.float32)
    ctx = tl.load(LENS + s)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for start in range(0, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < ctx
        block = tl.load(TABLES + s * s_ts + n // block_size, mask=n_mask, other=0).to(tl.int64)
        row = KV + block * s_kb + (n % block_size).to(tl.int64) * s_kt  # (BLOCK_N,) row starts
        c = tl.load(row[:, None] + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        c = c.to(tl.float32)  # (BLOCK_N, BLOCK_L): latent keys and values
        k_pe = tl.load(row[:, None] + kv_lora_rank + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        qk = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
        qk += tl.dot(q_pe, tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
        qk = tl.where(n_mask[None, :], qk * scale, float("-inf"))  # (BLOCK_H, BLOCK_N)
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m = m_new
    out = acc / denom[:, None]
    o_ptr = OUT + s * s_os + h[:, None].to(tl.int64) * s_oh + offs_l[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.mla_decode_attention` (shapes checked there; no host sync).

    Raises:
        ValueError: the cache is not contiguous or not in q's dtype.
    """
    S, H, D = q.shape
    if not kv_cache.is_contiguous() or kv_cache.dtype != q.dtype:
        raise ValueError(f"mla_decode_attention: a contiguous {q.dtype} latent cache is needed, got {kv_cache.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    tables = block_tables.contiguous()
    out = new_empty((S, H, kv_lora_rank), q.dtype, q.device)
    block_h = block_for(min(H, 64), 16)
    if S:
        _mla_decode_kernel[(S, triton.cdiv(H, block_h))](
            q,
            kv_cache,
            tables,
            context_lens.contiguous(),
            out,
            H,
            kv_lora_rank,
            D - kv_lora_rank,
            kv_cache.shape[2],
            q.stride(0),
            q.stride(1),
            kv_cache.stride(1),
            kv_cache.stride(2),
            tables.stride(0),
            out.stride(0),
            out.stride(1),
            float(scale),
            BLOCK_H=block_h,
            BLOCK_N=16,
            BLOCK_L=block_for(kv_lora_rank, 16),
            BLOCK_R=block_for(D - kv_lora_rank, 16),
        )
    return out
