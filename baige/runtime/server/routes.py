"""The route handlers: ``/health``, ``/metrics``, ``/v1/models``, ``/v1/completions`` (``stream: true``
as server-sent events ending with ``data: [DONE]``), and the helpers the chat route
(:mod:`.chat_routes`) shares with them.

Handlers are module-level functions over the :class:`ServerState` the app holds in
``app.state.baige``. A client that disconnects aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from baige.errors import BaigeError
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.outputs import EngineDeadError, RequestFailed, RequestOutput
from baige.runtime.infer.sampling import Logprobs, SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.server.metrics import Metrics
from baige.runtime.server.protocol import (
    APIError,
    CompletionRequest,
    SamplingFields,
    error_body,
    parse_body,
    validation_message,
)
from baige.runtime.server.tools import ToolConfig

DEFAULT_MAX_N = 128  # sequences one request may ask for (n x prompts); `baige serve --max-n`


@dataclass
class ServerState:
    """What every handler reads: the engine, the name it serves under, metrics, start time."""

    engine: AsyncEngine
    served_model_name: str
    metrics: Metrics
    created: int
    max_n: int = DEFAULT_MAX_N
    tools: ToolConfig | None = None  # tool calling: build_app sets it from the chat template and the flags

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

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
        lora = self.engine.engine.lora
        found = lora.loaded.get(model) if lora is not None else None
        if found is None:
            also = f" or its LoRA adapters ({', '.join(map(repr, lora.loaded))})" if lora and lora.loaded else ""
            raise APIError(
                f"the model `{model}` does not exist (this server serves `{self.served_model_name}`{also})",
                404,
                param="model",
                code="model_not_found",
            )
        # without its path: an adapter unloaded before the request reaches the engine is a 404 there,
        # never loaded again from disk (the offline load-on-first-use)
        return dataclasses.replace(found.request, lora_path="")


def state_of(request: Request) -> ServerState:
    return request.app.state.baige


# ---- helpers ------------------------------------------------------------------------------------
def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


async def collect(request: Request, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput] | None:
    """Final outputs of each stream; None when the client disconnected (which aborts them).

    Raises APIError 500 when the engine failed one of them (RequestFailed), 503 when the engine
    loop has stopped."""

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
    except (RequestFailed, EngineDeadError) as e:
        raise engine_error(e) from None


def engine_error(e: RequestFailed | EngineDeadError) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, code="engine_dead")
    if e.status == 400:
        return APIError(str(e), 400, param=e.param)
    return APIError(str(e), 500, code="internal_error")


async def guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A server-sent-event stream that ends with an error event and ``[DONE]`` when the engine
    fails the request (or stops) mid-stream, instead of a cut connection."""
    try:
        async for chunk in chunks:
            yield chunk
    except (RequestFailed, EngineDeadError) as e:
        err = engine_error(e)
        yield sse(error_body(err.message, err.status, code=err.code))
        yield "data: [DONE]\n\n"


def event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(guarded(chunks), media_type="text/event-stream")


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    """The request body validated by ``schema``. Raises APIError (400, 404 for another model,
    503 when the engine loop has stopped)."""
    st = state_of(request)
    if not st.engine.is_alive:
        raise APIError("the engine loop has stopped; restart the server", 503, code="engine_dead")
    body = parse_body(await request.body())
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(msg, param=param) from None
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
    error names the field the request gave it in (``response_format`` or ``structured_outputs``)."""

    def run() -> list[tuple[list[int], SamplingParams]]:
        out = []
        for p in prompts:
            try:
                _, ids, filled = st.engine.engine.prepare(p, params)
            except BaigeError as e:
                param = e.param or "prompt"
                if param == "structured_outputs" and req.structured_outputs is None and req.response_format:
                    param = "response_format"
                raise APIError(str(e), param=param) from None
            out.append((ids, filled))
        return out

    return await asyncio.to_thread(run)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---- small endpoints ----------------------------------------------------------------------------
async def health(request: Request) -> Response:
    """200 while the engine loop runs, 503 once it has stopped (the process then exits)."""
    return Response(status_code=200 if state_of(request).engine.is_alive else 503)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict:
    """The base model, then every loaded LoRA adapter with ``parent`` = the base (vLLM's listing)."""
    st = state_of(request)
    max_len = st.engine.engine.max_model_len
    data = [
        {
            "id": st.served_model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "baige",
            "root": st.served_model_name,
            "parent": None,
            "max_model_len": max_len,
        }
    ]
    lora = st.engine.engine.lora
    for name, loaded in list(lora.loaded.items()) if lora is not None else []:
        data.append(
            {
                "id": name,
                "object": "model",
                "created": st.created,
                "owned_by": "baige",
                "root": loaded.request.lora_path,
                "parent": st.served_model_name,
                "max_model_len": max_len,
            }
        )
    return {"object": "list", "data": data}


# ---- /v1/completions ----------------------------------------------------------------------------
@dataclass
class CompletionJob:
    """A parsed /v1/completions request, its prompts validated."""

    req: CompletionRequest
    jobs: list[tuple[list[int], SamplingParams]]
    prompt_texts: list[str]
    base: dict
    score_prompt: bool  # logprobs of the echoed prompt tokens too

    @property
    def n(self) -> int:
        return self.jobs[0][1].n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.jobs)


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
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError("the prompt is empty", param="prompt")
    return prompts


