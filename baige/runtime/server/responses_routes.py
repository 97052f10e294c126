"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes a chat conversation (:mod:`.responses`: instructions, the stored conversation of
``previous_response_id``, the input items), runs through the chat pipeline (:mod:`.chat`: tools,
``text.format`` as a structured-output constraint, the reasoning parser), and its output becomes
reasoning, message and function-call items, whole or as the typed stream events (``event: TYPE`` and
``data: {...}`` with a ``sequence_number``). ``store`` (default true) keeps the response and its
conversation in memory (:class:`~.responses.ResponseStore`) under the caller's API key.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from baige.errors import BaigeError
from baige.runtime.infer.outputs import EngineDeadError, RequestFailed, RequestOutput
from baige.runtime.server.chat import ChatJob, prepare_chat
from baige.runtime.server.protocol import APIError, ChatCompletionRequest, validation_message
from baige.runtime.server.responses import (
    OutputBuilder,
    chat_body,
    conversation,
    new_id,
    output_messages,
    owner_of,
    response_object,
    response_usage,
)
from baige.runtime.server.responses_protocol import ResponsesRequest
from baige.runtime.server.serving import ServerState, collect, engine_error, merge, parse, sampling_params, state_of

router = APIRouter()

# the chat request's fields that a Responses request calls otherwise
RESPONSES_PARAM = {
    "messages": "input",
    "response_format": "text",
    "structured_outputs": "text",
    "max_tokens": "max_output_tokens",
    "prompt": "input",
}


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request of a Responses request. Raises APIError (400) naming the field."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(req, messages))
    except ValidationError as e:
        msg, _ = validation_message(e)
        raise APIError(f"input: {msg}", param="input") from None


def reasoning_tokens(st: ServerState, ids: list[int], reasoned: bool) -> int:
    """Output tokens spent reasoning: up to and including the end marker (all of them when cut off)."""
    cfg = st.reasoning
    if not reasoned or cfg is None or cfg.end_id is None:
        return 0
    return ids.index(cfg.end_id) + 1 if cfg.end_id in ids else len(ids)


class Turn:
    """One Responses request in flight: what it was asked, its chat job, and how it is answered."""

    def __init__(self, st: ServerState, req: ResponsesRequest, owner: str, messages: list[dict], job: ChatJob):
        self.st, self.req, self.owner, self.job, self.messages = st, req, owner, job, messages
        self.rid, self.created = new_id("resp"), int(time.time())
        self.model = req.model or st.served_model_name
        self.reader, self.builder = job.reader(), OutputBuilder()

    def response(self, status: str, final: RequestOutput | None = None) -> dict:
        usage = None
        if final is not None:
            o = final.outputs[0]
            n_reason = reasoning_tokens(self.st, o.token_ids, self.reader.reasoned)
            usage = response_usage(len(final.prompt_token_ids), len(o.token_ids), n_reason, final.num_cached_tokens)
        return response_object(self.req, self.rid, self.created, self.model, self.builder.items, status, usage)

    def finish(self, final: RequestOutput) -> dict:
        """The completed response, stored unless ``store`` is false."""
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        resp = self.response(status, final)
        if self.req.store:
            own = self.messages[1:] if self.req.instructions else self.messages  # instructions do not carry over
            self.st.responses.put(self.owner, resp, own + output_messages(self.builder.items))
        return resp


@router.post("/v1/responses")
async def create_response(request: Request):
    st = state_of(request)
    req: ResponsesRequest = await parse(request, ResponsesRequest)
    owner = owner_of(request.headers.get("authorization"))
    previous = []
    if req.previous_response_id is not None:
        previous = st.responses.get(owner, req.previous_response_id, "previous_response_id").messages
    messages = conversation(req, previous)
    chat = chat_request(req, messages)
    try:
        params = sampling_params(chat, req.max_output_tokens, None, 1, st.max_n)
        job = await prepare_chat(st, chat, params, max_tool_calls=req.max_tool_calls)
    except APIError as e:  # the chat pipeline names chat fields: name the Responses request's
        e.param = RESPONSES_PARAM.get(e.param, e.param)
        raise
    turn = Turn(st, req, owner, messages, job)
    gen = st.engine.generate(job.ids, job.params, turn.rid, st.lora_request(req.model))
    if req.stream:
        return StreamingResponse(stream_response(turn, gen), media_type="text/event-stream")
    finals = await collect(request, [gen])
    if finals is None:
        return Response(status_code=499)
    (final,) = finals
    o = final.outputs[0]
    turn.builder.feed(turn.reader.feed(o.token_ids, o.text) + turn.reader.finish())
    turn.builder.close()
    return turn.finish(final)


def event(obj: dict, seq: int) -> str:
    """One server-sent event of the Responses stream: ``event: TYPE`` and the object with its number."""
    obj = {**obj, "sequence_number": seq}
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream_response(turn: Turn, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """The typed events of one response, numbered from 0; a failure after the stream began is an
    ``error`` event (OpenAI's) and ``response.failed``."""
    seq = 0

    def emit(events: list[dict]) -> list[str]:
        nonlocal seq
        out = [event(e, seq + k) for k, e in enumerate(events)]
        seq += len(events)
        return out

    for chunk in emit(
        [
            {"type": "response.created", "response": turn.response("in_progress")},
            {"type": "response.in_progress", "response": turn.response("in_progress")},
        ]
    ):
        yield chunk
    final = None
    try:
        async for _, out in merge([gen]):
            o = out.outputs[0]
            events = turn.reader.feed(o.delta_token_ids, o.delta_text)
            if o.finished:
                events += turn.reader.finish()
            for chunk in emit(turn.builder.feed(events)):
                yield chunk
            final = out
    except (RequestFailed, EngineDeadError, BaigeError) as e:
        err = engine_error(e)
        for chunk in emit(
            [
                {"type": "error", "code": err.code, "message": err.message, "param": err.param},
                {
                    "type": "response.failed",
                    "response": {
                        **turn.response("failed"),
                        "error": {"code": err.code or "server_error", "message": err.message},
                    },
                },
            ]
        ):
            yield chunk
        return
    for chunk in emit(turn.builder.close()):
        yield chunk
    resp = turn.finish(final)
    kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
    for chunk in emit([{"type": kind, "response": resp}]):
        yield chunk


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    st = state_of(request)
    return st.responses.get(owner_of(request.headers.get("authorization")), response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    st = state_of(request)
    st.responses.delete(owner_of(request.headers.get("authorization")), response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
