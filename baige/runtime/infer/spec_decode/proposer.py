"""The proposer interface: what verification needs from anything that guesses tokens.

A proposer sees the sequences about to decode and returns per sequence up to its budget of draft
tokens, with the distribution each was drawn from when it drew at random (None: chosen
deterministically, which the rejection sampler treats as a one-hot draft distribution). Nothing
else crosses the boundary, so a trained head (EAGLE, MTP) is one more subclass: it needs the
target's hidden states, which :meth:`Proposer.propose` may take from ``hidden`` once the runner
passes them (it does not yet).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baige.runtime.infer.sampling import SamplerRow
from baige.runtime.infer.scheduler import Sequence

logger = logging.getLogger("baige.spec_decode")


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


@dataclass
class DraftBudget:
    """How many drafts one sequence asks for (dynamic speculation length).

    Every draft token costs a row of the verify forward whether or not it is accepted, so a sequence
    whose drafts fail outright asks for fewer: a step that accepted no draft halves the budget, and
    when even a single draft is rejected the sequence stops speculating for 1, 2, 4 .. 16 steps before
    it probes again. A step that accepted some drafts keeps the budget (the proposer was on the right
    text), one that accepted all doubles it (up to ``k``). Copying text stays at ``k``; text with
    nothing to copy costs about one extra verify row every 16 steps.
    """

    k: int
    budget: int = -1  # -1: k
    backoff: int = 0  # steps skipped after the last outright rejection of a single draft
    skip: int = 0  # steps left to skip

    def take(self) -> int:
        """This step's budget (0 while backing off)."""
        if self.skip:
            self.skip -= 1
            return 0
        return self.k if self.budget < 0 else self.budget

    def update(self, num_draft: int, num_accepted: int) -> None:
        """After a verify step of ``num_draft`` drafts whose first ``num_accepted`` were kept."""
        if num_accepted >= num_draft:
            self.budget, self.backoff = min(self.k, max(1, num_draft) * 2), 0
        elif num_accepted > 0:
            self.budget, self.backoff = max(num_draft, self.budget), 0
        elif num_draft > 1:
            self.budget = num_draft // 2
        else:
            self.backoff = min(16, max(1, 2 * self.backoff))
            self.skip, self.budget = self.backoff, 1


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


def assign_drafts(proposer: Proposer, running: list[Sequence], k: int, max_model_len: int,
                  sampler_row: Callable[[Sequence], SamplerRow]) -> None:
    """Ask ``proposer`` for the drafts of the ``running`` sequences that decode next step and set
    their ``spec_token_ids`` / ``spec_draft_probs``.

    A sequence's budget follows its acceptance (:class:`DraftBudget`) and never lets a step emit past
    ``max_tokens`` or ``max_model_len``. A structured-output sequence's drafts are cut before the
    first token its grammar refuses (llguidance's ``validate_tokens``); the engine computes its masks
    at every draft position with the step's other masks. A proposer that raises costs this step's
    speculation only: every sequence then decodes plainly.
    """
    seqs, budgets = [], []
    for seq in running:
        if seq.num_computed_tokens != len(seq.token_ids) - 1:
            continue
        room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
        seqs.append(seq)
        if seq.spec_budget is None:
            seq.spec_budget = DraftBudget(k)
        budgets.append(max(0, min(seq.spec_budget.take(), room)))
    if not seqs:
        return
    try:
        proposals = proposer.propose(seqs, budgets, [sampler_row(s) for s in seqs])
    except Exception:
        logger.exception("the speculative proposer failed; this step decodes without speculation")
        for seq in seqs:
            proposer.release(seq)
        return
    for seq, p in zip(seqs, proposals):
        drafts, probs = list(p.token_ids), p.probs
        grammar = seq.payload.grammar
        if drafts and grammar is not None:
            keep = grammar.validate_tokens(drafts)  # proposals the constraint refuses are never verified
            drafts, probs = drafts[:keep], (probs[:keep] if probs is not None and keep else None)
        seq.spec_token_ids, seq.spec_draft_probs = drafts, probs
