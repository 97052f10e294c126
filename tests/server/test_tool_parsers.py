"""Tool-call parsers (hermes, llama3_json, mistral) and the streams over them: complete strings (one call,
two calls, text before and after, invalid JSON and unknown names staying content) and the same text fed
in every 2-chunk split and in 1-character chunks, whose joined deltas must equal the one-piece result;
the forced-call reader of tool_choice required/named; parser choice from a chat template."""

import json

import pytest

from baige.runtime.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    parser_for_template,
)
from baige.runtime.server.tool_streams import (
    ForcedCallStream,
    PlainStream,
    ToolCallStream,
    assemble,
    delta_of,
)

NAMES = ("get_weather", "add")
W = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
A = {"name": "add", "arguments": {"a": 1, "b": 2}}


def chunkings(text: str) -> list[list[str]]:
    """The text whole, split in two at every position, and one character at a time."""
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


def run(stream, chunks: list[str]) -> list:
    events = []
    for c in chunks:
        events += stream.feed(c)
    return events + stream.finish()


def result(events: list) -> tuple:
    """(content, [(name, arguments text)]) with the random ids left out (they are checked apart)."""
    content, calls = assemble(events)
    assert all(c["type"] == "function" and c["id"] for c in calls)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def expect_same_for_every_chunking(make, text: str, expected: tuple) -> None:
    for chunks in chunkings(text):
        events = run(make(), chunks)
        assert result(events) == expected, chunks
        for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
            if expected[1] and marker not in (expected[0] or ""):  # valid calls' markup never leaks into content
                assert all(marker not in e[1] for e in events if e[0] == "content"), (chunks, events)


def call(c: dict, key: str = "arguments") -> tuple[str, str]:
    return c["name"], json.dumps(c[key], ensure_ascii=False)


def hermes_block(c: dict) -> str:
    return f"<tool_call>\n{json.dumps(c)}\n</tool_call>"


HERMES = [
    (hermes_block(W), (None, [call(W)])),
    (hermes_block(W) + "\n" + hermes_block(A), (None, [call(W), call(A)])),
    ("Let me check.\n" + hermes_block(W) + "\nDone, café.", ("Let me check.\n\nDone, café.", [call(W)])),
    ("  " + hermes_block(A) + "\n\n", (None, [call(A)])),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', (None, [call(A)])),  # unclosed at the end
    ('<tool_call>{"name": "add"}</tool_call>', (None, [("add", "{}")])),  # no arguments: {}
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich \\u00e9"}}</tool_call>',
        (None, [("get_weather", '{"city": "Zürich é"}')]),
    ),
]
HERMES_CONTENT = [  # not valid calls: everything stays content, markup included
    'Text <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call> more',
    '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not a declared tool
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',  # NaN is not JSON
    '<tool_call>{"name": "add", "arguments": {"a": 1',  # cut off
    "a < b, and <tool not a marker; <tool_call",
    "Plain answer with trailing space  \n",
    "",
]


@pytest.mark.parametrize("text,expected", HERMES)
def test_hermes_calls(text, expected):
    expect_same_for_every_chunking(lambda: ToolCallStream(HermesToolParser(NAMES)), text, expected)


@pytest.mark.parametrize("text", HERMES_CONTENT)
def test_hermes_invalid_calls_stay_content(text):
    expect_same_for_every_chunking(lambda: ToolCallStream(HermesToolParser(NAMES)), text, (text, []))


def test_hermes_two_calls_and_invalid_one_between():
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    text = hermes_block(W) + bad + hermes_block(A)
    expect_same_for_every_chunking(lambda: ToolCallStream(HermesToolParser(NAMES)), text, (bad, [call(W), call(A)]))


def llama(c: dict) -> str:
    return json.dumps({"name": c["name"], "parameters": c["arguments"]})


LLAMA = [
    (llama(W), (None, [call(W)])),
    ("\n " + llama(W), (None, [call(W)])),
    (llama(W) + "; " + llama(A), (None, [call(W), call(A)])),
    (llama(W) + ";" + llama(A) + " ;\n" + llama(W), (None, [call(W), call(A), call(W)])),
    ("<|python_tag|>" + llama(A), (None, [call(A)])),
    ("Sure.<|python_tag|>" + llama(A) + "; " + llama(W), ("Sure.", [call(A), call(W)])),
    (llama(W) + " Hope that helps.", (" Hope that helps.", [call(W)])),
    (llama(W) + "; and more", ("; and more", [call(W)])),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', (None, [call(A)])),  # "arguments" is read too
    (llama(W) + '; {"name": "nope", "parameters": {}}', ('; {"name": "nope", "parameters": {}}', [call(W)])),
]
LLAMA_CONTENT = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # unclosed
    '{"name": get_weather, "parameters": {}}',  # not JSON
    '{"answer": 42}',  # JSON, but not a call
    "The set {1, 2} has two elements.",  # a brace that does not start the output
    'Call it: {"name": "add", "parameters": {"a": 1, "b": 2}}',  # a call in prose is prose
    "<|python_tag|>brave_search.call(query='x')",  # a built-in tool call is not JSON: content
    "   ",
]


@pytest.mark.parametrize("text,expected", LLAMA)
def test_llama3_json_calls(text, expected):
    expect_same_for_every_chunking(lambda: ToolCallStream(Llama3JsonToolParser(NAMES)), text, expected)


