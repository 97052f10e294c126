"""Tool calling through `baige serve` and the official openai client on the embedded model (SmolLM2, whose
chat template ignores `tools`, so the default tool prompt is used): tool_choice required and named give
calls whose arguments validate against the tool's schema, streamed deltas join to the same calls, a
follow-up turn with the tool's answer renders and answers, auto and none, and bad tool input as 400s in
OpenAI's shape. Plus the prompt side in-process: the default tool prompt, a tool-aware --chat-template,
the forced-call constraint."""

import json
import subprocess
import sys

import httpx
import openai
import pytest
from server_utils import launched

from baige.errors import BaigeError

KEY = "tools-key"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(embedded_dir):
    with launched(
        embedded_dir,
        "--served-model-name",
        "x",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "150MB",
        "--max-num-seqs",
        "16",
        "--log-level",
        "warning",
        api_key=KEY,
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as c:
        yield c


def validate(value, schema: dict, where: str = "arguments") -> None:
    """A hand check of the JSON-schema keywords these tools use (jsonschema is not installed)."""
    types = {"object": dict, "string": str, "integer": int}
    assert isinstance(value, types[schema["type"]]) and not isinstance(value, bool), (where, value)
    if schema["type"] == "object":
        assert set(schema.get("required", ())) <= value.keys(), (where, value)
        for key, item in value.items():
            assert key in schema["properties"], f"{where}.{key} is not declared"
            validate(item, schema["properties"][key], f"{where}.{key}")
    if "enum" in schema:
        assert value in schema["enum"], (where, value)
    if "maxLength" in schema:
        assert len(value) <= schema["maxLength"], (where, value)
    if "minimum" in schema:
        assert schema["minimum"] <= value <= schema["maximum"], (where, value)


def check_calls(message, names=("get_weather", "add")) -> list[tuple[str, str]]:
    assert message.content is None and message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names, c
        validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def streamed_calls(client, **kwargs) -> tuple[list[tuple[str, str]], str, str]:
    """(name, arguments) of every streamed call, the joined content, and the last finish reason."""
    calls: dict[int, list] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:  # the first delta of a call: id, type and name
                assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], content, finish


def test_required_calls_validate_and_stream_the_same(client):
    args = {
        "model": "x",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 80,
        "seed": 0,
    }
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = check_calls(choice.message)
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1])["city"] == "Paris"
    streamed, content, finish = streamed_calls(client, **args)
    assert streamed == calls and content == "" and finish == "tool_calls"


