"""GRPO against TRL: baige's ``train --method grpo`` and TRL's ``GRPOTrainer`` on the same task and settings.

Both runs train the same model (default: the embedded SmolLM2-135M-Instruct, fp32) on the same prompts
(a JSONL file from ``scripts/make_rl_task.py``), with the same group size, prompts per step, most new
tokens, temperature, learning rate, loss (DAPO's token-mean, clip 0.2, no KL) and the same reward
(baige's built-in ``exact_answer``, called from TRL as a reward function), for the same number of steps,
in one process each, on ``--threads`` CPU threads, neither recomputing activations. TRL generates with
transformers' ``generate`` (its default without vLLM); baige rolls out with its own engine in the same job
and syncs weights in place.

Per step it records the wall time, the rollout (generation) time, the rollout tokens/s and the mean
reward; the JSON (``--out``) holds both runs' per-step rows and their medians. Needs ``trl`` (PyPI
``trl==1.16.0``; it installs beside baige's pins without moving them).

usage: python scripts/bench_rl_vs_trl.py --data task.jsonl [--steps 10] [--group-size 8]
       [--prompts-per-step 2] [--max-tokens 64] [--lr 1e-6] [--threads 2] [--dtype float32|bfloat16]
       [--only baige|trl] [--out rl.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if "answer" not in r or not ("prompt" in r or "messages" in r):
            sys.exit(f"error: {path} line {i + 1}: needs 'answer' and 'prompt' or 'messages'")
    return rows


def run_trl(args, rows: list[dict], model_dir: Path) -> list[dict]:
    """TRL's GRPOTrainer, per-step rows: wall_s, rollout_s, rollout_tokens, reward, response_length."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from baige.runtime.train.rl.rewards import exact_answer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = [
        {"prompt": r.get("messages") or [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
        for r in rows
    ]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master weights

    timing = {"rollout_s": 0.0, "rollout_tokens": 0}
    generate = model.generate

    def timed_generate(*a, **kw):  # instruments this instance only: the rollout phase's time and tokens
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        timing["rollout_s"] += time.perf_counter() - t0
        prompt_len = (kw.get("input_ids") if "input_ids" in kw else a[0]).shape[1]
        ids = out.sequences if hasattr(out, "sequences") else out
        timing["rollout_tokens"] += int((ids[:, prompt_len:] != tok.pad_token_id).sum())
        return out

    model.generate = timed_generate

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return exact_answer(prompts, texts, answer=answer)

    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.t0 = time.perf_counter()
            timing.update(rollout_s=0.0, rollout_tokens=0)

        def on_step_end(self, *_a, **_k):
            steps.append(dict(wall_s=time.perf_counter() - self.t0, **timing))

        def on_log(self, _args, _state, _control, logs=None, **_k):
            if logs and "reward" in logs and steps:
                steps[-1].update(reward=logs["reward"], response_length=logs.get("completions/mean_length"))

    batch = args.group_size * args.prompts_per_step
    trl_out = tempfile.mkdtemp(prefix="trl-grpo-")
    cfg = GRPOConfig(
        output_dir=trl_out,
        use_cpu=True,
        bf16=args.dtype == "bfloat16",  # autocast to bf16 over fp32 weights, as baige's mixed precision
        per_device_train_batch_size=batch,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        gradient_checkpointing=False,  # TRL's default recomputes activations; baige's run keeps them
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=cfg,
        train_dataset=Dataset.from_list(data),
        processing_class=tok,
        callbacks=[StepClock()],
    )
    try:
        trainer.train()
    finally:
        shutil.rmtree(trl_out, ignore_errors=True)
    for s in steps:
        s["rollout_tokens_per_s"] = s["rollout_tokens"] / s["rollout_s"] if s["rollout_s"] else None
    return steps


def run_baige(args, model: str) -> list[dict]:
    """``baige train --method grpo`` in a subprocess; per-step rows from its metrics.jsonl."""
    out = Path(tempfile.mkdtemp(prefix="baige-grpo-"))
    cmd = [
        sys.executable, "-m", "baige", "train", "--method", "grpo", "--model", model, "--data", str(args.data),
        "--reward", "exact_answer", "--steps", str(args.steps), "--lr", str(args.lr), "--output", str(out / "run"),
        "--seed", str(args.seed),
        "--set", f"rl.group_size={args.group_size}", "--set", f"rl.prompts_per_step={args.prompts_per_step}",
        "--set", f"rl.max_tokens={args.max_tokens}", "--set", f"rl.temperature={args.temperature}",
        "--set", "rl.clip_low=0.2", "--set", "rl.clip_high=0.2", "--set", "rl.kl_coef=0",
    ]  # fmt: skip
    if args.batch_invariant:
        cmd.append("--batch-invariant")
    # fp32 master weights either way; bfloat16: bf16 compute in the trainer and bf16 engine weights
    cmd += ["--set", f"parallelism.mixed_precision_param={args.dtype}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    try:
        subprocess.run(cmd, check=True, env=env)
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:  # the run's checkpoint and HF export (~2 GB for SmolLM2) are not kept
        shutil.rmtree(out, ignore_errors=True)
    rows = [r for r in rows if r["split"] == "train"]  # not the checkpoint records
    return [
        dict(
            wall_s=r["step_time_s"],
            rollout_s=r["rollout_s"],
            rollout_tokens_per_s=r["rollout_tokens_per_s"],
            reward=r["reward"],
            response_length=r["response_length"],
            weight_sync_s=r["weight_sync_s"],
            logprob_mismatch=r["logprob_mismatch"],
        )
        for r in rows
        if r.get("split", "train") == "train" and "reward" in r
    ]


def _summary(steps: list[dict]) -> dict:
    later = steps[1:] or steps  # the first step carries one-time costs (compiles, warm-up)
    med = {k: statistics.median([s[k] for s in later if s.get(k) is not None] or [0.0]) for k in later[0]}
    return {
        "median_after_first_step": med,
        "reward_first": steps[0].get("reward"),
        "reward_last": steps[-1].get("reward"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant", action="store_true", help="baige's run in batch-invariant mode")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype of both runs (bfloat16: fp32 master weights, bf16 autocast; baige's engine in bf16)",
    )
    ap.add_argument("--only", choices=["baige", "trl"])
    ap.add_argument("--note", default="", help="free text kept in the record (how the machine was shared, ...)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/rl_vs_trl.json"))
    args = ap.parse_args()

    from baige.runtime.bench.common import environment
    from baige.runtime.weights.hub import resolve_model

    model_dir = resolve_model(args.model)
    rows = _records(args.data)
    result = {
        "benchmark": "rl_vs_trl",
        "settings": {k: str(v) for k, v in vars(args).items()},
        "model_dir": str(model_dir),
        "environment": environment(),  # machine, flags, commit, command, load average at the start
    }
    for name, run in (
        ("baige", lambda: run_baige(args, str(model_dir))),
        ("trl", lambda: run_trl(args, rows, model_dir)),
    ):
        if args.only in (None, name):
            steps = run()
            result[name] = {"steps": steps, **_summary(steps)}
            print(name, json.dumps(result[name]["median_after_first_step"]), flush=True)
    if "baige" in result and "trl" in result:
        b, t = result["baige"]["median_after_first_step"], result["trl"]["median_after_first_step"]
        result["speedup"] = {
            "step": t["wall_s"] / b["wall_s"],
            "rollout": t["rollout_s"] / b["rollout_s"],
        }
        print("speedup (TRL time / baige time):", json.dumps(result["speedup"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
