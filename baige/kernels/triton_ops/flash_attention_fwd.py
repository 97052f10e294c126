"""The forward of causal varlen flash attention in Triton (FlashAttention-2, Dao 2023, arXiv:2307.08691):
each program takes a tile of one sequence's queries for one head and streams that sequence's keys
through an online softmax with fp32 statistics, base-2 exponentials (``exp2`` with the scale folded
into ``scale * log2(e)``). Layout and masking: see :mod:`.flash_attention`.

Also holds what the backward (:mod:`.flash_attention_bwd`) shares with it: the packed sequence's
bounds, the tile sizes and the base-2 scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import block_for, new_empty

LOG2E = 1.4426950408889634


@triton.jit
def seq_bounds(CU_Q, CU_K, seq):
    """First query row, query count, first key row and key count of packed sequence ``seq``."""
    q_start = tl.load(CU_Q + seq)
    k_start = tl.load(CU_K + seq)
    return q_start, tl.load(CU_Q + seq + 1) - q_start, k_start, tl.load(CU_K + seq + 1) - k_start


def tile_sizes(head_dim: int, device: torch.device, backward: bool) -> tuple[int, int, dict]:
    """(BLOCK_M, BLOCK_N, launch options). GPU sizes follow the Triton fused-attention tutorial's
    Hopper choices; the interpreter gets small tiles (its cost grows with tile area times programs)."""
    if device.type != "cuda":
        return 16, 16, {}
    if backward or head_dim > 128:
        return 64, 64, {"num_warps": 8 if head_dim > 64 else 4, "num_stages": 2}
    return 128, 64, {"num_warps": 8 if head_dim > 64 else 4, "num_stages": 3}


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
    q_start, len_q, k_start, len_k = seq_bounds(CU_Q, CU_K, seq)
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


def flash_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        q: (Nq, H, D), last dim contiguous; k, v: (Nk, Hkv, D), likewise, ``H % Hkv == 0``.
        cu_q, cu_k: (P + 1,) contiguous int32/int64 cumulative lengths starting at 0.
        max_q: the longest query sequence (host int).
        scale: softmax scale.
    Returns:
        ``(o, lse)``: o (Nq, H, D) in q's dtype; lse (H, Nq) fp32, the base-2 log-sum-exp of the scaled
        scores. Rows outside every sequence are left unwritten in both.
    """
    n_q, n_heads, head_dim = q.shape
    n_seq = cu_q.shape[0] - 1
    o = new_empty(q.shape, q.dtype, q.device)
    lse = new_empty((n_heads, n_q), torch.float32, q.device)  # base-2 log-sum-exp of scaled scores
    bm, bn, opts = tile_sizes(head_dim, q.device, backward=False)
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
            GROUP=n_heads // k.shape[1],
            HEAD_DIM=head_dim,
            BLOCK_D=block_for(head_dim),
            BLOCK_M=bm,
            BLOCK_N=bn,
            **opts,
        )
    return o, lse
