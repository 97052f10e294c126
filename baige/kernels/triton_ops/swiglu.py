"""SwiGLU activation ``silu(gate) * up`` in Triton, forward and backward.

SwiGLU: Shazeer 2020 (arXiv:2002.05202); ``silu(g) = g * sigmoid(g)`` (Elfwing et al. 2017,
arXiv:1702.03118). Everything is computed in fp32 and rounded once to the input dtype. The backward
recomputes the sigmoid instead of saving activations (as Liger-Kernel's ``swiglu`` does):

    d_up = dy * silu(g)        d_gate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from baige.kernels.triton_ops.common import block_for, new_empty

MAX_BLOCK = 1024  # columns per program; a row wider than this spans several programs


@triton.jit
def _silu_mul_fwd_kernel(
    g_ptr,
    g_row_stride,
    u_ptr,
    u_row_stride,
    y_ptr,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    dy_ptr,
    dy_row_stride,
    g_ptr,
    g_row_stride,
    u_ptr,
    u_row_stride,
    dg_ptr,
    du_ptr,
    n_cols,  # dg, du: contiguous (n_rows, n_cols)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    du = dy * silu
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * n_cols + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * n_cols + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (rows, n) view with unit column stride (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(block_for(n_cols), MAX_BLOCK)
    return (n_rows, triton.cdiv(n_cols, block)), block


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g2, u2 = _rows(gate), _rows(up)
        n_rows, n_cols = g2.shape
        y = new_empty(gate.shape, gate.dtype, gate.device)
        grid, block = _grid(n_rows, n_cols)
        _silu_mul_fwd_kernel[grid](g2, g2.stride(0), u2, u2.stride(0), y, n_cols, BLOCK=block)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        n_rows, n_cols = g2.shape
        dy2 = _rows(dy)
        dg = new_empty(ctx.shape, g2.dtype, g2.device)
        du = new_empty(ctx.shape, u2.dtype, u2.device)
        grid, block = _grid(n_rows, n_cols)
        _silu_mul_bwd_kernel[grid](dy2, dy2.stride(0), g2, g2.stride(0), u2, u2.stride(0), dg, du, n_cols, BLOCK=block)
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with autograd for both inputs, computed in fp32 inside the kernel.

    Args:
        gate, up: (..., intermediate), same shape and dtype (fp32/fp16/bf16); rows may be strided,
            e.g. the two halves of one (N, 2 * intermediate) fused gate/up projection.
    Returns:
        (..., intermediate), contiguous, in the inputs' dtype.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} != up {tuple(up.shape)} {up.dtype}")
    return _SiluMul.apply(gate, up)
