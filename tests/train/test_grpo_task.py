"""scripts/make_rl_task.py (baige/runtime/train/rl/tasks.py): deterministic arithmetic problems whose
answers are right, in the JSONL the GRPO trainer reads, and their exact_answer reward."""

from __future__ import annotations

import ast
import json
import operator

import pytest
from conftest import _load_script

from baige.runtime.train.rl.prompts import read_prompts
from baige.runtime.train.rl.rewards import exact_answer

task = _load_script("make_rl_task")
BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node) -> int:
    """The oracle: the expression's value from Python's own parser (integers, + - * only)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    assert isinstance(node, ast.BinOp) and type(node.op) in BINOPS, ast.dump(node)
    return BINOPS[type(node.op)](_value(node.left), _value(node.right))


@pytest.mark.parametrize("difficulty", [1, 2, 3, 5])
def test_problems_are_right_and_deterministic(tmp_path, difficulty):
    out = tmp_path / "task.jsonl"
    assert task.main(["-o", str(out), "-n", "40", "--seed", "7", "--difficulty", str(difficulty)]) == 0
    text = out.read_text()
    assert (
        task.main(["-o", str(tmp_path / "again.jsonl"), "-n", "40", "--seed", "7", "--difficulty", str(difficulty)])
        == 0
    )
    assert (tmp_path / "again.jsonl").read_text() == text
    records = [json.loads(line) for line in text.splitlines()]
    for r in records:
        content = r["messages"][0]["content"]
        expr = content.removeprefix("Compute ").removesuffix(". Put the final answer in \\boxed{}.")
        tree = ast.parse(expr, mode="eval").body
        assert _value(tree) == r["answer"] and r["difficulty"] == difficulty
        assert sum(isinstance(n, ast.Constant) for n in ast.walk(tree)) == difficulty + 1
        if difficulty == 1:
            assert "*" not in expr
    assert len({r["answer"] for r in records}) > 5  # not one problem repeated
    # the trainer reads the file; exact_answer pays for the boxed answer only
    prompts = read_prompts([str(out)], required=("answer",))
    answers = [p.fields["answer"] for p in prompts]
    replies = [f"so it is \\boxed{{{a}}}" for a in answers]
    assert exact_answer(None, replies, answer=answers) == [1.0] * 40
    assert exact_answer(None, [f"\\boxed{{{a + 1}}}" for a in answers], answer=answers) == [0.0] * 40


def test_prompt_format_and_errors(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert task.main(["-o", str(out), "-n", "2", "--format", "prompt", "--difficulty", "1"]) == 0
    assert all(set(json.loads(x)) == {"prompt", "answer", "difficulty"} for x in out.read_text().splitlines())
    capsys.readouterr()
    assert task.main(["-o", str(out), "--difficulty", "6"]) == 2
    assert capsys.readouterr().err.strip() == "error: --difficulty must be in 1..5 (got 6)"
    assert task.main(["-o", str(tmp_path / "no" / "x.jsonl")]) == 2
    assert "not a file in an existing directory" in capsys.readouterr().err
