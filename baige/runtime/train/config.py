"""``baige train``'s configuration: one dataclass per TOML section, file + flags + ``--set`` overrides.

Resolution order (later wins): the dataclass defaults, ``--config run.toml``, the command-line flags, then
``--set section.field=value`` overrides. ``value`` is read as a TOML value (``3e-4``, ``true``, ``[0.9, 0.95]``,
``"text"``); a bare word that is not TOML is taken as a string (``--set model.name=/data/llama``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from baige.errors import BaigeError
from baige.runtime.config import DATA_SEED_RANGE, check_float, check_int, check_output_path
from baige.runtime.model.config import LORA_TARGETS
from baige.runtime.train.mtp_config import validate_mtp
from baige.runtime.train.parallelism_config import validate_context_parallel, validate_pipeline
from baige.runtime.train.rl.config import RLSection, validate_rl


@dataclass
class ModelSection:
    name: str | None = None  # pretrained weights: any spec the loader accepts (None = the embedded default)
    config: str | None = None  # from scratch instead: a config.json path or a preset name (see train.PRESETS)
    tokenizer: str | None = None  # tokenizer dir/spec; default: the model's own (or the config.json's dir)
    mtp_depth: int | None = None  # multi-token-prediction modules (train/mtp.py); None: the checkpoint's
    mtp_loss_scaling_factor: float = 0.3  # MTP loss weight (DeepSeek-V3's lambda; Megatron's name)


@dataclass
class DataSection:
    train: list[str] = field(default_factory=list)  # .txt (one document per file) or .jsonl ("text" / "messages")
    eval: list[str] = field(default_factory=list)
    shuffle: bool = True  # shuffle windows each epoch (seeded by training.seed + epoch)


@dataclass
class TrainingSection:
    steps: int = 1000  # optimizer steps
    seq_len: int = 2048  # tokens per window
    batch_size: int = 8  # windows per device per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    max_norm: float = 1.0  # gradient clipping by global L2 norm; 0 = off
    eval_every: int = 0  # steps between evaluations of data.eval; 0 = only at the end
    eval_batches: int = 0  # micro-batches per evaluation (per device); 0 = the whole eval set
    device: str = "auto"  # auto | cpu | cuda
    activation_checkpointing: str = "none"  # none | full | N (every N-th block)
    # torch.compile each block; auto = on for single-device CPU training (no FSDP/TP), where the blocks'
    # reference norms/RoPE/SwiGLU otherwise run as many small eager ops (docs/benchmarks/archive.md)
    compile: bool | str = "auto"  # auto | true | false
    # causal: attention crosses the documents packed into a window (GPT-2 / nanoGPT packing); block_causal:
    # each token attends only within its own document (torchtitan's name for document masking)
    attn_mask_type: str = "causal"


@dataclass
class OptimizerSection:
    # adamw | muon (Newton-Schulz orthogonalised momentum on the hidden matrices, AdamW on embeddings,
    # the LM head, norms and biases; one lr, Muon's scaled to AdamW's update RMS: train/optimizer.py)
    name: str = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings
    fused: str = "auto"  # auto = true (torch has fused AdamW for CUDA and CPU) | true | false
    momentum: float = 0.95  # muon: momentum of the orthogonalised updates (Nesterov)
    ns_steps: int = 5  # muon: Newton-Schulz iterations per step


@dataclass
class LRSchedulerSection:
    name: str = "cosine"  # cosine | wsd | constant (all after a linear warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # final lr / peak lr for cosine and wsd
    decay_ratio: float = 0.2  # wsd: fraction of the steps spent in the final linear decay


@dataclass
class ParallelismSection:
    data_parallel_replicate_degree: int = 1  # HSDP replicas (1 = plain FSDP)
    data_parallel_shard_degree: int = -1  # -1 = whatever world_size leaves
    tensor_parallel_degree: int = 1
    # experts sharded over this many ranks of the data-parallel shard dimension (torchtitan's name);
    # must divide data_parallel_shard_degree and the number of routed experts
    expert_parallel_degree: int = 1
    # pipeline parallel (torch.distributed.pipelining): the outermost mesh dimension, stages split by layer count
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | ZBVZeroBubble (torchtitan's names)
    # micro-batches each pipeline step splits training.batch_size into (must divide it); 0 = batch_size
    pipeline_parallel_microbatches: int = 0
    # context parallel (torchtitan's name): each window's sequence sharded over this many ranks
    # (training.seq_len must be a multiple of 2 x the degree: load-balanced causal chunks)
    context_parallel_degree: int = 1
    # ring (K/V blocks passed around the CP ranks) | ulysses (all-to-all to head sharding, DeepSpeed-Ulysses:
    # the attention heads and KV heads per rank must be divisible by the degree)
    context_parallel_method: str = "ring"
    # compute dtype (--dtype): auto (bfloat16 on CUDA and on CPUs with native bf16, else float32) | float32 |
    # bfloat16; the parameters (master weights) and optimizer state stay fp32
    mixed_precision_param: str = "auto"
    mixed_precision_reduce: str = "float32"


@dataclass
class MoESection:
    """Mixture-of-Experts training (ignored for dense models); see ``train/moe.py`` for the formulas."""

    load_balance: str = "aux_loss"  # aux_loss (Switch/GShard loss) | bias (DeepSeek-V3 aux-loss-free)
    router_aux_loss_coef: float | None = None  # None: the model's router_aux_loss_coef (aux_loss), 0 (bias)
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss weight; 0 = off
    bias_update_rate: float = 1e-3  # bias: per-step selection-bias change (DeepSeek-V3's gamma)


@dataclass
class LoRASection:
    """LoRA fine-tuning (``train/lora.py``): the base frozen, adapters of ``rank`` on ``targets`` trained."""

    rank: int | None = None  # None = full fine-tuning; >= 1: LoRA of this rank (PEFT's r)
    alpha: float = 8.0  # scaling = alpha / rank (PEFT's lora_alpha, default 8)
    dropout: float = 0.0  # dropout on the adapter's input (PEFT's lora_dropout)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # module names (PEFT's target_modules)
    use_rslora: bool = False  # rsLoRA: scaling = alpha / sqrt(rank)
    merge: bool = False  # also write <output>/hf: the base with the adapter merged in


# checkpoint.async_mode's choices (torchtitan's names; baige/runtime/train/checkpoint.py says what each does)
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


@dataclass
class CheckpointSection:
    interval: int = 500  # steps between DCP checkpoints (0 = only at the end)
    keep_latest: int = 2  # complete checkpoints kept (0 = all)
    resume: str = "auto"  # auto (newest complete step, fresh start if none) | none | PATH to a step dir
    # disabled (write on the critical path) | async (stage a host copy, write in the background) |
    # async_with_pinned_mem (also stage in the background, into reused, page-locked on CUDA, host buffers)
    async_mode: str = "disabled"
    export_hf: bool = True  # write an HF directory (output/hf) at the end
    export_dtype: str = "auto"  # auto (the model config's torch_dtype) | float32 | bfloat16 | float16


@dataclass
class MetricsSection:
    log_every: int = 10  # steps
    tensorboard: bool = True  # when the tensorboard package is installed
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = table (CUDA) or measured matmul rate (CPU)


@dataclass
class TrainConfig:
    """Resolved configuration of ``baige train`` (saved as ``config.toml`` beside every checkpoint)."""

    output: str = "runs/train"
    # sft / pretrain: next-token training (the data decides which tokens carry loss); grpo: RL (the rl section)
    method: str = "sft"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    moe: MoESection = field(default_factory=MoESection)
    lora: LoRASection = field(default_factory=LoRASection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    rl: RLSection = field(default_factory=RLSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The config as TOML text (the inverse of :func:`load_train_config`)."""
        top, sections = [], []
        for key, value in self.to_dict().items():
            if isinstance(value, dict):
                lines = [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
                sections.append(f"[{key}]\n" + "\n".join(lines))
            elif value is not None:
                top.append(f"{key} = {_toml_value(value)}")
        return "\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _coerce(where: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field's type; ints become floats for float fields. Raises BaigeError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(where, value, option)
            except BaigeError:
                pass
        raise BaigeError(f"config {where}: {value!r} is not a {annotation}")
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise BaigeError(f"config {where}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_coerce(where, v, item) for v in value]
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if annotation is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, annotation) and not (annotation is int and isinstance(value, bool)):
        return value
    raise BaigeError(f"config {where}: expected {annotation.__name__}, got {value!r}")


def _set(cfg: TrainConfig, dotted: str, value: Any) -> None:
    """Assign ``section.field`` (or a top-level field). Raises BaigeError for unknown names or bad types."""
    parts = dotted.split(".")
    target: Any = cfg
    for part in parts[:-1]:
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
            raise BaigeError(f"unknown config section {part!r} in {dotted!r}")
        target = getattr(target, part)
    fields = {f.name: f for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else {}
    name = parts[-1]
    if name in fields and dataclasses.is_dataclass(getattr(target, name)):
        first = dataclasses.fields(getattr(target, name))[0].name
        raise BaigeError(f"config {dotted!r} is a section, not a field: set its fields (e.g. {dotted}.{first}=...)")
    if name not in fields:
        raise BaigeError(f"unknown config field {dotted!r}")
    setattr(target, name, _coerce(dotted, value, typing.get_type_hints(type(target))[name]))


def parse_override(text: str) -> tuple[str, Any]:
    """``"training.steps=200"`` -> ``("training.steps", 200)``. Raises BaigeError without ``=``."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise BaigeError(f"--set {text!r}: expected section.field=value (e.g. training.steps=200)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word: a string
    return key.strip(), value


def load_train_config(
    path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> TrainConfig:
    """Resolve the config: defaults <- TOML file <- flags (dotted name -> value, None = not given) <- ``--set``.

    Raises:
        BaigeError: missing/invalid TOML file, unknown section or field, a value of the wrong type.
    """
    cfg = TrainConfig()
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise BaigeError(f"{path}: config file not found") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
            raise BaigeError(f"{path}: cannot read the config file as UTF-8 text ({type(e).__name__})") from None
        except tomllib.TOMLDecodeError as e:
            raise BaigeError(f"{path}: not valid TOML ({e})") from None
        for key, value in data.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    _set(cfg, f"{key}.{sub}", v)
            else:
                _set(cfg, key, value)
    for key, value in (flags or {}).items():
        if value is not None:
            _set(cfg, key, value)
    for text in overrides or []:
        _set(cfg, *parse_override(text))
    validate(cfg)
    return cfg


def _check_paths(cfg: TrainConfig) -> None:
    """Data files that are directories, and an output that cannot be a writable directory; a path the file
    system refuses (too long, ...). Raises BaigeError."""
    for split in ("train", "eval"):
        for name in getattr(cfg.data, split):
            try:
                is_dir = Path(name).is_dir()
            except OSError as e:
                raise BaigeError(f"data.{split} {name[:120]!r}: {e.strerror or type(e).__name__}") from None
            if is_dir:
                raise BaigeError(f"data.{split} {name!r} is a directory; give the files in it (repeat --data)")
    try:
        check_output_path("output", cfg.output, "dir")
    except OSError as e:
        raise BaigeError(f"output {str(cfg.output)[:120]!r}: {e.strerror or type(e).__name__}") from None


def _validate_moe(cfg: TrainConfig) -> None:
    """The moe section and the expert-parallel degree. Raises BaigeError naming the field."""
    m = cfg.moe
    if m.load_balance not in ("aux_loss", "bias"):
        raise BaigeError(f"moe.load_balance must be aux_loss or bias (got {m.load_balance!r})")
    if m.router_aux_loss_coef is not None:
        check_float("moe.router_aux_loss_coef", m.router_aux_loss_coef, 0.0)
    check_float("moe.router_z_loss_coef", m.router_z_loss_coef, 0.0)
    check_float("moe.bias_update_rate", m.bias_update_rate, 0.0)
    check_int("parallelism.expert_parallel_degree", cfg.parallelism.expert_parallel_degree, 1)


def _validate_lora(cfg: TrainConfig) -> None:
    """The lora section. Raises BaigeError naming the field."""
    lo = cfg.lora
    if lo.rank is None:
        if lo != LoRASection():
            raise BaigeError("lora options need lora.rank: pass --lora-rank R (or set lora.rank)")
        return
    check_int("lora.rank", lo.rank, 1)
    check_float("lora.alpha", lo.alpha, 0.0, low_open=True)
    check_float("lora.dropout", lo.dropout, 0.0, 1.0)
    if lo.dropout == 1.0:
        raise BaigeError("lora.dropout must be < 1 (got 1.0)")
    if not lo.targets:
        raise BaigeError("lora.targets is empty: name at least one module (e.g. q_proj,v_proj)")
    for t in lo.targets:
        if t not in LORA_TARGETS:
            raise BaigeError(f"lora.targets: unknown module {t!r} (one of {', '.join(LORA_TARGETS)})")
    if cfg.model.name is None and cfg.model.config is not None:
        raise BaigeError("lora.rank needs pretrained weights (--model), not a model trained from scratch")


METHODS = ("sft", "pretrain", "grpo")


def _validate_method(cfg: TrainConfig) -> None:
    """``method`` and, for grpo, the rl section and what GRPO does not compose with. Raises BaigeError."""
    if cfg.method not in METHODS:
        raise BaigeError(f"--method must be one of {', '.join(METHODS)} (got {cfg.method!r})")
    if cfg.method != "grpo":
        if cfg.rl != RLSection():
            raise BaigeError("rl options (--reward, --batch-invariant, rl.*) need --method grpo")
        return
    validate_rl(cfg.rl)
    p = cfg.parallelism
    for flag, degree in (
        ("--tp", p.tensor_parallel_degree),
        ("--pp", p.pipeline_parallel_degree),
        ("--ep", p.expert_parallel_degree),
    ):
        if degree != 1:
            raise BaigeError(f"--method grpo runs data-parallel (FSDP2 / HSDP) only: {flag} {degree} is not supported")
    if cfg.model.config is not None:
        raise BaigeError("--method grpo trains a pretrained policy: pass --model, not --model-config")
    if cfg.data.eval:
        raise BaigeError("--method grpo has no evaluation data: drop --eval-data (the reward is logged every step)")
    if cfg.rl.batch_invariant and cfg.lora.rank is not None:
        raise BaigeError("--batch-invariant does not compose with --lora-rank (its kernels take plain linear layers)")


def validate(cfg: TrainConfig) -> None:
    """Range and choice checks. Raises BaigeError naming the field."""
    _validate_method(cfg)
    t = cfg.training
    for name in ("steps", "seq_len", "batch_size", "grad_accum"):
        if getattr(t, name) < 1:
            raise BaigeError(f"training.{name} must be >= 1 (got {getattr(t, name)})")
    for where, value in (
        ("training.eval_every", t.eval_every),
        ("training.eval_batches", t.eval_batches),
        ("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps),
        ("checkpoint.interval", cfg.checkpoint.interval),
        ("checkpoint.keep_latest", cfg.checkpoint.keep_latest),
    ):
        if value < 0:
            raise BaigeError(f"{where} must be >= 0 (got {value})")
    check_int("training.seed", t.seed, *DATA_SEED_RANGE)  # torch.manual_seed and the data order's numpy seed
    o = cfg.optimizer
    for name in ("lr", "eps", "weight_decay"):
        check_float(f"optimizer.{name}", getattr(o, name), 0.0)
    check_float("training.max_norm", t.max_norm, 0.0)
    check_float("lr_scheduler.min_lr_ratio", cfg.lr_scheduler.min_lr_ratio, 0.0, 1.0)
    check_float("lr_scheduler.decay_ratio", cfg.lr_scheduler.decay_ratio, 0.0, 1.0)
    check_float("metrics.peak_tflops", cfg.metrics.peak_tflops, 0.0)
    for check in (_validate_moe, validate_pipeline, validate_context_parallel, _validate_lora, validate_mtp):
        check(cfg)
    ac = t.activation_checkpointing
    if ac not in ("none", "full") and not (ac.isdigit() and int(ac) >= 1):
        raise BaigeError(
            f"training.activation_checkpointing must be none, full or a block interval N >= 1 (got {ac!r})"
        )
    if o.name not in ("adamw", "muon"):
        raise BaigeError(f"optimizer.name must be adamw or muon (got {o.name!r})")
    check_float("optimizer.momentum", o.momentum, 0.0, 1.0)
    check_int("optimizer.ns_steps", o.ns_steps, 1, 99)
    if len(cfg.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optimizer.betas):  # nan fails too
        raise BaigeError(f"optimizer.betas must be two numbers in [0, 1) (got {cfg.optimizer.betas})")
    if t.compile not in (True, False, "auto"):
        raise BaigeError(f"training.compile must be auto, true or false (got {t.compile!r})")
    if cfg.optimizer.fused not in ("auto", "true", "false"):
        raise BaigeError(f"optimizer.fused must be auto, true or false (got {cfg.optimizer.fused!r})")
    if cfg.lr_scheduler.name not in ("cosine", "wsd", "constant"):
        raise BaigeError(f"lr_scheduler.name must be cosine, wsd or constant (got {cfg.lr_scheduler.name!r})")
    for name in ("mixed_precision_param", "mixed_precision_reduce"):
        if getattr(cfg.parallelism, name) not in ("auto", "float32", "bfloat16"):
            raise BaigeError(f"parallelism.{name} must be auto, float32 or bfloat16")
    if cfg.checkpoint.async_mode not in ASYNC_MODES:
        raise BaigeError(f"checkpoint.async_mode must be {', '.join(ASYNC_MODES)} (got {cfg.checkpoint.async_mode!r})")
    if cfg.checkpoint.export_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise BaigeError("checkpoint.export_dtype must be auto, float32, bfloat16 or float16")
    if cfg.model.name is not None and cfg.model.config is not None:
        raise BaigeError("give model.name (pretrained weights) or model.config (from scratch), not both")
    if not cfg.data.train:
        raise BaigeError("no training data: pass --data FILE (or data.train in the config)")
    if cfg.metrics.log_every < 1:
        raise BaigeError(f"metrics.log_every must be >= 1 (got {cfg.metrics.log_every})")
    _check_paths(cfg)
