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
from baige.errors import BaigeError
from baige.kernels import reference
from baige.runtime import roofline
from baige.runtime.bench.common import environment, median_time
from baige.runtime.bench.offline import Progress


@dataclass(frozen=True)
class Shape:
    """The layer shapes the cases are built from; ``experts``, ``top_k`` and ``moe_intermediate`` are
    the MoE block of the same hidden size (the MoE ops' cases)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int
    top_k: int
    moe_intermediate: int


SHAPES = {
    # the embedded model (SmolLM2-135M): hidden 576, 9 heads / 3 KV heads of 64, vocab 49152; a SmolLM2-sized
    # MoE block of 8 experts, top-2, intermediate 256
    "smollm2-135m": Shape(576, 9, 3, 64, 1536, 49152, 8, 2, 256),
    # Llama-3-8B (hidden 4096, 32 / 8 heads of 128, vocab 128256): the GPU target shapes; MoE block
    # as Mixtral-8x7B's (8 experts, top-2, intermediate 14336 at hidden 4096)
    "llama3-8b": Shape(4096, 32, 8, 128, 14336, 128256, 8, 2, 14336),
}

# ops with a backward (timed as forward + backward with --backward)
GRAD_OPS = (
    "rms_norm",
    "apply_rope",
    "silu_mul",
    "attention",
    "flash_attention_varlen",
    "fused_linear_cross_entropy",
    "fused_moe",
)


@dataclass
class KernelsConfig:
    """Resolved arguments of ``baige bench kernels``. ``sizes``: tokens per call. Raises BaigeError for
    a dtype, op or shape it does not know, or a size below 1."""

    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"
    sizes: tuple[int, ...] = (128, 512, 2048)
    ops: tuple[str, ...] = ()  # baige.kernels names; empty: every op
    compile: bool = True
    iters: int = 10
    shape: str = "smollm2-135m"  # a SHAPES name
    backward: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise BaigeError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        unknown = [o for o in self.ops if o not in kernels.OPS]
        if unknown:
            raise BaigeError(f"--op {unknown[0]!r} is not a baige.kernels op ({', '.join(kernels.OPS)})")
        if not self.sizes:
            raise BaigeError("--sizes: give at least one token count")
        if min(self.sizes) < 1:
            raise BaigeError(f"--sizes {','.join(map(str, self.sizes))!r}: token counts must be >= 1")
        if self.shape not in SHAPES:
            raise BaigeError(f"--shape {self.shape!r}: choose {' or '.join(SHAPES)}")


@dataclass
class Case:
    """One call of an op: positional args, bytes moved and FLOPs done (counts documented per op)."""

    args: tuple
    bytes: int
    flops: int


def _r(*shape, dt, dev):
    return torch.randn(*shape, dtype=dt, device=dev)


def _cache(
    sh: Shape, blocks: int, block_size: int, dt: torch.dtype, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V block pools in whatever layout the engine's :class:`KVCache` uses
    (random contents; the pool's extra scratch block included)."""
    from baige.runtime.infer.kv_cache import KVCache
    from baige.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": sh.vocab,
            "hidden_size": sh.hidden,
            "intermediate_size": sh.intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": sh.heads,
            "num_key_value_heads": sh.kv_heads,
            "head_dim": sh.head_dim,
            "max_position_embeddings": 1 << 20,
        }
    )
    kv = KVCache(cfg, blocks, block_size, dt, dev)
    return kv.k[0].normal_(), kv.v[0].normal_()


