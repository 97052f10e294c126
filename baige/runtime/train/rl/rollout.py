"""Rollouts from baige's own engine in the training process, and the weight sync back into it.

Each data-parallel rank owns one :class:`~baige.runtime.infer.llm.LLM` (continuous batching, prefix
caching: a prompt's ``n = rl.group_size`` samples share its KV blocks; the native CPU decode or the
Triton path on GPU) over its share of the step's prompts. The step's phases on the engine:
generate -> ``sleep(level=1)`` (the KV cache released while the trainer runs) -> ``update_weights``
from the trainer's parameters -> ``reset_prefix_cache()`` (cached prefixes were computed with the old
weights) -> ``wake_up()``. The engine runs eager (``enforce_eager``): captured CUDA graphs hold the KV
pools' addresses, which a sleep moves.

The engine's logprobs are those of the raw model distribution (vLLM's: before temperature, top-p and
any processor), the same quantity the trainer's loss uses, so the ratio, the KL and the engine /
trainer mismatch all speak of the model at temperature 1; ``rl.temperature`` and ``rl.top_p`` shape
the sampling only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.infer.llm import LLM
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.lora import lora_modules
from baige.runtime.train.rl.config import RLSection

MAX_NUM_SEQS = 256  # most sequences the engine runs at once (vLLM's default max_num_seqs)
BLOCK_SIZE = 16


@dataclass
class Sample:
    """One generated sequence. ``group``: the index of its prompt among this rank's prompts of the step."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]  # per completion token, natural log, the engine's raw distribution
    text: str
    finish_reason: str | None


def build_engine(
    model_dir: str,
    mc: ModelConfig,
    rl: RLSection,
    device: torch.device,
    dtype: torch.dtype,
    max_prompt_len: int,
    num_prompts: int,
    seed: int,
) -> LLM:
    """This rank's engine for ``num_prompts`` prompts of at most ``max_prompt_len`` tokens per step:
    ``max_model_len`` = that + ``rl.max_tokens``, a KV cache that holds every sequence of a step whole.

    Raises:
        BaigeError: the longest prompt plus ``rl.max_tokens`` exceeds the model's context.
    """
    max_model_len = max_prompt_len + rl.max_tokens
    if max_model_len > mc.max_position_embeddings:
        raise BaigeError(
            f"the longest prompt ({max_prompt_len} tokens) plus rl.max_tokens ({rl.max_tokens}) exceeds the model's "
            f"context of {mc.max_position_embeddings} tokens"
        )
    num_seqs = min(MAX_NUM_SEQS, num_prompts * rl.group_size)
    blocks = num_seqs * -(-max_model_len // BLOCK_SIZE)
    kv_bytes = blocks * BLOCK_SIZE * mc.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    extra = {"batch_invariant": True} if rl.batch_invariant else {}
    return LLM(
        model_dir,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs),
        block_size=BLOCK_SIZE,
        kv_cache_memory=kv_bytes,
        enforce_eager=True,
        **extra,
    )


def generate(llm: LLM, prompt_ids: list[list[int]], seeds: list[int], rl: RLSection) -> list[Sample]:
    """``rl.group_size`` samples of each prompt (one request with ``n`` = G and its own seed), with the
    engine's logprob of every sampled token; groups in prompt order."""
    params = [
        SamplingParams(
            n=rl.group_size,
            temperature=rl.temperature,
            top_p=rl.top_p,
            max_tokens=rl.max_tokens,
            stop=list(rl.stop) or None,
            logprobs=0,
            seed=seed,
        )
        for seed in seeds
    ]
    samples = []
    for group, (ids, out) in enumerate(zip(prompt_ids, llm.generate(prompt_ids, params))):
        for c in out.outputs:
            if c.logprobs is None or len(c.logprobs) != len(c.token_ids):
                raise RuntimeError(
                    f"the engine returned {len(c.logprobs or [])} logprobs for {len(c.token_ids)} tokens"
                )
            lps = [lp.logprob for lp in c.logprobs]
            samples.append(Sample(group, list(ids), list(c.token_ids), lps, c.text, c.finish_reason))
    return samples


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (gathered from its FSDP shards: collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def policy_weights(model: nn.Module, lora: bool, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's new weights, by state-dict name, in ``dtype``: every trained parameter (a tied
    embedding once), or with LoRA only the adapted projections, merged (``W + scaling * B @ A``, fp32
    arithmetic). Gathers FSDP shards one parameter at a time: every rank must consume the iterator
    whole, in the same order (collective)."""
    if not lora:
        for name, p in model.named_parameters():
            if p.requires_grad:
                yield name, _full(p).detach().to(dtype)
        return
    for name, module in lora_modules(model):
        a, b = _full(module.lora_A.weight).float(), _full(module.lora_B.weight).float()
        yield f"{name}.weight", (_full(module.weight).float() + (b @ a) * module.lora_scaling).to(dtype)


def sync_weights(llm: LLM, model: nn.Module, lora: bool, dtype: torch.dtype) -> None:
    """Load the trainer's weights into the engine in place (while it sleeps, so that what the engine
    derives from them is rebuilt once, when it wakes), reset its prefix cache, wake it (collective)."""
    llm.update_weights(policy_weights(model, lora, dtype))
    llm.reset_prefix_cache()
    llm.wake_up()
