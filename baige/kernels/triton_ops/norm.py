"""RMSNorm and fused residual-add + RMSNorm in Triton.

RMSNorm: Zhang & Sennrich 2019 (arXiv:1910.07467). Numerics follow HF's ``LlamaRMSNorm`` and
:func:`baige.kernels.reference.rms_norm`: the mean square and the normalisation are computed in fp32,
the normalised row is cast to ``x.dtype`` and only then multiplied by the weight; the output has the
promoted dtype of weight and x. Structure after Liger-Kernel's ``rms_norm``: one program per row,
the backward recomputes the normalised row from the saved fp32 ``rstd`` and reduces ``dweight``
through per-program fp32 partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from baige.kernels.triton_ops.common import block_for, new_empty


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    w_ptr,
    y_ptr,
    y_row_stride,
    rstd_ptr,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype)  # cast before the weight multiply, as the reference does
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    dy_row_stride,
    x_ptr,
    x_row_stride,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dx_row_stride,
    dw_partial_ptr,  # (n_programs, n_cols) fp32, contiguous
    n_rows,
    n_cols,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid.to(tl.int64), n_rows, n_programs):  # int64 row offsets
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x.to(tl.float32) * rstd
        # y = w * cast(xhat): the cast is transparent to the gradient (as in autograd's .to()).
        dw_acc += dy * xhat.to(x.dtype).to(tl.float32)
        g = dy * w  # dL/dxhat
        # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat))
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask)


@triton.jit
def _add_rms_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    r_ptr,
    r_row_stride,
    w_ptr,
    y_ptr,
    s_ptr,  # contiguous (n_rows, n_cols) outputs: normed, summed
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)  # the rounded sum is the residual stream
    tl.store(s_ptr + row * n_cols + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n_cols + eps)
    y = (sf * rstd).to(s.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., hidden) -> (rows, hidden) view with unit column stride (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _dw_programs(x: torch.Tensor, n_rows: int) -> int:
    """Programs of the backward kernel: one per SM on CUDA (each keeps an fp32 dweight partial), few on CPU."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    return max(1, min(n_rows, sms))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")


def _rms_norm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x2.shape
    y = new_empty((n_rows, n_cols), torch.promote_types(weight.dtype, x2.dtype), x2.device)
    rstd = new_empty((n_rows,), torch.float32, x2.device)
    block = block_for(n_cols)
    _rms_norm_fwd_kernel[(n_rows,)](
        x2, x2.stride(0), weight, y, y.stride(0), rstd, n_cols, eps, BLOCK=block, num_warps=_num_warps(block)
    )
    return y, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = _rows(x)
        w = weight.contiguous()
        y, rstd = _rms_norm_forward(x2, w, eps)
        ctx.save_for_backward(x2, w, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _rows(dy)
        dx = new_empty((n_rows, n_cols), x2.dtype, x2.device)
        n_programs = _dw_programs(x2, n_rows)
        dw_partial = new_empty((n_programs, n_cols), torch.float32, x2.device)
        block = block_for(n_cols)
        _rms_norm_bwd_kernel[(n_programs,)](
            dy2,
            dy2.stride(0),
            x2,
            x2.stride(0),
            w,
            rstd,
            dx,
            dx.stride(0),
            dw_partial,
            n_rows,
            n_cols,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
        dw = dw_partial.sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm ``weight * cast(x * rsqrt(mean(x**2, -1) + eps))`` with autograd for ``x`` and ``weight``.

    Args:
        x: (..., hidden) fp32/fp16/bf16; rows may be strided (the last dim must be, or is made, unit-stride).
        weight: (hidden,), x's dtype or fp32.
        eps: added to the mean square.
    Returns:
        (..., hidden) in ``torch.promote_types(weight.dtype, x.dtype)``. Statistics in fp32; the
        normalised value is cast to ``x.dtype`` before the weight multiply (HF ``LlamaRMSNorm``).
    """
    _check(x, weight)
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``summed = x + residual``; ``rms_norm(summed, weight, eps)`` for inference (no autograd).

    Args:
        x, residual: (..., hidden), same shape and dtype; rows may be strided.
        weight: (hidden,), x's dtype or fp32.
        eps: added to the mean square.
    Returns:
        ``(normed, summed)``: (..., hidden) each; ``summed`` in x's dtype, ``normed`` in the promoted
        dtype of weight and x. Same numerics as :func:`rms_norm` applied to the rounded ``summed``.
    """
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}"
        )
    x2, r2, w = _rows(x), _rows(residual), weight.contiguous()
    n_rows, n_cols = x2.shape
    summed = new_empty((n_rows, n_cols), x.dtype, x.device)
    normed = new_empty((n_rows, n_cols), torch.promote_types(weight.dtype, x.dtype), x.device)
    block = block_for(n_cols)
    _add_rms_norm_fwd_kernel[(n_rows,)](
        x2, x2.stride(0), r2, r2.stride(0), w, normed, summed, n_cols, eps, BLOCK=block, num_warps=_num_warps(block)
    )
    return normed.view(x.shape[:-1] + normed.shape[-1:]), summed.view(x.shape)
