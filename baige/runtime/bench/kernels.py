"""``baige bench kernels``: every public ``baige.kernels`` op against its PyTorch reference and
``torch.compile`` of that reference, over a size sweep.

Timing: ``triton.testing.do_bench`` (median) on CUDA, warm-up + median of ``iters`` on CPU
(:func:`common.median_time`). Per op and size we count the bytes it must move (inputs read +
outputs written, once each) and the FLOPs it must do, and report effective GB/s = bytes / time,
TFLOP/s = FLOPs / time, and "% of limit" = the larger of GB/s / measured bandwidth and
FLOP/s / measured matmul peak (whichever roof the op is nearer to). Ops with no input generator
here are listed in ``skipped`` (so a new op is never silently left out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from baige import kernels
from baige.kernels import reference
from baige.runtime.bench import roofline
from baige.runtime.bench.common import environment, median_time
from baige.runtime.bench.offline import Progress

# a Llama-ish layer's shapes: hidden 576 / 9 heads / 3 KV heads / head_dim 64 (the embedded model)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152


@dataclass
class KernelsConfig:
    """Resolved arguments of ``baige bench kernels``. ``sizes``: tokens per call."""

    dtype: str = "float32"
    device: str = "auto"
    sizes: tuple[int, ...] = (128, 512, 2048)
    ops: tuple[str, ...] = ()  # empty: every op
    compile: bool = True
    iters: int = 10


@dataclass
class Case:
    """One call of an op: positional args, bytes moved and FLOPs done (counts documented per op)."""

    args: tuple
    bytes: int
    flops: int


def _r(*shape, dt, dev):
    return torch.randn(*shape, dtype=dt, device=dev)


def _cache(blocks: int, block_size: int, dt: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V block pools in whatever layout the engine's :class:`KVCache` uses
    (random contents; the pool's extra scratch block included)."""
    from baige.runtime.config import ModelConfig
    from baige.runtime.kv_cache import KVCache

    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
                                 "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
                                 "num_key_value_heads": KV_HEADS, "max_position_embeddings": 1 << 20})
    kv = KVCache(cfg, blocks, block_size, dt, dev)
    return kv.k[0].normal_(), kv.v[0].normal_()


