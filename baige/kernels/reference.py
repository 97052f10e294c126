"""Pure-PyTorch twins of every ``baige.kernels`` op.

These are the numerical oracle for the Triton kernels and the CPU path of the model. Each
function has the same signature and semantics as its public counterpart in
``baige.kernels``; see the docstrings there for shapes and dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32, cast back before the weight multiply: the order HF's LlamaRMSNorm uses.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(-2)  # (..., 1, D): broadcast over heads
    sin = sin.unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0
) -> torch.Tensor:
    T, S = q.shape[1], k.shape[1]
    qh = q.transpose(1, 2)  # (B, H, T, D)
    kh = k.transpose(1, 2)  # (B, Hkv, S, D); SDPA broadcasts the KV heads over query groups
    vh = v.transpose(1, 2)  # (B, Hkv, S, Dv)
    gqa = q.shape[2] != k.shape[2]
    if T == 1 and q_offset == S - 1:  # one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif q_offset == 0 and T == S:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at absolute position q_offset + i and sees keys 0..q_offset + i.
        qpos = torch.arange(T, device=q.device) + q_offset
        mask = torch.arange(S, device=q.device)[None, :] <= qpos[:, None]  # (T, S)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)  # (B, T, H, Dv)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    Hkv, D = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k)  # slot = block * block_size + offset
    v_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, v)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    S, H, D = q.shape
    W = block_tables.shape[1]
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    L = W * block_size
    k = k_cache[block_tables].view(S, L, Hkv, D)  # (S, W * block_size, Hkv, D), gathered blocks
    v = v_cache[block_tables].view(S, L, Hkv, D)
    mask = torch.arange(L, device=q.device)[None, :] < context_lens[:, None]  # (S, L)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # (S, H, 1, D)
        k.transpose(1, 2),  # (S, Hkv, L, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],  # (S, 1, 1, L)
        scale=scale,
        enable_gqa=True,
    )  # (S, H, 1, D)
    return out.view(S, H, D)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu, ctx_lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, ctx in enumerate(ctx_lens):
        start, end = cu[i], cu[i + 1]
        n_blocks = -(-ctx // block_size)
        table = block_tables[i, :n_blocks]
        k = k_cache[table].view(-1, Hkv, D)[:ctx]  # (ctx, Hkv, D)
        v = v_cache[table].view(-1, Hkv, D)[:ctx]
        out[start:end] = attention(q[None, start:end], k[None], v[None], scale, q_offset=ctx - (end - start))[0]
    return out


def _cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # (n, vocab), fp32 for the log-sum-exp
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, hidden)
    t = targets.reshape(-1)  # (N,)
    # Chunks of ~16M logits (64 MB in fp32); each chunk's logits are recomputed in backward
    # (activation checkpointing), so at most one chunk of logits and its gradient exist at a time.
    chunk = max(1, (1 << 24) // weight.shape[0])
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk):
        args = (h[s:s + chunk], weight, t[s:s + chunk], ignore_index)
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            total = total + torch.utils.checkpoint.checkpoint(_cross_entropy_sum, *args, use_reentrant=False)
        else:
            total = total + _cross_entropy_sum(*args)
    if normalizer is None:
        normalizer = (t != ignore_index).sum()
    return total / normalizer
