"""The trainer's side of a step's samples: padded micro-batches with their response masks, and the
policy's log-probabilities of the sampled tokens (the one function that computes them).

A sequence is ``prompt_ids + completion_ids``; target position ``t`` predicts token ``t + 1``, so the
response tokens are targets ``[len(prompt) - 1, len(prompt) - 1 + len(completion))``. Sequences are
right-padded (causal attention: padding after a sequence never reaches it) and the padding, like
the prompt, carries no loss (``mask`` 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baige.runtime.train.rl.rollout import Sample

PAD_ID = 0  # any id: padded positions are masked out


@dataclass
class MicroBatch:
    """B sequences; T = the longest sequence - 1 target positions."""

    input_ids: torch.Tensor  # (B, T + 1) int64
    mask: torch.Tensor  # (B, T) fp32: 1 on response targets
    engine_logprobs: torch.Tensor  # (B, T) fp32: the engine's logprobs of the sampled tokens, 0 off the mask
    advantages: torch.Tensor  # (B,) fp32
    lengths: list[int]  # each sequence's real length (prompt + completion)

    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt and completion) the trainer's forward runs over."""
        return sum(self.lengths)


def micro_batches(samples: list[Sample], advantages: list[float], size: int, device: torch.device) -> list[MicroBatch]:
    """The samples in order, ``size`` sequences per micro-batch."""
    out = []
    for start in range(0, len(samples), size):
        chunk = samples[start : start + size]
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in chunk]
        width = max(lengths)
        ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.int64)
        mask = torch.zeros(len(chunk), width - 1)
        engine = torch.zeros(len(chunk), width - 1)
        for b, s in enumerate(chunk):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            ids[b, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
            mask[b, p - 1 : p - 1 + c] = 1.0
            engine[b, p - 1 : p - 1 + c] = torch.tensor(s.engine_logprobs)
        adv = torch.tensor(advantages[start : start + size], dtype=torch.float32)
        out.append(MicroBatch(ids.to(device), mask.to(device), engine.to(device), adv.to(device), lengths))
    return out


def _plain_logprobs(model: nn.Module, mb: MicroBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's forward over the padded batch (causal, positions from 0); logits only at the
    response targets. Returns (B, T) fp32 logprobs (0 off the mask) and, when asked, the (B, T) entropy
    of the next-token distribution there (no gradient)."""
    ids = mb.input_ids
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (B, T + 1)
    hidden = model(ids, positions)[:, :-1]  # (B, T, hidden)
    where = mb.mask.bool()
    logits = model.compute_logits(hidden[where]).float()  # (N, vocab), N response tokens
    logp = torch.log_softmax(logits, dim=-1)  # (N, vocab)
    chosen = logp.gather(1, ids[:, 1:][where][:, None])[:, 0]  # (N,)
    out = torch.zeros(mb.mask.shape, dtype=torch.float32, device=ids.device).masked_scatter(where, chosen)
    if not entropy:
        return out, None
    with torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)  # (N,)
        return out, torch.zeros_like(mb.mask).masked_scatter(where, ent)


def policy_logprobs(
    model: nn.Module, mb: MicroBatch, batch_invariant: bool, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's log-probabilities of the sampled tokens, (B, T) fp32 with gradient (0 off the mask),
    and with ``entropy`` the (B, T) token entropies (nats, no gradient).

    With ``batch_invariant`` each sequence runs alone through
    :func:`baige.runtime.model.logprobs.sequence_logprobs`, whose values equal the engine's
    sampled-token logprobs bitwise; the entropy then takes a plain forward of its own.
    """
    if not batch_invariant:
        return _plain_logprobs(model, mb, entropy)
    from baige.runtime.model.logprobs import sequence_logprobs

    rows = []
    for b, n in enumerate(mb.lengths):
        lp = sequence_logprobs(model, mb.input_ids[b, :n], batch_invariant=True)  # (n - 1,)
        rows.append(torch.nn.functional.pad(lp, (0, mb.mask.shape[1] - (n - 1))))
    out = torch.stack(rows) * mb.mask  # (B, T)
    if not entropy:
        return out, None
    with torch.no_grad():
        return out, _plain_logprobs(model, mb, True)[1]
