"""The shared serving plumbing of ``baige.runtime.server.serving`` without a server: how an engine's
refusal or failure after a stream has begun reaches the client (an OpenAI error event, then
``[DONE]``), the status each engine error maps to, and how ``merge`` interleaves several streams."""

from __future__ import annotations

import asyncio
import json

import pytest

from baige.errors import BaigeError
from baige.runtime.infer.lora import LoRANotFound
from baige.runtime.infer.outputs import EngineDeadError, RequestFailed
from baige.runtime.server.serving import DONE, engine_error, guarded, join_logprobs, merge, usage


async def _drain(chunks) -> list[str]:
    return [c async for c in chunks]


def _events(chunks: list[str]) -> list:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks), chunks
    return [c[6:-2] if c == DONE else json.loads(c[6:-2]) for c in chunks]


@pytest.mark.parametrize(
    "error, status, kind, param, code",
    [
        (
            LoRANotFound("the LoRA adapter 'sql' is not loaded", param="model"),
            404,
            "not_found_error",
            "model",
            "model_not_found",
        ),
        (BaigeError("bad stop", param="stop"), 400, "invalid_request_error", "stop", None),
        (
            RequestFailed("cannot follow", 400, "structured_outputs"),
            400,
            "invalid_request_error",
            "structured_outputs",
            None,
        ),
        (RequestFailed("step failed"), 500, "server_error", None, "internal_error"),
        (EngineDeadError("the engine loop stopped"), 503, "service_unavailable", None, "engine_dead"),
    ],
)
def test_an_engine_error_mid_stream_ends_it_with_an_openai_error_event(error, status, kind, param, code):
    async def chunks():
        yield "data: {}\n\n"
        raise error

    assert engine_error(error).status == status
    first, err, done = _events(asyncio.run(_drain(guarded(chunks()))))
    assert first == {} and done == "[DONE]"
    assert err == {"error": {"message": str(error), "type": kind, "param": param, "code": code}}


def test_a_programming_error_is_not_swallowed_by_the_stream():
    async def chunks():
        yield "data: {}\n\n"
        raise KeyError("bug")

    with pytest.raises(KeyError):
        asyncio.run(_drain(guarded(chunks())))


def test_merge_tags_each_output_with_its_stream_and_fails_with_the_first_error():
    async def stream(items, delay):
        for x in items:
            await asyncio.sleep(delay)
            if isinstance(x, BaseException):
                raise x
            yield x

    async def run(gens):
        return [pair async for pair in merge(gens)]

    got = asyncio.run(run([stream(["a", "b"], 0.01), stream(["c"], 0.0)]))
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")]
    assert [x for k, x in got if k == 0] == ["a", "b"]  # each stream's order kept
    with pytest.raises(RequestFailed, match="boom"):
        asyncio.run(run([stream(["a", "b", "c"], 0.05), stream(["x", RequestFailed("boom")], 0.0)]))


def test_usage_and_joined_logprobs():
    assert usage(7, 5) == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    prompt = {"tokens": ["a"], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    completion = {"tokens": ["b"], "token_logprobs": [-0.5], "top_logprobs": [{"b": -0.5}], "text_offset": [1]}
    assert join_logprobs(prompt, completion) == {
        "tokens": ["a", "b"],
        "token_logprobs": [None, -0.5],
        "top_logprobs": [None, {"b": -0.5}],
        "text_offset": [0, 1],
    }
    assert join_logprobs(None, completion) is completion and join_logprobs(prompt, None) is prompt
