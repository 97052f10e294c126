"""Write a procedural RL task that needs no download: integer arithmetic problems as the JSONL that
``baige train --method grpo`` reads, with the ``answer`` field that the ``exact_answer`` reward checks
(the generator and its difficulty levels: ``baige/runtime/train/rl/tasks.py``). The same --seed,
--difficulty and -n give the same file.

Usage: python scripts/make_rl_task.py --output arith.jsonl [-n 1000] [--seed 0] [--difficulty 2]
       [--format messages|prompt]
  messages (default): {"messages": [{"role": "user", "content": ...}], "answer": N, "difficulty": k}
  prompt:             {"prompt": ..., "answer": N, "difficulty": k}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from baige.runtime.train.rl.tasks import MAX_DIFFICULTY, arithmetic_problems


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
    lines = [json.dumps(p) + "\n" for p in arithmetic_problems(args.n, args.seed, args.difficulty, args.format)]
    fd, tmp = tempfile.mkstemp(dir=args.output.parent, prefix=f".{args.output.name}.")
    with os.fdopen(fd, "w") as f:  # written whole, then renamed: never a half-written file
        f.writelines(lines)
    os.replace(tmp, args.output)
    print(f"wrote {args.n} problems (difficulty {args.difficulty}, seed {args.seed}) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
