"""Plain KV-cached generation with a contiguous cache: prefill once, then decode token by token.

This is the foundation's reference generation path (``baige generate`` / ``baige chat``); the
paged, continuously batched engine reproduces its greedy outputs token for token.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplingParams, sample
from baige.runtime.model.transformer import Transformer


class ContiguousKVCache:
    """Per-layer K/V tensors ``(B, max_len, n_kv_heads, head_dim)`` filled left to right.

    Serves as the model's attention metadata: :meth:`attend` stores the new tokens' K/V at
    ``start .. start+T-1`` and attends over everything cached so far. Call :meth:`advance` after
    each forward.
    """

    def __init__(self, model: Transformer, batch_size: int, max_len: int):
        cfg = model.config
        p = next(model.parameters())
        shape = (batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len
        self.start = 0  # tokens already cached
        self.pending = 0  # tokens of the forward in flight

    def attend(self, layer_idx: int, q, k, v, scale: float, *, window=None, sinks=None, softcap=None) -> torch.Tensor:
        T = q.shape[1]
        end = self.start + T
        if end > self.max_len:
            raise BaigeError(f"sequence of {end} tokens exceeds the cache of {self.max_len}")
        self.k[layer_idx][:, self.start : end] = k
        self.v[layer_idx][:, self.start : end] = v
        self.pending = T
        k_all, v_all = self.k[layer_idx][:, :end], self.v[layer_idx][:, :end]
        extra = {"window": window, "sinks": sinks, "softcap": softcap}
        return kernels.attention(q, k_all, v_all, scale, q_offset=self.start, **extra)

    def advance(self) -> None:
        self.start += self.pending
        self.pending = 0


@torch.inference_mode()
def generate_tokens(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    max_model_len: int | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time (an EOS id is yielded, then generation stops).

    Args:
        model: the decoder, in eval mode.
        prompt_ids: the prompt's token ids (non-empty).
        params: sampling settings; ``max_tokens=None`` means up to ``max_model_len``.
        eos_token_ids: ids that end generation unless ``params.ignore_eos``.
        max_model_len: context limit in tokens (default: the config's ``max_position_embeddings``).
    Raises:
        BaigeError: empty prompt, or a prompt that leaves no room in the context.
    """
    max_model_len = max_model_len or model.config.max_position_embeddings
    n = len(prompt_ids)
    if n == 0:
        raise BaigeError("the prompt is empty")
    if n >= max_model_len:
        raise BaigeError(f"prompt of {n} tokens leaves no room to generate (max model length {max_model_len})")
    max_new = min(params.max_tokens or max_model_len, max_model_len - n)
    device = next(model.parameters()).device
    cache = ContiguousKVCache(model, 1, n + max_new)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    eos = set() if params.ignore_eos else set(eos_token_ids)

    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, n)
    positions = torch.arange(n, device=device)[None]  # (1, n)
    for _ in range(max_new):
        hidden = model(ids, positions, cache)  # (1, T, hidden)
        cache.advance()
        logits = model.compute_logits(hidden[:, -1])  # (1, vocab)
        token = int(sample(logits, params, generator)[0])
        yield token
        if token in eos:
            return
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        positions = torch.tensor([[cache.start]], dtype=torch.long, device=device)
