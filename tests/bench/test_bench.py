"""``baige bench``: roofline and summary math against hand-computed values, and the CLI end to end
on a tiny checkpoint (latency, throughput, compare, kernels), Ctrl-C accounting, bad input."""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import BASE, make_checkpoint
from typer.testing import CliRunner

from baige.runtime import roofline
from baige.runtime.bench.compare import ratios
from baige.runtime.bench.offline import (
    LatencyConfig,
    bench_engine,
    latency_summary,
    random_token_prompts,
    throughput_summary,
)
from baige.runtime.infer.scheduler import StepShape
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.transformer import Transformer

LIMITS = roofline.HardwareLimits("cpu", "float32", bandwidth=10e9, matmul_peak=100e9)


# ----------------------------------------------------------------------------- roofline math


def test_decode_roofline_by_hand():
    # 100 MB of weights, 1000 B of KV per token, batch 2 at a mean context of 50 tokens:
    # bytes/step = 1e8 + 2*50*1000 = 100.1e6; 40 tokens/s over batch 2 = 20 steps/s -> 2.002 GB/s
    r = roofline.decode_roofline(40.0, 2, 100_000_000, 1000, 50, 10e9)
    assert r["bytes_per_step"] == 100_100_000
    assert r["achieved_gb_s"] == pytest.approx(2.002)
    assert r["pct_of_limit"] == pytest.approx(20.02)
    assert r["limit_tokens_per_s"] == pytest.approx(2 * 10e9 / 100.1e6)


def test_compute_roofline_and_forward_flops_by_hand():
    # N = 1e6 non-embedding params, L*H*Q = 1000, T = 100: forward 2e6 + 4e5 = 2.4e6 FLOPs/token
    f = roofline.forward_flops_per_token(1_000_000, 1000, 100)
    assert f == 2_400_000
    r = roofline.compute_roofline(1000.0, f, 100e9)
    assert r["achieved_tflop_s"] == pytest.approx(2.4e-3)
    assert r["pct_of_limit"] == pytest.approx(2.4)
    assert r["limit_tokens_per_s"] == pytest.approx(100e9 / 2.4e6)


def _tiny_model(tied: bool) -> Transformer:
    cfg = ModelConfig.from_dict({**BASE, "model_type": "llama", "tie_word_embeddings": tied})
    return Transformer(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_model_counts_match_the_model(tied):
    m = _tiny_model(tied)
    c = roofline.model_counts(m)
    h, V, L, H, Q = 64, 160, 2, 4, 16
    assert c["attn_dims"] == L * H * Q
    # forward = one third of the training count 6N + 12LHQT
    assert (
        roofline.forward_flops_per_token(c["num_params_non_embedding"], c["attn_dims"], 37) == m.flops_per_token(37) / 3
    )
    # every weight read once per decode step, fp32: the non-embedding body + the V x h output head
    # (tied: that is the embedding; untied: the embedding table itself is only indexed, not read)
    assert c["weight_bytes"] == 4 * (c["num_params_non_embedding"] + V * h)


def test_weight_bytes_of_fp16_weight_model():
    from baige.runtime.quant.fp16_weight import apply_quantization

    m = _tiny_model(True)
    body = roofline.model_counts(m)["num_params_non_embedding"]
    norms = sum(p.numel() for n, p in m.named_parameters() if "norm" in n)
    apply_quantization(m, "fp16-weight")  # every Linear, the tied lm_head too (it packs its own copy)
    h, V = 64, 160
    # linears at 2 bytes per weight (lm_head included), norms stay fp32; the embedding is only indexed
    assert roofline.weight_bytes(m) == 2 * (body - norms + V * h) + 4 * norms


def test_datasheet_lookup():
    assert roofline.datasheet_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert roofline.datasheet_peaks("NVIDIA H100 PCIe")[0] == 756e12
    assert roofline.datasheet_peaks("cpu") is None


class FakeTime:
    """Stands in for a module's ``time``: ``perf_counter`` / ``monotonic`` return the given readings in
    order (and fail when there are more calls than readings); everything else is the real module."""

    def __init__(self, readings):
        self.readings = list(readings)
        self.perf_counter = self.monotonic = self._next

    def _next(self) -> float:
        assert self.readings, "more clock readings than the test scripted"
        return self.readings.pop(0)

    def __getattr__(self, name):
        return getattr(time, name)


def test_measurements_take_the_best_of_their_timed_calls(monkeypatch):
    # three timed calls of 0.25, 0.125 and 0.5 s (warm-up calls are not timed): the best is 0.125 s
    monkeypatch.setattr(roofline, "time", FakeTime([0.0, 0.25, 1.0, 1.125, 2.0, 2.5]))
    nbytes = 1 << 20
    assert roofline.measure_bandwidth(torch.device("cpu"), nbytes, iters=3) == 2 * nbytes / 0.125  # read + write
    monkeypatch.setattr(roofline, "time", FakeTime([0.0, 0.5, 1.0, 1.25, 2.0, 2.0625]))
    assert (
        roofline.measure_matmul_peak(torch.device("cpu"), torch.float32, n=64, iters=3, min_seconds=0)
        == 2 * 64**3 / 0.0625
    )


def test_matmul_peak_keeps_timing_until_its_minimum_seconds(monkeypatch):
    # iters=2 but min_seconds=1: calls of 0.5, 0.25 (0.75 s so far), 0.125 (0.875), 0.5 (1.375): four
    # timed calls, the best 0.125 s -- a slow spell at the start does not set the limit
    monkeypatch.setattr(roofline, "time", FakeTime([0.0, 0.5, 1.0, 1.25, 2.0, 2.125, 3.0, 3.5]))
    assert (
        roofline.measure_matmul_peak(torch.device("cpu"), torch.float32, n=64, iters=2, min_seconds=1.0)
        == 2 * 64**3 / 0.125
    )


def test_limits_measured_again_keep_the_better_of_the_two(monkeypatch):
    monkeypatch.setattr(roofline, "_CACHE", {})
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda device: 9e9)
    monkeypatch.setattr(roofline, "measure_matmul_peak", lambda device, dtype: {torch.bfloat16: 8e11}[dtype])
    first = roofline.HardwareLimits("cpu", "bfloat16", bandwidth=1e10, matmul_peak=4e11)
    again = roofline.remeasure_limits(first)  # bandwidth fell (kept 1e10), the peak rose (8e11 now)
    assert (again.bandwidth, again.matmul_peak, again.dtype) == (1e10, 8e11, "bfloat16")
    assert roofline.hardware_limits("cpu", torch.bfloat16) is again  # the process's limits from now on
    gpu = roofline.HardwareLimits("NVIDIA H100", "bfloat16", bandwidth=3e12, matmul_peak=9e14)
    assert roofline.remeasure_limits(gpu) is gpu


