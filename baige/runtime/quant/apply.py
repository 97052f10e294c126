"""The model transform: swap every targeted ``nn.Linear`` for a :class:`QuantizedLinear`, by
round-to-nearest (with the optional clip search) or GPTQ."""

from __future__ import annotations

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.quant.gptq import gptq_quantize_model
from baige.runtime.quant.linear import QuantizedLinear, layer_report, set_submodule, target_linears
from baige.runtime.quant.scheme import ProgressFn, QuantScheme, quantize_weight


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
        names = [n for n, _ in targets]
        return gptq_quantize_model(
            model, scheme, names, calib_ids, progress=progress, clip_search=clip_search, **gptq_kwargs
        )
    raise BaigeError(f"unknown quantization method {method!r} (choose rtn, gptq)")
