"""What every route shares (vLLM's ``serving_engine``): the :class:`ServerState` the app holds in
``app.state.baige``, request validation, sampling parameters, prompt preparation, collecting and
merging the output streams of ``n > 1`` and of several prompts, server-sent-event framing, OpenAI's
logprob objects and ``usage``.

Route modules (``*_routes``) import from here and never from each other; they reach the engine
through :class:`AsyncEngine`'s public methods only (``tests/test_architecture.py`` enforces both).
A client that disconnects aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from baige.errors import BaigeError
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.lora import LoRANotFound, LoRARequest
from baige.runtime.infer.outputs import EngineDeadError, RequestAborted, RequestFailed, RequestOutput
from baige.runtime.infer.sampling import Logprobs, SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.server.lifecycle import Lifecycle
from baige.runtime.server.metrics import Metrics
from baige.runtime.server.protocol import APIError, SamplingFields, error_body, parse_body, validation_message
from baige.runtime.server.reasoning import ReasoningConfig
from baige.runtime.server.responses import ResponseStore
from baige.runtime.server.tools import ToolConfig

DEFAULT_MAX_N = 128  # sequences one request may ask for (n x prompts); `baige serve --max-n`
DONE = "data: [DONE]\n\n"  # the last event of every stream (OpenAI's)


@dataclass
class ServerState:
    """What every handler reads: the engine, the name it serves under, metrics, start time, the shutdown state."""

    engine: AsyncEngine
    served_model_name: str
    metrics: Metrics
    created: int
    max_n: int = DEFAULT_MAX_N
    tools: ToolConfig | None = None  # tool calling: build_app sets it from the chat template and the flags
    reasoning: ReasoningConfig | None = None  # --reasoning-parser (None: outputs are not split)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' stored responses
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # draining, requests in flight (lifecycle.py)

    @property
    def draining(self) -> bool:
        """A stop signal has come: /health and new requests answer 503 (:mod:`.lifecycle`)."""
        return self.lifecycle.draining

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names: None for the base model (or no name).

        The request carries no ``lora_path``, so the engine resolves it by name when it adds it: an
        adapter unloaded meanwhile is then LoRANotFound (a 404) instead of being loaded again.

        Raises:
            APIError: 404 (OpenAI's ``model_not_found``) for a name that is neither the base nor a
            loaded adapter.
        """
        if model is None or model == self.served_model_name:
            return None
        adapters = self.engine.lora_adapters()
        found = adapters.get(model)
        if found is None:
            also = f" or its LoRA adapters ({', '.join(map(repr, adapters))})" if adapters else ""
            raise APIError(
                f"the model `{model}` does not exist (this server serves `{self.served_model_name}`{also})",
                404,
                param="model",
                code="model_not_found",
            )
        # without its path: an adapter unloaded before the request reaches the engine is a 404 there,
        # never loaded again from disk (the offline load-on-first-use)
        return dataclasses.replace(found, lora_path="")


def state_of(request: Request) -> ServerState:
    return request.app.state.baige


# ---- validation ---------------------------------------------------------------------------------
async def validated(request: Request, schema: type[BaseModel]) -> Any:
    """The request's JSON body validated by ``schema``. Raises APIError (400) naming the bad field."""
    body = parse_body(await request.body())
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(msg, param=param) from None


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    """A generation request's body validated by ``schema`` (its ``model`` served here). Raises APIError
    (400, 404 for another model, 503 when the engine loop has stopped)."""
    st = state_of(request)
    if not st.engine.is_alive:
        raise APIError("the engine loop has stopped; restart the server", 503, code="engine_dead")
    req = await validated(request, schema)
    st.lora_request(req.model)  # 404 for a model name it does not serve
    return req


def sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, num_prompts: int, max_n: int
) -> SamplingParams:
    """The engine's parameters for a request's sampling fields. Raises APIError."""
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if req.n * num_prompts > max_n:
        what = f"n={req.n} x {num_prompts} prompts" if num_prompts > 1 else f"n={req.n}"
        raise APIError(f"{what} asks for more than the {max_n} sequences a request may have (--max-n)", param="n")
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=req.logit_bias_ids(),
            allowed_token_ids=req.allowed_token_ids,
            structured_outputs=req.constraint(),
        )
    except BaigeError as e:
        raise APIError(str(e), param=e.param) from None


