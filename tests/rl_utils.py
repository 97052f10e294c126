"""Helpers for the GRPO tests: prompt files, a reward a random tiny model can learn, configs, jobs
for spawned ranks and metrics records."""

from __future__ import annotations

import json
from pathlib import Path

TARGET = "e"  # the character the target_token reward pays for


def target_token_reward(prompts, completions, completion_ids=None, **fields) -> list[float]:
    """Fraction of the reply's characters that are ``TARGET`` (0 for an empty reply)."""
    return [c.count(TARGET) / max(1, len(c)) for c in completions]


def raising_reward(prompts, completions, **fields) -> list[float]:
    raise ValueError("the grader\nis down")


def short_reward(prompts, completions, **fields) -> list[float]:
    return [1.0] * (len(completions) - 1)


def huge_reward(prompts, completions, **fields) -> list[float]:
    return [1e39] * len(completions)  # finite in Python, beyond float32's range


def write_prompts(path: Path, n: int = 8, **fields) -> Path:
    """``n`` prompt records (alternately a plain prompt and a chat conversation) with ``fields``."""
    with open(path, "w") as f:
        for i in range(n):
            text = f"say something {i}"
            record = {"prompt": text} if i % 2 == 0 else {"messages": [{"role": "user", "content": text}]}
            f.write(json.dumps({**record, **fields}) + "\n")
    return path


def grpo_config(model: Path, data: Path, output: Path, **flags):
    """A GRPO TrainConfig for the tiny model: 4 prompts x 8 samples of <= 8 tokens per step, the
    target_token reward, lr 1e-2 constant, no checkpoint but the last, no export."""
    from baige.runtime.train.config import load_train_config

    base = {
        "method": "grpo",
        "model.name": str(model),
        "data.train": [str(data)],
        "output": str(output),
        "rl.rewards": ["rl_utils:target_token_reward"],
        "rl.group_size": 8,
        "rl.prompts_per_step": 4,
        "rl.max_tokens": 8,
        "training.batch_size": 16,
        "training.steps": 12,
        "optimizer.lr": 1e-2,
        "lr_scheduler.name": "constant",
        "metrics.tensorboard": False,
        "checkpoint.interval": 0,
        "checkpoint.keep_latest": 0,
        "checkpoint.export_hf": False,
    }
    base.update(flags)
    return load_train_config(None, base)


def job_grpo(model: str, data: str, output: str, **flags) -> None:
    """One GRPO run (every rank calls it; tests/train_utils.spawn_worker's job)."""
    from baige.runtime.train.trainer import run_training

    run_training(grpo_config(Path(model), Path(data), Path(output), **flags))


TIMING = ("rollout_tokens_per_s", "train_tokens_per_s", "weight_sync_s", "step_time_s", "rollout_s", "train_s")
TIMING += ("peak_memory_gib",)


def read_records(output: Path) -> dict[int, dict]:
    """step -> the GRPO (train) record of metrics.jsonl without its timing fields (later records of a step win)."""
    out = {}
    for line in (output / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] == "train":  # not the checkpoint records
            out[r["step"]] = {k: v for k, v in r.items() if k not in TIMING}
    return out
