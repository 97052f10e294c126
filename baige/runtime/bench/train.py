"""``baige bench train``: short training runs through the :class:`~baige.runtime.train.trainer.Trainer`.

Each step is one optimizer step (forward + backward of ``batch_size`` windows of ``seq_len`` tokens,
gradient clipping, AdamW or Muon: ``optimizer``), timed from before the step to after it (``loss.item()``
inside the step synchronises the device). Reported per device (this bench runs one process):

- tokens/s = batch_size * seq_len * grad_accum / step time (median of the timed steps);
- MFU = tokens/s * FLOPs/token / peak (PaLM, Chowdhery et al. 2022, appendix B) with FLOPs/token =
  ``Transformer.flops_per_token(seq_len)`` = 6 N_non-embedding + 12 L H Q T, where for an MoE model
  N counts the active parameters (``num_params_active``: top-k routed experts, router, shared
  experts); peak = the data-sheet dense bf16 number on known GPUs (:data:`roofline.GPU_PEAKS`) when
  training in bf16, otherwise the measured matmul peak in the run dtype (:func:`roofline.hardware_limits`);
- peak memory = ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU (bytes), also
  recorded before the first step (``setup_peak_memory_bytes``): the difference is what the steps added.

With ``context_parallel_degree`` > 1, :func:`~baige.runtime.bench.train_cp.run_train_cp` sweeps sequence
lengths instead (one process per rank).

Data: ``data_path`` (a UTF-8 text file) or, by default, a synthetic file of random-token text just
long enough for the run (throughput does not depend on the text).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from baige.errors import BaigeError
from baige.runtime import roofline
from baige.runtime.bench.common import environment
from baige.runtime.bench.offline import Progress
from baige.runtime.config import DATA_SEED_RANGE, check_float, check_int

if TYPE_CHECKING:
    from baige.runtime.train.config import TrainConfig


@dataclass
class TrainBenchConfig:
    """Resolved arguments of ``baige bench train``. Raises BaigeError for an unknown dtype or no
    timed step."""

    model: str | None = None  # a model spec, or a train.PRESETS name (from scratch)
    seq_len: int = 256  # tokens per window
    batch_size: int = 4  # windows per micro-batch
    grad_accum: int = 1
    steps: int = 6  # optimizer steps, warm-up included
    warmup_steps: int = 2  # untimed
    dtype: str = "auto"  # auto (bf16 on CUDA and on CPUs with native bf16, else fp32) | float32 | bfloat16
    device: str = "auto"
    activation_checkpointing: str = "none"
    compile: bool | str = "auto"  # training.compile: auto | True | False
    data_path: str | None = None
    seed: int = 0
    context_parallel_degree: int = 1  # > 1: train_cp.py's sweep (CP=1 and CP=N per sequence length)
    context_parallel_method: str = "ring"  # ring | ulysses
    seq_lens: list[int] | None = None  # the CP sweep's sequence lengths (None: seq_len alone)
    optimizer: str = "adamw"  # adamw | muon (optimizer.name)
    lr: float | None = None  # optimizer.lr (None: the training default)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise BaigeError(f"--dtype {self.dtype!r}: choose auto, float32 or bfloat16")
        if self.optimizer not in ("adamw", "muon"):
            raise BaigeError(f"--optimizer {self.optimizer!r}: choose adamw or muon")
        if self.lr is not None:
            check_float("--lr", self.lr, 0.0)
        if self.steps <= self.warmup_steps:
            raise BaigeError(f"--steps ({self.steps}) must exceed --warmup-steps ({self.warmup_steps})")
        check_int("--seed", self.seed, *DATA_SEED_RANGE)
        check_int("--cp", self.context_parallel_degree, 1)
        if self.context_parallel_method not in ("ring", "ulysses"):
            raise BaigeError(f"--cp-method {self.context_parallel_method!r}: choose ring or ulysses")
        if self.context_parallel_degree > 1 and self.compile is True:
            raise BaigeError("--compile does not apply to --cp runs (both sides of the sweep run eager)")
        if self.seq_lens is not None and self.context_parallel_degree == 1:
            raise BaigeError("--seq-lens is the --cp sweep's: pass --cp N (N >= 2) with it")


def _synthetic_text(tokenizer, n_tokens: int, path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(32 if tokenizer.vocab_size > 1000 else 0, tokenizer.vocab_size, n_tokens).tolist()
    path.write_text(tokenizer.decode(ids))


def _train_config(cfg: TrainBenchConfig, tmp: Path) -> TrainConfig:
    """The validated training config of the bench run: the model (a preset architecture from scratch, with
    the default model's tokenizer, or a model spec), the data (``cfg.data_path`` or a synthetic text
    written under ``tmp``), the run's shape and dtype; output under ``tmp``, no TensorBoard, no HF export.

    Raises:
        BaigeError: the training config is invalid (``validate``), or the model whose tokenizer writes the
            synthetic text (or a preset's default tokenizer) cannot be resolved.
    """
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.train.config import TrainConfig, validate
    from baige.runtime.train.presets import PRESETS
    from baige.runtime.weights.hub import resolve_model

    from_scratch = cfg.model in PRESETS  # a preset architecture, randomly initialised, default tokenizer
    data = cfg.data_path
    if data is None:
        data = str(tmp / "synthetic.txt")
        tok = Tokenizer.from_dir(resolve_model(None if from_scratch else cfg.model))
        # decoded random ids re-tokenize to roughly as many tokens; 2x margin
        _synthetic_text(
            tok, 2 * (cfg.steps * cfg.batch_size * cfg.grad_accum + 1) * (cfg.seq_len + 1), Path(data), cfg.seed
        )
    tc = TrainConfig(output=str(tmp / "run"))
    if from_scratch:
        tc.model.config, tc.model.tokenizer = cfg.model, str(resolve_model(None))
    else:
        tc.model.name = cfg.model
    tc.data.train = [data]
    t = tc.training
    t.steps, t.seq_len, t.batch_size, t.grad_accum, t.seed = (
        cfg.steps,
        cfg.seq_len,
        cfg.batch_size,
        cfg.grad_accum,
        cfg.seed,
    )
    t.device, t.activation_checkpointing, t.compile = cfg.device, cfg.activation_checkpointing, cfg.compile
    tc.parallelism.mixed_precision_param = cfg.dtype
    tc.parallelism.context_parallel_degree = cfg.context_parallel_degree
    tc.parallelism.context_parallel_method = cfg.context_parallel_method
    tc.optimizer.name = cfg.optimizer
    if cfg.lr is not None:
        tc.optimizer.lr = cfg.lr
    tc.metrics.tensorboard = False
    tc.checkpoint.export_hf = False
    validate(tc)
    return tc


def run_train(cfg: TrainBenchConfig, progress: Progress | None = None, measure_limits: bool = True) -> dict:
    """Run ``baige bench train``; returns the JSON result (per-step samples in seconds, summary).
    ``measure_limits`` False (the CP sweep's ranks): no hardware limits, no MFU in the summary."""
    import torch

    from baige.runtime.train.metrics import peak_memory_bytes
    from baige.runtime.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="baige-bench-train-") as tmp:
        tc = _train_config(cfg, Path(tmp))
        trainer = Trainer(tc)
        setup_mem = peak_memory_bytes(trainer.device)
        dtype = trainer.param_dtype
        samples: list[dict] = []
        interrupted = False
        try:
            for i in range(cfg.steps):
                t0 = time.perf_counter()
                loss, grad_norm, _ = trainer.train_step()
                dt = time.perf_counter() - t0
                if i >= cfg.warmup_steps:
                    samples.append({"step": i + 1, "time_s": dt, "loss": loss, "grad_norm": grad_norm})
                if progress:
                    progress(i + 1, cfg.steps, "warm-up" if i < cfg.warmup_steps else "timed")
        except KeyboardInterrupt:
            interrupted = True
        mem = peak_memory_bytes(trainer.device)
        # measured after the steps, so that its buffers stay out of the peak memory
        limits = roofline.hardware_limits(trainer.device, dtype) if measure_limits else None
        sheet = limits.datasheet_peak if limits is not None and dtype == torch.bfloat16 else None
        peak, peak_source = (
            (sheet, "data sheet (dense bf16)") if sheet else (limits and limits.matmul_peak, "measured matmul")
        )
        compiled = trainer.compile  # what training.compile (auto by default) resolved to
        fpt = trainer.model.flops_per_token(cfg.seq_len)
        mc = trainer.model_config
        counts = {
            "num_params": mc.num_params(),
            "num_params_non_embedding": mc.num_params(non_embedding=True),
            "num_params_active": mc.num_params(non_embedding=True, active=True),
        }  # roofline.model_counts
    summary = {}
    if samples:
        step_s = statistics.median(s["time_s"] for s in samples)
        tps = cfg.batch_size * cfg.seq_len * cfg.grad_accum / step_s
        summary = {
            "step_time_s": step_s,
            "tokens_per_s_per_device": tps,
            "peak_memory_bytes": mem,
            "setup_peak_memory_bytes": setup_mem,  # before the first step: weights, optimizer, runtime
        }
        if limits is not None:
            summary.update(peak_flops=peak, peak_source=peak_source, roofline=roofline.compute_roofline(tps, fpt, peak))
            summary["mfu_pct"] = summary["roofline"]["pct_of_limit"]
    return {
        "benchmark": "train",
        "args": asdict(cfg),
        "environment": environment(),
        "limits": limits.to_dict() if limits is not None else None,
        "model": counts,
        "dtype": str(dtype).removeprefix("torch."),
        "compiled": compiled,
        "interrupted": interrupted,
        "samples": samples,
        "summary": summary,
    }
