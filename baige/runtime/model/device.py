"""Where the model lives and in which dtype: ``--device`` and ``--dtype`` resolution."""

from __future__ import annotations

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None, cfg: ModelConfig) -> torch.dtype:
    """``auto``/None -> the checkpoint's ``torch_dtype`` (fp32 if unknown); else the named dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return DTYPES.get(cfg.torch_dtype.replace("torch.", ""), torch.float32)
    if name not in DTYPES:
        raise BaigeError(f"unknown dtype {name!r} (choose auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises BaigeError for cuda without a GPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BaigeError("--device cuda was asked for but no CUDA GPU is available")
    if not name.startswith(("cpu", "cuda")):
        raise BaigeError(f"unknown device {name!r} (choose auto, cpu, cuda)")
    return torch.device(name)
