"""The native bf16 linears (bf16.c) over one decode step's weight stream: SmolLM2-135M's 30 layers of joined
projections (q|k|v 960 x 576, o 576 x 576, gate|up 3072 x 576, down 576 x 1536) then the tied lm_head
(49152 x 576), bf16 weights N(0, 0.05) placed in the huge-page weight arena in the order a step reads them
(as the engine places a model's: ``kernels.to_weight_arena``), 270 MB in all, so every pass streams them
from memory.

For each thread count and row count it times whole passes (the 120 layer projections, then lm_head; fp32
activations, no bias) and reports the median of ``--repeats`` passes after two warm-up passes: milliseconds,
GFLOP/s and GB/s of weights. Writes a ``bf16_linear`` record with ``--output-dir``.

    python scripts/bench_bf16_linear.py --threads 1,2 --rows 1,4,8,16 --output-dir docs/benchmarks/records
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer, in execution order
HEAD = (49152, 576)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def weights() -> list[torch.Tensor]:
    """The 121 bf16 matrices in the order a decode step reads them, each placed in the weight arena."""
    from baige import kernels

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            out.append(kernels.to_weight_arena((torch.randn(n, k, generator=g) * 0.05).bfloat16()))
    out.append(kernels.to_weight_arena((torch.randn(*HEAD, generator=g) * 0.05).bfloat16()))
    return out


def time_pass(lib, ws: list[torch.Tensor], rows: int, threads: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the layer projections and of lm_head over ``repeats`` passes (two warm-up passes
    first), calling the library directly with preallocated activations and outputs."""
    xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES} | {HEAD[1]}}
    ys = [torch.empty(rows, w.shape[0]) for w in ws]
    calls = [
        (xs[w.shape[1]].data_ptr(), rows, w.shape[1], w.shape[1], w.data_ptr(), w.shape[0], w.shape[1], y.data_ptr())
        for w, y in zip(ws, ys)
    ]
    layers, head = [], []
    for rep in range(repeats + 2):
        t0 = time.perf_counter()
        for xp, m, k, ldx, wp, n, ldw, yp in calls[:-1]:
            lib.baige_linear_bf16(xp, m, k, ldx, wp, n, ldw, None, None, yp, n, threads)
        t1 = time.perf_counter()
        xp, m, k, ldx, wp, n, ldw, yp = calls[-1]
        lib.baige_linear_bf16(xp, m, k, ldx, wp, n, ldw, None, None, yp, n, threads)
        t2 = time.perf_counter()
        if rep >= 2:
            layers.append(t1 - t0)
            head.append(t2 - t1)
    return statistics.median(layers), statistics.median(head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=_ints, default=[1, 2], help="comma-separated thread counts")
    ap.add_argument("--rows", type=_ints, default=[1, 4, 8, 16], help="comma-separated activation row counts")
    ap.add_argument("--repeats", type=int, default=9, help="timed passes per configuration (median)")
    ap.add_argument("--note", default="", help="free text kept in the record (machine state, what changed)")
    ap.add_argument("--output-dir", type=Path, default=None)
    args = ap.parse_args()

    from baige.kernels.cpu.build import library
    from baige.runtime.bench.common import environment, write_result

    lib = library()
    if lib is None:
        sys.exit("error: the native CPU library is not available on this machine (needs AVX2 and a C compiler)")
    ws = weights()
    layer_bytes = sum(w.numel() * 2 for w in ws[:-1])
    head_bytes = ws[-1].numel() * 2
    results = []
    for threads in args.threads:
        for rows in args.rows:
            lt, ht = time_pass(lib, ws, rows, threads, args.repeats)
            row = {
                "threads": threads,
                "rows": rows,
                "layers_ms": lt * 1e3,
                "lm_head_ms": ht * 1e3,
                "total_ms": (lt + ht) * 1e3,
                "layers_gflops": 2 * rows * layer_bytes / 2 / lt / 1e9,
                "lm_head_gflops": 2 * rows * head_bytes / 2 / ht / 1e9,
                "weights_gb_per_s": (layer_bytes + head_bytes) / (lt + ht) / 1e9,
            }
            results.append(row)
            print(
                f"threads {threads} rows {rows:3d}: layers {row['layers_ms']:7.2f} ms ({row['layers_gflops']:6.1f} "
                f"GFLOP/s)  lm_head {row['lm_head_ms']:6.2f} ms  total {row['total_ms']:7.2f} ms "
                f"({row['weights_gb_per_s']:5.1f} GB/s of weights)"
            )
    result = {
        "benchmark": "bf16_linear",
        "settings": {"layers": LAYERS, "shapes": SHAPES, "lm_head": HEAD, "repeats": args.repeats, "note": args.note},
        "environment": {
            **environment(),
            "command": shlex.join(["python", "scripts/bench_bf16_linear.py", *sys.argv[1:]]),
        },
        "weights_mb": (layer_bytes + head_bytes) / 2**20,
        "results": results,
    }
    if args.output_dir:
        print(write_result(args.output_dir, "bf16_linear", result))


if __name__ == "__main__":
    main()
