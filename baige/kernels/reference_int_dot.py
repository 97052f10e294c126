"""Reference math of the integer-dot CPU linears (``baige/kernels/cpu/qdot.c``): activation blocks
and their residual pass. Re-exported by :mod:`baige.kernels.reference`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACT_BLOCK = 32  # columns per activation block of the integer-dot linears (llama.cpp's QK8_0)


def quantize_activation_blocks(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-block symmetric int8 quantization of activations, as ``baige/kernels/cpu/qdot.c``
    does it (bit-identical: the same fp32 operations in the same order).

    Args:
        x: (..., K) any float dtype; quantized from its fp32 values.
    Returns:
        q: (..., nb * block) fp32 holding integers in [-127, 127] (zero past K), nb = ceil(K / block);
        d: (..., nb) fp32 block scales, ``d = max|x| / 127`` (fp32 division), ``q = rint(x * (1 / d))``
        rounded half to even, ``q = 0`` where ``d = 0``. Source: llama.cpp's ``quantize_row_q8_0``.
    """
    xf = x.float()
    k = xf.shape[-1]
    nb = -(-k // block)
    xf = F.pad(xf, (0, nb * block - k)).unflatten(-1, (nb, block))
    d = xf.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(xf * inv.unsqueeze(-1))
    return q.flatten(-2), d


def quantize_activation_residual(
    x: torch.Tensor, block: int = ACT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-pass activations of ``qdot.c`` (``BAIGE_CPU_INT_DOT_PASSES=2``): x rounded to int8 blocks
    (:func:`quantize_activation_blocks`), then the residual ``r = x - q * d`` (fp32 product, then fp32
    difference: no FMA, as the C code) rounded to its own int8 blocks the same way.

    Args:
        x: (..., K) any float dtype; quantized from its fp32 values.
    Returns:
        ``(q, d, q2, d2)``: the first pass and the residual's, each as :func:`quantize_activation_blocks`
        returns them (bit-identical to the kernel's). ``|x - q d - q2 d2| <= d2 / 2 <= amax / 64516`` per block.
    """
    q, d = quantize_activation_blocks(x, block)
    k = x.shape[-1]
    nb = d.shape[-1]
    xb = F.pad(x.float(), (0, nb * block - k)).unflatten(-1, (nb, block))
    resid = xb - q.unflatten(-1, (nb, block)) * d.unsqueeze(-1)  # fp32 product, then fp32 difference
    q2, d2 = quantize_activation_blocks(resid.flatten(-2), block)
    return q, d, q2, d2
