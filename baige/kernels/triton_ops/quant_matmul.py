"""Weight-only quantized linear layer in Triton: dequantize weight tiles in registers inside a tiled
matmul (the approach of GPTQ-for-LLaMa's / AutoGPTQ's Triton kernels, with compressed-tensors layouts).

Layouts (see :mod:`baige.runtime.quant.scheme`): int8 per output channel, ``qweight`` int8 (out, in) and
``scale`` (out, 1); int4 group-wise, ``qweight`` int32 (out, ceil(in / 8)) with element ``j`` of a
word in bits ``4j..4j+3`` stored as ``q + 8``, ``scale`` (out, n_groups) and an optional unpacked
``zero_point`` (out, n_groups). Dequantization (compressed-tensors): ``w = (q - zero_point) * scale``.

Each program computes a (BLOCK_M, BLOCK_N) tile of ``y = x @ W.T``: per K step it loads a
(BLOCK_K, BLOCK_N) tile of the transposed integer weight, unpacks it, finds each element's group as
``k // group_size`` (so any group size works, including a partial last group), dequantizes in fp32,
rounds to x's dtype (as the reference does) and accumulates ``tl.dot`` in fp32. Forward only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import new_empty


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    x_sm,  # (M, K), unit column stride
    qw_ptr,
    qw_sn,  # (N, K) int8 or (N, ceil(K / 8)) int32, unit column stride
    s_ptr,
    s_sn,
    s_sg,  # (N, n_groups)
    zp_ptr,
    zp_sn,
    zp_sg,  # (N, n_groups) or unused
    b_ptr,  # (N,) or unused
    y_ptr,  # (M, N) contiguous
    M,
    N,
    K,
    GROUP_SIZE: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_ptr + rm[:, None] * x_sm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]  # (BLOCK_K, BLOCK_N): the transposed weight tile
        if INT4:
            word = tl.load(qw_ptr + rn[None, :] * qw_sn + (rk // 8)[:, None], mask=w_mask, other=0)
            q = ((word >> ((rk % 8) * 4)[:, None]) & 0xF) - 8  # & drops the arithmetic shift's sign bits
        else:
            q = tl.load(qw_ptr + rn[None, :] * qw_sn + rk[:, None], mask=w_mask, other=0).to(tl.int32)
        group = (rk // GROUP_SIZE)[:, None]
        w = q.to(tl.float32)
        if HAS_ZP:
            w -= tl.load(zp_ptr + rn[None, :] * zp_sn + group * zp_sg, mask=w_mask, other=0).to(tl.float32)
        # masked columns get scale 0, so their weight is 0 whatever q was
        w *= tl.load(s_ptr + rn[None, :] * s_sn + group * s_sg, mask=w_mask, other=0.0).to(tl.float32)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def _block_m(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64  # tl.dot needs every block dim >= 16


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only quantized ``x @ W.T + bias``, ``W = (q - zero_point) * scale`` dequantized per tile.

    Args:
        x: (..., in_features) fp32/fp16/bf16.
        qweight: int8 (out, in_features), or int32 (out, ceil(in_features / 8)) packed int4
            (element ``j`` in bits ``4j..4j+3``, stored as q + 8).
        scale: (out, n_groups) in x's dtype or fp32, n_groups = ceil(in_features / group_size)
            (1 when ``group_size`` is None).
        zero_point: None (symmetric) or (out, n_groups) signed integer zero points, unpacked.
        group_size: input columns per scale group; None = one group per output channel.
        bias: (out,) or None.
    Returns:
        (..., out) in x's dtype. The weight is rounded to x's dtype after dequantization (as
        :func:`baige.kernels.reference.quantized_linear` does); products accumulate in fp32 (IEEE
        fp32 for fp32 inputs, no TF32).
    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    K = x.shape[-1]
    N = qweight.shape[0]
    int4 = qweight.dtype == torch.int32
    if qweight.dtype not in (torch.int8, torch.int32):
        raise ValueError(f"quantized_linear: qweight dtype {qweight.dtype} is neither int8 nor int32 (packed int4)")
    want_cols = math.ceil(K / 8) if int4 else K
    if qweight.dim() != 2 or qweight.shape[1] != want_cols:
        raise ValueError(f"quantized_linear: qweight {tuple(qweight.shape)} does not fit in_features {K}")
    n_groups = 1 if group_size is None else math.ceil(K / group_size)
    if scale.shape != (N, n_groups):
        raise ValueError(f"quantized_linear: scale {tuple(scale.shape)} != ({N}, {n_groups})")
    if zero_point is not None and zero_point.shape != (N, n_groups):
        raise ValueError(f"quantized_linear: zero_point {tuple(zero_point.shape)} != ({N}, {n_groups})")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"quantized_linear: bias {tuple(bias.shape)} != ({N},)")

    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qw = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    M = x2.shape[0]
    y = new_empty((M, N), x.dtype, x.device)
    zp = zero_point if zero_point is not None else scale  # placeholder pointer, never read
    block_m, block_n, block_k = _block_m(M), 64, 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _quant_matmul_kernel[grid](
        x2,
        x2.stride(0),
        qw,
        qw.stride(0),
        scale,
        scale.stride(0),
        scale.stride(1),
        zp,
        zp.stride(0),
        zp.stride(1),
        bias if bias is not None else scale,  # placeholder pointer when there is no bias
        y,
        M,
        N,
        K,
        GROUP_SIZE=group_size or K,
        INT4=int4,
        HAS_ZP=zero_point is not None,
        HAS_BIAS=bias is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return y.view(*x.shape[:-1], N)
