"""gpt-oss's MoE tensors between the checkpoint layouts and baige's stacked experts.

On disk, per layer ``i`` (prefix ``model.layers.{i}.mlp.``), as transformers 5 saves a float model:
``router.weight`` (E, H), ``router.bias`` (E,), ``experts.gate_up_proj`` (E, H, 2I) with gate and up
interleaved along the last dim (gate ``[..., ::2]``, up ``[..., 1::2]``), ``experts.gate_up_proj_bias``
(E, 2I) interleaved the same way, ``experts.down_proj`` (E, I, H), ``experts.down_proj_bias`` (E, H).

The published MXFP4 checkpoints (``quantization_config.quant_method: mxfp4``) store the two expert
weights as ``experts.gate_up_proj_blocks`` (E, 2I, H / 32, 16) + ``experts.gate_up_proj_scales``
(E, 2I, H / 32) -- rows are the (interleaved) outputs, the blocks run along the input -- and
``experts.down_proj_blocks`` (E, H, I / 32, 16) + ``experts.down_proj_scales`` (E, H, I / 32)
(:mod:`baige.runtime.quant.mxfp4`). baige dequantizes them on load, into the dtype the checkpoint's
float tensors load in; the model in memory is then a float model, and its config drops
``quantization_config`` (:func:`dense_config`), so an export writes the float layout above.

In baige (:class:`baige.runtime.model.moe.SparseMoeBlock`): ``gate.weight``, ``gate.bias``,
``experts.gate_up_proj`` (E, 2I, H) gate rows then up rows, ``experts.gate_up_proj_bias`` (E, 2I) in
that order, ``experts.down_proj`` (E, H, I), ``experts.down_proj_bias`` (E, H).

A compressed-tensors checkpoint (``baige quantize``, llm-compressor's linearised gpt-oss) holds the
experts per expert instead: ``experts.{j}.gate_proj.weight_packed`` ... and ``experts.{j}.gate_proj.bias``
(:mod:`baige.runtime.quant.experts`); those keep their names (only the router is renamed) and load into
``quant.experts.QuantizedExperts``.
"""

from __future__ import annotations

import dataclasses

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.quant.mxfp4 import dequantize_mxfp4

MXFP4 = "mxfp4"


