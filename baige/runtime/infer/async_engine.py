"""One :class:`Engine` driven from a background thread, its outputs streamed to asyncio consumers
(what the HTTP server runs)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from baige.errors import BaigeError
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.outputs import RequestOutput
from baige.runtime.infer.sampling import SamplingParams

logger = logging.getLogger("baige.engine")

class AsyncEngine:
    """Drives an :class:`Engine` from one background thread; asyncio callers stream its outputs.

    Args:
        engine: the engine (used only from the loop thread after this).
        on_output: called in the loop thread with every output (metrics).
    """

    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self.on_output = on_output
        self._cv = threading.Condition()
        self._adds: list[tuple[str, str | list[int], SamplingParams, float]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="baige-engine", daemon=True)
        self._thread.start()

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    @property
    def num_pending(self) -> int:
        return len(self._adds)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; leaving early (or cancellation) aborts it.

        Validation happens before the first yield: bad input raises BaigeError at the first
        ``__anext__`` and nothing is queued.
        """
        _, ids, params = self.engine.prepare(prompt, params)
        request_id = request_id or self.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._cv:
            self._streams[request_id] = (loop, queue)
            self._adds.append((request_id, prompt if isinstance(prompt, str) else ids, params, time.monotonic()))
            self._cv.notify()
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            with self._cv:
                self._streams.pop(request_id, None)
                if not finished:
                    self._aborts.append(request_id)
                    self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._stopped or self._adds or self._aborts or engine.has_unfinished()):
                    self._cv.wait()
                if self._stopped:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            for rid in aborts:
                engine.abort(rid)
            for rid, prompt, params, arrival in adds:
                if rid in aborts:
                    continue
                try:
                    engine.add_request(rid, prompt, params, arrival)
                except BaigeError as e:
                    self._deliver(rid, e)
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug: fail the requests in flight, keep serving
                logger.exception("engine step failed; aborting %d requests", len(engine.requests))
                for rid in list(engine.requests):
                    engine.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine error: {e}"))
                continue
            for out in outputs:
                if self.on_output is not None:
                    self.on_output(out)
                self._deliver(out.request_id, out)
