"""OpenAI-compatible HTTP API over an :class:`~baige.runtime.engine.AsyncEngine` (FastAPI).

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus text format), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as server-sent events
ending with ``data: [DONE]``). Request and response fields follow OpenAI's API reference; the
vLLM extensions top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos and
skip_special_tokens are accepted too.

Every user error is a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``;
the engine keeps serving. A client that disconnects aborts its request, which frees its KV blocks.
This is the only module that imports the web framework.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from baige.errors import BaigeError
from baige.runtime.engine import AsyncEngine, RequestOutput
from baige.runtime.sampling import MAX_LOGPROBS, Logprobs, SamplingParams

logger = logging.getLogger("baige.server")


# ---- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """A request error with its HTTP status (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# ---- request schemas ----------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One line for the first problem pydantic found, and the top-level field it concerns."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    first = str(err["loc"][0]) if err["loc"] else None
    return (f"{loc}: {err['msg']}" if loc else err["msg"]), first


# ---- metrics ------------------------------------------------------------------------------------
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)


class Metrics:
    """Prometheus metrics of one server (vLLM's names with a ``baige:`` prefix), in its own registry."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = r = CollectorRegistry()
        eng, bm = engine.engine, engine.engine.block_manager
        Gauge("baige:num_requests_running", "Requests with sequences in the running queue.", registry=r
              ).set_function(lambda: eng.num_running_requests)
        Gauge("baige:num_requests_waiting", "Requests waiting to be scheduled.", registry=r
              ).set_function(lambda: eng.num_waiting_requests + engine.num_pending)
        Gauge("baige:kv_cache_blocks_used", "KV-cache blocks referenced by a sequence.", registry=r
              ).set_function(lambda: bm.num_used_blocks)
        Gauge("baige:kv_cache_blocks_total", "KV-cache blocks in the pool.", registry=r).set(bm.num_blocks)
        Gauge("baige:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", registry=r
              ).set_function(lambda: bm.num_used_blocks / bm.num_blocks)
        Gauge("baige:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
              registry=r).set_function(lambda: bm.prefix_hit_rate)
        Gauge("baige:num_preemptions", "Sequences preempted (recompute) so far.", registry=r
              ).set_function(lambda: eng.scheduler.num_preemptions)
        self.prompt_tokens = Counter("baige:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("baige:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("baige:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("baige:time_to_first_token_seconds", "Time to first token (TTFT), seconds.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("baige:time_per_output_token_seconds",
                              "Time per output token after the first (TPOT), seconds.", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("baige:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def on_output(self, out: RequestOutput) -> None:
        """Called by the engine thread with every output."""
        self.generation_tokens.inc(sum(len(o.delta_token_ids) for o in out.outputs))
        if not out.finished:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for o in out.outputs:
            self.requests.labels(o.finish_reason or "unknown").inc()
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
            n = max(len(o.token_ids) for o in out.outputs)
            if n > 1 and out.finished_time is not None:
                self.tpot.observe((out.finished_time - out.first_token_time) / (n - 1))
        if out.finished_time is not None:
            self.e2e.observe(out.finished_time - out.arrival_time)


# ---- helpers ------------------------------------------------------------------------------------
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as they produce; cancelling the consumer cancels them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((k, out))
        except BaseException as e:  # delivered to the consumer, which re-raises it
            await queue.put((k, e))
            return
        await queue.put((k, done))

    tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


# ---- the app ------------------------------------------------------------------------------------
class _BearerAuth:
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


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under the model name ``served_model_name``."""
    app = FastAPI(title="baige", docs_url=None, redoc_url=None)
    eng = engine.engine
    tok = eng.tokenizer
    metrics = Metrics(engine, served_model_name)
    engine.on_output = metrics.on_output
    created = int(time.time())

    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e.message, e.status, e.param, e.code)

    @app.exception_handler(BaigeError)
    async def baige_error(_: Request, e: BaigeError):
        return error_response(str(e), 400)

    @app.exception_handler(404)
    async def not_found(_: Request, e):
        return error_response("not found", 404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, e):
        return error_response(f"method {request.method} not allowed", 405)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "baige", "max_model_len": eng.max_model_len}]}

    async def parse(request: Request, schema: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise APIError(msg, param=param) from None
        if req.model is not None and req.model != served_model_name:
            raise APIError(f"the model `{req.model}` does not exist (this server serves `{served_model_name}`)",
                           404, param="model", code="model_not_found")
        return req

    def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                max_tokens=max_tokens, ignore_eos=req.ignore_eos, n=req.n, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
            )
        except BaigeError as e:
            raise APIError(str(e)) from None

    def prepared(prompts: list[str | list[int]], params: SamplingParams) -> list[tuple[str | list[int], SamplingParams]]:
        """Validate every prompt before anything runs (the same 400 whether streaming or not)."""
        out = []
        for p in prompts:
            try:
                _, ids, filled = eng.prepare(p, params)
            except BaigeError as e:
                raise APIError(str(e), param="prompt") from None
            out.append((ids, filled))
        return out

    def token_text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def collect(request: Request, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput] | None:
        """Final outputs of each stream; None when the client disconnected (which aborts them)."""
        async def run() -> list[RequestOutput]:
            final: list[RequestOutput | None] = [None] * len(gens)
            async for k, out in _merge(gens):
                final[k] = out
            return final

        task = asyncio.create_task(run())
        watch = asyncio.create_task(_until_disconnect(request))
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        return task.result()

    # ---- /v1/completions ------------------------------------------------------------------------
    def completion_logprobs(lps: list[Logprobs | None], offset0: int, token_ids: list[int] | None = None) -> dict:
        """OpenAI's completion ``logprobs`` object. ``token_ids`` default to each entry's own token; an
        entry of None (the first echoed prompt token, which nothing predicts) gives nulls."""
        ids = [lp.token_id for lp in lps] if token_ids is None else token_ids
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset0
        for t, lp in zip(ids, lps):
            text = token_text(t)
            tokens.append(text)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {token_text(a): v for a, v in lp.top})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
        if first is None or second is None:
            return first or second
        return {key: first[key] + second[key] for key in first}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(request, CompletionRequest)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
        prompts: list[str | list[int]]
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError("the prompt is empty", param="prompt")
        echo_only = req.echo and req.max_tokens == 0
        score_prompt = req.echo and req.logprobs is not None  # logprobs of the echoed prompt tokens too
        params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs)
        if score_prompt:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        jobs = prepared(prompts, params)
        prompt_texts = [x if isinstance(x, str) else tok.decode(x) for x in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name}
        n_prompt = sum(len(ids) for ids, _ in jobs)
        if echo_only:  # nothing generated; with logprobs, one scoring pass per prompt (its token discarded)
            plps: list[dict | None] = [None] * len(jobs)
            if score_prompt:
                gens = [engine.generate(ids, dataclasses.replace(sp, n=1), f"{rid}-{k}")
                        for k, (ids, sp) in enumerate(jobs)]
                finals = await collect(request, gens)
                if finals is None:
                    return Response(status_code=499)
                plps = [completion_logprobs(out.prompt_logprobs, 0, ids) for (ids, _), out in zip(jobs, finals)]
            choices = [{"index": k * n + i, "text": prompt_texts[k], "logprobs": plps[k], "finish_reason": "length"}
                       for k in range(len(prompts)) for i in range(n)]
            if not req.stream:
                return {**base, "choices": choices, "usage": usage(n_prompt, 0)}

            async def echo_stream() -> AsyncIterator[str]:
                for c in choices:
                    yield _sse({**base, "choices": [c]})
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({**base, "choices": [], "usage": usage(n_prompt, 0)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(echo_stream(), media_type="text/event-stream")
        gens = [engine.generate(ids, sp, f"{rid}-{k}") for k, (ids, sp) in enumerate(jobs)]

        if not req.stream:
            finals = await collect(request, gens)
            if finals is None:
                return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
            choices, n_out = [], 0
            for k, out in enumerate(finals):
                for o in out.outputs:
                    prefix = prompt_texts[k] if req.echo else ""
                    lp = completion_logprobs(o.logprobs, len(prefix)) if o.logprobs is not None else None
                    if score_prompt:
                        lp = join_logprobs(completion_logprobs(out.prompt_logprobs, 0, jobs[k][0]), lp)
                    choices.append({"index": k * n + o.index, "text": prefix + o.text, "logprobs": lp,
                                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
                    n_out += len(o.token_ids)
            return {**base, "choices": choices, "usage": usage(n_prompt, n_out)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream() -> AsyncIterator[str]:
            n_out = 0
            offsets = {}
            echoed: set[int] = set()

            def echo_chunks(k: int, prompt_lps: list[Logprobs | None] | None) -> list[str]:
                echoed.add(k)
                lp = completion_logprobs(prompt_lps, 0, jobs[k][0]) if prompt_lps is not None else None
                chunks = []
                for i in range(n):
                    offsets[k * n + i] = len(prompt_texts[k])
                    chunks.append(_sse({**base, "choices": [{"index": k * n + i, "text": prompt_texts[k],
                                                             "logprobs": lp, "finish_reason": None}]}))
                return chunks

            if req.echo and not score_prompt:  # the echo goes first; with prompt logprobs, once they exist
                for k in range(len(prompts)):
                    for chunk in echo_chunks(k, None):
                        yield chunk
            async for k, out in _merge(gens):
                if req.echo and k not in echoed:
                    for chunk in echo_chunks(k, out.prompt_logprobs):
                        yield chunk
                for o in out.outputs:
                    if not (o.delta_text or o.delta_token_ids or o.finished):
                        continue
                    idx = k * n + o.index
                    n_out += len(o.delta_token_ids)
                    lp = None
                    if o.logprobs is not None:
                        lp = completion_logprobs(o.delta_logprobs, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(o.delta_text)
                    yield _sse({**base, "choices": [{"index": idx, "text": o.delta_text, "logprobs": lp,
                                                     "finish_reason": o.finish_reason if o.finished else None}]})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage(n_prompt, n_out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    # ---- /v1/chat/completions -------------------------------------------------------------------
    def chat_logprobs(lps: list[Logprobs]) -> dict:
        def entry(t: int, v: float) -> dict:
            text = token_text(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                               param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        except BaigeError as e:
            raise APIError(str(e), param="messages") from None
        (ids, params), = prepared([ids], params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name}
        gen = engine.generate(ids, params, rid)

        if not req.stream:
            finals = await collect(request, [gen])
            if finals is None:
                return Response(status_code=499)
            (final,) = finals
            choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                        "logprobs": chat_logprobs(o.logprobs) if o.logprobs is not None else None,
                        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in final.outputs]
            n_out = sum(len(o.token_ids) for o in final.outputs)
            return {**base, "choices": choices, "usage": usage(len(ids), n_out)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk = {**base, "object": "chat.completion.chunk"}

        async def stream() -> AsyncIterator[str]:
            n_out = 0
            for i in range(params.n):
                yield _sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            async for _, out in _merge([gen]):
                for o in out.outputs:
                    if not (o.delta_text or o.delta_token_ids or o.finished):
                        continue
                    n_out += len(o.delta_token_ids)
                    delta = {"content": o.delta_text} if o.delta_text else {}
                    lp = chat_logprobs(o.delta_logprobs) if o.logprobs is not None else None
                    yield _sse({**chunk, "choices": [{"index": o.index, "delta": delta, "logprobs": lp,
                                                      "finish_reason": o.finish_reason if o.finished else None}]})
            if include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage(len(ids), n_out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def run_server(engine: AsyncEngine, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, log_level: str = "info") -> None:
    """Serve ``engine`` with uvicorn until interrupted; the engine thread is stopped on the way out."""
    import uvicorn

    try:
        uvicorn.run(build_app(engine, served_model_name, api_key), host=host, port=port, log_level=log_level.lower())
    finally:
        engine.shutdown()
