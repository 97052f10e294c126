"""Prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; vLLM's
``ngram`` method): the last n tokens of a sequence are looked up earlier in the same sequence
(prompt and output), and the tokens that followed the match are proposed."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from baige.runtime.infer.sampling import SamplerRow
from baige.runtime.infer.scheduler import Sequence
from baige.runtime.infer.spec_decode.proposer import Proposal, Proposer


def lookup(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix.

    Args:
        tokens: (L,) int64, the sequence so far.
        n_max, n_min: suffix lengths tried, longest first.
        k: most tokens returned.
    Returns:
        Up to ``k`` token ids (fewer when the match is near the end; none without a match).
    Cost: O(L * n) per suffix length tried.
    """
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows starting at i < L - n, so at least one token follows each and the suffix itself is excluded
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == tokens[L - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Proposals copied from the sequence itself (see :func:`lookup`); no state between steps."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k, self.n_max, self.n_min = num_speculative_tokens, prompt_lookup_max, prompt_lookup_min

    def propose(self, seqs: list[Sequence], budgets: list[int], rows: list[SamplerRow]) -> list[Proposal]:
        return [
            Proposal(lookup(np.asarray(s.token_ids, dtype=np.int64), self.n_max, self.n_min, min(b, self.k)))
            for s, b in zip(seqs, budgets)
        ]
