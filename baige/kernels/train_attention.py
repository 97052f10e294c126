"""Causal (and explicitly masked) attention for short training sequences on the CPU in bf16 / fp16, with the
scores materialised.

PyTorch's CPU flash attention (``scaled_dot_product_attention``'s fused kernel) tiles queries and keys for
long sequences; at a few hundred tokens its backward costs more than the attention's FLOPs warrant. Here
the (T, T) scores of each head exist at once: ``S = scale * Q K^T`` in fp32 (from the bf16 operands, exact
products accumulated in fp32, as the flash kernel accumulates), the causal mask, a softmax in fp32,
``P`` rounded to the compute dtype (the flash kernel rounds its probabilities the same way before the
``P V`` product) and ``O = P V``; autograd derives the backward, and inside a ``torch.compile`` region
Inductor fuses the mask and softmax with their neighbours. The grouped-query heads share their K/V head by
a reshape of the queries (no repeat of K/V).

:func:`use_materialized` decides when (the speed crossover is a measurement: docs/commands/train.md,
"Where a bf16 training step's time goes"); :func:`baige.kernels.attention` dispatches, and
:func:`baige.kernels.masked_attention` through :func:`use_materialized_masked` (GRPO's prompt-shared
blocks, :mod:`baige.runtime.train.rl.batch`; docs/rl.md).
"""

from __future__ import annotations

import torch

from baige.kernels import dispatch
from baige.kernels.settings import settings

# Longest sequence that takes the materialised path (eager or inside torch.compile): the crossover with the
# flash kernel is measured, see the module docstring.
MAX_LEN = 128


def use_materialized(q: torch.Tensor, k: torch.Tensor, q_offset: int) -> bool:
    """Whether :func:`baige.kernels.attention` takes :func:`causal_attention`: ``BAIGE_KERNELS`` unset or
    ``auto`` (``reference`` keeps PyTorch's attention) with the dispatch on its reference backend, CPU
    tensors in bf16 or fp16 that need a gradient (training), plain causal self-attention (``q_offset`` 0,
    as many keys as queries) at most :data:`MAX_LEN` tokens long."""
    T = q.shape[1]
    return (
        settings().mode == "auto"
        and q.device.type == "cpu"
        and dispatch.backend(q) == "reference"  # looked up per call: a test that forces Triton reroutes it
        and q.dtype in (torch.bfloat16, torch.float16)
        and (q.requires_grad or k.requires_grad)
        and torch.is_grad_enabled()
        and q_offset == 0
        and k.shape[1] == T
        and T <= MAX_LEN
    )


def use_materialized_masked(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`baige.kernels.masked_attention` takes :func:`masked_attention`: the conditions of
    :func:`use_materialized` for any query offset, with at most :data:`MAX_LEN` queries and keys (the
    blocks of GRPO's packed prompt-shared rows, whose masked flash backward costs far more)."""
    return (
        settings().mode == "auto"
        and q.device.type == "cpu"
        and dispatch.backend(q) == "reference"
        and q.dtype in (torch.bfloat16, torch.float16)
        and (q.requires_grad or k.requires_grad)
        and torch.is_grad_enabled()
        and max(q.shape[1], k.shape[1]) <= MAX_LEN
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention with the scores materialised (see the module docstring).

    Args:
        q: (B, T, n_heads, head_dim), bf16 or fp16.
        k, v: (B, T, n_kv_heads, head_dim), q's dtype; ``n_heads % n_kv_heads == 0``.
        scale: softmax scale.
    Returns:
        (B, T, n_heads, head_dim) in q's dtype: query ``i`` attends to keys ``0..i``.
    """
    T = q.shape[1]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return _materialized(q, k, v, scale, future)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """Attention under an explicit boolean mask with the scores materialised (the module docstring's
    scheme), for short blocks of training's packed layouts (:func:`use_materialized_masked`).

    Args:
        q: (B, T, n_heads, head_dim), bf16 or fp16.
        k: (B, S, n_kv_heads, head_dim), v: (B, S, n_kv_heads, head_dim_v), q's dtype;
            ``n_heads % n_kv_heads == 0``.
        scale: softmax scale.
        mask: (B, T, S) bool, True where query t may attend key s; every query row needs a True.
    Returns:
        (B, T, n_heads, head_dim_v) in q's dtype.
    """
    return _materialized(q, k, v, scale, ~mask[:, None, None])


def _materialized(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, hidden: torch.Tensor
) -> torch.Tensor:
    """``softmax(scale * Q K^T, hidden keys at -inf) V`` with fp32 scores, ``P`` rounded to q's dtype;
    ``hidden`` broadcasts to (B, n_kv_heads, group, T, S)."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    # query head h = kv * g + j uses K/V head kv: (B, H, T, D) -> (B, Hkv, g * T, D)
    qh = q.transpose(1, 2).reshape(B, Hkv, g * T, D)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S, D)
    s = (qh.float() @ kh.float().transpose(-1, -2)).view(B, Hkv, g, T, S) * scale  # fp32 scores
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1).to(q.dtype)
    o = p.view(B, Hkv, g * T, S) @ vh  # (B, Hkv, g * T, Dv)
    return o.view(B, H, T, -1).transpose(1, 2)