def make_case(op: str, n: int, dt: torch.dtype, dev: torch.device) -> Case | None:
    """Inputs for ``op`` at ``n`` tokens; None when this harness has no generator for ``op``.

    Byte counts: every input read once and every output written once, at the dtype's size.
    FLOP counts: 2 per multiply-add (matmuls, attention scores and values); elementwise ops count
    their arithmetic per element (rms_norm 4, silu_mul 5, rope 6 per element of q and k).
    """
    e = torch.tensor([], dtype=dt).element_size()
    h = HIDDEN
    if op == "rms_norm":
        return Case((_r(n, h, dt=dt, dev=dev), _r(h, dt=dt, dev=dev), 1e-5), (2 * n * h + h) * e, 4 * n * h)
    if op == "add_rms_norm":
        return Case((_r(n, h, dt=dt, dev=dev), _r(n, h, dt=dt, dev=dev), _r(h, dt=dt, dev=dev), 1e-5),
                    (4 * n * h + h) * e, 5 * n * h)
    if op == "silu_mul":
        return Case((_r(n, INTER, dt=dt, dev=dev), _r(n, INTER, dt=dt, dev=dev)), 3 * n * INTER * e, 5 * n * INTER)
    if op == "apply_rope":
        q, k = _r(1, n, HEADS, HEAD_DIM, dt=dt, dev=dev), _r(1, n, KV_HEADS, HEAD_DIM, dt=dt, dev=dev)
        cos, sin = _r(1, n, HEAD_DIM, dt=dt, dev=dev), _r(1, n, HEAD_DIM, dt=dt, dev=dev)
        qk = n * (HEADS + KV_HEADS) * HEAD_DIM
        return Case((q, k, cos, sin), (2 * qk + 2 * n * HEAD_DIM) * e, 6 * qk)
    if op == "attention":  # causal prefill of one sequence of n tokens: QK^T and PV over ~n^2/2 pairs
        q = _r(1, n, HEADS, HEAD_DIM, dt=dt, dev=dev)
        k, v = _r(1, n, KV_HEADS, HEAD_DIM, dt=dt, dev=dev), _r(1, n, KV_HEADS, HEAD_DIM, dt=dt, dev=dev)
        return Case((q, k, v, HEAD_DIM**-0.5), (2 * n * HEADS + 2 * n * KV_HEADS) * HEAD_DIM * e,
                    2 * 2 * HEADS * HEAD_DIM * n * (n + 1) // 2)
    if op == "store_kv":
        blocks = n // 16 + 1
        kc, vc = _cache(blocks, 16, dt, dev)
        k, v = _r(n, KV_HEADS, HEAD_DIM, dt=dt, dev=dev), _r(n, KV_HEADS, HEAD_DIM, dt=dt, dev=dev)
        slots = torch.randperm(blocks * 16, device=dev)[:n]
        return Case((k, v, kc, vc, slots), 4 * n * KV_HEADS * HEAD_DIM * e, 0)
    if op == "paged_decode_attention":  # 8 sequences of n cached tokens each, one query each
        S, bs = 8, 16
        W = -(-n // bs)
        kc, vc = _cache(S * W, bs, dt, dev)
        tables = torch.arange(S * W, device=dev).view(S, W)
        lens = torch.full((S,), n, dtype=torch.int64, device=dev)
        return Case((_r(S, HEADS, HEAD_DIM, dt=dt, dev=dev), kc, vc, tables, lens, HEAD_DIM**-0.5),
                    (2 * S * n * KV_HEADS + 2 * S * HEADS) * HEAD_DIM * e, 4 * S * HEADS * HEAD_DIM * n)
    if op == "paged_prefill_attention":  # 4 sequences prefilling n/4 new tokens each (no cached prefix)
        P, bs = 4, 16
        T = max(1, n // P)
        W = -(-T // bs)
        kc, vc = _cache(P * W, bs, dt, dev)
        tables = torch.arange(P * W, device=dev).view(P, W)
        cu = torch.arange(0, P * T + 1, T, device=dev)
        lens = torch.full((P,), T, dtype=torch.int64, device=dev)
        return Case((_r(P * T, HEADS, HEAD_DIM, dt=dt, dev=dev), kc, vc, tables, cu, lens, HEAD_DIM**-0.5),
                    (2 * P * T * HEADS + 2 * P * T * KV_HEADS) * HEAD_DIM * e,
                    2 * 2 * HEADS * HEAD_DIM * P * (T * (T + 1) // 2))
    if op == "fused_linear_cross_entropy":  # n tokens through the (VOCAB, hidden) head
        return Case((_r(n, h, dt=dt, dev=dev), _r(VOCAB, h, dt=dt, dev=dev) * 0.02,
                     torch.randint(0, VOCAB, (n,), device=dev)), (n * h + VOCAB * h) * e + 8 * n, 2 * n * h * VOCAB)
    return None


def _timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median") / 1e3
    return lambda fn: median_time(fn, warmup=2, iters=iters)


def run_kernels(cfg: KernelsConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench kernels``; returns the JSON result with one row per (op, size, impl)."""
    from baige.runtime.loader import resolve_device

    dev = resolve_device(cfg.device)
    dt = getattr(torch, cfg.dtype)
    limits = roofline.hardware_limits(dev, dt)
    timer = _timer(dev, cfg.iters)
    ops = list(cfg.ops) or list(kernels.__all__)
    rows, skipped = [], []
    total, done = len(ops) * len(cfg.sizes), 0
    interrupted = False
    try:
        for op in ops:
            ref = getattr(reference, op)
            impls = {"baige": getattr(kernels, op), "reference": ref}
            if cfg.compile:
                impls["torch.compile"] = torch.compile(ref, dynamic=False)
            for n in cfg.sizes:
                case = make_case(op, n, dt, dev)
                done += 1
                if case is None:
                    if op not in skipped:
                        skipped.append(op)
                    continue
                with torch.inference_mode():
                    for impl, fn in impls.items():
                        t = timer(lambda fn=fn: fn(*case.args))
                        gb_s, tflop_s = case.bytes / t / 1e9, case.flops / t / 1e12
                        pct = max(100 * case.bytes / t / limits.bandwidth, 100 * case.flops / t / limits.matmul_peak)
                        rows.append({"op": op, "tokens": n, "impl": impl, "time_s": t, "bytes": case.bytes,
                                     "flops": case.flops, "gb_s": gb_s, "tflop_s": tflop_s, "pct_of_limit": pct})
                if progress:
                    progress(done, total, f"{op} n={n}")
    except KeyboardInterrupt:
        interrupted = True
    return {"benchmark": "kernels", "args": asdict(cfg), "environment": environment(), "limits": limits.to_dict(),
            "interrupted": interrupted, "skipped": skipped, "samples": rows,
            "summary": {"ops": sorted({r["op"] for r in rows}), "rows": len(rows)}}
