"""``baige bench grpo``: a short GRPO run through the :class:`~baige.runtime.train.rl.grpo.GRPOTrainer`
on the procedural arithmetic task (:mod:`baige.runtime.train.rl.tasks`) with the ``exact_answer`` reward.

Each step is timed whole (rollout, rewards, update, weight sync) and by phase as the trainer measures
them; a sample per step keeps the reward and the step's metrics, so ``--plot`` draws the reward curve.
Summary: the median step time and phase times (seconds), rollout and training tokens/s (medians), the
reward over the first and the last quarter of the steps, peak memory (bytes).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.bench.common import environment
from baige.runtime.bench.offline import Progress
from baige.runtime.config import DATA_SEED_RANGE, check_float, check_int

SAMPLE_KEYS = (
    "reward",
    "reward_std",
    "response_length",
    "entropy",
    "logprob_mismatch",
    "clip_fraction",
    "rollout_s",
    "train_s",
    "weight_sync_s",
    "rollout_tokens_per_s",
    "train_tokens_per_s",
)


@dataclass
class GRPOBenchConfig:
    """Resolved arguments of ``baige bench grpo``. Raises BaigeError for a value out of range."""

    model: str | None = None
    steps: int = 5
    prompts_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 48
    batch_size: int = 8  # sequences per trainer micro-batch
    difficulty: int = 1
    lr: float = 2e-6
    device: str = "auto"
    batch_invariant: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        from baige.runtime.train.rl.tasks import MAX_DIFFICULTY

        for name in ("steps", "prompts_per_step", "max_tokens", "batch_size"):
            check_int(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        check_int("--group-size", self.group_size, 2)
        check_int("--difficulty", self.difficulty, 1, MAX_DIFFICULTY)
        check_float("--lr", self.lr, 0.0)
        check_int("--seed", self.seed, *DATA_SEED_RANGE)


def _train_config(cfg: GRPOBenchConfig, tmp: Path):
    """The bench run's validated GRPO TrainConfig; its prompts (enough for every step) written under ``tmp``."""
    from baige.runtime.train.config import TrainConfig, validate
    from baige.runtime.train.rl.tasks import arithmetic_problems

    data = tmp / "task.jsonl"
    problems = arithmetic_problems(cfg.steps * cfg.prompts_per_step, cfg.seed, cfg.difficulty)
    data.write_text("".join(json.dumps(p) + "\n" for p in problems))
    tc = TrainConfig(output=str(tmp / "run"), method="grpo")
    tc.model.name, tc.data.train = cfg.model, [str(data)]
    t, rl = tc.training, tc.rl
    t.steps, t.batch_size, t.seed, t.device = cfg.steps, cfg.batch_size, cfg.seed, cfg.device
    tc.optimizer.lr, tc.lr_scheduler.name = cfg.lr, "constant"
    rl.rewards, rl.group_size, rl.prompts_per_step = ["exact_answer"], cfg.group_size, cfg.prompts_per_step
    rl.max_tokens, rl.batch_invariant = cfg.max_tokens, cfg.batch_invariant
    tc.metrics.tensorboard, tc.checkpoint.export_hf = False, False
    validate(tc)
    return tc


def run_grpo(cfg: GRPOBenchConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench grpo``; returns the JSON result (a sample per step, summary).

    Raises:
        BaigeError: as ``baige train --method grpo`` (the model, the engine, a step).
    """
    from baige.runtime.train.metrics import peak_memory_bytes
    from baige.runtime.train.rl.grpo import GRPOTrainer

    samples: list[dict] = []
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="baige-bench-grpo-") as tmp:
        trainer = GRPOTrainer(_train_config(cfg, Path(tmp)))
        try:
            for i in range(cfg.steps):
                t0 = time.perf_counter()
                record = trainer.train_step()
                step_s = time.perf_counter() - t0
                samples.append({"step": i + 1, "step_s": step_s, **{k: record[k] for k in SAMPLE_KEYS}})
                if progress:
                    progress(i + 1, cfg.steps, f"reward {record['reward']:.3f}")
        except KeyboardInterrupt:
            interrupted = True
        finally:
            trainer.llm.engine.close()
        mem = peak_memory_bytes(trainer.device)
        dtype = str(trainer.param_dtype).removeprefix("torch.")
    if not samples and not interrupted:
        raise BaigeError("baige bench grpo: no step ran")
    return {
        "benchmark": "grpo",
        "args": asdict(cfg),
        "environment": environment(),
        "dtype": dtype,
        "interrupted": interrupted,
        "samples": samples,
        "summary": _summary(samples, mem) if samples else {},
    }


def _summary(samples: list[dict], peak_memory: int) -> dict:
    def median(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    quarter = max(1, len(samples) // 4)
    return {
        "step_time_s": median("step_s"),
        "rollout_s": median("rollout_s"),
        "train_s": median("train_s"),
        "weight_sync_s": median("weight_sync_s"),
        "rollout_tokens_per_s": median("rollout_tokens_per_s"),
        "train_tokens_per_s": median("train_tokens_per_s"),
        "reward_first": statistics.fmean(s["reward"] for s in samples[:quarter]),
        "reward_last": statistics.fmean(s["reward"] for s in samples[-quarter:]),
        "logprob_mismatch_max": max(s["logprob_mismatch"] for s in samples),
        "peak_memory_bytes": peak_memory,
    }
