"""``baige bench latency`` and ``baige bench throughput``: the offline engine (``LLM.generate``).

Definitions follow ``vllm bench latency`` / ``vllm bench throughput``:

- latency: seconds for one ``generate`` call on a batch of ``batch_size`` random-token prompts of
  ``input_len`` tokens, each producing ``output_len`` tokens with EOS ignored; mean, std and
  percentiles over ``num_iters`` timed calls after ``num_iters_warmup`` untimed ones.
  Per call we also split prefill from decode with the engine's request timestamps:
  TTFT = the last request's first token time - call start (every prompt has been prefilled);
  prefill tokens/s = batch_size * input_len / TTFT; TPOT = (latency - TTFT) / (output_len - 1);
  decode tokens/s = batch_size * (output_len - 1) / (latency - TTFT).
- throughput: all ``num_prompts`` requests submitted at once; requests/s = completed / elapsed,
  total tokens/s = (prompt + output tokens) / elapsed, output tokens/s = output tokens / elapsed.

A ``KeyboardInterrupt`` raised during the timed loop (Ctrl-C, or by the ``progress`` callback) ends
the run early; the result then has ``"interrupted": true`` and summarizes what was measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from baige.errors import BaigeError
from baige.runtime import roofline
from baige.runtime.bench.common import environment, random_token_prompts, summarize  # noqa: F401 (re-exported)
from baige.runtime.config import DATA_SEED_RANGE, EngineConfig, check_int
from baige.runtime.infer.scheduler import StepShape

Progress = Callable[[int, int, str], None]  # (done, total, what)
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def bench_engine(**fields) -> EngineConfig:
    """The :class:`EngineConfig` of a benchmark: ``fields`` (EngineConfig names) over its defaults,
    prefix caching off unless asked (random prompts share nothing; off = no hashing cost).
    ``max_model_len`` and ``max_num_seqs`` are sized to each workload by :func:`build_llm` (the result's
    ``args.engine`` records the sized values)."""
    return EngineConfig(**{"enable_prefix_caching": False, **fields})


@dataclass
class LatencyConfig:
    """Resolved arguments of ``baige bench latency``. Raises BaigeError for sizes below 1."""

    engine: EngineConfig  # see bench_engine
    input_len: int = 32  # tokens
    output_len: int = 128  # tokens
    batch_size: int = 8
    num_iters_warmup: int = 1
    num_iters: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.input_len, self.output_len, self.batch_size, self.num_iters) < 1:
            raise BaigeError("--input-len, --output-len, --batch-size and --num-iters must be >= 1")
        check_int("--seed", self.seed, *DATA_SEED_RANGE)


@dataclass
class ThroughputConfig:
    """Resolved arguments of ``baige bench throughput``. Raises BaigeError for no prompts."""

    engine: EngineConfig  # see bench_engine
    num_prompts: int = 32
    input_len: int = 128  # tokens
    output_len: int = 128  # tokens
    range_ratio: float = 0.0
    dataset_path: str | None = None  # ShareGPT JSON
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise BaigeError("--num-prompts must be >= 1")
        check_int("--seed", self.seed, *DATA_SEED_RANGE)


def build_llm(engine: EngineConfig, max_model_len: int, max_num_seqs: int):
    """An ``LLM`` on ``engine``'s settings sized for the workload: context ``max_model_len`` tokens,
    ``max_num_seqs`` sequences at once (both replace ``engine``'s), and at least ``max_num_seqs``
    tokens per step."""
    from baige.runtime.infer.llm import LLM

    sized = replace(
        engine,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(engine.max_num_batched_tokens, max_num_seqs),
    )
    return LLM(**asdict(sized))


def run_args(cfg, llm) -> dict:
    """The JSON ``args`` of a run: ``cfg`` with its ``engine`` as ``llm`` was built (sized by
    :func:`build_llm`: ``max_model_len``, ``max_num_seqs`` and ``max_num_batched_tokens`` as used)."""
    return {**asdict(cfg), "engine": asdict(llm.engine.cfg)}


def spec_decode_result(llm) -> dict | None:
    """The run's speculative-decoding counters (vLLM's names; warm-up iterations included), or None
    without speculation."""
    return llm.engine.spec_stats.as_dict() if llm.engine.proposer is not None else None


def _model_info(llm, dtype_bytes: int) -> dict:
    model = llm.engine.model
    return {**roofline.model_counts(model), "kv_bytes_per_token": model.config.kv_bytes_per_token(dtype_bytes)}


def _fwd_flops(info: dict, context_len: float) -> float:
    ctx = roofline.attn_context(info, context_len)  # sliding layers attend over their window at most
    return roofline.forward_flops_per_token(info["num_params_active"], info["attn_dims"], ctx)


def _limits(llm):
    """This machine's limits for the model's dtype, and the bytes of one cached K/V element (the KV
    cache's dtype, which ``--kv-cache-dtype`` may set apart from the weights')."""
    p = next(llm.engine.model.parameters())
    return roofline.hardware_limits(p.device, p.dtype), llm.engine.kv_cache.k[0].element_size()


def run_latency(cfg: LatencyConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench latency``; returns the JSON result (args, environment, samples, summary,
    roofline)."""
    from baige.runtime.infer.sampling import SamplingParams

    llm = build_llm(cfg.engine, cfg.input_len + cfg.output_len, cfg.batch_size)
    prompts = [
        {"prompt_token_ids": ids}
        for ids, _ in random_token_prompts(llm.engine.vocab_size, cfg.batch_size, cfg.input_len, 1, 0.0, cfg.seed)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.output_len, ignore_eos=True)
    limits, dtype_bytes = _limits(llm)
    samples: list[dict] = []
    total = cfg.num_iters_warmup + cfg.num_iters
    interrupted = False
    try:
        for i in range(total):
            start = time.monotonic()
            outs = llm.generate(prompts, params)
            latency = time.monotonic() - start
            if i >= cfg.num_iters_warmup:
                ttft = max(o.first_token_time for o in outs) - start
                samples.append({"latency": latency, "ttft": ttft})
            if progress:
                progress(i + 1, total, "warm-up" if i < cfg.num_iters_warmup else "timed")
    except KeyboardInterrupt:
        interrupted = True
    if not interrupted:  # the better of before and after the timing (not after a Ctrl-C: no waiting then)
        limits = roofline.remeasure_limits(limits)
    info = _model_info(llm, dtype_bytes)
    # the cache one decode step reads per cached token at the decode's mean context (sliding layers: their window)
    ctx = cfg.input_len + cfg.output_len / 2
    info["kv_read_bytes_per_token"] = roofline.kv_read_bytes_per_token(llm.engine.model.config, dtype_bytes, ctx)
    return {
        "benchmark": "latency",
        "args": run_args(cfg, llm),
        "environment": environment(),
        "model": info,
        "limits": limits.to_dict(),
        "interrupted": interrupted,
        "samples": samples,
        "summary": latency_summary(samples, cfg, info, limits) if samples else {},
        "spec_decode": spec_decode_result(llm),
    }


