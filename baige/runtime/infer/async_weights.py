"""The RL hooks of :class:`~baige.runtime.infer.async_engine.AsyncEngine` (:class:`AsyncEngineWeights`):
weight updates, sleep / wake-up and the prefix-cache reset, run on the engine's thread between steps (the
server's ``/update_weights_from_disk``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from baige.runtime.infer import weight_sync


class AsyncEngineWeights:
    """Weights and memory of :class:`~baige.runtime.infer.async_engine.AsyncEngine` (which provides
    ``engine`` and ``call``)."""

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], lora_name: str | None = None
    ) -> None:
        """:meth:`Engine.update_weights` once the requests in flight have finished with the old weights
        (requests that arrive meanwhile wait and run with the new ones). Raises BaigeError."""
        pairs = list(named_tensors)
        await self.call(lambda engine: engine.update_weights(pairs, lora_name), drain=True)

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Read the checkpoint at ``model_path`` off the engine's thread (the engine keeps serving), then
        :meth:`update_weights` with it. Raises BaigeError (``weight_sync.read_checkpoint``)."""
        state = await asyncio.to_thread(weight_sync.read_checkpoint, model_path, self.engine.model)
        await self.update_weights(state.items())

    async def sleep(self, level: int = 1) -> None:
        """:meth:`Engine.sleep` once the requests in flight have finished; requests are then refused
        (BaigeError) until :meth:`wake_up`. Raises BaigeError as :meth:`Engine.sleep`."""
        await self.call(lambda engine: engine.sleep(level), drain=True)

    async def wake_up(self) -> None:
        """:meth:`Engine.wake_up`, after any sleep still waiting for requests in flight (calls keep their order)."""
        await self.call(lambda engine: engine.wake_up(), ordered=True)

    async def reset_prefix_cache(self) -> None:
        """:meth:`Engine.reset_prefix_cache` between two steps (requests in flight go on)."""
        await self.call(lambda engine: engine.reset_prefix_cache())
