"""The trainer's side of a step's samples: micro-batches that compute each prompt once for all of its
samples, their response masks, and the policy's log-probabilities of the sampled tokens (the one
function that computes them).

A micro-batch packs its samples by prompt: one row holds a prompt followed by the completions of its
samples, each completion at positions ``len(prompt) ..`` and attending to the prompt and to its own
earlier tokens only (a shared-prefix mask), so a group of G samples costs ``prompt + G x completion``
tokens instead of ``G x (prompt + completion)``. Completion token ``t`` of a sample is predicted by the
hidden state of the prompt's last token (``t = 0``) or of its own token ``t - 1``. Rows are right-padded;
padding, like the prompt, carries no loss. The per-sample tensors are completion-aligned: (S, C) with
C the longest completion of the micro-batch.

The attention of a bf16 / fp16 CPU forward (:class:`_SharedPrefix`) does not run over the (R, L, L) mask,
most of which is masked out (each completion hides its row's other completions): it gathers each prompt
(causal, (R, P, P)) and each completion with its prompt's keys ((S, C, P + C)) into blocks of their own
(:class:`SegmentIndex`), attends within them and scatters the outputs back, the same keys for every
query. fp32 and other devices keep the full-mask attention.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from baige import kernels
from baige.runtime.train.rl.rollout import Sample

PAD_ID = 0  # any id: padded positions are masked out
PROMPT, PAD = 0, -1  # segment ids: the prompt, padding; completions are 1, 2, ... within their row


@dataclass
class SegmentIndex:
    """Where each attention block of a packed micro-batch's rows lives (flat indices ``row * L + column``
    into its (R, L) tokens); padded entries of a block hold index 0 and attend to their key 0 only."""

    prompt: torch.Tensor  # (R, P) int64: each row's prompt tokens, P the longest prompt
    prompt_mask: torch.Tensor  # (R, P, P) bool: causal over the row's prompt
    queries: torch.Tensor  # (S, C) int64: each sample's completion tokens
    keys: torch.Tensor  # (S, K) int64: its prompt's tokens, then its completion's (K = max prompt + completion)
    keys_mask: torch.Tensor  # (S, C, K) bool: completion token c sees the prompt and its own tokens <= c
    prompt_valid: torch.Tensor  # (R, P) bool
    queries_valid: torch.Tensor  # (S, C) bool
    out: torch.Tensor  # (N,) int64: the flat index of each valid prompt entry, then of each valid query

    def to(self, device: torch.device) -> SegmentIndex:
        return SegmentIndex(*(getattr(self, f.name).to(device) for f in fields(self)))


def _segment_index(rows: list[list[int]], prompts: list[int], lengths: list[int], width: int) -> SegmentIndex:
    """:class:`SegmentIndex` of rows holding ``rows[r]`` samples (indices) after a prompt of ``prompts[r]``
    tokens; sample ``j`` has ``lengths[j]`` completion tokens, placed in its row's order."""
    R, S = len(rows), len(lengths)
    P, C = max(prompts), max(1, max(lengths))
    K = max(prompts[r] + lengths[j] for r, js in enumerate(rows) for j in js)
    prompt, queries = torch.zeros(R, P, dtype=torch.int64), torch.zeros(S, C, dtype=torch.int64)
    keys = torch.zeros(S, K, dtype=torch.int64)
    p_valid, q_valid = torch.zeros(R, P, dtype=torch.bool), torch.zeros(S, C, dtype=torch.bool)
    p_mask, k_mask = torch.zeros(R, P, P, dtype=torch.bool), torch.zeros(S, C, K, dtype=torch.bool)
    p_mask[:, :, 0] = k_mask[:, :, 0] = True  # padded queries: key 0 (a finite softmax, never read)
    for r, js in enumerate(rows):
        n_p, base, off = prompts[r], r * width, prompts[r]
        prompt[r, :n_p] = torch.arange(base, base + n_p)
        p_valid[r, :n_p] = True
        p_mask[r, :n_p, :n_p] = torch.ones(n_p, n_p, dtype=torch.bool).tril()
        for j in js:
            n = lengths[j]
            queries[j, :n] = torch.arange(base + off, base + off + n)
            keys[j, :n_p], keys[j, n_p : n_p + n] = prompt[r, :n_p], queries[j, :n]
            q_valid[j, :n] = True
            k_mask[j, :n, : n_p + n] = torch.ones(n, n_p + n, dtype=torch.bool).tril(n_p)
            off += n
    out = torch.cat([prompt[p_valid], queries[q_valid]])
    return SegmentIndex(prompt, p_mask, queries, keys, k_mask, p_valid, q_valid, out)


