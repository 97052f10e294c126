"""The backward of causal varlen flash attention in Triton (FlashAttention-2, Dao 2023, arXiv:2307.08691):
the probabilities are recomputed from the forward's saved base-2 log-sum-exp instead of stored. One
kernel gives dK and dV per key tile (:mod:`.flash_attention_bwd_dkdv`: the program of a KV head loops over
its query heads, so no atomics are needed), another dQ per query tile (here). Layout and masking: see
:mod:`.flash_attention`. With a sliding window each program reads only the tiles that overlap its
windows; a soft-cap's derivative scales the score gradients; the sinks' gradient is :func:`sink_grad`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.attention_variants import LOG2E, softcap, variant_args
from baige.kernels.triton_ops.common import block_for
from baige.kernels.triton_ops.flash_attention_bwd_dkdv import _bwd_dkdv_kernel
from baige.kernels.triton_ops.flash_attention_fwd import key_ranges, seq_bounds, tile_sizes


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
    window,
    cap,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
    if HAS_SOFTCAP:
        qk = softcap(qk, cap)
    p = tl.exp2(qk - lse[:, None])
    if MASKED:
        visible = (cols[None, :] <= diag + offs_m[:, None]) & n_mask[None, :] & m_mask[:, None]
        if HAS_WINDOW:
            visible = visible & (cols[None, :] > diag + offs_m[:, None] - window)
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2(x / c), and qk / cap is that tanh
        t = qk / cap
        ds = ds * (1.0 - t * t)
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
    sdq_t,
    sdq_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
    # the forward's key tiles (rows past len_q add nothing: q = dO = 0)
    lo, n_win, n_full, hi = key_ranges(diag + pid_m * BLOCK_M, len_k, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for start_n in range(n_win, n_full, BLOCK_N):
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
            window,
            cap,
            MASKED=False,
            HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP,
        )
    for i in range(lo, n_win + hi - n_full, BLOCK_N):
        start_n = tl.where(i < n_win, i, i - n_win + n_full)
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
            window,
            cap,
            MASKED=True,
            HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP,
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
    variants: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the two backward kernels.

    Args:
        do: (Nq, H, D) contiguous upstream gradient; q, k, v, o, lse, cu_q, cu_k: the forward's inputs
            and outputs (see :func:`.flash_attention_fwd.flash_attention_forward`).
        max_q, max_k: the longest query and key sequences (host ints).
        scale: softmax scale.
        variants: the forward's ``window``, ``sinks``, ``softcap`` (or None).
    Returns:
        ``(dq, dk, dv, dsinks)``: dq, dk, dv with the shapes and dtypes of q, k and v; dsinks (H,) fp32
        (:func:`sink_grad`), or None without sinks.
    """
    n_q, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    n_seq = cu_q.shape[0] - 1
    variants = variants or {"window": None, "sinks": None, "softcap": None}
    var = variant_args(**variants, n_heads=n_heads, like=q)
    delta = (do.float() * o.float()).sum(-1).t().contiguous()  # (H, Nq): rowsum(dO * O)
    # zeros, not empty: rows outside every sequence (padding after the last cu_seqlens entry) get no
    # gradient from the kernels and must read 0, as through the reference
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bm, bn, opts = tile_sizes(head_dim, q.device, backward=True)
    qk_scale = scale * LOG2E
    common = dict(GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_D=block_for(head_dim), BLOCK_M=bm, BLOCK_N=bn)
    common |= dict(HAS_WINDOW=var["HAS_WINDOW"], HAS_SOFTCAP=var["HAS_SOFTCAP"], **opts)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    strides += (do.stride(0), do.stride(1), lse.stride(0))
    ins = (q, k, v, do, lse, delta)
    if n_seq and k.shape[0]:
        _bwd_dkdv_kernel[(triton.cdiv(max_k, bn), n_seq, n_kv)](
            *ins, dk, dv, cu_q, cu_k, qk_scale, scale, var["window"], var["cap"], *strides, *dk.stride()[:2],
            *dv.stride()[:2], **common,
        )  # fmt: skip
    if n_seq and n_q:
        _bwd_dq_kernel[(triton.cdiv(max_q, bm), n_seq, n_heads)](
            *ins, dq, cu_q, cu_k, qk_scale, scale, var["window"], var["cap"], *strides, *dq.stride()[:2], **common
        )
    dsinks = None if variants["sinks"] is None else sink_grad(var["SINKS"], lse, delta, cu_q)
    return dq, dk, dv, dsinks


def sink_grad(sinks2: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, cu_q: torch.Tensor) -> torch.Tensor:
    """The gradient of the loss with respect to each query head's sink logit.

    A row's output is ``O = sum_j P_j V_j`` with ``P = softmax([s_1 .. s_n, sink])`` and no value for the
    sink. The softmax Jacobian gives ``dL/dx_i = P_i (dP_i - sum_j P_j dP_j)`` for every logit x_i, where
    ``dP_j = dO . V_j`` and ``dP_sink = 0``; so ``sum_j P_j dP_j = dO . O`` (the backward's ``delta``), the
    keys' score gradients are FlashAttention's ``P (dP - delta)`` unchanged (with the sink inside the
    log-sum-exp), and ``dL/dsink = -P_sink * delta`` per row, summed over the rows of the head:
    ``dsink_h = -sum_rows P_sink (dO . O)``. Derived here from the softmax Jacobian (gpt-oss's own Triton
    attention, ``gpt_oss/triton/attention.py``, has a forward only); the tests check it against autograd
    through the reference (:func:`baige.kernels.reference.attention`).

    Args:
        sinks2: (H,) fp32 sink logits times log2(e); lse: (H, Nq) fp32 base-2 log-sum-exp (sink included);
        delta: (H, Nq) fp32 ``dO . O``; cu_q: (P + 1,) cumulative query counts (rows from ``cu_q[-1]`` on
            belong to no sequence and count nothing; read on the device, no sync).
    Returns:
        (H,) fp32.
    """
    rows = torch.arange(lse.shape[1], device=lse.device) < cu_q[-1]
    p_sink = torch.exp2(sinks2[:, None] - lse)  # (H, Nq)
    return -torch.where(rows, p_sink * delta, 0.0).sum(1)
