"""Causal flash attention over packed variable-length sequences, forward and backward, in Triton.

The algorithm is FlashAttention-2 (Dao 2023, arXiv:2307.08691): queries are tiled, keys streamed
through an online softmax with fp32 statistics, and the backward recomputes the probabilities from
the saved log-sum-exp instead of storing them. Exponentials are taken base 2 (``exp2``) with the
scale folded into ``scale * log2(e)``; the saved log-sum-exp is in those base-2 units.

Layout: ``q`` (Nq, H, D), ``k``/``v`` (Nk, Hkv, D) packed by ``cu_seqlens`` (``flash_attn_varlen_func``'s
convention); the causal mask is aligned to the bottom right (query j of a sequence with Lq queries and
Lk keys sees keys 0..Lk - Lq + j). Grouped-query heads: query head h reads KV head h // (H / Hkv); the
dK/dV program of a KV head loops over its query heads, so no atomics are needed.

:func:`attention` also takes a sliding window, attention sinks (with their gradient) and a logit
soft-cap (:mod:`.attention_variants`); with a window the tiles wholly outside every window of a program
are skipped, forward and backward.

The kernels and their launchers live in :mod:`.flash_attention_fwd` and :mod:`.flash_attention_bwd`
(:mod:`.flash_attention_bwd_dkdv`); this module holds the autograd Function over them and the Triton
twins of the public ops.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from baige.kernels.triton_ops.flash_attention_bwd import flash_attention_backward
from baige.kernels.triton_ops.flash_attention_fwd import flash_attention_forward


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(q, k, v, cu_q, cu_k):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"flash attention expects q (Nq, H, D) and k, v (Nk, Hkv, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]} with equal head_dim")
    if cu_q.shape != cu_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")


class _FlashAttnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None, sinks=None, softcap=None):
        _check(q, k, v, cu_q, cu_k)
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # read with unit stride
        variants = {"window": window, "sinks": sinks, "softcap": softcap}
        o, lse = flash_attention_forward(q, k, v, cu_q, cu_k, max_q, scale, variants)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, sinks)
        ctx.max_q, ctx.max_k, ctx.scale, ctx.window, ctx.softcap = max_q, max_k, scale, window, softcap
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        variants = {"window": ctx.window, "sinks": sinks, "softcap": ctx.softcap}
        dq, dk, dv, dsinks = flash_attention_backward(
            do.contiguous(), q, k, v, o, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.scale, variants
        )
        dsinks = None if dsinks is None else dsinks.to(sinks.dtype)
        return dq, dk, dv, None, None, None, None, None, None, dsinks, None


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.flash_attention_varlen` (see there for shapes)."""
    return _FlashAttnVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_offset: int = 0,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.attention`: (B, T, H, D) queries over (B, S, Hkv, D) keys,
    run as B packed sequences of T queries and ``q_offset + T`` keys (later keys are masked anyway).
    ``window``, ``sinks`` ((H,); its gradient is :func:`.flash_attention_bwd.sink_grad`) and ``softcap``
    as there; with a window, key tiles wholly outside every query's window are not read, forward or
    backward.

    Raises:
        ValueError: fewer than ``q_offset + T`` keys; a bad window, sinks or softcap.
    """
    B, T, H, D = q.shape
    S = q_offset + T
    if B == 0 or T == 0:
        return q.new_zeros(q.shape)
    if k.shape[1] < S:
        raise ValueError(f"attention: {k.shape[1]} keys cannot hold q_offset {q_offset} + {T} queries")
    k, v = k[:, :S], v[:, :S]
    cu_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
    q, k, v = q.reshape(B * T, H, D), k.reshape(B * S, *k.shape[2:]), v.reshape(B * S, *v.shape[2:])
    out = _FlashAttnVarlen.apply(q, k, v, cu_q, cu_k, T, S, scale, window, sinks, softcap)
    return out.view(B, T, H, D)
