"""DeepSeek's group-limited router top-k in Triton (see :mod:`baige.kernels.routing` for the formula).

One program per token: fp32 sigmoid or softmax over the experts, the selection bias, each group's
score (sum of its two best biased scores, or its best score without a bias) in a loop over the
groups, ``topk_group`` rounds of argmax over the group scores, then ``top_k`` rounds of argmax over
the kept experts (ties: the lowest index). Forward only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import block_for, router_topk_buffers


@triton.jit
def _grouped_topk_kernel(
    LOGITS,
    BIAS,
    W,
    IDS,
    num_experts,
    s_t,
    top_k,
    n_group,
    topk_group,
    scale,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    e_mask = offs < num_experts
    z = tl.load(LOGITS + t * s_t + offs, mask=e_mask, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        p = tl.where(e_mask, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    else:
        p = tl.exp(z - tl.max(z, 0))
        p = p / tl.sum(p, 0)  # 0 on the padding lanes
    choice = p
    if HAS_BIAS:
        choice = p + tl.load(BIAS + offs, mask=e_mask, other=0.0).to(tl.float32)
    choice = tl.where(e_mask, choice, float("-inf"))
    group = offs // (num_experts // n_group)  # (E,) group of each expert
    gslots = tl.arange(0, BLOCK_G)
    gscore = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for g in range(n_group):
        c = tl.where(group == g, choice, float("-inf"))
        best = tl.max(c, 0)
        if HAS_BIAS:  # V3: the sum of the group's two best
            second = tl.max(tl.where(offs == tl.argmax(c, 0), float("-inf"), c), 0)
            best = best + second
        gscore = tl.where(gslots == g, best, gscore)
    keep = tl.zeros((BLOCK_E,), tl.int32)
    for _ in range(topk_group):
        bg = tl.argmax(gscore, 0)
        keep = tl.where(group == bg, 1, keep)
        gscore = tl.where(gslots == bg, float("-inf"), gscore)
    choice = tl.where((keep == 1) & e_mask, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    ids = tl.zeros((BLOCK_K,), tl.int64)
    for j in range(top_k):
        best_e = tl.argmax(choice, 0)
        weights = tl.where(slots == j, tl.sum(tl.where(offs == best_e, p, 0.0), 0), weights)
        ids = tl.where(slots == j, best_e.to(tl.int64), ids)
        choice = tl.where(offs == best_e, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = weights * scale
    k_mask = slots < top_k
    tl.store(W + t * top_k + slots, weights, mask=k_mask)
    tl.store(IDS + t * top_k + slots, ids, mask=k_mask)


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`baige.kernels.grouped_topk` (arguments checked there); forward only."""
    T, E = router_logits.shape
    logits, bias, weights, ids = router_topk_buffers(router_logits, top_k, correction_bias)
    if T:
        _grouped_topk_kernel[(T,)](
            logits,
            bias,
            weights,
            ids,
            E,
            logits.stride(0),
            top_k,
            n_group,
            topk_group,
            float(routed_scaling_factor),
            SIGMOID=scoring_func == "sigmoid",
            HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize,
            BLOCK_E=block_for(E, 2),
            BLOCK_G=block_for(n_group, 2),
            BLOCK_K=block_for(top_k, 2),
        )
    return weights, ids