@dataclass
class MicroBatch:
    """S samples packed into R rows of L tokens (see the module docstring)."""

    input_ids: torch.Tensor  # (R, L) int64: a prompt, then its samples' completions, then padding
    positions: torch.Tensor  # (R, L) int64: RoPE positions (each completion starts at its prompt's length)
    segments: torch.Tensor  # (R, L) int64: PROMPT, the row's k-th completion (k >= 1), or PAD
    sources: torch.Tensor  # (S, C) int64: flat index (row * L + column) of the hidden state predicting each token
    targets: torch.Tensor  # (S, C) int64: the completion tokens (PAD_ID off the mask)
    mask: torch.Tensor  # (S, C) fp32: 1 on completion tokens
    engine_logprobs: torch.Tensor  # (S, C) fp32: the engine's logprobs of the sampled tokens, 0 off the mask
    advantages: torch.Tensor  # (S,) fp32
    sequences: list[list[int]]  # (S,) each sample's prompt + completion ids (the per-sequence path)
    blocks: SegmentIndex  # the attention blocks of the rows (the bf16 / fp16 CPU forward)

    @property
    def num_seqs(self) -> int:
        return len(self.sequences)

    def forward_tokens(self, batch_invariant: bool) -> int:
        """Real tokens the trainer's forward runs over: the packed rows' (each prompt once), or with
        ``batch_invariant`` every sequence whole."""
        if batch_invariant:
            return sum(map(len, self.sequences))
        return int((self.segments != PAD).sum())

    def attention_mask(self) -> torch.Tensor:
        """(R, L, L) bool: query i sees key j <= i of the prompt or of its own completion; padding sees
        itself only (a finite softmax; its outputs are never read)."""
        seg = self.segments
        L = seg.shape[1]
        idx = torch.arange(L, device=seg.device)
        causal = idx[None, :] <= idx[:, None]  # (L, L)
        same = (seg[:, None, :] == PROMPT) | (seg[:, None, :] == seg[:, :, None])  # (R, L, L)
        return (causal & same & (seg[:, :, None] != PAD)) | torch.eye(L, dtype=torch.bool, device=seg.device)


def _rows(chunk: list[Sample]) -> list[list[int]]:
    """Indices into ``chunk`` per packed row: consecutive samples of the same prompt share a row."""
    rows: list[list[int]] = []
    for j, s in enumerate(chunk):
        first = chunk[rows[-1][0]] if rows else None
        if first is not None and first.group == s.group and first.prompt_ids == s.prompt_ids:
            rows[-1].append(j)
        else:
            rows.append([j])
    return rows


def _pack(chunk: list[Sample], advantages: list[float], device: torch.device) -> MicroBatch:
    rows = _rows(chunk)
    width = max(len(chunk[js[0]].prompt_ids) + sum(len(chunk[j].completion_ids) for j in js) for js in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.int64)
    pos = torch.zeros(len(rows), width, dtype=torch.int64)
    seg = torch.full((len(rows), width), PAD, dtype=torch.int64)
    C = max(1, max(len(s.completion_ids) for s in chunk))
    sources = torch.zeros(len(chunk), C, dtype=torch.int64)
    targets = torch.full((len(chunk), C), PAD_ID, dtype=torch.int64)
    mask, engine = torch.zeros(len(chunk), C), torch.zeros(len(chunk), C)
    for r, js in enumerate(rows):
        prompt = chunk[js[0]].prompt_ids
        P, off = len(prompt), len(prompt)
        ids[r, :P], pos[r, :P], seg[r, :P] = torch.tensor(prompt), torch.arange(P), PROMPT
        for k, j in enumerate(js, start=1):
            c = chunk[j].completion_ids
            n = len(c)
            ids[r, off : off + n], pos[r, off : off + n], seg[r, off : off + n] = (
                torch.tensor(c),
                torch.arange(P, P + n),
                k,
            )
            # token 0 from the prompt's last position, token t > 0 from the completion's token t - 1
            sources[j, :n] = r * width + torch.tensor([P - 1] + list(range(off, off + n - 1)))
            targets[j, :n], mask[j, :n] = torch.tensor(c), 1.0
            engine[j, :n] = torch.tensor(chunk[j].engine_logprobs)
            off += n
    return MicroBatch(
        ids.to(device), pos.to(device), seg.to(device), sources.to(device), targets.to(device), mask.to(device),
        engine.to(device), torch.tensor(advantages, dtype=torch.float32, device=device),
        [s.prompt_ids + s.completion_ids for s in chunk],
        _segment_index(
            rows, [len(chunk[js[0]].prompt_ids) for js in rows], [len(s.completion_ids) for s in chunk], width
        ).to(device),
    )  # fmt: skip


def micro_batches(samples: list[Sample], advantages: list[float], size: int, device: torch.device) -> list[MicroBatch]:
    """The samples in order, ``size`` sequences per micro-batch, each packed by prompt."""
    return [
        _pack(samples[start : start + size], advantages[start : start + size], device)
        for start in range(0, len(samples), size)
    ]


