"""What every benchmark shares: statistics, the environment record, and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baige.errors import BaigeError


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation between closest ranks.

    numpy's default method, which ``vllm bench`` also uses, so numbers compare directly.
    Returns 0.0 for an empty sequence (as vLLM reports metrics with no samples).
    """
    return float(np.percentile(values, p)) if len(values) else 0.0


def summarize(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median, std (population, like numpy) and the requested percentiles of ``values``."""
    if not len(values):
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{_pct_name(p)}": 0.0 for p in percentiles}}
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out.update({f"p{_pct_name(p)}": percentile(arr, p) for p in percentiles})
    return out


def _pct_name(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's key spelling)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Versions and hardware a result was measured on: baige/torch/triton versions, device, CPU, its
    instruction-set flags and the native kernel variant used, threads, date, and the commit and
    command line (:func:`baige.runtime.bench.records.provenance`)."""
    from importlib.metadata import version

    import torch

    from baige import kernels
    from baige.runtime.bench.records import provenance

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "baige": version("baige"),  # the installed distribution (robust to how the package was imported)
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": kernels.cpu_isa_flags(),  # the instruction-set flags a number depends on
        "cpu_isa": kernels.cpu_isa(),  # the native library variant loaded (None: PyTorch only)
        "cpu_int_dot": kernels.cpu_int_dot(),  # int8/int4 linears as integer dot products
        "cpu_int_dot_passes": kernels.cpu_int_dot_passes(),  # their activation passes: 1 int8 block, 2 + the residual's
        "torch_num_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),  # 1/5/15-minute run-queue averages: > cpu_count = noisy timings
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **provenance(),  # git_commit, git_dirty, command: what ran, and how it was asked for
    }


def _jsonable(x: Any) -> Any:
    if is_dataclass(x) and not isinstance(x, type):
        return asdict(x)
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_result(output_dir: str | Path, name: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as ``<output_dir>/<name>-<timestamp>.json`` (temp file, then rename).

    Returns the path written.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=_jsonable))
    os.replace(tmp, path)
    return path


def median_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """CPU timing harness: run ``fn`` ``warmup`` times, then return the median of ``iters`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_token_prompts(
    vocab_size: int, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[tuple[list[int], int]]:
    """vLLM's random dataset as token ids: ``(prompt ids, output_len)`` pairs, lengths uniform in
    ``[len * (1 - r), len * (1 + r)]``, ids uniform over the vocabulary above its first 32 ids
    (where special tokens live). Raises BaigeError for ``range_ratio`` outside [0, 1)."""
    if not 0 <= range_ratio < 1:
        raise BaigeError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    in_lens = rng.integers(lo_in, hi_in + 1, num_prompts)
    out_lens = rng.integers(lo_out, hi_out + 1, num_prompts)
    first = 32 if vocab_size > 1000 else 0
    return [(rng.integers(first, vocab_size, int(n)).tolist(), int(m)) for n, m in zip(in_lens, out_lens)]


def set_dist_env(rank: int, world_size: int, port: int) -> None:
    """torch.distributed's launcher variables for a rank this process spawned (a local gloo/nccl group, as
    torchrun would set them): ``MASTER_ADDR`` 127.0.0.1, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
