"""The Trainer: model set-up, the training step (fused CE, accumulation, clipping), schedule,
evaluation, checkpoints and metrics. ``baige train`` builds a :class:`TrainConfig` and calls
:func:`run_training` on every rank.

Loss normalisation: every micro-batch's summed token cross-entropy is divided by the number of valid
target tokens of the whole step (all micro-batches, all data-parallel ranks), so accumulation and
data parallelism give the gradient of one big batch. FSDP averages gradients over data-parallel
ranks, so the backward loss is multiplied by the data-parallel size. Mixture-of-Experts models add
the router terms of :class:`~baige.runtime.train.moe.MoEBalancer` (load balancing, z-loss) to each
micro-batch's loss under the same factors; the reported ``loss`` stays the cross-entropy.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.device import DTYPES
from baige.runtime.model.transformer import Transformer
from baige.runtime.settings import settings
from baige.runtime.train import lora, parallel
from baige.runtime.train.checkpoint import (
    CheckpointManager,
    export_hf,
    optimizer_state_is_flat,
    rng_state,
    set_rng_state,
)
from baige.runtime.train.config import TrainConfig
from baige.runtime.train.data import DataLoader, eval_batches, load_windows
from baige.runtime.train.lr_scheduler import build_lr_scheduler
from baige.runtime.train.metrics import MetricsLogger, mfu, peak_flops, peak_memory_bytes
from baige.runtime.train.moe import MoEBalancer, RouterLogits
from baige.runtime.train.presets import init_weights, scratch_config


@dataclass
class TrainResult:
    """What a run did: per-step training losses and evaluation losses (rank 0 and others alike)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss over the global batch (nats/token)
    eval_losses: dict[int, float] = field(default_factory=dict)
    start_step: int = 0
    checkpoint: Path | None = None
    export: Path | None = None


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


