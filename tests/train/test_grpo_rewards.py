"""The built-in rewards on their edge cases, reward specs, and the one-line failures of a reward."""

from __future__ import annotations

import json
import sys

import pytest

from baige.errors import BaigeError
from baige.runtime.train.rl.config import RLSection, parse_reward_spec
from baige.runtime.train.rl.rewards import Reward, extract_answer, load_rewards, score


def _fn(rl: RLSection, name: str):
    return next(r for r in load_rewards(rl) if r.name == name).fn


@pytest.mark.parametrize(
    "reply,answer,expected",
    [
        ("The answer is 42.", 42, 1.0),
        ("The answer is 42.", "42", 1.0),
        ("I think 41, no wait, 42", 42, 1.0),  # the last number
        ("I think 42, no wait, 41", 42, 0.0),
        ("no number here", 42, 0.0),
        ("", 0, 0.0),
        ("\\boxed{3} hmm, actually \\boxed{4}", 4, 1.0),  # two boxed answers: the last one counts
        ("\\boxed{3} hmm, actually \\boxed{4}", 3, 0.0),
        ("\\boxed{12} so the count is 13", 12, 1.0),  # a boxed answer wins over a later number
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("\\boxed{5 and then text", 5, 1.0),  # unclosed box: ignored, the last number counts
        ("total: 1,234", 1234, 1.0),
        ("it is 4.0", 4, 1.0),  # numbers by value
        ("it is 4.5", 4, 0.0),
        ("x = -7", -7, 1.0),
        ("x = -7", 7, 0.0),
        ("\\boxed{ $Paris$ }.", "Paris", 1.0),
    ],
)
def test_exact_answer(reply, answer, expected):
    fn = _fn(RLSection(rewards=["exact_answer"]), "exact_answer")
    assert fn(["q"], [reply], answer=[answer]) == [expected]


def test_extract_answer():
    assert extract_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert extract_answer("nothing") is None
    assert extract_answer("-.5 then 3") == "3"


def test_regex():
    fn = _fn(RLSection(rewards=["regex"], reward_regex=r"^<answer>\d+</answer>$"), "regex")
    assert fn(["q"] * 3, ["<answer>12</answer>", "<answer>x</answer>", "so <answer>1</answer>"]) == [1.0, 0.0, 0.0]


def test_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fn = _fn(RLSection(rewards=["json_schema"], reward_json_schema=json.dumps(schema)), "json_schema")
    replies = ['{"a": 1}', "{'a': 1}", '{"a": "x"}', '```json\n{"a": 2}\n```', "  [1, 2]  ", "not json at all"]
    assert fn(["q"] * 6, replies) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # no schema in the config: any JSON value; a record's own json_schema wins over the config's
    assert _fn(RLSection(rewards=["json_schema"]), "json_schema")(["q"] * 2, ["[1, 2]", "{x"]) == [1.0, 0.0]
    own = [{"type": "array"}, None]
    assert fn(["q"] * 2, ["[1]", "[1]"], json_schema=own) == [1.0, 0.0]


def test_length_penalty():
    fn = _fn(RLSection(rewards=["length_penalty"], max_tokens=10, overlong_buffer=4), "length_penalty")
    ids = [[1] * n for n in (3, 6, 7, 8, 10)]
    # 0 up to max_tokens - buffer = 6 tokens, then (6 - L) / 4 down to -1 at 10
    assert fn(["q"] * 5, [""] * 5, completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0]


def test_reward_specs():
    assert parse_reward_spec("exact_answer") == ("exact_answer", 1.0)
    assert parse_reward_spec("exact_answer=0.5") == ("exact_answer", 0.5)
    assert parse_reward_spec("my.mod:fn=-2") == ("my.mod:fn", -2.0)
    for spec, needle in [
        ("exact", "unknown reward"),
        ("exact_answer=abc", "the weight 'abc' is not a finite number"),
        ("exact_answer=nan", "is not a finite number"),
        ("=2", "no reward name"),
        (":fn", "module:function"),
    ]:
        with pytest.raises(BaigeError, match=needle):
            parse_reward_spec(spec)


