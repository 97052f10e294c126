"""The attention ops of :mod:`baige.kernels` (re-exported there; see its docstring for the dispatch):
contiguous causal attention, masked attention, packed variable-length attention and the paged KV cache's
store and attention ops, each with an optional sliding window, attention sinks and logit soft-capping
where the issue's models need them.

Dispatch goes through :mod:`baige.kernels.dispatch`'s ``impl_for`` / ``native_cpu`` looked up at call
time, so a test that swaps them there reroutes these ops too.
"""

from __future__ import annotations

import torch

from baige.kernels import dispatch, invariant, reference, train_attention


def _variant(window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> bool:
    """Whether a sliding window, attention sinks or a logit soft-cap is asked for (see :func:`attention`);
    the batch-invariant kernels, which lack them, then run the reference (the Triton and native CPU
    kernels take them)."""
    return window is not None or sinks is not None or softcap is not None


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
    """Causal scaled-dot-product attention with grouped-query heads over contiguous K/V, with an
    optional sliding window, attention sinks and logit soft-capping (differentiable on every path).

    Query ``i`` is at absolute position ``p = q_offset + i`` and attends to keys ``0..p`` (the
    causal mask is aligned to the bottom right when ``q_offset = S - T``); with ``window`` w only to
    keys ``p - w < s <= p`` (w keys, itself included: transformers' sliding-window masks).
    ``softcap`` c replaces each score ``scale * q.k`` by ``c * tanh(score / c)`` before masking
    (Gemma 2's ``attn_logit_softcapping``). ``sinks`` adds one logit per query head to every row's
    softmax denominator that carries no value (gpt-oss): ``out = sum_s softmax([scores, sink])_s v_s``.

    Args:
        q: (B, T, n_heads, head_dim).
        k, v: (B, S, n_kv_heads, head_dim) with ``n_heads % n_kv_heads == 0`` and ``S >= q_offset + T``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        q_offset: absolute position of the first query.
        window: sliding-window length w >= 1 in tokens, or None (full causal).
        sinks: (n_heads,) sink logits (any float dtype; fp32 math), or None.
        softcap: the cap c > 0, or None.
    Returns:
        (B, T, n_heads, head_dim) in the dtype of ``q``.
    """
    if _variant(window, sinks, softcap):
        impl = reference if invariant.enabled() else dispatch.impl_for(q, "flash_attention")
        return impl.attention(q, k, v, scale, q_offset, window=window, sinks=sinks, softcap=softcap)
    if not invariant.enabled() and train_attention.use_materialized(q, k, q_offset):  # short bf16 training
        return train_attention.causal_attention(q, k, v, scale)
    return (invariant if invariant.enabled() else dispatch.impl_for(q, "flash_attention")).attention(
        q, k, v, scale, q_offset
    )


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
    """Scaled-dot-product attention under an explicit boolean mask, grouped-query heads, with autograd
    (training's packed layouts whose mask is not plain causal, e.g. several completions sharing one
    prompt).

    Args:
        q: (B, T, n_heads, head_dim).
        k, v: (B, S, n_kv_heads, head_dim), ``n_heads % n_kv_heads == 0``.
        scale: softmax scale.
        mask: (B, T, S) bool, True where query t may attend key s (a sliding window goes into it);
            every query row needs a True.
        sinks, softcap: as :func:`attention`'s.
    Returns:
        (B, T, n_heads, head_dim) in the dtype of ``q``.
    """
    plain = sinks is None and softcap is None
    if plain and not invariant.enabled() and train_attention.use_materialized_masked(q, k):  # small bf16 blocks
        return train_attention.masked_attention(q, k, v, scale, mask)
    return reference.masked_attention(q, k, v, scale, mask, sinks=sinks, softcap=softcap)


# ---- paged KV cache (vLLM's PagedAttention layout, Kwon et al. 2023, arXiv:2309.06180) ------------
# A layer's cache is (n_kv_heads, num_blocks, block_size, head_dim), heads outermost; token slot s of
# KV head h lives at [h, s // block_size, s % block_size]. A block table row lists a sequence's blocks
# in order. Heads outermost makes gathering a batch's blocks produce (n_kv_heads, S, tokens, head_dim)
# directly, the layout of a batched matmul per KV head (no transpose copy after the gather).


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' K/V into their cache slots, in place.

    Args:
        k, v: (N, n_kv_heads, head_dim). On CPU they are rounded to the cache's dtype (an fp16 cache
            under an fp32 model, ``kv_cache_dtype``); the Triton path needs the cache's dtype.
        k_cache, v_cache: (n_kv_heads, num_blocks, block_size, head_dim), contiguous.
        slot_mapping: (N,) int64 slot of each token, ``block_id * block_size + offset``; distinct and
            inside the pool. The Triton path does not range-check them (that would need a device sync):
            an out-of-range slot writes outside the pool.
    Raises:
        ValueError (Triton path): K/V and cache dtypes differ, or slot_mapping is not (N,).
    """
    same = k.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16  # bf16 into bf16: native row copies
    impl = dispatch.native_cpu(k, v, caches=(k_cache, v_cache), bf16=same) or dispatch.impl_for(k, "paged_attention")
    impl.store_kv(k, v, k_cache, v_cache, slot_mapping)


def _paged_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, variant: bool):
    """The module a paged attention op runs: the batch-invariant kernels when enabled (the reference
    instead for a ``variant``: window, sinks or soft-cap), else the native CPU kernels where they run,
    else the dispatch's backend (Triton or the reference)."""
    if invariant.enabled():
        return reference if variant else invariant
    return dispatch.native_cpu(q, caches=(k_cache, v_cache), bf16=True) or dispatch.impl_for(q, "paged_attention")


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
    """Attention of one query per sequence over its cached K/V (decode), grouped-query heads.

    The query's own K/V must already be stored; it attends to the first ``context_lens[i]`` cached
    tokens of sequence ``i``. Shapes are fixed by the padding of ``block_tables``, so one compiled
    graph (or CUDA graph) serves every decode step of a given batch and table width. Work and memory
    traffic grow with ``S * W``: callers group sequences of similar length (see the model runner).

    Args:
        q: (S, n_heads, head_dim).
        k_cache, v_cache: (n_kv_heads, num_blocks, block_size, head_dim), contiguous; on CPU their
            dtype may differ from q's (read converted to it), on the Triton path it must not.
        block_tables: (S, W) int64 block ids; entries past a sequence's blocks must be valid ids
            (any block: they are masked), and so may those of blocks wholly before the window.
        context_lens: (S,) int64 tokens in the cache per sequence, 1 <= context_lens <= W * block_size.
        scale: softmax scale.
        window, sinks, softcap: as :func:`attention`'s; the query sits at position ``context_lens - 1``.
    Returns:
        (S, n_heads, head_dim) in the dtype of ``q``.
    """
    impl = _paged_impl(q, k_cache, v_cache, _variant(window, sinks, softcap))
    if _variant(window, sinks, softcap):
        extra = {"window": window, "sinks": sinks, "softcap": softcap}
        return impl.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, **extra)
    return impl.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


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
    """Causal attention of prefill chunks over their cached prefix plus themselves (chunked prefill,
    prefix caching), grouped-query heads, sequences packed without padding.

    Sequence ``i`` has queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` (its last ``T_i`` tokens, whose
    K/V are already stored) and ``context_lens[i]`` tokens in the cache; query ``j`` sits at position
    ``context_lens[i] - T_i + j`` and sees keys ``0..`` that position.

    Args:
        q: (N, n_heads, head_dim), N = total query tokens.
        k_cache, v_cache: (n_kv_heads, num_blocks, block_size, head_dim), contiguous; on CPU their
            dtype may differ from q's (read converted to it), on the Triton path it must not.
        block_tables: (P, W) int64 block ids per sequence (with a window, the entries of blocks wholly
            before the first query's window may be any valid id: they are masked).
        cu_seqlens_q: (P + 1,) int64 cumulative query counts, starting at 0.
        context_lens: (P,) int64 cached tokens per sequence, the new ones included.
        scale: softmax scale.
        window, sinks, softcap: as :func:`attention`'s.
    Returns:
        (N, n_heads, head_dim) in the dtype of ``q``.
    """
    impl = _paged_impl(q, k_cache, v_cache, _variant(window, sinks, softcap))
    if _variant(window, sinks, softcap):
        extra = {"window": window, "sinks": sinks, "softcap": softcap}
        return impl.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, **extra
        )
    return impl.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


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
    """Causal attention over packed variable-length sequences, grouped-query heads, with autograd
    (FlashAttention-2's online softmax, Dao 2023, arXiv:2307.08691; ``flash_attn_varlen_func``'s
    argument convention).

    Sequence ``i`` owns queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and keys
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; with ``Lq <= Lk`` tokens the causal mask is aligned to the
    bottom right: query ``j`` sees keys ``0..Lk - Lq + j``.

    Args:
        q: (Nq, n_heads, head_dim) fp32/fp16/bf16.
        k, v: (Nk, n_kv_heads, head_dim), ``n_heads % n_kv_heads == 0``.
        cu_seqlens_q, cu_seqlens_k: (P + 1,) int32/int64 cumulative lengths starting at 0.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (host ints: no device sync); each
            sequence needs ``0 < Lq <= Lk`` and lengths no longer than these, or rows are left unwritten.
        scale: softmax scale.
    Returns:
        (Nq, n_heads, head_dim) in the dtype of ``q``; softmax statistics are fp32.
    """
    impl = dispatch.impl_for(q, "flash_attention")
    return impl.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
