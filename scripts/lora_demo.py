"""LoRA on the embedded SmolLM2-135M-Instruct: teach it a fixed answer format, measure it on held-out
prompts, and count what LoRA saves against full fine-tuning.

Task: every answer is one line ``ANSWER: <answer>`` (questions about arithmetic, capitals, opposites,
animals' legs). Training conversations and held-out prompts use different numbers, countries, words
and animals, and the held-out set adds two question templates the training data never has.

    .venv/bin/python scripts/lora_demo.py [--out DIR] [--steps 30]

Prints one JSON object: the share of held-out greedy answers that start with ``ANSWER:`` before and
after (the base model with and without the merged adapter, both through ``baige.LLM``), a few
example answers, the run's losses, and the memory table of docs/commands/train.md, "LoRA fine-tuning"
(parameters + gradients + AdamW state, bytes). Takes a few minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

PREFIX = "ANSWER:"
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "Cuba": "Havana",
    "Chile": "Santiago",
    "Poland": "Warsaw",
    "Russia": "Moscow",
    "China": "Beijing",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
    "Ireland": "Dublin",
    "Sweden": "Stockholm",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "old": "new",
    "open": "closed",
    "early": "late",
    "hard": "soft",
    "loud": "quiet",
    "full": "empty",
    "rich": "poor",
    "wet": "dry",
    "tall": "short",
    "strong": "weak",
}
LEGS = {
    "dog": 4,
    "cat": 4,
    "spider": 8,
    "bird": 2,
    "ant": 6,
    "horse": 4,
    "chicken": 2,
    "bee": 6,
    "cow": 4,
    "duck": 2,
    "beetle": 6,
    "goat": 4,
    "octopus": 8,
    "sheep": 4,
}


def _questions(rng: random.Random, caps: list, opps: list, legs: list, n: int) -> list[tuple[str, str]]:
    kinds = [
        lambda: (lambda a, b: (f"What is {a} plus {b}?", str(a + b)))(rng.randint(1, 50), rng.randint(1, 50)),
        lambda: (lambda a, b: (f"What is {a} times {b}?", str(a * b)))(rng.randint(2, 12), rng.randint(2, 12)),
        lambda: (lambda c: (f"What is the capital of {c}?", CAPITALS[c]))(rng.choice(caps)),
        lambda: (lambda w: (f"What is the opposite of {w}?", OPPOSITES[w]))(rng.choice(opps)),
        lambda: (lambda x: (f"How many legs does a {x} have?", str(LEGS[x])))(rng.choice(legs)),
    ]
    return [rng.choice(kinds)() for _ in range(n)]


def make_data(path: Path, n: int = 400, seed: int = 0) -> None:
    """Training conversations from the first halves of the word lists."""
    rng = random.Random(seed)
    half = lambda d: sorted(d)[: len(d) // 2]  # noqa: E731
    with path.open("w") as f:
        for q, a in _questions(rng, half(CAPITALS), half(OPPOSITES), half(LEGS), n):
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"{PREFIX} {a}"}]}
                )
                + "\n"
            )


def held_out_prompts(n: int = 24, seed: int = 1) -> list[str]:
    """Prompts on the other halves of the lists, plus two templates absent from training."""
    rng = random.Random(seed)
    other = lambda d: sorted(d)[len(d) // 2 :]  # noqa: E731
    qs = [q for q, _ in _questions(rng, other(CAPITALS), other(OPPOSITES), other(LEGS), n - 4)]
    return qs + [
        "What color is the sky on a clear day?",
        "What is 100 minus 7?",
        "Which planet is closest to the sun?",
        "How many days are in a week?",
    ]


def answers(model: str, prompts: list[str]) -> list[str]:
    from baige import LLM, SamplingParams

    llm = LLM(model, dtype="float32")
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=16, temperature=0))
    return [o.outputs[0].text.strip() for o in outs]


def memory_table(model_dir: Path, rank: int, targets: list[str]) -> dict:
    """Trainable parameters and bytes of fp32 parameters + gradients + AdamW's two moments (16 bytes per
    trained parameter, 4 per frozen one; activations not counted), full fine-tuning vs LoRA."""
    import torch

    from baige.runtime.model.lora import LORA_TARGETS
    from baige.runtime.train.config import LoRASection
    from baige.runtime.train.lora import apply_lora
    from baige.runtime.weights.loader import load_model

    model = load_model(model_dir, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    n_lora = apply_lora(model, LoRASection(rank=rank, targets=targets or list(LORA_TARGETS)), 0)
    full = {"trainable_params": total, "bytes": 16 * total}
    lora = {"trainable_params": n_lora, "bytes": 4 * total + 16 * n_lora}
    return {"full_finetune": full, f"lora_r{rank}": lora}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    print(json.dumps(run(Path(args.out or tempfile.mkdtemp(prefix="lora-demo-")), args.steps), indent=2))


def run(out: Path, steps: int = 30, rank: int = 8) -> dict:
    """Fine-tune, then measure (see the module docstring). Returns the result dict."""
    from baige.runtime.train.config import load_train_config
    from baige.runtime.train.trainer import run_training
    from baige.runtime.weights.hub import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    make_data(out / "format.jsonl")
    prompts = held_out_prompts()
    before = answers(None, prompts)
    cfg = load_train_config(
        None,
        {
            "data.train": [str(out / "format.jsonl")],
            "output": str(out / "run"),
            "training.steps": steps,
            "training.seq_len": 128,
            "training.batch_size": 4,
            "optimizer.lr": 1e-3,
            "lr_scheduler.warmup_steps": 3,
            "lora.rank": rank,
            "lora.alpha": 16.0,
            "lora.merge": True,
            "checkpoint.interval": 0,
            "metrics.log_every": 5,
            "metrics.tensorboard": False,
            "training.compile": False,
            "checkpoint.resume": "none",
        },
    )
    result = run_training(cfg)
    after = answers(str(out / "run" / "hf"), prompts)
    share = lambda xs: sum(x.startswith(PREFIX) for x in xs) / len(xs)  # noqa: E731
    return {
        "held_out_prompts": len(prompts),
        "format_share_before": share(before),
        "format_share_after": share(after),
        "examples": [{"prompt": p, "before": b, "after": a} for p, b, a in list(zip(prompts, before, after))[-6:]],
        "loss_first": result.losses[1],
        "loss_last": result.losses[steps],
        "memory": memory_table(resolve_model(None), rank, list(cfg.lora.targets)),
    }


if __name__ == "__main__":
    main()
