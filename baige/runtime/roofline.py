"""The hardware limit every benchmark is compared against: measured memory bandwidth and matmul peak.

A roofline (Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance model")
bounds a workload by ``min(peak FLOP/s, bandwidth * arithmetic intensity)``. Here:

- **Bandwidth** (bytes/s) is measured with a large device copy ``dst.copy_(src)``: every byte is read
  once and written once, so ``bandwidth = 2 * nbytes / time`` (the STREAM "copy" kernel's counting,
  McCalpin 1995), best of 10 trials.
- **Matmul peak** (FLOP/s) is measured with a large square GEMM in the run dtype:
  ``2 * N**3 / time`` (one multiply and one add per inner-product term), best of at least 5 trials
  and of as many as fit in 2 s on the CPU, and offline benchmarks measure both limits again after
  their timed runs and keep the better (:func:`remeasure_limits`): on a shared VM the same GEMM can
  run at a fraction of its rate for seconds (seen on an Intel host, oneDNN on AMX:
  docs/benchmarks/archive.md, "Workload roofline, SDPA bf16 prefill on AMX"), and a limit is what the
  machine can do.
- **Decode** at batch ``B`` reads every weight once per step and each sequence's K/V cache once:
  ``bytes/step = weight_bytes + B * context_len * kv_bytes_per_token``; achieved bandwidth is
  ``bytes/step * steps/s`` (gpt-fast's "memory bandwidth achieved" counts weights only; we add the KV).
- **Prefill / offline throughput / training** are compute bound: achieved FLOP/s is tokens/s times
  FLOPs per token, forward only = ``flops_per_token / 3`` (the PaLM paper's 6N + 12LHQT training count,
  appendix B, is 2N + 4LHQT forward plus twice that backward).
- **A whole offline workload** is not all compute bound: its decode steps read every weight for a
  few rows each. :func:`workload_roofline` bounds it step by step from the shapes the scheduler
  actually ran (``scheduler.StepShape``): each step takes at least ``max(FLOPs / peak, bytes / bandwidth)``,
  and their sum is the least time any implementation on this machine needs for the same schedule;
  :func:`workload_floor` bounds it for any schedule of the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

# Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (bytes/s) from the vendors' data sheets:
# A100 SXM (NVIDIA A100 datasheet), H100 SXM and H200 (H100/H200 datasheets), L4, A10. Matched by
# substring of torch.cuda.get_device_name(); first match wins.
GPU_PEAKS: list[tuple[str, float, float]] = [
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.039e12),
    ("L40S", 362e12, 0.864e12),
    ("L4", 121e12, 0.3e12),
    ("A10", 125e12, 0.6e12),
]


@dataclass
class HardwareLimits:
    """What this machine can do: ``bandwidth`` bytes/s, ``matmul_peak`` FLOP/s (measured), and the
    data-sheet numbers where the device is known (None otherwise)."""

    device: str
    dtype: str
    bandwidth: float  # bytes/s, measured
    matmul_peak: float  # FLOP/s, measured
    datasheet_bandwidth: float | None = None  # bytes/s
    datasheet_peak: float | None = None  # FLOP/s, dense bf16

    def to_dict(self) -> dict:
        return asdict(self)


def datasheet_peaks(device_name: str) -> tuple[float, float] | None:
    """(bf16 FLOP/s, bytes/s) from :data:`GPU_PEAKS` for a CUDA device name, or None."""
    for key, flops, bw in GPU_PEAKS:
        if key.lower() in device_name.lower():
            return flops, bw
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(
    fn: Callable[[], None],
    device: torch.device,
    warmup: int,
    iters: int,
    min_seconds: float = 0.0,
    max_iters: int = 200,
) -> float:
    """Best (minimum) seconds per call, as STREAM reports the best rate of its trials: a limit is
    what the machine can do, and on a shared machine the median is pulled down by other work.
    ``triton.testing.do_bench`` on CUDA, warm-up + timed loop on CPU: ``iters`` timed calls, then
    more while the timed calls add up to less than ``min_seconds`` (at most ``max_iters`` in all)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="min") / 1e3
    for _ in range(warmup):
        fn()
    best, spent, done = float("inf"), 0.0, 0
    while done < iters or (spent < min_seconds and done < max_iters):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, done = min(best, dt), spent + dt, done + 1
    return best


