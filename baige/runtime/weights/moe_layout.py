"""Routed experts between the published checkpoint layout and baige's stacked one.

On disk (HF, as transformers 5 saves and the Hub publishes): one tensor per expert,
``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`` and the router
``model.layers.{i}.mlp.gate.weight``; Mixtral names them ``block_sparse_moe.experts.{j}.w1`` (gate),
``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate.weight``. In baige (:mod:`baige.runtime.model.moe`):
``mlp.experts.gate_up_proj`` (E, 2I, H) = per expert ``cat(gate, up)`` and ``mlp.experts.down_proj``
(E, H, I), router ``mlp.gate.weight``. Everything else keeps its name. Both directions leave keys
they do not recognise untouched, so converting twice is harmless.
"""

from __future__ import annotations

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig


def _names(cfg: ModelConfig, i: int) -> tuple[str, tuple[str, str, str]]:
    """(the layer's HF MLP prefix, HF names of gate/up/down inside an expert)."""
    if cfg.model_type == "mixtral":
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")


def to_internal(state: dict[str, torch.Tensor], cfg: ModelConfig, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Stack each sparse layer's per-expert tensors (see the module docstring); returns a new dict.

    Raises:
        BaigeError: an expert tensor is missing (named), or the experts' shapes differ.
    """
    if cfg.moe is None:
        return state
    state = dict(state)
    for i in cfg.moe.sparse_layers:
        hf, (g, u, d) = _names(cfg, i)
        ours = f"model.layers.{i}.mlp."
        if f"{ours}experts.gate_up_proj" in state:
            continue  # already stacked
        if f"{hf}gate.weight" in state:
            state[f"{ours}gate.weight"] = state.pop(f"{hf}gate.weight")
        gate_up, down = [], []
        for j in range(cfg.moe.num_experts):
            keys = [f"{hf}experts.{j}.{n}.weight" for n in (g, u, d)]
            missing = [k for k in keys if k not in state]
            if missing:
                raise BaigeError(f"{where}: tensor {missing[0]!r} missing from the checkpoint "
                                 f"({cfg.moe.num_experts} experts expected in layer {i})")
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
    (contiguous copies of the slices); returns a new dict."""
    if cfg.moe is None:
        return state
    state = dict(state)
    for i in cfg.moe.sparse_layers:
        hf, (g, u, d) = _names(cfg, i)
        ours = f"model.layers.{i}.mlp."
        gate_up = state.pop(f"{ours}experts.gate_up_proj", None)
        if gate_up is None:
            continue
        down = state.pop(f"{ours}experts.down_proj")
        inter = gate_up.shape[1] // 2
        for j in range(gate_up.shape[0]):
            state[f"{hf}experts.{j}.{g}.weight"] = gate_up[j, :inter].contiguous()
            state[f"{hf}experts.{j}.{u}.weight"] = gate_up[j, inter:].contiguous()
            state[f"{hf}experts.{j}.{d}.weight"] = down[j].contiguous()
        if hf != ours and f"{ours}gate.weight" in state:
            state[f"{hf}gate.weight"] = state.pop(f"{ours}gate.weight")
    return state
