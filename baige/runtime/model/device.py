"""Where the model lives and in which dtype: ``--device`` and ``--dtype`` resolution."""

from __future__ import annotations

import torch

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.settings import settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(cfg: ModelConfig) -> torch.dtype:
    """The checkpoint's ``torch_dtype`` from config.json (fp32 when absent or not a float type)."""
    return DTYPES.get(cfg.torch_dtype.replace("torch.", ""), torch.float32)


def cpu_auto_dtype() -> torch.dtype:
    """What ``--dtype auto`` runs on the CPU: bf16 where the CPU computes it natively (AVX-512 BF16 or
    AMX-BF16: :func:`baige.kernels.cpu_has_native_bf16`), else fp32 (bf16 without those instructions
    is converted op by op and runs slower than fp32; fp16 has no CPU matmul path worth taking). vLLM's
    CPU backend makes the same choice. ``BAIGE_CPU_AUTO_DTYPE=float32|bfloat16`` overrides it
    (the test suite pins float32, so its assertions hold on every CPU).

    Raises:
        BaigeError: ``BAIGE_CPU_AUTO_DTYPE`` is none of auto, float32, bfloat16.
    """
    forced = settings().cpu_auto_dtype
    if forced not in ("auto", "float32", "bfloat16"):
        raise BaigeError(f"BAIGE_CPU_AUTO_DTYPE={forced!r}: choose auto, float32 or bfloat16")
    if forced != "auto":
        return DTYPES[forced]
    return torch.bfloat16 if kernels.cpu_has_native_bf16() else torch.float32


def resolve_dtype(name: str | torch.dtype | None, cfg: ModelConfig, device: torch.device | None = None) -> torch.dtype:
    """The dtype to run ``cfg``'s model in.

    ``auto``/None: on a CPU ``device``, :func:`cpu_auto_dtype` for every 16/32-bit checkpoint; on
    CUDA or with no device given (convert, quantize), the checkpoint's own dtype
    (:func:`checkpoint_dtype`). A name: that dtype. A ``torch.dtype``: itself.

    Raises:
        BaigeError: an unknown name.
    """
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        if device is not None and torch.device(device).type == "cpu":
            return cpu_auto_dtype()
        return checkpoint_dtype(cfg)
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


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: free GPU memory on CUDA, ``MemAvailable`` of /proc/meminfo on CPU.

    Raises:
        BaigeError: /proc/meminfo cannot be read or has no ``MemAvailable``.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise BaigeError("cannot read MemAvailable from /proc/meminfo; pass --kv-cache-memory")
