"""Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434) over the paged latent cache, and
DeepSeek's group-limited routing (:mod:`baige.kernels.routing`): the public ops and their dispatch.

The latent cache of one layer is ``(1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``
(the paged layout of :mod:`baige.kernels` with one KV head): per token the compressed latent
``c_kv`` (after ``kv_a_layernorm``) followed by the rotated rope key ``k_pe``. Decode runs in the
absorbed form: the query is ``[q_nope @ W_UK, q_pe]`` per head, the keys are the cached rows and the
values their first ``kv_lora_rank`` columns, so the attention output is a latent per head that the
caller maps through ``W_UV`` (section 2.1.2 of the paper, "absorb"; vLLM's and SGLang's MLA backends).
"""

from __future__ import annotations

import importlib

import torch

from baige.kernels.dispatch import backend
from baige.kernels.routing import grouped_topk  # noqa: F401  (re-exported: a public op)

MLA_OPS = ("grouped_topk", "mla_decode_attention")
__all__ = [*MLA_OPS]
_TRITON: dict[str, object] = {}


def _triton(module: str):
    mod = _TRITON.get(module)
    if mod is None:
        mod = _TRITON[module] = importlib.import_module(f"baige.kernels.triton_ops.{module}")
    return mod


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed MLA decode: one query per sequence over its cached latents.

    ``out[s, h] = sum_n softmax_n(scale * q[s, h] . kv[s, n]) * kv[s, n, :kv_lora_rank]`` over the
    first ``context_lens[s]`` cached tokens of sequence ``s`` (its own already stored), fp32 softmax.

    Args:
        q: (S, n_heads, kv_lora_rank + rope_dim): ``[q_nope @ W_UK, q_pe]`` per head.
        kv_cache: (1, num_blocks, block_size, kv_lora_rank + rope_dim), contiguous; on the reference
            path its dtype may differ from q's (read converted to it), on the Triton path it must not.
        block_tables: (S, W) int64 block ids (entries past a sequence's blocks: any valid id).
        context_lens: (S,) int64, 1 <= context_lens <= W * block_size.
        scale: softmax scale (``qk_head_dim ** -0.5`` times YaRN's mscale squared).
        kv_lora_rank: the latent width (the values are the first ``kv_lora_rank`` columns).
    Returns:
        (S, n_heads, kv_lora_rank) in q's dtype.
    Raises:
        ValueError: mismatched shapes.
    """
    S, H, D = q.shape
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != D or not 0 < kv_lora_rank <= D:
        raise ValueError(f"mla_decode_attention: kv_cache {tuple(kv_cache.shape)} for q {tuple(q.shape)}")
    if block_tables.shape[0] != S or context_lens.shape != (S,):
        raise ValueError(f"mla_decode_attention: {S} queries, block_tables {tuple(block_tables.shape)}")
    if backend(q) == "reference":
        return mla_decode_attention_reference(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank)
    return _triton("mla_attention").mla_decode_attention(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank)


def mla_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The PyTorch oracle of :func:`mla_decode_attention` (arguments checked there)."""
    S, H, D = q.shape
    kv = kv_cache[0][block_tables].reshape(S, -1, D).to(q.dtype)  # (S, W * block_size, D)
    scores = torch.einsum("shd,snd->shn", q.float(), kv.float()) * scale  # (S, H, N) fp32
    n = torch.arange(kv.shape[1], device=q.device)
    valid = n[None, :] < context_lens[:, None]  # (S, N)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (S, H, N)
    return torch.einsum("shn,snl->shl", probs, kv[..., :kv_lora_rank].float()).to(q.dtype)  # (S, H, Dl)
