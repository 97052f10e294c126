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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.model.lora import is_linear, lora_scaling, peft_key
from baige.runtime.weights.safetensors_io import atomic_dir

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


def _read_config(path: Path) -> dict:
    if not (path / CONFIG_FILE).is_file():
        raise BaigeError(f"{path}: not a PEFT adapter directory (no {CONFIG_FILE})")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaigeError(f"{path / CONFIG_FILE}: not valid JSON ({e})") from None
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
    if not (path / WEIGHTS_FILE).is_file():
        raise BaigeError(f"{path}: no {WEIGHTS_FILE} (only safetensors adapters are read)")
    return cfg


def _targets(cfg: dict, path: Path) -> list[str]:
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise BaigeError(f"{path}: target_modules as a regex ({targets!r}) is not supported; list the names")
    if not isinstance(targets, list) or not targets:
        raise BaigeError(f"{path}: target_modules must be a non-empty list of module names")
    return targets


def load_peft_adapter(path: str | Path, model: nn.Module, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read a PEFT LoRA adapter for ``model`` (a baige Transformer) and check it fits, tensors in ``dtype``.

    Raises:
        BaigeError (one line naming the mismatch): not an adapter directory, not LoRA, DoRA,
        ``fan_in_fan_out``, trained biases or ``modules_to_save``, a target module the model does not have, a tensor
        for a module that is not
        a linear of the model, a rank that differs from the config's ``r`` / ``rank_pattern``, in/out
        features that differ from the model's (an adapter trained on another base model).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = _read_config(path)
    base = cfg.get("base_model_name_or_path")
    linears = {n: m for n, m in model.named_modules() if is_linear(m)}
    present = {n.rpartition(".")[2] for n in linears}
    for t in _targets(cfg, path):
        if t not in present:
            raise BaigeError(
                f"{path}: target module {t!r} is not in this {model.config.model_type} model "
                f"(adapter made for {base!r}?)"
            )
    tensors = load_file(str(path / WEIGHTS_FILE))
    for k in tensors:
        if not (k.startswith(_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise BaigeError(f"{path}: tensor {k!r} is not a LoRA weight (base_model.model.<module>.lora_A/B.weight)")
    names = sorted({k[len(_PREFIX) :].rsplit(".lora_", 1)[0] for k in tensors})
    modules = {}
    for name in names:
        a, b = tensors.get(peft_key(name, "A")), tensors.get(peft_key(name, "B"))
        if name not in linears or a is None or b is None:
            raise BaigeError(
                f"{path}: tensors for {name!r}, which is not a linear of this model "
                f"or lacks lora_A/lora_B (adapter made for {base!r}?)"
            )
        short = name.rpartition(".")[2]
        r = int(cfg.get("rank_pattern", {}).get(short, cfg.get("r", 8)))
        alpha = float(cfg.get("alpha_pattern", {}).get(short, cfg.get("lora_alpha", 8)))
        m = linears[name]
        if a.shape != (r, m.in_features) or b.shape != (m.out_features, r):
            raise BaigeError(
                f"{path}: {name} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank {r} "
                f"on a {m.in_features} -> {m.out_features} linear (adapter made for {base!r}?)"
            )
        modules[name] = (a.to(dtype), b.to(dtype), lora_scaling(r, alpha, bool(cfg.get("use_rslora", False))))
    if not modules:
        raise BaigeError(f"{path}: {WEIGHTS_FILE} holds no lora_A/lora_B tensor")
    return LoRAAdapter(path, max(a.shape[0] for a, _, _ in modules.values()), modules)