async def prepared(
    st: ServerState, prompts: list[str | list[int]], params: SamplingParams, req: SamplingFields
) -> list[tuple[list[int], SamplingParams]]:
    """Validate and tokenize every prompt before anything runs (the same 400 whether streaming or
    not), off the event loop so a long prompt does not stall other clients' streams. A constraint's
    error names the field the request gave it in (``response_format``, ``structured_outputs``, or
    ``tool_choice`` for a forced tool call); a chat request's prompt error names ``messages``."""

    def run() -> list[tuple[list[int], SamplingParams]]:
        out = []
        for p in prompts:
            try:
                out.append(st.engine.prepare(p, params))
            except BaigeError as e:
                param = e.param or "prompt"
                if param == "prompt" and hasattr(req, "messages"):  # a chat request's prompt is its messages
                    param = "messages"
                if param == "structured_outputs" and req.structured_outputs is None:  # the constraint's source
                    forced = getattr(req, "tool_choice", None) is not None
                    param = "response_format" if req.response_format else "tool_choice" if forced else param
                raise APIError(str(e), param=param) from None
        return out

    return await asyncio.to_thread(run)


# ---- collecting and merging outputs -------------------------------------------------------------
async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as they produce, each output with its stream's index;
    cancelling the consumer cancels them all."""
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


async def until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


async def collect(request: Request, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput] | None:
    """Final outputs of each stream; None when the client disconnected (which aborts them).

    Raises APIError (:func:`engine_error`) when the engine refused or failed one of them."""

    async def run() -> list[RequestOutput]:
        final: list[RequestOutput | None] = [None] * len(gens)
        async for k, out in merge(gens):
            final[k] = out
        return final

    task = asyncio.create_task(run())
    watch = asyncio.create_task(until_disconnect(request))
    await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    try:
        return task.result()
    except (RequestFailed, EngineDeadError, BaigeError) as e:
        raise engine_error(e) from None


def engine_error(e: RequestFailed | EngineDeadError | BaigeError) -> APIError:
    """The HTTP error of a request the engine refused or failed after the route had checked it: 404
    for an adapter unloaded meanwhile (LoRANotFound), 400 for another user error, 500 for a failure
    inside the engine, 503 once the engine loop has stopped or when the server's shutdown aborted it
    (RequestAborted: ``code: server_shutting_down``)."""
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, code="engine_dead")
    if isinstance(e, RequestAborted):
        return APIError(str(e), 503, code="server_shutting_down")
    if isinstance(e, LoRANotFound):
        return APIError(str(e), 404, param=e.param, code="model_not_found")
    if isinstance(e, BaigeError) or e.status == 400:
        return APIError(str(e), 400, param=e.param)
    return APIError(str(e), 500, code="internal_error")


# ---- server-sent events -------------------------------------------------------------------------
def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A server-sent-event stream that ends with an error event (OpenAI's error body,
    :func:`engine_error`) and ``[DONE]`` when the engine refuses or fails the request (or stops)
    once the stream has begun, instead of a cut connection."""
    try:
        async for chunk in chunks:
            yield chunk
    except (RequestFailed, EngineDeadError, BaigeError) as e:
        err = engine_error(e)
        yield sse(error_body(err.message, err.status, err.param, err.code))
        yield DONE


def event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(guarded(chunks), media_type="text/event-stream")


# ---- logprobs and usage -------------------------------------------------------------------------
def completion_logprobs(
    tok: Tokenizer, lps: list[Logprobs | None], offset0: int, token_ids: list[int] | None = None
) -> dict:
    """OpenAI's completion ``logprobs`` object. ``token_ids`` default to each entry's own token; an
    entry of None (the first echoed prompt token, which nothing predicts) gives nulls."""
    ids = [lp.token_id for lp in lps] if token_ids is None else token_ids
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    for t, lp in zip(ids, lps):
        text = tok.decode([t], skip_special_tokens=False)
        tokens.append(text)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {tok.decode([a], skip_special_tokens=False): v for a, v in lp.top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two completion ``logprobs`` objects one after the other (the echoed prompt's, the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tok: Tokenizer, lps: list[Logprobs]) -> dict:
    """OpenAI's chat ``logprobs`` object: ``content`` entries with token, logprob, UTF-8 bytes and top alternatives."""

    def entry(t: int, v: float) -> dict:
        text = tok.decode([t], skip_special_tokens=False)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