def test_required_cut_by_max_tokens_is_length_without_a_partial_call(client):
    """tool_choice required cut off by max_tokens: finish_reason length; the plain response holds no call
    and no partial JSON as content (before the fix: content '[{"name'); the stream sends the cut call's
    header and the arguments written so far (a prefix of the whole call's), then length."""
    args = {"model": "x", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = client.chat.completions.create(max_tokens=80, **args)
    ((name, full_args),) = check_calls(whole.choices[0].message)
    n = whole.usage.completion_tokens
    headers = 0
    for cut in (3, n // 2, n - 3):
        choice = client.chat.completions.create(max_tokens=cut, **args).choices[0]
        assert choice.finish_reason == "length", cut
        assert choice.message.content == "" and not choice.message.tool_calls, (cut, choice.message)
        streamed, content, finish = streamed_calls(client, max_tokens=cut, **args)
        assert finish == "length" and content == "", (cut, content)
        for got_name, got_args in streamed:
            assert got_name == name and full_args.startswith(got_args) and got_args != full_args, (cut, got_args)
        headers += len(streamed)
    assert headers  # a cut inside the arguments was met, not only cuts before the call's name


def test_required_single_call_samples_validate(client):
    r = client.chat.completions.create(
        model="x",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        n=6,
        max_tokens=60,
        seed=2,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(check_calls(c.message)) == 1


def test_named_tool_choice(client):
    args = {
        "model": "x",
        "messages": [{"role": "user", "content": "What is 2 plus 3?"}],
        "tools": TOOLS,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "max_tokens": 40,
        "seed": 1,
    }
    r = client.chat.completions.create(**args)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = check_calls(r.choices[0].message, names=("add",))
    assert len(calls) == 1
    streamed, content, finish = streamed_calls(client, **args)
    assert streamed == calls and content == "" and finish == "tool_calls"


def test_follow_up_turn_with_the_tool_result_answers(client):
    first = client.chat.completions.create(
        model="x",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]
    r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, temperature=0, max_tokens=30)
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert msg.content or msg.tool_calls
    # the tool's answer is in the prompt: more prompt tokens than without it
    shorter = client.chat.completions.create(model="x", messages=messages[:2], tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens


def test_auto_and_none(client):
    plain = client.chat.completions.create(model="x", messages=ASK, temperature=0, max_tokens=24)
    auto = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=24)
    none = client.chat.completions.create(
        model="x", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    )
    # the default tool prompt is rendered for auto and, as vLLM does, for none too
    assert auto.usage.prompt_tokens == none.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    msg = auto.choices[0].message
    if msg.tool_calls:  # whatever the model wrote: valid calls, or content
        check_calls(msg)
    else:
        assert isinstance(msg.content, str) and auto.choices[0].finish_reason in ("stop", "length")
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)


def bad(**fields) -> dict:
    return {"messages": ASK, "max_tokens": 2, "tools": TOOLS, **fields}


def tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    "body,param,needle",
    [
        (bad(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
        (bad(tool_choice="sometimes"), "tool_choice", "tool_choice"),
        (bad(tools=WEATHER), "tools", "list"),
        (bad(tools=[tool(parameters={"type": "nonsense"})]), "tools", "parameters"),
        (bad(tools=[tool(parameters={"type": "object", "properties": {"a": {"type": 5}}})]), "tools", "parameters"),
        (bad(tools=[tool(parameters={"type": "object", "required": "a"})]), "tools", "parameters"),
        (bad(tools=[tool(parameters="a string")]), "tools", "parameters"),
        (bad(tools=[tool(), tool()]), "tools", "twice"),
        (bad(tools=[tool(name="no spaces allowed")]), "tools", "name"),
        (bad(tools=[tool()] * 129), "tools", "tools"),
        (bad(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools", "type"),
        (
            bad(tools=[tool(parameters={"type": "array", "uniqueItems": True})], tool_choice="required"),
            "tools",
            "uniqueItems",
        ),
        (bad(tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "response_format"),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "tools"),
        (bad(messages=ASK + [{"role": "tool", "content": "18 C"}]), "messages", "tool_call_id"),
        (
            bad(
                messages=[
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
                    }
                ]
            ),
            "messages",
            "assistant",
        ),
        (
            bad(
                messages=ASK
                + [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}
                        ],
                    }
                ]
            ),
            "messages",
            "arguments",
        ),
        (
            bad(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add"}}]}]),
            "messages",
            "arguments",
        ),
    ],
)
def test_bad_tool_input_is_a_400_in_openai_shape(http, body, param, needle):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"], err


def test_auto_accepts_schemas_llguidance_cannot_enforce(http):
    """Valid JSON schemas with keywords the grammar engine does not implement are fine for auto (nothing
    is enforced); only required/named refuse them (above)."""
    body = bad(tools=[tool(parameters={"type": "array", "uniqueItems": True})], max_tokens=1)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert http.post("/v1/chat/completions", json=bad(tools=[], tool_choice="required")).status_code == 200


# ---- the prompt side, in-process --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from baige.runtime.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(embedded_dir)


def plan_of(tokenizer, body: dict, max_calls: int | None = None, **config):
    from baige.runtime.server.protocol import ChatCompletionRequest
    from baige.runtime.server.tools import plan_tools, tool_config

    plan = plan_tools(ChatCompletionRequest.model_validate(body), tool_config(tokenizer, **config), max_calls)
    return plan, tokenizer.render_chat_template(plan.messages, True, **plan.template_vars)


HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def test_default_tool_prompt_lists_tools_and_renders_the_history(tokenizer):
    plan, text = plan_of(tokenizer, {"messages": HISTORY, "tools": TOOLS})
    assert plan.mode == "auto" and plan.template_vars == {}
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(ADD) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert text.count("<|im_start|>system") == 1 and "SmolLM" not in text  # the tool prompt is the system turn
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>"
    ) in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>" in text
    # a system message keeps its text, the tool block follows it
    _, text = plan_of(tokenizer, {"messages": [{"role": "system", "content": "Be brief."}] + ASK, "tools": TOOLS})
    assert "<|im_start|>system\nBe brief.\n\n# Tools\n" in text
    _, text = plan_of(
        tokenizer, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}, exclude_none=True
    )  # --exclude-tools-when-tool-choice-none
    assert "# Tools" not in text


