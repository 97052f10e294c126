"""Forwarding one request: pick backends by policy, try them in order until one takes it, and pass
its answer through.

- A try *fails over* to the next backend when nothing has been sent to the client yet: the
  connection cannot be made or breaks, the backend answers 502/503/504, or a stream ends or breaks
  before its first event. A transport failure also marks the backend down (:mod:`.backends`).
- Any other answer (200, a 4xx the backend chose, a 500) is the client's answer, passed through.
- A stream (``text/event-stream``) is relayed event by event as the backend sends it, never
  gathered: a complete server-sent event (up to its blank line) is sent on at once, and a partial
  one waits for its end. If the backend fails after the first event, the client gets an error event
  (OpenAI's error body, code ``backend_failed``) and ``data: [DONE]`` instead of a cut connection,
  and the backend is marked down.
- When no backend is healthy, or every one failed, the answer is 503 in OpenAI's error shape.
- Every client request has a deadline, ``--request-timeout-secs`` after it arrived (SGLang's router
  flag; a pd request's two phases share one): a backend that has not answered by then (a hung engine
  whose connection stays open) gets the client a 504 ``request_timeout``; a stream that has not ended by
  then gets an error event (code ``request_timeout``) and ``[DONE]``. Either way the router closes the
  backend's connection (the backend aborts the request) and does not mark it down: a slow request is
  not a dead backend, and the health checks judge the rest.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from baige.runtime.config import RouterConfig
from baige.runtime.router.backends import Backend, BackendPool
from baige.runtime.router.metrics import RouterMetrics

logger = logging.getLogger("baige.router")

RETRY_STATUSES = frozenset({502, 503, 504})  # a backend that cannot take the request now: try the next
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
PASSED_BACK_HEADERS = ("content-type", "x-request-id")
DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "server_error",
    504: "server_error",
}


def error_body(message: str, status: int, code: str | None = None) -> dict:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(status, "service_unavailable" if status == 503 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(message: str, status: int, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code), status_code=status)


def sse_event(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class RequestTimedOut(Exception):
    """The client's deadline passed before the backend answered (its connection is closed)."""


def deadline_after(state: "RouterState") -> float:
    """A request's deadline on anyio's clock: ``--request-timeout-secs`` from now."""
    return anyio.current_time() + state.config.request_timeout_secs


def _left(deadline: float) -> float:
    return max(deadline - anyio.current_time(), 0.0)


def timed_out(state: "RouterState", backend: Backend, what: str) -> JSONResponse:
    """The 504 ``request_timeout`` (OpenAI's error shape) of a request whose deadline passed at ``backend``."""
    timeout = state.config.request_timeout_secs
    logger.warning("%s at %s passed --request-timeout-secs (%g s)", what, backend.url, timeout)
    message = f"the request passed --request-timeout-secs ({timeout:g} s) waiting for {backend.url}"
    return error_response(message, 504, "request_timeout")


class BackendFailed(Exception):
    """A try that failed before anything reached the client; ``transport``: the connection failed
    (the backend is marked down), else the backend answered a retryable status."""

    def __init__(self, why: str, transport: bool):
        super().__init__(why)
        self.why, self.transport = why, transport


@dataclass
class RouterState:
    """What every route shares: the configuration, the backends, one policy per role, the metrics
    and the HTTP client (one connection pool to the backends)."""

    config: RouterConfig
    pool: BackendPool
    policies: dict[str, Any]
    metrics: RouterMetrics
    client: httpx.AsyncClient | None = None

    def order(self, role: str, key: bytes) -> list[Backend]:
        """The healthy backends of ``role`` in the order to try them for a request of ``key``."""
        healthy = self.pool.healthy(role)
        urls = [b.url for b in healthy]
        loads = {b.url: b.load for b in healthy}
        by_url = {b.url: b for b in healthy}
        return [by_url[u] for u in self.policies[role].order(urls, loads, key)]


def forwarded_headers(headers: Any) -> dict[str, str]:
    """The request headers a backend gets: auth, content type, accept and the request id (one is
    made when the client sent none, so a pd request carries the same id to both backends)."""
    out = {k: headers[k] for k in FORWARDED_HEADERS if k in headers}
    out.setdefault("x-request-id", uuid.uuid4().hex)
    return out


