"""Where one training step's CPU time goes: baige's Trainer against the HF loops of
``scripts/bench_train_vs_hf.py``, by op category, from ``torch.profiler`` (self CPU time) and
``time.process_time`` (this process's CPU seconds, which a loaded shared machine does not inflate the way it
inflates wall time).

The same set-up as the benchmark (its ``baige_runner`` / ``hf_runner``): each run takes ``--warmup`` steps
(baige's compile happens there), then ``--steps`` steps are timed with ``process_time``, the runs interleaved
step by step, then one more step of each is profiled. Categories are matched on the profiler's op names
(aten ops, oneDNN / mkldnn calls, Inductor's compiled kernels, autograd nodes):

- ``matmul``: aten::mm / addmm / linear's kernels (forward and backward, oneDNN);
- ``attention``: scaled_dot_product_attention and its flash-attention backward, and aten::bmm (in these
  models only attention multiplies batched matrices: baige's short-sequence training attention);
- ``fused kernels (compiled)``: the calls of Inductor's compiled graphs (baige's blocks: norms, RoPE, SiLU,
  softmax, and the weights' bf16 casts inside them);
- ``cross-entropy (besides its matmuls)``: baige's fused linear cross-entropy's own time (its native row
  pass included), HF's log_softmax / nll_loss and their backward;
- ``optimizer and clipping``: the fused AdamW and the gradient-norm clip;
- ``casts / copies``: aten::to / copy_ / _to_copy outside compiled code;
- ``elementwise / reductions / other``: everything else (autograd bookkeeping included).

    python scripts/profile_train_step.py --threads 1 --seq-len 128 --batch-size 2 --output prof.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_train_vs_hf as bench  # noqa: E402  (scripts/: the benchmark's runners)

CATEGORIES = (
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "aten::bmm")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "mkldnn", "onednn")),
    ("cross-entropy (besides its matmuls)", ("crossentropy", "log_softmax", "nll_loss", "logsumexp")),
    ("optimizer and clipping", ("adam", "clip_grad", "foreach", "_fused", "vector_norm")),
    ("casts / copies", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous")),
)


def category(name: str) -> str:
    """The category of one profiler event name (see the module docstring)."""
    low = name.lower()
    if "cpp_fused" in low or "compiledfxgraph" in low or "inductor" in low:
        return "fused kernels (compiled)"
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise / reductions / other"


def profile_step(step) -> tuple[dict, list]:
    """One call of ``step`` under torch.profiler: (category -> self CPU seconds, the top 25 ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    cats: dict[str, float] = defaultdict(float)
    ops = []
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        cats[category(e.key)] += s
        ops.append((e.key, s, e.count))
    ops.sort(key=lambda o: -o[1])
    return dict(cats), [{"op": k, "self_cpu_s": s, "calls": c} for k, s, c in ops[:25]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=str(bench.DATA))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hf-dtypes", default="bf16-autocast,bfloat16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    args.device = "cpu"
    torch.set_num_threads(args.threads)
    load = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        args.steps_total = args.warmup + args.steps + 1
        ns = argparse.Namespace(**{**vars(args), "steps": args.steps_total})
        trainer, baige_step = bench.baige_runner(ns, Path(tmp) / "run")
        runners = {"baige": baige_step}
        for d in args.hf_dtypes.split(","):
            runners[f"hf {d}"] = bench.hf_runner(ns, trainer, d)
        for _ in range(args.warmup):
            for step in runners.values():
                step()
        cpu: dict[str, list[float]] = {n: [] for n in runners}
        usage: dict[str, list[tuple]] = {n: [] for n in runners}
        for _ in range(args.steps):
            for name, step in runners.items():
                t0, r0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
                step()
                cpu[name].append(time.process_time() - t0)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                usage[name].append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))
        result = {}
        for name, step in runners.items():
            cats, ops = profile_step(step)
            result[name] = {
                "process_time_s": cpu[name],
                "user_s": [u[0] for u in usage[name]],
                "system_s": [u[1] for u in usage[name]],  # the kernel's time: page faults, mostly
                "minor_page_faults": [u[2] for u in usage[name]],
                "categories_s": cats,
                "top_ops": ops,
            }
    tokens = args.seq_len * args.batch_size
    from baige.runtime.bench.common import environment

    env = environment()  # versions, CPU flags, threads, load, commit; the command is this script's
    env["command"] = shlex.join(["python", "scripts/profile_train_step.py", *sys.argv[1:]])
    out = {
        "benchmark": "train_step_profile",
        "environment": env,
        "args": vars(args),
        "tokens_per_step": tokens,
        "flops_per_token": trainer.flops_per_token,
        "load_average_before": load,
        "load_average_after": list(os.getloadavg()),
        "runs": result,
    }
    for name, r in result.items():
        best = min(r["process_time_s"])
        print(f"\n== {name}: CPU s/step {[round(s, 3) for s in r['process_time_s']]} -> {tokens / best:.1f} tok/CPU-s")
        print(f"   system s/step {[round(s, 3) for s in r['system_s']]}, minor page faults {r['minor_page_faults']}")
        for cat, s in sorted(r["categories_s"].items(), key=lambda kv: -kv[1]):
            print(f"   {cat:36s} {s:7.3f} s")
        for o in r["top_ops"][:15]:
            print(f"      {o['op'][:60]:60s} {o['self_cpu_s']:7.3f} s  x{o['calls']}")
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
