"""The engine's RL hooks over HTTP (``baige serve --enable-rl-endpoints``), under vLLM's and SGLang's
names so verl / OpenRLHF-style drivers can use ``baige serve`` as their rollout engine:

- ``POST /update_weights_from_disk`` ``{"model_path": DIR}``: new weights from a checkpoint of the same
  architecture, read off the engine's thread; requests in flight finish on the old weights first
  (requests that arrive meanwhile wait, then run on the new ones). 200 ``{"success": true, "message"}``
  (SGLang's answer).
- ``POST /sleep`` (``?level=1``): release the KV cache once the requests in flight have finished; new
  requests get a 400 until ``POST /wake_up``. ``GET /is_sleeping``: ``{"is_sleeping": bool}`` (vLLM's).
- ``POST /reset_prefix_cache``: forget the prefix cache.

Without the flag these paths do not exist (404). With ``--api-key`` they need it, as ``/v1/*`` does
(401 otherwise; the app's ``BearerAuth`` guards :data:`RL_PATHS`). Errors in OpenAI's shape: 400 for a bad
path, another architecture, a level other than 1; 503 once the engine loop has stopped.
"""

from __future__ import annotations

from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from baige.errors import BaigeError
from baige.runtime.infer.outputs import EngineDeadError
from baige.runtime.server.protocol import APIError
from baige.runtime.server.serving import engine_error, state_of, validated

router = APIRouter()
RL_PATHS = ("/update_weights_from_disk", "/sleep", "/wake_up", "/reset_prefix_cache", "/is_sleeping")


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model_path: str = Field(min_length=1)  # "" would name the working directory


async def _engine_call(call: Awaitable[None]) -> None:
    """Await an engine hook; its refusal is the caller's 400, a stopped engine a 503 (:func:`engine_error`)."""
    try:
        await call
    except (BaigeError, EngineDeadError) as e:
        raise engine_error(e) from None


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    req = await validated(request, UpdateWeightsFromDiskRequest)
    await _engine_call(state_of(request).engine.update_weights_from_disk(req.model_path))
    return JSONResponse({"success": True, "message": f"weights updated from {req.model_path}"})


@router.post("/sleep")
async def sleep(request: Request, level: str = "1") -> Response:
    if level not in ("1", "2"):
        raise APIError(f"level {level[:20]!r}: 1 or 2", param="level")
    await _engine_call(state_of(request).engine.sleep(int(level)))
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request) -> Response:
    await _engine_call(state_of(request).engine.wake_up())
    return Response(status_code=200)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    await _engine_call(state_of(request).engine.reset_prefix_cache())
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": state_of(request).engine.is_sleeping})