def measure_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a copy of ``nbytes`` (default 256 MiB on CPU, 2 GiB on
    CUDA, far beyond any cache): ``2 * nbytes / best time`` (read + write)."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), device, warmup=2, iters=iters)
    return 2 * src.numel() * 4 / t


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int | None = None, iters: int = 5, min_seconds: float = 2.0
) -> float:
    """Matmul FLOP/s of an ``n x n @ n x n`` GEMM in ``dtype`` (default n = 2048 on CPU, 8192 on
    CUDA): ``2 * n**3 / best time`` over at least ``iters`` calls and ``min_seconds`` of timed calls
    on the CPU (see the module docstring: a shared CPU's rate drops for seconds at a time)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _time(lambda: torch.mm(a, b), device, warmup=1, iters=iters, min_seconds=min_seconds)
    return 2 * n**3 / t


_CACHE: dict[tuple[str, str], HardwareLimits] = {}


def hardware_limits(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> HardwareLimits:
    """Measure (once per process, per device and dtype) the bandwidth and matmul peak."""
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key not in _CACHE:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        sheet = datasheet_peaks(name) if device.type == "cuda" else None
        _CACHE[key] = HardwareLimits(
            device=name,
            dtype=str(dtype).removeprefix("torch."),
            bandwidth=measure_bandwidth(device),
            matmul_peak=measure_matmul_peak(device, dtype),
            datasheet_peak=sheet[0] if sheet else None,
            datasheet_bandwidth=sheet[1] if sheet else None,
        )
    return _CACHE[key]


def remeasure_limits(limits: HardwareLimits) -> HardwareLimits:
    """``limits`` measured again (CPU; on CUDA returned as is), each kept at the better of the two
    measurements, and cached so for the process: a benchmark measures before and after its timed
    runs, so one slow spell of a shared host (see the module docstring) does not set the limit."""
    if limits.device != "cpu":
        return limits
    device, dtype = torch.device("cpu"), getattr(torch, limits.dtype)
    out = HardwareLimits(
        device=limits.device,
        dtype=limits.dtype,
        bandwidth=max(limits.bandwidth, measure_bandwidth(device)),
        matmul_peak=max(limits.matmul_peak, measure_matmul_peak(device, dtype)),
    )
    _CACHE[(str(device), str(dtype))] = out
    return out


# ----------------------------------------------------------------------------- model byte/FLOP counts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every distinct parameter and buffer storage
    (tied embeddings count once, quantized weights at their packed size), except an untied input
    embedding table, of which a step reads only one row per token. Rotary tables are excluded."""
    seen: set[int] = set()
    total = 0
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    skip = set()
    if embed is not None and lm_head is not None and embed.weight is not getattr(lm_head, "weight", None):
        skip.add(embed.weight.data_ptr())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rotary_emb" in name or t.data_ptr() in seen or t.data_ptr() in skip:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total + sum(m.packed_weight_bytes() for m in model.modules() if hasattr(m, "packed_weight_bytes"))


