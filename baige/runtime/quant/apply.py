"""The model transform: swap every targeted ``nn.Linear`` for a :class:`QuantizedLinear`, by
round-to-nearest (with the optional clip search) or GPTQ."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.quant.experts import (
    ALWAYS_IGNORE,
    NO_TOKEN_FALLBACK,
    QuantizedExperts,
    published_name,
    restack_float_experts,
    unstack_experts,
)
from baige.runtime.quant.gptq import gptq_quantize_model
from baige.runtime.quant.linear import QuantizedLinear, layer_report, set_submodule, target_linears
from baige.runtime.quant.scheme import ProgressFn, QuantScheme, quantize_weight


def _routed_rows_hooks(model: nn.Module, rows: dict[str, torch.Tensor]) -> list:
    """Forward pre-hooks on every :class:`QuantizedExperts` that record, per expert ``{name}.{j}``,
    the indices of the (N, H) input rows routed to it (what its Linears' hooks then receive)."""

    def hook(name: str):
        def fn(module: QuantizedExperts, args: tuple) -> None:
            for j, r in enumerate(module.routed_rows(args[2])):
                rows[f"{name}.{j}"] = r

        return fn

    return [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, QuantizedExperts)]


@torch.no_grad()
def input_sq_means(
    model: nn.Module, names: list[str], calib_ids: torch.Tensor, batch_size: int = 8, skip_first: bool = False
) -> dict[str, torch.Tensor]:
    """Mean squared input of every input column of the named Linears over calibration windows.

    ``c_j = mean_t x_{t,j}^2`` over the tokens a Linear sees: the ``n_samples * seq_len`` tokens
    (``seq_len - 1`` per window with ``skip_first``: position 0 of each window left out), or for a
    routed expert's Linear (inside :class:`QuantizedExperts`) the tokens the router sent to that
    expert (position 0 left out the same way), from one forward of the (unquantized) model with
    causal attention. It is the diagonal of ``X^T X / n``, so
    ``sum_j c_j (w_j - w_hat_j)^2`` is the expected output error ``E[((w - w_hat) . x)^2]`` of a row
    when the input columns are treated as uncorrelated -- the weighting of the clip search.
    ``skip_first``: the first position is the attention sink. On SmolLM2-135M its MLP intermediate
    (``down_proj``'s input) has a few channels so large that counting this one token multiplies
    their mean square by orders of magnitude (the attention and MLP input projections barely change;
    docs/benchmarks/archive.md, "Quantization (perplexity)"), so it would set those channels' weights
    alone.

    Args:
        model: a :class:`Transformer` (``forward(input_ids, positions)``).
        calib_ids: (n_samples, seq_len) int64 token ids (``seq_len >= 2`` with ``skip_first``).
    Returns:
        name -> (in_features,) float32, for every named Linear that saw at least one counted token
        (an expert the router never chose is absent).
    """
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    rows: dict[str, torch.Tensor] = {}
    first, T = (1 if skip_first else 0), calib_ids.shape[1]

    def hook(name: str):
        def fn(module: nn.Module, args: tuple) -> None:
            a = args[0]
            if a.dim() == 3:  # (b, T, in)
                x = a[:, first:].reshape(-1, a.shape[-1])
            else:  # (rows, in): the flattened (b * T) tokens, or the tokens routed to one expert
                r = rows.get(name.rpartition(".")[0])
                r = torch.arange(a.shape[0], device=a.device) if r is None else r
                x = a[r % T >= first]
            x = x.float()  # (tokens, in)
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return fn

    hooks = _routed_rows_hooks(model, rows)
    hooks += [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    device = next(model.parameters()).device
    try:
        for i in range(0, len(calib_ids), batch_size):
            ids = calib_ids[i : i + batch_size].to(device)  # (b, T)
            model(ids, torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1))
    finally:
        for h in hooks:
            h.remove()
    return {n: sums[n] / counts[n] for n in names if counts.get(n)}


