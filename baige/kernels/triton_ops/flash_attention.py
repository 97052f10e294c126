"""Causal flash attention over packed variable-length sequences, forward and backward, in Triton.

The algorithm is FlashAttention-2 (Dao 2023, arXiv:2307.08691): queries are tiled, keys streamed
through an online softmax with fp32 statistics, and the backward recomputes the probabilities from
the saved log-sum-exp instead of storing them. Exponentials are taken base 2 (``exp2``) with the
scale folded into ``scale * log2(e)``; the saved log-sum-exp is in those base-2 units.

Layout: ``q`` (Nq, H, D), ``k``/``v`` (Nk, Hkv, D) packed by ``cu_seqlens`` (``flash_attn_varlen_func``'s
convention); the causal mask is aligned to the bottom right (query j of a sequence with Lq queries and
Lk keys sees keys 0..Lk - Lq + j). Grouped-query heads: query head h reads KV head h // (H / Hkv); the
dK/dV program of a KV head loops over its query heads, so no atomics are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from baige.kernels.triton_ops.common import block_for, new_empty

LOG2E = 1.4426950408889634


@triton.jit
def _seq_bounds(CU_Q, CU_K, seq):
    """First query row, query count, first key row and key count of packed sequence ``seq``."""
    q_start = tl.load(CU_Q + seq)
    k_start = tl.load(CU_K + seq)
    return q_start, tl.load(CU_Q + seq + 1) - q_start, k_start, tl.load(CU_K + seq + 1) - k_start


@triton.jit
def _fwd_tile(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    sk_t,
    sv_t,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    d_mask,
    len_k,
    diag,
    qk_scale,
    MASKED: tl.constexpr,
):
    """One key tile of the online softmax; ``MASKED`` applies the causal and sequence-length masks."""
    cols = start_n + offs_n
    if MASKED:
        n_mask = cols < len_k
        kt = tl.load(k_base + cols[None, :] * sk_t + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        kt = tl.load(k_base + cols[None, :] * sk_t + offs_d[:, None], mask=d_mask[:, None], other=0.0)  # (D, N)
        v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    qk = tl.dot(q, kt, input_precision="ieee") * qk_scale
    if MASKED:
        qk = tl.where((cols[None, :] <= diag + offs_m[:, None]) & n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: key 0 is visible to every row
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_Q,
    CU_K,
    qk_scale,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    so_t,
    so_h,
    slse_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q, k_start, len_k = _seq_bounds(CU_Q, CU_K, seq)
    if pid_m * BLOCK_M >= len_q:
        return
    diag = len_k - len_q  # query m sees keys 0..diag + m
    kvh = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < len_q
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * sq_t + head * sq_h + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + k_start * sk_t + kvh * sk_h
    v_base = V + k_start * sv_t + kvh * sv_h
    # keys below n_full are visible to every row of this tile: no causal or length mask there
    n_full = tl.minimum(diag + pid_m * BLOCK_M + 1, len_k) // BLOCK_N * BLOCK_N
    hi = tl.minimum(len_k, diag + (pid_m + 1) * BLOCK_M)  # keys past hi are masked for every row here
    for start_n in range(0, n_full, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            sk_t,
            sv_t,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            len_k,
            diag,
            qk_scale,
            MASKED=False,
        )
    for start_n in range(n_full, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            sk_t,
            sv_t,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            len_k,
            diag,
            qk_scale,
            MASKED=True,
        )
    acc = acc / l_i[:, None]
    tl.store(
        O + (q_start + offs_m)[:, None] * so_t + head * so_h + offs_d[None, :],
        acc.to(O.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    tl.store(LSE + head * slse_h + q_start + offs_m, m_i + tl.log2(l_i), mask=m_mask)


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
    q_start, len_q, k_start, len_k = _seq_bounds(CU_Q, CU_K, seq)
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
    # from m_full on, every query sees every key of this tile: no causal mask (rows past len_q load
    # zeros for q and dO and add nothing; keys past len_k are never stored)
    m_full = tl.maximum(lo, tl.cdiv(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
    for g in range(GROUP):
        head = kvh * GROUP + g
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
    q_start, len_q, k_start, len_k = _seq_bounds(CU_Q, CU_K, seq)
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


def _blocks(head_dim: int, device: torch.device, backward: bool) -> tuple[int, int, dict]:
    """(BLOCK_M, BLOCK_N, launch options). GPU sizes follow the Triton fused-attention tutorial's
    Hopper choices; the interpreter gets small tiles (its cost grows with tile area times programs)."""
    if device.type != "cuda":
        return 16, 16, {}
    if backward or head_dim > 128:
        return 64, 64, {"num_warps": 8 if head_dim > 64 else 4, "num_stages": 2}
    return 128, 64, {"num_warps": 8 if head_dim > 64 else 4, "num_stages": 3}


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(q, k, v, cu_q, cu_k):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"flash attention expects q (Nq, H, D) and k, v (Nk, Hkv, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]} with equal head_dim")
    if cu_q.shape != cu_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")


class _FlashAttnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        _check(q, k, v, cu_q, cu_k)
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # read with unit stride
        n_q, n_heads, head_dim = q.shape
        group = n_heads // k.shape[1]
        n_seq = cu_q.shape[0] - 1
        o = new_empty(q.shape, q.dtype, q.device)
        lse = new_empty((n_heads, n_q), torch.float32, q.device)  # base-2 log-sum-exp of scaled scores
        bm, bn, opts = _blocks(head_dim, q.device, backward=False)
        if n_q and n_seq:
            _fwd_kernel[(triton.cdiv(max_q, bm), n_seq, n_heads)](
                q,
                k,
                v,
                o,
                lse,
                cu_q,
                cu_k,
                scale * LOG2E,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                o.stride(0),
                o.stride(1),
                lse.stride(0),
                GROUP=group,
                HEAD_DIM=head_dim,
                BLOCK_D=block_for(head_dim),
                BLOCK_M=bm,
                BLOCK_N=bn,
                **opts,
            )
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        do = do.contiguous()
        n_q, n_heads, head_dim = q.shape
        n_kv = k.shape[1]
        group = n_heads // n_kv
        n_seq = cu_q.shape[0] - 1
        delta = (do.float() * o.float()).sum(-1).t().contiguous()  # (H, Nq): rowsum(dO * O)
        # zeros, not empty: rows outside every sequence (padding after the last cu_seqlens entry) get no
        # gradient from the kernels and must read 0, as through the reference
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        bm, bn, opts = _blocks(head_dim, q.device, backward=True)
        qk_scale = ctx.scale * LOG2E
        common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_for(head_dim), BLOCK_M=bm, BLOCK_N=bn, **opts)
        if n_seq and k.shape[0]:
            _bwd_dkdv_kernel[(triton.cdiv(ctx.max_k, bn), n_seq, n_kv)](
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
                ctx.scale,
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
            _bwd_dq_kernel[(triton.cdiv(ctx.max_q, bm), n_seq, n_heads)](
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
                ctx.scale,
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
        return dq, dk, dv, None, None, None, None, None


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.flash_attention_varlen` (see there for shapes)."""
    return _FlashAttnVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.attention`: (B, T, H, D) queries over (B, S, Hkv, D) keys,
    run as B packed sequences of T queries and ``q_offset + T`` keys (later keys are masked anyway)."""
    B, T, H, D = q.shape
    S = q_offset + T
    if B == 0 or T == 0:
        return q.new_zeros(q.shape)
    if k.shape[1] < S:
        raise ValueError(f"attention: {k.shape[1]} keys cannot hold q_offset {q_offset} + {T} queries")
    k, v = k[:, :S], v[:, :S]
    cu_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
    out = flash_attention_varlen(
        q.reshape(B * T, H, D), k.reshape(B * S, *k.shape[2:]), v.reshape(B * S, *v.shape[2:]), cu_q, cu_k, T, S, scale
    )
    return out.view(B, T, H, D)