@pytest.mark.parametrize("text", LLAMA_CONTENT)
def test_llama3_json_invalid_calls_stay_content(text):
    expect_same_for_every_chunking(lambda: ToolCallStream(Llama3JsonToolParser(NAMES)), text, (text, []))


MISTRAL = [
    ("[TOOL_CALLS]" + json.dumps([W]), (None, [call(W)])),
    ("[TOOL_CALLS] " + json.dumps([W, A]), (None, [call(W), call(A)])),
    ("[TOOL_CALLS]" + json.dumps(A), (None, [call(A)])),  # one object without the list
    ("Checking. [TOOL_CALLS]" + json.dumps([A]) + " Done.", ("Checking.  Done.", [call(A)])),
    ("[TOOL_CALLS]" + json.dumps([W]) + "[TOOL_CALLS]" + json.dumps([A]), (None, [call(W), call(A)])),
]
MISTRAL_CONTENT = [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',  # brackets do not match
    "[TOOL_CALLS]" + json.dumps([W, {"name": "nope", "arguments": {}}]),  # one bad call spoils the list
    "[TOOL_CALLS]" + json.dumps([W])[:-3],  # cut off
    "[TOOL_CALLS] I will not call anything",
    "[TOOL_CALLS][]",
    "[TOOL",
]


@pytest.mark.parametrize("text,expected", MISTRAL)
def test_mistral_calls(text, expected):
    expect_same_for_every_chunking(lambda: ToolCallStream(MistralToolParser(NAMES)), text, expected)


@pytest.mark.parametrize("text", MISTRAL_CONTENT)
def test_mistral_invalid_calls_stay_content(text):
    expect_same_for_every_chunking(lambda: ToolCallStream(MistralToolParser(NAMES)), text, (text, []))


def test_ids_and_deltas_are_openai_shaped():
    events = run(ToolCallStream(HermesToolParser(NAMES)), [hermes_block(W) + hermes_block(A)])
    content, calls = assemble(events)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert delta_of(events[0]) == {
        "tool_calls": [
            {"index": 0, "id": calls[0]["id"], "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ]
    }
    assert delta_of(events[1]) == {
        "tool_calls": [{"index": 0, "function": {"arguments": calls[0]["function"]["arguments"]}}]
    }
    _, calls = assemble(run(ToolCallStream(MistralToolParser(NAMES)), ["[TOOL_CALLS]" + json.dumps([W])]))
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()  # Mistral's templates insist on 9 characters


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = hermes_block(W) + "\n" + hermes_block(A)
    expect_same_for_every_chunking(
        lambda: ToolCallStream(HermesToolParser(NAMES), max_calls=1), text, (None, [call(W)])
    )


def test_plain_stream_is_the_text():
    assert assemble(run(PlainStream(), ["<tool_call>", "x"])) == ("<tool_call>x", [])


FORCED_ONE = '{"name": "get_weather", "arguments": {"city": "Paris {x}", "unit": "celsius"}}'
FORCED_LIST = '[{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}, {"name": "get_weather", "arguments": {}}]'


@pytest.mark.parametrize(
    "text,array,expected",
    [
        (FORCED_ONE, False, (None, [("get_weather", '{"city": "Paris {x}", "unit": "celsius"}')])),
        (FORCED_LIST, True, (None, [("add", '{"a": 1, "b": [2, {"c": "}"}]}'), ("get_weather", "{}")])),
        # cut off by max_tokens: the cut call is streamed (header, partial arguments) but left out of the
        # message; JSON cut before a call's name is dropped, never content
        (FORCED_ONE[:40], False, ("", [])),
        ('{"name": "get_w', False, ("", [])),
        (FORCED_LIST[:70], True, (None, [("add", '{"a": 1, "b": [2, {"c": "}"}]}')])),  # before the 2nd's name
        (FORCED_LIST[:-3], True, (None, [("add", '{"a": 1, "b": [2, {"c": "}"}]}')])),  # in the 2nd's arguments
        (FORCED_LIST[:56], True, ("", [])),  # inside the first call's arguments, just after a "}" in a string
    ],
)
def test_forced_calls_stream_arguments_as_generated(text, array, expected):
    expect_same_for_every_chunking(lambda: ForcedCallStream(array), text, expected)
    events = run(ForcedCallStream(array), list(text))
    if expected[1] and len(expected[1][0][1]) > 2:
        assert sum(e[0] == "args" for e in events) > 2  # arguments arrive in fragments, not at the end
    started = [e[1] for e in events if e[0] == "call"]
    cut = [e[1] for e in events if e[0] == "cut"]
    assert cut == started[len(expected[1]) :]  # the one call begun and not finished, marked last
    assert not any(e[0] == "content" for e in events)


def test_parser_for_template():
    assert parser_for_template("{{ '<tool_call>' }}") is HermesToolParser
    assert parser_for_template("{{- '<|python_tag|>' }}") is Llama3JsonToolParser
    assert parser_for_template("[AVAILABLE_TOOLS] {{ tools }} [TOOL_CALLS]") is MistralToolParser
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is HermesToolParser
    assert parser_for_template(None) is HermesToolParser


def test_render_matches_what_the_parser_reads():
    calls = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser):
        content, parsed = result(run(ToolCallStream(parser(NAMES)), [parser.render(calls)]))
        assert content is None and [(n, json.loads(a)) for n, a in parsed] == calls, parser.name
