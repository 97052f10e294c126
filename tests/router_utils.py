"""The router tests' set-up: ASGI apps served by uvicorn on threads of the test process (stand-in
backends and the router itself), and stand-in OpenAI servers whose behaviour a test sets: their
/health status, reported load, an answer status, a stream that waits for the test or breaks, and the
``kv_transfer_params`` a pd producer answers with. Every request body and header they get is kept."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from baige.runtime.config import RouterConfig
from baige.runtime.router.app import build_app, listen

TIMEOUT = 30.0  # seconds any wait of these tests may take before it fails


@contextmanager
def serve_app(app):
    """Serve ``app`` with uvicorn on a thread, on a free port; yields its base URL."""
    import uvicorn

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the app did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        sock.close()


@contextmanager
def router_over(policy: str, **fields):
    """A router (``RouterConfig(policy, **fields)``, by default health checks every 0.1 s) on a thread;
    yields (base URL, its RouterState)."""
    fields = {"health_interval": 0.1, "health_timeout": 2.0, "log_level": "critical", **fields}
    cfg = RouterConfig(policy=policy, **fields)
    app = build_app(cfg)
    with serve_app(app) as url:
        yield url, app.state.router


@contextmanager
def launched_all(model_dir, n: int, *args: str, codes: dict[int, str] | None = None, timeout: float = 600):
    """``n`` `baige serve` processes (:func:`server_utils.launched`'s command; ``codes[i]`` runs in
    process i before the CLI) started at once, then waited for together; yields [(base URL, process)]."""
    import os
    import subprocess
    import sys

    from server_utils import free_port

    ports = [free_port() for _ in range(n)]
    procs = []
    try:
        for i, port in enumerate(ports):
            argv = ["serve", "--model", str(model_dir), "--port", str(port), *args]
            boot = (codes or {}).get(i, "") + "\nfrom baige.cli import main\nmain(" + repr(argv) + ")\n"
            procs.append(
                subprocess.Popen([sys.executable, "-c", boot], env=dict(os.environ), stdout=subprocess.DEVNULL)
            )
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        deadline = time.monotonic() + timeout
        for url, proc in zip(urls, procs):
            while True:
                assert proc.poll() is None, f"{url} exited with {proc.returncode}"
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the servers did not start"
                time.sleep(0.3)
        yield list(zip(urls, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(timeout=TIMEOUT)


def dead_url() -> str:
    """A base URL nothing listens on (connections are refused)."""
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def wait_until(check, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def sse_data(text: str) -> list:
    """The ``data:`` payloads of a server-sent-event body: JSON objects, and ``"[DONE]"``."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def prom(text: str) -> dict[str, float]:
    """A Prometheus text exposition as {sample name with labels: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class StandIn:
    """A stand-in OpenAI server named ``name``: each answer's text names it.

    Settable: ``health`` (the /health status), ``metrics`` (its /metrics text), ``status`` (not 200:
    /v1/* answer that status with an OpenAI error body), ``events`` (stream length), ``gate`` (a stream
    waits for it after its first event), ``break_after`` (a stream raises after that many events: the
    connection is cut, and /health answers 503 from then on), ``kv_transfer_params`` (a request with
    ``do_remote_decode`` gets them back), ``stall`` (a completion waits for it before answering: a hung
    engine that keeps the connection open)."""

    def __init__(self, name: str):
        self.name = name
        self.health = 200
        self.metrics = ""
        self.status = 200
        self.events = 3
        self.gate: threading.Event | None = None
        self.stall: threading.Event | None = None  # /v1/* requests wait for it before answering at all
        self.break_after: int | None = None
        self.kv_transfer_params: dict | None = None
        self.received: list[tuple[str, dict, dict]] = []  # (path, body, headers)
        self.stored: dict[str, dict] = {}  # the Responses API's responses made here, by id
        self.app = self._build()

    def bodies(self, path: str | None = None) -> list[dict]:
        return [b for p, b, _ in self.received if path is None or p == path]

    def _chunk(self, i: int) -> bytes:
        return f"data: {json.dumps({'choices': [{'index': 0, 'text': f'{self.name}-{i}'}]})}\n\n".encode()

    async def _stream(self):
        for i in range(self.events):
            if self.break_after is not None and i == self.break_after:
                self.health = 503  # as a process that died: its health checks fail from now on
                raise RuntimeError("the stand-in breaks its stream")
            yield self._chunk(i)
            if i == 0 and self.gate is not None:
                assert await anyio.to_thread.run_sync(self.gate.wait, TIMEOUT), "the gate was never opened"
        yield b"data: [DONE]\n\n"

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=self.health)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics, media_type="text/plain")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.name, "object": "model"}]}

        async def complete(request: Request):
            body = json.loads(await request.body())
            self.received.append((request.url.path, body, dict(request.headers)))
            if self.stall is not None:
                await anyio.to_thread.run_sync(self.stall.wait, TIMEOUT)
            if self.status != 200:
                error = {"message": f"{self.name} says {self.status}", "type": "x", "param": None, "code": None}
                return JSONResponse({"error": error}, status_code=self.status)
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": self.name}]}
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode") and self.kv_transfer_params:
                answer["kv_transfer_params"] = self.kv_transfer_params
            return answer

        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"):
            app.add_api_route(path, complete, methods=["POST"])
        self._add_responses(app)
        return app

    def _add_responses(self, app: FastAPI) -> None:
        @app.get("/version")
        async def version():
            return {"version": self.name}

        @app.post("/v1/responses")
        async def create(request: Request):
            body = json.loads(await request.body())
            self.received.append((request.url.path, body, dict(request.headers)))
            if self.status != 200:
                return JSONResponse({"error": {"message": f"{self.name} says {self.status}"}}, status_code=self.status)
            previous = body.get("previous_response_id")
            if previous and previous not in self.stored:
                return JSONResponse({"error": {"message": f"{self.name}: no {previous}"}}, status_code=404)
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            answer = {"id": f"resp_{self.name}{len(self.stored)}", "object": "response", "previous": previous}
            self.stored[answer["id"]] = answer
            return answer

        @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
        async def stored(request: Request, response_id: str):
            self.received.append((request.url.path, {"method": request.method}, dict(request.headers)))
            if response_id not in self.stored:
                return JSONResponse({"error": {"message": f"{self.name}: no {response_id}"}}, status_code=404)
            if request.method == "DELETE":
                del self.stored[response_id]
                return {"id": response_id, "object": "response", "deleted": True}
            return self.stored[response_id]


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=TIMEOUT)
