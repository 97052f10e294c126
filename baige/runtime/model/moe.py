"""The sparse MLP of Mixture-of-Experts layers: a router, ``num_experts`` SwiGLU experts stored
stacked, and an optional shared expert (Qwen2-MoE's gated one, ERNIE-4.5's plain ones).

Inside baige the routed experts are two 3-D parameters, transformers 5's in-memory layout:
``experts.gate_up_proj`` (E, 2I, H) -- rows ``[0, I)`` gate_proj, ``[I, 2I)`` up_proj -- and
``experts.down_proj`` (E, H, I). Checkpoints keep the published layout (one tensor per expert:
``mlp.experts.{j}.gate_proj.weight`` ..., Mixtral's ``block_sparse_moe.experts.{j}.w1/w2/w3``);
:mod:`baige.runtime.weights.moe_layout` converts on load and on save.

Compute goes through ``baige.kernels``: ``moe_topk`` (routing) and ``fused_moe`` (the grouped
experts: batched matmuls over the tokens sorted by expert on the reference path, the fused Triton
kernel on CUDA); no Python loop over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baige import kernels
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.gpt_oss import biased_experts
from baige.runtime.model.linear import project


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with HF's parameter names (the dense MLP and shared experts)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, kernels.silu_mul(project(self.gate_proj, x), project(self.up_proj, x)))


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights (see the module docstring).

    gpt-oss (``bias``, ``swiglu_alpha`` / ``swiglu_limit``): ``gate_up_proj_bias`` (E, 2I) in the rows'
    order and ``down_proj_bias`` (E, H), and the clamped SwiGLU; those run
    :func:`baige.runtime.model.gpt_oss.biased_experts` (``kernels.fused_moe`` has neither)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        bias: bool = False,
        swiglu_alpha: float | None = None,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: (N, H); topk_weights (N, k) fp32; topk_ids (N, k) int64 -> (N, H) in x's dtype."""
        if self.gate_up_proj_bias is not None or self.swiglu_limit is not None:
            return biased_experts(
                x,
                self.gate_up_proj,
                self.gate_up_proj_bias,
                self.down_proj,
                self.down_proj_bias,
                topk_weights,
                topk_ids,
                self.swiglu_alpha,
                self.swiglu_limit,
            )
        return kernels.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class Router(nn.Module):
    """``gate``: the router's linear (E, H) (with gpt-oss's bias (E,): ``router.bias`` on disk)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.weight = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(m.num_experts)) if m.router_bias else None
        self.fp32 = m.router_fp32
        self.e_score_correction_bias = None  # DeepSeek-V3's selection bias, stored with the router
        if m.routing is not None and m.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, H) -> router logits (N, E), fp32 when the family computes them so (ERNIE), else x's dtype."""
        if self.fp32:
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)


class MoEStatics(nn.Module):
    """ERNIE-4.5's ``moe_statics.e_score_correction_bias`` (1, E) fp32: added to the routing
    probabilities to pick the experts (not to their weights). Stored as a parameter without
    gradient, as transformers does, so checkpoints load and save it by name."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(1, num_experts, dtype=torch.float32), requires_grad=False
        )


class SparseMoeBlock(nn.Module):
    """Router -> top-k experts -> weighted sum, plus the shared expert when the family has one.

    Parameter names: ``gate.weight`` (+ ``gate.bias``, gpt-oss's ``router.bias``), ``experts.gate_up_proj``,
    ``experts.down_proj`` (+ ``experts.gate_up_proj_bias``, ``experts.down_proj_bias``),
    ``shared_expert.*`` + ``shared_expert_gate.weight`` (Qwen2-MoE), ``shared_experts.*`` and
    ``moe_statics.e_score_correction_bias`` (ERNIE-4.5); ``shared_experts.*`` and
    ``gate.e_score_correction_bias`` (DeepSeek-V3, routed by :func:`baige.kernels.grouped_topk`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.top_k, self.renormalize, self.norm_min = m.top_k, m.renormalize, m.norm_min
        self.gate = Router(cfg)
        self.experts = Experts(
            m.num_experts, cfg.hidden_size, m.intermediate_size, m.expert_bias, m.swiglu_alpha, m.swiglu_limit
        )
        self.routing = m.routing  # DeepSeek's group-limited router (kernels.grouped_topk), else None
        self.moe_statics = MoEStatics(m.num_experts) if m.correction_bias and m.routing is None else None
        shared = SwiGLU(cfg.hidden_size, m.shared_intermediate_size) if m.shared_intermediate_size else None
        if m.shared_gate:  # Qwen2-MoE's names
            self.shared_expert, self.shared_experts = shared, None
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:  # ERNIE-4.5's
            self.shared_expert, self.shared_experts, self.shared_expert_gate = None, shared, None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, H) -> (router logits (N, E), topk_weights (N, k) fp32, topk_ids (N, k) int64)."""
        logits = self.gate(x)
        return (logits, *self.topk(logits))

    def topk(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> (topk_weights (N, k) fp32, topk_ids (N, k) int64), the family's rule.

        ``correction_bias`` (E,) fp32: DeepSeek's selection bias to use instead of the router's own
        (the trainer passes the whole tensor when FSDP holds the router's as a sharded DTensor)."""
        if self.routing is not None:
            r = self.routing
            if correction_bias is None:
                correction_bias = self.gate.e_score_correction_bias
            weights, ids = kernels.grouped_topk(
                logits,
                self.top_k,
                n_group=r.n_group,
                topk_group=r.topk_group,
                scoring_func=r.scoring_func,
                renormalize=self.renormalize,
                correction_bias=correction_bias,
                routed_scaling_factor=r.routed_scaling_factor,
            )
            return weights, ids
        bias = self.moe_statics.e_score_correction_bias[0] if self.moe_statics is not None else None
        return kernels.moe_topk(logits, self.top_k, self.renormalize, bias, self.norm_min)

    def forward(self, x: torch.Tensor, router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x: (B, T, H) -> (B, T, H). ``router_logits``: when a list, this layer's (B*T, E) logits are
        appended (the training loss's load-balancing term reads them)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, H)
        logits, weights, ids = self.route(x2)
        if router_logits is not None:
            router_logits.append(logits)
        out = self.experts(x2, weights, ids)  # (N, H)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(project(self.shared_expert_gate, x2)) * self.shared_expert(x2)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        return out.view(shape)
