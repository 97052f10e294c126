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

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.infer.llm import LLM
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import available_memory
from baige.runtime.model.lora import lora_modules
from baige.runtime.train.config import LoRASection
from baige.runtime.train.rl.config import RLSection
from baige.runtime.weights.peft import adapter_config, save_peft_adapter

MAX_NUM_SEQS = 256  # most sequences the engine runs at once (vLLM's default max_num_seqs)
BLOCK_SIZE = 16
ADAPTER = "policy"  # the engine's name for a LoRA run's adapter
POLICY_ADAPTER = LoRARequest(ADAPTER, 1, "")  # every rollout of a LoRA run: the loaded adapter, by name


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
    adapter: Path | None = None,
    max_lora_rank: int = 1,
) -> LLM:
    """This rank's engine for ``num_prompts`` prompts of at most ``max_prompt_len`` tokens per step:
    ``max_model_len`` = that + ``rl.max_tokens``, a KV cache that holds every sequence of a step whole.
    ``adapter``: a LoRA run's initial adapter (:func:`write_adapter`), served as :data:`ADAPTER`. The caller
    has checked that every prompt plus ``rl.max_tokens`` fits the model's context (GRPOTrainer._build_data,
    which names the prompt's line).

    Raises:
        BaigeError: that KV cache exceeds the memory free on ``device`` (named in rl.* terms, not the
        engine's flags).
    """
    max_model_len = max_prompt_len + rl.max_tokens
    num_seqs = min(MAX_NUM_SEQS, num_prompts * rl.group_size)
    blocks = num_seqs * -(-max_model_len // BLOCK_SIZE)
    kv_bytes = blocks * BLOCK_SIZE * mc.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    if kv_bytes > (free := available_memory(device)):
        raise BaigeError(
            f"the rollout's KV cache ({num_seqs} sequences of up to {max_prompt_len} prompt + {rl.max_tokens} "
            f"rl.max_tokens tokens) needs {kv_bytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on "
            f"{device.type}; lower rl.max_tokens, rl.group_size or rl.prompts_per_step"
        )
    extra = {"batch_invariant": True} if rl.batch_invariant else {}
    if adapter is not None:
        extra.update(enable_lora=True, max_lora_rank=max_lora_rank, lora_modules={ADAPTER: str(adapter)})
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


def generate(
    llm: LLM, prompt_ids: list[list[int]], seeds: list[int], rl: RLSection, lora: bool = False
) -> list[Sample]:
    """``rl.group_size`` samples of each prompt (one request with ``n`` = G and its own seed), with the
    engine's logprob of every sampled token; groups in prompt order. ``lora``: through :data:`ADAPTER`."""
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
    outs = llm.generate(prompt_ids, params, lora_request=POLICY_ADAPTER if lora else None)
    for group, (ids, out) in enumerate(zip(prompt_ids, outs)):
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
def policy_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's new weights, by state-dict name, in ``dtype``: every trained parameter (a tied
    embedding once). Gathers FSDP shards one parameter at a time: every rank must consume the iterator
    whole, in the same order (collective)."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield name, _full(p).detach().to(dtype)


@torch.no_grad()
def adapter_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA run's adapters, fp32, by their training names (``<module>.lora_A.weight`` (r, in),
    ``<module>.lora_B.weight`` (out, r)), gathered as :func:`policy_weights` (collective)."""
    for name, module in lora_modules(model):
        yield f"{name}.lora_A.weight", _full(module.lora_A.weight).detach().float()
        yield f"{name}.lora_B.weight", _full(module.lora_B.weight).detach().float()


def write_adapter(model: nn.Module, cfg: LoRASection) -> Path:
    """The adapters as a PEFT directory in a new temporary directory of this rank, for the engine to
    load at start (collective: gathers them). The caller removes it (:func:`remove_adapter`)."""
    weights: dict[str, list[torch.Tensor]] = {}
    for key, t in adapter_weights(model):
        module, _, which = key.rpartition(".lora_")
        weights.setdefault(module, []).append(t.cpu())
    config = adapter_config(cfg.rank, cfg.alpha, cfg.dropout, cfg.targets, cfg.use_rslora, None)
    out = Path(tempfile.mkdtemp(prefix="baige-grpo-adapter-")) / ADAPTER
    return save_peft_adapter({m: (a, b) for m, (a, b) in weights.items()}, config, out, torch.float32)


def remove_adapter(path: Path) -> None:
    shutil.rmtree(path.parent, ignore_errors=True)


def sync_weights(llm: LLM, model: nn.Module, lora: bool, dtype: torch.dtype) -> None:
    """Load the trainer's weights into the engine in place (while it sleeps, so that what the engine
    derives from them is rebuilt once, when it wakes), reset its prefix cache, wake it (collective).
    A LoRA run sends only its adapters (:data:`ADAPTER`'s lora_A / lora_B); the base never changes."""
    if lora:
        llm.update_weights(adapter_weights(model), lora_name=ADAPTER)
    else:
        llm.update_weights(policy_weights(model, dtype))
    llm.reset_prefix_cache()
    llm.wake_up()
