"""Token log-probabilities as the engine reports them, for the trainer to recompute (RL: the policy ratio of
GRPO / PPO divides the trainer's probability of a sampled token by the engine's).

One formula on both sides, :func:`log_probs`: the raw logits (no temperature or penalties, vLLM's
``logprobs``) through ``log_softmax`` in fp32. With ``batch_invariant`` on, :func:`sequence_logprobs` runs the
forward under :func:`baige.kernels.batch_invariant`, and equals bit for bit the logprobs an engine built
with ``EngineConfig.batch_invariant`` reports for the same tokens -- sampled or prompt tokens, whatever else
was in its batches and however its prompt was chunked (``baige/kernels/invariant.py`` says how, and
tests/infer/test_batch_invariant.py checks it). Without it the two agree up to the kernels' rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.model.transformer import Transformer


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """(..., vocab) logits in any float dtype -> (..., vocab) fp32 ``log_softmax`` (natural log)."""
    return torch.log_softmax(logits.float(), dim=-1)


def check_batch_invariant(model: Transformer, kv_cache_dtype: torch.dtype | None = None) -> None:
    """Raise BaigeError (one line) when batch-invariant mode cannot hold for ``model``: parameters off the
    CPU, compiled modules (``torch.compile`` would fuse the fixed-order ops and round differently),
    Mixture-of-Experts layers, a linear projection that is not a plain ``nn.Linear`` without hooks
    (quantized, fp16-weight, LoRA, tensor-parallel shards), attention with a sliding window, sinks or a
    soft-cap, or a KV cache dtype other than the model's (its rounding would differ from the trainer's)."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise BaigeError(f"batch-invariant mode runs on the CPU only; the model is on {p.device.type}")
    if kv_cache_dtype is not None and kv_cache_dtype != p.dtype:
        raise BaigeError(
            f"batch-invariant mode needs the KV cache in the model's dtype ({p.dtype}), not {kv_cache_dtype}"
        )
    for name, mod in model.named_modules():
        if getattr(mod, "_compiled_call_impl", None) is not None or hasattr(mod, "_orig_mod"):
            raise BaigeError(f"batch-invariant mode runs eagerly; {name or 'the model'} is compiled (torch.compile)")
        if isinstance(mod, SparseMoeBlock):
            raise BaigeError(f"batch-invariant mode does not support Mixture-of-Experts layers ({name})")
        for what in ("sliding_window", "sinks", "softcap"):  # kernels/invariant.py has plain causal attention only
            if getattr(mod, what, None) is not None:
                raise BaigeError(f"batch-invariant mode does not support attention with {what} ({name})")
        if not hasattr(mod, "in_features"):
            continue
        if type(mod) is not nn.Linear:
            raise BaigeError(f"batch-invariant mode needs plain linear layers; {name} is {type(mod).__name__}")
        if mod._forward_hooks or mod._forward_pre_hooks:
            raise BaigeError(f"batch-invariant mode does not support hooked linears (LoRA adapters): {name}")


def sequence_logprobs(model: Transformer, input_ids: torch.Tensor, *, batch_invariant: bool) -> torch.Tensor:
    """Log-probabilities of tokens 1..T-1 of one sequence under ``model``, each given the tokens before it.

    The plain causal forward of training (``attn_metadata=None``) on shape (1, T), then :func:`log_probs` of
    each position's logits gathered at the next token; differentiable w.r.t. the model's parameters
    (autograd follows the grad mode of the caller).

    Args:
        model: the decoder (train or eval mode; dropout-free).
        input_ids: (T,) int64 token ids, T >= 2 (prompt + completion), on the model's device.
        batch_invariant: run the forward in batch-invariant mode (:func:`baige.kernels.batch_invariant`):
            the result then equals an ``EngineConfig.batch_invariant`` engine's logprobs bit for bit.
    Returns:
        (T-1,) fp32: entry t is ``log p(input_ids[t+1] | input_ids[:t+1])``.
    Raises:
        BaigeError: ``input_ids`` is not 1-D with at least 2 tokens, or (``batch_invariant``) the model cannot
        run in the mode (:func:`check_batch_invariant`).
    """
    if input_ids.dim() != 1 or input_ids.shape[0] < 2:
        raise BaigeError(f"sequence_logprobs needs (T,) token ids with T >= 2, got shape {tuple(input_ids.shape)}")
    if batch_invariant:
        check_batch_invariant(model)
    T = input_ids.shape[0]
    positions = torch.arange(T, device=input_ids.device)[None]  # (1, T)
    with kernels.batch_invariant(batch_invariant):
        hidden = model(input_ids[None], positions)  # (1, T, hidden)
        logits = model.compute_logits(hidden[0, :-1])  # (T-1, vocab)
    return log_probs(logits).gather(-1, input_ids[1:, None])[:, 0]
