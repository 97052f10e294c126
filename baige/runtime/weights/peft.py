"""PEFT-format LoRA adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``.

The layout ``peft.PeftModel.from_pretrained`` reads (PEFT's ``save_pretrained`` of a LoRA model):
keys ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r), module
names as in the HF checkpoint (``model.layers.0.self_attn.q_proj``); the config's ``r``,
``lora_alpha``, ``target_modules``, ``use_rslora`` (and the optional per-module ``rank_pattern`` /
``alpha_pattern``) give each module's rank and scaling. Only safetensors are read (never
``adapter_model.bin``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.model.config_checks import read_json
from baige.runtime.model.lora import is_linear, lora_scaling, peft_key
from baige.runtime.weights.safetensors_io import atomic_dir
from baige.runtime.weights.validate import read_safetensors_header

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def adapter_config(
    rank: int, alpha: float, dropout: float, targets: list[str], use_rslora: bool, base_model: str | None
) -> dict:
    """The ``adapter_config.json`` of a LoRA adapter for a causal LM (PEFT's ``LoraConfig`` fields)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_adapter(
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]], config: dict, out_dir: Path, dtype: torch.dtype
) -> Path:
    """Write an adapter directory: ``weights`` maps a module name to its ``(lora_A.weight (r, in),
    lora_B.weight (out, r))``, saved in ``dtype``. Written under a temporary name, then renamed; an
    existing ``out_dir`` is replaced.

    Raises:
        BaigeError: the parent directory cannot be created.
    """
    from safetensors.torch import save_file

    tensors = {}
    for name, (a, b) in weights.items():
        tensors[peft_key(name, "A")] = a.detach().to("cpu", dtype).contiguous()
        tensors[peft_key(name, "B")] = b.detach().to("cpu", dtype).contiguous()
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, "adapter directory") as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out_dir


@dataclass
class LoRAAdapter:
    """One adapter read from disk: per adapted module name, ``(A (r, in), B (out, r), scaling)``."""

    path: Path
    rank: int  # the largest rank of its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_RANK = 2**16


def _read_config(path: Path) -> dict:
    """``adapter_config.json`` read and checked (:func:`_check_config`), and the weights file present.
    A pickle-only adapter is refused, never unpickled. Raises BaigeError naming the file."""
    if not (path / CONFIG_FILE).is_file():
        raise BaigeError(f"{path}: not a PEFT adapter directory (no {CONFIG_FILE})")
    cfg = read_json(path / CONFIG_FILE)
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise BaigeError(f"{path}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else None!r} is not LORA")
    for field, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(field) == bad:
            raise BaigeError(f"{path}: {field}=true adapters are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise BaigeError(
            f"{path}: adapters that also train biases or whole modules (bias={cfg.get('bias')!r}, "
            f"modules_to_save={cfg.get('modules_to_save')!r}) are not supported"
        )
    _check_config(cfg, path / CONFIG_FILE)
    if not (path / WEIGHTS_FILE).is_file():
        pickles = [f for f in PICKLE_FILES if (path / f).is_file()]
        if pickles:
            raise BaigeError(
                f"{path / pickles[0]}: a pickle adapter is refused (baige never unpickles: it can run code); "
                f"save it as {WEIGHTS_FILE}"
            )
        raise BaigeError(f"{path}: no {WEIGHTS_FILE} (only safetensors adapters are read)")
    return cfg


