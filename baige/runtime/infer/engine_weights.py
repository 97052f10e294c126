"""The engine's weights and KV memory between requests (:class:`EngineWeights`, a part of the one
:class:`~baige.runtime.infer.engine.Engine`): in-place weight updates, sleep / wake-up and the prefix-cache
reset that RL weight sync and the server's RL endpoints call (``weight_sync.py`` holds the copying)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from baige.errors import BaigeError
from baige.runtime.infer import weight_sync
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.runner import ModelRunner


class EngineWeights:
    """Weights and memory of :class:`~baige.runtime.infer.engine.Engine` (which provides ``model``,
    ``runner``, ``proposer``, ``lora``, ``kv_cache``, ``block_manager``, ``requests``, ``tp``,
    ``resolve_lora`` and ``has_unfinished``)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], lora_name: str | None = None) -> None:
        """Copy new weights into the model in place (RL weight sync; ``weight_sync.copy_weights``: names,
        layouts, DTensors), rebuild what is derived from them, and reset the prefix cache. Runs between
        steps, as every engine call does: sequences in flight take the new weights from their next step
        on (their K/V so far stays the old weights'); ``AsyncEngine.update_weights`` drains them first.
        Works while asleep. ``lora_name``: the pairs are that loaded adapter's lora_A/lora_B weights
        instead (``LoRAManager.update``). Raises BaigeError (as those; tensor parallelism; no LoRA)."""
        self._check_local("update_weights")
        if lora_name is not None:
            self.resolve_lora(LoRARequest(lora_name, 1, ""))  # raises without LoRA or for a name not loaded
            self.lora.update(lora_name, named_tensors)
        else:
            weight_sync.copy_weights(self.model, named_tensors)
            if not self.is_sleeping:
                self.runner.rebuild_native()
        self.reset_prefix_cache()

    def update_weights_from_disk(self, model_path: str) -> None:
        """:meth:`update_weights` with every tensor of a checkpoint of the same architecture (an HF
        directory or ``.gguf``; ``weight_sync.read_checkpoint``, which raises BaigeError)."""
        self._check_local("update_weights_from_disk")
        self.update_weights(weight_sync.read_checkpoint(model_path, self.model).items())

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (``BlockManager.reset_prefix_cache``): no later request reuses K/V
        computed so far; requests in flight keep theirs."""
        self.block_manager.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return not self.kv_cache.allocated

    def _runners(self) -> list[ModelRunner]:
        return [self.runner] + ([self.proposer.runner] if hasattr(self.proposer, "runner") else [])

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (vLLM's sleep level 1: the paged pools, a draft model's too) until
        :meth:`wake_up`; the weights stay, and :meth:`update_weights` works meanwhile. New requests are
        refused while asleep. A no-op when already asleep.

        Raises:
            BaigeError: ``level`` not 1 (level 2, which also discards the weights, is not supported),
            requests in flight (finish or abort them first), tensor parallelism, captured CUDA graphs.
        """
        if level != 1:
            raise BaigeError(
                f"sleep level {level} is not supported; level 1 releases the KV cache (the weights stay)",
                param="level",
            )
        self._check_local("sleep")
        if self.has_unfinished():
            raise BaigeError(f"sleep: {len(self.requests)} request(s) in flight; let them finish or abort them first")
        if not self.is_sleeping:
            self.block_manager.reset_prefix_cache()
            for runner in self._runners():
                runner.release_kv()

    def wake_up(self) -> None:
        """Allocate the KV cache again (empty) after :meth:`sleep`; a no-op when awake."""
        if self.is_sleeping:
            for runner in self._runners():
                runner.restore_kv()

    def _check_local(self, what: str) -> None:
        if self.tp is not None or self.kv_transfer is not None:  # pinned or pulled K/V would outlive the weights
            why = "tensor parallelism (--tensor-parallel-size > 1)" if self.tp is not None else "--kv-transfer-config"
            raise BaigeError(f"{what} is not supported under {why}")
