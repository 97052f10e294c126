"""The LoRA hooks of :class:`~baige.runtime.infer.async_engine.AsyncEngine` (:class:`AsyncEngineLoRA`):
the adapters loaded, and loading or unloading one between two steps while requests go on (the server's
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` and the adapters ``/v1/models`` lists)."""

from __future__ import annotations

import asyncio

from baige.errors import BaigeError
from baige.runtime.infer.lora import LoRARequest


class AsyncEngineLoRA:
    """LoRA adapters of :class:`~baige.runtime.infer.async_engine.AsyncEngine` (which provides ``engine`` and
    ``call``)."""

    @property
    def lora_enabled(self) -> bool:
        """LoRA adapters can be served (``--enable-lora``)."""
        return self.engine.lora is not None

    def lora_adapters(self) -> dict[str, LoRARequest]:
        """The loaded LoRA adapters by name, in load order (empty without LoRA)."""
        lora = self.engine.lora
        return {} if lora is None else {name: a.request for name, a in list(lora.loaded.items())}

    async def load_lora_adapter(self, lora_request: LoRARequest) -> None:
        """Load a PEFT adapter directory: read and checked off the event loop and off the loop thread
        (disk, shapes), then put on the model between two steps, so requests in flight go on unharmed.

        Raises:
            BaigeError: LoRA is not enabled, or as :meth:`LoRAManager.read` (a bad, mismatched or too
            large adapter, an empty name, a name already loaded).
            EngineDeadError: the loop has stopped.
        """
        lora = self.engine.lora
        if lora is None:
            raise BaigeError("LoRA is not enabled (--enable-lora)")
        adapter = await asyncio.to_thread(lora.read, lora_request)
        await self.call(lambda engine: engine.lora.add(lora_request, adapter))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter between two steps (:meth:`Engine.unload_lora_adapter`).

        Raises:
            LoRANotFound: no adapter of that name is loaded.
            BaigeError: LoRA is not enabled, or requests in flight use the adapter (they finish).
            EngineDeadError: the loop has stopped.
        """
        await self.call(lambda engine: engine.unload_lora_adapter(lora_name))