def test_a_failing_reward_is_one_line_naming_it():
    def boom(prompts, completions, **fields):
        raise ValueError("the grader\nis down")

    def ok(prompts, completions, **fields):
        return [1.0] * len(completions)

    cases = [
        (boom, "reward bad failed: ValueError: the grader is down"),
        (lambda p, c, **f: [1.0], "reward bad returned 1 values; expected a list of 2 numbers"),
        (lambda p, c, **f: 1.0, "reward bad returned float; expected a list of 2 numbers"),
        (lambda p, c, **f: [1.0, float("nan")], "reward bad returned nan; every value must be a finite number"),
        (lambda p, c, **f: [1.0, "1"], "reward bad returned '1'; every value must be a finite number"),
        (lambda p, c, **f: sys.exit(3), "reward bad failed: SystemExit: 3"),
        (  # an int past float's range, its repr cut to 60 characters
            lambda p, c, **f: [1, 10**400],
            f"reward bad returned 1{'0' * 59}; every value must be a finite number",
        ),
    ]
    for fn, message in cases:
        with pytest.raises(BaigeError) as e:
            score([Reward("fine", 1.0, ok), Reward("bad", 1.0, fn)], ["p", "q"], ["a", "b"], {})
        assert str(e.value) == message and "\n" not in str(e.value)
    assert score([Reward("fine", 1.0, ok)], ["p"], ["a"], {}) == {"fine": [1.0]}


def test_custom_reward_import_errors():
    with pytest.raises(BaigeError, match="cannot import 'no_such_module_xyz'"):
        load_rewards(RLSection(rewards=["no_such_module_xyz:f"]))
    with pytest.raises(BaigeError, match="'rl_utils' has no callable 'nope'"):
        load_rewards(RLSection(rewards=["rl_utils:nope"]))
    (r,) = load_rewards(RLSection(rewards=["rl_utils:target_token_reward=2"]))
    assert r.weight == 2.0 and not r.binary and r.fn(["p"], ["ee", "xe"]) == [1.0, 0.5]


def test_record_fields_do_not_replace_a_builtin_s_settings():
    """Records with fields named like a built-in's settings (max_tokens, pattern, schema, buffer) are
    handed to the rewards as every field is, but the built-ins keep rl.*'s values."""
    rl = RLSection(
        rewards=["regex", "json_schema", "length_penalty"],
        reward_regex="ok",
        reward_json_schema='{"type": "integer"}',
        max_tokens=8,
        overlong_buffer=4,
    )
    fields = {"pattern": ["zz", "zz"], "schema": ["x", "x"], "max_tokens": [100, 100], "buffer": [1, 1]}
    fields["completion_ids"] = [[1] * 6, [1] * 3]
    values = score(load_rewards(rl), ["p", "q"], ["ok 7", "5"], fields)
    assert values == {"regex": [1.0, 0.0], "json_schema": [0.0, 1.0], "length_penalty": [-0.5, 0.0]}


def test_reward_json_schema_errors(tmp_path):
    from baige.runtime.train.rl.config import load_json_schema

    latin1 = tmp_path / "schema.json"
    latin1.write_bytes(b'{"type": "object", "description": "caf\xe9"}')
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    for text, message in [
        (str(latin1), f"rl.reward_json_schema {latin1}: not UTF-8 text (it holds the byte 0xe9)"),
        (str(listed), f"rl.reward_json_schema {listed}: a JSON schema is an object (got list)"),
        (
            '{"type": 5}',
            "rl.reward_json_schema: not a valid JSON schema (5 is not valid under any of the given schemas)",
        ),
        ("{nope", "rl.reward_json_schema: not valid JSON (Expecting property name enclosed in double quotes)"),
        (
            str(tmp_path / "none.json"),
            f"rl.reward_json_schema '{tmp_path / 'none.json'}': neither a JSON object nor a file",
        ),
        (f"/tmp/{'x' * 5000}", f"rl.reward_json_schema '/tmp/{'x' * 115}': File name too long"),
    ]:
        with pytest.raises(BaigeError) as e:
            load_json_schema(text)
        assert str(e.value) == message