def dense_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without its ``quantization_config`` when that is MXFP4 (the experts are dequantized on
    load, so the model built is a float one); other configs unchanged.

    Raises:
        BaigeError: MXFP4 declared for a model type other than gpt_oss.
    """
    qcfg = cfg.raw.get("quantization_config")
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != MXFP4:
        return cfg
    if cfg.model_type != "gpt_oss":
        raise BaigeError(
            f"quantization_config.quant_method 'mxfp4' is supported for gpt_oss only, not {cfg.model_type}"
        )
    raw = {k: v for k, v in cfg.raw.items() if k != "quantization_config"}
    return dataclasses.replace(cfg, raw=raw)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Entries 0, 2, 4, ... then 1, 3, 5, ... along ``dim`` (HF's interleaved gate/up -> gate, up)."""
    idx = [slice(None)] * t.dim()
    even, odd = list(idx), list(idx)
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat([t[tuple(even)], t[tuple(odd)]], dim=dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`_deinterleave`: halves [0, n/2) and [n/2, n) woven 0, n/2, 1, n/2 + 1, ..."""
    dim = dim % t.dim()
    a, b = t.chunk(2, dim=dim)
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def _expert_weight(state: dict[str, torch.Tensor], prefix: str, proj: str, where: str) -> tuple[torch.Tensor, bool]:
    """The float weight ``{prefix}{proj}`` (popped), or the dequantized ``_blocks`` / ``_scales`` pair in
    its (E, rows, K) MXFP4 orientation; returns it and whether it came from MXFP4."""
    name = f"{prefix}{proj}"
    if f"{name}_blocks" in state or f"{name}_scales" in state:
        blocks, scales = state.pop(f"{name}_blocks", None), state.pop(f"{name}_scales", None)
        if blocks is None or scales is None:
            missing = f"{name}_blocks" if blocks is None else f"{name}_scales"
            raise BaigeError(f"{where}: tensor {missing!r} missing from the checkpoint")
        bias = state.get(f"{name}_bias")
        dtype = bias.dtype if bias is not None and bias.is_floating_point() else torch.float32
        return dequantize_mxfp4(blocks, scales, dtype, f"{where}: {name}"), True
    if name not in state:
        raise BaigeError(f"{where}: tensor {name!r} missing from the checkpoint")
    return state.pop(name), False


def _per_expert(state: dict[str, torch.Tensor], prefix: str) -> bool:
    """Whether layer ``prefix``'s experts are stored per expert (``{prefix}experts.{j}.``...), not stacked."""
    start = f"{prefix}experts."
    return any(k.startswith(start) and k[len(start) : len(start) + 1].isdigit() for k in state)


def to_internal(state: dict[str, torch.Tensor], cfg: ModelConfig, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The checkpoint's gpt-oss MoE tensors (float or MXFP4) in baige's layout (module docstring);
    per-expert (quantized) experts keep their names. Returns a new dict, other keys untouched. Works
    on meta tensors (shape checks before reading).

    Raises:
        BaigeError: naming ``where`` and a missing expert tensor, a weight of the wrong rank, or bad
        MXFP4 blocks/scales (:func:`~baige.runtime.quant.mxfp4.dequantize_mxfp4`).
    """
    state = dict(state)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        if f"{p}gate.weight" in state and f"{p}router.weight" not in state:
            continue  # already baige's layout
        for name in ("weight", "bias"):
            if f"{p}router.{name}" in state:
                state[f"{p}gate.{name}"] = state.pop(f"{p}router.{name}")
        if _per_expert(state, p):
            continue  # quantized per expert: the names are baige's already
        gate_up, gu_mx = _expert_weight(state, f"{p}experts.", "gate_up_proj", where)
        down, d_mx = _expert_weight(state, f"{p}experts.", "down_proj", where)
        if gate_up.dim() != 3 or down.dim() != 3:
            raise BaigeError(f"{where}: the experts of layer {i} are not (E, ., .) tensors")
        gate_up = gate_up if gu_mx else gate_up.transpose(1, 2)  # (E, 2I, H) interleaved rows
        state[f"{p}experts.gate_up_proj"] = _deinterleave(gate_up, 1).contiguous()  # (E, 2I, H)
        state[f"{p}experts.down_proj"] = (down if d_mx else down.transpose(1, 2)).contiguous()  # (E, H, I)
        bias = state.get(f"{p}experts.gate_up_proj_bias")
        if bias is not None:
            state[f"{p}experts.gate_up_proj_bias"] = _deinterleave(bias, -1).contiguous()  # (E, 2I)
    return state


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_internal`: transformers' gpt-oss layout (module docstring) for stacked
    experts, contiguous copies; per-expert tensors keep their names. Returns a new dict."""
    state = dict(state)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        for name in ("weight", "bias"):
            if f"{p}gate.{name}" in state:
                state[f"{p}router.{name}"] = state.pop(f"{p}gate.{name}")
        gate_up = state.get(f"{p}experts.gate_up_proj")
        if gate_up is None:
            continue
        state[f"{p}experts.gate_up_proj"] = _interleave(gate_up, 1).transpose(1, 2).contiguous()  # (E, H, 2I)
        state[f"{p}experts.down_proj"] = state[f"{p}experts.down_proj"].transpose(1, 2).contiguous()  # (E, I, H)
        bias = state.get(f"{p}experts.gate_up_proj_bias")
        if bias is not None:
            state[f"{p}experts.gate_up_proj_bias"] = _interleave(bias, -1).contiguous()
    return state
