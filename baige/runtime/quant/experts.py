"""Routed experts for quantization: :class:`QuantizedExperts`, one module per expert under the
published names, and the MoE naming shared by the quantizer, the format and ``weights.moe_layout``.

Published layout (what llm-compressor writes and vLLM / transformers read): one Linear per expert
projection, ``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj`` (Mixtral:
``model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w3,w2}``), each quantized on its own with its
own scales: ``...experts.{j}.gate_proj.weight_packed``, ``weight_scale``, ``weight_zero_point``,
``weight_shape`` exactly as a dense layer. The router (``mlp.gate``, Mixtral ``block_sparse_moe.gate``)
and Qwen2-MoE's ``shared_expert_gate`` stay in full precision (vLLM builds them unquantized).

Why per-expert modules rather than stacked integer tensors: a :class:`QuantizedExperts` holds a
:class:`~baige.runtime.quant.linear.QuantizedLinear` per projection, so (as for dense layers) its state
dict *is* the checkpoint, RTN and GPTQ treat every projection as an ordinary Linear (GPTQ's Hessian
hook on an expert's Linear sees exactly the tokens routed to that expert), and the ignore list can
keep single projections in float. ``baige.kernels`` has no quantized grouped-GEMM to feed a stacked
layout; compute groups the tokens by expert as the reference ``fused_moe`` does (one matmul chain per
expert that received tokens, dequantized on the fly by ``kernels.quantized_linear``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.moe import Experts
from baige.runtime.quant.linear import QuantizedLinear

# Qwen2-MoE's (H -> 1) shared-expert gate is never quantized (an fnmatch pattern for quantize_model);
# the routers need no pattern: they are not nn.Linear in baige (``model.moe.Router``)
ALWAYS_IGNORE = ("*.mlp.shared_expert_gate",)
# the report's note on an expert projection no calibration token reached
NO_TOKEN_FALLBACK = "rtn min/max: no calibration token was routed to this expert"


def expert_names(cfg: ModelConfig, i: int) -> tuple[str, tuple[str, str, str]]:
    """(layer ``i``'s published MLP prefix, the published names of gate/up/down inside an expert)."""
    if cfg.model_type == "mixtral":
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")


def published_name(cfg: ModelConfig | None, name: str) -> str:
    """A module or tensor name inside baige -> its published (HF checkpoint) name: Mixtral's sparse
    block is ``block_sparse_moe`` on disk and ``mlp`` in baige; every other name is the same."""
    if cfg is None or cfg.model_type != "mixtral" or cfg.moe is None:
        return name
    m = re.match(r"model\.layers\.(\d+)\.mlp\.", name)
    if m is None or int(m.group(1)) not in cfg.moe.sparse_layers:
        return name
    return f"model.layers.{m.group(1)}.block_sparse_moe." + name[m.end() :]


def stacked_expert_linears(model: nn.Module) -> list[str]:
    """baige names of the per-expert projections (``model.layers.{i}.mlp.experts.{j}.gate_proj`` ...)
    of the layers whose experts are still stacked :class:`Experts` (float): Linears in the published
    layout, so a quantized checkpoint lists them as ignored."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.moe is None:
        return []
    return [
        f"model.layers.{i}.mlp.experts.{j}.{n}"
        for i in cfg.moe.sparse_layers
        if isinstance(model.model.layers[i].mlp.experts, Experts)
        for j in range(cfg.moe.num_experts)
        for n in expert_names(cfg, i)[1]
    ]


def router_ignore(cfg: ModelConfig | None) -> list[str]:
    """compressed-tensors ``ignore`` entries for the routers (llm-compressor's spelling)."""
    if cfg is None or cfg.moe is None:
        return []
    return ["re:.*block_sparse_moe.gate$"] if cfg.model_type == "mixtral" else ["re:.*mlp.gate$"]


class ExpertMLP(nn.Module):
    """One routed expert, ``down(silu(gate(x)) * up(x))``, its three projections under the family's
    published names (``gate_proj``/``up_proj``/``down_proj`` or Mixtral's ``w1``/``w3``/``w2``), each an
    ``nn.Linear`` or a ``QuantizedLinear``."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        names: tuple[str, str, str],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.names = names
        g, u, d = names
        kw = {"bias": False, "dtype": dtype, "device": device}
        setattr(self, g, nn.Linear(hidden, intermediate, **kw))
        setattr(self, u, nn.Linear(hidden, intermediate, **kw))
        setattr(self, d, nn.Linear(intermediate, hidden, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(c, H) -> (c, H) in x's dtype."""
        g, u, d = (getattr(self, n) for n in self.names)
        return d(kernels.silu_mul(g(x), u(x)))


class QuantizedExperts(nn.ModuleList):
    """The routed experts as ``num_experts`` :class:`ExpertMLP` modules (state-dict names
    ``{j}.gate_proj.weight_packed`` ..., the published layout); a drop-in for
    :class:`~baige.runtime.model.moe.Experts` (same attributes and ``forward`` signature).

    The quantizer swaps a model's stacked experts for this module with float Linears, then each
    Linear for a ``QuantizedLinear`` (those the ignore patterns keep stay ``nn.Linear``); a quantized
    checkpoint loads into one built by :meth:`empty`.
    """

    def __init__(self, experts: list[ExpertMLP], intermediate: int):
        super().__init__(experts)
        self.num_experts, self.intermediate_size = len(experts), intermediate

    @classmethod
    def empty(
        cls,
        num_experts: int,
        hidden: int,
        intermediate: int,
        names: tuple[str, str, str],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> QuantizedExperts:
        """Float (uninitialised) experts of the given shapes, e.g. on meta for a strict load."""
        return cls([ExpertMLP(hidden, intermediate, names, dtype, device) for _ in range(num_experts)], intermediate)

    @classmethod
    @torch.no_grad()
    def from_stacked(cls, experts: Experts, names: tuple[str, str, str]) -> QuantizedExperts:
        """Per-expert float Linears holding copies of the stacked ``gate_up_proj`` (E, 2I, H) rows
        ``[0, I)`` (gate) and ``[I, 2I)`` (up) and ``down_proj`` (E, H, I)."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        inter, hidden = experts.intermediate_size, gate_up.shape[2]
        out = cls.empty(experts.num_experts, hidden, inter, names, gate_up.dtype, gate_up.device)
        g, u, d = names
        for j, e in enumerate(out):
            getattr(e, g).weight.copy_(gate_up[j, :inter])  # (I, H)
            getattr(e, u).weight.copy_(gate_up[j, inter:])  # (I, H)
            getattr(e, d).weight.copy_(down[j])  # (H, I)
        return out

    def _groups(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(N, k) ids -> (order (N * k,): the pair indices sorted by expert (stable), tok (N * k,): the
        token of each sorted pair, counts: pairs per expert)."""
        flat = topk_ids.reshape(-1)  # (N * k,)
        order = torch.argsort(flat, stable=True)
        return order, order // topk_ids.shape[1], torch.bincount(flat, minlength=self.num_experts).tolist()

    def routed_rows(self, topk_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per expert, the indices (into the (N, H) input) of the tokens routed to it, in the order
        :meth:`forward` feeds them to that expert (what a calibration hook on its Linears sees)."""
        _, tok, counts = self._groups(topk_ids)
        return list(tok.split(counts))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: (N, H); topk_weights (N, k) fp32; topk_ids (N, k) int64 -> (N, H) in x's dtype.

        The (token, expert) pairs sorted by expert, each expert's rows through its MLP in one batch,
        the weighted combine in fp32 by one ``index_add`` -- the grouping of
        ``kernels.reference.fused_moe``. An expert with no pair is not called.
        """
        order, tok, counts = self._groups(topk_ids)
        xs = x[tok]  # (N * k, H)
        pieces, start = [], 0
        for expert, c in zip(self, counts):
            if c:
                pieces.append(expert(xs[start : start + c]))  # (c, H)
                start += c
        y = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])  # (N * k, H) sorted order
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        weighted = y.to(acc) * topk_weights.reshape(-1)[order].to(acc)[:, None]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device).index_add(0, tok, weighted)
        return out.to(x.dtype)


def _restack(per_expert: QuantizedExperts) -> Experts:
    """Float per-expert Linears back into one stacked :class:`Experts` (same device and dtype)."""
    g, u, d = per_expert[0].names
    w = getattr(per_expert[0], g).weight
    with torch.device(w.device):
        stacked = Experts(per_expert.num_experts, w.shape[1], per_expert.intermediate_size).to(w.dtype)
    with torch.no_grad():
        gate_up = [torch.cat([getattr(e, g).weight, getattr(e, u).weight]) for e in per_expert]  # (2I, H) each
        stacked.gate_up_proj.copy_(torch.stack(gate_up))
        stacked.down_proj.copy_(torch.stack([getattr(e, d).weight for e in per_expert]))
    return stacked


def restack_float_experts(model: nn.Module) -> None:
    """Undo :func:`unstack_experts` in the layers where no expert projection was quantized (all
    ignored): they compute with the stacked ``fused_moe`` again, as they will after a reload."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedExperts) and not any(isinstance(x, QuantizedLinear) for x in m.modules()):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _restack(m))


def unstack_experts(model: nn.Module) -> int:
    """Swap every sparse layer's stacked :class:`Experts` of a Transformer for float
    :class:`QuantizedExperts` (in place; the same function, to fp32 rounding: gate and up become two
    matmuls). Returns how many layers were swapped."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.moe is None:
        return 0
    n = 0
    for i in cfg.moe.sparse_layers:
        block = model.model.layers[i].mlp
        if isinstance(block.experts, Experts) and block.experts.gate_up_proj_bias is not None:
            raise BaigeError(
                f"{cfg.model_type}: layer {i}'s experts have biases and the clamped SwiGLU "
                "(swiglu_limit), which the per-expert quantized layout does not hold; quantizing them is not supported"
            )
        if isinstance(block.experts, Experts):
            block.experts = QuantizedExperts.from_stacked(block.experts, expert_names(cfg, i)[1])
            n += 1
    return n
