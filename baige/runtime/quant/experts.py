"""Routed experts for quantization: :class:`QuantizedExperts`, one module per expert under the
published names, and the MoE naming shared by the quantizer, the format and ``weights.moe_layout``.

Published layout (what llm-compressor writes and vLLM / transformers read): one Linear per expert
projection, ``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj`` (Mixtral:
``model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w3,w2}``), each quantized on its own with its
own scales: ``...experts.{j}.gate_proj.weight_packed``, ``weight_scale``, ``weight_zero_point``,
``weight_shape`` exactly as a dense layer. The router (``mlp.gate``, Mixtral ``block_sparse_moe.gate``,
gpt-oss ``mlp.router``) and Qwen2-MoE's ``shared_expert_gate`` stay in full precision (vLLM builds them
unquantized).

gpt-oss: every expert projection also has a float ``bias``, ``...experts.{j}.gate_proj.bias`` (I,),
``up_proj.bias`` (I,), ``down_proj.bias`` (H,) -- the halves of the interleaved ``gate_up_proj_bias``
(gate the even entries, up the odd ones; baige holds them de-interleaved, see
:mod:`baige.runtime.weights.gpt_oss_layout`) -- and the expert computes the clamped SwiGLU
(:func:`baige.runtime.model.gpt_oss.clamped_swiglu`). This is the layout llm-compressor's
linearised gpt-oss writes (``modeling/moe/gpt_oss.py``, ``GptOssLinearExperts``: one
``gate_proj``/``up_proj``/``down_proj`` Linear with bias per expert in a ModuleList in place of
``mlp.experts``, gate and up split on the even / odd columns; vllm-project/llm-compressor PRs #2113 and #3100).

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
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.gpt_oss import clamped_swiglu
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
    """compressed-tensors ``ignore`` entries for the routers (llm-compressor's spelling; gpt-oss's
    router is ``mlp.router`` on disk)."""
    if cfg is None or cfg.moe is None:
        return []
    if cfg.model_type == "gpt_oss":
        return ["re:.*mlp.router$"]
    return ["re:.*block_sparse_moe.gate$"] if cfg.model_type == "mixtral" else ["re:.*mlp.gate$"]


class ExpertMLP(nn.Module):
    """One routed expert, ``down(act(gate(x), up(x)))``, its three projections under the family's
    published names (``gate_proj``/``up_proj``/``down_proj`` or Mixtral's ``w1``/``w3``/``w2``), each an
    ``nn.Linear`` or a ``QuantizedLinear``, with biases when ``bias`` (gpt-oss).

    ``act``: ``silu(gate) * up``, or with ``swiglu_limit`` gpt-oss's clamped SwiGLU
    (:func:`baige.runtime.model.gpt_oss.clamped_swiglu`, the function the stacked experts call)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        names: tuple[str, str, str],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        bias: bool = False,
        swiglu_alpha: float | None = None,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        self.names = names
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        g, u, d = names
        kw = {"bias": bias, "dtype": dtype, "device": device}
        setattr(self, g, nn.Linear(hidden, intermediate, **kw))
        setattr(self, u, nn.Linear(hidden, intermediate, **kw))
        setattr(self, d, nn.Linear(intermediate, hidden, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(c, H) -> (c, H) in x's dtype."""
        g, u, d = (getattr(self, n) for n in self.names)
        if self.swiglu_limit is None:
            return d(kernels.silu_mul(g(x), u(x)))
        return d(clamped_swiglu(g(x), u(x), self.swiglu_alpha, self.swiglu_limit))  # (c, I) -> (c, H)


class QuantizedExperts(nn.ModuleList):
    """The routed experts as ``num_experts`` :class:`ExpertMLP` modules (state-dict names
    ``{j}.gate_proj.weight_packed`` ..., the published layout); a drop-in for
    :class:`~baige.runtime.model.moe.Experts` (same attributes and ``forward`` signature).

    The quantizer swaps a model's stacked experts for this module with float Linears, then each
    Linear for a ``QuantizedLinear`` (those the ignore patterns keep stay ``nn.Linear``); a quantized
    checkpoint loads into one built by :meth:`empty_like`.
    """

    def __init__(self, experts: list[ExpertMLP], intermediate: int):
        super().__init__(experts)
        self.num_experts, self.intermediate_size = len(experts), intermediate
        # gpt-oss: projections with biases and the clamped SwiGLU (the stacked Experts' attributes)
        self.has_bias = getattr(experts[0], experts[0].names[0]).bias is not None
        self.swiglu_alpha, self.swiglu_limit = experts[0].swiglu_alpha, experts[0].swiglu_limit

    @classmethod
    def empty_like(
        cls, experts: Experts, names: tuple[str, str, str], device: torch.device | str | None = None
    ) -> QuantizedExperts:
        """Float (uninitialised) per-expert modules of the stacked ``experts``' shapes, biases and
        activation, in its dtype, on ``device`` (default its device; e.g. meta for a strict load)."""
        w = experts.gate_up_proj
        kw = {
            "bias": experts.gate_up_proj_bias is not None,
            "swiglu_alpha": experts.swiglu_alpha,
            "swiglu_limit": experts.swiglu_limit,
        }
        hidden, inter, dev = w.shape[2], experts.intermediate_size, w.device if device is None else device
        return cls([ExpertMLP(hidden, inter, names, w.dtype, dev, **kw) for _ in range(experts.num_experts)], inter)

    @classmethod
    @torch.no_grad()
    def from_stacked(cls, experts: Experts, names: tuple[str, str, str]) -> QuantizedExperts:
        """Per-expert float Linears holding copies of the stacked ``gate_up_proj`` (E, 2I, H) rows
        ``[0, I)`` (gate) and ``[I, 2I)`` (up) and ``down_proj`` (E, H, I); with biases, of
        ``gate_up_proj_bias`` (E, 2I) entries ``[0, I)`` / ``[I, 2I)`` and ``down_proj_bias`` (E, H)."""
        gate_up, down, inter = experts.gate_up_proj, experts.down_proj, experts.intermediate_size
        b13, b2 = experts.gate_up_proj_bias, experts.down_proj_bias
        out = cls.empty_like(experts, names)
        g, u, d = names
        for j, e in enumerate(out):
            getattr(e, g).weight.copy_(gate_up[j, :inter])  # (I, H)
            getattr(e, u).weight.copy_(gate_up[j, inter:])  # (I, H)
            getattr(e, d).weight.copy_(down[j])  # (H, I)
            if b13 is not None:
                getattr(e, g).bias.copy_(b13[j, :inter])  # (I,)
                getattr(e, u).bias.copy_(b13[j, inter:])  # (I,)
                getattr(e, d).bias.copy_(b2[j])  # (H,)
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
    """Float per-expert Linears back into one stacked :class:`Experts` (same device and dtype,
    biases and activation)."""
    g, u, d = per_expert[0].names
    w = getattr(per_expert[0], g).weight
    with torch.device(w.device):
        stacked = Experts(
            per_expert.num_experts,
            w.shape[1],
            per_expert.intermediate_size,
            per_expert.has_bias,
            per_expert.swiglu_alpha,
            per_expert.swiglu_limit,
        ).to(w.dtype)
    with torch.no_grad():
        for p in ("weight", "bias") if per_expert.has_bias else ("weight",):
            gate_up = [torch.cat([getattr(getattr(e, g), p), getattr(getattr(e, u), p)]) for e in per_expert]
            getattr(stacked, "gate_up_proj" if p == "weight" else "gate_up_proj_bias").copy_(torch.stack(gate_up))
            down = torch.stack([getattr(getattr(e, d), p) for e in per_expert])  # (E, H, I) / (E, H)
            getattr(stacked, "down_proj" if p == "weight" else "down_proj_bias").copy_(down)
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
    matmuls; gpt-oss's biases and clamped SwiGLU come along). Returns how many layers were swapped."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.moe is None:
        return 0
    n = 0
    for i in cfg.moe.sparse_layers:
        block = model.model.layers[i].mlp
        if isinstance(block.experts, Experts):
            block.experts = QuantizedExperts.from_stacked(block.experts, expert_names(cfg, i)[1])
            n += 1
    return n
