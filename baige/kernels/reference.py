"""Pure-PyTorch twins of every ``baige.kernels`` op.

These are the numerical oracle for the Triton kernels and the CPU path of the model. Each
function has the same signature and semantics as its public counterpart in
``baige.kernels``; see the docstrings there for shapes and dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32, cast back before the weight multiply: the order HF's LlamaRMSNorm uses.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(-2)  # (..., 1, D): broadcast over heads
    sin = sin.unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0
) -> torch.Tensor:
    T, S = q.shape[1], k.shape[1]
    qh = q.transpose(1, 2)  # (B, H, T, D)
    kh = k.transpose(1, 2)  # (B, Hkv, S, D); SDPA broadcasts the KV heads over query groups
    vh = v.transpose(1, 2)  # (B, Hkv, S, Dv)
    gqa = q.shape[2] != k.shape[2]
    if T == 1 and q_offset == S - 1:  # one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif q_offset == 0 and T == S:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at absolute position q_offset + i and sees keys 0..q_offset + i.
        qpos = torch.arange(T, device=q.device) + q_offset
        mask = torch.arange(S, device=q.device)[None, :] <= qpos[:, None]  # (T, S)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)  # (B, T, H, Dv)