def _check_config(cfg: dict, where: Path) -> None:
    """``r`` and ``rank_pattern``'s values integers in [1, 2**16], ``lora_alpha`` and ``alpha_pattern``'s
    values finite numbers, ``use_rslora`` a boolean. Raises BaigeError naming ``where`` and the field."""

    def rank_ok(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_RANK

    def alpha_ok(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for field, ok, pattern, requirement in (
        ("r", rank_ok, "rank_pattern", f"an integer in [1, {MAX_RANK}]"),
        ("lora_alpha", alpha_ok, "alpha_pattern", "a finite number"),
    ):
        if field in cfg and not ok(cfg[field]):
            raise BaigeError(f"{where}: {field} must be {requirement}, got {str(cfg[field])[:60]}")
        values = cfg.get(pattern) or {}
        if not isinstance(values, dict) or not all(isinstance(k, str) and ok(v) for k, v in values.items()):
            raise BaigeError(f"{where}: {pattern} must map module names to {requirement.removeprefix('a ')}s")
    if cfg.get("use_rslora") is not None and not isinstance(cfg["use_rslora"], bool):
        raise BaigeError(f"{where}: use_rslora must be true or false, got {str(cfg['use_rslora'])[:60]}")


def declared_ranks(cfg: dict) -> list[int]:
    """The ranks an adapter config declares: ``r`` (default 8) and every ``rank_pattern`` value."""
    return [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]


def _targets(cfg: dict, path: Path) -> list[str]:
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise BaigeError(f"{path}: target_modules as a regex ({targets[:60]!r}) is not supported; list the names")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise BaigeError(f"{path}: target_modules must be a non-empty list of module names")
    return targets


def load_peft_adapter(
    path: str | Path, model: nn.Module, dtype: torch.dtype = torch.float32, max_rank: int | None = None
) -> LoRAAdapter:
    """Read a PEFT LoRA adapter for ``model`` (a baige Transformer) and check it fits, tensors in ``dtype``.

    Everything is checked before a tensor is read: the config's fields, the ranks it declares against
    ``max_rank`` (``--max-lora-rank``), the safetensors header
    (:func:`~baige.runtime.weights.validate.read_safetensors_header`) and every tensor's name and shape
    against the model. A pickle-only adapter (``adapter_model.bin``) is refused, never unpickled.

    Raises:
        BaigeError (one line naming the file and the mismatch): not an adapter directory, not LoRA, DoRA,
        ``fan_in_fan_out``, trained biases or ``modules_to_save``, a bad config field, a rank past
        ``max_rank``, a pickle-only adapter, a bad header, a target module the model does not have, a
        tensor for a module that is not a linear of the model, a rank that differs from the config's ``r`` /
        ``rank_pattern``, in/out features that differ from the model's (an adapter trained on another base
        model).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = _read_config(path)
    if max_rank is not None and max(declared_ranks(cfg)) > max_rank:
        raise BaigeError(
            f"{path / CONFIG_FILE}: rank {max(declared_ranks(cfg))} exceeds --max-lora-rank {max_rank}",
            param="lora_path",
        )
    base = cfg.get("base_model_name_or_path")
    linears = {n: m for n, m in model.named_modules() if is_linear(m)}
    present = {n.rpartition(".")[2] for n in linears}
    for t in _targets(cfg, path):
        if t not in present:
            raise BaigeError(
                f"{path}: target module {t!r} is not in this {model.config.model_type} model "
                f"(adapter made for {base!r}?)"
            )
    header = read_safetensors_header(path / WEIGHTS_FILE)
    shapes = _check_tensors(header, cfg, linears, path, base)
    tensors = load_file(str(path / WEIGHTS_FILE))
    modules = {}
    for name, scaling in shapes.items():
        a, b = tensors[peft_key(name, "A")], tensors[peft_key(name, "B")]
        modules[name] = (a.to(dtype), b.to(dtype), scaling)
    return LoRAAdapter(path, max(a.shape[0] for a, _, _ in modules.values()), modules)


def _check_tensors(
    header: dict, cfg: dict, linears: dict[str, nn.Module], path: Path, base: object
) -> dict[str, float]:
    """The header's tensors against the model: only ``lora_A`` / ``lora_B`` weights of its linears,
    floating point, of the config's rank and the linear's features. Returns module -> scaling."""
    for k, info in header.items():
        if not (k.startswith(_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise BaigeError(f"{path}: tensor {k!r} is not a LoRA weight (base_model.model.<module>.lora_A/B.weight)")
        if not info.dtype.is_floating_point:
            raise BaigeError(f"{path}: tensor {k!r} is {str(info.dtype).removeprefix('torch.')}, not floating point")
    names = sorted({k[len(_PREFIX) :].rsplit(".lora_", 1)[0] for k in header})
    if not names:
        raise BaigeError(f"{path}: {WEIGHTS_FILE} holds no lora_A/lora_B tensor")
    scalings = {}
    for name in names:
        a, b = header.get(peft_key(name, "A")), header.get(peft_key(name, "B"))
        if name not in linears or a is None or b is None:
            raise BaigeError(
                f"{path}: tensors for {name!r}, which is not a linear of this model "
                f"or lacks lora_A/lora_B (adapter made for {base!r}?)"
            )
        short = name.rpartition(".")[2]
        r = (cfg.get("rank_pattern") or {}).get(short, cfg.get("r", 8))
        alpha = float((cfg.get("alpha_pattern") or {}).get(short, cfg.get("lora_alpha", 8)))
        m = linears[name]
        if a.shape != (r, m.in_features) or b.shape != (m.out_features, r):
            raise BaigeError(
                f"{path}: {name} lora_A {a.shape} / lora_B {b.shape} do not fit rank {r} "
                f"on a {m.in_features} -> {m.out_features} linear (adapter made for {base!r}?)"
            )
        scalings[name] = lora_scaling(r, alpha, bool(cfg.get("use_rslora", False)))
    return scalings
