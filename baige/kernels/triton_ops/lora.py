"""Batched multi-adapter LoRA in Triton: shrink ``v = (x @ A_i^T) * s_i`` and expand ``y += v @ B_i^T``,
the adapter ``i`` gathered per token from the stacks (see :mod:`baige.kernels.lora`).

Each program owns BLOCK_M tokens (and, in the expand, BLOCK_N output columns). It walks the distinct
adapter ids among its tokens, smallest first: per id, the tokens of that id are selected by a row
mask and one tiled ``tl.dot`` pass runs with that adapter's weights (SGMV for a block inside one
prefill segment: one pass; BGMV-like for decode batches mixing adapters: one pass per id present).
Tokens with id -1 are never selected. ``v`` is kept in fp32 between the kernels; products use IEEE
fp32 for fp32 inputs (no TF32). Forward only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import block_for

_NO_ID = 2**30  # larger than any adapter slot: a row that is done (or has no adapter)


@triton.jit
def _next_id(pending):
    return tl.min(pending, axis=0)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    x_sm,  # (T, IN), unit column stride
    a_ptr,
    a_sl,
    a_sr,  # (L, R, IN), unit column stride
    s_ptr,  # (L,) fp32
    ids_ptr,  # (T,)
    v_ptr,  # (T, R) fp32 contiguous
    T,
    R,
    IN,
    NO_ID: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    m_mask = rm < T
    ids = tl.load(ids_ptr + rm, mask=m_mask, other=-1).to(tl.int32)
    pending = tl.where(ids >= 0, ids, NO_ID)
    out = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    cur = _next_id(pending)
    while cur < NO_ID:
        sel = pending == cur
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < IN
            x = tl.load(x_ptr + rm[:, None] * x_sm + rk[None, :], mask=sel[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(
                a_ptr + cur.to(tl.int64) * a_sl + rr[None, :] * a_sr + rk[:, None],
                mask=(rr[None, :] < R) & k_mask[:, None],
                other=0.0,
            )  # (BLOCK_K, BLOCK_R): A_i^T
            acc = tl.dot(x, a, acc, input_precision=INPUT_PRECISION)
        out = tl.where(sel[:, None], acc * tl.load(s_ptr + cur), out)
        pending = tl.where(sel, NO_ID, pending)
        cur = _next_id(pending)
    tl.store(v_ptr + rm[:, None] * R + rr[None, :], out, mask=m_mask[:, None] & (rr[None, :] < R))


@triton.jit
def _lora_expand_kernel(
    v_ptr,  # (T, R) fp32 contiguous
    b_ptr,
    b_sl,
    b_sn,  # (L, OUT, R), unit column stride
    ids_ptr,  # (T,)
    y_ptr,
    y_sm,  # (T, OUT), unit column stride; updated in place
    T,
    R,
    OUT,
    NO_ID: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    m_mask = rm < T
    n_mask = rn < OUT
    ids = tl.load(ids_ptr + rm, mask=m_mask, other=-1).to(tl.int32)
    pending = tl.where(ids >= 0, ids, NO_ID)
    v = tl.load(v_ptr + rm[:, None] * R + rr[None, :], mask=m_mask[:, None] & (rr[None, :] < R), other=0.0)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    cur = _next_id(pending)
    while cur < NO_ID:
        sel = pending == cur
        b = tl.load(
            b_ptr + cur.to(tl.int64) * b_sl + rn[None, :] * b_sn + rr[:, None],
            mask=n_mask[None, :] & (rr[:, None] < R),
            other=0.0,
        )  # (BLOCK_R, BLOCK_N): B_i^T
        part = tl.dot(tl.where(sel[:, None], v, 0.0), b.to(tl.float32), input_precision=INPUT_PRECISION)
        delta = tl.where(sel[:, None], part, delta)
        pending = tl.where(sel, NO_ID, pending)
        cur = _next_id(pending)
    has = (ids >= 0)[:, None] & m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rm[:, None] * y_sm + rn[None, :]
    y = tl.load(y_ptrs, mask=has, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=has)


def _block_m(T: int) -> int:
    return 16 if T <= 16 else 32 if T <= 32 else 64  # tl.dot needs every block dim >= 16


def lora_apply(y, x, lora_a_stack, lora_b_stack, scalings, token_lora_ids):
    """See :func:`baige.kernels.lora.lora_apply` (shapes and dtypes checked there)."""
    T, n_in = x.shape
    L, R, _ = lora_a_stack.shape
    n_out = y.shape[1]
    if T == 0:
        return y
    if y.stride(-1) != 1:
        raise ValueError("lora_apply: y needs a unit column stride (it is updated in place)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = lora_a_stack if lora_a_stack.stride(-1) == 1 else lora_a_stack.contiguous()
    b = lora_b_stack if lora_b_stack.stride(-1) == 1 else lora_b_stack.contiguous()
    s = scalings.to(device=x.device, dtype=torch.float32).contiguous()
    ids = token_lora_ids.contiguous()
    v = torch.empty((T, R), dtype=torch.float32, device=x.device)
    block_m, block_r = _block_m(T), block_for(R)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _lora_shrink_kernel[(triton.cdiv(T, block_m),)](
        x,
        x.stride(0),
        a,
        a.stride(0),
        a.stride(1),
        s,
        ids,
        v,
        T,
        R,
        n_in,
        NO_ID=_NO_ID,
        INPUT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=64,
        num_warps=4,
    )
    block_n = 64
    _lora_expand_kernel[(triton.cdiv(T, block_m), triton.cdiv(n_out, block_n))](
        v,
        b,
        b.stride(0),
        b.stride(1),
        ids,
        y,
        y.stride(0),
        T,
        R,
        n_out,
        NO_ID=_NO_ID,
        INPUT_PRECISION="ieee",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=4,
    )
    return y
