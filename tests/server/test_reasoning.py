"""Reasoning output (`baige serve --reasoning-parser`): the parsers on token ids and text chunked every way,
the engine's constraint deferred to the end of the reasoning, and through `baige serve` with the official
openai client on tiny checkpoints whose greedy output is `<think> Okay, the user asks about Paris.</think>
It is sunny.` (tests/reasoning_utils.py), with a Qwen3-style and a DeepSeek-R1-style chat template:
reasoning and content split exactly, whole and streamed, and tool calls after the reasoning complete in
both modes."""

import json
import random

import httpx
import jsonschema
import openai
import pytest
from reasoning_utils import ANSWER_TEXT, REASONING_TEXT, SERVE_ARGS, write_reasoning_checkpoint
from server_utils import launched

from baige.errors import BaigeError
from baige.runtime.server.reasoning import (
    HarmonyStream,
    ReasoningConfig,
    ThinkStream,
    detect,
    reasoning_config,
)

QWEN3 = ReasoningConfig("qwen3", start_id=1, end_id=2)
R1 = ReasoningConfig("deepseek_r1", start_id=1, end_id=2)


def run(stream, tokens: list[tuple[int, str]], cuts: list[int], lag: int = 0) -> tuple[str, str]:
    """Feed ``tokens`` (id, text) in chunks ending at ``cuts``; the text lags ``lag`` characters behind
    the ids (a stop string holding text back) until the end. Returns (reasoning, content)."""
    text = "".join(t for _, t in tokens)
    events, sent, start = [], 0, 0
    for end in [*cuts, len(tokens)]:
        upto = max(sent, len("".join(t for _, t in tokens[:end])) - lag) if end < len(tokens) else len(text)
        events += stream.feed([i for i, _ in tokens[start:end]], text[sent:upto])
        sent, start = upto, end
    events += stream.finish()
    kinds = [e[0] for e in events]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning"), kinds  # reasoning first, then content
    return "".join(e[1] for e in events if e[0] == "reasoning"), "".join(e[1] for e in events if e[0] == "content")


THOUGHT = [(1, "<think>"), (5, " Okay"), (6, " the"), (2, "</think>"), (7, " It"), (8, " is")]


@pytest.mark.parametrize("lag", [0, 1, 4, 9])
def test_think_stream_every_chunking(lag):
    rng = random.Random(lag)
    n = len(THOUGHT)
    splits = [[k for k in range(1, n) if mask >> (k - 1) & 1] for mask in range(2 ** (n - 1))]
    for cuts in splits + [sorted(rng.sample(range(1, n), 2)) for _ in range(20)]:
        assert run(ThinkStream(QWEN3, None), THOUGHT, cuts, lag) == (" Okay the", " It is"), (cuts, lag)


def test_think_stream_rules():
    # a marker spelled from smaller tokens is text; the reasoning ends at the marker token only
    spelled = [(1, "<think>"), (9, "</"), (10, "think>"), (5, " a"), (2, "</think>"), (7, " b")]
    assert run(ThinkStream(QWEN3, None), spelled, [2, 4]) == ("</think> a", " b")
    # cut off while reasoning: everything is reasoning
    assert run(ThinkStream(QWEN3, None), THOUGHT[:3], [1]) == (" Okay the", "")
    # qwen3: an output that does not open <think> is an answer
    assert run(ThinkStream(QWEN3, None), [(7, " It"), (2, "</think>"), (8, " is")], [1]) == ("", " It</think> is")
    # deepseek_r1 reasons from the first token (R1's template opens <think> in the prompt)
    assert R1.starts_in_reasoning([3, 4]) is True and QWEN3.starts_in_reasoning([3, 4]) is None
    assert run(ThinkStream(R1, R1.starts_in_reasoning([3])), THOUGHT[1:], [2]) == (" Okay the", " It is")
    # a prompt that closed the reasoning (enable_thinking false) gives an answer only
    closed = QWEN3.starts_in_reasoning([3, 1, 2])
    assert closed is False and run(ThinkStream(QWEN3, closed), [(7, " It")], []) == ("", " It")
    assert QWEN3.starts_in_reasoning([2, 1]) is True  # an open <think> at the end of the prompt


HARMONY = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
    '<|constrain|>json<|message|>{"city": "Paris"}'
)


