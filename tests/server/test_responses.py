"""`POST /v1/responses` through `baige serve --reasoning-parser auto` and the official openai client, on the
Qwen3-style chain checkpoint (tests/reasoning_utils.py: greedy output `<think> Okay, the user asks about
Paris.</think> It is sunny.`): text with its reasoning item, the typed stream events in OpenAI's order and
numbered, a function tool call round trip through `previous_response_id`, `text.format` json_schema, the
store (GET, DELETE, `store: false`, another API key), and bad input as 4xx naming the field."""

import json

import httpx
import jsonschema
import openai
import pytest
from reasoning_utils import ANSWER_TEXT, REASONING_TEXT, SERVE_ARGS, write_reasoning_checkpoint
from server_utils import launched

from baige.runtime.model.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_reasoning_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def url(model):
    with launched(model, "--served-model-name", "chain", *SERVE_ARGS) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0, timeout=300)


def items(response) -> list[tuple]:
    """(type, text or (name, arguments)) of each output item."""
    out = []
    for it in response.output:
        if it.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in it.content)))
        elif it.type == "message":
            out.append(("message", "".join(c.text for c in it.content)))
        else:
            out.append((it.type, (it.name, it.arguments)))
    return out


def test_text_response_with_reasoning_item(client):
    r = client.responses.create(model="chain", input="What is the weather in Paris?", temperature=0)
    assert (r.object, r.status, r.model) == ("response", "completed", "chain")
    assert items(r) == [("reasoning", REASONING_TEXT), ("message", ANSWER_TEXT)]
    assert r.output_text == ANSWER_TEXT
    # 8 reasoning tokens: <think>, six words, </think>; then three words and <|im_end|>
    assert (r.usage.output_tokens, r.usage.output_tokens_details.reasoning_tokens) == (12, 8)
    assert r.usage.total_tokens == r.usage.input_tokens + 12


def test_stateless_client_with_encrypted_reasoning_include(client):
    """Codex CLI's way: ``store: false`` and ``include: ["reasoning.encrypted_content"]``, then the previous
    output items sent back as input. The reasoning item comes back as text (no encrypted_content) and the
    round trip is accepted: the second reply is the checkpoint's greedy answer again."""
    r = client.responses.create(
        model="chain", input="What is the weather in Paris?", temperature=0, store=False,
        include=["reasoning.encrypted_content"],
    )  # fmt: skip
    assert items(r) == [("reasoning", REASONING_TEXT), ("message", ANSWER_TEXT)]
    assert getattr(r.output[0], "encrypted_content", None) is None
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    history += [it.model_dump(exclude_none=True) for it in r.output]
    history.append({"role": "user", "content": "And tomorrow?"})
    r2 = client.responses.create(
        model="chain", input=history, temperature=0, store=False, include=["reasoning.encrypted_content"]
    )
    assert r2.status == "completed" and items(r2)[-1] == ("message", ANSWER_TEXT)


def test_instructions_and_max_output_tokens(client):
    r = client.responses.create(
        model="chain", instructions="Be brief.", input=[{"role": "user", "content": "hi"}], max_output_tokens=4
    )
    assert (r.status, r.incomplete_details.reason, r.instructions) == ("incomplete", "max_output_tokens", "Be brief.")
    assert items(r) == [("reasoning", " Okay, the user")]


MESSAGE_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 3,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
REASONING_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    *["response.reasoning_text.delta"] * 6,
    "response.reasoning_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_stream_event_order(client):
    with client.responses.stream(model="chain", input="hi", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        *REASONING_EVENTS,
        *MESSAGE_EVENTS,
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER_TEXT
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING_TEXT
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert items(final) == [("reasoning", REASONING_TEXT), ("message", ANSWER_TEXT)]
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_function_call_round_trip(client, model):
    kwargs = dict(model="chain", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0)
    first = client.responses.create(input=[{"role": "user", "content": "Weather in Paris?"}], **kwargs)
    assert items(first) == [("reasoning", REASONING_TEXT), ("function_call", ("get_weather", '{"city": "Paris"}'))]
    call = first.output[1]
    assert call.call_id.startswith("call_") and call.status == "completed"
    # streamed: the call's events, its arguments in fragments that join to the same call
    with client.responses.stream(input="Weather in Paris?", **kwargs) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    start = kinds.index("response.output_item.added", 3)  # the call item, after the reasoning item
    n_args = kinds.count("response.function_call_arguments.delta")
    assert n_args > 1 and kinds[start:] == [
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * n_args,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-3]
    assert (done.name, done.arguments) == ("get_weather", '{"city": "Paris"}')
    # the tool's output goes back with previous_response_id: the stored conversation continues
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}]
    second = client.responses.create(
        model="chain", previous_response_id=first.id, input=answer, tools=[WEATHER], temperature=0
    )
    assert second.previous_response_id == first.id
    assert items(second) == [("reasoning", REASONING_TEXT), ("message", ANSWER_TEXT)]
    # an output whose call_id answers no call of the previous response (nor of the input) is a 400 naming it
    stray = [{**answer[0], "call_id": "call_stray"}]
    with pytest.raises(openai.BadRequestError, match="call_stray") as bad:
        client.responses.create(model="chain", previous_response_id=first.id, input=stray, tools=[WEATHER])
    assert bad.value.body["param"] == "input"
    # the earlier turn is in the prompt: the question, the call and its output, rendered as one chat
    tok = Tokenizer.from_dir(model)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'},
    ]
    assert second.usage.input_tokens == len(tok.apply_chat_template(history, tools=[chat_tool]))


