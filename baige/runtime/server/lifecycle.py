"""The server's shutdown: SIGTERM or SIGINT drains it, a second one exits at once.

On the first signal the server drains (:meth:`GracefulServer.drain`): ``/health`` answers 503 at once so
load balancers stop routing to it, every new request gets a 503 with ``Retry-After`` and
``Connection: close`` (the listening socket stays open, so a client is told instead of refused), and the
requests in flight go on. When the last one has finished, or ``--shutdown-timeout`` seconds have passed
(vLLM's flag), the ones still running are aborted (:meth:`AsyncEngine.abort_all`: a stream ends with an
OpenAI-shaped error event and ``[DONE]``, a plain request gets a 503), uvicorn closes the connections, the
engine is shut down (its tensor-parallel workers told to stop) and ``baige serve`` exits 0. A second signal
exits at once with 128 + its number (130 for SIGINT, 143 for SIGTERM), the workers SIGKILLed.

uvicorn's own handling (a fixed grace, the listening socket closed at once, the signal raised again after
the shutdown so the process dies of it) is replaced by overriding its hooks
(:meth:`uvicorn.Server.capture_signals`, ``handle_exit``, ``on_tick``), not by another HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

import uvicorn

from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.server.protocol import error_response

logger = logging.getLogger("baige.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # `baige serve --shutdown-timeout` (the default; vLLM's is 0)
RETRY_AFTER_S = 5  # the Retry-After of a request refused while draining: by then a load balancer that
# polls /health has moved it elsewhere
ABORT_GRACE_S = 5.0  # after aborting, how long the aborted requests' error events and bodies may take to
# be written; connections still open after it are closed (uvicorn's timeout_graceful_shutdown)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
UNGATED_PATHS = ("/health", "/metrics")  # answered while draining (/health with its 503), never counted


class Lifecycle:
    """Whether the server is draining, and its requests in flight (all HTTP requests but
    :data:`UNGATED_PATHS`, from their first byte to their response's last). Used from the event loop only."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()  # set while nothing is in flight (binds to a loop at its first wait)
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no request to be in flight; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return self.in_flight == 0
        return True


class DrainGate:
    """Pure ASGI middleware, the outermost: counts the requests in flight, and answers each new one
    with 503 (OpenAI's error body, ``code: server_shutting_down``, ``Retry-After``, ``Connection:
    close``) once the server drains; :data:`UNGATED_PATHS` pass through, uncounted."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNGATED_PATHS:
            return await self.app(scope, receive, send)
        if self.lifecycle.draining:
            response = error_response(
                "the server is shutting down and takes no new requests; retry on another replica",
                503,
                code="server_shutting_down",
            )
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, drained on SIGTERM / SIGINT and exited at once on the second (module docstring).

    Args:
        config: uvicorn's configuration (its ``timeout_graceful_shutdown`` bounds what is left after the drain).
        engine: the engine served; its requests are aborted when ``shutdown_timeout`` passes.
        lifecycle: the app's :class:`Lifecycle` (:class:`DrainGate` and ``/health`` read it).
        shutdown_timeout: seconds the requests in flight may take to finish after the signal (0: abort at once).
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, lifecycle: Lifecycle, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.lifecycle, self.shutdown_timeout = engine, lifecycle, shutdown_timeout
        self.signalled: int | None = None  # the first stop signal; on_tick starts the drain
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's hook, a no-op here: :meth:`stop_signals` handles the signals around the whole run,
        the engine's shutdown included (uvicorn's would restore the previous handlers before it, and
        raise the signal again afterwards, so that the process died of it)."""
        yield

    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM with :meth:`handle_exit` inside the block (main thread only, as
        uvicorn's), then restore the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler: the first signal asks for a drain (started by :meth:`on_tick`, in the
        event loop); a second exits the process now, status 128 + ``sig``."""
        if self.signalled is None:
            self.signalled = sig
            return
        logger.warning(
            "%s again: exiting now, cutting %d requests in flight", signal.Signals(sig).name, self.lifecycle.in_flight
        )
        self.engine.kill()
        os._exit(128 + sig)

    async def on_tick(self, counter: int) -> bool:
        if self.signalled is not None and self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain(self.signalled))
        return await super().on_tick(counter)

    async def drain(self, sig: int) -> None:
        """/health and new requests 503; wait for the requests in flight up to the shutdown timeout,
        abort the rest and give their error responses :data:`ABORT_GRACE_S` to be written; then let
        uvicorn shut down."""
        lc = self.lifecycle
        lc.draining = True
        logger.info(
            "%s: draining %d requests in flight for up to %g s (--shutdown-timeout); new requests get 503",
            signal.Signals(sig).name,
            lc.in_flight,
            self.shutdown_timeout,
        )
        if not await lc.wait_idle(self.shutdown_timeout):
            n = self.engine.abort_all(
                f"the server is shutting down: the request was still running after --shutdown-timeout "
                f"({self.shutdown_timeout:g} s) and was aborted"
            )
            logger.warning("--shutdown-timeout (%g s) passed: aborted %d engine requests", self.shutdown_timeout, n)
            if not await lc.wait_idle(ABORT_GRACE_S):
                logger.warning("%d requests still open after the abort; their connections are closed", lc.in_flight)
        else:
            logger.info("drained: no request in flight")
        self.should_exit = True
