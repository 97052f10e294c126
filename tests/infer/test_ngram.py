"""Prompt lookup (the longest suffix that occurs earlier, its most recent occurrence, what followed),
the draft budget, and assign_drafts' disable_by_batch_size."""

import numpy as np
import pytest

from baige.errors import BaigeError
from baige.runtime.infer.spec_decode.ngram import lookup


def a(*xs):
    return np.array(xs, dtype=np.int64)


def test_the_longest_matching_suffix_wins():
    # suffix [2, 3] occurs at 1; the 1-gram [3] occurs later at 5 (followed by 9), but 2 > 1
    assert lookup(a(1, 2, 3, 4, 5, 3, 9, 2, 3), n_max=3, n_min=1, k=2) == [4, 5]


def test_the_most_recent_occurrence_wins_and_k_caps():
    assert lookup(a(7, 1, 2, 7, 3, 4, 5, 7), n_max=2, n_min=1, k=2) == [3, 4]
    assert lookup(a(7, 1, 2, 7, 3, 4, 5, 7), n_max=2, n_min=1, k=10) == [3, 4, 5, 7]


def test_no_match_or_below_the_minimum_proposes_nothing():
    assert lookup(a(1, 2, 3, 4), n_max=3, n_min=1, k=4) == []
    assert lookup(a(5, 6, 1, 6), n_max=3, n_min=2, k=4) == []  # only a 1-gram matches
    assert lookup(a(5), n_max=3, n_min=1, k=4) == []
    assert lookup(a(5, 5), n_max=3, n_min=1, k=4) == [5]
    assert lookup(a(1, 2, 1), n_max=3, n_min=1, k=0) == []


def test_the_draft_budget_follows_the_expected_tokens_per_cost():
    """Hand-computed values (1 + p + .. + p^n) / (1 + 0.1 n) of n drafts at acceptance p."""
    from baige.runtime.infer.spec_decode.proposer import DraftBudget

    b = DraftBudget(4)
    # prior p = 1/2: n=1 1.5/1.1 = 1.364, n=2 1.75/1.2 = 1.458, n=3 1.875/1.3 = 1.442, n=4 1.9375/1.4 = 1.384
    assert b.take() == 2
    b.update(2, 2)  # accepted 0.85 + 2, rejected 0.85 (none this step): p = 2.85 / 3.7 = 0.770
    assert (round(b.accepted, 4), round(b.rejected, 4)) == (2.85, 0.85)
    assert b.take() == 4  # n=3 2.583/1.3 = 1.987 < n=4 2.935/1.4 = 2.097
    b.update(4, 0)  # accepted 2.4225, rejected 1.7225: p = 0.5845
    assert b.take() == 3  # n=3 2.126/1.3 = 1.635 > n=4 2.242/1.4 = 1.601 > n=2 1.926/1.2 = 1.605
    low = DraftBudget(4, accepted=0.5, rejected=5.0)  # p = 0.0909: one draft 1.0909/1.1 = 0.992 < 1
    assert [low.take() for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]  # plain steps, a probe every 4th
    low.update(1, 1)  # the probe kept: accepted 1.425, rejected 4.25, p = 0.251 -> n=1 1.137 > n=2 1.095
    assert low.take() == 1
    assert DraftBudget(4, row_cost=0.0).take() == 4  # free rows: always all k
    assert DraftBudget(4, row_cost=1.0).take() == 0  # rows as dear as a step: never worth it at p = 1/2


def test_disable_by_batch_size_stops_proposing_above_it():
    """assign_drafts with a recording proposer over decoding sequences (stand-ins with the fields it
    reads): 3 decoding (+1 mid-prefill, not counted) with disable_by_batch_size 2 -> no proposal and
    no budget consumed; with 3 -> every decoding sequence gets its drafts."""
    from types import SimpleNamespace

    from baige.runtime.config import SpeculativeConfig
    from baige.runtime.infer.spec_decode.proposer import Proposal, Proposer, assign_drafts

    class Recording(Proposer):
        calls = 0

        def propose(self, seqs, budgets, rows):
            Recording.calls += 1
            return [Proposal([7] * b) for b in budgets]

    def seq(computed):
        return SimpleNamespace(
            token_ids=[1, 2, 3, 4],
            num_computed_tokens=computed,
            max_tokens=50,
            num_output_tokens=1,
            spec_budget=None,
            payload=SimpleNamespace(grammar=None, pending_grammar=None),
            spec_token_ids=[],
            spec_draft_probs=None,
        )

    running = [seq(3), seq(3), seq(3), seq(1)]
    assign_drafts(Recording(), running, 4, 64, lambda s: None, disable_by_batch_size=2)
    assert Recording.calls == 0 and all(s.spec_budget is None and s.spec_token_ids == [] for s in running)
    assign_drafts(Recording(), running, 4, 64, lambda s: None, disable_by_batch_size=3)
    assert Recording.calls == 1 and [s.spec_token_ids for s in running] == [[7, 7]] * 3 + [[]]  # prior budget 2
    assert (
        SpeculativeConfig.parse(
            '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}'
        ).disable_by_batch_size
        == 8
    )
    with pytest.raises(BaigeError, match=r"disable_by_batch_size must be an integer >= 1 or null, got 0"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}')
