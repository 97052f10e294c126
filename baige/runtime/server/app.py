"""The FastAPI application: the route modules' routers (``*_routes``, over the shared plumbing of
:mod:`.serving`; tool calling in :mod:`.tools`), error handlers in
OpenAI's shape (:mod:`.protocol`) for every status (400, 401, 404, 405, 408, 413, 422, 500, 503), a
request-size limit and read deadlines, bearer-token auth, metrics (:mod:`.metrics`), and :func:`run_server`
(uvicorn, drained on SIGTERM / SIGINT: :mod:`.lifecycle`).

Every user error is a 4xx with OpenAI's error body; the engine keeps serving. If the engine loop
stops, /health answers 503 and the server exits non-zero a moment later (a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from baige.errors import BaigeError
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.lora import LoRANotFound
from baige.runtime.server import (
    chat_routes,
    completion_routes,
    embedding_routes,
    lora_routes,
    responses_routes,
    rl_routes,
    routes,
    tokenize_routes,
)
from baige.runtime.server.lifecycle import ABORT_GRACE_S, DEFAULT_SHUTDOWN_TIMEOUT_S, DrainGate, GracefulServer
from baige.runtime.server.metrics import Metrics
from baige.runtime.server.protocol import APIError, error_response
from baige.runtime.server.reasoning import reasoning_config
from baige.runtime.server.serving import DEFAULT_MAX_N, ServerState
from baige.runtime.server.tools import tool_config

logger = logging.getLogger("baige.server")

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # `baige serve --max-request-bytes`
DEAD_EXIT_DELAY_S = 2.0  # /health answers 503 this long before the process exits

# The routers every server includes; lora_routes joins them with --enable-lora (build_app).
ROUTERS = (
    routes.router,
    completion_routes.router,
    chat_routes.router,
    responses_routes.router,
    embedding_routes.router,
    tokenize_routes.router,
)

READ_TIMEOUT_S = 30.0  # `baige serve --read-timeout`: longest wait for a request's headers (then the
# connection is closed) and for each next piece of its body (then 408)


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class BodyLimit:
    """Pure ASGI middleware: a request body over ``max_bytes`` gets 413 before it is read whole
    (a ``Content-Length`` over the limit at once, a chunked body as soon as it passes it), and a
    body whose next piece takes longer than ``timeout`` seconds gets 408 (a client that stalls, or
    sends less than its ``Content-Length``, holds its connection no longer than that)."""

    def __init__(self, app, max_bytes: int, timeout: float = READ_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(scope, receive, send)
        seen, done = 0, False

        async def limited():
            nonlocal seen, done
            if done:  # the body is in: later calls wait for the client's disconnect, unbounded
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                raise BodyTimeout() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
                done = not message.get("more_body", False)
            return message

        return await self.app(scope, limited, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(
            f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)",
            413,
            code="request_too_large",
        )
        await response(scope, receive, send)


class BearerAuth:
    """Pure ASGI middleware: /v1/* and the ``guarded`` paths need ``Authorization: Bearer <api_key>``
    (401 otherwise), compared in constant time. Not a BaseHTTPMiddleware: that wrapper hides client
    disconnects."""

    def __init__(self, app, api_key: str, guarded: tuple[str, ...] = ()):
        self.app, self.expected, self.guarded = app, f"Bearer {api_key}".encode(), frozenset(guarded)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in self.guarded):
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            # exactly one header: with two, proxies and frameworks disagree on which one counts
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                response = error_response(
                    "invalid or missing API key (send 'Authorization: Bearer <key>')", 401, code="invalid_api_key"
                )
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _api_error(_: Request, e: APIError):
    return error_response(e.message, e.status, e.param, e.code)


async def _baige_error(_: Request, e: BaigeError):
    return error_response(str(e), 400)


async def _lora_not_found(_: Request, e: LoRANotFound):
    return error_response(str(e), 404, param=e.param, code="model_not_found")


async def _too_large(request: Request, e: BodyTooLarge):
    return error_response(
        f"the request body is larger than {request.app.state.baige_max_bytes} bytes (--max-request-bytes)",
        413,
        code="request_too_large",
    )


async def _body_timeout(request: Request, e: BodyTimeout):
    return error_response(
        f"the request body stalled: no data for {request.app.state.baige_read_timeout:g} s (--read-timeout)",
        408,
        code="request_timeout",
    )


async def _client_left(request: Request, e: ClientDisconnect):
    logger.info("%s %s: the client left before its request body was read", request.method, request.url.path)
    return Response(status_code=499)  # nobody reads it (nginx's code for a client that closed the request)


async def _http_error(request: Request, e: HTTPException):
    if e.status_code == 404:
        return error_response(f"not found: {request.url.path[:200]}", 404)
    if e.status_code == 405:
        return error_response(f"method {request.method} not allowed on {request.url.path[:200]}", 405)
    return error_response(str(e.detail)[:300], e.status_code)


async def _validation_error(_: Request, e: RequestValidationError):
    return error_response(f"invalid request: {str(e.errors()[:1])[:300]}", 422)


async def _internal_error(request: Request, e: Exception):
    logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return error_response(f"internal error ({type(e).__name__}); the server keeps running", 500, code="internal_error")


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_n: int = DEFAULT_MAX_N,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str = "auto",
    exclude_tools_when_tool_choice_none: bool = False,
    enable_auto_tool_choice: bool = True,
    read_timeout: float = READ_TIMEOUT_S,
    enable_rl_endpoints: bool = False,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` under the model name ``served_model_name``.

    ``max_n``: most sequences one request may ask for; ``max_request_bytes``: largest request body;
    ``read_timeout``: seconds each piece of a body may take (408 after it);
    ``tool_call_parser`` and the two tool flags: :mod:`.tools` (``baige serve --tool-call-parser`` ...);
    ``enable_rl_endpoints``: the RL hooks (:mod:`.rl_routes`, ``baige serve --enable-rl-endpoints``);
    ``reasoning_parser``: :mod:`.reasoning` (``baige serve --reasoning-parser``; None: off).

    Raises:
        BaigeError: a reasoning parser whose markers are not single tokens of the vocabulary.
    """
    app = FastAPI(title="baige", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(engine, served_model_name)
    engine.set_on_output(metrics.on_output)
    tools = tool_config(
        engine.tokenizer, tool_call_parser, exclude_tools_when_tool_choice_none, enable_auto_tool_choice
    )
    reasoning = reasoning_config(engine.tokenizer, reasoning_parser)
    app.state.baige = ServerState(engine, served_model_name, metrics, int(time.time()), max_n, tools, reasoning)
    app.state.baige_max_bytes, app.state.baige_read_timeout = max_request_bytes, read_timeout
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, guarded=rl_routes.RL_PATHS if enable_rl_endpoints else ())
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, timeout=read_timeout)  # before auth reads anything
    app.add_middleware(DrainGate, lifecycle=app.state.baige.lifecycle)  # outermost: counts every request in flight
    for exc, handler in (
        (APIError, _api_error),
        (BaigeError, _baige_error),
        (LoRANotFound, _lora_not_found),
        (BodyTooLarge, _too_large),
        (BodyTimeout, _body_timeout),
        (ClientDisconnect, _client_left),
        (HTTPException, _http_error),
        (RequestValidationError, _validation_error),
        (Exception, _internal_error),
    ):
        app.add_exception_handler(exc, handler)
    for router in ROUTERS:
        app.include_router(router)
    if engine.lora_enabled:  # --enable-lora: vLLM's runtime adapter endpoints
        app.include_router(lora_routes.router)
    if enable_rl_endpoints:  # --enable-rl-endpoints: the RL drivers' hooks (vLLM's / SGLang's names)
        app.include_router(rl_routes.router)
    return app


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers: a connection that has not sent
    a complete request head ``head_timeout`` seconds after it opened or after its last response is
    closed (uvicorn itself times out idle keep-alive connections only after a response, and never a
    head that trickles in), so idle or slow-header clients cannot pile up open sockets."""

    head_timeout = READ_TIMEOUT_S  # run_server sets its --read-timeout on a subclass

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        old = getattr(self, "_head_task", None)
        if old is not None:
            old.cancel()
        self._head_task = self.loop.call_later(self.head_timeout, self._head_expired)

    def _head_expired(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # no request in progress
        if waiting and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._head_task.cancel()
        super().connection_lost(exc)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (IPv4 or IPv6, as ``host`` resolves).

    Raises:
        BaigeError: the host does not resolve or the address cannot be bound (in use, not local).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise BaigeError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def run_server(
    engine: AsyncEngine,
    served_model_name: str,
    sock: socket.socket,
    api_key: str | None = None,
    log_level: str = "info",
    max_n: int = DEFAULT_MAX_N,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    read_timeout: float = READ_TIMEOUT_S,
    enable_rl_endpoints: bool = False,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    **tool_options,
) -> None:
    """Serve ``engine`` with uvicorn on the listening socket ``sock`` (:func:`listen`) until a stop
    signal has drained it (:mod:`.lifecycle`; ``shutdown_timeout``: ``baige serve --shutdown-timeout``,
    seconds the requests in flight may take); the engine is shut down on the way out (its loop thread
    stopped, its tensor-parallel workers told to exit). ``tool_options``: :func:`build_app`'s
    ``tool_call_parser``, ``exclude_tools_when_tool_choice_none``, ``enable_auto_tool_choice``,
    ``reasoning_parser``;
    ``read_timeout``: ``baige serve --read-timeout`` (:class:`BodyLimit`, :class:`HeadDeadline`);
    ``enable_rl_endpoints``: :func:`build_app`'s. Returns normally after a drained shutdown.

    Raises:
        BaigeError: the engine loop stopped while serving (after /health has answered 503 for
        DEAD_EXIT_DELAY_S seconds and the server has shut down), so the CLI exits non-zero.
    """
    import uvicorn

    try:
        app = build_app(
            engine,
            served_model_name,
            api_key,
            max_n,
            max_request_bytes,
            read_timeout=read_timeout,
            enable_rl_endpoints=enable_rl_endpoints,
            **tool_options,
        )
    except BaigeError:  # a flag the model cannot honour (--reasoning-parser): nothing is left running
        engine.shutdown()
        sock.close()
        raise
    protocol = type("HeadDeadline", (HeadDeadline,), {"head_timeout": read_timeout})
    config = uvicorn.Config(app, log_level=log_level.lower(), timeout_graceful_shutdown=ABORT_GRACE_S, http=protocol)
    server = GracefulServer(config, engine, app.state.baige.lifecycle, shutdown_timeout)

    def stop_later() -> None:
        threading.Timer(DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

    engine.set_on_dead(stop_later)
    with server.stop_signals():  # a second signal while the engine shuts down still exits at once
        try:
            server.run(sockets=[sock])
        finally:
            engine.shutdown()
            sock.close()
    if engine.dead is not None:
        raise BaigeError(
            f"the engine loop stopped ({type(engine.dead).__name__}: {engine.dead}); exiting so a "
            "supervisor can restart the server"
        )
