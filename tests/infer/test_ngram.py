"""Prompt lookup: the longest suffix that occurs earlier, its most recent occurrence, what followed."""

import numpy as np

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


def test_the_draft_budget_halves_on_outright_rejection_and_backs_off():
    from baige.runtime.infer.spec_decode.proposer import DraftBudget

    b = DraftBudget(4)
    assert b.take() == 4
    b.update(4, 1)  # some accepted: the proposer was on the right text, keep asking for 4
    assert b.take() == 4
    b.update(4, 0)  # none accepted: halve
    assert b.take() == 2
    b.update(2, 2)  # all accepted: double
    assert b.take() == 4
    b.update(4, 0)
    b.update(2, 0)
    assert b.take() == 1
    b.update(1, 0)  # a single draft rejected outright: skip 1 step, then probe with 1
    assert [b.take() for _ in range(2)] == [0, 1]
    b.update(1, 0)  # again: skip 2
    assert [b.take() for _ in range(3)] == [0, 0, 1]
    for _ in range(6):
        b.update(1, 0)
        while b.take() == 0:
            pass
    assert b.backoff == 16  # capped
    b.update(1, 1)
    assert (b.take(), b.backoff) == (2, 0)
