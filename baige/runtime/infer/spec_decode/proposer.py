"""The proposer interface: what verification needs from anything that guesses tokens.

A proposer sees the sequences about to decode and returns per sequence up to its budget of draft
tokens, with the distribution each was drawn from when it drew at random (None: chosen
deterministically, which the rejection sampler treats as a one-hot draft distribution). Nothing
else crosses the boundary, so a trained head (EAGLE, MTP) is one more subclass: one that sets
``needs_hidden`` gets the target's final hidden states of every row the runner computed
(:meth:`Proposer.observe`) before each :meth:`Proposer.propose`.
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
    """How many drafts one sequence asks for (dynamic speculation length), by expected value.

    Model (Leviathan et al. 2023, arXiv:2211.17192: expected tokens per step and the walltime
    improvement (1 - a^(g+1)) / ((1 - a)(g c + 1)) used to choose g): each draft is accepted with
    probability ``p`` given the ones before it were, so a step with n drafts emits
    ``1 + p + ... + p^n`` tokens in expectation; it costs ``1 + row_cost * n`` one-token steps (c is
    here a verify row's cost, not a draft model's). :meth:`take` asks for the n in 0..k with the
    most expected tokens per cost. ``p`` is estimated per sequence from decayed counts (``decay`` per
    verify step) of accepted drafts and of rejections (a step that kept all its drafts observed no
    rejection; prior: one of each, p = 0.5). While the best n is 0 the sequence decodes plainly and
    probes with one draft every ``probe`` steps, so text that becomes copyable again is noticed.

    ``row_cost``: a verify row's cost relative to a one-token decode step. At batch 1 on the CPU (the
    embedded 135M model, the native decode step) a row measured below this default, so 0.1 errs on
    the cautious side (docs/benchmarks/archive.md, "Speculative decoding"). With it and k = 4:
    p < 0.11 -> 0 drafts, < 0.36 -> 1, < 0.54 -> 2, < 0.66 -> 3, else 4. (It replaces a
    halve-and-back-off rule that, replayed offline on the benchmark's greedy outputs, left much of the
    copy prompts' speed-up unused: scripts/bench_spec_decode.py, the same archive section.)
    """

    k: int
    row_cost: float = 0.1
    decay: float = 0.85
    probe: int = 4
    accepted: float = 1.0  # decayed count of accepted drafts
    rejected: float = 1.0  # decayed count of verify steps that rejected a draft
    idle: int = 0  # plain steps since the last draft

    def take(self) -> int:
        """This step's number of drafts (0: decode plainly)."""
        p = self.accepted / (self.accepted + self.rejected)
        best, n_best, expected = 1.0, 0, 1.0
        for n in range(1, self.k + 1):
            expected += p**n
            value = expected / (1.0 + self.row_cost * n)
            if value > best:
                best, n_best = value, n
        if n_best:
            return n_best
        self.idle += 1
        if self.idle >= self.probe:
            self.idle = 0
            return 1
        return 0

    def update(self, num_draft: int, num_accepted: int) -> None:
        """After a verify step of ``num_draft`` (>= 1) drafts whose first ``num_accepted`` were kept."""
        self.accepted = self.accepted * self.decay + num_accepted
        self.rejected = self.rejected * self.decay + (1.0 if num_accepted < num_draft else 0.0)
        self.idle = 0


class Proposer(ABC):
    """Guesses tokens for decoding sequences (see the module docstring)."""

    needs_hidden = False  # True: the runner keeps every row's final hidden state for observe()

    def observe(self, hidden: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """The target's steps since the last proposal: per computed chunk ``(sequence, position of its
        first row, (rows, hidden) final hidden states in position order)``, rejected draft rows included
        (a proposer keeps what is still part of the sequence). Called only when ``needs_hidden``."""

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


def assign_drafts(
    proposer: Proposer,
    running: list[Sequence],
    k: int,
    max_model_len: int,
    sampler_row: Callable[[Sequence], SamplerRow],
    disable_by_batch_size: int | None = None,
) -> None:
    """Ask ``proposer`` for the drafts of the ``running`` sequences that decode next step and set
    their ``spec_token_ids`` / ``spec_draft_probs``.

    A sequence's budget follows its acceptance (:class:`DraftBudget`) and never lets a step emit past
    ``max_tokens`` or ``max_model_len``. A structured-output sequence's drafts are cut before the
    first token its grammar refuses (llguidance's ``validate_tokens``); the engine computes its masks
    at every draft position with the step's other masks. A proposer that raises costs this step's
    speculation only: every sequence then decodes plainly. With more decoding sequences than
    ``disable_by_batch_size`` (not None), nothing is proposed this step.
    """
    seqs = [seq for seq in running if seq.num_computed_tokens == len(seq.token_ids) - 1]
    if not seqs or (disable_by_batch_size is not None and len(seqs) > disable_by_batch_size):
        return
    budgets = []
    for seq in seqs:
        room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
        if seq.spec_budget is None:
            seq.spec_budget = DraftBudget(k)
        budgets.append(max(0, min(seq.spec_budget.take(), room)))
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
        end = seq.payload.params.reasoning_end_token_id if seq.payload.pending_grammar is not None else None
        if end in drafts:  # the end of reasoning only as a step's last token: the constraint masks what follows
            cut = drafts.index(end)
            drafts, probs = drafts[:cut], (probs[:cut] if probs is not None and cut else None)
        if drafts and grammar is not None:
            keep = grammar.validate_tokens(drafts)  # proposals the constraint refuses are never verified
            drafts, probs = drafts[:keep], (probs[:keep] if probs is not None and keep else None)
        seq.spec_token_ids, seq.spec_draft_probs = drafts, probs
