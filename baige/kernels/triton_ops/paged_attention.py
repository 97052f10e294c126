"""Paged attention over the engine's block pool (vLLM's PagedAttention layout, Kwon et al. 2023,
arXiv:2309.06180) and ``store_kv``, in Triton.

One kernel serves decode (one query per sequence) and prefill with a cached prefix (a chunk of
queries per sequence, causal, bottom-right aligned). Decode of few sequences over long contexts is
split over the keys (flash-decoding): each program handles one key range and writes unnormalised
partials, and a second kernel combines them (:mod:`.paged_decode_split`). A sliding window, attention
sinks and a logit soft-cap are compile-time options (:mod:`.attention_variants`); with a window a
program reads only the key tiles from the one holding its first query's window start on, so a
sliding layer's decode reads at most ``window + BLOCK_N - 1`` keys whatever the context.

A program owns one KV head of one sequence and a tile of ``BLOCK_T`` query tokens; its rows are those
tokens times the ``GROUP`` query heads that share the KV head (padded to a power of two), so each K/V
tile read from the pool serves the whole group (the grouped-query layout of FlashDecoding-style
kernels). Keys are streamed ``BLOCK_N`` at a time; each key's slot is looked up through the block
table, so ``BLOCK_N`` need not match the cache's block size. Online softmax with fp32 statistics
(FlashAttention-2, arXiv:2307.08691).

Cache layout (see :mod:`baige.kernels`): (n_kv_heads, num_blocks, block_size, head_dim).
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
from baige.kernels.triton_ops.paged_decode_split import decode_splits, merge_splits


@triton.jit
def _paged_attn_kernel(
    Q,
    KC,
    VC,
    O,
    BT,
    CU_Q,
    CTX,
    WS_M,
    WS_L,
    WS_ACC,
    SINKS,
    qk_scale,
    window,
    cap,
    split_len,
    n_kv,
    n_splits,
    sq_t,
    sq_h,
    so_t,
    so_h,
    skc_h,
    skc_b,
    skc_s,
    svc_h,
    svc_b,
    svc_s,
    sbt,
    IS_DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    pid0, seq, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SPLIT:  # decode split over the keys (flash-decoding): axis 0 is the split, not a query tile
        pid_t = 0
    else:
        pid_t = pid0
    if IS_DECODE:
        q_start = seq
        len_q = 1
    else:
        q_start = tl.load(CU_Q + seq)
        len_q = tl.load(CU_Q + seq + 1) - q_start
    if pid_t * BLOCK_T >= len_q:
        return
    ctx = tl.load(CTX + seq)  # cached tokens, this chunk's included
    first_pos = ctx - len_q  # absolute position of query 0
    rows = tl.arange(0, BLOCK_T * G_PAD)
    tok = pid_t * BLOCK_T + rows // G_PAD
    g = rows % G_PAD
    row_mask = (tok < len_q) & (g < GROUP)
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + tok)[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    qpos = first_pos + tok
    # with sinks, each row's softmax starts from its head's sink, unless split (the reduce adds it once)
    m_i, l_i = softmax_start(SINKS, head, g < GROUP, BLOCK_T * G_PAD, HAS_SINKS and not SPLIT)
    acc = tl.zeros([BLOCK_T * G_PAD, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    hi = tl.minimum(ctx, first_pos + (pid_t + 1) * BLOCK_T)  # keys past hi are masked for every row
    lo = 0
    if HAS_WINDOW:  # key tiles wholly before the window of the tile's first query are never read
        lo = window_first_tile(first_pos + pid_t * BLOCK_T, window, BLOCK_N)
    if SPLIT:  # split pid0's range of keys, counted from lo (a decode reads at most its window)
        lo = lo + pid0 * split_len
        hi = tl.minimum(hi, lo + split_len)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < ctx
        blk = tl.load(BT + seq * sbt + pos // KV_BLOCK, mask=n_mask, other=0)
        slot = pos % KV_BLOCK
        kt = tl.load(
            KC + kvh * skc_h + blk[None, :] * skc_b + slot[None, :] * skc_s + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # (D, N)
        qk = tl.dot(q, kt, input_precision="ieee") * qk_scale
        if HAS_SOFTCAP:
            qk = softcap(qk, cap)
        visible = (pos[None, :] <= qpos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new, m_sub = online_max(m_i, qk, HAS_WINDOW)  # finite without a window: position 0 is visible to every row
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            VC + kvh * svc_h + blk[:, None] * svc_b + slot[:, None] * svc_s + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if SPLIT:  # unnormalised partials of this key range; _decode_reduce_kernel combines the splits
        ws = ((seq * n_kv + kvh) * n_splits + pid0) * (BLOCK_T * G_PAD) + rows
        tl.store(WS_M + ws, m_i)
        tl.store(WS_L + ws, l_i)
        tl.store(WS_ACC + ws[:, None] * BLOCK_D + offs_d[None, :], acc)
    else:
        acc = acc / l_i[:, None]
        tl.store(
            O + (q_start + tok)[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
            acc.to(O.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOTS,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    skc_h,
    skc_s,
    svc_h,
    svc_s,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(SLOTS + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < N_KV)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + tok * sk_t + offs_h[:, None] * sk_h + offs_d[None, :], mask=mask)
    v = tl.load(V + tok * sv_t + offs_h[:, None] * sv_h + offs_d[None, :], mask=mask)
    # flat slot index over (num_blocks, block_size): the cache is contiguous, so the slot stride is skc_s;
    # slot -1 marks a padding token (vLLM's convention): nothing is written for it
    if slot >= 0:
        tl.store(KC + offs_h[:, None] * skc_h + slot * skc_s + offs_d[None, :], k, mask=mask)
        tl.store(VC + offs_h[:, None] * svc_h + slot * svc_s + offs_d[None, :], v, mask=mask)


def _tiles(group: int, head_dim: int, device: torch.device, decode: bool) -> tuple[int, int, int, dict]:
    """(G_PAD, BLOCK_T, BLOCK_N, launch options): rows = BLOCK_T * G_PAD >= 16 (tl.dot's minimum)."""
    g_pad = triton.next_power_of_2(group)
    if decode:
        block_t = max(1, 16 // g_pad)  # only token 0 is real; the rest pads the dot to 16 rows
    else:
        block_t = max(1, (64 if device.type == "cuda" else 16) // g_pad)
    block_n = 64 if device.type == "cuda" else 16
    opts = {"num_warps": 4, "num_stages": 2} if device.type == "cuda" else {}
    return g_pad, block_t, block_n, opts


def _check(q, k_cache, v_cache, block_tables, cu_q, context_lens, decode: bool) -> None:
    """The launcher's argument checks (shapes as in :func:`paged_prefill_attention`).

    Raises:
        ValueError: the query heads are not a multiple of the cache's KV heads or head_dim differs; a
            K/V pool is not contiguous; ``context_lens`` (and ``cu_q`` for prefill) does not match the
            block-table rows; a decode has not one query per row.
    """
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[0]
    if n_heads % n_kv or k_cache.shape[-1] != head_dim:
        raise ValueError(
            f"paged attention: {n_heads} query heads over a cache of {n_kv} KV heads, "
            f"head_dim {head_dim} vs {k_cache.shape[-1]}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged attention needs contiguous K/V block pools")
    n_seq = block_tables.shape[0]
    if context_lens.shape != (n_seq,) or (not decode and cu_q.shape != (n_seq + 1,)):
        raise ValueError(
            f"paged attention: {n_seq} block-table rows need {n_seq} context_lens"
            f"{'' if decode else f' and {n_seq + 1} cu_seqlens_q'}; got {tuple(context_lens.shape)}"
            f"{'' if decode else f' and {tuple(cu_q.shape)}'}"
        )
    if decode and q.shape[0] != n_seq:
        raise ValueError(f"paged decode: {q.shape[0]} queries for {n_seq} block-table rows")


def _split_plan(n_seq: int, n_kv: int, max_slots: int, window: int, block_n: int, device, decode: bool):
    """(n_splits, split_len) of a launch: a decode over long contexts is split over the keys into ranges of
    ``split_len`` keys (whole key tiles) counted from the first key tile it reads; with a window it reads at
    most ``window + block_n - 1`` keys, whatever the context. Prefill: one range."""
    span = max_slots if not window else min(max_slots, window + block_n - 1)
    n_splits = decode_splits(n_seq, n_kv, span, device) if decode else 1
    split_len = triton.cdiv(triton.cdiv(span, n_splits), block_n) * block_n
    return triton.cdiv(span, split_len), split_len  # after rounding the ranges up to whole key tiles


def _launch(q, k_cache, v_cache, block_tables, cu_q, context_lens, scale, max_q, decode, variants) -> torch.Tensor:
    """Paged attention of decode (``decode``: one query per block-table row, ``cu_q`` unread) or prefill
    chunks (``max_q`` their longest); shapes as in :func:`paged_prefill_attention`, ``variants`` the
    keyword arguments of :func:`baige.kernels.attention` (window, sinks, softcap); returns (N, n_heads,
    head_dim) in q's dtype. A decode over long contexts is split over the keys, then merged."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    _check(q, k_cache, v_cache, block_tables, cu_q, context_lens, decode)
    n_tok, n_heads, head_dim = q.shape
    n_kv, _, kv_block, _ = k_cache.shape
    group = n_heads // n_kv
    n_seq = block_tables.shape[0]
    var = variant_args(**variants, n_heads=n_heads, like=q)
    # the kernel indexes these with unit strides
    block_tables, cu_q, context_lens = block_tables.contiguous(), cu_q.contiguous(), context_lens.contiguous()
    out = new_empty(q.shape, q.dtype, q.device)
    g_pad, block_t, block_n, opts = _tiles(group, head_dim, q.device, decode)
    if not (n_tok and n_seq):
        return out
    block_d = block_for(head_dim)
    n_splits, split_len = _split_plan(
        n_seq, n_kv, block_tables.shape[1] * kv_block, var["window"], block_n, q.device, decode
    )
    rows = block_t * g_pad
    if n_splits > 1:
        ws_m = torch.empty((n_seq, n_kv, n_splits, rows), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((n_seq, n_kv, n_splits, rows, block_d), dtype=torch.float32, device=q.device)
        grid = (n_splits, n_seq, n_kv)
    else:
        ws_m = ws_l = ws_acc = out  # unused
        grid = (triton.cdiv(max_q, block_t), n_seq, n_kv)
    _paged_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_q,
        context_lens,
        ws_m,
        ws_l,
        ws_acc,
        var["SINKS"],
        scale * LOG2E,
        var["window"],
        var["cap"],
        split_len,
        n_kv,
        n_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        IS_DECODE=decode,
        SPLIT=n_splits > 1,
        GROUP=group,
        G_PAD=g_pad,
        KV_BLOCK=kv_block,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        HAS_SINKS=var["HAS_SINKS"],
        HAS_WINDOW=var["HAS_WINDOW"],
        HAS_SOFTCAP=var["HAS_SOFTCAP"],
        **opts,
    )
    if n_splits > 1:
        sinks = var["SINKS"] if var["HAS_SINKS"] else None
        merge_splits(ws_m, ws_l, ws_acc, out, sinks, group, g_pad, head_dim, block_d)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.paged_decode_attention` (no host synchronisation: safe to
    capture in a CUDA graph). With a window a decode reads only the key tiles from the one holding its
    window's first key on: at most ``window + BLOCK_N - 1`` keys, whatever the context.

    Raises:
        ValueError: as :func:`_check`, or a bad window, sinks or softcap (:func:`.attention_variants.variant_args`).
    """
    variants = {"window": window, "sinks": sinks, "softcap": softcap}
    return _launch(q, k_cache, v_cache, block_tables, context_lens, context_lens, scale, 1, True, variants)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.paged_prefill_attention` (one host sync for the longest chunk).
    With a window each tile of queries reads the key tiles from the one holding its first query's
    window start on.

    Raises:
        ValueError: as :func:`paged_decode_attention`.
    """
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if cu_seqlens_q.numel() > 1 else 0
    variants = {"window": window, "sinks": sinks, "softcap": softcap}
    return _launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q, False, variants)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton twin of :func:`baige.kernels.store_kv`: one program per token writes all its KV heads.
    A slot of -1 (a padding token) is skipped; slots are not range-checked (no device sync)."""
    n_tok, n_kv, head_dim = k.shape
    if k_cache.shape[0] != n_kv or k_cache.shape[-1] != head_dim or v.shape != k.shape:
        raise ValueError(f"store_kv: K/V {tuple(k.shape)} do not fit a cache of {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous K/V block pools")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if slot_mapping.shape != (n_tok,):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} for {n_tok} tokens")
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise ValueError(f"store_kv: K/V {k.dtype} into a {k_cache.dtype} cache")
    slot_mapping = slot_mapping.contiguous()
    if n_tok:
        _store_kv_kernel[(n_tok,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(2),
            N_KV=n_kv,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(n_kv),
            BLOCK_D=block_for(head_dim),
        )
