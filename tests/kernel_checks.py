"""Shared checks for the Triton kernel tests (tests/test_kernels_*.py).

Pass rule (FlashAttention's): the Triton result's max error against an fp64 computation of the same
op is at most ``factor`` (2) times the max error of the PyTorch reference op run at the kernel's
precision, plus a small per-dtype floor (``FLOOR``) that covers ops where PyTorch happens to be exact
(elementwise fp32 ops can have zero reference error while a fused kernel reorders one rounding).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from baige.runtime.settings import reload_settings

# Absolute error floors per dtype, scaled by the magnitude of the exact result (max |exact|, at least 1).
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def triton_kernels(monkeypatch: pytest.MonkeyPatch):
    """Force the Triton path (interpreted on CPU) with NaN-filled output buffers."""
    from baige.kernels.triton_ops import common

    monkeypatch.setenv("BAIGE_KERNELS", "triton")
    reload_settings()
    monkeypatch.setattr(common, "FILL_NAN", True)
    yield


def assert_close_fp64(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, factor: float = 2.0, name: str = ""):
    """``max|out - exact| <= factor * max|ref - exact| + FLOOR[dtype] * max(1, max|exact|)``; no NaN anywhere."""
    assert out.shape == exact.shape, f"{name}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel's output (an element left unwritten?)"
    exact = exact.double()
    err = (out.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    scale = max(1.0, exact.abs().max().item())
    bound = factor * ref_err + FLOOR[out.dtype] * scale
    assert err <= bound, f"{name}: max error {err:.3g} > {factor} x reference error {ref_err:.3g} + floor ({bound:.3g})"


def rand(*shape, dtype, scale: float = 1.0, seed: int | None = None) -> torch.Tensor:
    """Normal random tensor on the test device (generated in fp32 so every dtype sees the same values)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values with a padded last-but-one stride (a view into a wider buffer)."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]
