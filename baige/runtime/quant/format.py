"""The compressed-tensors checkpoint format: ``quantization_config`` in config.json, and the two
steps between a quantized model and a checkpoint (gpt-fast's split): :func:`quantized_checkpoint`
makes the state dict, config and report to write (``weights.safetensors_io.save_hf_checkpoint``
writes them), :func:`prepare_quantized_model` shapes a model to load one.

Spec: compressed-tensors (https://github.com/neuralmagic/compressed-tensors), ``QuantizationConfig``
(``quant_method: "compressed-tensors"``, ``format``, ``config_groups`` of ``{targets, weights}``,
``ignore``, ``quantization_status: "compressed"``) and the per-format tensor names documented in
``scheme.py``. vLLM's ``compressed-tensors`` method and transformers' ``CompressedTensorsHfQuantizer``
read this config.
"""

from __future__ import annotations

import json
import re
from functools import partial

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.model.moe import Experts
from baige.runtime.quant.experts import (
    QuantizedExperts,
    expert_names,
    published_name,
    router_ignore,
    stacked_expert_linears,
)
from baige.runtime.quant.linear import QuantizedLinear, set_submodule
from baige.runtime.quant.scheme import CLIP_KWARGS, QuantScheme

REPORT_FILE = "quantization_report.json"


def quantization_config(scheme: QuantScheme, ignored: list[str], clip_search: bool = False) -> dict:
    """The config.json ``quantization_config`` for one scheme applied to every Linear not in
    ``ignored`` (exact published module names, e.g. ``["lm_head"]``, or ``re:`` patterns such as the
    MoE routers' ``re:.*mlp.gate$``).

    ``observer`` records how the scales were chosen (compressed-tensors ``QuantizationArgs.observer``,
    free text; loaders ignore it): ``minmax``, or with ``clip_search`` ``mse`` with
    ``observer_kwargs`` ``maxshrink``/``grid``/``norm`` -- llm-compressor's names for the shrink grid
    and error exponent -- plus baige's ``maxexpand`` and ``zero_point_offsets`` (see
    ``scheme.search_qparams``; its activation weighting is in the report).
    """
    weights = {
        "num_bits": scheme.num_bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": "channel" if scheme.group_size is None else "group",
        "dynamic": False,
        "actorder": "weight" if scheme.actorder else None,
        "block_structure": None,
        "observer": "mse" if clip_search else "minmax",
        "observer_kwargs": dict(CLIP_KWARGS) if clip_search else {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": scheme.format,
            }
        },
        "ignore": list(ignored),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def _scheme_from_weights(w: dict, where: str) -> QuantScheme:
    if w.get("type", "int") != "int" or w.get("dynamic"):
        raise BaigeError(f"{where}: only static integer weight quantization is supported")
    strategy = w.get("strategy")
    if strategy not in ("channel", "group"):
        raise BaigeError(f"{where}: weight strategy {strategy!r} is not supported (channel, group)")
    for key in ("num_bits", "group_size") if strategy == "group" else ("num_bits",):
        if not isinstance(w.get(key), int) or isinstance(w.get(key), bool):
            raise BaigeError(f"{where}: weights.{key} must be an integer, got {str(w.get(key))[:40]}")
    return QuantScheme(
        num_bits=w["num_bits"],
        group_size=w["group_size"] if strategy == "group" else None,
        symmetric=bool(w.get("symmetric", True)),
        actorder=w.get("actorder") == "weight",
    )


def _matches(name: str, module: nn.Module, pattern: str) -> bool:
    """compressed-tensors target matching: ``re:<regex>`` on the name, else an exact name or class name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__


def _targeted(name: str, m: nn.Module, targets: list[str], ignore: list[str]) -> bool:
    return any(_matches(name, m, t) for t in targets) and not any(_matches(name, m, p) for p in ignore)


def _unstack_targeted_experts(model: nn.Module, targets: list[str], ignore: list[str]) -> None:
    """Swap a sparse layer's stacked experts for :class:`QuantizedExperts` (float Linears, same
    device and dtype) when any of its per-expert projections is targeted: the checkpoint then holds
    them per expert and quantized (``weights.moe_layout.to_internal`` leaves such layers unstacked)."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.moe is None:
        return
    for i in cfg.moe.sparse_layers:
        name = f"model.layers.{i}.mlp.experts"
        stacked = model.get_submodule(name)
        if not isinstance(stacked, Experts):
            continue
        per_expert = QuantizedExperts.empty_like(stacked, expert_names(cfg, i)[1])  # gpt-oss: with biases
        if any(
            _targeted(published_name(cfg, f"{name}.{n}"), m, targets, ignore)
            for n, m in per_expert.named_modules()
            if isinstance(m, nn.Linear)
        ):
            set_submodule(model, name, per_expert)


