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
(401 otherwise). Errors in OpenAI's shape: 400 for a bad path, another architecture, a level other than 1.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from baige.errors import BaigeError
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.outputs import EngineDeadError
from baige.runtime.server.protocol import APIError, parse_body, validation_message


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model_path: str


async def _engine_call(call: Awaitable[None]) -> None:
    """Await an engine hook; its BaigeError is the caller's 400, a stopped engine a 503."""
    try:
        await call
    except BaigeError as e:
        raise APIError(str(e), 400, param=e.param) from None
    except EngineDeadError as e:
        raise APIError(str(e), 503, code="engine_dead") from None


def _api_key_check(api_key: str) -> Callable[[Request], None]:
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        given = request.headers.getlist("authorization")
        # exactly one header, compared in constant time (as app.BearerAuth does for /v1/*)
        if len(given) != 1 or not hmac.compare_digest(given[0].encode(), expected):
            raise APIError(
                "invalid or missing API key (send 'Authorization: Bearer <key>')", 401, code="invalid_api_key"
            )

    return check


def add_rl_routes(app: FastAPI, engine: AsyncEngine, api_key: str | None = None) -> None:
    """Add the endpoints (module docstring) serving ``engine`` to ``app``; with ``api_key`` each needs
    ``Authorization: Bearer <api_key>``."""

    async def update_weights_from_disk(request: Request) -> JSONResponse:
        try:
            req = UpdateWeightsFromDiskRequest.model_validate(parse_body(await request.body()))
        except ValidationError as e:
            msg, param = validation_message(e)
            raise APIError(msg, param=param) from None
        await _engine_call(engine.update_weights_from_disk(req.model_path))
        return JSONResponse({"success": True, "message": f"weights updated from {req.model_path}"})

    async def sleep(level: str = "1") -> Response:
        if level not in ("1", "2"):
            raise APIError(f"level {level[:20]!r}: 1 or 2", param="level")
        await _engine_call(engine.sleep(int(level)))
        return Response(status_code=200)

    async def wake_up() -> Response:
        await _engine_call(engine.wake_up())
        return Response(status_code=200)

    async def reset_prefix_cache() -> Response:
        await _engine_call(engine.reset_prefix_cache())
        return Response(status_code=200)

    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.is_sleeping})

    deps = [Depends(_api_key_check(api_key))] if api_key else None
    for path, endpoint, method in (
        ("/update_weights_from_disk", update_weights_from_disk, "POST"),
        ("/sleep", sleep, "POST"),
        ("/wake_up", wake_up, "POST"),
        ("/reset_prefix_cache", reset_prefix_cache, "POST"),
        ("/is_sleeping", is_sleeping, "GET"),
    ):
        app.add_api_route(path, endpoint, methods=[method], dependencies=deps)
