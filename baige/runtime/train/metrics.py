"""Training metrics: MFU, peak memory, and the sinks (rich console, JSONL, TensorBoard when installed)."""

from __future__ import annotations

import functools
import json
import resource
from pathlib import Path
from typing import Any

import torch

from baige.runtime import roofline


@functools.lru_cache(maxsize=None)
def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0) -> tuple[float, str]:
    """Per-device peak FLOP/s for MFU and where it comes from, as ``baige bench train`` defines it.

    ``override_tflops`` > 0 wins; training in bf16 on a GPU of the data-sheet table
    (``roofline.GPU_PEAKS``, dense bf16) uses that number; otherwise the measured rate of an
    ``n x n`` matmul in ``dtype`` (``roofline.measure_matmul_peak``; n = 1024 on CPU), which
    makes a CPU or fp32 MFU a fraction of the achievable GEMM rate. Measured once per process; the
    RNG state is restored around the measurement.
    """
    if override_tflops > 0:
        return override_tflops * 1e12, "configured"
    if device.type == "cuda" and dtype == torch.bfloat16:
        sheet = roofline.datasheet_peaks(torch.cuda.get_device_name(device))
        if sheet is not None:
            return sheet[0], "data sheet (dense bf16)"
    rng = torch.get_rng_state()
    try:
        return roofline.measure_matmul_peak(device, dtype, n=None if device.type == "cuda" else 1024), "measured matmul"
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
        """One record: ``{"split": "train"|"eval", "step": int, ...numbers}``; MoE runs add ``aux_loss``,
        ``z_loss`` and per-layer lists ``expert_load_max_mean`` / ``expert_load_cv`` (for ``moe_layers``);
        pipeline runs add the ``pp_*`` timings of :meth:`~baige.runtime.train.pipeline.Pipeline.metrics`;
        ``{"split": "checkpoint", ...}`` records are the checkpoint manager's, one per complete save
        (:class:`~baige.runtime.train.checkpoint.CheckpointManager`)."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            layers = record.get("moe_layers", [])
            for key, value in record.items():
                if key not in ("split", "step") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
                elif key.startswith("expert_load"):  # one curve per sparse layer
                    for layer, v in zip(layers, value):
                        self._tb.add_scalar(f"{record['split']}/{key}/layer_{layer}", v, record["step"])
        if "reward" in record:
            self.console.print(_rl_line(record), highlight=False)
        elif record["split"] == "checkpoint":  # CheckpointManager's record of a complete save
            self.console.print(
                f"checkpoint step {record['step']} complete: {record['critical_path_seconds']:.3f} s on the "
                f"critical path ({record['async_mode']}), written in {record['write_seconds']:.3f} s",
                highlight=False,
            )
        elif record["split"] == "train":
            moe = ""
            if "aux_loss" in record:  # MoE: balance loss, and the worst layer's expert load
                moe = (
                    f"  aux {record['aux_loss']:.3f}  expert load max/mean {max(record['expert_load_max_mean']):.2f} "
                    f"cv {max(record['expert_load_cv']):.2f}"
                )
            pp = ""
            if "pp_bubble_fraction" in record:  # pipeline: measured and ideal bubble, compute per stage rank
                stages = "/".join(f"{t:.2f}" for t in record["pp_stage_compute_seconds"])
                pp = (
                    f"  pp bubble {record['pp_bubble_fraction']:.2f} (ideal "
                    f"{record['pp_bubble_fraction_schedule']:.2f})"
                    f" compute {stages} s"
                )
            self.console.print(
                f"step {record['step']:>6}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
                f"lr {record['lr']:.3e}  {record['tokens_per_second_per_device']:,.0f} tokens/s/device  "
                f"MFU {100 * record['mfu']:.1f}%  peak mem {record['peak_memory_gib']:.2f} GiB{moe}{pp}",
                highlight=False,
            )
        else:
            self.console.print(
                f"step {record['step']:>6}  eval loss {record['loss']:.4f} ({record['tokens']} tokens)", highlight=False
            )

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _rl_line(r: dict[str, Any]) -> str:
    """The console line of a GRPO step (``rl/grpo.py``'s record)."""
    kl = f"  kl {r['kl']:.4f}" if r["kl"] is not None else ""
    return (
        f"step {r['step']:>6}  reward {r['reward']:.3f} (std {r['reward_std']:.3f})  loss {r['loss']:+.4f}{kl}  "
        f"clip {r['clip_fraction']:.3f}  entropy {r['entropy']:.3f}  len {r['response_length']:.1f}  "
        f"mismatch {r['logprob_mismatch']:.2e}  rollout {r['rollout_tokens_per_s']:,.0f} tokens/s  "
        f"train {r['train_tokens_per_s']:,.0f} tokens/s  sync {r['weight_sync_s']:.2f} s  "
        f"peak mem {r['peak_memory_gib']:.2f} GiB"
    )