def test_workload_roofline_by_hand():
    counts = {"num_params_active": 1000, "attn_dims": 10, "lm_head_params": 500, "weight_bytes": 4000}
    steps = [
        StepShape(tokens=100, kv_tokens=100, attn_pairs=5050, sampled=1),  # a 100-token prompt
        StepShape(tokens=2, kv_tokens=101, attn_pairs=101, sampled=2),
    ]  # two decode rows
    b = roofline.workload_roofline(steps, counts, 100, peak=1e6, bandwidth=1e5)
    # prefill: 2*1000*100 + 4*10*5050 + 2*500 = 403000 FLOPs (0.403 s) > 4000 + 100*200 bytes (0.24 s)
    # decode: 4000 + 4040 + 2000 = 10040 FLOPs (0.01004 s) < 4000 + 100*103 = 14300 bytes (0.143 s)
    assert b["compute_bound_s"] == pytest.approx(0.403) and b["bandwidth_bound_s"] == pytest.approx(0.143)
    assert b["min_time_s"] == pytest.approx(0.546) and (b["steps"], b["bandwidth_bound_steps"]) == (2, 1)
    w = roofline.workload_limit(b, total_tokens=102, flops_per_token=2400, peak=1e6, elapsed=1.092)
    assert w["limit_tokens_per_s"] == pytest.approx(102 / 0.546)
    assert w["limit_pct_of_peak"] == pytest.approx(100 * 102 / 0.546 * 2400 / 1e6)  # 44.8%
    assert w["pct_of_limit"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="bandwidth"):
        roofline.workload_roofline(steps, counts, 100, peak=1e6, bandwidth=0)


def test_workload_floor_by_hand_and_against_a_schedule():
    """Any schedule's least time: (3 prompt, 2 output) and (1, 3) tokens. FLOPs 2 N T + 4 LHQ T(T+1)/2 +
    2 V O: 8000 + 400 + 2000 = 10400 and 6000 + 240 + 3000 = 9240; bytes: 3 steps x 4000 weight bytes +
    100 x (cache reads 3 + 4, 1 + 2 + 3, writes 4 + 3 tokens) = 14000."""
    counts = {"num_params_active": 1000, "attn_dims": 10, "lm_head_params": 500, "weight_bytes": 4000}
    reqs = [(3, 2), (1, 3)]
    f = roofline.workload_floor(reqs, counts, 100, peak=1e6, bandwidth=1e5)
    assert f["compute_s"] == pytest.approx(0.01964) and f["memory_s"] == pytest.approx(0.14)
    assert (f["min_time_s"], f["min_steps"]) == (pytest.approx(0.14), 3)
    # the schedule that meets it: both prefills, two decodes, the last decode
    steps = [
        StepShape(tokens=4, kv_tokens=4, attn_pairs=7, sampled=2),
        StepShape(tokens=2, kv_tokens=6, attn_pairs=6, sampled=2),
        StepShape(tokens=1, kv_tokens=3, attn_pairs=3, sampled=1),
    ]
    assert roofline.workload_roofline(steps, counts, 100, peak=1e6, bandwidth=1e5)["min_time_s"] == pytest.approx(0.14)
    # a slow peak: compute bound, 19640 FLOPs at 1e4 FLOP/s; this schedule's steps add up to more (1.964 s is
    # their FLOPs, but each step pays its own max) -- never less
    f = roofline.workload_floor(reqs, counts, 100, peak=1e4, bandwidth=1e5)
    assert f["min_time_s"] == pytest.approx(1.964)
    assert roofline.workload_roofline(steps, counts, 100, peak=1e4, bandwidth=1e5)["min_time_s"] >= f["min_time_s"]
    s = roofline.workload_summary(
        steps,
        counts,
        100,
        roofline.HardwareLimits("cpu", "float32", 1e5, 1e6),
        total_tokens=9,
        flops_per_token=2000,
        elapsed=0.28,
        requests=reqs,
    )
    assert s["any_schedule_min_time_s"] == pytest.approx(0.14) and s["pct_of_limit"] == pytest.approx(50.0)
    assert s["any_schedule_pct_of_peak"] == pytest.approx(100 * 9 / 0.14 * 2000 / 1e6)  # 12.9%
    over = roofline.workload_summary(
        steps,
        counts,
        100,
        roofline.HardwareLimits("cpu", "float32", 1e5, 1e6),
        total_tokens=9,
        flops_per_token=1e6,
        elapsed=0.28,
        requests=reqs,
    )
    assert over["any_schedule_pct_of_peak"] == 100.0  # a per-token count past the floor's FLOPs: capped
    for bad in ([], [(0, 2)], [(3, 0)]):
        with pytest.raises(ValueError, match="at least one request"):
            roofline.workload_floor(bad, counts, 100, peak=1e6, bandwidth=1e5)


def test_engine_records_the_shape_of_each_step(tiny_dir):
    from baige.runtime.infer.llm import LLM
    from baige.runtime.infer.sampling import SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", enforce_eager=True, max_model_len=32, kv_cache_memory=1 << 20)
    llm.engine.step_shapes = []
    llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )
    S = StepShape
    # prefill 5 + 3 tokens (pairs 15 + 6), then two decode steps of two rows each after 5/3, 6/4 cached tokens
    assert llm.engine.step_shapes == [S(8, 8, 21, 2), S(2, 6 + 4, 6 + 4, 2), S(2, 7 + 5, 7 + 5, 2)]


def test_hardware_limits_measure_once_per_device_and_dtype(monkeypatch):
    calls = []
    monkeypatch.setattr(roofline, "_CACHE", {})
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda device: calls.append(("bw", str(device))) or 7e9)
    monkeypatch.setattr(
        roofline,
        "measure_matmul_peak",
        lambda device, dtype: calls.append(("mm", str(dtype))) or {torch.float32: 3e11}.get(dtype, 5e11),
    )
    a = roofline.hardware_limits("cpu", torch.float32)
    assert (a.device, a.dtype, a.bandwidth, a.matmul_peak, a.datasheet_peak) == ("cpu", "float32", 7e9, 3e11, None)
    assert roofline.hardware_limits("cpu", torch.float32) is a
    b = roofline.hardware_limits("cpu", torch.bfloat16)
    assert (b.dtype, b.matmul_peak) == ("bfloat16", 5e11)
    assert calls == [("bw", "cpu"), ("mm", "torch.float32"), ("bw", "cpu"), ("mm", "torch.bfloat16")]


