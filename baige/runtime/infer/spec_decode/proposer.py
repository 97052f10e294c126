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


def next_budget(budget: int, num_draft: int, num_accepted: int, k: int) -> int:
    """A sequence's draft budget for its next step after a verify step (dynamic speculation length).

    Every draft token costs a row of the verify forward whether or not it is accepted, so a sequence
    whose drafts keep failing should ask for fewer: after a rejection the budget becomes the run that
    was accepted plus one (at least 1, so the proposer keeps probing); after a fully accepted step it
    doubles, up to ``k``. Copying text ramps to ``k`` within a few steps; open-ended text settles at
    one draft per step.
    """
    if num_accepted >= num_draft:
        return min(k, max(1, budget) * 2)
    return max(1, num_accepted + 1)


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
