"""Causal training attention on the CPU: PyTorch's scaled_dot_product_attention (its flash kernel) against baige's
materialised-scores path (baige/kernels/train_attention.py), eager and under torch.compile, forward + backward,
CPU seconds per call (time.process_time) by sequence length and dtype: the measurement behind
train_attention.MAX_LEN_EAGER / MAX_LEN_COMPILED and the bf16/fp16-only rule.

SmolLM2-135M's attention shapes by default (9 query heads, 3 K/V heads, head_dim 64).

    python scripts/bench_train_attention.py --threads 1 --output attn.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from baige.kernels import reference, train_attention


def per_call_seconds(fn, B, T, H, Hkv, D, dtype, iters: int) -> float:
    """Median CPU seconds of forward + backward of ``fn(q, k, v)`` over ``iters`` calls (3 warm-up calls)."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(B, T, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    do = torch.randn(B, T, H, D, generator=g).to(dtype)
    times = []
    for i in range(iters + 3):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        t0 = time.process_time()
        fn(q, k, v).backward(do)
        if i >= 3:
            times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2x128,2x256,1x512,1x1024", help="comma-separated BATCHxSEQ")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = list(os.getloadavg())
    scale = args.head_dim**-0.5
    impls = {
        "sdpa": lambda q, k, v: reference.attention(q, k, v, scale),
        "materialized eager": lambda q, k, v: train_attention.causal_attention(q, k, v, scale),
        "materialized compiled": torch.compile(lambda q, k, v: train_attention.causal_attention(q, k, v, scale)),
    }
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in args.shapes.split(","):
            B, T = map(int, shape.split("x"))
            row = {"dtype": dtype_name, "batch": B, "seq_len": T}
            for name, fn in impls.items():
                row[f"{name} ms"] = 1e3 * per_call_seconds(
                    fn, B, T, args.heads, args.kv_heads, args.head_dim, dtype, args.iters
                )
            rows.append(row)
            print(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    from baige.runtime.bench.common import environment

    env = environment()
    env["command"] = shlex.join(["python", "scripts/bench_train_attention.py", *sys.argv[1:]])
    result = {
        "benchmark": "train_attention",
        "environment": env,
        "args": vars(args),
        "load_average_before": load,
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
