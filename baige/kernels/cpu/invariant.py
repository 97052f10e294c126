"""The batch-invariant kernels of ``invariant.c`` (see its header for the fixed reduction orders), called by
:mod:`baige.kernels.invariant` on values that need no gradient: fp32 activations, fp32 or bf16 weights,
fp32 / fp16 / bf16 KV caches, on ``torch.get_num_threads()`` threads (results independent of the count).
Call them only where :func:`available` is true."""

from __future__ import annotations

import torch

from baige.kernels.cpu.build import library, native_allowed
from baige.kernels.cpu.ops import kv_dtype_code


def available() -> bool:
    """Whether the native kernels run here: ``BAIGE_KERNELS`` auto (not inside a ``torch.compile`` trace) and
    the library built for the instruction-set variant in force."""
    return native_allowed() and library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) fp32 @ (N, K) fp32 or bf16 weight ^T (+ (N,) fp32 bias) -> (M, N) fp32, contiguous. Under AVX-512
    BF16 a bf16 weight takes x rounded to bf16: pass bf16 values (a bf16 model's activations, widened)."""
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    library().baige_bi_linear(
        x.data_ptr(),
        M,
        K,
        weight.data_ptr(),
        int(weight.dtype == torch.bfloat16),
        N,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    table_of_row: torch.Tensor | None,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q (S, hq, d) fp32; caches (hk, num_blocks, bs, d) fp32/fp16/bf16 of one dtype, contiguous; tables
    (P, W) int64; table_of_row (S,) int64 or None (row s reads table row s); lens (S,) int64, each >= 1 and
    within its table -> (S, hq, d) fp32. Raises MemoryError when the kernel's scratch cannot be allocated."""
    q = q.contiguous()
    tables, lens = tables.contiguous(), lens.contiguous()
    table_of_row = None if table_of_row is None else table_of_row.contiguous()
    S, hq, d = q.shape
    hk, num_blocks, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    rc = library().baige_bi_attention(
        q.data_ptr(),
        S,
        hq,
        hk,
        d,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        kv_dtype_code(k_cache.dtype),
        num_blocks,
        bs,
        tables.data_ptr(),
        tables.shape[1],
        None if table_of_row is None else table_of_row.data_ptr(),
        lens.data_ptr(),
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise MemoryError("baige_bi_attention: no memory for its score buffers")
    return out


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """(R, n) fp32 -> (R,) fp32, each row's sum of squares."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32)
    library().baige_bi_sumsq(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def silu(g: torch.Tensor) -> torch.Tensor:
    """``g / (1 + exp(-g))`` of an fp32 tensor, any shape -> the same shape, contiguous."""
    g = g.contiguous()
    out = torch.empty_like(g)
    library().baige_bi_silu(g.data_ptr(), g.numel(), out.data_ptr(), torch.get_num_threads())
    return out
