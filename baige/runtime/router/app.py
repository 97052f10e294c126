"""The router's FastAPI application and its uvicorn server.

Routes: ``/health`` (200 while every role has a healthy backend, else 503; the body names the policy
and each backend's state), ``/metrics`` (the router's own, :mod:`.metrics`), ``/v1/models`` (a healthy
backend's answer), ``/v1/completions`` and ``/v1/chat/completions`` (forwarded by policy,
:mod:`.proxy` and :mod:`.pd`), ``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/version`` and
``/v1/responses`` (forwarded by policy; under ``pd`` to the decode backends) and
``GET``/``DELETE /v1/responses/{id}`` (to the backend holding it, :mod:`.responses`). Any other path
is 404 with OpenAI's ``not_found_error``. The router keeps no request state between requests, so several
routers over the same backends can sit behind one load balancer; the prefix policy's hash is stable
across processes, so they agree on where a prefix goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from baige.errors import BaigeError
from baige.runtime.config import RouterConfig
from baige.runtime.router.backends import Backend, BackendPool
from baige.runtime.router.metrics import RouterMetrics
from baige.runtime.router.pd import forward_pd
from baige.runtime.router.policies import LeastLoad, Prefix, make_policy, prompt_prefix
from baige.runtime.router.proxy import RouterState, error_response, forward, forwarded_headers
from baige.runtime.router.responses import forward_response, forward_stored

logger = logging.getLogger("baige.router")

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")
# seconds an idle pooled connection to a backend is kept: below the keep-alive timeout of the backends'
# uvicorn (5 s, its default, which `baige serve` keeps), so the router never reuses a connection at the
# moment the backend closes it (httpx's default expiry is those same 5 s: a request sent then fails with
# ReadError, and the backend is marked down)
KEEPALIVE_EXPIRY_S = 2.0
PASSED_PATHS = ("/v1/embeddings", "/tokenize", "/detokenize")  # POST, by policy, no pd split


class BodyTooLarge(Exception):
    pass


def router_state(config: RouterConfig) -> RouterState:
    """The backends, policies and metrics of ``config`` (no connection made yet)."""
    if config.policy == "pd":
        backends = [Backend(u, "prefill") for u in config.prefill] + [Backend(u, "decode") for u in config.decode]
        policies = {"prefill": Prefix(config.prefill, config.balance_abs_threshold), "decode": LeastLoad()}
    else:
        backends = [Backend(u) for u in config.backends]
        policies = {"backend": make_policy(config.policy, config.backends, config.balance_abs_threshold)}
    scrape = config.policy != "round_robin"
    pool = BackendPool(backends, config.health_interval, config.health_timeout, scrape_load=scrape)
    return RouterState(config, pool, policies, RouterMetrics(pool))


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused (BodyTooLarge) as soon as it passes ``max_bytes``."""
    parts, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > max_bytes:
            raise BodyTooLarge()
        parts.append(chunk)
    return b"".join(parts)


def _add_routes(app: FastAPI, state: RouterState) -> None:
    cfg, pool = state.config, state.pool

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        ok = all(pool.healthy(role) for role in pool.roles())
        info = {"policy": cfg.policy, "backends": [b.describe() for b in pool.backends]}
        return JSONResponse({"status": "ok" if ok else "unavailable", "router": info}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    role = "decode" if cfg.policy == "pd" else "backend"

    async def get_any(request: Request) -> Response:
        return await forward(state, role, "GET", request.url.path, b"", forwarded_headers(request.headers), b"")

    for path in ("/v1/models", "/version"):
        app.add_api_route(path, get_any, methods=["GET"])

    async def stored(request: Request, response_id: str) -> Response:
        return await forward_stored(state, role, request.method, response_id, forwarded_headers(request.headers))

    app.add_api_route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"])

    async def passed(request: Request) -> Response:
        content = await read_body(request, cfg.max_request_bytes)
        try:
            body = json.loads(content)
        except ValueError:
            body = None  # the backend's validation answers it (its 400)
        headers, key = forwarded_headers(request.headers), prompt_prefix(body, cfg.prefix_chars)
        if request.url.path == "/v1/responses":
            return await forward_response(state, role, body, content, headers, key)
        return await forward(state, role, "POST", request.url.path, content, headers, key)

    for path in (*PASSED_PATHS, "/v1/responses"):
        app.add_api_route(path, passed, methods=["POST"])

    async def proxied(request: Request) -> Response:
        content = await read_body(request, cfg.max_request_bytes)
        try:
            body = json.loads(content)
        except ValueError:
            body = None  # the backend's validation answers it (its 400)
        headers = forwarded_headers(request.headers)
        key = prompt_prefix(body, cfg.prefix_chars)
        if cfg.policy != "pd":
            return await forward(state, "backend", "POST", request.url.path, content, headers, key)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        return await forward_pd(state, request.url.path, body, headers, key)

    for path in PROXIED_PATHS:
        app.add_api_route(path, proxied, methods=["POST"])


def _add_error_handlers(app: FastAPI, max_bytes: int) -> None:
    async def too_large(_: Request, e: BodyTooLarge) -> Response:
        return error_response(f"the request body is larger than {max_bytes} bytes", 413, "request_too_large")

    async def client_left(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it (nginx's code for a client that closed the request)

    async def http_error(request: Request, e: HTTPException) -> Response:
        if e.status_code == 405:
            return error_response(f"method {request.method} not allowed on {request.url.path[:200]}", 405)
        if e.status_code == 404:
            return error_response(f"not found: {request.url.path[:200]}", 404, "not_found")
        return error_response(str(e.detail)[:300], e.status_code)

    async def internal(request: Request, e: Exception) -> Response:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(f"internal error in the router ({type(e).__name__})", 500, "internal_error")

    for exc, handler in (
        (BodyTooLarge, too_large),
        (ClientDisconnect, client_left),
        (HTTPException, http_error),
        (Exception, internal),
    ):
        app.add_exception_handler(exc, handler)


def build_app(config: RouterConfig) -> FastAPI:
    """The router application of ``config``; its lifespan opens the connection pool, checks every
    backend once before serving, and runs the health checks every ``config.health_interval`` s."""
    state = router_state(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        timeout = httpx.Timeout(None, connect=config.connect_timeout)  # a generation may take long
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state.client = client
            await state.pool.check_all(client)
            checks = asyncio.create_task(state.pool.run(client))
            try:
                yield
            finally:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks

    app = FastAPI(title="baige router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.router = state
    _add_routes(app, state)
    _add_error_handlers(app, config.max_request_bytes)
    return app


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening. Raises BaigeError when it cannot be bound."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise BaigeError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def make_server(config: RouterConfig):
    """A uvicorn server of the router application (``.run(sockets=[listen(...)])`` serves it)."""
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check and per request
    app = build_app(config)
    return uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5))


def run_router(config: RouterConfig) -> None:
    """Serve the router on ``config.host:config.port`` until interrupted. Raises BaigeError (port)."""
    sock = listen(config.host, config.port)
    try:
        make_server(config).run(sockets=[sock])
    finally:
        sock.close()
