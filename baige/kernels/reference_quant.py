"""Weight-only quantization math in the compressed-tensors layouts (see ``baige.runtime.quant.scheme``):
int4 unpacking, group expansion, dequantization, and the pure-PyTorch twins of ``quantized_linear``
(the dequantizing one and the integer-dot one of the native CPU linears). Re-exported by
:mod:`baige.kernels.reference`; ``dequantize_weight``, ``expand_groups`` and ``unpack_int4`` are
shared with the runtime's quantizer through :mod:`baige.kernels`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baige.kernels.reference_int_dot import quantize_activation_blocks, quantize_activation_residual


def expand_groups(t: torch.Tensor, group_size: int | None, in_features: int) -> torch.Tensor:
    """(out, n_groups) -> (out, in_features): each group value repeated over its columns."""
    if group_size is None:
        return t.expand(-1, in_features)
    return t.repeat_interleave(group_size, dim=1)[:, :in_features]


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """(rows, words) int32, eight 4-bit values per word (element j in bits 4j..4j+3, stored as q + 8)
    -> (rows, cols) int8 in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    u = (packed.unsqueeze(-1) >> shifts) & 0xF  # (rows, words, 8); & drops the arithmetic-shift sign bits
    return (u.flatten(1)[:, :cols] - 8).to(torch.int8)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group_size: int | None
) -> torch.Tensor:
    """``(q - zp) * scale`` -> (out, in) weight in ``scale.dtype``. q: (out, in) int; scale, zp: (out, n_groups)."""
    in_f = q.shape[1]
    x = q.to(scale.dtype)
    if zero_point is not None:
        x = x - expand_groups(zero_point.to(scale.dtype), group_size, in_f)
    return x * expand_groups(scale, group_size, in_f)


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    q = qweight if qweight.dtype == torch.int8 else unpack_int4(qweight, x.shape[-1])
    return F.linear(x, dequantize_weight(q, scale, zero_point, group_size).to(x.dtype), bias)


def quantized_linear_int_dot(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
    passes: int = 2,
) -> torch.Tensor:
    """The math of the native integer-dot linears (``BAIGE_CPU_INT_DOT``): ``x`` replaced by its
    block-quantized value ``q * d`` (``passes=1``, :func:`quantize_activation_blocks`, always from fp32)
    or ``q * d + q2 * d2`` (``passes=2``, the default: :func:`quantize_activation_residual`), then
    ``F.linear`` with the dequantized weight, both in ``x.dtype`` (pass fp64 for an exact oracle; the
    two passes' products are summed in ``x.dtype``). Returns (..., out) in x's dtype.

    Raises:
        ValueError: ``passes`` is not 1 or 2.
    """
    if passes not in (1, 2):
        raise ValueError(f"integer-dot activation passes must be 1 or 2, got {passes!r}")
    k = x.shape[-1]
    if passes == 1:
        parts = [quantize_activation_blocks(x)]
    else:
        q, d, q2, d2 = quantize_activation_residual(x)
        parts = [(q, d), (q2, d2)]
    xd = sum(
        (q.to(x.dtype).unflatten(-1, (d.shape[-1], -1)) * d.to(x.dtype).unsqueeze(-1)).flatten(-2)[..., :k]
        for q, d in parts
    )
    w = qweight if qweight.dtype == torch.int8 else unpack_int4(qweight, k)
    return F.linear(xd, dequantize_weight(w, scale.to(x.dtype), zero_point, group_size), bias)