def test_harmony_stream_every_split():
    for k in range(len(HARMONY) + 1):
        s = HarmonyStream()
        events = s.feed([], HARMONY[:k]) + s.feed([], HARMONY[k:]) + s.finish()
        assert "".join(e[1] for e in events if e[0] == "reasoning") == "Need weather.", k
        assert "".join(e[1] for e in events if e[0] == "content") == "It is sunny.", k
    for k in range(len(HARMONY_CALL) + 1):
        s = HarmonyStream(frozenset({"get_weather"}))
        events = s.feed([], HARMONY_CALL[:k]) + s.feed([], HARMONY_CALL[k:]) + s.finish()
        assert [e[3] for e in events if e[0] == "call"] == ["get_weather"], k
        assert "".join(e[2] for e in events if e[0] == "args") == '{"city": "Paris"}', k
        assert "".join(e[1] for e in events if e[0] == "reasoning") == "Call it.", k


def test_harmony_without_headers_and_gpt_oss_constraints():
    s = HarmonyStream()
    assert s.feed([], "plain text") + s.finish() == [("content", "plain text")]  # never dropped
    from types import SimpleNamespace

    from baige.runtime.infer.sampling import SamplingParams
    from baige.runtime.infer.structured import StructuredOutputsParams
    from baige.runtime.server.chat import with_reasoning
    from baige.runtime.server.protocol import APIError

    st = SimpleNamespace(reasoning=ReasoningConfig("gpt_oss", keep_special_tokens=True))
    params = with_reasoning(st, [3], SamplingParams())
    assert params.skip_special_tokens is False and params.reasoning_end_token_id is None
    with pytest.raises(APIError) as e:
        with_reasoning(
            st, [3], SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), "tool_choice"
        )
    assert (e.value.status, e.value.param) == (400, "tool_choice")
    st = SimpleNamespace(reasoning=QWEN3)  # deferred unless the prompt closed the reasoning
    so = StructuredOutputsParams(json_object=True)
    deferred = with_reasoning(st, [3], SamplingParams(structured_outputs=so))
    assert (deferred.reasoning_end_token_id, deferred.reasoning_start_token_id) == (2, 1)
    st = SimpleNamespace(reasoning=R1)  # R1 reasons from the first token: no start token to wait for
    deferred = with_reasoning(st, [3], SamplingParams(structured_outputs=so))
    assert (deferred.reasoning_end_token_id, deferred.reasoning_start_token_id) == (2, None)
    st = SimpleNamespace(reasoning=QWEN3)
    assert with_reasoning(st, [1, 2], SamplingParams(structured_outputs=so)).reasoning_end_token_id is None


def test_auto_detection_and_bad_parsers(tmp_path):
    assert detect("{{ '<think>' }}") == "qwen3"
    assert detect("<｜Assistant｜><think>") == "deepseek_r1"
    assert detect("<|start|>assistant<|channel|>analysis<|message|>") == "gpt_oss"
    assert detect("{{ messages }}") is None and detect(None) is None
    from tiny import write_tiny_tokenizer

    from baige.runtime.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(write_tiny_tokenizer(tmp_path))  # word-level: <think> is its unknown token
    with pytest.raises(BaigeError, match="'<think>' is not one token"):
        reasoning_config(tok, "qwen3")
    assert reasoning_config(tok, "auto") is None  # no chat template: no parser


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_reasoning_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_engine_defers_the_constraint_to_the_end_of_reasoning(qwen3_dir):
    from baige.runtime.infer.llm import LLM
    from baige.runtime.infer.sampling import SamplingParams
    from baige.runtime.infer.structured import StructuredOutputsParams

    llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="8MB")
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    end = tok.encode("</think>", add_special_tokens=False)[0]
    so = StructuredOutputsParams(regex="(Rain|Snow)!")
    deferred = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so, reasoning_end_token_id=end)
    free = SamplingParams(temperature=0, max_tokens=40)
    at_once = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    outs = llm.generate([prompt] * 3, [deferred, free, at_once])
    assert outs[1].outputs[0].text == f"<think>{REASONING_TEXT}</think>{ANSWER_TEXT}"
    assert outs[0].outputs[0].text == f"<think>{REASONING_TEXT}</think>Rain!"  # the chain until </think>
    assert outs[2].outputs[0].text == "Rain!"  # constrained from the first token
    # qwen3 without a marker in the prompt: the first token decides. After "\n" the chain opens <think> (the
    # constraint waits for </think>); after " It" its next word is masked, so the answer is constrained at once
    start = tok.encode("<think>", add_special_tokens=False)[0]
    undecided = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=so, reasoning_end_token_id=end, reasoning_start_token_id=start
    )
    it = tok.encode(" It", add_special_tokens=False)
    outs = llm.generate([prompt, prompt[:-1] + it], [undecided, undecided])
    assert outs[0].outputs[0].text == f"<think>{REASONING_TEXT}</think>Rain!"
    assert outs[1].outputs[0].text == "Rain!"
    assert llm.generate([prompt[:-1] + it], free)[0].outputs[0].text == ANSWER_TEXT[len(" It") :]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
