"""The proposer interface: what verification needs from anything that guesses tokens.

A proposer sees the sequences about to decode and returns per sequence up to its budget of draft
tokens, with the distribution each was drawn from when it drew at random (None: chosen
deterministically, which the rejection sampler treats as a one-hot draft distribution). Nothing
else crosses the boundary, so a trained head (EAGLE, MTP) is one more subclass: it needs the
target's hidden states, which :meth:`Proposer.propose` may take from ``hidden`` once the runner
passes them (it does not yet).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from baige.runtime.infer.sampling import SamplerRow
from baige.runtime.infer.scheduler import Sequence


@dataclass
class Proposal:
    """Draft tokens for one sequence.

    Attributes:
        token_ids: the draft tokens in order (may be empty: the sequence then simply decodes).
        probs: (len(token_ids), vocab) fp32, the distribution each token was drawn from, or None
            when they were chosen deterministically (n-gram lookup, greedy drafts).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Guesses tokens for decoding sequences (see the module docstring)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int], rows: list[SamplerRow]) -> list[Proposal]:
        """Draft tokens for each sequence.

        Args:
            seqs: sequences whose K/V is computed up to their last token (they decode next step).
            budgets: per sequence the most tokens to propose (>= 0; never past max_tokens or the
                context limit).
            rows: per sequence its sampling inputs (a draft model samples under the same settings).
        Returns:
            One :class:`Proposal` per sequence, at most ``budgets[i]`` tokens each.
        """

    def release(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished or preempted): free whatever the proposer holds for it."""