def make_case(op: str, n: int, dt: torch.dtype, dev: torch.device, sh: Shape = SHAPES["smollm2-135m"]) -> Case | None:
    """Inputs for ``op`` at ``n`` tokens; None when this harness has no generator for ``op``.

    Byte counts: every input read once and every output written once, at the dtype's size (forward).
    FLOP counts: 2 per multiply-add (matmuls, attention scores and values); elementwise ops count
    their arithmetic per element (rms_norm 4, silu_mul 5, rope 6 per element of q and k).
    """
    e = torch.tensor([], dtype=dt).element_size()
    h, H, Hkv, D, inter = sh.hidden, sh.heads, sh.kv_heads, sh.head_dim, sh.intermediate
    if op == "rms_norm":
        return Case((_r(n, h, dt=dt, dev=dev), _r(h, dt=dt, dev=dev), 1e-5), (2 * n * h + h) * e, 4 * n * h)
    if op == "add_rms_norm":
        return Case(
            (_r(n, h, dt=dt, dev=dev), _r(n, h, dt=dt, dev=dev), _r(h, dt=dt, dev=dev), 1e-5),
            (4 * n * h + h) * e,
            5 * n * h,
        )
    if op == "silu_mul":
        return Case((_r(n, inter, dt=dt, dev=dev), _r(n, inter, dt=dt, dev=dev)), 3 * n * inter * e, 5 * n * inter)
    if op == "apply_rope":
        q, k = _r(1, n, H, D, dt=dt, dev=dev), _r(1, n, Hkv, D, dt=dt, dev=dev)
        cos, sin = _r(1, n, D, dt=dt, dev=dev), _r(1, n, D, dt=dt, dev=dev)
        qk = n * (H + Hkv) * D
        return Case((q, k, cos, sin), (2 * qk + 2 * n * D) * e, 6 * qk)
    if op == "fused_linear_cross_entropy":  # n tokens through the (vocab, hidden) head
        return Case(
            (
                _r(n, h, dt=dt, dev=dev),
                _r(sh.vocab, h, dt=dt, dev=dev) * 0.02,
                torch.randint(0, sh.vocab, (n,), device=dev),
            ),
            (n * h + sh.vocab * h) * e + 8 * n,
            2 * n * h * sh.vocab,
        )
    if op == "quantized_linear":  # int4 group-128 symmetric weight (the up projection), n tokens
        groups = -(-h // 128)
        qweight = torch.randint(-(2**31), 2**31 - 1, (inter, -(-h // 8)), dtype=torch.int32, device=dev)
        scale = torch.rand(inter, groups, dtype=dt, device=dev) * 0.01
        return Case(
            (_r(n, h, dt=dt, dev=dev), qweight, scale, None, 128, None),
            n * h * e + qweight.numel() * 4 + scale.numel() * e + n * inter * e,
            2 * n * h * inter,
        )
    if op == "lora_apply":  # 4 adapters of rank 16 on a (hidden -> hidden) projection, n tokens in 4 segments
        L, R = 4, 16
        ids = torch.arange(n, device=dev) * L // n
        a, b = _r(L, R, h, dt=dt, dev=dev) * h**-0.5, _r(L, h, R, dt=dt, dev=dev)
        return Case(
            (_r(n, h, dt=dt, dev=dev), _r(n, h, dt=dt, dev=dev), a, b, torch.ones(L, device=dev), ids),
            (3 * n * h + 2 * L * R * h) * e + 8 * n,
            4 * n * R * h + n * h,
        )
    return _attention_case(op, n, dt, dev, sh) or _moe_case(op, n, dt, dev, sh)


def _attention_case(op: str, n: int, dt: torch.dtype, dev: torch.device, sh: Shape) -> Case | None:
    """The attention ops and ``store_kv`` at ``n`` tokens (counts as in :func:`make_case`; the paged ops
    over block pools of 16-token blocks in the engine's layout); None for any other op."""
    e = torch.tensor([], dtype=dt).element_size()
    H, Hkv, D = sh.heads, sh.kv_heads, sh.head_dim
    if op == "attention":  # causal prefill of one sequence of n tokens: QK^T and PV over ~n^2/2 pairs
        q = _r(1, n, H, D, dt=dt, dev=dev)
        k, v = _r(1, n, Hkv, D, dt=dt, dev=dev), _r(1, n, Hkv, D, dt=dt, dev=dev)
        return Case((q, k, v, D**-0.5), (2 * n * H + 2 * n * Hkv) * D * e, 2 * 2 * H * D * n * (n + 1) // 2)
    if op == "flash_attention_varlen":  # 4 packed sequences of n/4 tokens each
        P = 4
        T = max(1, n // P)
        cu = torch.arange(0, P * T + 1, T, dtype=torch.int32, device=dev)
        q = _r(P * T, H, D, dt=dt, dev=dev)
        k, v = _r(P * T, Hkv, D, dt=dt, dev=dev), _r(P * T, Hkv, D, dt=dt, dev=dev)
        return Case(
            (q, k, v, cu, cu, T, T, D**-0.5),
            (2 * P * T * H + 2 * P * T * Hkv) * D * e,
            2 * 2 * H * D * P * (T * (T + 1) // 2),
        )
    if op == "store_kv":
        blocks = n // 16 + 1
        kc, vc = _cache(sh, blocks, 16, dt, dev)
        k, v = _r(n, Hkv, D, dt=dt, dev=dev), _r(n, Hkv, D, dt=dt, dev=dev)
        slots = torch.randperm(blocks * 16, device=dev)[:n]
        return Case((k, v, kc, vc, slots), 4 * n * Hkv * D * e, 0)
    if op == "paged_decode_attention":  # 8 sequences of n cached tokens each, one query each
        S, bs = 8, 16
        W = -(-n // bs)
        kc, vc = _cache(sh, S * W, bs, dt, dev)
        tables = torch.arange(S * W, device=dev).view(S, W)
        lens = torch.full((S,), n, dtype=torch.int64, device=dev)
        return Case(
            (_r(S, H, D, dt=dt, dev=dev), kc, vc, tables, lens, D**-0.5),
            (2 * S * n * Hkv + 2 * S * H) * D * e,
            4 * S * H * D * n,
        )
    if op == "paged_prefill_attention":  # 4 sequences prefilling n/4 new tokens each (no cached prefix)
        P, bs = 4, 16
        T = max(1, n // P)
        W = -(-T // bs)
        kc, vc = _cache(sh, P * W, bs, dt, dev)
        tables = torch.arange(P * W, device=dev).view(P, W)
        cu = torch.arange(0, P * T + 1, T, device=dev)
        lens = torch.full((P,), T, dtype=torch.int64, device=dev)
        return Case(
            (_r(P * T, H, D, dt=dt, dev=dev), kc, vc, tables, cu, lens, D**-0.5),
            (2 * P * T * H + 2 * P * T * Hkv) * D * e,
            2 * 2 * H * D * P * (T * (T + 1) // 2),
        )
    return None


def _moe_case(op: str, n: int, dt: torch.dtype, dev: torch.device, sh: Shape) -> Case | None:
    """The MoE ops at ``n`` tokens routed top-``sh.top_k`` over ``sh.experts`` experts (random router).

    moe_topk: reads the (n, E) logits, writes fp32 weights and int64 ids; ~5 FLOPs per logit (max,
    exp, sum, divide, compare). moe_align_block_size: reads the int64 ids, writes the int32 buffers
    (block size 64), no FLOPs. fused_moe: reads x, the weights of the experts the router picked and
    the routing, writes the output; 2 FLOPs per multiply-add of the gate, up and down matmuls of each
    (token, expert) pair.
    """
    e = torch.tensor([], dtype=dt).element_size()
    h, E, k, inter = sh.hidden, sh.experts, sh.top_k, sh.moe_intermediate
    if op == "moe_topk":
        return Case((_r(n, E, dt=dt, dev=dev), k, True), n * E * e + n * k * 12, 5 * n * E)
    topk_weights, topk_ids = reference.moe_topk(_r(n, E, dt=torch.float32, dev=dev), k, True)
    if op == "moe_align_block_size":
        max_len = n * k + E * 63
        return Case((topk_ids, E, 64), n * k * 8 + (max_len + -(-max_len // 64) + 1) * 4, 0)
    if op == "fused_moe":
        w13 = _r(E, 2 * inter, h, dt=dt, dev=dev) * h**-0.5
        w2 = _r(E, h, inter, dt=dt, dev=dev) * inter**-0.5
        used = topk_ids.unique().numel()
        return Case(
            (_r(n, h, dt=dt, dev=dev), w13, w2, topk_weights, topk_ids),
            (2 * n * h + 3 * used * inter * h) * e + n * k * 12,
            2 * n * k * 3 * inter * h,
        )
    return None


def _unfused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The path the fused op replaces: all logits materialised, then ``F.cross_entropy`` in fp32."""
    return torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets)


def _with_backward(fn: Callable, args: tuple) -> Callable[[], object]:
    """A call of ``fn`` followed by backward through every float tensor argument (grads reset first)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    for a in leaves:
        a.requires_grad_(True)

    def call():
        for a in leaves:
            a.grad = None
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return call


def _timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median") / 1e3
    return lambda fn: median_time(fn, warmup=2, iters=iters)


def _peak_bytes(call: Callable[[], object], device: torch.device) -> int | None:
    """Peak CUDA memory one call allocates beyond what was live before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def run_kernels(cfg: KernelsConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench kernels``; returns the JSON result with one row per (op, size, impl).

    ``cfg.backward`` times forward + backward of the ops in :data:`GRAD_OPS` (others are listed under
    ``forward_only``); the fused cross-entropy then also runs the unfused path (``unfused``: logits
    materialised + ``F.cross_entropy``) so its time and, on CUDA, peak memory compare directly.
    """
    from baige.runtime.model.device import resolve_device

    dev = resolve_device(cfg.device)
    dt = getattr(torch, cfg.dtype)
    sh = SHAPES[cfg.shape]
    limits = roofline.hardware_limits(dev, dt)
    timer = _timer(dev, cfg.iters)
    ops = list(cfg.ops) or list(kernels.OPS)
    rows, skipped, forward_only = [], [], []
    total, done = len(ops) * len(cfg.sizes), 0
    interrupted = False
    try:
        for op in ops:
            ref = getattr(reference, op)
            impls = {"baige": getattr(kernels, op), "reference": ref}
            if op == "fused_linear_cross_entropy":
                impls["unfused"] = _unfused_cross_entropy
            if cfg.compile:
                impls["torch.compile"] = torch.compile(ref, dynamic=False)
            if cfg.backward and op not in GRAD_OPS:
                forward_only.append(op)
                done += len(cfg.sizes)
                continue
            for n in cfg.sizes:
                case = make_case(op, n, dt, dev, sh)
                done += 1
                if case is None:
                    if op not in skipped:
                        skipped.append(op)
                    continue
                for impl, fn in impls.items():
                    if cfg.backward:
                        call = _with_backward(fn, case.args)
                    else:
                        call = lambda fn=fn: fn(*case.args)  # noqa: E731
                    with torch.inference_mode(not cfg.backward):
                        t = timer(call)
                        peak = _peak_bytes(call, dev)
                    work = 3 if cfg.backward else 1  # backward ~ 2x the forward's FLOPs and traffic
                    gb_s, tflop_s = work * case.bytes / t / 1e9, work * case.flops / t / 1e12
                    pct = max(100 * gb_s * 1e9 / limits.bandwidth, 100 * tflop_s * 1e12 / limits.matmul_peak)
                    rows.append(
                        {
                            "op": op,
                            "tokens": n,
                            "impl": impl,
                            "pass": "fwd+bwd" if cfg.backward else "fwd",
                            "time_s": t,
                            "bytes": case.bytes * work,
                            "flops": case.flops * work,
                            "gb_s": gb_s,
                            "tflop_s": tflop_s,
                            "pct_of_limit": pct,
                            "peak_mem_bytes": peak,
                        }
                    )
                if progress:
                    progress(done, total, f"{op} n={n}")
    except KeyboardInterrupt:
        interrupted = True
    return {
        "benchmark": "kernels",
        "args": asdict(cfg),
        "environment": environment(),
        "limits": limits.to_dict(),
        "shape": asdict(sh),
        "interrupted": interrupted,
        "skipped": skipped,
        "forward_only": forward_only,
        "samples": rows,
        "summary": {"ops": sorted({r["op"] for r in rows}), "rows": len(rows), "speedup_vs_reference": _speedups(rows)},
    }


def _speedups(rows: list[dict]) -> dict:
    """``{op: {tokens: reference time / baige time}}``, plus ``peak_mem_ratio`` (baige / unfused) for the
    fused cross-entropy when peak memory was measured."""
    by = {(r["op"], r["tokens"], r["impl"]): r for r in rows}
    out: dict = {}
    for (op, n, impl), r in by.items():
        if impl != "baige":
            continue
        entry = out.setdefault(op, {}).setdefault(str(n), {})
        ref = by.get((op, n, "reference"))
        if ref:
            entry["reference_over_baige"] = ref["time_s"] / r["time_s"]
        unf = by.get((op, n, "unfused"))
        if unf and r["peak_mem_bytes"] and unf["peak_mem_bytes"]:
            entry["peak_mem_ratio_vs_unfused"] = r["peak_mem_bytes"] / unf["peak_mem_bytes"]
    return out
