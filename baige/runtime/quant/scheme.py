"""Weight-only quantization schemes and their math: formats, qparams, the clip search, int4 packing.

Formats (compressed-tensors, https://github.com/neuralmagic/compressed-tensors, the layout vLLM and
transformers load; ``linear.py`` holds :class:`QuantizedLinear`, ``format.py`` config.json):

- int8 ``int-quantized``: symmetric, one scale per output channel. Buffers ``weight`` int8 (out, in),
  ``weight_scale`` (out, 1).
- int4 ``pack-quantized``: group-wise along ``in_features`` (``group_size`` columns share a scale),
  symmetric or asymmetric. Buffers ``weight_packed`` int32 (out, ceil(in / 8)) -- eight 4-bit values
  per word, element ``j`` of a word in bits ``4j .. 4j+3`` (little end first), each stored as
  ``q + 8`` so it is unsigned; ``weight_scale`` (out, n_groups); ``weight_shape`` int64 ``[out, in]``;
  asymmetric adds ``weight_zero_point`` int32 (ceil(out / 8), n_groups), the signed zero points
  packed the same way along the output dimension.

Arithmetic (the compressed-tensors definitions): with ``qmin, qmax = -2**(b-1), 2**(b-1) - 1``,
``q = clamp(round(w / scale + zp), qmin, qmax)`` and ``w_hat = (q - zp) * scale``. Symmetric:
``scale = max|w| / ((qmax - qmin) / 2)``, ``zp = 0``. Asymmetric: ``scale = (max - min) / (qmax - qmin)``
with ``min <= 0 <= max`` (0 stays exact), ``zp = clamp(round(qmin - min / scale), qmin, qmax)``.

Clip search (``apply.quantize_model(clip_search=True)``; ``baige quantize --method int4`` uses it when given
calibration text): the extremes above are the minmax choice. :func:`search_qparams` instead tries
the scaled range ``alpha * min``, ``alpha * max`` for each factor ``alpha`` of a grid (1 first,
then shrinking down to ``1 - maxshrink``, then widening up to ``1 + maxexpand``) -- and, when
asymmetric, that range's zero point and its two neighbours ``zp - 1``, ``zp + 1`` -- and keeps,
per group, the candidate with the smallest squared error ``sum_j c_j (w_j - w_hat_j)^2``, ``c_j``
the mean squared input activation of column ``j`` (``apply.input_sq_means``, the first token of each
calibration window left out) or 1 without calibration data (llama.cpp's quantizers and AWQ's clip
search do the same kind of search; llm-compressor calls it the ``mse`` observer). It changes only
which scale/zero point is stored; the formulas and layout are the ones above (every candidate zero
point is an integer in ``[qmin, qmax]``, so 0 stays exact), and ``alpha = 1`` with the range's own
zero point reproduces the minmax parameters. GPTQ (``gptq.py``) can run the same search on each
group's error-updated weights, weighted by the layer Hessian's diagonal.

An ``in_features`` that is not a multiple of ``group_size`` gets ``ceil(in / group_size)`` groups;
the last one is partial and its scale comes from its real columns only (zero padding changes
neither ``max|w|`` nor the 0-including ``min``/``max``). compressed-tensors' own initialiser lays
such layers out the same way, but its dequantizer (0.20) and vLLM's int4 kernels refuse them, so
``apply.quantize_model`` reports which layers have a partial group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baige.errors import BaigeError
from baige.kernels import expand_groups

ProgressFn = Callable[[int, int, str], None]  # (done, total, what)


@dataclass(frozen=True)
class QuantScheme:
    """One weight quantization scheme.

    ``group_size=None`` means one scale per output channel (the int8 scheme).
    ``actorder`` records that GPTQ processed columns in decreasing Hessian-diagonal order with
    groups fixed in the original column order (compressed-tensors ``actorder: "weight"``).
    """

    num_bits: int
    group_size: int | None
    symmetric: bool = True
    actorder: bool = False

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise BaigeError(f"unsupported weight bits {self.num_bits} (baige writes int4 and int8)")
        if self.num_bits == 8 and (self.group_size is not None or not self.symmetric):
            raise BaigeError("int8 is symmetric per output channel only")
        if self.group_size is not None and self.group_size <= 0:
            raise BaigeError(f"group size must be positive, got {self.group_size}")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    @property
    def format(self) -> str:
        """The compressed-tensors format name."""
        return "int-quantized" if self.num_bits == 8 else "pack-quantized"

    def n_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    def describe(self) -> str:
        grouping = "per-channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.num_bits} {grouping} {'sym' if self.symmetric else 'asym'}"


def compute_qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point from per-group extremes (formulas in the module docstring).

    Args:
        wmin, wmax: (...) per-group minimum and maximum of the weights, float.
    Returns:
        scale (...) in the input dtype, > 0; zero point (...) float holding integers in [qmin, qmax]
        (all zeros when symmetric).
    """
    wmin = torch.minimum(wmin, torch.zeros_like(wmin))
    wmax = torch.maximum(wmax, torch.zeros_like(wmax))
    qrange = scheme.qmax - scheme.qmin
    if scheme.symmetric:
        scale = torch.maximum(-wmin, wmax) / (qrange / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group: any scale is exact
        return scale, torch.zeros_like(scale)
    scale = (wmax - wmin) / qrange
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zp = torch.clamp(torch.round(scheme.qmin - wmin / scale), scheme.qmin, scheme.qmax)
    return scale, zp


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round to the integer grid: ``clamp(round(w / scale + zp), qmin, qmax)``; all args broadcast.

    Returns int8 of ``w``'s shape.
    """
    return torch.clamp(torch.round(w / scale + zp), scheme.qmin, scheme.qmax).to(torch.int8)


CLIP_GRID = 40  # shrink factors 1 - i / CLIP_GRID ...
CLIP_MAXSHRINK = 0.5  # ... for i < CLIP_MAXSHRINK * CLIP_GRID: 1.0, 0.975, ..., 0.525 (20 steps)
CLIP_MAXEXPAND = 0.1  # then widening factors 1 + i / CLIP_GRID up to 1 + CLIP_MAXEXPAND: 1.025 ... 1.1
ZP_OFFSETS = (0, -1, 1)  # asymmetric search: each range's own zero point, then its two neighbours
# how the search runs, as config.json's observer_kwargs and the report record it
CLIP_KWARGS = {
    "maxshrink": CLIP_MAXSHRINK,
    "maxexpand": CLIP_MAXEXPAND,
    "grid": CLIP_GRID,
    "norm": 2,
    "zero_point_offsets": list(ZP_OFFSETS),
}


def clip_factors(
    grid: int = CLIP_GRID, maxshrink: float = CLIP_MAXSHRINK, maxexpand: float = CLIP_MAXEXPAND
) -> list[float]:
    """The range factors of the clip search: 1.0 first, the shrink factors ``1 - i / grid`` for
    ``i = 1 .. round(maxshrink * grid) - 1`` (the grid of llm-compressor's ``mse`` observer, its
    ``grid`` and ``maxshrink`` arguments), then the widening factors ``1 + i / grid`` for
    ``i = 1 .. round(maxexpand * grid)`` (with the zero-point neighbours of :func:`search_qparams`
    they lowered held-out perplexity of the embedded model at int4 g128 asymmetric;
    docs/benchmarks/archive.md, "Quantization (perplexity)")."""
    n = max(1, round(maxshrink * grid))
    return [1.0 - i / grid for i in range(n)] + [1.0 + i / grid for i in range(1, round(maxexpand * grid) + 1)]


def search_qparams(
    grouped: torch.Tensor,
    scheme: QuantScheme,
    dtype: torch.dtype = torch.float32,
    col_weight: torch.Tensor | None = None,
    factors: list[float] | None = None,
    zp_offsets: tuple[int, ...] = ZP_OFFSETS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group clip search: the scale/zero point minimising the (weighted) squared rounding error.

    For each range factor ``alpha`` (default :func:`clip_factors`), the candidate parameters are
    :func:`compute_qparams` of ``alpha * min`` and ``alpha * max``, the scale rounded to ``dtype``
    as it would be stored; when asymmetric, each of ``zp + d`` for ``d`` in ``zp_offsets`` (clamped
    to ``[qmin, qmax]``, so always an integer and 0 stays exact) is a candidate with that scale.
    The error of a group is ``sum_j c_j (w_j - w_hat_j)^2`` with
    ``w_hat = (clamp(round(w / scale + zp)) - zp) * scale``. Each group keeps the first candidate
    with the smallest error, so the result is never worse than the minmax parameters (``alpha = 1``
    with offset 0, tried first). All groups at once; the loops run over the grid only. Zero padding
    of a partial group adds no error (0 is exact on every candidate grid).

    Why the zero-point neighbours: the levels are always the multiples of the scale (0 is exact),
    and the zero point only picks which ``qmax - qmin + 1`` consecutive multiples are representable.
    A shrunk range's own zero point clips both ends in proportion; a neighbour moves the window
    one step toward either end, so the clipping can fall on the side where it costs less. With
    the widening factors it lowered held-out perplexity of the embedded SmolLM2-135M at int4 g128
    asymmetric when ``c_j`` came from 64 or more calibration windows of 512 tokens. From 8 windows
    it fits the sample: worse than the shrink-only search on two seeds of three
    (docs/benchmarks/archive.md, "Quantization (perplexity)").

    Args:
        grouped: (out, n_groups, g) float32 weights, ``g`` columns per group (zero padded).
        scheme: the integer grid (qmin, qmax, symmetric).
        dtype: the dtype the scale is stored in.
        col_weight: (n_groups, g) non-negative per-column weights ``c_j`` (e.g. the mean squared
            input activation of each input column), or None for ``c_j = 1`` (weight-space error).
        factors: shrink factors to try (1.0 should be first).
    Returns:
        scale (out, n_groups) in ``dtype``; zero point (out, n_groups) float32 holding integers
        (zeros when symmetric).
    """
    wmin, wmax = grouped.amin(dim=2), grouped.amax(dim=2)  # (out, n_groups)
    best_scale = best_zp = best_err = None
    offsets = (0,) if scheme.symmetric else zp_offsets
    for alpha in factors or clip_factors():
        scale, zp0 = compute_qparams(alpha * wmin, alpha * wmax, scheme)
        scale = scale.to(dtype)
        s = scale.float()[..., None]  # (out, n_groups, 1)
        for d in offsets:
            zp = torch.clamp(zp0 + d, scheme.qmin, scheme.qmax)
            z = zp[..., None]
            w_hat = (quantize_with(grouped, s, z, scheme).float() - z) * s  # (out, n_groups, g)
            sq = (grouped - w_hat) ** 2
            err = (sq if col_weight is None else sq * col_weight).sum(dim=2)  # (out, n_groups)
            if best_err is None:
                best_scale, best_zp, best_err = scale, zp, err
            else:
                better = err < best_err  # strict: ties keep the earlier candidate (alpha = 1, offset 0 first)
                best_scale = torch.where(better, scale, best_scale)
                best_zp = torch.where(better, zp, best_zp)
                best_err = torch.where(better, err, best_err)
    return best_scale, best_zp


def quantize_weight(
    w: torch.Tensor, scheme: QuantScheme, clip_search: bool = False, col_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of a Linear weight.

    Args:
        w: (out, in) float weight.
        clip_search: choose each group's range by :func:`search_qparams` instead of its min/max.
        col_weight: (in,) non-negative weight of each input column's squared error in the clip
            search (None: plain weight-space error); ignored without ``clip_search``.
    Returns:
        q: (out, in) int8 in [qmin, qmax]; scale: (out, n_groups) in ``w.dtype``;
        zero point: (out, n_groups) int8, or None when symmetric.
    """
    out_f, in_f = w.shape
    wf = w.float()
    g = in_f if scheme.group_size is None else scheme.group_size  # per channel: one group of every column
    pad = scheme.n_groups(in_f) * g - in_f
    grouped = F.pad(wf, (0, pad)).view(out_f, -1, g)  # (out, n_groups, g); zero pad is neutral
    if clip_search:
        cw = None if col_weight is None else F.pad(col_weight.float(), (0, pad)).view(-1, g)  # (n_groups, g)
        scale, zp = search_qparams(grouped, scheme, w.dtype, cw)
    else:
        scale, zp = compute_qparams(grouped.amin(dim=2), grouped.amax(dim=2), scheme)  # (out, n_groups)
    scale = scale.to(w.dtype)  # round the stored scale first, so q is computed against it
    q = quantize_with(
        wf, expand_groups(scale.float(), scheme.group_size, in_f), expand_groups(zp, scheme.group_size, in_f), scheme
    )
    return q, scale, None if scheme.symmetric else zp.to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(rows, cols) int8 in [-8, 7] -> (rows, ceil(cols / 8)) int32, element j of a word in bits 4j..4j+3,
    stored as q + 8 (the compressed-tensors ``pack_to_int32`` layout for 4 bits)."""
    rows, cols = q.shape
    words = math.ceil(cols / 8)
    u = F.pad(q.to(torch.int64) + 8, (0, words * 8 - cols)).view(rows, words, 8)  # (rows, words, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    packed = (u << shifts).sum(dim=2)  # (rows, words) in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement into int32
    return packed.to(torch.int32)
