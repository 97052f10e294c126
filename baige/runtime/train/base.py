"""What every ``baige train`` method shares (:class:`TrainerBase`): the process group and device mesh,
the model and tokenizer, LoRA, the parallelisms in torchtitan's order, the optimizer (AdamW or Muon:
``optimizer.py``) and its clipped step, the compute dtype, the learning-rate schedule, DCP checkpoints with
exact resume, the metrics logger and the HF export.

A method is a subclass that builds its data (:meth:`TrainerBase._build_data`) and runs its own loop:
next-token training (SFT / pre-training, :class:`~baige.runtime.train.trainer.Trainer`) and GRPO
(:class:`~baige.runtime.train.rl.grpo.GRPOTrainer`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from baige.errors import BaigeError
from baige.runtime.model.device import DTYPES
from baige.runtime.model.transformer import Transformer
from baige.runtime.settings import settings
from baige.runtime.train import host_memory, lora, parallel
from baige.runtime.train.checkpoint import (
    CheckpointManager,
    export_hf,
    optimizer_state_is_flat,
    rng_state,
    set_rng_state,
)
from baige.runtime.train.config import TrainConfig
from baige.runtime.train.lr_scheduler import build_lr_scheduler
from baige.runtime.train.metrics import MetricsLogger
from baige.runtime.train.moe import MoEBalancer
from baige.runtime.train.mtp import set_mtp_depth
from baige.runtime.train.presets import init_weights, scratch_config


@dataclass
class TrainResult:
    """What a run did: per-step training losses and evaluation losses (rank 0 and others alike)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss over the global batch (nats/token)
    eval_losses: dict[int, float] = field(default_factory=dict)
    start_step: int = 0
    checkpoint: Path | None = None
    export: Path | None = None
    stopped: bool = False  # a stop signal (SIGTERM / SIGINT) ended the run early, after a checkpoint


def _has_cxx_compiler() -> bool:
    """A C++ compiler for torch.compile's CPU backend (Inductor): $CXX, g++, c++ or clang++ on PATH."""
    return any(shutil.which(c) for c in (settings().cxx or "g++", "c++", "clang++"))


