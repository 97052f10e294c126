"""Helpers for the GRPO tests: prompt files, a reward a random tiny model can learn, and the stand-ins
for the engine hooks and batch-invariant logprobs that other branches add (installed only while
those are missing: ``LLM.update_weights`` / ``sleep`` / ``wake_up`` / ``reset_prefix_cache``, and
``baige.runtime.model.logprobs.sequence_logprobs``)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch

TARGET = "e"  # the character the target_token reward pays for


def target_token_reward(prompts, completions, completion_ids=None, **fields) -> list[float]:
    """Fraction of the reply's characters that are ``TARGET`` (0 for an empty reply)."""
    return [c.count(TARGET) / max(1, len(c)) for c in completions]


def raising_reward(prompts, completions, **fields) -> list[float]:
    raise ValueError("the grader\nis down")


def short_reward(prompts, completions, **fields) -> list[float]:
    return [1.0] * (len(completions) - 1)


def write_prompts(path: Path, n: int = 8, **fields) -> Path:
    """``n`` prompt records (alternately a plain prompt and a chat conversation) with ``fields``."""
    with open(path, "w") as f:
        for i in range(n):
            text = f"say something {i}"
            record = {"prompt": text} if i % 2 == 0 else {"messages": [{"role": "user", "content": text}]}
            f.write(json.dumps({**record, **fields}) + "\n")
    return path


def install_shims() -> None:
    """The engine hooks (branch rlengine) and sequence_logprobs (branch batchinv), where still missing."""
    from baige.runtime.infer.llm import LLM

    if not hasattr(LLM, "update_weights"):
        LLM.update_weights = _update_weights
        LLM.sleep = lambda self, level=1: None
        LLM.wake_up = lambda self: None
        LLM.reset_prefix_cache = _reset_prefix_cache
    try:
        import baige.runtime.model.logprobs  # noqa: F401
    except ImportError:
        module = types.ModuleType("baige.runtime.model.logprobs")
        module.sequence_logprobs = _sequence_logprobs
        sys.modules[module.__name__] = module


@torch.no_grad()
def _update_weights(self, named_tensors) -> None:
    params = dict(self.engine.model.named_parameters())
    for name, tensor in named_tensors:
        params[name].copy_(tensor)


def _reset_prefix_cache(self) -> None:
    bm = self.engine.block_manager
    for block_id in list(bm._evictable):
        block = bm.blocks[block_id]
        block.hash, block.token_ids = None, ()
        bm._free.append(block_id)
    bm._evictable.clear()
    bm._cached.clear()


def _sequence_logprobs(model, input_ids: torch.Tensor, *, batch_invariant: bool) -> torch.Tensor:
    ids = input_ids[None]  # (1, T)
    hidden = model(ids, torch.arange(ids.shape[1], device=ids.device)[None])[0, :-1]  # (T - 1, hidden)
    logp = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    return logp.gather(1, input_ids[1:, None])[:, 0]