def latency_summary(samples: list[dict], cfg: LatencyConfig, info: dict, limits) -> dict:
    """Aggregate per-call samples (seconds) into the latency report (see the module docstring)."""
    lat = [s["latency"] for s in samples]
    ttft = float(np.mean([s["ttft"] for s in samples]))
    mean_lat = float(np.mean(lat))
    decode_time = mean_lat - ttft
    B, n_in, n_out = cfg.batch_size, cfg.input_len, cfg.output_len
    prefill_tps = B * n_in / ttft
    decode_tps = B * (n_out - 1) / decode_time if n_out > 1 and decode_time > 0 else 0.0
    out = {f"{k}_latency_s": v for k, v in summarize(lat, LATENCY_PERCENTILES).items()}
    out.update(
        {
            "avg_latency_s": mean_lat,  # vLLM's key
            "ttft_s": ttft,
            "tpot_s": decode_time / (n_out - 1) if n_out > 1 else 0.0,
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens_per_s": decode_tps,
        }
    )
    out["prefill_roofline"] = roofline.compute_roofline(prefill_tps, _fwd_flops(info, n_in), limits.matmul_peak)
    out["decode_roofline"] = roofline.decode_roofline(
        decode_tps,
        B,
        roofline.step_weight_bytes(info, B),
        info["kv_read_bytes_per_token"],
        n_in + n_out / 2,
        limits.bandwidth,
    )
    return out


def run_throughput(cfg: ThroughputConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench throughput``: every request submitted at once, stepped to completion.
    Returns the JSON result; raises BaigeError for a bad dataset or ``range_ratio``."""
    from baige.runtime.bench.serve import sharegpt_requests
    from baige.runtime.infer.sampling import SamplingParams
    from baige.runtime.model.config import ModelConfig
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.hub import resolve_model

    if cfg.dataset_path:
        tok = Tokenizer.from_dir(resolve_model(cfg.engine.model))
        reqs = [
            (tok.encode(r.prompt, add_special_tokens=False), r.output_len)
            for r in sharegpt_requests(cfg.dataset_path, tok, cfg.num_prompts, cfg.seed)
        ]
    else:
        vocab = ModelConfig.from_file(resolve_model(cfg.engine.model) / "config.json").vocab_size
        reqs = random_token_prompts(vocab, cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.seed)
    max_len = max(len(ids) + n for ids, n in reqs)
    llm = build_llm(cfg.engine, max_len, min(len(reqs), 256))
    limits, dtype_bytes = _limits(llm)
    eng = llm.engine
    # warm-up: one short request, so one-time costs (allocation, compilation) stay out of the timing
    llm.generate([{"prompt_token_ids": reqs[0][0][:8]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    ids = []
    for i, (prompt, n_out) in enumerate(reqs):
        rid = f"bench-{i}"
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
        ids.append(rid)
    done: dict[str, object] = {}
    interrupted = False
    eng.step_shapes = []
    start = time.monotonic()
    try:
        while len(done) < len(ids) and eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    if progress:
                        progress(len(done), len(ids), "requests")
    except KeyboardInterrupt:
        interrupted = True
    elapsed = time.monotonic() - start
    if not interrupted:  # the better of before and after the timing (not after a Ctrl-C: no waiting then)
        limits = roofline.remeasure_limits(limits)
    samples = []
    for rid, (prompt, _) in zip(ids, reqs):
        out = done.get(rid)
        if out is not None:
            samples.append(
                {
                    "prompt_len": len(prompt),
                    "output_len": len(out.outputs[0].token_ids),
                    "e2el_s": out.finished_time - out.arrival_time,
                    "ttft_s": out.first_token_time - out.arrival_time,
                }
            )
    info = _model_info(llm, dtype_bytes)
    return {
        "benchmark": "throughput",
        "args": run_args(cfg, llm),
        "environment": environment(),
        "model": info,
        "limits": limits.to_dict(),
        "interrupted": interrupted,
        "samples": samples,
        "summary": throughput_summary(
            samples, elapsed, info, limits, eng.step_shapes, speculative=eng.proposer is not None
        )
        if samples
        else {},
        "spec_decode": spec_decode_result(llm),
    }


def throughput_summary(
    samples: list[dict],
    elapsed: float,
    info: dict,
    limits,
    steps: list[StepShape] | None = None,
    speculative: bool = False,
) -> dict:
    """requests/s, total tokens/s, output tokens/s over ``elapsed`` seconds, and the compute
    roofline with FLOPs/token at the mean sequence length (prompt + output); with the run's
    ``steps``, also ``workload_roofline`` (:func:`roofline.workload_summary`: the least time this
    schedule needs on this machine, and -- unless the run ``speculative``-ly decoded, which takes fewer
    steps than that bound assumes -- any schedule of the same requests)."""
    n_in = sum(s["prompt_len"] for s in samples)
    n_out = sum(s["output_len"] for s in samples)
    total_tps = (n_in + n_out) / elapsed
    mean_len = (n_in + n_out) / len(samples)
    flops = _fwd_flops(info, mean_len)
    out = {
        "elapsed_time_s": elapsed,
        "num_requests": len(samples),
        "total_num_tokens": n_in + n_out,
        "total_output_tokens": n_out,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": total_tps,
        "output_tokens_per_second": n_out / elapsed,
        "compute_roofline": roofline.compute_roofline(total_tps, flops, limits.matmul_peak),
    }
    if steps:
        lengths = [(s["prompt_len"], s["output_len"]) for s in samples if s["output_len"] > 0]
        out["workload_roofline"] = roofline.workload_summary(
            steps,
            info,
            info["kv_bytes_per_token"],
            limits,
            n_in + n_out,
            flops,
            elapsed,
            requests=None if speculative else lengths,
        )
    return out
