"""LLM.chat (vLLM's offline chat): prompts rendered by the chat template as transformers renders them,
tools given to the template, structured outputs on the reply, and one-line errors for bad conversations."""

import json

import pytest
from conftest import embedded_gguf

from baige import LLM, SamplingParams
from baige.errors import BaigeError
from baige.runtime.infer.structured import StructuredOutputsParams

CONV = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def llm(embedded_dir):
    return LLM(str(embedded_dir), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def ref():
    transformers = pytest.importorskip("transformers")
    gguf = embedded_gguf()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _ids(x):
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def test_chat_prompt_is_transformers_rendering_and_reply_equals_generate(llm, ref):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (out,) = llm.chat(CONV, params)
    expected_ids = _ids(ref.apply_chat_template(CONV, tokenize=True, add_generation_prompt=True))
    assert out.prompt_token_ids == expected_ids
    (plain,) = llm.generate([expected_ids], params)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and len(plain.outputs[0].token_ids) == 8


def test_chat_many_conversations_in_order(llm, ref):
    convs = [CONV, [{"role": "user", "content": "Name a colour."}]]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [
        _ids(ref.apply_chat_template(c, tokenize=True, add_generation_prompt=True)) for c in convs
    ]


def test_chat_tools_reach_the_template_and_the_override_is_per_call(llm):
    tok = llm.get_tokenizer()
    (out,) = llm.chat(CONV, SamplingParams(max_tokens=1), tools=[TOOL], chat_template=TOOL_TEMPLATE)
    # HF's Jinja settings (trim_blocks) drop the newline after a block tag.
    assert tok.decode(out.prompt_token_ids) == "<system>Be terse.\n<user>What is 2+2?\nTOOLS: get_weather<assistant>"
    (again,) = llm.chat(CONV, SamplingParams(max_tokens=1))
    assert "TOOLS" not in tok.decode(again.prompt_token_ids)  # the model's own template is back


def test_chat_structured_reply_parses(llm):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, n=3, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (out,) = llm.chat(CONV, params)
    for o in out.outputs:
        assert set(json.loads(o.text)) == {"answer"} and isinstance(json.loads(o.text)["answer"], int)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "messages"),
        ("hi", "messages"),
        ([["not a dict"]], r"messages\[0\]"),
        ([{"content": "no role"}], r"messages\[0\]"),
    ],
)
def test_chat_bad_conversations_are_one_line_errors(llm, messages, match):
    with pytest.raises(BaigeError, match=match):
        llm.chat(messages)


def test_chat_bad_template_is_an_error(llm):
    with pytest.raises(BaigeError):
        llm.chat(CONV, chat_template="{% for %}")
