"""Which implementation an op runs (:func:`backend`), from the kernel settings; see :mod:`baige.kernels`.

Kept apart from the package ``__init__`` so that op modules outside it (:mod:`baige.kernels.lora`)
dispatch the same way without importing the package that re-exports them.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from baige.kernels import reference
from baige.kernels.settings import BACKENDS, int_dot_passes, settings


class KernelConfigError(ValueError):
    """``BAIGE_KERNELS`` names no backend, or one that cannot run here (the CLI prints it as one line)."""


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _refuse(mode: str, on_cuda: bool) -> None:
    """Raise the KernelConfigError for a ``BAIGE_KERNELS`` that cannot run on tensors on CUDA
    (``on_cuda``) or on the CPU; nothing when it can."""
    if mode not in BACKENDS:
        raise KernelConfigError(f"BAIGE_KERNELS={mode!r} is not one of {', '.join(BACKENDS)}")
    if mode != "triton":
        return
    if not _triton_importable():
        raise KernelConfigError("BAIGE_KERNELS=triton but triton is not installed")
    if not on_cuda and not settings().triton_interpret:
        raise KernelConfigError("BAIGE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")


def backend(x: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"``: the implementation an op on ``x`` runs (see module docstring).

    Raises:
        KernelConfigError: ``BAIGE_KERNELS`` is not one of auto/reference/triton, or it asks for Triton
        where Triton cannot run (not installed; CPU tensors without ``TRITON_INTERPRET=1``).
    """
    mode = settings().mode
    if mode == "reference":
        return "reference"
    if mode == "auto":
        return "triton" if x.is_cuda and _triton_importable() else "reference"
    _refuse(mode, x.is_cuda)
    return "triton"


def check_startup() -> None:
    """What :func:`backend` would refuse at the first op, checked before any model loads (the CLI
    calls it first); a machine without CUDA has only CPU tensors. Also a ``BAIGE_CPU_ISA`` that is
    unknown or names a variant this CPU lacks (ops would otherwise quietly use the best one), and a
    ``BAIGE_CPU_INT_DOT_PASSES`` other than 1 or 2.

    Raises:
        KernelConfigError: one line, as :func:`backend` would raise it, or naming the missing CPU flags.
    """
    _refuse(settings().mode, torch.cuda.is_available())
    from baige.kernels.cpu import isa

    try:
        isa.resolve(settings().cpu_isa)
        int_dot_passes()
    except ValueError as e:
        raise KernelConfigError(str(e)) from None


_TRITON_MODULES: dict[str, object] = {}  # imported on first use; a plain dict read stays traceable by torch.compile


def impl_for(x: torch.Tensor, module: str):
    """The module holding the implementation for ``x``: :mod:`reference` or ``triton_ops.<module>``."""
    if backend(x) == "reference":
        return reference
    mod = _TRITON_MODULES.get(module)
    if mod is None:
        mod = _TRITON_MODULES[module] = importlib.import_module(f"baige.kernels.triton_ops.{module}")
    return mod


_CPU_OPS: list = []  # [baige.kernels.cpu.ops] once imported


def native_cpu(*tensors: torch.Tensor, caches: tuple[torch.Tensor, ...] = (), bf16: bool = False):
    """:mod:`baige.kernels.cpu.ops` when these tensors may run on the native CPU kernels (``auto``
    mode, fp32 CPU tensors -- or all bf16 with ``bf16`` -- needing no gradient, KV ``caches`` fp32,
    fp16 or bf16, not inside a ``torch.compile`` trace, the library built), else None (see
    :mod:`baige.kernels.cpu`). Called once per op: kept to a few attribute reads."""
    if tensors[0].device.type != "cpu":
        return None
    if not _CPU_OPS:
        from baige.kernels.cpu import native_allowed, ops

        _CPU_OPS.extend((ops, native_allowed))
    ops, native_allowed = _CPU_OPS
    return ops if native_allowed() and ops.usable(*tensors, caches=caches, bf16=bf16) else None
