"""Checkpoint stall: the training time a DCP checkpoint costs with each ``checkpoint.async_mode``.

Runs ``baige train`` in-process (the :class:`~baige.runtime.train.trainer.Trainer`, the shape and synthetic
data of ``baige bench train``) once per mode, saving every ``--interval`` steps, and reads the run's
``metrics.jsonl``: each save's ``checkpoint`` record gives ``critical_path_seconds`` (how long training
waited for it: the write itself when ``disabled``; the staging copy, and any wait for a write still in
flight, when async) and ``write_seconds`` (until it was on disk); the ``train`` records give the step times,
split into the steps that ran while a background write was in flight (the step right after a save) and the
others. The final save (nothing left to overlap) is left out of the means; ``--rounds`` runs of every mode,
interleaved, give the medians of those means.

    python scripts/bench_checkpoint.py --model-config scripts/bench_checkpoint_model.json --threads 2 \
        --seq-len 16 --batch-size 1 --steps 7 --interval 3 --rounds 2 \
        --out docs/benchmarks/records/checkpoint-$(date -u +%Y%m%d-%H%M%S).json

(``scripts/bench_checkpoint_model.json``: a 38.8M-parameter Llama, 4 layers of width 512 with SmolLM2's
49152-token vocabulary, whose checkpoint with AdamW's state is 541 MiB.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

MODES = ("disabled", "async", "async_with_pinned_mem")


def run_mode(args, mode: str, tmp: Path) -> dict:
    """One training run with ``checkpoint.async_mode = mode``; its saves and step times (seconds)."""
    from baige.runtime.bench.train import TrainBenchConfig, _train_config
    from baige.runtime.train.trainer import Trainer

    bench = TrainBenchConfig(
        model="debug" if args.model_config is not None else args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        compile=False,
    )
    tc = _train_config(bench, tmp)
    if args.model_config is not None:  # this architecture from scratch, with the preset's (default) tokenizer
        tc.model.config = str(args.model_config)
    tc.checkpoint.interval, tc.checkpoint.async_mode, tc.checkpoint.keep_latest = args.interval, mode, 1
    tc.metrics.log_every = 1
    Trainer(tc).train()
    records = [json.loads(line) for line in (Path(tc.output) / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r["split"] == "checkpoint" and r["step"] < args.steps]
    steps = {r["step"]: r["seconds"] for r in records if r["split"] == "train"}
    after_save = [steps[s["step"] + 1] for s in saves]
    others = [t for s, t in steps.items() if s > 1 and s - 1 not in {x["step"] for x in saves}]
    return {
        "saves": saves,
        "critical_path_seconds_mean": statistics.mean(s["critical_path_seconds"] for s in saves),
        "wait_seconds_mean": statistics.mean(s["wait_seconds"] for s in saves),
        "write_seconds_mean": statistics.mean(s["write_seconds"] for s in saves),
        "step_seconds_after_save_median": statistics.median(after_save),
        "step_seconds_other_median": statistics.median(others),
        "checkpoint_bytes": sum(
            p.stat().st_size for p in (Path(tc.output) / "checkpoints").rglob("*.distcp") if p.is_file()
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a train preset (from scratch) or a model spec")
    ap.add_argument(
        "--model-config", type=Path, default=None, help="a config.json to train from scratch instead of --model"
    )
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9, help="optimizer steps per mode (the last one saves too)")
    ap.add_argument("--interval", type=int, default=2, help="steps between checkpoints")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode, interleaved (the medians are reported)")
    ap.add_argument("--out", type=Path, default=None, help="write the record (JSON) here")
    args = ap.parse_args()

    import torch

    from baige.runtime.bench.common import environment

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):  # the modes interleaved, so that a change in load hits each of them
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix=f"baige-bench-ckpt-{mode}-") as tmp:
                rounds[mode].append(run_mode(args, mode, Path(tmp)))
    keys = [k for k in rounds[modes[0]][0] if k.endswith(("_mean", "_median"))]
    results = {
        m: {**{k: statistics.median(r[k] for r in rs) for k in keys}, "checkpoint_bytes": rs[0]["checkpoint_bytes"]}
        | {"rounds": rs}
        for m, rs in rounds.items()
    }
    env = environment()
    env["command"] = shlex.join(["python", *sys.argv])
    record = {
        "benchmark": "checkpoint",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | ({"model": str(args.model_config)} if args.model_config is not None else {}),  # what was trained
        "environment": env,
        "model_config": json.loads(args.model_config.read_text()) if args.model_config is not None else None,
        "results": results,
    }
    for mode, r in results.items():
        print(
            f"{mode:>22}: {r['critical_path_seconds_mean']:.3f} s on the critical path per save, written in "
            f"{r['write_seconds_mean']:.3f} s; step {r['step_seconds_after_save_median']:.3f} s after a save, "
            f"{r['step_seconds_other_median']:.3f} s otherwise ({r['checkpoint_bytes'] / 2**20:.0f} MiB)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
