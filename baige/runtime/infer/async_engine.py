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
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from baige.errors import BaigeError
from baige.runtime.infer.async_lora import AsyncEngineLoRA
from baige.runtime.infer.async_weights import AsyncEngineWeights
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.kv_offload import KVOffloadStats
from baige.runtime.infer.kv_transfer.manager import KVTransferStats
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.outputs import (
    EmbeddingRequestOutput,
    EngineDeadError,
    RequestAborted,
    RequestFailed,
    RequestOutput,
)
from baige.runtime.infer.pooling import PoolingParams
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats
from baige.runtime.model.tokenizer import Tokenizer

logger = logging.getLogger("baige.engine")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (what ``/metrics`` exports; vLLM's metric names).

    Attributes:
        num_requests_running: requests with sequences in the running queue.
        num_requests_waiting: requests waiting to be scheduled, those not yet handed to the loop included.
        kv_cache_blocks_used: KV-cache blocks referenced by a sequence.
        kv_cache_blocks_total: KV-cache blocks in the pool.
        prefix_cache_hit_rate: prompt tokens found in the prefix cache / prompt tokens looked up (0-1).
        prefix_cache_queries: prompt tokens looked up in the prefix cache so far (vLLM's
            ``prefix_cache_queries``).
        prefix_cache_hits: of those, tokens found cached so far (vLLM's ``prefix_cache_hits``).
        num_preemptions: sequences preempted (recompute) so far.
        num_structured_output_requests: requests with a structured-output constraint so far.
        grammar: the constraint compiler's counters (``compiles``, ``compile_seconds``, ``mask_seconds``,
            ``masked_tokens``); empty before its first use.
        spec_decode: speculative decoding's acceptance counters (a copy); None without a proposer.
        kv_transfer: the KV transfers' counters (a copy); None without ``--kv-transfer-config``.
        kv_offload: the second KV tier's counters (a copy); None without ``--kv-offload-size``.
    """

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_blocks_used: int
    kv_cache_blocks_total: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_structured_output_requests: int
    grammar: dict[str, float]
    spec_decode: SpecDecodeStats | None
    kv_transfer: KVTransferStats | None = None
    kv_offload: KVOffloadStats | None = None


class AsyncEngine(AsyncEngineWeights, AsyncEngineLoRA):
    """Drives an :class:`Engine` from one background thread; asyncio callers stream its outputs.

    The HTTP server uses this class's public methods only, never the wrapped ``engine``
    (``tests/test_architecture.py`` enforces it): what it needs of the Engine gets a method here.

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
        self._adds: list[
            tuple[str, str | list[int], SamplingParams | PoolingParams, float, LoRARequest | None, dict | None]
        ] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[Engine], object], concurrent.futures.Future]] = []
        # run once no request is in flight; until then new requests wait (update_weights, sleep)
        self._drains: list[tuple[Callable[[Engine], object], concurrent.futures.Future]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._closing: str | None = None  # abort_all's message: new requests are refused with it
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

    def set_on_output(self, fn: Callable[[RequestOutput], None] | None) -> None:
        """Call ``fn`` in the loop thread with every output from now on (replaces the previous one)."""
        self.on_output = fn

    def set_on_dead(self, fn: Callable[[], None] | None) -> None:
        """Call ``fn`` once, in the loop thread, if the loop stops for any reason but :meth:`shutdown`."""
        self.on_dead = fn

    # ---- what the server asks of the engine ---------------------------------------------
    # Read-only views (any thread) and named operations; the server never touches the Engine itself.
    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer (thread-safe to encode, decode and render templates with)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest sequence, prompt plus completion, in tokens."""
        return self.engine.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit ``max_model_len`` whatever it tokenizes to
        (:attr:`Engine.max_prompt_chars`)."""
        return self.engine.max_prompt_chars

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate a prompt (any thread; :meth:`Engine.prepare`): its token ids and
        ``params`` with ``max_tokens`` filled in. Raises BaigeError (see :meth:`Engine.prepare`)."""
        _, ids, params = self.engine.prepare(prompt, params)
        return ids, params

    def stats(self) -> EngineStats:
        """The engine's counters now (read from any thread; each number is read once, not under a lock)."""
        engine, bm = self.engine, self.engine.block_manager
        spec = None
        if engine.proposer is not None:  # a copy: the loop thread goes on counting
            spec = dataclasses.replace(engine.spec_stats, accepted_per_pos=list(engine.spec_stats.accepted_per_pos))
        return EngineStats(
            num_requests_running=engine.num_running_requests,
            num_requests_waiting=engine.num_waiting_requests + self.num_pending,
            kv_cache_blocks_used=bm.num_used_blocks,
            kv_cache_blocks_total=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hit_rate,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=engine.scheduler.num_preemptions,
            num_structured_output_requests=engine.num_constrained_requests,
            grammar=engine.grammar_stats,
            spec_decode=spec,
            kv_transfer=dataclasses.replace(engine.kv_transfer.stats) if engine.kv_transfer is not None else None,
            kv_offload=dataclasses.replace(engine.kv_offload.stats) if engine.kv_offload is not None else None,
        )

    async def call(self, fn: Callable[[Engine], object], drain: bool = False, ordered: bool = False) -> object:
        """Run ``fn(engine)`` on the loop thread between two steps (what changes the model, such as
        loading a LoRA adapter, must not overlap a forward); returns its result or raises its error.
        ``drain``: first stop admitting requests and let those in flight finish (requests that arrive
        meanwhile wait, and are admitted after ``fn``), so no request sees the engine both before and
        after ``fn``. ``ordered``: run after the drain calls already waiting (a wake-up sent while a
        sleep still drains must not run first, leaving the engine asleep)."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped; restart the server")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            (self._drains if drain or (ordered and self._drains) else self._calls).append((fn, future))
            self._cv.notify()
        return await asyncio.wrap_future(future)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; leaving early (or cancellation) aborts it.
        ``lora_request``: the adapter it runs with (None: the base model); ``kv_transfer_params``:
        vLLM's P/D fields (:meth:`Engine.add_request`; a producer's final output carries its own).

        Validation happens before the first yield: bad input raises BaigeError at the first
        ``__anext__`` and nothing is queued. Raises RequestFailed when the engine fails this
        request, EngineDeadError when the loop has stopped.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped; restart the server")
        if self._closing is not None:
            raise RequestAborted(self._closing)
        _, ids, params = self.engine.prepare(prompt, params)
        prompt = prompt if isinstance(prompt, str) else ids
        async for out in self._stream(request_id, prompt, params, lora_request, kv_transfer_params):
            yield out

    # ---- pooling (the pooling runner: embeddings) ------------------------------------------------
    @property
    def is_pooling(self) -> bool:
        """The engine runs the pooling runner (``--runner pooling``): it embeds and does not generate."""
        return self.engine.pooler is not None

    @property
    def hidden_size(self) -> int:
        return self.engine.model.config.hidden_size

    def prepare_pooling(self, prompt: str | list[int], params: PoolingParams) -> list[int]:
        """Tokenize and validate a pooling prompt and its parameters (any thread;
        :meth:`Engine.prepare_pooling`): its token ids. Raises BaigeError."""
        return self.engine.prepare_pooling(prompt, params)[1]

    async def embed(
        self, prompt: str | list[int], params: PoolingParams, request_id: str | None = None
    ) -> EmbeddingRequestOutput:
        """Pool one prompt (:meth:`Engine.add_pooling_request`, batched with the other requests); its
        output once its prompt is computed. Cancellation aborts it. Raises BaigeError (the generate
        runner, bad input: before anything is queued), RequestFailed, EngineDeadError."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped; restart the server")
        if not self.is_pooling:
            raise BaigeError("this model runs the generate runner; embeddings need --runner pooling", param="model")
        ids = self.prepare_pooling(prompt, params)
        out = None
        async for out in self._stream(request_id, ids, params, None):
            pass
        return out

    async def _stream(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params,
        lora_request: LoRARequest | None,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator:
        """Hand a validated request to the loop and yield its outputs until it finishes; leaving early
        aborts it."""
        request_id = request_id or self.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._cv:
            if self.dead is not None:
                raise EngineDeadError("the engine loop has stopped; restart the server")
            self._streams[request_id] = (loop, queue)
            self._adds.append((request_id, prompt, params, time.monotonic(), lora_request, kv_transfer_params))
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

    def abort_all(self, message: str) -> int:
        """Abort every request in flight and refuse the ones that come later (the server's shutdown,
        once ``--shutdown-timeout`` has passed): each waiting consumer of :meth:`generate` gets
        :class:`RequestAborted` with ``message`` at once, from the calling thread (a step in progress
        does not delay it); their sequences are freed at the loop's next round. Returns how many
        requests were aborted."""
        with self._cv:
            self._closing = message
            rids = list(self._streams)
            self._aborts.extend(rids)
            self._cv.notify()
        for rid in rids:
            self._deliver(rid, RequestAborted(message))
        return len(rids)

    def kill(self) -> None:
        """Stop at once, for a process about to exit without cleaning up (a second stop signal):
        SIGKILL the tensor-parallel workers (:meth:`Engine.kill`); the loop thread is left to die with
        the process."""
        self.engine.kill()

    def shutdown(self) -> None:
        """Stop the loop thread (after the step in progress, waiting up to 10 s) and close the engine
        (the tensor-parallel workers are told to stop and exit)."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand each ``(request id, item)`` to its stream's queue, in order: one ``call_soon_threadsafe``
        per event loop for all of them (a step's outputs), not one per request, so a step that streams to
        many requests wakes the server's loop once (each wake-up is a write to the loop's self-pipe, and
        the loop thread then competes with this thread for the interpreter lock)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
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
        for rid, prompt, params, arrival, lora, kv_params in adds:
            self._add(rid, prompt, params, arrival, lora, kv_params)
        delivered = []
        if engine.has_unfinished():
            for out in self._step():
                self._observe(out)
                delivered.append((out.request_id, out))
        self._deliver_all(delivered + engine.take_failures())
        if not engine.has_unfinished():
            with self._cv:
                drains, self._drains = self._drains, []
            _run_calls(engine, drains)
        return True

    def _add(
        self,
        rid: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        arrival: float,
        lora: LoRARequest | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        try:
            if isinstance(params, PoolingParams):
                self.engine.add_pooling_request(rid, prompt, params, arrival)
            else:
                self.engine.add_request(
                    rid, prompt, params, arrival, lora_request=lora, kv_transfer_params=kv_transfer_params
                )
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

    def _observe(self, out: RequestOutput) -> None:
        if self.on_output is not None:
            try:
                self.on_output(out)
            except Exception:
                logger.exception("on_output failed for request %s", out.request_id)

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


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    """In a server's event loop: put each item into its stream's queue."""
    for queue, item in puts:
        queue.put_nowait(item)


def _run_calls(engine: Engine, calls: list[tuple[Callable[[Engine], object], concurrent.futures.Future]]) -> None:
    """Run each ``fn(engine)`` and settle its future with the result or the error (the caller's to
    handle: a BaigeError is its 4xx)."""
    for fn, future in calls:
        try:
            future.set_result(fn(engine))
        except Exception as e:
            future.set_exception(e)
