"""GRPO step time and rollout throughput: baige (`baige bench grpo`: the engine in the training process,
in-place weight sync) vs TRL's `GRPOTrainer` (PyPI `trl`, its default transformers `generate` on CPU), on
the same model, prompts (the procedural arithmetic task), group size, prompts per step, max tokens, learning
rate and steps, with the `exact_answer` reward. Both fp32, no KL term, token-mean loss (TRL's `dapo`), one
process, no activation checkpointing.

Per step: wall time, the rollout's share (baige: the trainer's `rollout_s`; TRL: the time inside the model's
`generate`) and generated tokens/s, and the mean reward. The JSON (--output) holds both runs' steps and the
ratios of the medians over steps 2..N (step 1 warms up).

    python scripts/bench_grpo_vs_trl.py --steps 4 --prompts-per-step 4 --group-size 4 --max-tokens 48 \\
        --threads 1 --output bench-grpo-vs-trl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def run_baige(args) -> list[dict]:
    from baige.runtime.bench.grpo import GRPOBenchConfig, run_grpo

    cfg = GRPOBenchConfig(
        args.model, args.steps, args.prompts_per_step, args.group_size, args.max_tokens,
        args.prompts_per_step * args.group_size, args.difficulty, args.lr, "cpu", False, args.seed,
    )  # fmt: skip
    return [
        {
            "step": s["step"],
            "step_s": s["step_s"],
            "rollout_s": s["rollout_s"],
            "generated_tokens": s["response_length"] * args.prompts_per_step * args.group_size,
            "reward": s["reward"],
        }
        for s in run_grpo(cfg)["samples"]
    ]


def run_trl(args, out_dir: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from baige.runtime.train.rl.rewards import exact_answer
    from baige.runtime.train.rl.tasks import arithmetic_problems
    from baige.runtime.weights.hub import resolve_model

    model_dir = str(resolve_model(args.model))
    problems = arithmetic_problems(args.steps * args.prompts_per_step, args.seed, args.difficulty)
    data = Dataset.from_list([{"prompt": p["messages"], "answer": str(p["answer"])} for p in problems])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generate, gen_time = model.generate, [0.0]

    def timed_generate(*a, **k):  # the rollout's share of the step
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_time[0] += time.perf_counter() - t0

    model.generate = timed_generate

    def reward(prompts, completions, answer, **_):
        return exact_answer(prompts, [c[-1]["content"] for c in completions], answer)

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, gen_time[0] = time.perf_counter(), 0.0

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                n = args.prompts_per_step * args.group_size
                steps.append(
                    {
                        "step": state.global_step,
                        "step_s": time.perf_counter() - self.t0,
                        "rollout_s": gen_time[0],
                        "generated_tokens": logs["completions/mean_length"] * n,
                        "reward": logs["reward"],
                    }
                )

    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        per_device_train_batch_size=args.prompts_per_step * args.group_size, num_generations=args.group_size,
        max_completion_length=args.max_tokens, temperature=1.0, beta=0.0, loss_type="dapo", logging_steps=1,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=args.seed, shuffle_dataset=False,
        gradient_checkpointing=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Timer()],
    )
    trainer.train()
    return steps


def summary(rows: list[dict]) -> dict:
    timed = rows[1:] or rows
    step_s = statistics.median(r["step_s"] for r in timed)
    rollout_s = statistics.median(r["rollout_s"] for r in timed)
    tps = statistics.median(r["generated_tokens"] / r["rollout_s"] for r in timed)
    return {
        "step_s": step_s,
        "rollout_s": rollout_s,
        "rollout_tokens_per_s": tps,
        "rewards": [r["reward"] for r in rows],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=Path("bench-grpo-vs-trl.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    baige = run_baige(args)
    trl = run_trl(args, args.output.parent / "trl-run")
    b, t = summary(baige), summary(trl)
    result = {
        "args": vars(args) | {"output": str(args.output)},
        "baige": {"steps": baige, "summary": b},
        "trl": {"steps": trl, "summary": t},
        "step_speedup": t["step_s"] / b["step_s"],
        "rollout_speedup": t["rollout_s"] / b["rollout_s"],
    }
    args.output.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("step_speedup", "rollout_speedup")} | {"baige": b, "trl": t}, indent=1))


if __name__ == "__main__":
    main()
