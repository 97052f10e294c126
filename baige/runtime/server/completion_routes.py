"""``/v1/completions``: one or several prompts (text or token ids), ``n`` choices each, ``echo`` (with
prompt logprobs when ``logprobs`` is set), whole or as server-sent events ending with ``data: [DONE]``."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from baige.runtime.infer.outputs import RequestOutput
from baige.runtime.infer.sampling import Logprobs, SamplingParams
from baige.runtime.server.protocol import APIError, CompletionRequest
from baige.runtime.server.serving import (
    DONE,
    ServerState,
    collect,
    completion_logprobs,
    event_stream,
    include_usage,
    join_logprobs,
    merge,
    parse,
    prepared,
    sampling_params,
    sse,
    state_of,
    usage,
)

router = APIRouter()


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


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError("the prompt is empty", param="prompt")
    return prompts


@router.post("/v1/completions")
async def completions(request: Request):
    st = state_of(request)
    req: CompletionRequest = await parse(request, CompletionRequest)
    prompts = completion_prompts(req)
    echo_only = req.echo and req.max_tokens == 0
    score_prompt = req.echo and req.logprobs is not None
    params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs, len(prompts), st.max_n)
    if score_prompt:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    if req.kv_transfer_params is not None and len(prompts) > 1:
        raise APIError("kv_transfer_params goes with one prompt", param="kv_transfer_params")
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
    gens = [
        st.engine.generate(ids, sp, f"{rid}-{k}", lora, kv_transfer_params=req.kv_transfer_params)
        for k, (ids, sp) in enumerate(jobs)
    ]
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
        yield DONE

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
    body = {**job.base, "choices": choices, "usage": usage(job.num_prompt_tokens, n_out)}
    if finals[0].kv_transfer_params is not None:  # a KV producer's answer: where its prefill's blocks wait
        body["kv_transfer_params"] = finals[0].kv_transfer_params
    return body


async def stream_completion(
    st: ServerState, job: CompletionJob, gens: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[str]:
    n, n_out = job.n, 0
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    ended: set[int] = set()  # choices whose finish chunk is sent: later outputs still list them, finished

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
            idx = k * n + o.index
            if idx in ended or not (o.delta_text or o.delta_token_ids or o.finished):
                continue
            if o.finished:
                ended.add(idx)
            n_out += len(o.delta_token_ids)
            lp = None
            if o.logprobs is not None:
                lp = completion_logprobs(st.tokenizer, o.delta_logprobs, offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + len(o.delta_text)
            choice = {"index": idx, "text": o.delta_text, "logprobs": lp, "finish_reason": None}
            if o.finished:  # the stop string or id that ended it on the last chunk, as the plain response's
                choice.update(finish_reason=o.finish_reason, stop_reason=o.stop_reason)
            yield sse({**job.base, "choices": [choice]})
    if include_usage(job.req):
        yield sse({**job.base, "choices": [], "usage": usage(job.num_prompt_tokens, n_out)})
    yield DONE
