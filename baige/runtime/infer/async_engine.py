"""One :class:`Engine` driven from a background thread, its outputs streamed to asyncio consumers
(what the HTTP server runs).

The loop contains every failure it can attribute: a request that cannot be added or fails in a
step gets its own error (the others go on); a step that fails as a whole fails the requests in it and
the loop goes on. Anything else that escapes the loop stops it: :attr:`AsyncEngine.dead` is set,
every waiting client gets :class:`EngineDeadError`, new requests are refused with it, and
``on_dead`` is called (the server then answers 503 on /health and exits non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable

import torch

from baige.errors import BaigeError
from baige.runtime.infer import weight_sync
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.outputs import EngineDeadError, RequestFailed, RequestOutput
from baige.runtime.infer.sampling import SamplingParams

logger = logging.getLogger("baige.engine")


class AsyncEngine:
    """Drives an :class:`Engine` from one background thread; asyncio callers stream its outputs.

    Args:
        engine: the engine (used only from the loop thread after this).
        on_output: called in the loop thread with every output (metrics); its errors are logged.
        on_dead: called once, in the loop thread, if the loop stops for any reason but :meth:`shutdown`.
    """

    def __init__(
        self,
        engine: Engine,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_dead: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.on_output = on_output
        self.on_dead = on_dead
        self.dead: BaseException | None = None
        self._cv = threading.Condition()
        self._adds: list[tuple[str, str | list[int], SamplingParams, float, LoRARequest | None]] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[Engine], object], concurrent.futures.Future]] = []
        # run once no request is in flight; until then new requests wait (update_weights, sleep)
        self._drains: list[tuple[Callable[[Engine], object], concurrent.futures.Future]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._fatal: BaseException | None = None  # set from another thread: the loop raises it
        if engine.tp is not None:  # a worker that dies while the loop waits stops it at once
            engine.tp.on_death.append(self._group_died)
        self._thread = threading.Thread(target=self._loop, name="baige-engine", daemon=True)
        self._thread.start()

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    @property
    def num_pending(self) -> int:
        return len(self._adds)

    @property
    def is_alive(self) -> bool:
        """The loop thread is running and has not died."""
        return self.dead is None and self._thread.is_alive()

    async def call(self, fn: Callable[[Engine], object], drain: bool = False) -> object:
        """Run ``fn(engine)`` on the loop thread between two steps (what changes the model, such as
        loading a LoRA adapter, must not overlap a forward); returns its result or raises its error.
        ``drain``: first stop admitting requests and let those in flight finish (requests that arrive
        meanwhile wait, and are admitted after ``fn``), so no request sees the engine both before and
        after ``fn``."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped; restart the server")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            (self._drains if drain else self._calls).append((fn, future))
            self._cv.notify()
        return await asyncio.wrap_future(future)

    # ---- weights and memory (RL hooks; the server's /update_weights_from_disk, /sleep, ...) -------
    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], lora_name: str | None = None
    ) -> None:
        """:meth:`Engine.update_weights` once the requests in flight have finished with the old weights
        (requests that arrive meanwhile wait and run with the new ones). Raises BaigeError."""
        pairs = list(named_tensors)
        await self.call(lambda engine: engine.update_weights(pairs, lora_name), drain=True)

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Read the checkpoint at ``model_path`` off the engine's thread (the engine keeps serving), then
        :meth:`update_weights` with it. Raises BaigeError (``weight_sync.read_checkpoint``)."""
        state = await asyncio.to_thread(weight_sync.read_checkpoint, model_path, self.engine.model)
        await self.update_weights(state.items())

    async def sleep(self, level: int = 1) -> None:
        """:meth:`Engine.sleep` once the requests in flight have finished; requests are then refused
        (BaigeError) until :meth:`wake_up`. Raises BaigeError as :meth:`Engine.sleep`."""
        await self.call(lambda engine: engine.sleep(level), drain=True)

    async def wake_up(self) -> None:
        """:meth:`Engine.wake_up`."""
        await self.call(lambda engine: engine.wake_up())

    async def reset_prefix_cache(self) -> None:
        """:meth:`Engine.reset_prefix_cache` between two steps (requests in flight go on)."""
        await self.call(lambda engine: engine.reset_prefix_cache())

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; leaving early (or cancellation) aborts it.
        ``lora_request``: the adapter it runs with (None: the base model).

        Validation happens before the first yield: bad input raises BaigeError at the first
        ``__anext__`` and nothing is queued. Raises RequestFailed when the engine fails this
        request, EngineDeadError when the loop has stopped.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped; restart the server")
        _, ids, params = self.engine.prepare(prompt, params)
        request_id = request_id or self.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._cv:
            if self.dead is not None:
                raise EngineDeadError("the engine loop has stopped; restart the server")
            self._streams[request_id] = (loop, queue)
            self._adds.append(
                (request_id, prompt if isinstance(prompt, str) else ids, params, time.monotonic(), lora_request)
            )
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
        if not self._thread.is_alive():
            self.engine.close()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's event loop has closed: nobody is waiting
                pass

    # ---- the loop thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:  # noqa: B902 - whatever stops the loop must reach the clients
            self._die(e)

    def _iterate(self) -> bool:
        """One round: take calls, aborts and adds (adds wait while a drain is pending), run a step,
        deliver; run the pending drains once nothing is in flight. False once shut down."""
        engine = self.engine
        with self._cv:
            while not (
                self._stopped
                or self._fatal
                or self._adds
                or self._aborts
                or self._calls
                or self._drains
                or engine.has_unfinished()
            ):
                self._cv.wait()
            if self._stopped:
                return False
            if self._fatal is not None:
                raise self._fatal
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            aborted = set(aborts)
            self._adds = [a for a in self._adds if a[0] not in aborted]
            adds, self._adds = (self._adds, []) if not self._drains else ([], self._adds)
        _run_calls(engine, calls)
        for rid in aborts:
            engine.abort(rid)
        for rid, prompt, params, arrival, lora in adds:
            self._add(rid, prompt, params, arrival, lora)
        if engine.has_unfinished():
            for out in self._step():
                self._emit(out)
        for rid, error in engine.take_failures():
            self._deliver(rid, error)
        if not engine.has_unfinished():
            with self._cv:
                drains, self._drains = self._drains, []
            _run_calls(engine, drains)
        return True

    def _add(
        self, rid: str, prompt: str | list[int], params: SamplingParams, arrival: float, lora: LoRARequest | None = None
    ) -> None:
        try:
            self.engine.add_request(rid, prompt, params, arrival, lora_request=lora)
        except BaigeError as e:
            self._deliver(rid, e)
        except Exception as e:  # not the caller's mistake: log it, fail this request only
            logger.exception("request %s could not be added", rid)
            self.engine.abort(rid)
            self._deliver(rid, RequestFailed(f"request {rid} failed: {type(e).__name__}: {e}"))

    def _step(self) -> list[RequestOutput]:
        engine = self.engine
        try:
            return engine.step()
        except EngineDeadError:  # a tensor-parallel rank is gone: the loop stops (the server exits)
            raise
        except Exception as e:  # not attributable to one request: fail the ones in flight, keep serving
            rids = list(engine.requests)
            logger.exception("engine step failed; failing requests %s", ", ".join(rids))
            for rid in rids:
                engine.abort(rid)
                self._deliver(rid, RequestFailed(f"request {rid} failed: engine step error: {type(e).__name__}: {e}"))
            return []

    def _emit(self, out: RequestOutput) -> None:
        if self.on_output is not None:
            try:
                self.on_output(out)
            except Exception:
                logger.exception("on_output failed for request %s", out.request_id)
        self._deliver(out.request_id, out)

    def _group_died(self, why: str) -> None:
        with self._cv:
            self._fatal = EngineDeadError(why)
            self._cv.notify()

    def _die(self, error: BaseException) -> None:
        with self._cv:
            self.dead = error
            streams = list(self._streams)
            calls, self._calls = self._calls + self._drains, []
            self._drains = []
        for _, future in calls:
            future.set_exception(EngineDeadError(f"the engine loop stopped ({type(error).__name__})"))
        logger.critical(
            "the engine loop stopped (%s: %s); failing %d waiting requests: %s",
            type(error).__name__,
            error,
            len(streams),
            ", ".join(streams),
        )
        for rid in streams:
            self._deliver(rid, EngineDeadError(f"the engine loop stopped ({type(error).__name__}); restart the server"))
        if self.on_dead is not None:
            self.on_dead()


def _run_calls(engine: Engine, calls: list[tuple[Callable[[Engine], object], concurrent.futures.Future]]) -> None:
    """Run each ``fn(engine)`` and settle its future with the result or the error (the caller's to
    handle: a BaigeError is its 4xx)."""
    for fn, future in calls:
        try:
            future.set_result(fn(engine))
        except Exception as e:
            future.set_exception(e)
