"""The GRPO loss on token tensors: group advantages, the clipped policy term, the k3 KL, truncated
importance sampling, masks and the loss aggregation modes. Pure functions over tensors.

Shapes: B sequences of a micro-batch, T token positions (the micro-batch's longest completion: see
``rl/batch.py``); ``mask`` (B, T) is 1 exactly on the response tokens (padding carries no loss). Log-probabilities are
fp32 natural logs of the sampled tokens.
"""

from __future__ import annotations

import torch

ADV_EPS = 1e-6  # added to the group std (verl's epsilon)


def group_advantages(rewards: torch.Tensor, norm_by_std: bool = True, eps: float = ADV_EPS) -> torch.Tensor:
    """GRPO's outcome advantages (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2): each sample's reward
    minus its group's mean, divided by the group's standard deviation (unbiased, + ``eps``) when
    ``norm_by_std``; Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops the division.

    Args:
        rewards: (P, G) fp32, G >= 2 samples of each of P prompts.
    Returns:
        (P, G) fp32 advantages; a group whose rewards are all equal gets zeros.
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (P, G)
    if not norm_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) from samples of pi: ``exp(d) - d - 1``, ``d = ref - logp``
    (Schulman 2020, "Approximating KL divergence"; the GRPO paper's eq. 4). Non-negative, 0 where equal."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def tis_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(old - engine), cap)`` (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): they correct for the engine
    (behaviour policy) sampling from slightly other probabilities than the trainer's. No gradient."""
    return torch.exp(old_logprobs - engine_logprobs).clamp(max=cap).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (PPO, Schulman et al. 2017, eq. 7) with DAPO's asymmetric clip:
    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, ``r = exp(logp - old)``.

    Args:
        logprobs: (B, T) the current policy's (with gradient).
        old_logprobs: (B, T) the policy's before this step's first update (no gradient).
        advantages: (B,) per sequence or (B, T) per token.
        weights: optional (B, T) per-token factors (truncated importance sampling).
    Returns:
        ``(loss, clipped)``: (B, T) per-token losses (unmasked) and a (B, T) bool of the tokens whose
        clipped term was the larger one (no gradient flows through them).
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped_term = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    if weights is not None:
        loss = loss * weights
    return loss, clipped_term > unclipped


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float, num_seqs: float, max_tokens: int
) -> torch.Tensor:
    """This micro-batch's share of the step's loss: its masked per-token losses reduced by ``mode``
    (``rl.config.LOSS_AGG_MODES``) and divided by the whole step's counts, so that the shares of every
    micro-batch and rank add up to the step's loss.

    Args:
        loss, mask: (B, T); mask 1 on response tokens.
        num_tokens: response tokens in the whole step (all micro-batches, all ranks).
        num_seqs: sequences in the whole step.
        max_tokens: the Dr. GRPO constant (``rl.max_tokens``).
    Returns:
        a scalar.
    """
    per_token = torch.where(mask.bool(), loss, 0.0)  # whatever sits off the mask (even inf) adds nothing
    if mode == "token-mean":
        return per_token.sum() / num_tokens
    seq_sums = per_token.sum(dim=1)  # (B,)
    if mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(dim=1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / (num_seqs * max_tokens)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")
