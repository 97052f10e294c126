"""Which implementation an op runs (:func:`backend`), from the kernel settings; see :mod:`baige.kernels`.

Kept apart from the package ``__init__`` so that op modules outside it (:mod:`baige.kernels.lora`)
dispatch the same way without importing the package that re-exports them.
"""

from __future__ import annotations

import importlib.util

import torch

from baige.kernels.settings import BACKENDS, settings



class KernelConfigError(ValueError):
    """``BAIGE_KERNELS`` names no backend, or one that cannot run here (the CLI prints it as one line)."""


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend(x: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"``: the implementation an op on ``x`` runs (see module docstring).

    Raises:
        KernelConfigError: ``BAIGE_KERNELS`` is not one of auto/reference/triton, or it asks for Triton
        where Triton cannot run (not installed; CPU tensors without ``TRITON_INTERPRET=1``).
    """
    s = settings()
    mode = s.mode
    if mode == "reference":
        return "reference"
    if mode == "auto":
        return "triton" if x.is_cuda and _triton_importable() else "reference"
    if mode != "triton":
        raise KernelConfigError(f"BAIGE_KERNELS={mode!r} is not one of {', '.join(BACKENDS)}")
    if not _triton_importable():
        raise KernelConfigError("BAIGE_KERNELS=triton but triton is not installed")
    if not x.is_cuda and not s.triton_interpret:
        raise KernelConfigError("BAIGE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return "triton"


def check_startup() -> None:
    """What :func:`backend` would refuse at the first op, checked before any model loads (the CLI
    calls it first): an unknown ``BAIGE_KERNELS``, ``triton`` without Triton installed, or ``triton``
    on a machine without CUDA and without ``TRITON_INTERPRET=1`` (every tensor is then a CPU tensor).

    Raises:
        KernelConfigError: one line, as :func:`backend` would raise it.
    """
    s = settings()
    if s.mode not in BACKENDS:
        raise KernelConfigError(f"BAIGE_KERNELS={s.mode!r} is not one of {', '.join(BACKENDS)}")
    if s.mode == "triton" and not _triton_importable():
        raise KernelConfigError("BAIGE_KERNELS=triton but triton is not installed")
    if s.mode == "triton" and not s.triton_interpret and not torch.cuda.is_available():
        raise KernelConfigError("BAIGE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