def model_counts(model) -> dict[str, int]:
    """The numbers the rooflines need from a :class:`Transformer`: ``num_params``,
    ``num_params_non_embedding``, ``num_params_active`` (non-embedding parameters one token uses:
    for MoE models only its ``top_k`` routed experts, :meth:`ModelConfig.num_params`), ``attn_dims``
    (= L * H * Q, layers x heads x head_dim), ``weight_bytes``, ``lm_head_params`` (vocab x hidden), and for MoE models
    ``routed_expert_bytes`` (all routed experts of all sparse layers), ``num_experts``, ``top_k``.
    ``attn_dims`` is ``ModelConfig.attn_dims`` (MLA: the mean of its QK^T and PV head widths); attention
    sinks are parameters (``n_heads`` per layer), so they are in ``weight_bytes`` and the counts.
    ``num_layers``, ``sliding_layers`` (layers with a window) and ``sliding_window`` (tokens, 0 without)
    let the workload bounds count a sliding layer's bounded reads and pairs."""
    c = model.config
    counts = {
        "num_params": model.num_params(),
        "num_params_non_embedding": model.num_params(non_embedding=True),
        "num_params_active": c.num_params(non_embedding=True, active=True),
        "attn_dims": c.attn_dims(),
        "weight_bytes": weight_bytes(model),
        "routed_expert_bytes": 0,
        "num_experts": 0,
        "top_k": 0,
        "lm_head_params": c.vocab_size * c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "sliding_layers": sum(c.layer_window(i) is not None for i in range(c.num_hidden_layers)),
        "sliding_window": c.sliding_window or 0,
    }
    if c.moe is not None:
        experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
        counts["routed_expert_bytes"] = sum(weight_bytes(m) for m in experts)
        counts["num_experts"], counts["top_k"] = c.moe.num_experts, c.moe.top_k
    return counts


def expected_active_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Expected distinct experts that ``num_tokens`` tokens activate in one layer when each picks
    ``top_k`` of ``num_experts`` uniformly: ``E (1 - (1 - k/E)^n)`` (each expert is missed by a
    token with probability ``1 - k/E``). Real routers are not uniform; this is the roofline's
    assumption, stated in the result."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def step_weight_bytes(counts: dict, batch_size: float) -> float:
    """Weight bytes one decode step of ``batch_size`` tokens reads: everything but the routed
    experts, plus the routed experts the batch activates (:func:`expected_active_experts`) —
    for a dense model just ``weight_bytes``."""
    e, routed = counts.get("num_experts", 0), counts.get("routed_expert_bytes", 0)
    if not e:
        return counts["weight_bytes"]
    return counts["weight_bytes"] - routed + routed * expected_active_experts(e, counts["top_k"], batch_size) / e


def forward_flops_per_token(num_params_non_embedding: int, attn_dims: int, context_len: float) -> float:
    """Forward FLOPs per token ``2 N + 4 L H Q T``: one third of ``Transformer.flops_per_token``'s
    training count ``6 N + 12 L H Q T`` (PaLM, Chowdhery et al. 2022, appendix B). N = non-embedding
    parameters a token uses (``num_params_active``: MoE counts its top-k experts), ``attn_dims`` =
    L H Q, T = ``context_len`` tokens. The lm_head projection is not
    counted (prefill projects only the last position)."""
    return 2 * num_params_non_embedding + 4 * attn_dims * context_len


def kv_read_bytes_per_token(cfg, dtype_bytes: int, context_len: float) -> float:
    """Bytes of K and V a decode step reads per cached token of a context of ``context_len`` tokens:
    ``cfg.kv_bytes_per_token`` (MLA: its latent rows, ``kv_lora_rank + qk_rope_head_dim`` values per
    layer, read once for all heads) with each sliding-window layer (``cfg.layer_window(i)``) counting only the
    ``min(context_len, window) / context_len`` share of the context it reads (its window's blocks; the
    paged kernels skip the blocks before it)."""
    full = cfg.kv_bytes_per_token(dtype_bytes)
    if context_len <= 0 or not any(cfg.layer_window(i) for i in range(cfg.num_hidden_layers)):
        return full
    per_layer = full / cfg.num_hidden_layers
    read = sum(min(context_len, cfg.layer_window(i) or context_len) for i in range(cfg.num_hidden_layers))
    return per_layer * read / context_len


def attn_context(counts: dict, context_len: float) -> float:
    """The T of :func:`forward_flops_per_token`'s ``4 L H Q T`` for a model whose sliding-window layers
    (:func:`model_counts`' ``sliding_layers`` of ``num_layers``, window ``sliding_window``; absent: none)
    attend over at most their window: the layer mean of ``context_len`` and ``min(context_len, window)``."""
    w = counts.get("sliding_window", 0)
    return _layer_mean(counts, context_len, min(context_len, w) if w else None)


