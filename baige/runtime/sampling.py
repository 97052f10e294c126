"""Sampling parameters and batched token sampling.

Filters follow the usual definitions: top-k keeps the k most likely tokens; top-p (nucleus,
Holtzman et al. 2019, arXiv:1904.09751) keeps the smallest set whose probability reaches p;
min-p keeps tokens with probability >= min_p * p_max (Nguyen et al. 2024, arXiv:2407.01082).
Temperature 0 is greedy whatever the filters say.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baige.errors import BaigeError


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise BaigeError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BaigeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise BaigeError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise BaigeError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BaigeError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_filters(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (set to -inf) the tokens top-k, top-p and min-p exclude.

    Args:
        logits: (B, vocab) float, already divided by the temperature.
    Returns:
        (B, vocab) with excluded entries at -inf; the most likely token always survives.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token of each row.

    Args:
        logits: (B, vocab), any float dtype; computed in fp32.
        params: shared by every row.
        generator: seeded RNG for reproducible sampling (None: torch's global RNG).
    Returns:
        (B,) int64 token ids.
    """
    logits = logits.float()
    if params.greedy:
        return logits.argmax(-1)
    logits = apply_filters(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