# ----------------------------------------------------------------------------- summaries


def test_latency_summary_by_hand():
    cfg = LatencyConfig(bench_engine(), input_len=10, output_len=5, batch_size=2)
    info = {
        "num_params_non_embedding": 1000,
        "num_params_active": 1000,
        "attn_dims": 10,
        "weight_bytes": 8000,
        "kv_bytes_per_token": 150,
        "kv_read_bytes_per_token": 100,  # what decode reads (a sliding layer: its window), not what it holds
    }
    samples = [{"latency": 1.0, "ttft": 0.2}, {"latency": 3.0, "ttft": 0.2}]
    s = latency_summary(samples, cfg, info, LIMITS)
    assert s["avg_latency_s"] == 2.0 and s["std_latency_s"] == 1.0 and s["p50_latency_s"] == 2.0
    assert s["p10_latency_s"] == pytest.approx(1.2)  # linear interpolation
    # prefill: 2 x 10 tokens in 0.2 s; decode: 2 x 4 tokens in 2.0 - 0.2 s; TPOT 1.8 / 4
    assert s["prefill_tokens_per_s"] == pytest.approx(100.0)
    assert s["decode_tokens_per_s"] == pytest.approx(8 / 1.8)
    assert s["tpot_s"] == pytest.approx(0.45)
    # prefill FLOPs/token 2*1000 + 4*10*10 = 2400 -> 240 kFLOP/s of 100 GFLOP/s
    assert s["prefill_roofline"]["pct_of_limit"] == pytest.approx(100 * 240_000 / 100e9)
    # decode bytes/step = 8000 + 2 * (10 + 2.5) * 100 = 10500, steps/s = (8/1.8)/2
    assert s["decode_roofline"]["bytes_per_step"] == 10500
    assert s["decode_roofline"]["achieved_gb_s"] == pytest.approx(10500 * 8 / 1.8 / 2 / 1e9)


def test_throughput_summary_by_hand():
    samples = [{"prompt_len": 10, "output_len": 6}, {"prompt_len": 20, "output_len": 4}]
    info = {"num_params_non_embedding": 1000, "num_params_active": 1000, "attn_dims": 10}
    s = throughput_summary(samples, 2.0, info, LIMITS)
    assert s["requests_per_second"] == 1.0 and s["tokens_per_second"] == 20.0 and s["output_tokens_per_second"] == 5.0
    assert s["total_num_tokens"] == 40 and s["total_output_tokens"] == 10
    # mean length 20 -> 2*1000 + 4*10*20 = 2800 FLOPs/token
    assert s["compute_roofline"]["flops_per_token"] == 2800


def test_random_prompts_lengths_and_ids():
    reqs = random_token_prompts(160, 50, 20, 10, range_ratio=0.5, seed=1)
    assert all(10 <= len(p) <= 30 and 5 <= n <= 15 and all(0 <= t < 160 for t in p) for p, n in reqs)
    assert reqs == random_token_prompts(160, 50, 20, 10, range_ratio=0.5, seed=1)
    assert all(len(p) == 20 and n == 10 for p, n in random_token_prompts(5000, 5, 20, 10))
    assert min(t for p, _ in random_token_prompts(5000, 5, 20, 10) for t in p) >= 32  # special ids skipped


def test_compare_ratios_by_hand():
    s = {
        "decode": {
            "baige": {"tokens_per_s": 30.0},
            "baige-int8": {"tokens_per_s": 50.0},
            "hf-float32": {"tokens_per_s": 10.0},
            "hf-bfloat16": {"tokens_per_s": 15.0},
        },
        "throughput": {"baige": {"tokens_per_s": 400.0}, "hf-float32": {"tokens_per_s": 100.0}},
    }
    r = ratios(s)
    assert r == {
        "decode_baige_over_hf-float32": 3.0,
        "decode_baige_over_hf-bfloat16": 2.0,
        "decode_baige_over_hf-best": 2.0,
        "decode_baige-int8_over_hf-best": 50.0 / 15.0,
        "throughput_baige_over_hf-float32": 4.0,
        "throughput_baige_over_hf-best": 4.0,
    }
    s = {
        "decode": {
            "baige": {"tokens_per_s": 30.0},
            "baige-int8": {"tokens_per_s": 60.0},
            "baige-int4-g32": {"tokens_per_s": 90.0},
            "llama.cpp-Q4_1": {"tokens_per_s": 75.0},
            "llama.cpp-Q8_0": {"tokens_per_s": 40.0},
            "llama.cpp-Q4_0": {"tokens_per_s": 72.0},
        }
    }
    r = ratios(s)
    assert r == {
        "decode_baige-int4-g32_over_fastest-peer-int4": 1.2,  # Q4_1's 75 tokens/s the fastest at 4 bits
        "decode_baige_over_llama.cpp-Q4_1": 0.4,
        "decode_baige_over_llama.cpp-Q8_0": 0.75,
        "decode_baige_over_llama.cpp-Q4_0": 30.0 / 72.0,
        "decode_baige-int8_over_llama.cpp-Q8_0": 1.5,
        "decode_baige-int4-g32_over_llama.cpp-Q4_0": 1.25,
        "decode_baige-int4-g32_over_llama.cpp-Q4_1": 1.2,
    }
    # Qwen2.5-Coder's GGUF ships as Q4_K_M: both int4 rows are timed against it
    s = {
        "decode": {
            "baige": {"tokens_per_s": 2.0},
            "baige-int4": {"tokens_per_s": 11.0},
            "baige-int4-g32": {"tokens_per_s": 10.0},
            "llama.cpp-Q4_K_M": {"tokens_per_s": 8.0},
        }
    }
    assert ratios(s) == {
        "decode_baige_over_llama.cpp-Q4_K_M": 0.25,
        "decode_baige-int4_over_llama.cpp-Q4_K_M": 1.375,
        "decode_baige-int4-g32_over_llama.cpp-Q4_K_M": 1.25,
    }
    # the rows whose tied lm_head is int8 too (llama.cpp quantizes its output matrix)
    s = {
        "decode": {
            "baige": {"tokens_per_s": 30.0},
            "baige-int8+int8-weight": {"tokens_per_s": 88.0},
            "baige-int4-g32+int8-weight": {"tokens_per_s": 100.0},
            "llama.cpp-Q8_0": {"tokens_per_s": 66.0},
            "llama.cpp-Q4_0": {"tokens_per_s": 80.0},
        }
    }
    assert {k: v for k, v in ratios(s).items() if not k.startswith("decode_baige_")} == pytest.approx(
        {
            "decode_baige-int8+int8-weight_over_llama.cpp-Q8_0": 88.0 / 66.0,
            "decode_baige-int4-g32+int8-weight_over_llama.cpp-Q4_0": 1.25,
        }
    )


def test_compare_times_rows_in_turn_and_keeps_the_fastest_hf_dtype(monkeypatch):
    from baige.runtime.bench import compare

    calls: list[str] = []
    seconds = {"hf-float32": 2.0, "hf-bfloat16": 3.0}  # per throughput call; 1.0 for every other row

    def row(name):
        fn = lambda: calls.append(name)  # noqa: E731
        fn.row = name
        return fn

    monkeypatch.setattr(compare, "_timed", lambda fn: (fn(), seconds.get(fn.row, 1.0))[1])
    rows = compare.Rows()
    for name in ("baige", "hf-float32", "hf-bfloat16", "baige-int8"):
        rows.add(name, row("decode " + name), row(name), 1, 4)
    rows.add("llama.cpp", row("decode llama.cpp"), None, 1, 2)
    progress = []
    samples, interrupted = compare.time_rows(rows, 2, lambda done, total, what: progress.append((done, total, what)))
    decode = [f"decode {k}" for k in ("baige", "hf-float32", "hf-bfloat16", "baige-int8", "llama.cpp")]
    # warm-up decodes, round 1: every row, round 2: HF static batching in float32 only (2.0 s < 3.0 s)
    assert calls == decode + decode + ["baige", "hf-float32", "hf-bfloat16", "baige-int8"] + decode + [
        "baige",
        "hf-float32",
        "baige-int8",
    ]
    assert not interrupted and samples["throughput"] == {
        "baige": [1.0, 1.0],
        "hf-float32": [2.0, 2.0],
        "hf-bfloat16": [3.0],
        "baige-int8": [1.0, 1.0],
    }
    assert samples["decode"]["llama.cpp"] == [1.0, 1.0] and "llama.cpp" not in samples["throughput"]
    assert [d for d, _, _ in progress] == list(range(1, 18)) and {t for _, t, _ in progress} == {17}
    assert list(rows.dtype_bytes) == list(rows.decode) and rows.dtype_bytes["llama.cpp"] == 2


def test_bench_configs_refuse_bad_values_in_one_line():
    from baige.errors import BaigeError
    from baige.runtime.bench.compare import CompareConfig
    from baige.runtime.bench.kernels import KernelsConfig
    from baige.runtime.bench.offline import ThroughputConfig
    from baige.runtime.bench.serve_run import ServeBenchConfig
    from baige.runtime.bench.train import TrainBenchConfig

    for make, message in [
        (lambda: LatencyConfig(bench_engine(), batch_size=0), "--batch-size and --num-iters must be >= 1"),
        (lambda: ThroughputConfig(bench_engine(), num_prompts=0), "--num-prompts must be >= 1"),
        (lambda: ServeBenchConfig(percentiles=[50.0, 101.0]), "--percentiles must be in (0, 100]"),
        (lambda: ServeBenchConfig(slo="ttfb:5"), "--slo: unknown metric 'ttfb'"),
        (lambda: KernelsConfig(dtype="int8"), "--dtype 'int8': choose float32, bfloat16 or float16"),
        (lambda: KernelsConfig(sizes=(8, 0)), "--sizes '8,0': token counts must be >= 1"),
        (lambda: KernelsConfig(shape="llama9"), "--shape 'llama9'"),
        (lambda: TrainBenchConfig(dtype="float16"), "--dtype 'float16': choose auto, float32 or bfloat16"),
        (lambda: TrainBenchConfig(steps=2, warmup_steps=2), "--steps (2) must exceed --warmup-steps (2)"),
        (lambda: TrainBenchConfig(optimizer="sgd"), "--optimizer 'sgd': choose adamw or muon"),
    ]:
        with pytest.raises(BaigeError) as e:
            make()
        assert message in str(e.value) and "\n" not in str(e.value)
    # the benchmarks' engine: prefix caching off (random prompts share nothing), the rest EngineConfig's
    eng = bench_engine(model="m", kv_cache_dtype="float16")
    assert (eng.enable_prefix_caching, eng.model, eng.kv_cache_dtype, eng.max_num_batched_tokens) == (
        False,
        "m",
        "float16",
        2048,
    )
    assert CompareConfig(eng, hf_dtypes=("bfloat16", "float32", "bfloat16")).hf_dtypes == ("bfloat16", "float32")


def test_launched_server_gets_this_processes_thread_count(monkeypatch):
    """`baige bench --threads N` sets torch's threads here; the launched `baige serve` gets N too."""
    from baige.runtime.bench.serve_run import server_env

    monkeypatch.delenv("BAIGE_API_KEY", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        env = server_env("key")
        assert env["OMP_NUM_THREADS"] == "1" and env["BAIGE_API_KEY"] == "key"
        assert "BAIGE_API_KEY" not in server_env(None)
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- CLI on a tiny checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded_dir):
    path = make_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", "llama-tied")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, path / name)
    return path


def _cli(args):
    from baige.cli import app

    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})  # wide enough for unwrapped table cells


def _result(out: Path, name: str) -> dict:
    files = sorted(out.glob(f"{name}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_cli_latency_and_throughput_write_json(tiny_dir, tmp_path, monkeypatch):
    res = _cli(
        [
            "bench",
            "latency",
            "--model",
            str(tiny_dir),
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--num-iters",
            "2",
            "--num-iters-warmup",
            "0",
            "--output-dir",
            str(tmp_path),
            "--plot",
        ]
    )
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "latency")
    assert len(r["samples"]) == 2 and r["args"]["batch_size"] == 2 and r["environment"]["cpu_count"] == os.cpu_count()
    flags = set(
        next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        .partition(":")[2]
        .split()
    )
    env = r["environment"]  # the flags named as /proc/cpuinfo has them, and the variant the kernels loaded
    assert ("avx2" in env["cpu_flags"]) == ("avx2" in flags) and set(env["cpu_flags"]) <= flags
    assert ("avx512_vnni" in env["cpu_flags"]) == ("avx512_vnni" in flags) and env["cpu_int_dot"] is True
    want_isa = (
        "avx512_amx"
        if {"avx512_bf16", "avx512_vnni", "avx512vl", "amx_tile", "amx_bf16", "amx_int8"} <= flags
        else "avx512_bf16"
        if {"avx512_bf16", "avx512_vnni", "avx512vl"} <= flags
        else "avx512_vnni"
        if {"avx512_vnni", "avx512vl", "avx512bw"} <= flags
        else "avx512"
        if {"avx512vl", "avx512bw"} <= flags
        else "avx2_vnni"
        if "avx_vnni" in flags
        else "avx2"
    )
    assert env["cpu_isa"] == want_isa and f"native kernels {want_isa}" in res.output
    engine = r["args"]["engine"]  # as built: sized to the batch, prefix caching off
    assert (engine["max_num_seqs"], engine["max_model_len"], engine["enable_prefix_caching"]) == (2, 6 + 4, False)
    assert "decode throughput" in res.output and "tokens/s" in res.output and "% of limit" in res.output
    assert r["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head_dim x fp32
    assert list(tmp_path.glob("latency-*-latency.png"))

    # a fake clock for the timed part: the 5 requests take 2.5 s
    from baige.runtime.bench import offline

    clock = FakeTime([100.0, 102.5])
    monkeypatch.setattr(offline, "time", clock)
    res = _cli(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_dir),
            "--num-prompts",
            "5",
            "--input-len",
            "7",
            "--output-len",
            "3",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert res.exit_code == 0, res.output
    assert clock.readings == []  # both readings taken
    r = _result(tmp_path, "throughput")
    s = r["summary"]
    assert s["num_requests"] == 5 and s["total_output_tokens"] == 15 and s["total_num_tokens"] == 50
    assert s["elapsed_time_s"] == 2.5
    # 5 requests, 50 tokens, 15 of them generated, in 2.5 s
    assert (s["requests_per_second"], s["tokens_per_second"], s["output_tokens_per_second"]) == (2.0, 20.0, 6.0)
    assert [x["output_len"] for x in r["samples"]] == [3] * 5 and [x["prompt_len"] for x in r["samples"]] == [7] * 5
    w = s["workload_roofline"]  # one prefill step of the 5 prompts, two decode steps of 5 rows
    assert (w["steps"], w["pct_of_limit"]) == (3, pytest.approx(100 * w["min_time_s"] / 2.5))
    assert "least time for this schedule (roofline)" in res.output
    # any schedule of these 5 requests (7 in, 3 out): at least 3 steps, no more time than this schedule's
    assert 0 < w["any_schedule_min_time_s"] <= w["min_time_s"] and "least time for any schedule" in res.output


def test_cli_throughput_with_speculation_claims_no_any_schedule_bound(tiny_dir, tmp_path):
    """A speculating run can take fewer steps than its longest output: the any-schedule bound (which
    assumes one token per sequence and step) is left out, the schedule's own bound stays."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    res = _cli(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_dir),
            "--num-prompts",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "24",
            "--speculative-config",
            spec,
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert res.exit_code == 0, res.output
    w = _result(tmp_path, "throughput")["summary"]["workload_roofline"]
    assert w["steps"] >= 1 and "any_schedule_min_time_s" not in w and "any schedule" not in res.output


def test_cli_latency_with_speculation_reports_its_counters(tiny_dir, tmp_path):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    res = _cli(
        [
            "bench",
            "latency",
            "--model",
            str(tiny_dir),
            "--input-len",
            "6",
            "--output-len",
            "24",
            "--batch-size",
            "2",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
            "--speculative-config",
            spec,
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "latency")
    sd = r["spec_decode"]
    assert r["args"]["engine"]["speculative_config"]["num_speculative_tokens"] == 3
    assert sd["num_drafts"] > 0 and 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"] <= 3 * sd["num_drafts"]
    assert sd["acceptance_rate"] == pytest.approx(sd["num_accepted_tokens"] / sd["num_draft_tokens"])
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert "spec decode: acceptance rate" in res.output


def test_cli_options_before_the_subcommand_apply_to_it(tiny_dir, tmp_path):
    """`baige bench --model M --output-dir D compare ...` (group options first) and --hf-dtype /
    --kv-cache-dtype reach the run: the JSON lands in D, one HF dtype timed, an fp16 KV cache."""
    res = _cli(
        [
            "bench",
            "--model",
            str(tiny_dir),
            "--output-dir",
            str(tmp_path),
            "compare",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--num-prompts",
            "2",
            "--tp-input-len",
            "4",
            "--tp-output-len",
            "2",
            "--no-quantized",
            "--hf-dtype",
            "float32",
            "--kv-cache-dtype",
            "float16",
        ]
    )
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "compare")
    assert set(r["samples"]["decode"]) == {"baige", "hf-float32"}
    assert r["args"]["engine"]["kv_cache_dtype"] == "float16" and r["args"]["engine"]["model"] == str(tiny_dir)
    # --peers none: no peers, so nothing to refuse where the subcommand has none
    res = _cli(
        [
            "bench",
            "--output-dir",
            str(tmp_path),
            "--kv-cache-dtype",
            "float16",
            "--peers",
            "none",
            "latency",
            "--model",
            str(tiny_dir),
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--batch-size",
            "1",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
        ]
    )
    assert res.exit_code == 0, res.output
    # the roofline counts the cache's bytes: fp16 K+V x layers x kv heads x head_dim
    assert _result(tmp_path, "latency")["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2


def test_cli_compare_peers_none_and_one_variant(tiny_dir, tmp_path, monkeypatch):
    """`bench --peers none compare --variants int8`: baige and baige-int8 only; HF transformers is never
    imported, llama.cpp never tried (no note)."""
    from baige.runtime.bench import compare

    monkeypatch.setattr(compare, "_transformers", lambda: pytest.fail("HF loaded under --peers none"))
    res = _cli(
        [
            "bench",
            "--peers",
            "none",
            "--output-dir",
            str(tmp_path),
            "compare",
            "--model",
            str(tiny_dir),
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--num-prompts",
            "2",
            "--tp-input-len",
            "4",
            "--tp-output-len",
            "2",
            "--variants",
            "int8",
        ]
    )
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "compare")
    assert list(r["samples"]["decode"]) == ["baige", "baige-int8"]
    # the tiny model's context (256) holds the default prefill's 128 tokens, not its 512
    assert r["notes"] == ["prefill pp512 skipped: the model's context is 256 tokens"]
    assert r["args"]["prefill_lens"] == [128] and set(r["summary"]["prefill"]["baige-int8"]) == {"pp128"}
    assert r["args"]["peers"] == [] and r["args"]["quantized"] == ["int8"]
    assert set(r["summary"]["ratios"]) == set()  # no peer row, no ratio
    w, w8 = (r["summary"]["throughput"][k]["workload_roofline"] for k in ("baige", "baige-int8"))
    assert w["steps"] == w8["steps"] >= 2  # one schedule; int8 weights: fewer bytes, no longer a least time
    assert w8["min_time_s"] <= w["min_time_s"] and r["model"]["lm_head_params"] == 160 * 64
    assert f"({w['limit_pct_of_peak']:.1f}% / {w['any_schedule_pct_of_peak']:.1f}%)" in res.output
    assert w["any_schedule_pct_of_peak"] >= w["limit_pct_of_peak"] * (1 - 1e-12)  # equal where the schedule meets it
    assert "baige-int8" in res.output and "ratios of tokens/s" not in res.output  # no ratio: no second table


def test_cli_group_kv_cache_dtype_refused_where_it_does_not_apply():
    res = _cli(["bench", "--kv-cache-dtype", "float16", "serve"])  # `baige` prints it as one line (main.py)
    assert res.exit_code != 0 and "does not apply to `bench serve`" in str(res.exception)
    assert "--server-arg" in str(res.exception)
    res = _cli(["bench", "--kv-cache-dtype", "float16", "kernels"])
    assert res.exit_code != 0 and "does not apply to `bench kernels`" in str(res.exception)


# seconds per timed call of each row, round by round (a fake clock: the calls themselves still run)
COMPARE_SECONDS = {
    ("decode", "baige"): [0.5, 0.25],
    ("decode", "hf-float32"): [1.0, 0.875],
    ("decode", "hf-bfloat16"): [2.0, 1.5],
    ("throughput", "baige"): [0.25, 0.5],
    ("throughput", "hf-float32"): [1.5],
    ("throughput", "hf-bfloat16"): [0.75, 0.625],
}


def test_cli_compare_prints_ratios(tiny_dir, tmp_path, monkeypatch):
    import importlib.util

    from baige.runtime.bench import compare

    seconds = {k: list(v) for k, v in COMPARE_SECONDS.items()}
    add = compare.Rows.add

    def tagged(kind, name, fn):
        if fn is None:
            return None
        call = lambda: fn()  # noqa: E731
        call.key = (kind, name)
        return call

    monkeypatch.setattr(
        compare.Rows,
        "add",
        lambda self, name, decode, batch, wb, db, prefill=None: add(
            self, name, tagged("decode", name, decode), tagged("throughput", name, batch), wb, db
        ),  # no prefill (--prefill-lens none)
    )
    monkeypatch.setattr(compare, "_timed", lambda fn: (fn(), seconds[fn.key].pop(0))[1])
    res = _cli(
        [
            "bench",
            "compare",
            "--model",
            str(tiny_dir),
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--num-prompts",
            "32",
            "--tp-input-len",
            "4",
            "--tp-output-len",
            "2",
            "--range-ratio",
            "0",
            "--hf-batch-size",
            "8",
            "--no-quantized",
            "--repeats",
            "2",
            "--prefill-lens",
            "none",
            "--output-dir",
            str(tmp_path),
            "--plot",
        ]
    )
    assert res.exit_code == 0, res.output
    assert all(not v for v in seconds.values())  # every scripted call was made, no more
    r = _result(tmp_path, "compare")
    # static batching: every HF dtype in round 1, then only the one fastest on it (bfloat16: 0.75 < 1.5 s)
    assert r["samples"]["throughput"] == {"baige": [0.25, 0.5], "hf-float32": [1.5], "hf-bfloat16": [0.75, 0.625]}
    assert r["samples"]["decode"]["baige"] == [0.5, 0.25]
    d, t = r["summary"]["decode"], r["summary"]["throughput"]
    # decode: 3 tokens / median seconds (0.375, 0.9375, 1.75)
    assert {k: v["tokens_per_s"] for k, v in d.items()} == pytest.approx(
        {"baige": 8.0, "hf-float32": 3.2, "hf-bfloat16": 3 / 1.75}
    )
    # throughput: 32 requests x (4 + 2) tokens = 192 / median seconds (0.375, 1.5, 0.6875)
    assert {k: v["tokens_per_s"] for k, v in t.items()} == pytest.approx(
        {"baige": 512.0, "hf-float32": 128.0, "hf-bfloat16": 192 / 0.6875}
    )
    assert r["summary"]["ratios"] == pytest.approx(
        {
            "decode_baige_over_hf-float32": 2.5,
            "decode_baige_over_hf-bfloat16": 1.75 / 0.375,
            "decode_baige_over_hf-best": 2.5,  # float32 decodes faster
            "throughput_baige_over_hf-float32": 4.0,
            "throughput_baige_over_hf-bfloat16": 0.6875 / 0.375,
            "throughput_baige_over_hf-best": 0.6875 / 0.375,
        }
    )  # bfloat16 batches faster
    # decode bytes per step: the fp32 weights (tied: 2 layers x (q, o 64x64 + k, v 64x32 + mlp 3 x 64x96 + 2
    # norms) + final norm + the 160 x 64 head) + 1 sequence x mean context (4 + 3/2) x K+V bytes per token
    weights = 4 * (2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64) + 64 + 160 * 64)
    assert r["model"]["weight_bytes"] == weights
    assert d["baige"]["roofline"]["bytes_per_step"] == weights + 5.5 * (2 * 2 * 2 * 16 * 4)
    assert "baige / row" in res.output and "offline throughput (32 prompts)" in res.output
    ratios_line = next(ln for ln in res.output.splitlines() if "throughput" in ln and "baige / hf-best" in ln)
    assert f"{0.6875 / 0.375:.2f}x" in ratios_line  # the second table: vs the best HF dtype
    # the model is a directory whose tokenizer (SmolLM2's) is longer than its 160-token vocabulary: llama.cpp is
    # skipped with a note, whether or not llama-cpp-python is installed
    note = (
        "llama.cpp skipped: baige cannot write the checkpoint as a GGUF (tokenizer.json has 49152 tokens, more "
        "than the model's vocab_size 160)"
        if importlib.util.find_spec("llama_cpp")
        else "llama-cpp-python is not installed: llama.cpp skipped (scripts/setup.sh --with-llama-cpp)"
    )
    assert r["notes"] == [note] and "llama.cpp" not in d
    assert list(tmp_path.glob("compare-*-decode.png"))


def test_cli_kernels_every_op_or_listed_skipped(tmp_path):
    from baige import kernels

    res = _cli(["bench", "kernels", "--sizes", "8", "--no-compile", "--iters", "1", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "kernels")
    measured = {row["op"] for row in r["samples"]}
    assert measured | set(r["skipped"]) == set(kernels.OPS)
    rms = next(row for row in r["samples"] if row["op"] == "rms_norm" and row["impl"] == "reference")
    assert rms["bytes"] == (2 * 8 * 576 + 576) * 4 and rms["flops"] == 4 * 8 * 576


def test_cli_kernels_backward_and_shape(tmp_path):
    res = _cli(
        [
            "bench",
            "kernels",
            "--op",
            "rms_norm",
            "--op",
            "store_kv",
            "--op",
            "fused_linear_cross_entropy",
            "--sizes",
            "8",
            "--backward",
            "--no-compile",
            "--iters",
            "1",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "kernels")
    assert r["forward_only"] == ["store_kv"] and {row["pass"] for row in r["samples"]} == {"fwd+bwd"}
    assert {row["impl"] for row in r["samples"] if row["op"] == "fused_linear_cross_entropy"} == {
        "baige",
        "reference",
        "unfused",
    }
    rms = next(row for row in r["samples"] if row["op"] == "rms_norm" and row["impl"] == "reference")
    assert rms["bytes"] == 3 * (2 * 8 * 576 + 576) * 4  # forward + backward counted as 3 forward passes
    assert "rms_norm" in r["summary"]["speedup_vs_reference"]
    res = _cli(
        [
            "bench",
            "kernels",
            "--shape",
            "llama3-8b",
            "--op",
            "rms_norm",
            "--sizes",
            "4",
            "--no-compile",
            "--iters",
            "1",
            "--output-dir",
            str(tmp_path / "big"),
        ]
    )
    assert res.exit_code == 0 and _result(tmp_path / "big", "kernels")["shape"]["hidden"] == 4096
    res = _cli(["bench", "kernels", "--shape", "llama9", "--output-dir", str(tmp_path)])
    assert res.exit_code != 0 and "--shape 'llama9'" in str(res.exception)


def test_interrupted_run_still_writes_what_was_measured(tmp_path, monkeypatch):
    from baige.runtime.bench.kernels import KernelsConfig, run_kernels

    def stop_after_first(done, total, what):
        raise KeyboardInterrupt

    r = run_kernels(KernelsConfig(sizes=(8, 16), ops=("silu_mul",), compile=False, iters=1), stop_after_first)
    assert r["interrupted"] and [row["tokens"] for row in r["samples"]] == [8, 8]  # baige + reference at n=8

    cmd = ["bench", "kernels", "--op", "silu_mul", "--sizes", "8,16", "--no-compile", "--iters", "1", "--output-dir"]
    assert _cli([*cmd, str(tmp_path)]).exit_code == 0
    monkeypatch.setattr(
        "baige.runtime.bench.kernels.run_kernels", lambda cfg, progress: run_kernels(cfg, stop_after_first)
    )
    out2 = tmp_path / "interrupted"
    res = _cli([*cmd, str(out2)])
    assert res.exit_code == 130
    r = _result(out2, "kernels")
    assert r["interrupted"] and len(r["samples"]) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "kernels", "--op", "nope"], "--op 'nope' is not a baige.kernels op"),
        (["bench", "throughput", "--range-ratio", "1.5"], "--range-ratio must be in [0, 1)"),
        (["bench", "serve", "--slo", "ttfb:5", "--base-url", "http://127.0.0.1:9"], "--slo: unknown metric 'ttfb'"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "baige", *args, "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], p.stderr


def test_help_lists_every_subcommand():
    res = _cli(["bench", "--help"])
    assert res.exit_code == 0
    for name in ("latency", "throughput", "serve", "kernels", "train", "grpo", "compare", "startup"):
        assert name in res.output


def test_bench_serve_against_baige_serve(tmp_path, embedded_dir):
    """The acceptance run at a size the suite can afford (full-size runs are benchmark records:
    docs/performance.md). The timing math on a fake clock and a fake server: tests/bench/test_bench_serve.py."""
    res = _cli(
        [
            "bench",
            "serve",
            "--num-prompts",
            "8",
            "--request-rate",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--slo",
            "e2el:600000",
            "--output-dir",
            str(tmp_path),
            "--plot",
        ]
    )
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "serve")
    assert (r["completed"], r["failed"]) == (8, 0) and r["errors"] == [""] * 8
    assert r["total_output_tokens"] == 8 * 6 and r["output_lens"] == [6] * 8  # usage counts, EOS ignored
    assert r["total_input_tokens"] == 8 * 16 and r["input_lens"] == [16] * 8
    # every request timed: a TTFT each, at most 5 gaps between its (at most 6) content chunks
    assert len(r["ttfts"]) == len(r["itls"]) == 8 and all(len(g) <= 5 for g in r["itls"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 10-minute SLO: every request is good
    assert r["request_rate"] == 4.0 and r["args"]["num_prompts"] == 8 and r["environment"]["torch"] == torch.__version__
    # decode bytes per step: the fp32 checkpoint + mean batch x mean context (16 + 6/2 tokens) x K+V bytes
    # per token (2 x 30 layers x 3 KV heads x head_dim 64 x 4 bytes)
    wbytes = (embedded_dir / "model.safetensors").stat().st_size
    roof = r["roofline"]
    assert roof["decode"]["bytes_per_step"] == pytest.approx(
        wbytes + roof["mean_concurrency"] * 19 * (2 * 30 * 3 * 64 * 4)
    )
    assert "failed requests" in res.output and list(tmp_path.glob("serve-*-serve.png"))


def test_cli_train_reports_mfu_from_flops_per_token(tmp_path, monkeypatch):
    from baige.runtime.bench import train

    # a fake clock around the 3 steps (0.5 s of warm-up, then 0.5 s and 0.25 s) and a fake machine
    monkeypatch.setattr(train, "time", FakeTime([0.0, 0.5, 10.0, 10.5, 20.0, 20.25]))
    monkeypatch.setattr(roofline, "hardware_limits", lambda device, dtype=torch.float32: LIMITS)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = _cli(
        [
            "bench",
            "train",
            "--model",
            "debug",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--no-compile",
            "--output-dir",
            str(tmp_path),
        ]
    )
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert res.exit_code == 0, res.output
    r = _result(tmp_path, "train")
    s = r["summary"]
    assert [x["step"] for x in r["samples"]] == [2, 3] and r["args"]["compile"] is False and r["compiled"] is False
    assert [x["time_s"] for x in r["samples"]] == [0.5, 0.25] and s["step_time_s"] == 0.375  # the median
    assert s["tokens_per_s_per_device"] == pytest.approx(2 * 16 / 0.375)
    # debug preset: N_non-embedding = 2 layers x (attn 64*64*2 + 2*64*32 + mlp 3*64*192 + 2*64) + 64; L*H*Q = 2*4*16
    n = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64) + 64
    fpt = 6 * n + 12 * 2 * 4 * 16 * 16
    assert s["roofline"]["flops_per_token"] == fpt
    # fp32 on CPU: the peak is the (fake) measured matmul peak, 100 GFLOP/s
    assert s["peak_flops"] == 100e9 and s["peak_source"] == "measured matmul"
    assert s["mfu_pct"] == pytest.approx(100 * (32 / 0.375) * fpt / 100e9)
    # this process's peak RSS in bytes (ru_maxrss is in KiB on Linux, and never decreases)
    assert rss_before <= s["peak_memory_bytes"] <= rss_after and "MFU" in res.output


def test_suite_headlines_and_table():
    from rich.console import Console

    from baige.runtime.bench.suite import headline, suite_configs, suite_table

    cfgs = suite_configs(None)
    assert list(cfgs) == ["latency", "throughput", "serve", "compare"] and cfgs["serve"].request_rate == 4.0
    assert cfgs["latency"].engine.kv_cache_dtype == "auto" and cfgs["serve"].server_args == []
    assert cfgs["compare"].peers == ("hf", "llama.cpp") and suite_configs(None, peers=())["compare"].peers == ()
    half = suite_configs(None, "float16")
    assert {half[k].engine.kv_cache_dtype for k in ("latency", "throughput", "compare")} == {"float16"}
    assert half["serve"].server_args == ["--kv-cache-dtype", "float16"]
    lat = {
        "summary": {
            "decode_tokens_per_s": 20.0,
            "ttft_s": 0.05,
            "tpot_s": 0.05,
            "decode_roofline": {"pct_of_limit": 40.0},
        }
    }
    # ratios compare reports on Qwen2.5-Coder's GGUF; the suite keeps baige / hf-best and those vs llama.cpp but
    # the "+" combinations' (they stay in compare's own tables)
    cmp_ = {
        "summary": {
            "ratios": {
                "decode_baige_over_hf-float32": 3.0,
                "decode_baige_over_hf-best": 2.5,
                "decode_baige-int4-g32+int8-weight_over_hf-best": 9.0,
                "decode_baige_over_llama.cpp-Q4_K_M": 0.125,
                "decode_baige-int4-g32_over_llama.cpp-Q4_K_M": 1.25,
                "decode_baige-int8_over_llama.cpp-Q8_0": 1.5,
                "decode_baige-int4-g32+int8-weight_over_llama.cpp-Q4_K_M": 1.75,
                "throughput_baige_over_hf-best": 0.75,
            }
        }
    }
    tp = {
        "summary": {
            "tokens_per_second": 500.0,
            "requests_per_second": 2.0,
            "compute_roofline": {"pct_of_limit": 15.0},
            "workload_roofline": {"limit_tokens_per_s": 1200.0, "limit_pct_of_peak": 36.0},
        }
    }
    assert headline("throughput", tp) == [
        ("total tokens", 500.0, "tokens/s", 15.0),
        ("roofline bound", 1200.0, "tokens/s", 36.0),
        ("requests", 2.0, "requests/s", None),
    ]
    rows = {"latency": headline("latency", lat), "compare": headline("compare", cmp_)}
    assert rows["latency"][0] == ("batch-1 decode", 20.0, "tokens/s", 40.0)
    assert rows["latency"][1] == ("TTFT", 50.0, "ms", None)
    assert rows["compare"] == [
        ("decode: baige / hf-best", 2.5, "x", None),
        ("decode: baige / llama.cpp-Q4_K_M", 0.125, "x", None),
        ("decode: baige-int4-g32 / llama.cpp-Q4_K_M", 1.25, "x", None),
        ("decode: baige-int8 / llama.cpp-Q8_0", 1.5, "x", None),
        ("throughput: baige / hf-best", 0.75, "x", None),
    ]
    serve = {
        "output_throughput": 123.456,
        "median_ttft_ms": 1234.5,
        "median_tpot_ms": 50.0,
        "failed": 0,
        "roofline": {"decode": {"pct_of_limit": 12.5}},
    }
    rows = {"latency": rows["latency"], "serve": headline("serve", serve), "compare": rows["compare"]}
    result = {
        "summary": {k: [dict(zip(("metric", "value", "unit", "pct_of_limit"), r)) for r in v] for k, v in rows.items()}
    }
    console = Console(width=80, record=True)
    console.print(suite_table(result))
    lines = console.export_text().splitlines()
    assert max(len(ln) for ln in lines) <= 80 and not any("…" in ln for ln in lines)  # fits, nothing cut
    # one section per part, compare's split by workload, every metric whole on one line
    for title in ("latency", "serve", "compare: decode", "compare: throughput"):
        assert sum(ln.strip("│ ").startswith(title) for ln in lines) == 1, title
    row = next(ln for ln in lines if "baige-int4-g32 / llama.cpp-Q4_K_M" in ln)
    assert [c.strip() for c in row.split("│")[1:5]] == ["baige-int4-g32 / llama.cpp-Q4_K_M", "1.25", "x", ""]
    assert any("batch-1 decode" in ln and "20.00" in ln and "40.0%" in ln for ln in lines)
    assert any("output tokens" in ln and "123.46" in ln and "tokens/s" in ln and "12.5%" in ln for ln in lines)


def test_compare_table_keeps_every_row_name_whole_at_80_columns():
    from rich.console import Console

    from baige.runtime.bench.report import compare_table

    names = ["baige", "hf-bfloat16", "baige-int4-g32+int8-weight", "llama.cpp-Q4_K_M", "llama.cpp-Q8_0"]
    dec = {
        n: {"tokens_per_s": 10.0 + i, "roofline": {"achieved_gb_s": 12.3456, "pct_of_limit": 99.5}}
        for i, n in enumerate(names)
    }
    tp = {n: {"tokens_per_s": 700.0, "roofline": {"achieved_tflop_s": 0.1642, "pct_of_limit": 13.4}} for n in names[:3]}
    tp["baige"]["workload_roofline"] = {"limit_pct_of_peak": 33.4}
    r = {"args": {"num_prompts": 32}, "summary": {"decode": dec, "throughput": tp}}
    console = Console(width=80, record=True)
    console.print(compare_table(r))
    lines = console.export_text().splitlines()
    assert max(len(ln) for ln in lines) <= 80 and not any("…" in ln for ln in lines)
    for n in names:  # each name whole in the first column, once per workload it has a row in
        assert sum(c.split("│")[1].strip() == n for c in lines if c.startswith("│")) == (2 if n in tp else 1), n
    assert (
        sum("batch-1 decode" in ln for ln in lines) == 1
        and sum("offline throughput (32 prompts)" in ln for ln in lines) == 1
    )
    assert any("13.4%" in ln for ln in lines) and any("(33.4%)" in ln for ln in lines)  # the bound, whole
