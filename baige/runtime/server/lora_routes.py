"""vLLM's runtime LoRA endpoints (``baige serve --enable-lora``): ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

An adapter is read and checked off the event loop and off the engine thread (disk, shapes), then
put on the model between two engine steps (:meth:`AsyncEngine.load_lora_adapter`), so requests in
flight go on unharmed. Unloading an adapter that requests in flight still use is refused (400); they
finish. Answers: 200 with a one-line text (vLLM's), 400 for a bad or mismatched adapter, the base
model's name, a name already loaded or in use, 404 for unloading a name not loaded; errors in OpenAI's shape.
"""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from baige.errors import BaigeError
from baige.runtime.infer.lora import LoRANotFound, LoRARequest
from baige.runtime.server.protocol import APIError
from baige.runtime.server.serving import state_of, validated

router = APIRouter()
_ids = itertools.count(1)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; ignored


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    """Load a PEFT adapter directory under ``lora_name``. Raises APIError 400 (see module docstring)."""
    st = state_of(request)
    req = await validated(request, LoadLoRAAdapterRequest)
    if req.lora_name == st.served_model_name:  # a request naming it gets the base model
        raise APIError(
            f"lora_name {req.lora_name!r}: an adapter needs a non-empty name other than the base model's",
            param="lora_name",
        )
    try:
        await st.engine.load_lora_adapter(LoRARequest(req.lora_name, next(_ids), req.lora_path))
    except BaigeError as e:
        raise APIError(str(e), 400, param=e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    """Unload ``lora_name``. Raises APIError 404 (not loaded) or 400 (requests in flight use it)."""
    st = state_of(request)
    req = await validated(request, UnloadLoRAAdapterRequest)
    try:
        await st.engine.unload_lora_adapter(req.lora_name)
    except LoRANotFound as e:
        raise APIError(str(e), 404, param="lora_name", code="model_not_found") from None
    except BaigeError as e:
        raise APIError(str(e), 400, param=e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
