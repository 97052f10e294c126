"""Weight-only quantization: the integer formats, :class:`QuantizedLinear`, and the model transform.

Formats (compressed-tensors, https://github.com/neuralmagic/compressed-tensors, the layout vLLM and
transformers load; see ``quant_format.py`` for config.json and saving):

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

Clip search (``quantize_model(clip_search=True)``; ``baige quantize --method int4`` uses it when given
calibration text): the extremes above are the minmax choice. :func:`search_qparams` instead tries
the scaled range ``alpha * min``, ``alpha * max`` for each factor ``alpha`` of a grid (1 first,
then shrinking down to ``1 - maxshrink``, then widening up to ``1 + maxexpand``) -- and, when
asymmetric, that range's zero point and its two neighbours ``zp - 1``, ``zp + 1`` -- and keeps,
per group, the candidate with the smallest squared error ``sum_j c_j (w_j - w_hat_j)^2``, ``c_j``
the mean squared input activation of column ``j`` (:func:`input_sq_means`, the first token of each
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
:func:`quantize_model` reports which layers have a partial group.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.kernels.reference import dequantize_weight, expand_groups, unpack_int4

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
CLIP_KWARGS = {"maxshrink": CLIP_MAXSHRINK, "maxexpand": CLIP_MAXEXPAND, "grid": CLIP_GRID, "norm": 2,
               "zero_point_offsets": list(ZP_OFFSETS)}


def clip_factors(grid: int = CLIP_GRID, maxshrink: float = CLIP_MAXSHRINK, maxexpand: float = CLIP_MAXEXPAND) -> list[float]:
    """The range factors of the clip search: 1.0 first, the shrink factors ``1 - i / grid`` for
    ``i = 1 .. round(maxshrink * grid) - 1`` (the grid of llm-compressor's ``mse`` observer, its
    ``grid`` and ``maxshrink`` arguments), then the widening factors ``1 + i / grid`` for
    ``i = 1 .. round(maxexpand * grid)`` (with the zero-point neighbours of :func:`search_qparams`
    they lowered held-out perplexity of the embedded model at int4 g128 asymmetric; README)."""
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
    it fits the sample: worse than the shrink-only search on two seeds of three (README,
    Quantization).

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


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored as integers and dequantized inside ``forward``.

    Buffer names and layouts are compressed-tensors' (module docstring), so the module's state
    dict is the on-disk checkpoint. The bias stays a float Parameter, untouched.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        n_groups = scheme.n_groups(in_features)
        kw = dict(device=device)
        if scheme.num_bits == 8:
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, **kw))
        else:
            words = math.ceil(in_features / 8)
            self.register_buffer("weight_packed", torch.zeros(out_features, words, dtype=torch.int32, **kw))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, **kw))
        self.register_buffer("weight_scale", torch.ones(out_features, n_groups, dtype=dtype, **kw))
        if not scheme.symmetric:
            zp_rows = math.ceil(out_features / 8)
            self.register_buffer("weight_zero_point", torch.zeros(zp_rows, n_groups, dtype=torch.int32, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **kw)) if bias else None

    @classmethod
    def from_quantized(
        cls, linear: nn.Linear, scheme: QuantScheme, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
    ) -> "QuantizedLinear":
        """Wrap integer weights (from :func:`quantize_weight` or GPTQ) for ``linear``; reuses its bias Parameter."""
        m = cls(linear.in_features, linear.out_features, False, scheme, scale.dtype, device=q.device)
        if scheme.num_bits == 8:
            m.weight = q.contiguous()
        else:
            m.weight_packed = pack_int4(q)
        m.weight_scale = scale.contiguous()
        if zero_point is not None:
            m.weight_zero_point = pack_int4(zero_point.t()).t().contiguous()  # packed along out_features
        m.bias = linear.bias
        return m

    def int_weight(self) -> torch.Tensor:
        """(out, in) int8 quantized values."""
        if self.scheme.num_bits == 8:
            return self.weight
        return unpack_int4(self.weight_packed, self.in_features)

    def zero_point(self) -> torch.Tensor | None:
        """(out, n_groups) int8 zero points, or None when symmetric."""
        if self.scheme.symmetric:
            return None
        return unpack_int4(self.weight_zero_point.t(), self.out_features).t()

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) float weight in the scale's dtype."""
        return dequantize_weight(self.int_weight(), self.weight_scale, self.zero_point(), self.scheme.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out): ``F.linear`` with the dequantized weight."""
        qweight = self.weight if self.scheme.num_bits == 8 else self.weight_packed
        return kernels.quantized_linear(x, qweight, self.weight_scale, self.zero_point(), self.scheme.group_size, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"


def target_linears(model: nn.Module, ignore: list[str]) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` whose qualified name matches none of the ``ignore`` glob patterns
    (``fnmatch``, e.g. ``lm_head``, ``*.down_proj``, ``model.layers.0.*``), in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(fnmatch.fnmatchcase(name, p) for p in ignore)
    ]


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def layer_report(name: str, w: torch.Tensor, qlinear: QuantizedLinear) -> dict:
    """One report row: format, shape, relative Frobenius error ``||W - W_hat|| / ||W||`` (unitless)."""
    w_hat = qlinear.dequantized_weight().float()
    w = w.float()
    rel = (torch.linalg.vector_norm(w - w_hat) / torch.linalg.vector_norm(w).clamp_min(1e-30)).item()
    partial = qlinear.scheme.group_size is not None and w.shape[1] % qlinear.scheme.group_size != 0
    return {
        "name": name,
        "format": qlinear.scheme.format,
        "scheme": qlinear.scheme.describe(),
        "shape": list(w.shape),
        "relative_weight_error": rel,
        "partial_last_group": partial,
    }


@torch.no_grad()
def input_sq_means(
    model: nn.Module, names: list[str], calib_ids: torch.Tensor, batch_size: int = 8, skip_first: bool = False
) -> dict[str, torch.Tensor]:
    """Mean squared input of every input column of the named Linears over calibration windows.

    ``c_j = mean_t x_{t,j}^2`` over the ``n_samples * seq_len`` tokens (``seq_len - 1`` per window
    with ``skip_first``: position 0 of each window left out), from one forward of the (unquantized)
    model with causal attention. It is the diagonal of ``X^T X / n``, so
    ``sum_j c_j (w_j - w_hat_j)^2`` is the expected output error ``E[((w - w_hat) . x)^2]`` of a row
    when the input columns are treated as uncorrelated -- the weighting of the clip search.
    ``skip_first``: the first position is the attention sink. On SmolLM2-135M its MLP intermediate
    (``down_proj``'s input) has a few channels so large that counting this one token multiplies
    their mean square by up to 1151 (layer 11; 477 in layer 29; the attention and MLP input
    projections change by at most 1.4x), so it would set those channels' weights alone.

    Args:
        model: a :class:`Transformer` (``forward(input_ids, positions)``).
        calib_ids: (n_samples, seq_len) int64 token ids (``seq_len >= 2`` with ``skip_first``).
    Returns:
        name -> (in_features,) float32.
    """
    sums: dict[str, torch.Tensor] = {}
    count = 0
    first = 1 if skip_first else 0

    def hook(name: str):
        def fn(module: nn.Module, args: tuple) -> None:
            x = args[0][:, first:].float().reshape(-1, args[0].shape[-1])  # (tokens, in)
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
        return fn

    hooks = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    device = next(model.parameters()).device
    try:
        for i in range(0, len(calib_ids), batch_size):
            ids = calib_ids[i : i + batch_size].to(device)  # (b, T)
            model(ids, torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1))
            count += ids.shape[0] * (ids.shape[1] - first)
    finally:
        for h in hooks:
            h.remove()
    return {n: sums[n] / count for n in names}


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    scheme: QuantScheme,
    ignore: list[str] | None = None,
    method: str = "rtn",
    calib_ids: torch.Tensor | None = None,
    progress: ProgressFn | None = None,
    clip_search: bool = False,
    **gptq_kwargs,
) -> list[dict]:
    """Swap every targeted ``nn.Linear`` of ``model`` for a :class:`QuantizedLinear`, in place.

    Args:
        scheme: the weight scheme; ``method="gptq"`` needs a 4-bit scheme.
        ignore: glob patterns of Linear names to keep in full precision (default ``["lm_head"]``).
        method: ``rtn`` (round to nearest) or ``gptq`` (Frantar et al. 2022, arXiv:2210.17323; see gptq.py).
        calib_ids: (n_samples, seq_len) int64 calibration tokens: GPTQ's, and the RTN clip search's
            activation weighting (:func:`input_sq_means`).
        progress: called as ``progress(done, total, layer_name)`` after each layer.
        clip_search: RTN: each group's range from :func:`search_qparams` instead of its min/max
            (compressed-tensors' ``minmax`` observer), the squared error weighted per input column by
            the mean squared activation over ``calib_ids`` when given, else unweighted. Measured on
            SmolLM2-135M int4 g128 (README): weighted lowers wikitext perplexity, unweighted raises it.
            GPTQ: the same search at the point GPTQ fixes each group's parameters, weighted by the
            layer Hessian's diagonal (:func:`gptq.gptq_quantize_weight`).
        gptq_kwargs: ``percdamp``, ``block_size``, ``batch_size``, ``sink_weight``, ``down_percdamp`` for :func:`gptq.gptq_quantize_model`.
    Returns:
        the per-layer report rows (:func:`layer_report`).
    Raises:
        BaigeError: nothing to quantize; a tied lm_head left unignored; unknown method; GPTQ without
        calibration data or with an 8-bit scheme.
    """
    ignore = ["lm_head"] if ignore is None else list(ignore)
    targets = target_linears(model, ignore)
    if not targets:
        raise BaigeError(f"no Linear layer left to quantize after ignoring {ignore}")
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    for name, m in targets:
        if embed is not None and m.weight is embed.weight:
            raise BaigeError(f"{name} shares its weight with the embeddings (tied); add it to the ignore patterns")
    if method == "rtn":
        col_weights = {}
        if clip_search and calib_ids is not None:
            col_weights = input_sq_means(model, [n for n, _ in targets], calib_ids, skip_first=True)
        report = []
        for i, (name, linear) in enumerate(targets):
            q, scale, zp = quantize_weight(linear.weight, scheme, clip_search, col_weights.get(name))
            qlinear = QuantizedLinear.from_quantized(linear, scheme, q, scale, zp)
            report.append(layer_report(name, linear.weight, qlinear))
            set_submodule(model, name, qlinear)
            if progress:
                progress(i + 1, len(targets), name)
        return report
    if method == "gptq":
        if scheme.num_bits != 4:
            raise BaigeError("GPTQ writes the int4 layout; use a 4-bit scheme")
        if calib_ids is None:
            raise BaigeError("GPTQ needs calibration data (--calib-data)")
        from baige.runtime.gptq import gptq_quantize_model

        names = [n for n, _ in targets]
        return gptq_quantize_model(
            model, scheme, names, calib_ids, progress=progress, clip_search=clip_search, **gptq_kwargs
        )
    raise BaigeError(f"unknown quantization method {method!r} (choose rtn, gptq)")
