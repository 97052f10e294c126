"""A procedural RL task that needs no download: integer arithmetic problems, written as the JSONL that
``baige train --method grpo`` reads, with the ``answer`` field that the ``exact_answer`` reward checks.

Difficulty k (1..5) draws an expression of k + 1 integer operands in [0, 10 k] joined by ``+``, ``-``
(k = 1) and ``*`` (k >= 2), read with the usual precedence (k <= 2) or bracketed at random (k >= 3);
the answer is its exact integer value.
The same --seed, --difficulty and -n give the same file.

Usage: python scripts/make_rl_task.py --output arith.jsonl [-n 1000] [--seed 0] [--difficulty 2]
       [--format messages|prompt]
  messages (default): {"messages": [{"role": "user", "content": ...}], "answer": N, "difficulty": k}
  prompt:             {"prompt": ..., "answer": N, "difficulty": k}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

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


def problems(n: int, seed: int, difficulty: int, fmt: str) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        expr, value = expression(rng, difficulty)
        text = INSTRUCTION.format(expr=expr)
        record = {"messages": [{"role": "user", "content": text}]} if fmt == "messages" else {"prompt": text}
        out.append({**record, "answer": value, "difficulty": difficulty})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", "-o", required=True, type=Path)
    parser.add_argument("-n", type=int, default=1000, help="problems (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, default=2, help=f"1..{MAX_DIFFICULTY} (default 2)")
    parser.add_argument("--format", choices=("messages", "prompt"), default="messages")
    args = parser.parse_args(argv)
    if not 1 <= args.difficulty <= MAX_DIFFICULTY:
        print(f"error: --difficulty must be in 1..{MAX_DIFFICULTY} (got {args.difficulty})", file=sys.stderr)
        return 2
    if args.n < 1:
        print(f"error: -n must be >= 1 (got {args.n})", file=sys.stderr)
        return 2
    if args.output.is_dir() or not args.output.parent.is_dir():
        print(f"error: --output {args.output}: not a file in an existing directory", file=sys.stderr)
        return 2
    lines = [json.dumps(p) + "\n" for p in problems(args.n, args.seed, args.difficulty, args.format)]
    fd, tmp = tempfile.mkstemp(dir=args.output.parent, prefix=f".{args.output.name}.")
    with os.fdopen(fd, "w") as f:  # written whole, then renamed: never a half-written file
        f.writelines(lines)
    os.replace(tmp, args.output)
    print(f"wrote {args.n} problems (difficulty {args.difficulty}, seed {args.seed}) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
