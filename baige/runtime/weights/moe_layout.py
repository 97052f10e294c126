"""Routed experts between the published checkpoint layout and baige's stacked one.

On disk (HF, as transformers 5 saves and the Hub publishes): one tensor per expert,
``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`` and the router
``model.layers.{i}.mlp.gate.weight``; Mixtral names them ``block_sparse_moe.experts.{j}.w1`` (gate),
``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate.weight``. In baige (:mod:`baige.runtime.model.moe`):
``mlp.experts.gate_up_proj`` (E, 2I, H) = per expert ``cat(gate, up)`` and ``mlp.experts.down_proj``
(E, H, I), router ``mlp.gate.weight``. Everything else keeps its name. Both directions leave keys
they do not recognise untouched, so converting twice is harmless.

Quantized experts (compressed-tensors, one quantized Linear per expert projection) are never
stacked: they stay per expert under the same names in baige (``quant.experts.QuantizedExperts``).
"""

from __future__ import annotations

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.quant.experts import expert_names
from baige.runtime.weights import gpt_oss_layout


def _is_quantized(state: dict[str, torch.Tensor], prefix: str) -> bool:
    """Whether the per-expert tensors under ``prefix`` (``...experts.``) are compressed-tensors
    quantized: a ``weight_packed``/``weight_scale``/... tensor, or an integer ``weight`` (int8)."""
    return any(k.startswith(prefix) and (not k.endswith(".weight") or not state[k].is_floating_point()) for k in state)


def _move(state: dict[str, torch.Tensor], src: str, dst: str) -> None:
    """Rename every key starting with ``src`` to start with ``dst`` instead (in place)."""
    if src != dst:
        for k in [k for k in state if k.startswith(src)]:
            state[dst + k[len(src) :]] = state.pop(k)


def to_internal(state: dict[str, torch.Tensor], cfg: ModelConfig, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Stack each sparse layer's per-expert tensors (see the module docstring); returns a new dict.

    A layer whose experts are quantized (compressed-tensors: ``...experts.{j}.gate_proj.weight_packed``,
    ``weight_scale``, ...) is not stacked: its per-expert tensors keep their names (Mixtral's moved
    from ``block_sparse_moe.`` to ``mlp.``) and load into ``quant.experts.QuantizedExperts``.

    Raises:
        BaigeError: an expert tensor is missing (named), or the experts' shapes differ.
    """
    if cfg.moe is None:
        return state
    if cfg.model_type == "gpt_oss":  # stacked on disk already, interleaved, with biases and MXFP4
        return gpt_oss_layout.to_internal(state, cfg, where)
    state = dict(state)
    for i in cfg.moe.sparse_layers:
        hf, (g, u, d) = expert_names(cfg, i)
        ours = f"model.layers.{i}.mlp."
        if f"{ours}experts.gate_up_proj" in state:
            continue  # already stacked
        if f"{hf}gate.weight" in state:
            state[f"{ours}gate.weight"] = state.pop(f"{hf}gate.weight")
        if _is_quantized(state, f"{hf}experts.") or _is_quantized(state, f"{ours}experts."):
            _move(state, f"{hf}experts.", f"{ours}experts.")
            continue
        gate_up, down = [], []
        for j in range(cfg.moe.num_experts):
            keys = [f"{hf}experts.{j}.{n}.weight" for n in (g, u, d)]
            missing = [k for k in keys if k not in state]
            if missing:
                raise BaigeError(
                    f"{where}: tensor {missing[0]!r} missing from the checkpoint "
                    f"({cfg.moe.num_experts} experts expected in layer {i})"
                )
            w_g, w_u, w_d = (state.pop(k) for k in keys)
            gate_up.append(torch.cat([w_g, w_u], dim=0))  # (2I, H)
            down.append(w_d)  # (H, I)
        try:
            state[f"{ours}experts.gate_up_proj"] = torch.stack(gate_up)  # (E, 2I, H)
            state[f"{ours}experts.down_proj"] = torch.stack(down)  # (E, H, I)
        except RuntimeError:
            raise BaigeError(f"{where}: the experts of layer {i} have different shapes") from None
    return state


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_internal`: per-expert tensors under the family's HF names
    (contiguous copies of the slices); returns a new dict. Experts already held per expert
    (``QuantizedExperts``, quantized or not) keep their tensors, only Mixtral's prefix changes."""
    if cfg.moe is None:
        return state
    if cfg.model_type == "gpt_oss":
        return gpt_oss_layout.to_hf(state, cfg)
    state = dict(state)
    for i in cfg.moe.sparse_layers:
        hf, (g, u, d) = expert_names(cfg, i)
        ours = f"model.layers.{i}.mlp."
        gate_up = state.pop(f"{ours}experts.gate_up_proj", None)
        if gate_up is not None:
            down = state.pop(f"{ours}experts.down_proj")
            inter = gate_up.shape[1] // 2
            for j in range(gate_up.shape[0]):
                state[f"{hf}experts.{j}.{g}.weight"] = gate_up[j, :inter].contiguous()
                state[f"{hf}experts.{j}.{u}.weight"] = gate_up[j, inter:].contiguous()
                state[f"{hf}experts.{j}.{d}.weight"] = down[j].contiguous()
        else:
            _move(state, f"{ours}experts.", f"{hf}experts.")
        if hf != ours and f"{ours}gate.weight" in state:
            state[f"{hf}gate.weight"] = state.pop(f"{ours}gate.weight")
    return state
