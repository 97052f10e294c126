"""The public op API of baige: the only place the model, engine and trainer call for hot ops.

Every op has a pure-PyTorch twin in :mod:`baige.kernels.reference` with the same signature. Today
every op dispatches to that reference; fast Triton paths plug in behind these same functions.
"""

from __future__ import annotations

import torch

from baige.kernels import reference

__all__ = ["rms_norm", "add_rms_norm", "apply_rope", "silu_mul", "attention"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square layer norm (Zhang & Sennrich 2019, arXiv:1910.07467).

    ``y = weight * (x / sqrt(mean(x**2, -1) + eps))`` with the statistics in fp32.

    Args:
        x: (..., hidden), any float dtype.
        weight: (hidden,), same dtype as ``x`` (or fp32).
        eps: added to the mean square.
    Returns:
        (..., hidden) in the promoted dtype of ``weight`` and ``x``.
    """
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm for inference.

    Args:
        x, residual: (..., hidden), same dtype.
        weight: (hidden,).
    Returns:
        ``(rms_norm(x + residual), x + residual)``, both (..., hidden).
    """
    return reference.add_rms_norm(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864), rotate-half (HF) convention.

    Args:
        q: (..., n_heads, head_dim).
        k: (..., n_kv_heads, head_dim); GQA shapes are fine, heads only broadcast.
        cos, sin: (..., head_dim), the leading dims matching q/k's without the head axis.
    Returns:
        ``(q_rot, k_rot)`` with the shapes and dtypes of ``q`` and ``k``.
    """
    return reference.apply_rope(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` (Shazeer 2020, arXiv:2002.05202).

    Args:
        gate, up: (..., intermediate), same shape and dtype.
    Returns:
        (..., intermediate).
    """
    return reference.silu_mul(gate, up)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0
) -> torch.Tensor:
    """Causal scaled-dot-product attention with grouped-query heads over contiguous K/V.

    Query ``i`` is at absolute position ``q_offset + i`` and attends to keys ``0..q_offset + i``
    (the causal mask is aligned to the bottom right when ``q_offset = S - T``).

    Args:
        q: (B, T, n_heads, head_dim).
        k, v: (B, S, n_kv_heads, head_dim) with ``n_heads % n_kv_heads == 0`` and ``S >= q_offset + T``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        q_offset: absolute position of the first query.
    Returns:
        (B, T, n_heads, head_dim) in the dtype of ``q``.
    """
    return reference.attention(q, k, v, scale, q_offset)