class Trainer:
    """One training run on this rank. Collective: every rank builds one with the same config."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        for path in cfg.data.train + cfg.data.eval:  # before any expensive set-up
            if not Path(path).is_file():
                raise BaigeError(f"{path}: data file not found")
        self._init_distributed()
        self._init_output()
        self._resolve_model_and_tokenizer()
        model = self._load_or_init_weights()
        tp_mesh = self.mesh["tp"] if self.dims.tp > 1 else None  # LoRA applies TP first (the adapters follow it)
        self.lora_params = lora.apply_lora(model, cfg.lora, cfg.training.seed, tp_mesh) if cfg.lora.rank else 0
        self._build_data()
        self.model = self._apply_parallelisms(model)
        self.optimizer = self._build_optimizer()
        self._clip_in_optimizer = self._can_clip_in_optimizer()
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.ckpt = CheckpointManager(self.output / "checkpoints", self.dist.is_main, cfg.checkpoint.keep_latest)
        self.step = 0
        self.flops_per_token = lora.flops_per_token(self.model, self.lora_params, cfg.training.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, self.param_dtype, cfg.metrics.peak_tflops)

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
        )
        self.mesh = self.dims.build_mesh(self.device.type)
        self.sparse_mesh = self.dims.build_sparse_mesh(self.device.type)
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
        model.train()
        self.model_config = model.config
        return model

    def _build_data(self) -> None:
        """Token windows of the train (and eval) files and the data loader; local rank 0 tokenizes
        into the cache first.

        Raises:
            BaigeError: the data holds a token id outside the model's vocabulary.
        """
        from baige.runtime.weights.hub import cache_dir

        cfg, t = self.cfg, self.cfg.training
        cache = cache_dir() / "tokens"
        if self.dist.local_rank != 0:
            self._barrier()
        self.train_windows = load_windows(cfg.data.train, self.tokenizer, self.tokenizer_dir, cache, t.seq_len)
        self.eval_windows = (
            load_windows(cfg.data.eval, self.tokenizer, self.tokenizer_dir, cache, t.seq_len) if cfg.data.eval else None
        )
        if self.dist.local_rank == 0:
            self._barrier()
        for w in (self.train_windows, self.eval_windows):
            if w is not None and w.max_id >= self.model_config.vocab_size:
                raise BaigeError(
                    f"the data holds token id {w.max_id} but the model's vocab_size is "
                    f"{self.model_config.vocab_size}: tokenizer and model do not match"
                )
        self.loader = DataLoader(
            self.train_windows, t.batch_size, t.grad_accum, self.dims.dp_size, self.dp_rank, t.seed, cfg.data.shuffle
        )

    def _apply_parallelisms(self, model: Transformer) -> Transformer:
        """The MoE balancer (on the plain model), then TP -> EP -> AC -> compile -> FSDP
        (:func:`parallel.parallelize`), then the device move when FSDP does not place the parameters.
        Sets ``moe``, ``param_dtype``, ``compile`` and ``autocast``."""
        p = self.cfg.parallelism
        mp = p.mixed_precision_param
        self.param_dtype = DTYPES[
            "bfloat16" if mp == "auto" and self.device.type == "cuda" else ("float32" if mp == "auto" else mp)
        ]
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
            )
            return self.pipeline.model
        return model

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
        """AdamW (Loshchilov & Hutter 2019) with no weight decay on norms, biases and embeddings."""
        from torch.distributed.tensor import DTensor

        o = self.cfg.optimizer
        groups: dict[tuple[bool, bool], list] = {}
        for name, param in ((n, p) for n, p in self.model.named_parameters() if p.requires_grad):  # not a frozen base
            decay = param.ndim >= 2 and "embed_tokens" not in name
            # fused/foreach kernels take one kind per group: DTensors (FSDP/TP/EP, any mesh) apart from
            # plain tensors; the same groups on every layout, so checkpoints reshard between them
            groups.setdefault((decay, isinstance(param, DTensor)), []).append(param)
        groups = [
            {"params": params, "weight_decay": o.weight_decay if decay else 0.0}
            for (decay, _), params in sorted(groups.items(), reverse=True)
        ]
        fused = o.fused != "false"  # auto: torch has fused AdamW kernels for CUDA and CPU
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused or None)

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
        """A fp64 tensor summed over the data-parallel ranks (the world sum / the TP x PP degree)."""
        if not dist.is_initialized():
            return t
        t = t.to(self.device)
        dist.all_reduce(t)
        return t / self.dims.model_parallel_size

    def _loss_sum(
        self, input_ids: torch.Tensor, labels: torch.Tensor, normalizer: float
    ) -> tuple[torch.Tensor, RouterLogits | None]:
        """Summed token cross-entropy of one micro-batch / ``normalizer``; (B, T) int64 inputs. With
        gradients on an MoE model, also each sparse layer's (B*T, E) router logits."""
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        positions = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)  # (B, T)
        router_logits = RouterLogits() if self.moe is not None and torch.is_grad_enabled() else None
        with torch.autocast(self.device.type, dtype=self.param_dtype, enabled=self.autocast):
            hidden = self.model(input_ids, positions, router_logits=router_logits)  # (B, T, hidden)
            # FSDP keeps the root's parameters (lm_head) unsharded after forward, so this is the full weight.
            loss = kernels.fused_linear_cross_entropy(hidden, self.model.lm_head.weight, labels, normalizer=normalizer)
        return loss, router_logits

    # ---- checkpoint state -------------------------------------------------------------------------

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
            "data": self.loader.state_dict(),
            "rng": rng_state(self.device),
            "step": self.step,
        }
        moe = self.moe.state_dict() if self.moe is not None else {}
        return {**state, "moe": moe} if moe else state

    def save(self) -> Path:
        path = self.ckpt.save(self.step, self._state(), self.cfg.to_toml())
        self.log.print(f"saved checkpoint {path}")
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
        self.loader.load_state_dict(state["data"])
        set_rng_state(state["rng"], self.device)
        if "moe" in state:
            self.moe.load_state_dict(state["moe"])
        self.step = int(state["step"])
        self.log.print(f"resumed from {path} at step {self.step}")

    # ---- the loop ---------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step over ``grad_accum`` micro-batches. Returns (loss, grad_norm, lr) of the step.

        Raises:
            BaigeError: a non-finite loss or gradient norm (before the parameters change).
        """
        micro = self.loader.next_step()
        local_valid = sum(int((labels != -100).sum()) for _, labels in micro)
        # Every rank of a TP x PP group holds the same data: divide the world sum by that degree.
        n_valid = self._all_reduce_sum([float(local_valid)])[0] / self.dims.model_parallel_size
        if n_valid == 0:
            raise BaigeError(f"step {self.step + 1}: no target token carries loss in the whole batch")
        local_loss = 0.0  # loss on the last pipeline stage only; the world sum / TP is the step's loss
        if self.pipeline is not None:
            local_loss = self.pipeline.step(micro, n_valid, self.dims.dp_size)
        for input_ids, labels in micro if self.pipeline is None else ():
            loss, router_logits = self._loss_sum(input_ids, labels, n_valid)
            total = loss if router_logits is None else loss + self.moe.micro_batch_loss(router_logits)
            (total * self.dims.dp_size).backward()
            local_loss += loss.item()
        sums = self._all_reduce_sum([local_loss] + (self.moe.step_values() if self.moe is not None else []))
        loss_value = sums[0] / self.dims.tp
        self.moe_losses = dict(zip(("aux_loss", "z_loss"), (v / self.dims.tp for v in sums[1:])))
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
        try:
            self.optimizer.step()
        finally:
            if fold_clip:
                del self.optimizer.grad_scale
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.moe is not None:
            self.moe.end_step()
        self.step += 1
        return loss_value, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the eval data (``training.eval_batches`` rounds, 0 = all), nats/token."""
        t = self.cfg.training
        total, count = 0.0, 0.0
        for input_ids, labels in eval_batches(
            self.eval_windows, t.batch_size, self.dims.dp_size, self.dp_rank, t.eval_batches
        ):
            total += (
                self.pipeline.eval_loss(input_ids, labels)
                if self.pipeline is not None
                else self._loss_sum(input_ids, labels, 1.0)[0].item()
            )
            count += float((labels != -100).sum())
        total, count = self._all_reduce_sum([total, count])
        total, count = total / self.dims.tp, count / self.dims.model_parallel_size
        loss = total / count if count else float("nan")
        self.log.log({"split": "eval", "step": self.step, "loss": loss, "tokens": int(count)})
        return loss

    def train(self) -> TrainResult:
        """Resume if asked, train to ``training.steps``, evaluate, checkpoint, export. Collective."""
        cfg, t = self.cfg, self.cfg.training
        result = TrainResult()
        resume_path = self.ckpt.resolve_resume(cfg.checkpoint.resume)
        self.ckpt.clean_partial()
        if self.dist.is_main:
            (self.output / "config.toml").write_text(cfg.to_toml())
        self.log.print(cfg.to_toml())
        if resume_path is not None:
            self.resume(resume_path)
        result.start_step = self.step
        mc = self.model_config
        active = f" ({mc.num_params(active=True) / 1e6:.1f}M active)" if mc.moe is not None else ""
        active += f" (LoRA r={cfg.lora.rank}: {self.lora_params:,} trainable)" if self.lora_params else ""
        self.log.print(
            f"{mc.model_type} {mc.num_params() / 1e6:.1f}M params{active} | world_size "
            f"{self.dist.world_size} (pp {self.dims.pp} x dp_replicate {self.dims.dp_replicate} x dp_shard "
            f"{self.dims.dp_shard} x tp "
            f"{self.dims.tp}, ep {self.dims.ep}) | {self.train_windows.num_tokens} training tokens | global batch "
            f"{self.loader.global_batch} x {t.seq_len} tokens | peak {self.peak_flops / 1e12:.2f} TFLOP/s per "
            f"device ({self.peak_source})"
        )
        if self.pipeline is not None:
            self.log.print(self.pipeline.description)
        if self.eval_windows is not None and self.step == 0:
            result.eval_losses[0] = self.evaluate()
        tokens_per_step_per_device = self.loader.global_batch * t.seq_len / self.dist.world_size
        window_t0, window_steps = time.perf_counter(), 0
        last_saved = self.step
        while self.step < t.steps:
            loss, grad_norm, lr = self.train_step()
            result.losses[self.step] = loss
            window_steps += 1
            if self.step % cfg.metrics.log_every == 0 or self.step == t.steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - window_t0
                tps = window_steps * tokens_per_step_per_device / elapsed
                self.log.log(
                    {
                        "split": "train",
                        "step": self.step,
                        "loss": loss,
                        "grad_norm": grad_norm,
                        "lr": lr,
                        "tokens_per_second_per_device": tps,
                        "mfu": mfu(tps, self.flops_per_token, self.peak_flops),
                        "peak_memory_gib": peak_memory_bytes(self.device) / 2**30,
                        "seconds": elapsed,
                        "trainable_params": self.lora_params or mc.num_params(),
                        **(dict(self.moe_losses, **self.moe.metrics()) if self.moe is not None else {}),
                        **(self.pipeline.metrics() if self.pipeline is not None else {}),
                    }
                )
                window_t0, window_steps = time.perf_counter(), 0
            evaluated = False
            if self.eval_windows is not None and (
                (t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps
            ):
                result.eval_losses[self.step] = self.evaluate()
                evaluated = True
            interval = cfg.checkpoint.interval
            if (interval and self.step % interval == 0) or self.step == t.steps:
                result.checkpoint = self.save()
                last_saved = self.step
            if evaluated or self.step == last_saved:
                window_t0 = time.perf_counter()  # evaluation and saving are not training throughput
        if cfg.checkpoint.export_hf:
            result.export = self.export()
        self.log.close()
        return result

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


def run_training(cfg: TrainConfig) -> TrainResult:
    """Build a :class:`Trainer` for ``cfg`` and run it (every rank calls this). Collective."""
    return Trainer(cfg).train()
