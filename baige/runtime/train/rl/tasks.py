"""Procedural RL tasks that need no download: integer arithmetic problems with exact answers, as the
prompt records ``baige train --method grpo`` reads (``scripts/make_rl_task.py`` writes them to a file,
``baige bench grpo`` generates them for its run).

Difficulty k (1..5) draws an expression of k + 1 integer operands in [0, 10 k] joined by ``+``, ``-``
(k = 1) and ``*`` (k >= 2), read with the usual precedence (k <= 2) or bracketed at random (k >= 3);
the answer is its exact integer value, for the ``exact_answer`` reward. The same seed, difficulty and
count give the same problems.
"""

from __future__ import annotations

import random

INSTRUCTION = "Compute {expr}. Put the final answer in \\boxed{{}}."
MAX_DIFFICULTY = 5


def expression(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """One expression of ``difficulty + 1`` operands (see the module docstring) and its exact value."""
    ops = "+-" if difficulty == 1 else "+-*"
    values = [rng.randint(0, 10 * difficulty) for _ in range(difficulty + 1)]
    chosen = [rng.choice(ops) for _ in values[1:]]
    if difficulty < 3:  # flat, read with the usual precedence: products first, then + and - left to right
        products, signs = [values[0]], []
        for op, v in zip(chosen, values[1:]):
            if op == "*":
                products[-1] *= v
            else:
                products.append(v)
                signs.append(op)
        total = products[0]
        for op, v in zip(signs, products[1:]):
            total = total + v if op == "+" else total - v
        return " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(chosen, values[1:])]), total
    terms = [(str(v), v) for v in values]
    for op in chosen:  # join two neighbours at a random place, bracketed (the last join needs none)
        i = rng.randrange(len(terms) - 1)
        (ta, a), (tb, b) = terms[i], terms[i + 1]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        terms[i : i + 2] = [(f"{ta} {op} {tb}" if len(terms) == 2 else f"({ta} {op} {tb})", value)]
    return terms[0]


def arithmetic_problems(n: int, seed: int, difficulty: int, fmt: str = "messages") -> list[dict]:
    """``n`` prompt records: ``{"messages": [user turn]}`` (``fmt`` "messages") or ``{"prompt": text}``
    ("prompt"), each with its ``answer`` (int) and ``difficulty``."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        expr, value = expression(rng, difficulty)
        text = INSTRUCTION.format(expr=expr)
        record = {"messages": [{"role": "user", "content": text}]} if fmt == "messages" else {"prompt": text}
        out.append({**record, "answer": value, "difficulty": difficulty})
    return out
