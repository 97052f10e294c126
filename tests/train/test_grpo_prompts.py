"""The prompts file of a GRPO run: each bad record is one error naming its file, line and field; chat
messages are checked (and their text parts joined) as the server checks them."""

from __future__ import annotations

import json

import pytest

from baige.errors import BaigeError
from baige.runtime.train.rl.prompts import read_prompts

GOOD = {"prompt": "2+2?", "answer": "4"}


def _file(tmp_path, *records) -> str:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "record,needle",
    [
        ({"messages": [{"role": "user", "content": 5}]}, 'messages[0]: "content" must be a string or a list of'),
        ({"messages": [{"role": "user", "content": [1, 2]}]}, '"content" must be a string or a list of'),
        ({"messages": [{"role": "user", "content": {"a": 1}}]}, '"content" must be a string or a list of'),
        ({"messages": [{"role": 5, "content": "hi"}]}, 'messages[0]: a message is an object with a "role" string'),
        ({"messages": [{"role": "", "content": "hi"}]}, 'messages[0]: a message is an object with a "role" string'),
        ({"messages": ["hi"]}, 'messages[0]: a message is an object with a "role" string'),
        ({**GOOD, "answer": [1, 2]}, '"answer" must be a string or a number (got [1, 2])'),
        ({**GOOD, "answer": {"x": 1}}, '"answer" must be a string or a number (got {"x": 1})'),
        ({**GOOD, "answer": True}, '"answer" must be a string or a number (got true)'),
        ('{"prompt": "a", "answer": NaN}', '"answer" must be a string or a number (got NaN)'),
        ('{"prompt": "a", "answer": -Infinity}', '"answer" must be a string or a number (got -Infinity)'),
        ({**GOOD, "completions": "x"}, 'the field "completions" is a reward argument\'s name'),
        ({**GOOD, "prompts": "x"}, 'the field "prompts" is a reward argument\'s name'),
        ({**GOOD, "completion_ids": [1]}, 'the field "completion_ids" is a reward argument\'s name'),
        ({**GOOD, "json_schema": "{nope"}, '"json_schema": not valid JSON (Expecting property name'),
        ({**GOOD, "json_schema": {"type": 5}}, '"json_schema": not a valid JSON schema (5 is not valid under'),
        ({**GOOD, "json_schema": 5}, '"json_schema": a JSON schema is an object (got int)'),
    ],
)
def test_a_bad_record_names_its_line_and_field(tmp_path, record, needle):
    path = _file(tmp_path, GOOD, "", GOOD, record)
    with pytest.raises(BaigeError) as e:
        read_prompts([path], ("answer",), json_schema=True)
    assert str(e.value).startswith(f"{path}:4: ") and needle in str(e.value), str(e.value)


def test_good_records(tmp_path):
    """Numbers are answers; text parts are joined as the server joins them; a record's schema is kept
    parsed; without the json_schema reward its field is any value (the rewards never read it)."""
    parts = [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]
    records = [
        {"prompt": "a", "answer": 4},
        {"messages": [{"role": "user", "content": parts}], "answer": 4.5, "json_schema": '{"type": "integer"}'},
        {"messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}], "answer": "x"},
    ]
    path = _file(tmp_path, *records)
    a, b, c = read_prompts([path], ("answer",), json_schema=True)
    assert a.fields == {"answer": 4} and a.where == f"{path}:1"
    assert b.prompt == [{"role": "user", "content": "2+2?"}] and b.fields["json_schema"] == {"type": "integer"}
    assert c.prompt == records[2]["messages"]
    (d,) = read_prompts([_file(tmp_path, {"prompt": "a", "json_schema": 5})])
    assert d.fields == {"json_schema": 5}
