"""Routing the Responses API's stored responses (``/v1/responses/{id}`` and ``previous_response_id``).

A response is stored on the backend that made it, and the router keeps no request state, so it finds
that backend by asking:

- ``GET``/``DELETE /v1/responses/{id}`` tries the healthy backends in their configured order (the
  policy's rotation is neither used nor advanced) until one answers something other than 404 or a
  retryable failure; that answer is the client's, and 404 (``not_found_error``) when none has it.
- ``POST /v1/responses`` with ``previous_response_id`` first asks the healthy backends, in the same
  order, for that id with a ``GET`` and sends the request to the first that answers 200. When none
  has it, the request goes by policy and that backend's own 404 answers.

Any router over the same backends finds the same one. Under the ``pd`` policy these go to the decode
backends.
"""

from __future__ import annotations

import logging
from urllib.parse import quote

import httpx
from fastapi.responses import Response

from baige.runtime.router.backends import Backend
from baige.runtime.router.proxy import (
    BackendFailed,
    RequestTimedOut,
    RouterState,
    deadline_after,
    error_response,
    forward,
    timed_out,
    try_backend,
)

logger = logging.getLogger("baige.router")


async def holder(state: RouterState, role: str, response_id: str, headers: dict[str, str]) -> Backend | None:
    """The first healthy backend whose ``GET /v1/responses/{response_id}`` answers 200, else None.
    A backend that cannot be reached is marked down and skipped."""
    path = f"/v1/responses/{quote(response_id, safe='')}"
    for backend in state.pool.healthy(role):
        try:
            timeout = httpx.Timeout(state.config.request_timeout_secs, connect=state.config.connect_timeout)
            resp = await state.client.get(backend.url + path, headers=headers, timeout=timeout)
        except httpx.TransportError as e:
            state.pool.mark_down(backend, f"{type(e).__name__}: {e}")
            continue
        if resp.status_code == 200:
            return backend
    return None


async def forward_stored(
    state: RouterState, role: str, method: str, response_id: str, headers: dict[str, str]
) -> Response:
    """``method`` (GET or DELETE) of a stored response: the first backend's answer that is not 404 (or
    a retryable failure); 404 in OpenAI's shape when no healthy backend has it."""
    path = f"/v1/responses/{quote(response_id, safe='')}"
    tried, deadline = 0, deadline_after(state)
    for backend in state.pool.healthy(role):
        tried += 1
        try:
            resp = await try_backend(state, backend, method, path, b"", headers, deadline)
        except RequestTimedOut:
            return timed_out(state, backend, f"{method} {path}")
        except BackendFailed as e:
            if e.transport:
                state.pool.mark_down(backend, e.why)
            continue
        if resp.status_code != 404:
            return resp
    if not tried:
        return error_response("no healthy backend can take the request", 503, "no_healthy_backend")
    return error_response(f"no response with id {response_id[:200]!r}", 404, "response_not_found")


async def forward_response(
    state: RouterState, role: str, body: object, content: bytes, headers: dict[str, str], key: bytes
) -> Response:
    """``POST /v1/responses``: to the backend holding ``previous_response_id`` when the body names one
    (should that backend fail before answering, by policy: the one it goes to answers that it lacks
    the previous response), else by policy."""
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    deadline = deadline_after(state)
    if isinstance(previous, str) and previous:
        owner = await holder(state, role, previous, headers)
        if owner is not None:
            try:
                return await try_backend(state, owner, "POST", "/v1/responses", content, headers, deadline)
            except RequestTimedOut:
                return timed_out(state, owner, "POST /v1/responses")
            except BackendFailed as e:
                logger.warning("POST /v1/responses at %s (holding %s) failed: %s", owner.url, previous, e.why)
                if e.transport:
                    state.pool.mark_down(owner, e.why)
    return await forward(state, role, "POST", "/v1/responses", content, headers, key, deadline)
