"""The native CPU quantized linears, exact (``BAIGE_CPU_INT_DOT=0``: dequantize in registers, fp32
FMA) against integer dot products (qdot.c) with one activation pass (int8 blocks) and two (+ the
residual: ``BAIGE_CPU_INT_DOT_PASSES``), on SmolLM2-135M's projection shapes x 30 layers.

Best of 5 runs of all 210 projections per row count, one thread unless ``T`` says otherwise; rows
from ``ROWS`` (comma-separated, default 1,4,16,64,256). Random weights (N(0, 0.05)), RTN-quantized.

    T=1 ROWS=1,4,16 .venv/bin/python scripts/bench_qlinear.py
"""

import os
import time

import torch

from baige.kernels.cpu import qlinear as cpu
from baige.runtime.quant.scheme import QuantScheme, pack_int4, quantize_weight
from baige.runtime.settings import reload_settings

torch.set_num_threads(int(os.environ.get("T", "1")))
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
schemes = {"int8": QuantScheme(8, None), "int4 g32": QuantScheme(4, 32), "int4 g128": QuantScheme(4, 128)}
rows_list = [int(r) for r in os.environ.get("ROWS", "1,4,16,64,256").split(",")]
g = torch.Generator().manual_seed(0)
for name, sc in schemes.items():
    mats = []
    for n, k in shapes * 30:
        q, s, z = quantize_weight(torch.randn(n, k, generator=g) * 0.05, sc)
        mats.append((q if sc.num_bits == 8 else pack_int4(q), s, z))
    for rows in rows_list:
        res = {}
        for dot, passes in (("0", "2"), ("1", "1"), ("1", "2")):
            os.environ["BAIGE_CPU_INT_DOT"] = dot
            os.environ["BAIGE_CPU_INT_DOT_PASSES"] = passes
            reload_settings()
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            best = 1e9
            for rep in range(5):
                t = time.perf_counter()
                for (qw, s, z), (n, k) in zip(mats, shapes * 30):
                    cpu.quantized_linear(xs[k], qw, s, z, sc.group_size)
                best = min(best, time.perf_counter() - t)
            res[dot + passes] = best * 1e3
        ex, one, two = res["02"], res["11"], res["12"]
        print(
            f"{name:10s} M={rows:4d} exact {ex:8.2f} ms  int-dot 1 pass {one:8.2f} ms ({ex / one:.2f}x)  "
            f"2 passes {two:8.2f} ms ({ex / two:.2f}x)",
            flush=True,
        )
