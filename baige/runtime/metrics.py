"""Training metrics: MFU, peak memory, and the sinks (rich console, JSONL, TensorBoard when installed)."""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

# Dense (no sparsity) peak tensor-core TFLOP/s per GPU from the vendors' data sheets, by dtype.
_GPU_PEAK_TFLOPS = {  # name substring -> (bf16/fp16, fp32 via TF32)
    "H200": (989.0, 494.0),
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "A10G": (70.0, 35.0),
    "L4": (121.0, 60.0),
}


def measured_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Best-of-3 FLOP/s of an ``n x n`` matmul on ``device``: the CPU's practical peak (no data sheet)."""
    a = torch.randn(n, n, device=device, dtype=dtype, generator=None)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0) -> tuple[float, str]:
    """Per-device peak FLOP/s for MFU and where it comes from.

    ``override_tflops`` > 0 wins; on CUDA the data-sheet table above (dense bf16, or TF32 for fp32);
    otherwise (CPU, unknown GPU) the measured matmul rate of :func:`measured_matmul_flops`, which
    makes the CPU MFU a fraction of the achievable GEMM rate rather than of a data-sheet number.
    The RNG state is saved and restored around the measurement.
    """
    if override_tflops > 0:
        return override_tflops * 1e12, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, fp32) in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return (fp32 if dtype == torch.float32 else half) * 1e12, f"data sheet ({key})"
    rng = torch.get_rng_state()
    try:
        return measured_matmul_flops(device, dtype), "measured matmul"
    finally:
        torch.set_rng_state(rng)


def mfu(tokens_per_second: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B): achieved model FLOP/s / peak."""
    return tokens_per_second * flops_per_token / peak


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on CUDA; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLogger:
    """Writes records to the console (rich), ``<output>/metrics.jsonl`` and TensorBoard; rank 0 only."""

    def __init__(self, output: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(stderr=True, soft_wrap=True)  # long lines stay whole in log files
        self._file = open(output / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(output / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        """One record: ``{"split": "train"|"eval", "step": int, ...numbers}``."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("split", "step") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
        if record["split"] == "train":
            self.console.print(
                f"step {record['step']:>6}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
                f"lr {record['lr']:.3e}  {record['tokens_per_second_per_device']:,.0f} tokens/s/device  "
                f"MFU {100 * record['mfu']:.1f}%  peak mem {record['peak_memory_gib']:.2f} GiB",
                highlight=False,
            )
        else:
            self.console.print(f"step {record['step']:>6}  eval loss {record['loss']:.4f} "
                               f"({record['tokens']} tokens)", highlight=False)

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