class _SharedPrefix:
    """The model's attention over a micro-batch's packed rows (an ``AttentionMetadata``): by blocks
    (:class:`SegmentIndex`) for bf16 / fp16 CPU tensors without a window, sinks or soft-cap, else under
    the (R, L, L) mask."""

    def __init__(self, mb: MicroBatch):
        self.mb, self.positions = mb, mb.positions  # (R, L) int64
        self._mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        """(R, L, L) bool, :meth:`MicroBatch.attention_mask` (built on first use)."""
        if self._mask is None:
            self._mask = self.mb.attention_mask()
        return self._mask

    def attend(self, layer_idx: int, q, k, v, scale: float, *, window=None, sinks=None, softcap=None) -> torch.Tensor:
        plain = window is None and sinks is None and softcap is None
        if plain and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            return _block_attention(self.mb.blocks, q, k, v, scale)
        mask = self.mask
        if window is not None:  # on the true positions: each completion continues from its prompt's
            pos = self.positions
            mask = mask & (pos[:, :, None] - pos[:, None, :] < window)
        return kernels.masked_attention(q, k, v, scale, mask, sinks=sinks, softcap=softcap)


def _block_attention(ix: SegmentIndex, q, k, v, scale: float) -> torch.Tensor:
    """The shared-prefix attention of (R, L, heads, D) q / k / v by blocks: each prompt over itself, each
    completion over its prompt and itself (:class:`SegmentIndex`); padding positions get zeros."""
    R, L = q.shape[:2]
    qf, kf, vf = (t.reshape(R * L, *t.shape[2:]) for t in (q, k, v))

    def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # (R * L, ...) -> (*index.shape, ...)
        return t.index_select(0, index.flatten()).view(*index.shape, *t.shape[1:])  # backward: index_add

    attend = kernels.masked_attention  # short blocks: the materialised scores (baige/kernels/train_attention.py)
    prompt = attend(take(qf, ix.prompt), take(kf, ix.prompt), take(vf, ix.prompt), scale, ix.prompt_mask)
    completions = attend(take(qf, ix.queries), take(kf, ix.keys), take(vf, ix.keys), scale, ix.keys_mask)
    values = torch.cat([prompt[ix.prompt_valid], completions[ix.queries_valid]])  # (N, heads, Dv)
    out = values.new_zeros(R * L, *values.shape[1:]).index_copy(0, ix.out, values)
    return out.view(R, L, *values.shape[1:])


def _packed_logprobs(model: nn.Module, mb: MicroBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's forward over the packed rows; logits only where a completion token is predicted.
    Returns (S, C) fp32 logprobs (0 off the mask) and, when asked, the (S, C) entropy of the next-token
    distribution there (no gradient)."""
    hidden = model(mb.input_ids, mb.positions, _SharedPrefix(mb))  # (R, L, hidden)
    where = mb.mask.bool()
    rows = hidden.reshape(-1, hidden.shape[-1])[mb.sources[where]]  # (N, hidden), N completion tokens
    chosen, ent = kernels.token_logprobs(model.compute_logits(rows), mb.targets[where], entropy)  # (N,) each
    out = torch.zeros(mb.mask.shape, dtype=torch.float32, device=mb.mask.device).masked_scatter(where, chosen)
    if ent is None:
        return out, None
    return out, torch.zeros_like(mb.mask).masked_scatter(where, ent)


def policy_logprobs(
    model: nn.Module, mb: MicroBatch, batch_invariant: bool, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's log-probabilities of the sampled tokens, (S, C) fp32 with gradient (0 off the mask),
    and with ``entropy`` the (S, C) token entropies (nats, no gradient).

    With ``batch_invariant`` each sequence runs alone through
    :func:`baige.runtime.model.logprobs.sequence_logprobs`, whose values equal the engine's
    sampled-token logprobs bitwise; the entropy then takes a packed forward of its own.
    """
    if not batch_invariant:
        return _packed_logprobs(model, mb, entropy)
    from baige.runtime.model.logprobs import sequence_logprobs

    rows = []
    C = mb.mask.shape[1]
    for seq, n in zip(mb.sequences, mb.mask.sum(1).long().tolist()):
        ids = torch.tensor(seq, dtype=torch.int64, device=mb.mask.device)
        lp = sequence_logprobs(model, ids, batch_invariant=True)[len(seq) - 1 - n :]  # (n,) the completion's
        rows.append(torch.nn.functional.pad(lp, (0, C - n)))
    out = torch.stack(rows) * mb.mask  # (S, C)
    if not entropy:
        return out, None
    with torch.no_grad():
        return out, _packed_logprobs(model, mb, True)[1]
