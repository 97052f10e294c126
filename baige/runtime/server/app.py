"""The FastAPI application: routes (:mod:`.routes`), error handlers in OpenAI's shape
(:mod:`.protocol`), bearer-token auth, metrics (:mod:`.metrics`), and :func:`run_server` (uvicorn).

Every user error is a 4xx with OpenAI's error body; the engine keeps serving.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from baige.errors import BaigeError
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.server import routes
from baige.runtime.server.metrics import Metrics
from baige.runtime.server.protocol import APIError, error_response


class BearerAuth:
    """Pure ASGI middleware: /v1/* needs ``Authorization: Bearer <api_key>`` (401 otherwise).

    Not a BaseHTTPMiddleware: that wrapper hides client disconnects from the endpoints.
    """

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                response = error_response("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _api_error(_: Request, e: APIError):
    return error_response(e.message, e.status, e.param, e.code)


async def _baige_error(_: Request, e: BaigeError):
    return error_response(str(e), 400)


async def _not_found(_: Request, e):
    return error_response("not found", 404)


async def _not_allowed(request: Request, e):
    return error_response(f"method {request.method} not allowed", 405)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under the model name ``served_model_name``."""
    app = FastAPI(title="baige", docs_url=None, redoc_url=None)
    metrics = Metrics(engine, served_model_name)
    engine.on_output = metrics.on_output
    app.state.baige = routes.ServerState(engine, served_model_name, metrics, int(time.time()))
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(BaigeError, _baige_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _not_allowed)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    return app


def run_server(engine: AsyncEngine, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, log_level: str = "info") -> None:
    """Serve ``engine`` with uvicorn until interrupted; the engine thread is stopped on the way out."""
    import uvicorn

    try:
        uvicorn.run(build_app(engine, served_model_name, api_key), host=host, port=port, log_level=log_level.lower())
    finally:
        engine.shutdown()