def prepare_quantized_model(model: nn.Module, qcfg: dict, where: str = "config.json") -> list[str]:
    """Swap the Linears a ``quantization_config`` targets for empty :class:`QuantizedLinear` modules,
    so that a strict state-dict load fills them (used by ``loader.load_model``, also on meta).

    Targets and ignore entries are matched against the published module names (Mixtral's sparse
    block is ``block_sparse_moe`` on disk). A Mixture-of-Experts layer whose expert projections are
    targeted gets :class:`QuantizedExperts` (one module per expert) in place of its stacked experts.

    Returns the swapped module names (baige's).
    Raises:
        BaigeError: not compressed-tensors, an unsupported format/scheme, activation quantization,
        or a group that matches no module.
    """
    if qcfg.get("quant_method") != "compressed-tensors":
        raise BaigeError(
            f"{where}: quantization method {qcfg.get('quant_method')!r} is not supported (compressed-tensors)"
        )
    if qcfg.get("quantization_status", "compressed") != "compressed":
        raise BaigeError(
            f"{where}: quantization_status {qcfg.get('quantization_status')!r}; baige loads compressed checkpoints"
        )
    ignore = qcfg.get("ignore") or []
    groups = qcfg.get("config_groups") or {}
    _unstack_targeted_experts(model, [t for g in groups.values() for t in g.get("targets", [])], ignore)
    rename = partial(published_name, getattr(model, "config", None))
    swapped: list[str] = []
    for gname, group in groups.items():
        where_g = f"{where}: config_groups.{gname}"
        if group.get("input_activations") or group.get("output_activations"):
            raise BaigeError(f"{where_g}: activation quantization is not supported (weight-only)")
        scheme = _scheme_from_weights(group.get("weights") or {}, where_g)
        fmt = group.get("format") or qcfg.get("format")
        if fmt != scheme.format:
            raise BaigeError(
                f"{where_g}: format {fmt!r} with int{scheme.num_bits} weights (baige reads {scheme.format})"
            )
        hits = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and _targeted(rename(name), m, group.get("targets", []), ignore)
        ]
        if not hits:
            raise BaigeError(f"{where_g}: targets {group.get('targets')} match no Linear layer")
        for name, m in hits:
            device = m.weight.device
            q = QuantizedLinear(m.in_features, m.out_features, m.bias is not None, scheme, m.weight.dtype, device)
            set_submodule(model, name, q)
            swapped.append(name)
    return swapped


def quantized_checkpoint(
    model: nn.Module, scheme: QuantScheme, report: list[dict], clip_search: dict | None = None
) -> tuple[dict[str, torch.Tensor], dict, dict[str, str]]:
    """What a quantized model's HF directory holds: ``(state dict, config.json dict, extra files)``,
    the extra files being ``quantization_report.json`` (the per-layer report).

    ``clip_search``: how the RTN or GPTQ clip search ran (e.g. ``{"weighting": ..., "calib_data": ...}``),
    written to the report under ``clip_search`` (null: min/max scales) and recorded in config.json
    as the ``mse`` observer.
    """
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    ignored = [
        published_name(model.config, name)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in quantized
    ]
    ignored += [published_name(model.config, name) for name in stacked_expert_linears(model)]
    config = dict(model.config.raw)
    config["quantization_config"] = quantization_config(
        scheme, ignored + router_ignore(model.config), clip_search is not None
    )
    state = dict(model.state_dict())
    summary = {
        "scheme": scheme.describe(),
        "format": scheme.format,
        "clip_search": None if clip_search is None else {**CLIP_KWARGS, **clip_search},
        "layers": report,
        "quantized_bytes": sum(
            v.numel() * v.element_size() for k, v in state.items() if k.rsplit(".", 1)[0] in quantized
        ),
    }
    return state, config, {REPORT_FILE: json.dumps(summary, indent=2)}