async def sse_events(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The body of ``resp`` cut at server-sent-event boundaries (a blank line, ``\\n\\n`` or
    ``\\r\\n\\r\\n``): each complete event as soon as its end arrives; a trailing partial one when the
    body ends."""
    buf = b""
    async for chunk in resp.aiter_raw():
        buf += chunk
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if cut:
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


async def _close(resp: httpx.Response) -> None:
    with anyio.CancelScope(shield=True):  # runs even while the client's disconnect cancels the stream
        await resp.aclose()


async def relay(
    state: RouterState,
    backend: Backend,
    resp: httpx.Response,
    events: AsyncIterator[bytes],
    first: bytes,
    deadline: float,
) -> AsyncIterator[bytes]:
    """Pass a started stream on; a backend failure, or the deadline passing, becomes an error event and
    ``[DONE]``."""
    try:
        if first:
            yield first
        try:
            while True:
                event = None
                with anyio.move_on_after(_left(deadline)):
                    event = await anext(events, b"")
                if event is None:  # the deadline passed while the backend was silent
                    state.metrics.timeouts.labels(backend.url, backend.role).inc()
                    timeout = state.config.request_timeout_secs
                    message = f"the request passed --request-timeout-secs ({timeout:g} s) at {backend.url}"
                    yield sse_event(error_body(message + "; the response is incomplete", 504, "request_timeout"))
                    yield DONE
                    return
                if not event:
                    break
                yield event
        except httpx.TransportError as e:
            why = f"{type(e).__name__}: {e}"
            state.pool.mark_down(backend, f"a stream broke ({why})")
            state.metrics.stream_errors.labels(backend.url, backend.role).inc()
            message = f"backend {backend.url} failed mid-stream ({why}); the response is incomplete"
            yield sse_event(error_body(message, 502, "backend_failed"))
            yield DONE
        else:
            state.metrics.requests.labels(backend.url, backend.role, str(resp.status_code)).inc()
    finally:
        backend.in_flight -= 1
        await _close(resp)


async def try_backend(
    state: RouterState,
    backend: Backend,
    method: str,
    path: str,
    content: bytes,
    headers: dict[str, str],
    deadline: float,
) -> Response:
    """One try at ``backend``: its answer as the client's response (a stream once its first event is
    in). Raises BackendFailed when the client should be given another backend's answer instead, and
    RequestTimedOut when ``deadline`` (anyio's clock) passes before the answer or first event."""
    request = state.client.build_request(method, backend.url + path, content=content or None, headers=headers)
    backend.in_flight += 1
    handed_off = False
    resp = None
    try:
        with anyio.fail_after(_left(deadline)):
            try:
                resp = await state.client.send(request, stream=True)
            except httpx.TransportError as e:
                raise BackendFailed(f"{type(e).__name__}: {e}", transport=True) from None
            if resp.status_code in RETRY_STATUSES:
                raise BackendFailed(f"it answered {resp.status_code}", transport=False)
            passed = {k: resp.headers[k] for k in PASSED_BACK_HEADERS if k in resp.headers}
            if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                try:
                    body = await resp.aread()
                except httpx.TransportError as e:
                    raise BackendFailed(f"{type(e).__name__}: {e}", transport=True) from None
                state.metrics.requests.labels(backend.url, backend.role, str(resp.status_code)).inc()
                return Response(body, status_code=resp.status_code, headers=passed)
            events = sse_events(resp)
            try:
                first = await anext(events)
            except (StopAsyncIteration, httpx.TransportError) as e:
                raise BackendFailed(
                    f"its stream ended before the first event ({type(e).__name__})", transport=True
                ) from None
        handed_off = True
        return StreamingResponse(
            relay(state, backend, resp, events, first, deadline), status_code=resp.status_code, headers=passed
        )
    except TimeoutError:
        state.metrics.timeouts.labels(backend.url, backend.role).inc()
        raise RequestTimedOut() from None
    finally:
        if not handed_off:
            backend.in_flight -= 1
            if resp is not None:
                await _close(resp)


async def forward(
    state: RouterState,
    role: str,
    method: str,
    path: str,
    content: bytes,
    headers: dict[str, str],
    key: bytes,
    deadline: float | None = None,
) -> Response:
    """Send a request to the backends of ``role`` in policy order until one takes it; 503 (OpenAI's
    error shape) when none is healthy or every one failed before answering, 504 when ``deadline``
    (anyio's clock; None: :func:`deadline_after` now) passes first."""
    deadline = deadline_after(state) if deadline is None else deadline
    last = None
    for backend in state.order(role, key):
        try:
            return await try_backend(state, backend, method, path, content, headers, deadline)
        except RequestTimedOut:
            return timed_out(state, backend, f"{method} {path}")
        except BackendFailed as e:
            logger.warning("%s %s at %s failed, trying the next backend: %s", method, path, backend.url, e.why)
            state.metrics.retries.labels(backend.url, backend.role).inc()
            if e.transport:
                state.pool.mark_down(backend, e.why)
            last = f"{backend.url}: {e.why}"
    state.metrics.no_backend.inc()
    what = "backend" if role == "backend" else f"{role} backend"
    detail = f"; the last one tried, {last}" if last else ""
    return error_response(f"no healthy {what} can take the request{detail}", 503, "no_healthy_backend")