def _state_dict_options(**options):
    """DCP state-dict options (``options``: more ``StateDictOptions`` fields): the optimizer state flattened
    to one entry per parameter name (torchtitan's choice), so that pipeline stages, whose param_groups
    differ per rank, save and reshard by name (checkpoints from before keep the nested layout, see
    :func:`~baige.runtime.train.checkpoint.optimizer_state_is_flat`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**{"flatten_optimizer_state_dict": True, **options})


class TrainerBase(abc.ABC):
    """The set-up and the checkpoint state of one training run on this rank, whatever the method.
    Collective: every rank builds one with the same config.

    Subclasses implement :meth:`_build_data` (called after the weights and LoRA, before the
    parallelisms) and may override :meth:`_on_base_model`, :meth:`_extra_state` /
    :meth:`_load_extra_state` and :attr:`num_optimizer_steps`.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        for path in cfg.data.train + cfg.data.eval:  # before any expensive set-up
            if not Path(path).is_file():
                raise BaigeError(f"{path}: data file not found")
        self._init_distributed()
        if self.device.type == "cpu":  # reuse freed host memory between steps (no page faults per step)
            host_memory.keep_freed_memory()
        self._init_output()
        self._resolve_model_and_tokenizer()
        model = self._load_or_init_weights()
        self._on_base_model(model)
        tp_mesh = self.mesh["tp"] if self.dims.tp > 1 else None  # LoRA applies TP first (the adapters follow it)
        self.lora_params = lora.apply_lora(model, cfg.lora, cfg.training.seed, tp_mesh) if cfg.lora.rank else 0
        self._build_data()
        self.model = self._apply_parallelisms(model)
        self.optimizer = self._build_optimizer()
        self._clip_in_optimizer = self._can_clip_in_optimizer()
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, self.num_optimizer_steps)
        c = cfg.checkpoint
        self.ckpt = CheckpointManager(
            self.output / "checkpoints", self.dist.is_main, c.keep_latest, c.async_mode, self.log.log
        )
        self.step = 0

    @property
    def num_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the learning-rate schedule's length)."""
        return self.cfg.training.steps

    def _on_base_model(self, model: Transformer) -> None:
        """Called with the plain model (weights loaded, before LoRA and the parallelisms); nothing here."""

    @abc.abstractmethod
    def _build_data(self) -> None:
        """Build the method's data (token windows for next-token training, prompts for GRPO); each method's
        trainer defines it."""

    # ---- set-up steps, in the order __init__ runs them --------------------------------------------

    def _init_distributed(self) -> None:
        """Device, process group (:func:`parallel.init_distributed`), parallel dims and device mesh."""
        from baige.runtime.model.device import resolve_device

        p = self.cfg.parallelism
        self.device = resolve_device(self.cfg.training.device)
        self.dist = parallel.init_distributed(self.device.type)
        self.dims = parallel.ParallelDims.resolve(
            self.dist.world_size,
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            p.tensor_parallel_degree,
            p.expert_parallel_degree,
            p.pipeline_parallel_degree,
            p.context_parallel_degree,
        )
        self.mesh = self.dims.build_mesh(self.device.type)
        self.sparse_mesh = self.dims.build_sparse_mesh(self.device.type)
        self.dp_cp_mesh = self.dims.build_dp_cp_mesh(self.device.type)
        self.dp_rank = self.dims.dp_rank(self.mesh)

    def _init_output(self) -> None:
        """The output directory (rank 0 creates it, the others wait) and the metrics logger."""
        self.output = Path(self.cfg.output)
        if self.dist.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
        self._barrier()
        self.log = MetricsLogger(self.output, self.dist.is_main, self.cfg.metrics.tensorboard)

    def _resolve_model_and_tokenizer(self) -> None:
        """``model_dir`` (None from scratch), ``tokenizer_dir`` and ``tokenizer``. Local rank 0 resolves
        first (a GGUF import or download happens once per node)."""
        from baige.runtime.model.tokenizer import Tokenizer
        from baige.runtime.weights.hub import resolve_model

        cfg = self.cfg
        if self.dist.local_rank != 0:
            self._barrier()
        if cfg.model.config is None:
            self.model_dir = resolve_model(cfg.model.name)
            tok_dir = self.model_dir
        else:
            self.model_dir = None
            tok_dir = self._tokenizer_dir(cfg, resolve_model)
        if cfg.model.tokenizer is not None:
            tok_dir = self._tokenizer_dir(cfg, resolve_model)
        if self.dist.local_rank == 0:
            self._barrier()
        self.tokenizer_dir = tok_dir
        self.tokenizer = Tokenizer.from_dir(tok_dir)

    def _load_or_init_weights(self) -> Transformer:
        """The plain model in train mode, fp32 on the CPU: the checkpoint's weights, or (from scratch)
        :func:`init_weights` after seeding with ``training.seed``. Sets ``model_config``."""
        torch.manual_seed(self.cfg.training.seed)
        if self.model_dir is not None:
            from baige.runtime.weights.loader import load_model

            model = load_model(self.model_dir, dtype=torch.float32, device="cpu")
        else:
            mcfg = scratch_config(
                self.cfg.model.config,
                self.tokenizer.vocab_size,
                self.tokenizer.bos_token_id,
                self.tokenizer.eos_token_ids,
            )
            model = Transformer(mcfg)
            init_weights(model, float(mcfg.raw.get("initializer_range", 0.02)))
        if self.cfg.model.mtp_depth is not None and self.cfg.model.mtp_depth != model.config.mtp_depth:
            set_mtp_depth(model, self.cfg.model.mtp_depth, float(model.config.raw.get("initializer_range", 0.02)))
        model.train()
        self.model_config = model.config
        return model

    def _apply_parallelisms(self, model: Transformer) -> Transformer:
        """The MoE balancer (on the plain model), then TP -> EP -> AC -> compile -> FSDP
        (:func:`parallel.parallelize`), then the device move when FSDP does not place the parameters.
        Sets ``moe``, ``param_dtype``, ``compile`` and ``autocast``."""
        p = self.cfg.parallelism
        mp = p.mixed_precision_param
        self.param_dtype = self._auto_compute_dtype() if mp == "auto" else DTYPES[mp]
        reduce_dtype = DTYPES[p.mixed_precision_reduce if p.mixed_precision_reduce != "auto" else "float32"]
        self.moe = (
            MoEBalancer(model, self.cfg.moe, self.cfg.training.grad_accum, self._dp_sum)
            if model.config.moe is not None
            else None
        )
        self.compile = self._resolve_compile()
        dims = dataclasses.replace(self.dims, tp=1) if self.lora_params else self.dims  # TP already applied
        parallel.parallelize(
            model,
            dims,
            self.mesh,
            ac=self.cfg.training.activation_checkpointing,
            compile=self.compile,
            param_dtype=self.param_dtype,
            reduce_dtype=reduce_dtype,
            sparse_mesh=self.sparse_mesh,
            dp_cp_mesh=self.dp_cp_mesh,
        )
        if not self.dims.fsdp_enabled:
            model.to(self.device)
        # Without FSDP's MixedPrecisionPolicy, low-precision compute comes from autocast.
        self.autocast = (not self.dims.fsdp_enabled) and self.param_dtype != torch.float32
        self.pipeline = None
        if self.dims.pp > 1:  # this rank's stages (pipeline.py); self.model holds them under the full names
            from baige.runtime.train.pipeline import build_pipeline

            self.pipeline = build_pipeline(
                model,
                self.dims,
                self.mesh,
                self.device,
                schedule=p.pipeline_parallel_schedule,
                microbatches=p.pipeline_parallel_microbatches,
                batch_size=self.cfg.training.batch_size,
                param_dtype=self.param_dtype,
                reduce_dtype=reduce_dtype,
                autocast_dtype=self.param_dtype if self.autocast else None,
                moe=self.moe,
            )
            return self.pipeline.model
        return model

    def _auto_compute_dtype(self) -> torch.dtype:
        """``parallelism.mixed_precision_param = auto``: bf16 on CUDA; on the CPU bf16 where it computes
        bf16 natively (AVX-512 BF16 or AMX: :func:`~baige.runtime.model.device.cpu_auto_dtype`, the
        choice ``--dtype auto`` makes for inference, ``BAIGE_CPU_AUTO_DTYPE`` overriding it), else fp32.
        The parameters (master weights), gradients' reduction and optimizer state stay fp32."""
        from baige.runtime.model.device import cpu_auto_dtype

        return torch.bfloat16 if self.device.type == "cuda" else cpu_auto_dtype()

    def _resolve_compile(self) -> bool:
        """``training.compile``; ``auto`` compiles on a CPU without FSDP or TP when a C++ compiler exists
        and the model is dense (a sparse layer's expert grouping reads counts to the host: graph breaks).

        Raises:
            BaigeError: compile forced on a CPU without a C++ compiler.
        """
        c = self.cfg.training.compile
        enabled = (
            c
            if isinstance(c, bool)
            else (
                self.device.type == "cpu"
                and not self.dims.fsdp_enabled
                and self.dims.model_parallel_size == 1
                and self.moe is None
                and _has_cxx_compiler()
            )
        )  # Inductor's CPU backend builds C++; without a compiler, stay eager
        if enabled is True and self.device.type == "cpu" and not _has_cxx_compiler():
            raise BaigeError(
                "--compile (training.compile = true) on CPU needs a C++ compiler on PATH "
                "(g++, c++, clang++ or $CXX) for torch.compile's Inductor backend; install one "
                "or use --no-compile"
            )
        return enabled

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """``optimizer.name``: AdamW, or Muon for the hidden matrices with AdamW for the rest
        (:func:`~baige.runtime.train.optimizer.build_optimizer`); Muon's Newton-Schulz runs in the
        compute dtype (``param_dtype``: bf16 under mixed precision, as Keller Jordan's Muon does)."""
        from baige.runtime.train.optimizer import build_optimizer

        o = self.cfg.optimizer
        return build_optimizer(
            self.model,
            o.name,
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=o.fused != "false",  # auto: torch has fused AdamW kernels for CUDA and CPU
            momentum=o.momentum,
            ns_steps=o.ns_steps,
            ns_dtype=self.param_dtype,
        )

    def _can_clip_in_optimizer(self) -> bool:
        """Whether gradient clipping folds into the optimizer step.

        Fused AdamW divides every gradient by ``optimizer.grad_scale`` inside its own pass (the hook
        torch.amp.GradScaler uses): clipping then costs no extra pass over the gradients. Plain
        tensors only; FSDP/TP DTensor gradients are clipped in place as before.
        """
        from torch.distributed.tensor import DTensor

        return getattr(self.optimizer, "_step_supports_amp_scaling", False) and not any(
            isinstance(p, DTensor) for p in self.model.parameters()
        )

    # ---- set-up helpers ---------------------------------------------------------------------------

    @staticmethod
    def _tokenizer_dir(cfg: TrainConfig, resolve_model) -> Path:
        spec = cfg.model.tokenizer
        if spec is None:
            cfg_path = Path(cfg.model.config)
            base = cfg_path if cfg_path.is_dir() else cfg_path.parent
            if (base / "tokenizer.json").is_file():
                return base
            raise BaigeError("training from scratch needs a tokenizer: pass --tokenizer DIR_OR_MODEL")
        path = Path(spec).expanduser()
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return path
        return resolve_model(spec)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over every rank (fp64 on the CPU when gloo, on the device otherwise)."""
        if not dist.is_initialized():
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A fp64 tensor of per-layer statistics summed over the data-parallel ranks and the pipeline
        stages (each contributes the layers it holds): the world sum / the TP degree."""
        if not dist.is_initialized():
            return t
        t = t.to(self.device)
        dist.all_reduce(t)
        return t / self.dims.tp

    # ---- the optimizer step ---------------------------------------------------------------------

    def _clip_and_step(self, loss_value: float) -> tuple[float, float]:
        """Clip the accumulated gradients (``training.max_norm``), step AdamW and the schedule, zero the
        gradients. Returns (grad_norm, lr) of the step.

        Raises:
            BaigeError: a non-finite loss or gradient norm (before the parameters change).
        """
        max_norm = self.cfg.training.max_norm
        fold_clip = self._clip_in_optimizer and max_norm > 0
        clip = self.pipeline.clip_grad_norm_ if self.pipeline is not None else parallel.clip_grad_norm_
        norm = clip(self.model.parameters(), 0.0 if fold_clip else max_norm)
        grad_norm = norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise BaigeError(
                f"step {self.step + 1}: loss {loss_value} / grad norm {grad_norm} is not finite; "
                "stopping without a checkpoint (lower optimizer.lr or check the data)"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        # clipping multiplies by max_norm / (norm + 1e-6) when that is below 1 (clip_grads_with_norm_'s
        # coefficient); folded into fused AdamW it is a division by the inverse
        fold_clip = fold_clip and grad_norm + 1e-6 > max_norm
        if fold_clip:
            self.optimizer.grad_scale = (norm.float() + 1e-6) / max_norm
        self.ckpt.before_optimizer_step(self.step + 1)  # a save in flight finishes staging first
        try:
            self.optimizer.step()
        finally:
            if fold_clip:
                del self.optimizer.grad_scale
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    # ---- checkpoint state -------------------------------------------------------------------------

    def _extra_state(self) -> dict:
        """The method's own entries of the checkpoint (data order, MoE biases, ...); none here."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        """Restore :meth:`_extra_state`'s entries from a loaded checkpoint."""

    def _state(self, flat_optimizer: bool = True) -> dict:
        model_sd, optim_sd = lora.train_state_dict(
            self.model,
            self.optimizer,
            bool(self.lora_params),
            _state_dict_options(flatten_optimizer_state_dict=flat_optimizer),
        )
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(self.device),
            "step": self.step,
        }
        return {**state, **self._extra_state()}

    def save(self) -> Path:
        path = self.ckpt.save(self.step, self._state, self.cfg.to_toml())
        background = self.ckpt.async_mode != "disabled"
        self.log.print(f"checkpoint {path}: writing in the background" if background else f"saved checkpoint {path}")
        return path

    def resume(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        flat = optimizer_state_is_flat(path)
        if not flat and self.pipeline is not None:
            raise BaigeError(
                f"{path} predates pipeline parallel (nested optimizer state): resume it once without "
                "--pp; its next checkpoints reshard to any PP degree"
            )
        state = self._state(flat)
        self.ckpt.load(path, state, whole_model=self.pipeline is None)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_state_dict_options(strict=not self.lora_params, flatten_optimizer_state_dict=flat),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        self._load_extra_state(state)
        self.step = int(state["step"])
        self.log.print(f"resumed from {path} at step {self.step}")

    def _start_run(self) -> None:
        """Find the checkpoint to resume from and clear a partial one, write ``config.toml``, print the
        config, resume. Collective."""
        cfg = self.cfg
        resume_path = self.ckpt.resolve_resume(cfg.checkpoint.resume)
        self.ckpt.clean_partial()
        if self.dist.is_main:
            (self.output / "config.toml").write_text(cfg.to_toml())
        self.log.print(cfg.to_toml())
        if resume_path is not None:
            self.resume(resume_path)

    def _describe_model(self) -> str:
        """``llama 0.1M params (LoRA r=4: 1,234 trainable) | world_size 2 (pp 1 x ...)``: the console header's start."""
        mc, cfg = self.model_config, self.cfg
        active = f" ({mc.num_params(active=True) / 1e6:.1f}M active)" if mc.moe is not None else ""
        active += f" (LoRA r={cfg.lora.rank}: {self.lora_params:,} trainable)" if self.lora_params else ""
        return (
            f"{mc.model_type} {mc.num_params() / 1e6:.1f}M params{active} | world_size "
            f"{self.dist.world_size} (pp {self.dims.pp} x dp_replicate {self.dims.dp_replicate} x dp_shard "
            f"{self.dims.dp_shard} x cp {self.dims.cp} x tp {self.dims.tp}, ep {self.dims.ep})"
        )

    def export(self) -> Path | None:
        """Write ``<output>/hf`` from the current weights (collective)."""
        want = self.cfg.checkpoint.export_dtype
        dtype = (
            DTYPES.get(self.model_config.torch_dtype.replace("torch.", ""), torch.float32)
            if want == "auto"
            else DTYPES[want]
        )
        if self.lora_params:  # the PEFT adapter (and the merged model with lora.merge)
            return lora.export_lora(self, dtype)
        out = export_hf(
            self.model,
            dict(self.model_config.raw),
            self.output / "hf",
            self.tokenizer_dir,
            dtype,
            self.dist.is_main,
            self.pipeline.full_state_dict if self.pipeline is not None else None,
        )
        if out is not None:
            self.log.print(f"exported HF checkpoint to {out}")
            if self.moe is not None and self.moe.bias_mode and not self.moe.own_bias:
                self.log.print(
                    f"note: {self.model_config.model_type} checkpoints have no expert-selection bias: "
                    "the export routes without the moe.load_balance=bias biases (kept in the DCP checkpoint)"
                )
        return out