async def completions(request: Request):
    st = state_of(request)
    req: CompletionRequest = await parse(request, CompletionRequest)
    prompts = completion_prompts(req)
    echo_only = req.echo and req.max_tokens == 0
    score_prompt = req.echo and req.logprobs is not None
    params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs, len(prompts), st.max_n)
    if score_prompt:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    jobs = await prepared(st, prompts, params, req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    lora = st.lora_request(req.model)
    base = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model or st.served_model_name,
    }
    job = CompletionJob(
        req, jobs, [x if isinstance(x, str) else st.tokenizer.decode(x) for x in prompts], base, score_prompt
    )
    if echo_only:
        return await echo_only_completion(request, st, job)
    gens = [st.engine.generate(ids, sp, f"{rid}-{k}", lora) for k, (ids, sp) in enumerate(jobs)]
    if not req.stream:
        return await plain_completion(request, st, job, gens)
    return event_stream(stream_completion(st, job, gens))


async def echo_only_completion(request: Request, st: ServerState, job: CompletionJob):
    """``echo`` with ``max_tokens: 0``: nothing generated; with logprobs, one scoring pass per prompt
    (its sampled token discarded)."""
    plps: list[dict | None] = [None] * len(job.jobs)
    if job.score_prompt:
        gens = [
            st.engine.generate(
                ids, dataclasses.replace(sp, n=1), f"{job.base['id']}-{k}", st.lora_request(job.req.model)
            )
            for k, (ids, sp) in enumerate(job.jobs)
        ]
        finals = await collect(request, gens)
        if finals is None:
            return Response(status_code=499)
        plps = [
            completion_logprobs(st.tokenizer, out.prompt_logprobs, 0, ids) for (ids, _), out in zip(job.jobs, finals)
        ]
    n = job.n
    choices = [
        {"index": k * n + i, "text": job.prompt_texts[k], "logprobs": plps[k], "finish_reason": "length"}
        for k in range(len(job.jobs))
        for i in range(n)
    ]
    if not job.req.stream:
        return {**job.base, "choices": choices, "usage": usage(job.num_prompt_tokens, 0)}

    async def echo_stream() -> AsyncIterator[str]:
        for c in choices:
            yield sse({**job.base, "choices": [c]})
        if include_usage(job.req):
            yield sse({**job.base, "choices": [], "usage": usage(job.num_prompt_tokens, 0)})
        yield "data: [DONE]\n\n"

    return event_stream(echo_stream())


async def plain_completion(
    request: Request, st: ServerState, job: CompletionJob, gens: list[AsyncIterator[RequestOutput]]
):
    finals = await collect(request, gens)
    if finals is None:
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    choices, n_out = [], 0
    for k, out in enumerate(finals):
        for o in out.outputs:
            prefix = job.prompt_texts[k] if job.req.echo else ""
            lp = completion_logprobs(st.tokenizer, o.logprobs, len(prefix)) if o.logprobs is not None else None
            if job.score_prompt:
                lp = join_logprobs(completion_logprobs(st.tokenizer, out.prompt_logprobs, 0, job.jobs[k][0]), lp)
            choices.append(
                {
                    "index": k * job.n + o.index,
                    "text": prefix + o.text,
                    "logprobs": lp,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
            )
            n_out += len(o.token_ids)
    return {**job.base, "choices": choices, "usage": usage(job.num_prompt_tokens, n_out)}


async def stream_completion(
    st: ServerState, job: CompletionJob, gens: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[str]:
    n, n_out = job.n, 0
    offsets: dict[int, int] = {}
    echoed: set[int] = set()

    def echo_chunks(k: int, prompt_lps: list[Logprobs | None] | None) -> list[str]:
        echoed.add(k)
        lp = completion_logprobs(st.tokenizer, prompt_lps, 0, job.jobs[k][0]) if prompt_lps is not None else None
        chunks = []
        for i in range(n):
            offsets[k * n + i] = len(job.prompt_texts[k])
            chunks.append(
                sse(
                    {
                        **job.base,
                        "choices": [
                            {"index": k * n + i, "text": job.prompt_texts[k], "logprobs": lp, "finish_reason": None}
                        ],
                    }
                )
            )
        return chunks

    if job.req.echo and not job.score_prompt:  # the echo goes first; with prompt logprobs, once they exist
        for k in range(len(job.jobs)):
            for chunk in echo_chunks(k, None):
                yield chunk
    async for k, out in merge(gens):
        if job.req.echo and k not in echoed:
            for chunk in echo_chunks(k, out.prompt_logprobs):
                yield chunk
        for o in out.outputs:
            if not (o.delta_text or o.delta_token_ids or o.finished):
                continue
            idx = k * n + o.index
            n_out += len(o.delta_token_ids)
            lp = None
            if o.logprobs is not None:
                lp = completion_logprobs(st.tokenizer, o.delta_logprobs, offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + len(o.delta_text)
            yield sse(
                {
                    **job.base,
                    "choices": [
                        {
                            "index": idx,
                            "text": o.delta_text,
                            "logprobs": lp,
                            "finish_reason": o.finish_reason if o.finished else None,
                        }
                    ],
                }
            )
    if include_usage(job.req):
        yield sse({**job.base, "choices": [], "usage": usage(job.num_prompt_tokens, n_out)})
    yield "data: [DONE]\n\n"


# ---- /v1/chat/completions -----------------------------------------------------------------------
