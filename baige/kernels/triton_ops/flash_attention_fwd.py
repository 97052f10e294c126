"""The forward of causal varlen flash attention in Triton (FlashAttention-2, Dao 2023, arXiv:2307.08691):
each program takes a tile of one sequence's queries for one head and streams that sequence's keys
through an online softmax with fp32 statistics, base-2 exponentials (``exp2`` with the scale folded
into ``scale * log2(e)``). Layout and masking: see :mod:`.flash_attention`. A sliding window, attention
sinks and a logit soft-cap (:mod:`.attention_variants`) are compile-time options: with a window a query
tile reads only the key tiles that overlap its rows' windows.

Also holds what the backward (:mod:`.flash_attention_bwd`) shares with it: the packed sequence's
bounds, the tile sizes and the base-2 scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.attention_variants import (
    LOG2E,
    online_max,
    softcap,
    softmax_start,
    variant_args,
    window_first_tile,
)
from baige.kernels.triton_ops.common import block_for, new_empty


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
def key_ranges(row0, len_k, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The key tiles a tile of ``BLOCK_M`` queries from position ``row0`` reads, as ``(lo, n_win, n_full,
    hi)``: ``[n_win, n_full)`` are seen whole by every row (no mask); ``[lo, n_win)`` start before the
    window of the tile's last row and ``[n_full, hi)`` straddle the causal diagonal or the end of the keys
    (both masked); tiles before ``lo`` (wholly before the first row's window) and from ``hi`` on (after
    the last row) are never read. Without a window ``lo = n_win = 0``. All but ``hi`` are multiples of
    ``BLOCK_N``, ``lo <= n_win <= n_full``."""
    n_full = tl.minimum(row0 + 1, len_k) // BLOCK_N * BLOCK_N  # keys below: visible to every row, causally
    hi = tl.minimum(len_k, row0 + BLOCK_M)  # keys from hi on: masked for every row
    lo = 0
    n_win = 0
    if HAS_WINDOW:
        lo = window_first_tile(row0, window, BLOCK_N)
        # the tile's last row sees keys > row0 + BLOCK_M - 1 - window: tiles from there on are inside every window
        n_win = tl.cdiv(tl.maximum(row0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
        n_win = tl.minimum(tl.maximum(n_win, lo), n_full)
    return lo, n_win, n_full, hi


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
    window,
    cap,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One key tile of the online softmax; ``MASKED`` applies the causal, window and sequence-length masks
    (an unmasked tile is wholly inside every row's window)."""
    cols = start_n + offs_n
    if MASKED:
        n_mask = cols < len_k
        kt = tl.load(k_base + cols[None, :] * sk_t + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        kt = tl.load(k_base + cols[None, :] * sk_t + offs_d[:, None], mask=d_mask[:, None], other=0.0)  # (D, N)
        v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    qk = tl.dot(q, kt, input_precision="ieee") * qk_scale
    if HAS_SOFTCAP:
        qk = softcap(qk, cap)
    if MASKED:
        visible = (cols[None, :] <= diag + offs_m[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (cols[None, :] > diag + offs_m[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new, m_sub = online_max(m_i, qk, HAS_WINDOW)  # without a window: key 0 is visible to every row
    p = tl.exp2(qk - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
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
    SINKS,
    qk_scale,
    window,
    cap,
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
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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

    m_i, l_i = softmax_start(SINKS, head, head >= 0, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + k_start * sk_t + kvh * sk_h
    v_base = V + k_start * sv_t + kvh * sv_h
    lo, n_win, n_full, hi = key_ranges(diag + pid_m * BLOCK_M, len_k, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for start_n in range(n_win, n_full, BLOCK_N):
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
            window,
            cap,
            MASKED=False,
            HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP,
        )
    # the masked tiles: [lo, n_win) before the last row's window start, then [n_full, hi) on the diagonal
    for i in range(lo, n_win + hi - n_full, BLOCK_N):
        start_n = tl.where(i < n_win, i, i - n_win + n_full)
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
            window,
            cap,
            MASKED=True,
            HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP,
        )
    acc = acc / l_i[:, None]
    tl.store(
        O + (q_start + offs_m)[:, None] * so_t + head * so_h + offs_d[None, :],
        acc.to(O.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    tl.store(LSE + head * slse_h + q_start + offs_m, m_i + tl.log2(l_i), mask=m_mask)


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    scale: float,
    variants: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        q: (Nq, H, D), last dim contiguous; k, v: (Nk, Hkv, D), likewise, ``H % Hkv == 0``.
        cu_q, cu_k: (P + 1,) contiguous int32/int64 cumulative lengths starting at 0.
        max_q: the longest query sequence (host int).
        scale: softmax scale.
        variants: ``window``, ``sinks`` ((H,)) and ``softcap`` as :func:`baige.kernels.attention` takes
            them (query ``m`` of a sequence sits at position ``Lk - Lq + m``), or None for none.
    Returns:
        ``(o, lse)``: o (Nq, H, D) in q's dtype; lse (H, Nq) fp32, the base-2 log-sum-exp of the scaled
        (soft-capped) scores, the sink's ``sink * log2(e)`` included. Rows outside every sequence are left
        unwritten in both.
    Raises:
        ValueError: a bad window, sinks or softcap (:func:`.attention_variants.variant_args`).
    """
    n_q, n_heads, head_dim = q.shape
    n_seq = cu_q.shape[0] - 1
    var = variant_args(**(variants or {"window": None, "sinks": None, "softcap": None}), n_heads=n_heads, like=q)
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
            var["SINKS"],
            scale * LOG2E,
            var["window"],
            var["cap"],
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
            HAS_SINKS=var["HAS_SINKS"],
            HAS_WINDOW=var["HAS_WINDOW"],
            HAS_SOFTCAP=var["HAS_SOFTCAP"],
            **opts,
        )
    return o, lse
