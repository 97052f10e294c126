"""The kernels' settings, read from the environment once (not on every op call).

- ``BAIGE_KERNELS``: ``auto`` (default), ``reference`` or ``triton`` (see :mod:`baige.kernels`).
- ``TRITON_INTERPRET``: Triton's interpreter, which lets Triton kernels run on CPU tensors.
- ``BAIGE_CACHE``: the cache root (default ``~/.cache/baige``); the native CPU library is built
  under ``$BAIGE_CACHE/cpu_kernels``, models and token files under the same root.
- ``CC``: the C compiler for the native CPU kernels (default: ``cc``, else ``gcc`` on PATH).
- ``BAIGE_CPU_ISA``: the native CPU library's instruction-set variant (``auto``, the default: the best
  this CPU supports; see :mod:`baige.kernels.cpu.isa`).
- ``BAIGE_CPU_INT_DOT``: ``1`` (default) runs int8/int4 weight-only linears on CPU as integer dot
  products over int8-quantized activations (``baige/kernels/cpu/qdot.c``, llama.cpp's scheme);
  ``0`` keeps the exact dequantize-to-fp32 kernels (``qlinear.c``).
- ``BAIGE_CPU_INT_DOT_PASSES``: ``2`` (default) rounds each activation block to int8 and then its
  residual to a second int8 block, both dotted with the weights (about 16-bit activations; the
  perplexity of the exact kernels at twice the dot products); ``1``: one int8 block, llama.cpp's Q8_0
  activations (faster where compute-bound, less accurate). Validated by ``check_startup``.
- ``BAIGE_CPU_ONEDNN``: ``1`` (default) runs the CPU inference path's fp32 linears above the native
  kernels' few rows (prefill, the MoE experts' per-expert GEMMs) through oneDNN's matmul
  (``torch.ops.mkldnn._linear_pointwise``, see :func:`baige.kernels.dense_linear`); ``0`` keeps
  ``torch.nn.functional.linear`` (MKL's sgemm in PyTorch's CPU build).

Code that changes these variables at run time (tests, ``scripts/gpu_smoke.py``) calls
:func:`reload_settings` afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("auto", "reference", "triton")  # the values BAIGE_KERNELS takes


@dataclass(frozen=True)
class KernelSettings:
    mode: str  # BAIGE_KERNELS, "auto" when unset or empty (validated by baige.kernels.backend)
    triton_interpret: bool
    cache_dir: Path
    cc: str | None  # None: look on PATH
    cpu_isa: str  # BAIGE_CPU_ISA, "auto" when unset or empty (validated by baige.kernels.check_startup)
    cpu_int_dot: bool  # BAIGE_CPU_INT_DOT, on unless 0/false/off/no
    cpu_int_dot_passes: str  # BAIGE_CPU_INT_DOT_PASSES, "2" when unset or empty; see int_dot_passes()
    cpu_onednn: bool  # BAIGE_CPU_ONEDNN, on unless 0/false/off/no


def _read() -> KernelSettings:
    env = os.environ
    return KernelSettings(
        mode=env.get("BAIGE_KERNELS") or "auto",
        triton_interpret=env.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"),
        cache_dir=Path(env.get("BAIGE_CACHE") or Path.home() / ".cache" / "baige").expanduser(),
        cc=env.get("CC") or None,
        cpu_isa=env.get("BAIGE_CPU_ISA") or "auto",
        cpu_int_dot=env.get("BAIGE_CPU_INT_DOT", "1").strip().lower() not in ("0", "false", "off", "no"),
        cpu_int_dot_passes=env.get("BAIGE_CPU_INT_DOT_PASSES", "").strip() or "2",
        cpu_onednn=env.get("BAIGE_CPU_ONEDNN", "1").strip().lower() not in ("0", "false", "off", "no"),
    )


_current: list[KernelSettings] = [_read()]


def settings() -> KernelSettings:
    """The settings in force (a list read: cheap, and traceable by torch.compile)."""
    return _current[0]


def int_dot_passes() -> int:
    """The integer-dot kernels' activation passes (``BAIGE_CPU_INT_DOT_PASSES``: 1 or 2).

    Raises:
        ValueError: one line, when the variable holds anything else.
    """
    value = settings().cpu_int_dot_passes
    if value not in ("1", "2"):
        raise ValueError(f"BAIGE_CPU_INT_DOT_PASSES={value!r}: choose 1 (int8 activations) or 2 (int8 + residual)")
    return int(value)


def reload_settings() -> KernelSettings:
    """Re-read the environment (after a test or script changed it) and return the new settings."""
    _current[0] = _read()
    return _current[0]