def test_auto_tool_choice_off_is_a_400_as_in_vllm(tokenizer):
    from baige.runtime.server.protocol import APIError

    with pytest.raises(APIError, match="--no-enable-auto-tool-choice") as e:
        plan_of(tokenizer, {"messages": ASK, "tools": TOOLS}, enable_auto=False)  # auto: the default with tools
    assert e.value.status == 400 and e.value.param == "tool_choice"
    plan, _ = plan_of(tokenizer, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}, enable_auto=False)
    assert plan.mode == "forced"


TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
TOOLS {% for t in tools %}{{ t.function.name }}={{ t | tojson }};{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\
{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_tool_aware_chat_template_gets_the_tools(tmp_path, embedded_dir):
    from baige.cli.serve import read_chat_template
    from baige.runtime.model.tokenizer import Tokenizer

    path = tmp_path / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    tok = Tokenizer.from_dir(embedded_dir)
    tok.set_chat_template(*read_chat_template(str(path)))
    plan, text = plan_of(tok, {"messages": HISTORY, "tools": TOOLS})
    assert plan.template_vars == {"tools": TOOLS} and plan.parser.name == "hermes"  # auto: <tool_call> in it
    assert "TOOLS get_weather=" + json.dumps(WEATHER) + ";add=" in text and "# Tools" not in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text  # an object
    assert "[call_1] 18 C" in text and "[call_2] sunny" in text
    assert read_chat_template("{{ messages }}") == ("{{ messages }}", "--chat-template")  # inline, as vLLM takes it
    with pytest.raises(BaigeError, match="not a file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(BaigeError, match="does not compile"):
        tok.set_chat_template("{% for %}")


def test_serve_refuses_a_missing_chat_template_before_loading():
    r = subprocess.run(
        [sys.executable, "-m", "baige", "serve", "--chat-template", "/nonexistent.jinja"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: --chat-template: /nonexistent.jinja is not a file (nor a jinja template)"
    ]


def test_forced_constraint_schema(tokenizer):
    nested = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "guest": {"$ref": "#/$defs/Guest"},
                    "tags": {"allOf": [{"properties": {"x": {"type": "string"}}}]},
                },
                "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}}}},
            },
        },
    }
    plan, _ = plan_of(tokenizer, {"messages": ASK, "tools": [WEATHER, nested], "tool_choice": "required"})
    schema = plan.constraint.json
    assert plan.mode == "forced" and plan.array and schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][1]["properties"] == {
        "name": {"const": "book"},
        "arguments": {"$ref": "#/$defs/tool1"},
    }
    book = schema["$defs"]["tool1"]
    assert book["additionalProperties"] is False and book["properties"]["guest"] == {
        "$ref": "#/$defs/tool1/$defs/Guest"
    }
    assert book["$defs"]["Guest"]["additionalProperties"] is False
    assert "additionalProperties" not in book["properties"]["tags"]["allOf"][0]  # allOf branches stay open
    plan, _ = plan_of(
        tokenizer, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert not plan.array and len(plan.constraint.json["anyOf"]) == 2
    plan, _ = plan_of(
        tokenizer, {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    )
    assert plan.constraint.json["properties"]["name"] == {"const": "add"} and "anyOf" not in plan.constraint.json


def test_max_calls_caps_auto_and_required(tokenizer):
    """The Responses API's max_tool_calls: auto keeps the first N calls of an output (1 with
    parallel_tool_calls false); required constrains the list to at most N (N = 1: one call, not a list)."""
    auto = {"messages": ASK, "tools": TOOLS}
    assert plan_of(tokenizer, auto)[0].max_calls is None
    assert plan_of(tokenizer, auto, 3)[0].max_calls == 3
    assert plan_of(tokenizer, {**auto, "parallel_tool_calls": False}, 3)[0].max_calls == 1
    required = {**auto, "tool_choice": "required"}
    plan = plan_of(tokenizer, required, 3)[0]
    assert plan.array and plan.constraint.json["maxItems"] == 3 and plan.constraint.json["minItems"] == 1
    assert "maxItems" not in plan_of(tokenizer, required)[0].constraint.json
    plan = plan_of(tokenizer, required, 1)[0]
    assert not plan.array and len(plan.constraint.json["anyOf"]) == 2
