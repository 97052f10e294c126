"""Rotary position embedding in Triton, rotate-half (HF) convention, forward and backward.

RoPE: Su et al. 2021 (arXiv:2104.09864). With ``x = [x1, x2]`` split at ``D/2`` and ``cos``/``sin``
full head_dim vectors ``[c1, c2]``/``[s1, s2]`` (HF's ``q * cos + rotate_half(q) * sin``):

    y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2

The backward is the transpose of that linear map: ``dx1 = dy1 * c1 + dy2 * s2``,
``dx2 = dy2 * c2 - dy1 * s1``. One kernel serves both directions (``BACKWARD`` swaps which sine half
multiplies which input half and its sign). One program handles one token: it loads that token's
cos/sin once and rotates every query and key head (Liger-Kernel's ``rope`` does the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from baige.kernels.triton_ops.common import block_for, new_empty


@triton.jit
def _rotate_heads(
    x_ptr,
    x_sh,
    o_ptr,
    n_heads,
    c1,
    c2,
    sa,
    sb,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate a (n_heads, 2 * HALF) tile: ``o1 = x1 * c1 + x2 * sa``, ``o2 = x2 * c2 + x1 * sb``.
    ``x_ptr`` points at head 0 (head stride ``x_sh``, unit column stride); ``o_ptr`` is contiguous."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < HALF)
    x_off = heads * x_sh + cols
    o_off = heads * (2 * HALF) + cols
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1 + x2 * sa
    o2 = x2 * c2 + x1 * sb
    tl.store(o_ptr + o_off, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_off + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    q_sa,
    q_st,
    q_sh,
    k_ptr,
    k_sa,
    k_st,
    k_sh,
    cos_ptr,
    c_sa,
    c_st,
    sin_ptr,
    s_sa,
    s_st,
    qo_ptr,
    ko_ptr,  # contiguous (A * T, n_heads, D) / (A * T, n_kv_heads, D)
    T,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    a = pid // T
    t = pid % T
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    c_base = cos_ptr + a * c_sa + t * c_st
    s_base = sin_ptr + a * s_sa + t * s_st
    c1 = tl.load(c_base + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_base + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_base + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_base + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:
        sa = s2
        sb = -s1
    else:
        sa = -s1
        sb = s2
    _rotate_heads(
        q_ptr + a * q_sa + t * q_st,
        q_sh,
        qo_ptr + pid * n_q_heads * (2 * HALF),
        n_q_heads,
        c1,
        c2,
        sa,
        sb,
        HALF,
        BLOCK_QH,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + a * k_sa + t * k_st,
        k_sh,
        ko_ptr + pid * n_k_heads * (2 * HALF),
        n_k_heads,
        c1,
        c2,
        sa,
        sb,
        HALF,
        BLOCK_KH,
        BLOCK_HALF,
    )


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., H, D) -> (A, T, H, D) with unit column stride; T is the last leading dim (1 if none)."""
    lead = t.shape[:-2]
    t4 = t.reshape(-1, lead[-1] if lead else 1, *t.shape[-2:])
    return t4 if t4.stride(-1) == 1 else t4.contiguous()


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (A, T, D) with unit column stride (broadcast strides of 0 survive where a view allows)."""
    lead = t.shape[:-1]
    t3 = t.reshape(-1, lead[-1] if lead else 1, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _rope(q: torch.Tensor, k: torch.Tensor, cos3: torch.Tensor, sin3: torch.Tensor, backward: bool):
    """Rotate ``q``, ``k`` (..., heads, D) by (A, T, D) ``cos3``/``sin3``; new contiguous outputs."""
    q4, k4 = _as_4d(q), _as_4d(k)
    A, T, Hq, D = q4.shape
    Hk = k4.shape[2]
    qo = new_empty(q.shape, q.dtype, q.device)
    ko = new_empty(k.shape, k.dtype, k.device)
    half = D // 2
    _rope_kernel[(A * T,)](
        q4,
        q4.stride(0),
        q4.stride(1),
        q4.stride(2),
        k4,
        k4.stride(0),
        k4.stride(1),
        k4.stride(2),
        cos3,
        cos3.stride(0),
        cos3.stride(1),
        sin3,
        sin3.stride(0),
        sin3.stride(1),
        qo,
        ko,
        T,
        Hq,
        Hk,
        HALF=half,
        BACKWARD=backward,
        BLOCK_QH=block_for(Hq, 1),
        BLOCK_KH=block_for(Hk, 1),
        BLOCK_HALF=block_for(half),
        num_warps=4 if (Hq + Hk) * D <= 8192 else 8,
    )
    return qo, ko


class _ApplyRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos3, sin3):
        ctx.save_for_backward(cos3, sin3)
        return _rope(q, k, cos3, sin3, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk):
        cos3, sin3 = ctx.saved_tensors
        dq_in, dk_in = _rope(dq, dk, cos3, sin3, backward=True)
        return dq_in, dk_in, None, None


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of ``q`` and ``k`` with autograd for both (``cos``/``sin`` get no gradient).

    Args:
        q: (..., n_heads, head_dim) fp32/fp16/bf16, head_dim even; unit stride along head_dim.
        k: (..., n_kv_heads, head_dim), the same leading shape and head_dim (GQA: any head count).
        cos, sin: (..., head_dim), broadcastable to q's leading shape (e.g. (T, D) or (1, T, D)
            against (B, T, H, D)); full head_dim vectors, the two halves need not be equal.
    Returns:
        ``(q_rot, k_rot)``: contiguous, shapes and dtypes of ``q`` and ``k``; arithmetic in fp32.
    """
    lead, D = q.shape[:-2], q.shape[-1]
    if k.shape[:-2] != lead or k.shape[-1] != D:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ outside the head axis")
    if D % 2:
        raise ValueError(f"apply_rope: head_dim {D} is odd")
    if q.numel() == 0 or k.numel() == 0:  # nothing to rotate (the reference's result: empty tensors)
        return q * 1, k * 1
    cos3 = _as_3d(torch.broadcast_to(cos, (*lead, D)))  # (A, T, D); broadcast dims keep stride 0
    sin3 = _as_3d(torch.broadcast_to(sin, (*lead, D)))
    return _ApplyRope.apply(q, k, cos3, sin3)