def decode_roofline(
    tokens_per_s: float,
    batch_size: int,
    weight_bytes_: int,
    kv_bytes_per_token: int,
    context_len: float,
    bandwidth: float,
) -> dict[str, float]:
    """Decode against the bandwidth limit.

    Args:
        tokens_per_s: decode tokens/s summed over the batch.
        batch_size: sequences decoded per step.
        weight_bytes_: bytes of weights read per step (:func:`weight_bytes`).
        kv_bytes_per_token: bytes of K+V read per cached token (``ModelConfig.kv_bytes_per_token``; with
            sliding-window layers :func:`kv_read_bytes_per_token`).
        context_len: mean tokens in each sequence's cache during decode.
        bandwidth: measured bytes/s.
    Returns:
        ``bytes_per_step`` (bytes), ``achieved_gb_s`` (GB/s = 1e9 bytes/s), ``limit_gb_s``,
        ``limit_tokens_per_s`` (tokens/s if every step ran at ``bandwidth``), ``pct_of_limit`` (%).
    """
    bytes_per_step = weight_bytes_ + batch_size * context_len * kv_bytes_per_token
    achieved = bytes_per_step * tokens_per_s / batch_size
    return {
        "bytes_per_step": bytes_per_step,
        "achieved_gb_s": achieved / 1e9,
        "limit_gb_s": bandwidth / 1e9,
        "limit_tokens_per_s": bandwidth / bytes_per_step * batch_size,
        "pct_of_limit": 100 * achieved / bandwidth,
    }


def compute_roofline(tokens_per_s: float, flops_per_token: float, peak: float) -> dict[str, float]:
    """Compute-bound work against the matmul peak: achieved FLOP/s = tokens/s * FLOPs/token.

    Returns ``achieved_tflop_s`` and ``limit_tflop_s`` (1e12 FLOP/s), ``limit_tokens_per_s``,
    ``pct_of_limit`` (%; for training this is the MFU of the PaLM paper, in percent).
    """
    achieved = tokens_per_s * flops_per_token
    return {
        "flops_per_token": flops_per_token,
        "achieved_tflop_s": achieved / 1e12,
        "limit_tflop_s": peak / 1e12,
        "limit_tokens_per_s": peak / flops_per_token,
        "pct_of_limit": 100 * achieved / peak,
    }


def workload_roofline(
    steps: list, counts: dict, kv_bytes_per_token: int, peak: float, bandwidth: float
) -> dict[str, float]:
    """The least time a machine of ``peak`` FLOP/s and ``bandwidth`` bytes/s needs for ``steps``.

    Each step needs at least ``max(flops / peak, bytes / bandwidth)`` seconds (the roofline, Williams
    et al. 2009, per step), with ``flops = 2 N tokens + 4 LHQ attn_pairs + 2 V sampled`` (N =
    ``counts["num_params_active"]``, LHQ = ``counts["attn_dims"]``, V = ``counts["lm_head_params"]``: the forward count
    of
    :func:`forward_flops_per_token` plus the lm_head rows actually projected) and ``bytes =
    step_weight_bytes(counts, tokens) + kv_bytes_per_token * (kv_tokens + tokens)`` (every weight
    once, the cache read once and the new K/V written). Activations are assumed to stay in cache.
    With sliding-window layers (``counts["sliding_layers"]`` of ``counts["num_layers"]``; absent: none)
    those layers count the step's ``window_attn_pairs`` and ``window_kv_tokens`` instead.

    Args:
        steps: the schedule, one ``baige.runtime.infer.scheduler.StepShape`` per engine step (any object
            with its ``tokens``, ``kv_tokens``, ``attn_pairs`` and ``sampled``: this module sits below
            the engine and does not import it).
        counts: :func:`model_counts` of the model as run (its ``weight_bytes`` at the run's dtype).
        kv_bytes_per_token: K+V bytes per cached token, all layers (``ModelConfig.kv_bytes_per_token``).
        peak, bandwidth: FLOP/s and bytes/s (:func:`hardware_limits`).
    Returns:
        ``min_time_s`` (s), ``compute_bound_s`` / ``bandwidth_bound_s`` (s: the part of ``min_time_s``
        spent in steps bound by each limit), ``steps`` and ``bandwidth_bound_steps`` (counts).
    Raises:
        ValueError: for a ``peak`` or ``bandwidth`` that is not positive.
    """
    if peak <= 0 or bandwidth <= 0:
        raise ValueError(f"peak and bandwidth must be positive, got {peak} FLOP/s and {bandwidth} bytes/s")
    compute_s = memory_s = 0.0
    n_memory = 0
    for s in steps:
        pairs = _layer_mean(counts, s.attn_pairs, getattr(s, "window_attn_pairs", None))
        kv_read = _layer_mean(counts, s.kv_tokens, getattr(s, "window_kv_tokens", None))
        flops = 2 * counts["num_params_active"] * s.tokens + 4 * counts["attn_dims"] * pairs
        flops += 2 * counts["lm_head_params"] * s.sampled
        nbytes = step_weight_bytes(counts, s.tokens) + kv_bytes_per_token * (kv_read + s.tokens)
        tc, tm = flops / peak, nbytes / bandwidth
        if tm > tc:
            memory_s += tm
            n_memory += 1
        else:
            compute_s += tc
    return {
        "min_time_s": compute_s + memory_s,
        "compute_bound_s": compute_s,
        "bandwidth_bound_s": memory_s,
        "steps": len(steps),
        "bandwidth_bound_steps": n_memory,
    }


