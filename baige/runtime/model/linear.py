"""Projections of the per-op inference path: a plain ``nn.Linear`` applied to a few rows on the CPU
without autograd runs :func:`baige.kernels.dense_linear` (the native kernels read each weight row once
for all rows, where PyTorch's bf16 linear at a few rows streams the weight at a third to a half of the
speed); everything else -- GPU tensors, training, more rows, quantized / LoRA / tensor-parallel modules,
modules with hooks -- calls the module as it is.

This is the path of the steps the one-call native decode step does not take (Mixture-of-Experts
models, interleaved RoPE, adapters it cannot run) and of small prefill chunks."""

from __future__ import annotations

import torch
from torch import nn

from baige import kernels


def _global_hooks() -> bool:
    """Whether any global module forward hook is registered (``nn.modules.module.register_module_forward_hook``)."""
    mm = nn.modules.module
    return bool(getattr(mm, "_global_forward_hooks", None) or getattr(mm, "_global_forward_pre_hooks", None))


def project(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` for x (..., in) -> (..., out); the native kernel when ``mod`` is exactly ``nn.Linear``
    without hooks (its own or global ones), x on the CPU in the weight's dtype, autograd off, at most
    ``kernels.FEW_ROWS[weight dtype]`` rows of x (same values up to fp32 summation order; bf16 rows are
    rounded once, as torch's bf16 linear). In batch-invariant mode (``kernels.batch_invariant``) such a module
    runs ``kernels.batch_invariant_linear`` for any rows, with or without autograd."""
    plain = type(mod) is nn.Linear and not (mod._forward_hooks or mod._forward_pre_hooks or _global_hooks())
    if plain and kernels.batch_invariant_enabled():
        return kernels.batch_invariant_linear(x, mod.weight, mod.bias)
    if plain and x.device.type == "cpu" and not torch.is_grad_enabled():
        w = mod.weight
        if x.dtype == w.dtype:  # more rows: few_rows_linear's F.linear, which is what the module computes
            return kernels.few_rows_linear(x.reshape(-1, x.shape[-1]), w, mod.bias).view(*x.shape[:-1], w.shape[0])
    return mod(x)
