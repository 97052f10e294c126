"""Group-limited top-k routing of DeepSeek-V2/V3 (vLLM's ``grouped_topk``): the public op and its
PyTorch reference. The Triton twin is :mod:`baige.kernels.triton_ops.moe_routing`.

Formula (transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter``; DeepSeek-V3 report,
arXiv:2412.19437, section 2.1.2; DeepSeek-V2, arXiv:2405.04434, section 2.2.3):

- ``scores = sigmoid(logits)`` (V3) or ``softmax(logits)`` (V2), fp32;
- ``choice = scores + correction_bias`` (V3's ``e_score_correction_bias``, selection only);
- the experts are ``n_group`` equal groups; a group's score is the sum of its two best ``choice``
  values when a bias is given (V3), else its best ``scores`` value (V2's ``group_limited_greedy``);
  only the ``topk_group`` best groups stay (the others' experts get ``-inf``);
- ``ids = topk(choice, top_k)``; ``weights = scores[ids]`` (unbiased), divided by ``sum + 1e-20``
  when ``renormalize`` (V3's ``norm_topk_prob``), times ``routed_scaling_factor``.
"""

from __future__ import annotations

import importlib

import torch

from baige.kernels.dispatch import backend

SCORING_FUNCS = ("sigmoid", "softmax")
_TRITON: list = []  # [baige.kernels.triton_ops.moe_routing] once imported


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited router top-k (module docstring).

    Args:
        router_logits: (T, E), any float dtype (computed in fp32).
        top_k: experts per token, ``1 <= top_k <= topk_group * E / n_group``.
        n_group: expert groups, dividing E (1: plain top-k); with a bias each group has >= 2 experts.
        topk_group: groups kept per token, ``1 <= topk_group <= n_group``.
        scoring_func: ``"sigmoid"`` (V3) or ``"softmax"`` (V2).
        renormalize: divide the chosen weights by their sum (+1e-20).
        correction_bias: (E,) fp32 added to the scores for the selection only (V3), or None (V2).
        routed_scaling_factor: multiplies the final weights.
    Returns:
        ``(topk_weights, topk_ids)``: (T, top_k) fp32 (fp64 for fp64 logits, reference) and int64.
        Differentiable w.r.t. router_logits on the reference path (taken whenever they need a
        gradient; the Triton kernel is forward only). Ties: the reference uses ``torch.topk``, the
        Triton kernel takes the lowest index first.
    Raises:
        ValueError: shapes or arguments outside the ranges above.
    """
    T, E = router_logits.shape
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"grouped_topk: scoring_func {scoring_func!r} is not one of {SCORING_FUNCS}")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"grouped_topk: {E} experts, n_group {n_group}, topk_group {topk_group}")
    if not 1 <= top_k <= topk_group * (E // n_group):
        raise ValueError(f"grouped_topk: top_k {top_k} is not in [1, {topk_group * (E // n_group)}]")
    if correction_bias is not None and (correction_bias.shape != (E,) or (n_group > 1 and E // n_group < 2)):
        raise ValueError(f"grouped_topk: correction_bias {tuple(correction_bias.shape)} with {E} experts in {n_group}")
    needs_grad = router_logits.requires_grad and torch.is_grad_enabled()
    if needs_grad or backend(router_logits) == "reference":
        impl = grouped_topk_reference
    else:
        if not _TRITON:
            _TRITON.append(importlib.import_module("baige.kernels.triton_ops.moe_routing"))
        impl = _TRITON[0].grouped_topk
    return impl(
        router_logits, top_k, n_group, topk_group, scoring_func, renormalize, correction_bias, routed_scaling_factor
    )


def grouped_topk_reference(
    router_logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch oracle of :func:`grouped_topk` (arguments checked there)."""
    acc = torch.promote_types(router_logits.dtype, torch.float32)  # fp32 (fp64 stays fp64: the tests' oracle)
    z = router_logits.to(acc)
    scores = torch.sigmoid(z) if scoring_func == "sigmoid" else torch.softmax(z, dim=-1)  # (T, E)
    T, E = scores.shape
    choice = scores if correction_bias is None else scores + correction_bias.to(acc)
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)  # (T, G, E/G)
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G) V3: the two best per group
        else:
            group_scores = grouped.amax(-1)  # (T, G) V2: the best per group
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices  # (T, top_k) int64
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids
