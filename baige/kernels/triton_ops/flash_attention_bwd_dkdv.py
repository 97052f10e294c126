"""The dK/dV kernel of the causal varlen flash attention backward in Triton (FlashAttention-2, Dao 2023,
arXiv:2307.08691; launched by :func:`.flash_attention_bwd.flash_attention_backward`): one program per key
tile of one KV head of one sequence loops over the query heads that share it and over the query tiles
that see the key tile (no atomics), recomputing the probabilities from the forward's base-2 log-sum-exp.
With a sliding window only the query tiles whose windows overlap the key tile are read; a soft-cap's
derivative ``1 - tanh^2`` scales the score gradients (:mod:`.attention_variants`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from baige.kernels.triton_ops.attention_variants import softcap
from baige.kernels.triton_ops.flash_attention_fwd import seq_bounds


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
    window,
    cap,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
    if HAS_SOFTCAP:
        qk = softcap(qk, cap)
    p = tl.exp2(qk - lse[:, None])
    if MASKED:
        visible = (offs_n[None, :] <= diag + rows[:, None]) & n_mask[None, :] & m_mask[:, None]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > diag + rows[:, None] - window)
        p = tl.where(visible, p, 0.0)
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2(x / c), and qk / cap is that tanh
        t = qk / cap
        ds = ds * (1.0 - t * t)
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
    m_win,
    m_hi,
    offs_m,
    offs_n,
    offs_d,
    d_mask,
    n_mask,
    len_q,
    diag,
    qk_scale,
    window,
    cap,
    BLOCK_M: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One query head's contribution to a key tile's dK (unscaled) and dV (the query ranges of
    :func:`query_ranges`): the query tiles of ``[m_full, m_win)`` see every key of the tile, those of
    ``[lo, m_full)`` and ``[m_win, m_hi)`` are masked (rows past ``len_q`` load zeros for q and dO and add
    nothing)."""
    for start_m in range(m_full, m_win, BLOCK_M):
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
            window,
            cap,
            MASKED=False,
            HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP,
        )
    for i in range(lo, m_full + m_hi - m_win, BLOCK_M):
        start_m = tl.where(i < m_full, i, i - m_full + m_win)
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
            window,
            cap,
            MASKED=True,
            HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP,
        )
    return dk, dv


@triton.jit
def query_ranges(n0, len_q, diag, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The query tiles that see keys ``n0 .. n0 + BLOCK_N - 1`` (query m sits at ``diag + m``), as
    ``(lo, m_full, m_win, m_hi)``: those of ``[m_full, m_win)`` see every key of the tile (no mask);
    ``[lo, m_full)`` straddle the causal diagonal and ``[m_win, m_hi)`` the window's start (both masked);
    the others see none of it and are never read. Without a window ``m_win = m_hi = len_q``.
    ``lo <= m_full <= m_win <= m_hi``."""
    # the first query that sees key n0, rounded down to a tile boundary
    lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
    # from m_full on, every query sees every key of this tile causally (keys past len_k are never stored)
    m_full = tl.maximum(lo, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
    m_win = tl.maximum(len_q, m_full)
    m_hi = m_win
    if HAS_WINDOW:
        # rows below n0 - diag + window have the whole tile inside their window; rows from
        # n0 + BLOCK_N - 1 - diag + window on see none of it
        m_win = tl.minimum(tl.maximum(tl.maximum(n0 - diag + window, 0) // BLOCK_M * BLOCK_M, m_full), len_q)
        m_win = tl.maximum(m_win, m_full)
        m_hi = tl.maximum(tl.minimum(len_q, n0 + BLOCK_N - 1 - diag + window), m_win)
    return lo, m_full, m_win, m_hi


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
    window,
    cap,
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
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
    lo, m_full, m_win, m_hi = query_ranges(pid_n * BLOCK_N, len_q, diag, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
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
            m_win,
            m_hi,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            n_mask,
            len_q,
            diag,
            qk_scale,
            window,
            cap,
            BLOCK_M,
            HAS_WINDOW,
            HAS_SOFTCAP,
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