HERMES_CALL = '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>'


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def client(request, tmp_path_factory):
    model = write_reasoning_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    with launched(model, *SERVE_ARGS) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=300)
        client.style = request.param
        yield client


def message_of(client, **kwargs):
    r = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=200, **kwargs)
    return r.choices[0]


def streamed(client, **kwargs) -> dict:
    """The joined deltas: reasoning, content, calls {index: {id, name, arguments}}, and the order in
    which the kinds first appeared."""
    out = {"reasoning": "", "content": "", "calls": {}, "order": [], "finish": None}
    stream = client.chat.completions.create(
        model=None, messages=ASK, temperature=0, max_tokens=200, stream=True, **kwargs
    )
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        for kind, text in (("reasoning", extra.get("reasoning_content")), ("content", delta.content)):
            if text:
                out[kind] += text
                out["order"] += [] if out["order"][-1:] == [kind] else [kind]
        for tc in delta.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            call["arguments"] += tc.function.arguments or ""
            out["order"] += [] if out["order"][-1:] == ["calls"] else ["calls"]
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_chat_splits_reasoning_and_content(client):
    choice = message_of(client)
    m = choice.message
    assert (m.reasoning_content, m.reasoning, m.content) == (REASONING_TEXT, REASONING_TEXT, ANSWER_TEXT)
    assert choice.finish_reason == "stop"
    s = streamed(client)
    assert (s["reasoning"], s["content"], s["order"], s["finish"]) == (
        REASONING_TEXT,
        ANSWER_TEXT,
        ["reasoning", "content"],
        "stop",
    )
    dropped = message_of(client, extra_body={"include_reasoning": False}).message
    assert (dropped.reasoning_content, dropped.content) == (None, ANSWER_TEXT)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},  # forced: a constraint
        {"tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}},  # hermes, parsed
    ],
    ids=["named", "auto-hermes"],
)
def test_tool_call_after_reasoning_whole_and_streamed(client, kwargs):
    choice = message_of(client, tools=[WEATHER], **kwargs)
    m = choice.message
    assert (m.reasoning_content, m.content, choice.finish_reason) == (REASONING_TEXT, None, "tool_calls")
    assert [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls] == [CALL]
    assert m.tool_calls[0].id.startswith("call_")
    s = streamed(client, tools=[WEATHER], **kwargs)
    assert (s["reasoning"], s["content"], s["order"], s["finish"]) == (
        REASONING_TEXT,
        "",
        ["reasoning", "calls"],
        "tool_calls",
    )
    (call,) = s["calls"].values()
    assert call["id"].startswith("call_") and {"name": call["name"], "arguments": call["arguments"]} == CALL


def test_structured_output_constrains_the_answer_only(client):
    schema = {
        "type": "object",
        "properties": {"sky": {"enum": ["clear", "grey"]}},
        "required": ["sky"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    m = message_of(client, response_format=fmt).message
    assert m.reasoning_content == REASONING_TEXT  # the chain's own reasoning: not masked
    jsonschema.validate(json.loads(m.content), schema)
    s = streamed(client, response_format=fmt)
    assert (s["reasoning"], s["content"]) == (REASONING_TEXT, m.content)


def test_enable_thinking_false_passes_to_the_template(client):
    m = message_of(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).message
    # Qwen3's template closes the reasoning in the prompt; R1's ignores the variable and reasons
    expected = (None, ANSWER_TEXT) if client.style == "qwen3" else (REASONING_TEXT, ANSWER_TEXT)
    assert (m.reasoning_content, m.content) == expected
    bad = httpx.post(
        f"{client.base_url}chat/completions",
        json={"messages": ASK, "chat_template_kwargs": {"messages": []}},
        headers={"Authorization": "Bearer k"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
