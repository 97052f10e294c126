"""One step's flat inputs (:class:`StepInputs`), the paged-attention metadata the model reads them
through (:class:`PagedAttentionMetadata`, which owns the cache writes), and :func:`forward_step`:
what the runner runs on rank 0 and every tensor-parallel worker runs on its shard (``tp_worker.py``);
and how decode rows are grouped into paged-decode calls (:func:`group_by_width`).

Layout of one step: see ``runner.py`` (decode rows first, then each prefill chunk's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baige import kernels
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.model.transformer import Transformer


@dataclass
class SlidingInputs:
    """The sliding-window layers' side of one step when they have a pool of their own (``kv_cache.py``,
    ``block_manager.py``): the same rows, context lengths and decode grouping as the full layers', with
    slots and block tables from each sequence's ``sliding_table``."""

    slot_mapping: torch.Tensor  # (T,) int64
    decode_tables: list[torch.Tensor]  # per decode group (S_g, W_g) int64, as decode_groups' tables
    prefill_block_tables: torch.Tensor | None = None  # (P, W) int64


def sliding_view(kv: KVCache, tensor, row_seqs: list, positions: list[int], groups: list, prefills: list):
    """:class:`SlidingInputs` of a step: ``row_seqs`` / ``positions`` per flat row (step order), ``groups``
    the full layers' decode groups (over the first rows), ``prefills`` the prefilling sequences in order;
    ``tensor`` makes a device tensor from nested lists. Tables are padded with the sliding scratch block."""
    bs, scratch = kv.block_size, kv.sliding_scratch
    slots = [seq.sliding_table[p // bs] * bs + p % bs for seq, p in zip(row_seqs, positions)]
    decode_tables, r = [], 0
    for tables, _ in groups:
        n, w = tables.shape
        rows = [row_seqs[r + i].sliding_table[:w] for i in range(n)]
        decode_tables.append(tensor([t + [scratch] * (w - len(t)) for t in rows]))
        r += n
    pre = None
    if prefills:
        w = max(len(seq.sliding_table) for seq in prefills)
        pre = tensor([seq.sliding_table + [scratch] * (w - len(seq.sliding_table)) for seq in prefills])
    return SlidingInputs(tensor(slots), decode_tables, pre)


@dataclass
class PagedAttentionMetadata:
    """Attention metadata of one step (see ``model.AttentionMetadata``); owns the cache writes.

    Tokens ``0 .. num_decodes-1`` are decodes (one per sequence), the rest prefill chunks.
    """

    k_cache: list[torch.Tensor]  # per layer (n_kv_heads, num_blocks + 1, block_size, head_dim)
    v_cache: list[torch.Tensor]
    slot_mapping: torch.Tensor  # (T,) int64
    num_decodes: int
    # consecutive groups of decode rows: (block_tables (S_g, W_g) int64, context_lens (S_g,) int64)
    decode_groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    prefill_block_tables: torch.Tensor | None = None  # (P, W) int64
    prefill_cu_seqlens: torch.Tensor | None = None  # (P + 1,) int64
    prefill_context_lens: torch.Tensor | None = None  # (P,) int64
    # the sliding-window layers' slots and tables (their own pool); None: they use the ones above
    sliding: SlidingInputs | None = None

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: (1, T, n_heads, D); k, v: (1, T, n_kv_heads, D) -> (1, T, n_heads, D); ``window``, ``sinks``,
        ``softcap`` as :func:`baige.kernels.attention`'s. A layer with a window reads and writes the
        sliding pool through ``sliding`` when it is set."""
        kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]
        q, k, v = q[0], k[0], v[0]  # (T, H, D), (T, Hkv, D)
        own = self.sliding if window is not None else None
        kernels.store_kv(k, v, kc, vc, self.slot_mapping if own is None else own.slot_mapping)
        extra = {"window": window, "sinks": sinks, "softcap": softcap}
        nd = self.num_decodes
        parts = []
        row = 0
        for g, (tables, lens) in enumerate(self.decode_groups):
            n = tables.shape[0]
            tables = tables if own is None else own.decode_tables[g]
            parts.append(kernels.paged_decode_attention(q[row : row + n], kc, vc, tables, lens, scale, **extra))
            row += n
        if nd < q.shape[0]:
            tables = self.prefill_block_tables if own is None else own.prefill_block_tables
            cu, lens = self.prefill_cu_seqlens, self.prefill_context_lens
            parts.append(kernels.paged_prefill_attention(q[nd:], kc, vc, tables, cu, lens, scale, **extra))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out[None]  # (1, T, H, D)


@dataclass
class StepInputs:
    """One forward's inputs without the cache tensors: what rank 0 sends every tensor-parallel
    worker each step (``tp_worker.py``), and what :func:`forward_step` runs on any rank."""

    input_ids: torch.Tensor  # (1, T) int64
    positions: torch.Tensor  # (1, T) int64
    slot_mapping: torch.Tensor  # (T,) int64
    num_decodes: int
    decode_groups: list[tuple[torch.Tensor, torch.Tensor]]  # as PagedAttentionMetadata's
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    # per logits set the flattened token rows to project through lm_head (None: every row)
    logit_rows: list[torch.Tensor | None] = field(default_factory=lambda: [None])
    # the flattened token rows whose final hidden states pooling sequences need (None: none)
    hidden_rows: torch.Tensor | None = None
    sliding: SlidingInputs | None = None  # as PagedAttentionMetadata's


def forward_step(model: Transformer, kv: KVCache, s: StepInputs) -> list[torch.Tensor]:
    """Run the model on one step's flat tokens over the paged cache ``kv`` (writing their K/V);
    returns per ``s.logit_rows`` entry the logits ``(rows, vocab)`` in the model dtype (on a
    tensor-parallel worker: its vocabulary slice, discarded), then, when ``s.hidden_rows`` is set, the
    final hidden states ``(rows, hidden)`` of those rows (after the last norm; replicated on every rank)."""
    md = PagedAttentionMetadata(
        kv.k,
        kv.v,
        s.slot_mapping,
        s.num_decodes,
        s.decode_groups,
        s.prefill_block_tables,
        s.prefill_cu_seqlens,
        s.prefill_context_lens,
        s.sliding,
    )
    hidden = model(s.input_ids, s.positions, md)[0]  # (T, hidden)
    out = [model.compute_logits(hidden if rows is None else hidden[rows]) for rows in s.logit_rows]
    return out if s.hidden_rows is None else [*out, hidden[s.hidden_rows]]


# Cost of one extra decode group relative to one padded (sequence, block) of attention work, in
# (sequence, block) units: ~10 small ops per layer against ~25 KB of fp32 K/V per block read
# twice (gather + matmul). A tuning constant: it shapes the grouping, never the results.
GROUP_OVERHEAD_BLOCKS = 6


def group_by_width(widths: list[int], overhead: int = GROUP_OVERHEAD_BLOCKS) -> list[int]:
    """Split ascending block counts into consecutive groups minimising padded work.

    Cost of a group = rows * (its widest row) + ``overhead`` (dynamic programming, O(n * distinct)).

    Args:
        widths: per row its block count, ascending.
    Returns:
        The end index of each group, ascending, the last one ``len(widths)``.
    """
    n = len(widths)
    best, cut = [0] + [0] * n, [0] * (n + 1)
    starts = [i for i in range(n) if i == 0 or widths[i] != widths[i - 1]]  # cut only where widths change
    for j in range(1, n + 1):
        if j < n and widths[j] == widths[j - 1]:
            continue  # never end a group inside a run of equal widths
        best[j], cut[j] = min((best[i] + (j - i) * widths[j - 1] + overhead, i) for i in starts if i < j)
    ends, j = [], n
    while j:
        ends.append(j)
        j = cut[j]
    return ends[::-1]


@dataclass
class StepRows:
    """Where a mixed step's flattened rows go after the forward (the runner's ``_run_mixed``): the rows
    that sample a token, the prompt rows scored for prompt logprobs, and the rows whose hidden states
    pooling sequences need.

    Attributes:
        sample_at: flat rows that sample; ``spans`` per sampling sequence ``(batch index, first entry of
            sample_at, entries)``.
        score_at, score_targets: flat rows scored for prompt logprobs and the prompt token each scores;
            ``score_spans`` per scoring sequence ``(batch index, first prompt token scored, tokens)``.
        pool_at: flat rows whose final hidden states are pooled; ``pool_spans`` per pooling sequence
            ``(batch index, first prompt position of its chunk, entries of pool_at)``.
    """

    sample_at: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    score_at: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_spans: list[tuple[int, int, int]] = field(default_factory=list)
    pool_at: list[int] = field(default_factory=list)
    pool_spans: list[tuple[int, int, int]] = field(default_factory=list)

    def decode(self, i: int, seq, flat: list[int], position: int) -> None:
        """Sequence ``i`` computes decode rows at flat rows ``flat`` (its last token at prompt
        ``position`` first): they sample, or, for a pooling sequence (one row), may be pooled."""
        if seq.pooling is None:
            self.spans.append((i, len(self.sample_at), len(flat)))
            self.sample_at += flat
        else:
            self._pool(i, seq, position, position + 1, flat[0])

    def prefill(self, i: int, seq, start: int, end: int, base: int) -> None:
        """Sequence ``i`` computes positions ``[start, end)`` at flat rows ``base ..``: score them for
        prompt logprobs when asked (position p's logits score token p + 1), sample after the last one
        when the chunk ends the sequence, or pool the rows its pooling needs."""
        if seq.pooling is not None:
            self._pool(i, seq, start, end, base)
            return
        if seq.prompt_logprobs is not None:
            last = min(end, seq.num_prompt_tokens - 1)
            if last > start:
                self.score_spans.append((i, start + 1, last - start))
                self.score_at += range(base, base + last - start)
                self.score_targets += seq.token_ids[start + 1 : last + 1]
        if end == len(seq.token_ids):
            self.spans.append((i, len(self.sample_at), 1))
            self.sample_at.append(base + end - start - 1)

    def _pool(self, i: int, seq, start: int, end: int, base: int) -> None:
        want = seq.pooling.positions(start, end)
        if len(want):
            self.pool_spans.append((i, start, len(want)))
            self.pool_at += [base + p - start for p in want]

    def pooled(self, hidden: torch.Tensor | None) -> list[tuple[int, int, torch.Tensor]]:
        """Per pooling sequence ``(batch index, chunk start, its rows of hidden)`` from the hidden
        states of ``pool_at`` ((len(pool_at), hidden))."""
        out, at = [], 0
        for i, start, n in self.pool_spans:
            out.append((i, start, hidden[at : at + n]))
            at += n
        return out
