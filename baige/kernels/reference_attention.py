"""Pure-PyTorch twins of the attention ops of ``baige.kernels`` (re-exported by :mod:`.reference`): causal,
masked, packed variable-length and paged attention, each with the sliding window, sinks and logit
soft-capping of :func:`baige.kernels.attention` where it takes them, and the paged cache's ``store_kv``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean mask of the keys each query sees: ``k <= q`` and, with a sliding ``window`` w,
    ``q - w < k`` (w keys, the query's own included; transformers' ``sliding_window`` masks).

    Args:
        q_pos: (..., T) int64 absolute query positions; k_pos: (..., S) int64 key positions.
    Returns:
        (..., T, S) bool, broadcast over the leading dims.
    """
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # (..., T, S)
    mask = diff >= 0
    return mask if window is None else mask & (diff < window)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Explicit attention with soft-capping and sinks, math in fp32 (fp64 for fp64 inputs), autograd-able.

    ``s = scale * q.k``; with ``softcap`` c, ``s = c * tanh(s / c)`` (Gemma 2's ``attn_logit_softcapping``);
    masked keys get ``-inf``; with ``sinks`` a per-head logit joins each row's softmax denominator and
    carries no value (gpt-oss, HF ``GptOssAttention``): ``out = sum_j softmax([s, sink])_j v_j``.

    Args:
        q: (..., Hkv, G, T, D) queries, G query heads per KV head (query head ``h = kv * G + g``).
        k, v: (..., Hkv, 1, S, D); mask: bool broadcastable to (..., Hkv, G, T, S), True = visible.
        sinks: (Hkv * G,) per query head, or None; softcap: float > 0 or None.
    Returns:
        (..., Hkv, G, T, D) in q's dtype. A row with no visible key and no sink is NaN.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (..., Hkv, G, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        Hkv, G = q.shape[-4], q.shape[-3]
        sink = sinks.to(acc).view(Hkv, G, 1, 1).expand(*scores.shape[:-1], 1)  # (..., Hkv, G, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.matmul(probs, v.to(acc)).to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_offset: int = 0,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    qh = q.transpose(1, 2)  # (B, H, T, D)
    kh = k.transpose(1, 2)  # (B, Hkv, S, D); SDPA broadcasts the KV heads over query groups
    vh = v.transpose(1, 2)  # (B, Hkv, S, Dv)
    gqa = H != Hkv
    dev = q.device
    if sinks is not None or softcap is not None:
        mask = visible_keys(torch.arange(T, device=dev) + q_offset, torch.arange(S, device=dev), window)
        q5 = qh.reshape(B, Hkv, H // Hkv, T, D)
        out = softmax_attention(q5, kh[:, :, None], vh[:, :, None], scale, mask, sinks, softcap)
        out = out.reshape(B, H, T, -1)
    elif window is not None and window < S:
        mask = visible_keys(torch.arange(T, device=dev) + q_offset, torch.arange(S, device=dev), window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    elif T == 1 and q_offset == S - 1:  # one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif q_offset == 0 and T == S:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at absolute position q_offset + i and sees keys 0..q_offset + i.
        mask = visible_keys(torch.arange(T, device=dev) + q_offset, torch.arange(S, device=dev))  # (T, S)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)  # (B, T, H, Dv)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T or S, D)
    if sinks is not None or softcap is not None:
        B, H, T, D = qh.shape
        Hkv = kh.shape[1]
        q5 = qh.reshape(B, Hkv, H // Hkv, T, D)
        out = softmax_attention(q5, kh[:, :, None], vh[:, :, None], scale, mask[:, None, None], sinks, softcap)
        return out.reshape(B, H, T, -1).transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)  # (B, T, H, Dv)


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
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qe == qs:
            continue
        o = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale, q_offset=(ke - ks) - (qe - qs))
        out[qs:qe] = o[0]
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    Hkv, D = k_cache.shape[0], k_cache.shape[-1]
    # (Hkv, num_blocks * block_size, D): slot = block * block_size + offset indexes dim 1
    k_cache.view(Hkv, -1, D).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(Hkv, -1, D).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(Hkv, num_blocks, block_size, D) pool, (S, W) tables -> (Hkv, S, W * block_size, D), contiguous.

    ``index_select`` over the flattened table writes each sequence's blocks back to back, which is
    already the batched-matmul layout (measured faster than advanced indexing on CPU).
    """
    Hkv, _, bs, D = cache.shape
    S, W = block_tables.shape
    return cache.view(Hkv, -1, bs * D).index_select(1, block_tables.reshape(-1)).view(Hkv, S, W * bs, D)


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
    S, H, D = q.shape
    Hkv = k_cache.shape[0]
    L = block_tables.shape[1] * k_cache.shape[2]
    k = _gather_blocks(k_cache, block_tables).to(q.dtype)  # (Hkv, S, L, D)
    v = _gather_blocks(v_cache, block_tables).to(q.dtype)
    # the query sits at position context_lens - 1 and sees keys 0..context_lens - 1 (its window's last w)
    mask = visible_keys((context_lens - 1)[:, None], torch.arange(L, device=q.device), window)[:, 0]  # (S, L)
    qh = q.view(S, Hkv, H // Hkv, D).transpose(0, 1)  # (Hkv, S, group, D): query head h uses KV head h // group
    if sinks is not None or softcap is not None:
        q5 = q.view(S, Hkv, H // Hkv, 1, D)
        k5, v5 = k.transpose(0, 1)[:, :, None], v.transpose(0, 1)[:, :, None]  # (S, Hkv, 1, L, D)
        out = softmax_attention(q5, k5, v5, scale, mask[:, None, None, None, :], sinks, softcap)
        return out.reshape(S, H, -1)
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask[None, :, None, :], scale=scale)  # (Hkv, S, group, D)
    return out.transpose(0, 1).reshape(S, H, -1)


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
    block_size = k_cache.shape[2]
    out = torch.empty_like(q)
    cu, ctx_lens = cu_seqlens_q.tolist(), context_lens.tolist()
    extra = {"window": window, "sinks": sinks, "softcap": softcap}
    for i, ctx in enumerate(ctx_lens):
        start, end = cu[i], cu[i + 1]
        n_blocks = -(-ctx // block_size)
        table = block_tables[i : i + 1, :n_blocks]
        k = _gather_blocks(k_cache, table)[:, 0, :ctx].transpose(0, 1).to(q.dtype)  # (ctx, Hkv, D)
        v = _gather_blocks(v_cache, table)[:, 0, :ctx].transpose(0, 1).to(q.dtype)
        o = attention(q[None, start:end], k[None], v[None], scale, q_offset=ctx - (end - start), **extra)
        out[start:end] = o[0]
    return out
