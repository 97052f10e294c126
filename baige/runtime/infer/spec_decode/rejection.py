"""Verification of draft tokens against the target model's distributions.

Greedy rows keep the longest prefix of drafts equal to the target's argmax, then the target's own
next token. Sampling rows use rejection sampling (Leviathan et al. 2023, arXiv:2211.17192,
Algorithm 1; Chen et al. 2023, arXiv:2302.01318): draft token ``x ~ q`` is accepted with probability
``min(1, p(x) / q(x))``; at the first rejection a token is drawn from the residual
``norm(max(0, p - q))``; when every draft is accepted one more is drawn from the next position's
``p``. Each emitted token is then distributed exactly as ``p``, where ``p`` is the target's
distribution after every processor, temperature and filter of the request
(:func:`baige.runtime.infer.sampling.target_probs`), so speculation changes speed, not outputs.
A deterministic proposal (n-gram lookup) is a one-hot ``q``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from baige.runtime.infer.sampling import Logprobs, SamplerRow, target_probs, token_logprobs
from baige.runtime.infer.scheduler import ScheduledBatch


def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``min(1, p / q)`` elementwise, for draft tokens (so ``q > 0``). p, q: (n,) fp32 -> (n,)."""
    return (p / q).clamp(max=1.0)


def verify(
    target: torch.Tensor,
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a sequence emits this step: the accepted drafts, then one of the target's.

    Args:
        target: (n + 1, vocab) fp32, the target's distribution at each position (row i scores the
            token after the context plus drafts ``0..i-1``); greedy rows are one-hot.
        draft_ids: the n draft tokens.
        draft_probs: (n, vocab) fp32, the distribution each draft was drawn from; None: one-hot
            (deterministic proposals).
        greedy: compare with the argmax instead of sampling (exact for temperature 0).
        generator: the sequence's RNG for the uniform draws and the residual / bonus draws.
    Returns:
        1 .. n + 1 token ids.
    """
    n = len(draft_ids)
    if greedy:
        best = target.argmax(-1).tolist()
        out = []
        for i, d in enumerate(draft_ids):
            out.append(best[i])
            if d != best[i]:
                return out
        return out + [best[n]]
    dev = target.device
    ids = torch.tensor(draft_ids, dtype=torch.long, device=dev)
    rows = torch.arange(n, device=dev)
    p = target[rows, ids]
    q = draft_probs[rows, ids] if draft_probs is not None else torch.ones(n, device=dev)
    u = torch.rand(n, generator=generator, device=dev)
    rejected = (u >= accept_probability(p, q)).tolist()
    j = rejected.index(True) if any(rejected) else n
    if j == n:
        dist = target[n]
    else:
        q_j = (
            draft_probs[j]
            if draft_probs is not None
            else torch.zeros_like(target[j]).index_fill(0, ids[j : j + 1], 1.0)
        )
        dist = (target[j] - q_j).clamp(min=0)
        if not float(dist.sum()) > 0:  # p == q up to rounding: a rejection had probability 0
            dist = target[j]
    last = int(torch.multinomial(dist / dist.sum(), 1, generator=generator))
    return draft_ids[:j] + [last]


def verify_drafts(
    batch: ScheduledBatch,
    rows: list[SamplerRow | None],
    logits: torch.Tensor,
    spec: list[tuple[int, int, int]],
    tokens: list[list[int]],
    logprobs: list[list[Logprobs | None]],
) -> None:
    """Verify the draft tokens of a step's speculating sequences (:func:`verify` each), filling
    ``tokens`` and ``logprobs`` (per batch index) in place.

    Args:
        batch: the step; rows: per batch index its sampling inputs (and ``token_mask``: (vocab,) or
            (drafts + 1, vocab) per position of a constrained sequence).
        logits: (R, vocab) the step's sampling rows.
        spec: per speculating sequence ``(batch index, first row in logits, rows = drafts + 1)``.
    """
    pos_rows, at = [], []
    for i, first, n in spec:
        drafts, mask = batch.seqs[i].spec_token_ids, rows[i].token_mask
        pos_rows += [
            rows[i].with_outputs(drafts[:j])
            if mask is None
            else replace(rows[i].with_outputs(drafts[:j]), token_mask=mask[j])
            for j in range(n)
        ]
        at += range(first, first + n)
    sub = logits[torch.tensor(at, dtype=torch.long, device=logits.device)]
    probs = target_probs(sub, pos_rows)  # (sum n, vocab)
    off = 0
    for i, first, n in spec:
        seq, row = batch.seqs[i], rows[i]
        emitted = verify(
            probs[off : off + n], seq.spec_token_ids, seq.spec_draft_probs, row.params.greedy, row.generator
        )
        tokens[i] = emitted
        k = row.params.logprobs
        logprobs[i] = token_logprobs(sub[off : off + len(emitted)], emitted, [k] * len(emitted))
        off += n