def _layer_mean(counts: dict, full: float, windowed: float | None) -> float:
    """A per-layer count averaged over the layers: ``full`` for full-attention layers, ``windowed`` for
    the ``counts["sliding_layers"]`` sliding ones (``full`` where ``windowed`` is None)."""
    n_layers, n_sliding = counts.get("num_layers", 1), counts.get("sliding_layers", 0)
    if windowed is None or not n_sliding:
        return full
    return ((n_layers - n_sliding) * full + n_sliding * windowed) / n_layers


def workload_floor(
    requests: list[tuple[int, int]], counts: dict, kv_bytes_per_token: int, peak: float, bandwidth: float
) -> dict[str, float]:
    """The least time *any* schedule needs for ``requests`` on a machine of ``peak`` FLOP/s and
    ``bandwidth`` bytes/s, under :func:`workload_roofline`'s cost model, without speculative decoding or prefix-cache
    hits.

    Every schedule's ``workload_roofline`` time is ``sum_i max(c_i, m_i) >= max(sum_i c_i, sum_i m_i)``,
    and both sums have schedule-free lower bounds:

    - FLOPs do not depend on the schedule: a request of ``P`` prompt and ``O`` output tokens computes
      ``T = P + O - 1`` tokens (the last output is never fed back), scores ``T (T + 1) / 2`` (query,
      key) pairs however it is chunked, and projects ``O`` rows through the lm_head.
    - Bytes: a step emits at most one token per sequence, so there are at least ``max O`` steps, each
      reading every weight once (``step_weight_bytes`` of one token: for MoE the fewest experts a step
      can touch); each request reads its cache at least as a one-chunk prefill followed by
      ``O - 1`` decode steps does (``P + sum_{t=1}^{O-1} (P + t)`` cached tokens; a sliding layer of
      window w: ``P + sum_{t=1}^{O-1} min(P + t, w)``) and writes its ``T`` new tokens' K/V.
    - A sliding layer of window w scores ``sum_{p<T} min(p + 1, w)`` pairs.

    Args:
        requests: ``(prompt_len, output_len)`` per request, tokens (both >= 1).
        counts, kv_bytes_per_token, peak, bandwidth: as :func:`workload_roofline`.
    Returns:
        ``min_time_s`` (s: ``max(compute_s, memory_s)``), ``compute_s`` and ``memory_s`` (s: the two
        sums' bounds), ``min_steps``.
    Raises:
        ValueError: for no requests, a length below 1, or a ``peak`` / ``bandwidth`` that is not positive.
    """
    if peak <= 0 or bandwidth <= 0:
        raise ValueError(f"peak and bandwidth must be positive, got {peak} FLOP/s and {bandwidth} bytes/s")
    if not requests or min(min(p, o) for p, o in requests) < 1:
        raise ValueError("workload_floor needs at least one request, each with prompt and output lengths >= 1")
    flops = kv_tokens = 0
    w = counts.get("sliding_window", 0)
    for p, o in requests:
        t = p + o - 1
        pairs = _layer_mean(counts, t * (t + 1) // 2, sum(min(i + 1, w) for i in range(t)) if w else None)
        flops += 2 * counts["num_params_active"] * t + 4 * counts["attn_dims"] * pairs
        flops += 2 * counts["lm_head_params"] * o
        full = p + (o - 1) * p + (o - 1) * o // 2  # reads: a one-chunk prefill, then the decodes
        windowed = p + sum(min(p + i, w) for i in range(1, o)) if w else None
        kv_tokens += _layer_mean(counts, full, windowed) + t  # + the writes
    steps = max(o for _, o in requests)
    compute_s = flops / peak
    memory_s = (steps * step_weight_bytes(counts, 1) + kv_bytes_per_token * kv_tokens) / bandwidth
    return {"min_time_s": max(compute_s, memory_s), "compute_s": compute_s, "memory_s": memory_s, "min_steps": steps}


def workload_limit(
    bound: dict[str, float], total_tokens: int, flops_per_token: float, peak: float, elapsed: float
) -> dict[str, float]:
    """``bound`` (:func:`workload_roofline`) against a run of ``total_tokens`` in ``elapsed`` seconds:
    adds ``limit_tokens_per_s`` (total_tokens / min_time_s), ``limit_pct_of_peak`` (%: the most of
    ``peak`` that :func:`compute_roofline`'s count, ``flops_per_token`` per token, can reach on this
    schedule and machine) and ``pct_of_limit`` (%: min_time_s / elapsed)."""
    limit_tps = total_tokens / bound["min_time_s"] if bound["min_time_s"] > 0 else float("inf")
    return {
        **bound,
        "limit_tokens_per_s": limit_tps,
        "limit_pct_of_peak": 100 * limit_tps * flops_per_token / peak,
        "pct_of_limit": 100 * bound["min_time_s"] / elapsed,
    }


def workload_summary(
    steps: list,
    counts: dict,
    kv_bytes_per_token: int,
    limits,
    total_tokens: int,
    flops_per_token: float,
    elapsed: float,
    requests: list[tuple[int, int]] | None = None,
) -> dict[str, float]:
    """:func:`workload_limit` of :func:`workload_roofline` on ``limits`` (a :class:`HardwareLimits`): the
    schedule's least time on this machine against a run of ``total_tokens`` in ``elapsed`` seconds,
    as ``bench throughput`` and ``bench compare`` report it. With ``requests`` ((prompt, output)
    lengths), also :func:`workload_floor`'s bound for any schedule: ``any_schedule_min_time_s`` (s) and
    ``any_schedule_pct_of_peak`` (%: the most of the peak any schedule can reach here, counted as
    ``limit_pct_of_peak`` -- ``flops_per_token`` at the mean length, which overcounts long prompts'
    attention -- and capped at 100). Raises ValueError as workload_roofline / workload_floor."""
    bound = workload_roofline(steps, counts, kv_bytes_per_token, limits.matmul_peak, limits.bandwidth)
    out = workload_limit(bound, total_tokens, flops_per_token, limits.matmul_peak, elapsed)
    if requests:
        floor = workload_floor(requests, counts, kv_bytes_per_token, limits.matmul_peak, limits.bandwidth)
        out["any_schedule_min_time_s"] = floor["min_time_s"]
        any_pct = workload_limit(floor, total_tokens, flops_per_token, limits.matmul_peak, elapsed)["limit_pct_of_peak"]
        out["any_schedule_pct_of_peak"] = min(100.0, any_pct)
    return out