def test_max_tool_calls_caps_the_calls(client):
    """Forced parallel calls: uncapped, the chain model calls again and again until max_output_tokens cuts
    it; max_tool_calls N constrains the list to N calls, which then ends normally."""
    kwargs = dict(model="chain", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0)
    uncapped = client.responses.create(max_output_tokens=200, **kwargs)
    assert uncapped.status == "incomplete" and len([i for i in items(uncapped) if i[0] == "function_call"]) > 2
    for cap in (1, 2):
        r = client.responses.create(max_output_tokens=200, max_tool_calls=cap, **kwargs)
        assert r.status == "completed" and r.max_tool_calls == cap
        assert (
            items(r)
            == [("reasoning", REASONING_TEXT)] + [("function_call", ("get_weather", '{"city": "Paris"}'))] * cap
        )


def test_a_call_cut_off_by_max_output_tokens_still_continues(client, model):
    """A call truncated by max_output_tokens is stored as written (incomplete, arguments not JSON); the
    conversation goes on with its output, as do client-sent arguments that are not JSON (OpenAI takes
    arguments strings as given): the prompt shows the model the text as a JSON string."""
    kwargs = dict(model="chain", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0)
    full = client.responses.create(input="Weather in Paris?", **kwargs)
    cut = client.responses.create(input="Weather in Paris?", max_output_tokens=full.usage.output_tokens - 2, **kwargs)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    call = cut.output[-1]
    assert call.type == "function_call" and '{"city": "Paris"}'.startswith(call.arguments) and call.arguments
    assert call.status == "incomplete"  # its arguments are not a complete call (OpenAI's item status)
    with client.responses.stream(input="Weather in Paris?", max_output_tokens=cut.usage.output_tokens, **kwargs) as s:
        done = [e.item for e in s if e.type == "response.output_item.done"]
    assert (done[-1].type, done[-1].status, done[-1].arguments) == ("function_call", "incomplete", call.arguments)
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "?"}]
    second = client.responses.create(model="chain", previous_response_id=cut.id, input=answer, temperature=0)
    assert second.status == "completed" and items(second)[-1] == ("message", ANSWER_TEXT)
    sent = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{not json"}, answer[0]]
    sent[1] = {**sent[1], "call_id": "c1"}
    third = client.responses.create(model="chain", input=[{"role": "user", "content": "q"}, *sent], max_output_tokens=4)
    history = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "?"},
    ]
    assert third.usage.input_tokens == len(Tokenizer.from_dir(model).apply_chat_template(history))


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"sky": {"enum": ["clear", "grey"]}, "rain": {"type": "boolean"}},
        "required": ["sky", "rain"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    r = client.responses.create(model="chain", input="weather?", text=fmt, temperature=0)
    assert items(r)[0] == ("reasoning", REASONING_TEXT)  # the constraint starts after the reasoning
    jsonschema.validate(json.loads(r.output_text), schema)
    with client.responses.stream(model="chain", input="weather?", text=fmt, temperature=0) as stream:
        list(stream)
        assert stream.get_final_response().output_text == r.output_text


def test_store_get_delete_and_other_keys(client, url):
    r = client.responses.create(model="chain", input="hi", temperature=0)
    assert client.responses.retrieve(r.id).output_text == ANSWER_TEXT
    other = openai.OpenAI(base_url=f"{url}/v1", api_key="key-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="chain", input="hi", previous_response_id=r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="chain", input="hi", temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools"),
        ({"input": "hi", "tool_choice": {"type": "computer_use_preview"}}, 400, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": [], "instructions": "only"}, 400, "input"),
        # include: the values this server cannot honour (logprobs, built-in tools' outputs, ...) are refused
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include"),
        ({"input": "hi", "include": ["reasoning.encrypted_content", "file_search_call.results"]}, 400, "include"),
        ({"input": "hi", "include": ["no.such.value"]}, 400, "include"),
        ({"input": "hi", "max_tool_calls": 0}, 400, "max_tool_calls"),
        # a function_call_output needs a function_call before it with its call_id
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, 400, "input"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c2", "output": "x"},
                ]
            },
            400,
            "input",
        ),
    ],
)
def test_bad_input_is_named(url, body, status, param):
    r = httpx.post(f"{url}/v1/responses", json={"model": "chain", **body}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
