"""The backward of causal varlen flash attention in Triton (FlashAttention-2, Dao 2023, arXiv:2307.08691):
the probabilities are recomputed from the forward's saved base-2 log-sum-exp instead of stored. One
kernel gives dK and dV per key tile (the program of a KV head loops over its query heads, so no atomics
are needed), another dQ per query tile. Layout and masking: see :mod:`.flash_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import block_for
from baige.kernels.triton_ops.flash_attention_fwd import LOG2E, seq_bounds, tile_sizes


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    q_start,
    head,
    sq_t,
    sq_h,
    sdo_t,
    sdo_h,
    slse_h,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    d_mask,
    n_mask,
    len_q,
    diag,
    qk_scale,
    MASKED: tl.constexpr,
):
    """One query tile's contribution to a key tile's dK (unscaled) and dV."""
    rows = start_m + offs_m
    m_mask = rows < len_q
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + (q_start + rows)[:, None] * sq_t + head * sq_h + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + (q_start + rows)[:, None] * sdo_t + head * sdo_h + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + head * slse_h + q_start + rows, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + head * slse_h + q_start + rows, mask=m_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (M, N)
    p = tl.exp2(qk - lse[:, None])
    if MASKED:
        visible = (offs_n[None, :] <= diag + rows[:, None]) & n_mask[None, :] & m_mask[:, None]
        p = tl.where(visible, p, 0.0)
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    return dk, dv


@triton.jit
def _dkdv_head(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    q_start,
    head,
    sq_t,
    sq_h,
    sdo_t,
    sdo_h,
    slse_h,
    lo,
    m_full,
    offs_m,
    offs_n,
    offs_d,
    d_mask,
    n_mask,
    len_q,
    diag,
    qk_scale,
    BLOCK_M: tl.constexpr,
):
    """One query head's contribution to a key tile's dK (unscaled) and dV: the query tiles from ``lo``
    to ``m_full`` straddle the causal diagonal (masked), those from ``m_full`` to ``len_q`` see every
    key of the tile (rows past ``len_q`` load zeros for q and dO and add nothing)."""
    for start_m in range(lo, m_full, BLOCK_M):
        dk, dv = _dkdv_tile(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            q_start,
            head,
            sq_t,
            sq_h,
            sdo_t,
            sdo_h,
            slse_h,
            start_m,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            n_mask,
            len_q,
            diag,
            qk_scale,
            MASKED=True,
        )
    for start_m in range(m_full, len_q, BLOCK_M):
        dk, dv = _dkdv_tile(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            q_start,
            head,
            sq_t,
            sq_h,
            sdo_t,
            sdo_h,
            slse_h,
            start_m,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            n_mask,
            len_q,
            diag,
            qk_scale,
            MASKED=False,
        )
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU_Q,
    CU_K,
    qk_scale,
    sm_scale,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sdo_t,
    sdo_h,
    slse_h,
    sdk_t,
    sdk_h,
    sdv_t,
    sdv_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n, seq, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q, k_start, len_k = seq_bounds(CU_Q, CU_K, seq)
    if pid_n * BLOCK_N >= len_k:
        return
    diag = len_k - len_q

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < len_k
    d_mask = offs_d < HEAD_DIM
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + (k_start + offs_n)[:, None] * sk_t + kvh * sk_h + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start + offs_n)[:, None] * sv_t + kvh * sv_h + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # the first query that sees key pid_n * BLOCK_N, rounded down to a tile boundary
    lo = tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
    # from m_full on, every query sees every key of this tile: no causal mask (keys past len_k are never stored)
    m_full = tl.maximum(lo, tl.cdiv(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
    for g in range(GROUP):
        dk, dv = _dkdv_head(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            q_start,
            kvh * GROUP + g,
            sq_t,
            sq_h,
            sdo_t,
            sdo_h,
            slse_h,
            lo,
            m_full,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            n_mask,
            len_q,
            diag,
            qk_scale,
            BLOCK_M,
        )
    tl.store(
        DK + (k_start + offs_n)[:, None] * sdk_t + kvh * sdk_h + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + (k_start + offs_n)[:, None] * sdv_t + kvh * sdv_h + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _dq_tile(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    sk_t,
    sv_t,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    d_mask,
    m_mask,
    len_k,
    diag,
    qk_scale,
    MASKED: tl.constexpr,
):
    """One key tile's contribution to a query tile's dQ (unscaled)."""
    cols = start_n + offs_n
    if MASKED:
        n_mask = cols < len_k
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = (cols >= 0)[:, None] & d_mask[None, :]
    k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    p = tl.exp2(qk - lse[:, None])
    if MASKED:
        p = tl.where((cols[None, :] <= diag + offs_m[:, None]) & n_mask[None, :] & m_mask[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU_Q,
    CU_K,
    qk_scale,
    sm_scale,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sdo_t,
    sdo_h,
    slse_h,
    sdq_t,
    sdq_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q, k_start, len_k = seq_bounds(CU_Q, CU_K, seq)
    if pid_m * BLOCK_M >= len_q:
        return
    diag = len_k - len_q
    kvh = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < len_q
    d_mask = offs_d < HEAD_DIM
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + (q_start + offs_m)[:, None] * sq_t + head * sq_h + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + (q_start + offs_m)[:, None] * sdo_t + head * sdo_h + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + head * slse_h + q_start + offs_m, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + head * slse_h + q_start + offs_m, mask=m_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + k_start * sk_t + kvh * sk_h
    v_base = V + k_start * sv_t + kvh * sv_h
    # keys below n_full are visible to every row of this tile (rows past len_q add nothing: q = dO = 0)
    n_full = tl.minimum(diag + pid_m * BLOCK_M + 1, len_k) // BLOCK_N * BLOCK_N
    hi = tl.minimum(len_k, diag + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_tile(
            dq,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            sk_t,
            sv_t,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            m_mask,
            len_k,
            diag,
            qk_scale,
            MASKED=False,
        )
    for start_n in range(n_full, hi, BLOCK_N):
        dq = _dq_tile(
            dq,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            sk_t,
            sv_t,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            m_mask,
            len_k,
            diag,
            qk_scale,
            MASKED=True,
        )
    tl.store(
        DQ + (q_start + offs_m)[:, None] * sdq_t + head * sdq_h + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=qd_mask,
    )


def flash_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the two backward kernels.

    Args:
        do: (Nq, H, D) contiguous upstream gradient; q, k, v, o, lse, cu_q, cu_k: the forward's inputs
            and outputs (see :func:`.flash_attention_fwd.flash_attention_forward`).
        max_q, max_k: the longest query and key sequences (host ints).
        scale: softmax scale.
    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of q, k and v.
    """
    n_q, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    n_seq = cu_q.shape[0] - 1
    delta = (do.float() * o.float()).sum(-1).t().contiguous()  # (H, Nq): rowsum(dO * O)
    # zeros, not empty: rows outside every sequence (padding after the last cu_seqlens entry) get no
    # gradient from the kernels and must read 0, as through the reference
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bm, bn, opts = tile_sizes(head_dim, q.device, backward=True)
    qk_scale = scale * LOG2E
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_for(head_dim), BLOCK_M=bm, BLOCK_N=bn, **opts)
    if n_seq and k.shape[0]:
        _bwd_dkdv_kernel[(triton.cdiv(max_k, bn), n_seq, n_kv)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            cu_q,
            cu_k,
            qk_scale,
            scale,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            do.stride(0),
            do.stride(1),
            lse.stride(0),
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            **common,
        )
    if n_seq and n_q:
        _bwd_dq_kernel[(triton.cdiv(max_q, bm), n_seq, n_heads)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            cu_q,
            cu_k,
            qk_scale,
            scale,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            do.stride(0),
            do.stride(1),
            lse.stride(0),
            dq.stride(0),
            dq.stride(1),
            **common,
        )
    return dq, dk, dv
