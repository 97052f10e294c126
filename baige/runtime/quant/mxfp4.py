"""MXFP4 (OCP Microscaling FP4) weights, as the published gpt-oss checkpoints store their experts.

Format (OCP Microscaling Formats (MX) Specification v1.0, sections 5.2 (E8M0) and 5.3.3 (FP4 E2M1)):
a block of 32 consecutive elements along the reduction dimension shares one scale ``X``; element ``i``
is ``X * P_i``.

- ``P_i``: FP4 E2M1, 4 bits ``s e1 e0 m``: sign ``s``, a 2-bit exponent with bias 1, a 1-bit mantissa;
  exponent 0 is subnormal (``0.5 * m``). The 16 codes decode to +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}
  (:data:`E2M1_VALUES`, code order). No infinity or NaN.
- ``X``: E8M0, an unsigned 8-bit exponent ``x`` with bias 127, ``X = 2 ** (x - 127)``; ``x = 255``
  encodes NaN.

Packing in the published gpt-oss checkpoints (OpenAI's gpt-oss reference and transformers'
``integrations/mxfp4.py`` read it the same way): a weight of ``R`` output rows and ``K`` inputs is
stored as ``*_blocks`` uint8 ``(..., R, K / 32, 16)`` -- byte ``j`` of a block holds element ``2 j``
in its low nibble and element ``2 j + 1`` in its high nibble -- and ``*_scales`` uint8 ``(..., R,
K / 32)``, one E8M0 exponent per block.
"""

from __future__ import annotations

import torch

from baige.errors import BaigeError

BLOCK = 32  # elements per shared scale (the MX block size)
E8M0_BIAS = 127
E8M0_NAN = 255


def _e2m1(code: int) -> float:
    """The value of a 4-bit E2M1 code (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 0b1
    magnitude = 0.5 * man if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return sign * magnitude


E2M1_VALUES = tuple(_e2m1(c) for c in range(16))  # 0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, ..., -6


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, where: str = "mxfp4"
) -> torch.Tensor:
    """Decode MXFP4 blocks into floats (module docstring for the layout).

    Args:
        blocks: (..., G, 16) uint8, two E2M1 codes per byte (low nibble first).
        scales: (..., G) uint8 E8M0 exponents, one per 32 elements.
        dtype: the result's dtype; every MXFP4 value is exact in fp32 and bf16 (one mantissa bit,
            exponents within their range), fp16 rounds or overflows values past its range.
        where: names the tensor in errors.
    Returns:
        (..., G * 32) ``dtype``: element ``32 g + i`` of a row is block ``g``'s element ``i``. Meta
        tensors give a meta result of the same shape (shape checks before any data is read).
    Raises:
        BaigeError: naming ``where``: blocks or scales not uint8, shapes that do not pair
        (blocks' last dim 16, leading dims equal), or a scale of 255 (E8M0 NaN).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise BaigeError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise BaigeError(
            f"{where}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            f"(blocks (..., G, {BLOCK // 2}), scales (..., G))"
        )
    shape = (*scales.shape[:-1], scales.shape[-1] * BLOCK)
    if blocks.is_meta or scales.is_meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    if bool((scales == E8M0_NAN).any()):
        raise BaigeError(f"{where}: an MXFP4 scale is 255, which E8M0 reserves for NaN")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(shape, dtype=dtype, device=blocks.device)
    flat_b = blocks.reshape(-1, *blocks.shape[-2:])  # (N, G, 16)
    flat_s = scales.reshape(-1, scales.shape[-1])  # (N, G)
    flat_o = out.view(-1, shape[-1])  # (N, G * 32)
    rows = max(1, 2**22 // max(1, shape[-1]))  # a few million values of fp32 temporaries at a time
    for r0 in range(0, flat_b.shape[0], rows):
        b, s = flat_b[r0 : r0 + rows], flat_s[r0 : r0 + rows]
        lo, hi = lut[(b & 0x0F).long()], lut[(b >> 4).long()]  # (n, G, 16) elements 2j and 2j + 1
        vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # (n, G, 32)
        vals = torch.ldexp(vals, (s.to(torch.int32) - E8M0_BIAS)[..., None].float())  # * 2 ** (x - 127)
        flat_o[r0 : r0 + rows] = vals.flatten(-2).to(dtype)
    return out
