"""vLLM's runtime LoRA endpoints (``baige serve --enable-lora``): ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

An adapter is read and checked off the event loop and off the engine thread (disk, shapes), then
put on the model between two engine steps (:meth:`AsyncEngine.call`), so requests in flight go on
unharmed. Unloading an adapter that requests in flight still use is refused (400); they finish.
Answers: 200 with a one-line text (vLLM's), 400 for a bad or mismatched adapter, a name already
loaded or in use, 404 for unloading a name not loaded; errors in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import itertools

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from baige.errors import BaigeError
from baige.runtime.infer.lora import LoRANotFound, LoRARequest
from baige.runtime.server.protocol import APIError, parse_body, validation_message
from baige.runtime.server.routes import state_of

_ids = itertools.count(1)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; ignored


async def _body(request: Request, schema: type[BaseModel]) -> BaseModel:
    try:
        return schema.model_validate(parse_body(await request.body()))
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(msg, param=param) from None


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    """Load a PEFT adapter directory under ``lora_name``. Raises APIError 400 (see module docstring)."""
    st = state_of(request)
    req = await _body(request, LoadLoRAAdapterRequest)
    lora = st.engine.engine.lora
    lora_request = LoRARequest(req.lora_name, next(_ids), req.lora_path)
    try:
        adapter = await asyncio.to_thread(lora.read, lora_request)
        await st.engine.call(lambda engine: engine.lora.add(lora_request, adapter))
    except BaigeError as e:
        raise APIError(str(e), 400, param=e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    """Unload ``lora_name``. Raises APIError 404 (not loaded) or 400 (requests in flight use it)."""
    st = state_of(request)
    req = await _body(request, UnloadLoRAAdapterRequest)
    try:
        await st.engine.call(lambda engine: engine.unload_lora_adapter(req.lora_name))
    except LoRANotFound as e:
        raise APIError(str(e), 404, param="lora_name", code="model_not_found") from None
    except BaigeError as e:
        raise APIError(str(e), 400, param=e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
