"""The inference engine: requests in, streamed text out, many requests sharing one model.

``Engine`` is synchronous: :meth:`Engine.add_request`, :meth:`Engine.step` (one scheduler step:
schedule -> run -> sample -> stop checks -> detokenize), :meth:`Engine.abort`. ``AsyncEngine``
drives one ``Engine`` from a background thread and streams outputs to asyncio consumers (the HTTP
server). ``LLM`` is the offline API: ``LLM(model).generate(prompts, params)``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.block_manager import BlockManager
from baige.runtime.kv_cache import KVCache, num_blocks_for, profile_activation_peak, resolve_kv_cache_dtype
from baige.runtime.loader import load_model, parse_size, resolve_device, resolve_model
from baige.runtime.model import Transformer
from baige.runtime.runner import ModelRunner
from baige.runtime.sampling import Logprobs, SamplerRow, SamplingParams
from baige.runtime.scheduler import Scheduler, Sequence, SequenceStatus
from baige.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("baige.engine")


@dataclass
class EngineConfig:
    """Engine settings (vLLM's names). ``max_model_len`` None: the model's ``max_position_embeddings``;
    ``kv_cache_memory`` None: a fraction of the memory free after a warm-up step, less that step's
    activation peak (see ``kv_cache.num_blocks_for`` and ``kv_cache.profile_activation_peak``)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes, or a size such as "2GB" / "512MiB" (loader.parse_size)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    quantization: str | None = None  # None or "fp16-weight" (CPU fp32; see quant_dynamic.py)
    kv_cache_dtype: str = "auto"  # auto (the model's) | float32 | float16 | bfloat16; others than auto: CPU


@dataclass
class CompletionOutput:
    """One sequence of a request. Cumulative fields plus the delta of the step that produced it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced so far.

    Times are ``time.monotonic()`` seconds: ``arrival_time`` (added), ``first_token_time`` (TTFT
    = first_token_time - arrival_time), ``finished_time``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then one Logprobs per token
    # (filled as prefill chunks run; complete once the first output token exists)
    prompt_logprobs: list[Logprobs | None] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


class _SeqState:
    """Per-sequence text state: detokenizer, stop strings, what has been streamed."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, generator: torch.Generator | None):
        self.params = params
        self.generator = generator
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.text = ""
        self.sent = 0  # characters of text already emitted
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.sent_tokens = 0
        self.sent_logprobs = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    prompt_logprobs: list[Logprobs | None] | None = None


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: the decoder (eval mode).
        tokenizer: its tokenizer.
        cfg: engine settings.
    Raises:
        BaigeError: settings that cannot work (a KV budget below one max-length sequence,
        max_num_batched_tokens < max_num_seqs, ...).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, cfg: EngineConfig):
        mc = model.config
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise BaigeError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise BaigeError(f"--max-num-batched-tokens ({cfg.max_num_batched_tokens}) must be >= "
                             f"--max-num-seqs ({cfg.max_num_seqs})")
        if cfg.block_size < 1 or cfg.max_num_seqs < 1:
            raise BaigeError("--block-size and --max-num-seqs must be >= 1")
        if isinstance(cfg.kv_cache_memory, str):
            from dataclasses import replace

            cfg = self.cfg = replace(cfg, kv_cache_memory=parse_size(cfg.kv_cache_memory))
        p = next(model.parameters())
        kernels.backend(p)  # a bad BAIGE_KERNELS fails here, at start-up, not inside the first request
        peak = 0
        if cfg.kv_cache_memory is None:  # size the cache from what is free after a warm-up step
            peak = profile_activation_peak(model, min(cfg.max_num_batched_tokens, self.max_model_len),
                                           min(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len))
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, p.dtype, p.device)
        num_blocks = num_blocks_for(mc, cfg.block_size, kv_dtype, p.device, cfg.kv_cache_memory, self.max_model_len,
                                    activation_peak=peak)
        self.kv_cache = KVCache(mc, num_blocks, cfg.block_size, kv_dtype, p.device)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(model, self.kv_cache, cfg.max_num_seqs, self.max_model_len, cfg.enforce_eager)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids or mc.eos_token_id)
        self._eos_only = frozenset(self.eos_token_ids)
        self.generator = torch.Generator(device=p.device).manual_seed(cfg.seed)  # unseeded requests
        self.requests: dict[str, _Request] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MB, %s)", num_blocks, cfg.block_size,
                    num_blocks * cfg.block_size,
                    num_blocks * KVCache.bytes_per_block(mc, cfg.block_size, kv_dtype) / 1e6,
                    str(kv_dtype).removeprefix("torch."))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "Engine":
        """Resolve and load the model and tokenizer named by ``cfg.model``. Raises BaigeError."""
        model_dir = resolve_model(cfg.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        model = load_model(model_dir, cfg.dtype, resolve_device(cfg.device))
        if cfg.quantization:
            from baige.runtime.quant_dynamic import apply_quantization

            apply_quantization(model, cfg.quantization)
        return cls(model, tokenizer, cfg)

    # ---- requests --------------------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Tokenize and validate a prompt; fill in ``max_tokens`` (default: the rest of the context).

        Raises:
            BaigeError: empty prompt, token ids outside the vocabulary, or a prompt plus max_tokens
            longer than max_model_len (the message gives both numbers).
        """
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise BaigeError("the prompt is empty")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise BaigeError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        n = len(ids)
        if n >= self.max_model_len:
            raise BaigeError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the prompt has {n} tokens, which leaves no room to generate")
        if params.max_tokens is None:
            params = _replace(params, max_tokens=self.max_model_len - n)
        elif n + params.max_tokens > self.max_model_len:
            raise BaigeError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                             f"{n + params.max_tokens} were requested ({n} in the prompt, {params.max_tokens} "
                             f"in the completion); reduce the prompt or max_tokens")
        return text, ids, params

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises BaigeError as :meth:`prepare`, or for a
        request id already in flight."""
        if request_id in self.requests:
            raise BaigeError(f"request id {request_id!r} is already in use")
        text, ids, params = self.prepare(prompt, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            elif not params.greedy:
                gen = self.generator
            seq = Sequence(list(ids), params.max_tokens, params.min_tokens, stop_ids, request_id, i,
                           payload=_SeqState(self.tokenizer, params, gen),
                           prompt_logprobs=params.prompt_logprobs if i == 0 else None)  # one scorer per request
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs,
                                             time.monotonic() if arrival_time is None else arrival_time,
                                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.num_prompt_tokens += len(ids)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its KV blocks (no-op for an unknown or finished id)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        logger.info("request %s aborted after %.3f s", request_id, time.monotonic() - req.arrival_time)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running_requests(self) -> int:
        return len({s.request_id for s in list(self.scheduler.running)})

    @property
    def num_waiting_requests(self) -> int:
        running = {s.request_id for s in list(self.scheduler.running)}
        return len({s.request_id for s in list(self.scheduler.waiting)} - running)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns an output for every request that produced a token (or finished)."""
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        rows = []
        for s in batch.seqs:
            st: _SeqState = s.payload
            p = st.params
            rows.append(SamplerRow(
                p, st.generator,
                prompt_ids=s.token_ids[: s.num_prompt_tokens] if p.repetition_penalty != 1 else None,
                output_ids=s.output_token_ids if (p.has_penalties or p.min_tokens) else None,
                stop_ids=list(s.stop_token_ids) if p.min_tokens else None,
            ))
        tokens, logprobs, prompt_lps = self.runner.execute(batch, rows)
        for i, (first, lps) in prompt_lps.items():
            req = self.requests.get(batch.seqs[i].request_id)
            if req is not None and req.prompt_logprobs is not None and first == len(req.prompt_logprobs):
                req.prompt_logprobs.extend(lps)  # a recompute after preemption scores nothing new
        got = self.scheduler.postprocess(batch, tokens)
        now = time.monotonic()
        lp_of = {s.seq_id: lp for s, lp in zip(batch.seqs, logprobs)}
        touched: dict[str, _Request] = {}
        for seq in got:
            self._process_token(seq, lp_of[seq.seq_id])
            self.num_generated_tokens += 1
            req = self.requests.get(seq.request_id)
            if req is not None:
                if req.first_token_time is None:
                    req.first_token_time = now
                touched[req.request_id] = req
        return [self._output(req, now) for req in touched.values()]

    def _process_token(self, seq: Sequence, lp: Logprobs | None) -> None:
        st: _SeqState = seq.payload
        token = seq.token_ids[-1]
        if st.logprobs is not None and lp is not None:
            st.logprobs.append(lp)
        if not (seq.finish_reason == "stop" and seq.stop_reason == token):  # a stop token adds no text
            st.text += st.detok.add(token)
        if seq.is_finished:
            st.text += st.detok.flush()
        if st.max_stop:
            # emitted text never holds the start of a stop string (see _emit_upto), so search after it
            hits = [(i, s) for s in st.params.stop if (i := st.text.find(s, st.sent)) >= 0]
            if hits:
                i, stop = min(hits)
                st.text = st.text[:i]
                if seq.is_finished:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)

    def _emit_upto(self, seq: Sequence) -> int:
        """Characters of the text that may be streamed now: all when finished, else all but the
        longest tail that is a prefix of a stop string (it could still become one)."""
        st: _SeqState = seq.payload
        if seq.is_finished or not st.max_stop:
            return len(st.text)
        text = st.text
        for k in range(min(st.max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in st.params.stop):
                return len(text) - k
        return len(text)

    def _output(self, req: _Request, now: float) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            st: _SeqState = seq.payload
            upto = max(self._emit_upto(seq), st.sent)
            out_ids = seq.output_token_ids
            outs.append(CompletionOutput(
                index=seq.index,
                text=st.text[:upto],
                token_ids=list(out_ids),
                finish_reason=seq.finish_reason,
                stop_reason=None if seq.stop_reason in self._eos_only else seq.stop_reason,  # EOS: None (vLLM)
                logprobs=list(st.logprobs) if st.logprobs is not None else None,
                delta_text=st.text[st.sent:upto],
                delta_token_ids=out_ids[st.sent_tokens:],
                delta_logprobs=st.logprobs[st.sent_logprobs:] if st.logprobs is not None else [],
            ))
            st.sent, st.sent_tokens = upto, len(out_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        finished = all(s.is_finished for s in req.seqs)
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                            num_cached_tokens=req.seqs[0].num_cached_tokens,
                            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                            arrival_time=req.arrival_time,
                            first_token_time=req.first_token_time, finished_time=now if finished else None)
        if finished:
            del self.requests[req.request_id]
            n_out = sum(len(o.token_ids) for o in outs)
            logger.info("request %s: %d prompt tokens, %d output tokens, %.3f s, finish %s", req.request_id,
                        len(req.prompt_token_ids), n_out, now - req.arrival_time,
                        ",".join(str(o.finish_reason) for o in outs))
        return out

    # ---- offline ---------------------------------------------------------------------------
    def run_to_completion(self, request_ids: Seq[str]) -> list[RequestOutput]:
        """Step until every listed request has finished; their final outputs, in the given order."""
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids) and self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in request_ids]


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import replace

    return replace(params, **changes)


PromptType = str | list[int] | dict


class LLM:
    """Offline batched generation: ``LLM(model).generate(prompts, params)``.

    Args:
        model: a model spec (see ``loader.resolve_model``); None for the embedded default.
        **engine_args: any :class:`EngineConfig` field (dtype, max_model_len, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine.from_config(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        Args:
            prompts: a string, a list of token ids, ``{"prompt_token_ids": [...]}``, or a list of these.
            sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``).
        Raises:
            BaigeError: a bad prompt or parameters (nothing is generated then).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise BaigeError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            self.engine.prepare(prompt, p)  # validate all before queueing any
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        return self.engine.run_to_completion(ids)


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
