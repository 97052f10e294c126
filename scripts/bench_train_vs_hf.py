"""Training throughput of `baige train`'s Trainer vs a plain HF transformers loop on the same data.

Both runs start from the same checkpoint, see the same windows in the same order (baige's
DataLoader), use AdamW with the same hyper-parameters and parameter groups and clip at the same
norm; tokens/s is the median over steps 2..N (step 1 is warm-up). The runs' steps are interleaved by default
(step i of every run before step i + 1 of any, all models in memory): on a shared machine a load that changes
while measuring then falls on every run alike. MFU uses the same formula and
peak for both: model.flops_per_token(seq_len) (6N + 12LHQT) x tokens/s / the measured matmul peak.
baige runs with the trainer's defaults (torch.compile of the blocks on CPU: step 1 includes the compile;
``--dtype auto``: bf16 compute with fp32 master weights on a CPU with native bf16, else fp32).

HF runs in each of ``--hf-dtypes`` and the speedup is against the fastest of them ("HF's best dtype"):
float32; bf16-autocast (fp32 weights and AdamW, matmuls in bf16 under ``torch.autocast``: what the HF
Trainer's ``bf16=True`` does); bfloat16 (the model loaded in bf16, weights and AdamW state in bf16).

    python scripts/bench_train_vs_hf.py --steps 12 --seq-len 128 --batch-size 4 --threads 2 \
        --output bench-train.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from data_files import data_dir  # scripts/: $BAIGE_DATA, else tests/data

DATA = data_dir() / "tinyshakespeare.txt"


def baige_runner(args, out_dir: Path):
    """baige's Trainer and its one-step function (returns the step's loss)."""
    from baige.runtime.train.config import load_train_config
    from baige.runtime.train.trainer import Trainer

    cfg = load_train_config(
        None,
        {
            "model.name": args.model,
            "data.train": [args.data],
            "output": str(out_dir),
            "training.steps": args.steps,
            "training.seq_len": args.seq_len,
            "training.batch_size": args.batch_size,
            "optimizer.lr": args.lr,
            "lr_scheduler.name": "constant",
            "metrics.tensorboard": False,
            "checkpoint.export_hf": False,
            "training.device": args.device,
            "training.compile": "auto" if args.compile is None else args.compile,
        },
    )
    trainer = Trainer(cfg)

    def step() -> float:
        loss, _, _ = trainer.train_step()
        return loss

    return trainer, step


HF_DTYPES = ("float32", "bf16-autocast", "bfloat16")


def hf_runner(args, trainer, hf_dtype: str):
    """The one-step function of the same steps through transformers' LlamaForCausalLM with a plain PyTorch
    loop, in ``hf_dtype`` (one of :data:`HF_DTYPES`)."""
    from transformers import AutoModelForCausalLM

    from baige.runtime.train.data import DataLoader

    device = trainer.device
    weights = torch.bfloat16 if hf_dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(trainer.model_dir, dtype=weights).to(device).train()
    o = trainer.cfg.optimizer
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed_tokens" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        fused=True,  # torch's fused AdamW (CUDA and CPU), as baige uses
    )
    t = trainer.cfg.training
    loader = DataLoader(trainer.train_windows, t.batch_size, 1, 1, 0, t.seed, trainer.cfg.data.shuffle)

    def step() -> float:
        ((x, y),) = loader.next_step()
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=hf_dtype == "bf16-autocast"):
            logits = model(input_ids=x).logits  # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def timed_steps(runners: dict, steps: int, interleave: bool) -> dict:
    """name -> (step seconds, losses, step CPU seconds) of ``steps`` steps of each runner: all steps of one
    runner after the other, or (``interleave``) step i of every runner before step i + 1 of any, so that a load
    that varies while measuring (a shared machine) falls on all runners alike. The CPU seconds are this
    process's (``time.process_time``, all its threads): on a loaded machine wall time grows past them."""
    out = {name: ([], [], []) for name in runners}
    order = (
        [(i, n) for i in range(steps) for n in runners]
        if interleave
        else [(i, n) for n in runners for i in range(steps)]
    )
    for _, name in order:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = runners[name]()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out[name][0].append(time.perf_counter() - t0)
        out[name][1].append(loss)
        out[name][2].append(time.process_time() - c0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each block of baige's model, or not (default: the trainer's, on for CPU); HF stays eager",
    )
    ap.add_argument(
        "--hf-dtypes",
        default=",".join(HF_DTYPES),
        help=f"comma-separated HF runs ({', '.join(HF_DTYPES)}); the speedup is against the fastest",
    )
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time step i of every run before step i + 1 of any (default; all models in memory at once), "
        "or each run's steps in a row",
    )
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())  # the machine may be shared: every result carries its load

    from baige.runtime.train.metrics import mfu

    hf_dtypes = [d.strip() for d in args.hf_dtypes.split(",")]
    if not set(hf_dtypes) <= set(HF_DTYPES):
        ap.error(f"--hf-dtypes: choose among {', '.join(HF_DTYPES)} (got {args.hf_dtypes!r})")
    with tempfile.TemporaryDirectory() as tmp:
        trainer, baige_step = baige_runner(args, Path(tmp) / "run")
        runners = {"baige": baige_step}
        for hf_dtype in hf_dtypes:
            runners[f"hf {hf_dtype}"] = hf_runner(args, trainer, hf_dtype)
        runs = timed_steps(runners, args.steps, args.interleave)
    b_losses = runs["baige"][1]
    tokens = args.batch_size * args.seq_len
    fpt, peak = trainer.flops_per_token, trainer.peak_flops
    rows = {}
    for name, (times, losses, cpu) in runs.items():
        tps = tokens / statistics.median(times[1:])
        rows[name] = {
            "tokens_per_second": tps,
            "mfu": mfu(tps, fpt, peak),
            "step_seconds": times,
            "step_cpu_seconds": cpu,
            "tokens_per_cpu_second": tokens / statistics.median(cpu[1:]),
            "losses": losses,
        }
    best_hf = max((n for n in rows if n != "baige"), key=lambda n: rows[n]["tokens_per_second"])
    from baige.runtime.bench.common import environment

    env = environment()  # versions, CPU flags, threads, load, commit; the command is this script's
    env["command"] = shlex.join(["python", "scripts/bench_train_vs_hf.py", *sys.argv[1:]])
    result = {
        "benchmark": "train_vs_hf",
        "args": vars(args),
        "environment": env,
        "device": str(trainer.device),
        "threads": torch.get_num_threads(),
        "baige_dtype": str(trainer.param_dtype).removeprefix("torch."),
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "steps": args.steps,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens_per_step": tokens,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_source": trainer.peak_source,
        "runs": rows,
        "best_hf": best_hf,
        "speedup": rows["baige"]["tokens_per_second"] / rows[best_hf]["tokens_per_second"],
        "speedup_cpu_time": rows["baige"]["tokens_per_cpu_second"]
        / max(rows[n]["tokens_per_cpu_second"] for n in rows if n != "baige"),
        "max_loss_difference": {
            n: max(abs(a - b) for a, b in zip(b_losses, rows[n]["losses"])) for n in rows if n != "baige"
        },
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"train throughput, {tokens} tokens/step, {args.steps} steps on {result['device']} "
        f"({result['threads']} threads)"
    )
    for col in ("run", "tokens/s", "tokens/CPU-s", "MFU (%)", "first loss", "last loss"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['tokens_per_second']:.1f}",
            f"{r['tokens_per_cpu_second']:.1f}",
            f"{100 * r['mfu']:.1f}",
            f"{r['losses'][0]:.4f}",
            f"{r['losses'][-1]:.4f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"baige ({result['baige_dtype']}) vs the fastest HF run ({best_hf}): speedup {result['speedup']:.2f}x "
        f"(in CPU time vs HF's fastest: {result['speedup_cpu_time']:.2f}x); "
        f"max |loss difference| {result['max_loss_difference'][best_hf]:.2e}; peak {peak / 1e12:.3f} TFLOP/s "
        f"({trainer.peak_source}); load average {load_before[0]:.2f} before, "
        f"{result['load_average_after'][0]:.2f} after"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