def _rtn(
    model: nn.Module,
    targets: list[tuple[str, nn.Linear]],
    scheme: QuantScheme,
    clip_search: bool,
    calib_ids: torch.Tensor | None,
    progress: ProgressFn | None,
) -> list[dict]:
    """Round-to-nearest of every target (see :func:`quantize_model`); returns the report rows."""
    col_weights = None
    if clip_search and calib_ids is not None:
        col_weights = input_sq_means(model, [n for n, _ in targets], calib_ids, skip_first=True)
    report = []
    for i, (name, linear) in enumerate(targets):
        fallback = col_weights is not None and name not in col_weights
        cw = None if col_weights is None else col_weights.get(name)
        q, scale, zp = quantize_weight(linear.weight, scheme, clip_search and not fallback, cw)
        qlinear = QuantizedLinear.from_quantized(linear, scheme, q, scale, zp)
        report.append(layer_report(name, linear.weight, qlinear))
        if fallback:
            report[-1]["fallback"] = NO_TOKEN_FALLBACK
        set_submodule(model, name, qlinear)
        if progress:
            progress(i + 1, len(targets), name)
    return report


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

    Mixture-of-Experts models: the stacked experts are first split into one Linear per expert
    projection (:class:`QuantizedExperts`), so every expert is quantized with its own scales, GPTQ's
    Hessian of an expert comes from the tokens routed to it, and the RTN clip search weights an
    expert's columns by those tokens' activations. An expert that no calibration token reaches gets
    min/max RTN and its rows say so (``fallback``). The routers are not Linears and stay full
    precision, and so does Qwen2-MoE's ``shared_expert_gate`` (:data:`experts.ALWAYS_IGNORE`).

    Args:
        scheme: the weight scheme; ``method="gptq"`` needs a 4-bit scheme.
        ignore: glob patterns of Linear names to keep in full precision (default ``["lm_head"]``);
            a pattern may name baige's module or its published name (Mixtral's ``block_sparse_moe``).
        method: ``rtn`` (round to nearest) or ``gptq`` (Frantar et al. 2022, arXiv:2210.17323; see gptq.py).
        calib_ids: (n_samples, seq_len) int64 calibration tokens: GPTQ's, and the RTN clip search's
            activation weighting (:func:`input_sq_means`).
        progress: called as ``progress(done, total, layer_name)`` after each layer.
        clip_search: RTN: each group's range from :func:`search_qparams` instead of its min/max
            (compressed-tensors' ``minmax`` observer), the squared error weighted per input column by
            the mean squared activation over ``calib_ids`` when given, else unweighted. Measured on
            SmolLM2-135M int4 g128 (docs/benchmarks/archive.md, "Quantization (perplexity)"):
            weighted lowers wikitext perplexity, unweighted raises it.
            GPTQ: the same search at the point GPTQ fixes each group's parameters, weighted by the
            layer Hessian's diagonal (:func:`gptq.gptq_quantize_weight`).
        gptq_kwargs: ``percdamp``, ``block_size``, ``batch_size``, ``sink_weight``, ``down_percdamp`` for
        :func:`gptq.gptq_quantize_model`.
    Returns:
        the per-layer report rows (:func:`layer_report`; one per expert projection), named as
        published (the checkpoint's tensor prefixes).
    Raises:
        BaigeError: nothing to quantize; a tied lm_head left unignored; unknown method; GPTQ without
        calibration data or with an 8-bit scheme.
    """
    cfg = getattr(model, "config", None)
    ignore = ["lm_head"] if ignore is None else list(ignore)
    moe = cfg is not None and cfg.moe is not None
    if moe:
        unstack_experts(model)  # every expert projection a Linear of its own (per-expert scales)
    rename = partial(published_name, cfg)
    targets = target_linears(model, ignore + list(ALWAYS_IGNORE) if moe else ignore, rename)
    if not targets:
        raise BaigeError(f"no Linear layer left to quantize after ignoring {ignore}")
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    for name, m in targets:
        if embed is not None and m.weight is embed.weight:
            raise BaigeError(f"{name} shares its weight with the embeddings (tied); add it to the ignore patterns")
    if method == "rtn":
        report = _rtn(model, targets, scheme, clip_search, calib_ids, progress)
    elif method == "gptq":
        if scheme.num_bits != 4:
            raise BaigeError("GPTQ writes the int4 layout; use a 4-bit scheme")
        if calib_ids is None:
            raise BaigeError("GPTQ needs calibration data (--calib-data)")
        names = [n for n, _ in targets]
        report = gptq_quantize_model(
            model, scheme, names, calib_ids, progress=progress, clip_search=clip_search, **gptq_kwargs
        )
    else:
        raise BaigeError(f"unknown quantization method {method!r} (choose rtn, gptq)")
    if moe:
        restack_float_experts(model)
    for row in report:
        row["name"] = rename(row["name"])  # the published name (the checkpoint's tensors)
    return report
