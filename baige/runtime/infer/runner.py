"""ModelRunner: a scheduled batch -> flat tensors -> the model -> one sampled token per sequence.

Layout of one step (B = 1, T = all scheduled tokens, no padding): the decode rows first (each
decoding sequence's last token, followed by its draft tokens when it speculates: row j of such a
sequence attends to its context plus drafts ``0..j-1``, so one forward scores every draft), then
each prefill chunk's tokens. ``slot_mapping[t]`` is the cache slot of token t;
paged attention reads each sequence's blocks through its block table. Logits are computed only
for the last position of each sequence that samples this step (for every row of a speculating
one, which :func:`~baige.runtime.infer.spec_decode.rejection.verify` then accepts or rejects); a
pooling sequence's rows give their final hidden states instead (``pooling.py``).

Decoding sequences are grouped by context length (each group one paged-decode call whose block
tables are only as wide as its longest sequence): attention traffic then follows the real
contexts instead of the longest one. When graphs are captured (CUDA graphs through
``torch.compile``, on GPU unless ``enforce_eager``), decode-only steps instead run as one group
with fixed shapes: the batch padded to a bucket size and the tables to a bucket width, padded rows
writing to the pool's scratch block; one graph per bucket.

LoRA (``runner.lora``, the engine's :class:`~baige.runtime.infer.lora.LoRAManager`): each step
sets the adapter of every flattened token before the forward. A decode-only step in which any
token uses an adapter runs the native CPU decode step with the adapters' stacks when it is
eligible (its table is rebuilt after the loaded adapters change), else the per-op path (eager,
unpadded; the module hooks add the adapters' terms); never a captured graph. Mixed steps always
run per-op.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.sampling import Logprobs, SamplerRow, sample_batch, target_logprobs
from baige.runtime.infer.scheduler import ScheduledBatch
from baige.runtime.infer.spec_decode.rejection import verify_drafts
from baige.runtime.infer.step_inputs import (
    StepInputs,
    StepRows,
    forward_step,
    group_by_width,
    owner_spans,
    rows_by_length,
    size_buckets,
    sliding_view,
)
from baige.runtime.model.logprobs import check_batch_invariant
from baige.runtime.model.transformer import Transformer


class ModelRunner:
    """Runs one scheduled step on the model.

    Args:
        model: the decoder (eval mode).
        kv_cache: the block pools.
        max_num_seqs: largest decode batch (sets the batch buckets).
        max_model_len: longest sequence (sets the block-table width buckets).
        enforce_eager: never capture graphs.
        num_speculative_tokens: the most draft tokens a sequence verifies per step (sets the row
            buckets of captured decode graphs: up to ``max_num_seqs * (1 + k)`` rows).
        tp: rank 0's :class:`~baige.runtime.infer.tp_worker.TensorParallelGroup` when the model is a
            tensor-parallel shard: every forward is sent to the workers first; steps run eager and
            per-op (no captured graph, no native one-call decode: both lack the all-reduces).
        batch_invariant: run every forward in ``kernels.batch_invariant`` mode, per-op (no native
            one-call decode: its kernels block by row count). Raises BaigeError for a model or cache
            the mode cannot run (``model.logprobs.check_batch_invariant``).
    """

    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool = False,
        num_speculative_tokens: int = 0,
        tp=None,
        batch_invariant: bool = False,
    ):
        self.model = model
        self.batch_invariant = batch_invariant
        self.tp = tp
        self.kv = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        self.batch_buckets = size_buckets(max_num_seqs * (1 + num_speculative_tokens))
        self.width_buckets = size_buckets(-(-max_model_len // self.block_size))
        self.enforce_eager = enforce_eager
        self._decode_fn = self._decode_forward
        # Capture on GPU only: torch.compile "reduce-overhead" records CUDA graphs of the fixed-shape
        # decode. On CPU the step is bound by weight-streaming memory traffic, which a compiled graph does
        # not reduce, while each width bucket would pay a long compile: the CPU decode runs eager (measured:
        # docs/benchmarks/archive.md); the shapes are fixed either way.
        self.sliding = bool(kv_cache.sliding_layers)  # their own pool (kv_cache.py): tables per step, no graph
        self.captures = not enforce_eager and self.device.type == "cuda" and tp is None and not self.sliding
        if self.captures:
            self._decode_fn = torch.compile(self._decode_forward, dynamic=False, mode="reduce-overhead")
        # CPU fp32: decode-only steps run every layer in one native call (cpu_decode.py), when eligible
        self.lora = None  # the engine's LoRAManager when LoRA is enabled
        # keep_hidden (an MTP proposer): every step runs the mixed path and keeps its rows' final hidden states
        self.keep_hidden = False
        self.last_hidden: list = []  # StepRows.kept_hidden of the steps since the engine took it
        # the LoRAManager.version the native table was last built for, and whether that build succeeded
        self._fused_lora_version, self._fused_lora_ok = 0, False
        self.fused_decode, self.fused_decode_why = None, "not on the CPU"
        if tp is not None:
            self.fused_decode_why = "tensor parallel (the native step has no all-reduce)"
        elif batch_invariant:
            check_batch_invariant(model, kv_cache.k[0].dtype)  # BaigeError: a model the mode cannot run
            self.fused_decode_why = "batch-invariant mode (the native step's kernels block by row count)"
            from baige.runtime.infer.cpu_decode import place_weights

            place_weights(model)
        elif self.device.type == "cpu":
            from baige.runtime.infer.cpu_decode import FusedDecoder

            self.fused_decode, self.fused_decode_why = FusedDecoder.build(model, kv_cache)

    def rebuild_native(self) -> None:
        """Build the native CPU decode table again (a no-op where it cannot run): after the model's
        weights were written in place (the table's derived copies -- a bf16 model's fp32 norms and
        biases, joined biases, permuted q/k -- are made when it is built) or the KV pools reallocated.
        A model that is no longer eligible (or whose LoRA stacks are not) runs every step per-op; so does
        a batch-invariant runner, always (the native step's kernels block by row count)."""
        if self.tp is not None or self.device.type != "cpu" or self.batch_invariant:
            return
        from baige.runtime.infer.cpu_decode import FusedDecoder

        self.fused_decode, self.fused_decode_why = FusedDecoder.build(self.model, self.kv)
        if self.lora is not None:
            self._fused_lora_version, self._fused_lora_ok = self.lora.version, self.fused_decode is not None

    def release_kv(self) -> None:
        """Free the KV pools (the engine's ``sleep``); the runner cannot step until :meth:`restore_kv`.

        Raises:
            BaigeError: decode steps run as captured CUDA graphs, which read the pools' addresses (a
            reallocated pool would not be where they write); run with ``enforce_eager``.
        """
        if self.captures:
            raise BaigeError(
                "sleep with captured CUDA graphs is not supported (they hold the KV pools' addresses); "
                "start the engine with enforce_eager=True (--enforce-eager)"
            )
        self.fused_decode, self.fused_decode_why = None, "the KV cache is released (asleep)"
        self.kv.release()

    def restore_kv(self) -> None:
        """Allocate the KV pools again, zero-filled (the engine's ``wake_up``), and the native table."""
        self.kv.allocate()
        self.rebuild_native()

    def _tensor(self, data: list) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _rows_of(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``t[rows]``; a view when the rows are consecutive (one decoding row per sequence, the usual
        step), where an index gather would copy a vocabulary-wide row per sequence."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return t[rows[0] : rows[0] + len(rows)]
        return t[self._tensor(rows)]

    def _decode_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        groups: list[tuple[torch.Tensor, torch.Tensor]],
        native: bool = True,
        sliding=None,
    ) -> torch.Tensor:
        """Decode: (1, B) ids/positions, (B,) slots, groups of ((B_g, W_g) tables, (B_g,) lengths) covering
        the B rows in order -> (B, vocab) logits. ``native`` False: never the native CPU step; ``sliding``:
        the sliding layers' :class:`SlidingInputs` (never with the native step, see cpu_decode.py)."""
        if self.fused_decode is not None and native:
            # one table for every row: the native kernel reads only each row's own context
            if len(groups) == 1:
                tables, lens = groups[0]
            else:
                W = max(t.shape[1] for t, _ in groups)
                tables = torch.cat([F.pad(t, (0, W - t.shape[1]), value=self.kv.scratch_block) for t, _ in groups])
                lens = torch.cat([n for _, n in groups])
            lora_ids = self.lora.batch.token_lora_ids if self.lora is not None else None
            hidden = self.fused_decode(input_ids, positions, slot_mapping, tables, lens, lora_ids)
            return self.fused_decode.logits(hidden[0])
        step = StepInputs(input_ids, positions, slot_mapping, input_ids.shape[1], groups, sliding=sliding)
        return self._forward(step)[0]

    def _forward(self, s: StepInputs) -> list[torch.Tensor]:
        """:func:`forward_step` on this rank; under tensor parallelism the inputs go to every worker
        first, and the broadcast and the forward's collectives hold the group's lock together."""
        if self.tp is None:
            return forward_step(self.model, self.kv, s)
        with self.tp.step(s):
            return forward_step(self.model, self.kv, s)

    def _native_lora(self) -> bool:
        """Whether a decode step with adapters can run natively: the native table is rebuilt (with
        the current stacks) when the loaded adapters changed since it was built; a model whose stacks
        are not eligible (see cpu_decode.py) keeps the per-op path for adapter steps."""
        if self.fused_decode is None:
            return False
        if self._fused_lora_version != self.lora.version:
            from baige.runtime.infer.cpu_decode import FusedDecoder

            fused, _ = FusedDecoder.build(self.model, self.kv)
            self._fused_lora_version = self.lora.version
            self._fused_lora_ok = fused is not None
            if fused is not None:
                self.fused_decode = fused
        return self._fused_lora_ok

    def _set_lora(self, lora_ids: list[int]) -> bool:
        """Tell the LoRA hooks each flattened token's adapter (its sequence's ``lora_int_id``, 0 =
        base); returns whether any token uses one."""
        return self.lora is not None and self.lora.set_batch(lora_ids)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _decode_rows(self, seqs: list) -> tuple[list[int], list[int], list[int], list[int]]:
        """The rows of decoding sequences, each sequence's consecutively: its last token, then each
        of its draft tokens (``spec_token_ids``, verified in the same step).

        Returns:
            ``(ids, positions, slots, owner)`` per row: the token, its position and cache slot, and
            the index into ``seqs`` of its sequence. A row's context is its position + 1 tokens.
        """
        bs = self.block_size
        ids, pos, slots, owner = [], [], [], []
        for i, s in enumerate(seqs):
            p0 = len(s.token_ids) - 1
            for p, t in enumerate([s.token_ids[-1], *s.spec_token_ids], start=p0):
                ids.append(t)
                pos.append(p)
                slots.append(s.block_table[p // bs] * bs + p % bs)
                owner.append(i)
        return ids, pos, slots, owner

    def _decode_groups(
        self, tables: list[list[int]], lens: list[int]
    ) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Order decode rows by context length and group them (see :func:`group_by_width`).

        Args:
            tables: per row its sequence's block table; lens: per row its context length.
        Returns:
            ``(order, groups)``: the row order (indices into the rows) and per group its block tables
            (rows, widest row's blocks) and context lengths, padded with the scratch block.
        """
        order = rows_by_length(lens)
        return order, self._groups_in(order, tables, lens)

    def _groups_in(
        self, order: list[int], tables: list[list[int]], lens: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The groups of :meth:`_decode_groups` for rows already in ``order`` (ascending length)."""
        bs, scratch = self.block_size, self.kv.scratch_block
        widths = [-(-lens[i] // bs) for i in order]
        groups, start = [], 0
        for end in group_by_width(widths):
            w = widths[end - 1]
            rows = order[start:end]
            padded = [tables[i][:w] + [scratch] * (w - len(tables[i][:w])) for i in rows]
            groups.append((self._tensor(padded), self._tensor([lens[i] for i in rows])))
            start = end
        return groups

    def _run_decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """A decode-only step. Returns the logits of every row ((R, vocab), each sequence's rows
        consecutively) and per sequence ``(batch index, first row, rows)``."""
        seqs = batch.seqs
        ids, pos, slots, owner = self._decode_rows(seqs)
        R = len(ids)
        spans = owner_spans(owner)
        lora = self.lora is not None and any(s.lora_int_id for s in seqs)
        if not self.captures or lora:  # eager: unpadded, grouped by length
            order, groups = self._decode_groups([seqs[o].block_table for o in owner], [p + 1 for p in pos])
            # with adapters: the native step with their stacks, else the module path (their hooks)
            self._set_lora([seqs[owner[i]].lora_int_id for i in order] if lora else [])
            fn = self._decode_forward if lora else self._decode_fn
            in_order = [pos[i] for i in order]
            row_seqs = [seqs[owner[i]] for i in order]
            sliding = sliding_view(self.kv, self._tensor, row_seqs, in_order, groups, []) if self.sliding else None
            logits = fn(
                self._tensor([[ids[i] for i in order]]),
                self._tensor([in_order]),
                self._tensor([slots[i] for i in order]),
                groups,
                native=not lora or self._native_lora(),
                sliding=sliding,
            )
            if order == sorted(order):  # already in row order (one row, or lengths ascending): no gather
                return logits, spans
            inverse = [0] * R
            for row, i in enumerate(order):
                inverse[i] = row
            return logits[self._tensor(inverse)], spans
        self._set_lora([])
        B = self.batch_buckets[bisect.bisect_left(self.batch_buckets, R)]
        widest = max(len(s.block_table) for s in seqs)
        W = self.width_buckets[bisect.bisect_left(self.width_buckets, widest)]
        bs, scratch = self.block_size, self.kv.scratch_block
        tables = [seqs[o].block_table + [scratch] * (W - len(seqs[o].block_table)) for o in owner]
        lens = [p + 1 for p in pos]
        pad = B - R
        ids += [0] * pad
        pos += [0] * pad
        slots += [scratch * bs] * pad
        tables += [[scratch] * W] * pad
        lens += [1] * pad
        logits = self._decode_fn(
            self._tensor([ids]), self._tensor([pos]), self._tensor(slots), [(self._tensor(tables), self._tensor(lens))]
        )
        return logits[:R], spans

    def _run_mixed(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list, dict[int, tuple[int, list]], list]:
        """Any mix of decodes (with their draft tokens) and prefill chunks, unpadded. Returns the logits
        of the rows that sample (each sequence's consecutively), per such sequence ``(batch index,
        first row, rows)``, prompt logprobs (a batch index whose sequence asks for them maps to (index
        of the first prompt token scored, its :class:`Logprobs` in order)), and what pooling sequences
        pool (:meth:`StepRows.pooled`)."""
        nd = batch.num_decodes
        ids, pos, slots, owner = self._decode_rows(batch.seqs[:nd])
        decode_lens = [p + 1 for p in pos]
        order = rows_by_length(decode_lens)  # _decode_groups' order; its groups only on the per-op path
        flat_of_row = [0] * len(order)
        for flat, r in enumerate(order):
            flat_of_row[r] = flat
        rows = StepRows(keep_all=self.keep_hidden)
        for i, first, n in owner_spans(owner):  # a sequence's decode rows are consecutive in `owner`
            rows.decode(i, batch.seqs[i], flat_of_row[first : first + n], pos[first])
        ids, pos, slots = [ids[r] for r in order], [pos[r] for r in order], [slots[r] for r in order]
        pre_tables, pre_cu, pre_lens = [], [0], []
        for i in range(nd, len(batch)):
            s, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            rows.prefill(i, s, start, end, len(ids))
            ids += s.token_ids[start:end]
            pos += range(start, end)
            slots += self._slots(s.block_table, start, end)
            pre_tables.append(s.block_table)
            pre_cu.append(pre_cu[-1] + n)
            pre_lens.append(end)
        lora = False
        if self.lora is not None:
            lora = self._set_lora(
                [batch.seqs[owner[r]].lora_int_id for r in order]
                + [s.lora_int_id for s, n in zip(batch.seqs[nd:], batch.num_new_tokens[nd:]) for _ in range(n)]
            )
        logit_rows = rows.sample_at + rows.score_at
        if (
            self.fused_decode is not None
            and self.fused_decode.takes_rows(len(ids), max(pre_lens, default=0))
            and (not lora or self._native_lora())
        ):
            out, hidden = self._mixed_native(batch, [owner[r] for r in order], ids, pos, slots, logit_rows, rows, lora)
            logits, scored = out[: len(rows.sample_at)], [out[len(rows.sample_at) :]]
            self.last_hidden += rows.kept_hidden(hidden, batch.seqs)
            return logits, rows.spans, self._prompt_logprobs(batch, scored, rows), rows.pooled(hidden)
        groups = self._groups_in(order, [batch.seqs[o].block_table for o in owner], decode_lens) if nd else []
        step = StepInputs(
            self._tensor([ids]),
            self._tensor([pos]),
            self._tensor(slots),
            len(order),
            groups,
            logit_rows=[self._tensor(rows.sample_at)] + ([self._tensor(rows.score_at)] if rows.score_at else []),
            hidden_rows=rows.hidden_rows(len(ids), self.device),
        )
        if self.sliding:
            row_seqs = [batch.seqs[owner[r]] for r in order]
            row_seqs += [s for s, n in zip(batch.seqs[nd:], batch.num_new_tokens[nd:]) for _ in range(n)]
            step.sliding = sliding_view(self.kv, self._tensor, row_seqs, pos, groups, batch.seqs[nd:])
        if pre_lens:
            w = max(len(t) for t in pre_tables)
            step.prefill_block_tables = self._tensor([t + [self.kv.scratch_block] * (w - len(t)) for t in pre_tables])
            step.prefill_cu_seqlens, step.prefill_context_lens = self._tensor(pre_cu), self._tensor(pre_lens)
        out = self._forward(step)  # (n_sample, vocab), then (n_score, vocab) when scoring, then pooled hidden
        hidden = out.pop() if step.hidden_rows is not None else None
        logits, *scored = out
        self.last_hidden += rows.kept_hidden(hidden, batch.seqs)
        return logits, rows.spans, self._prompt_logprobs(batch, scored, rows), rows.pooled(hidden)

    def _mixed_native(
        self,
        batch: ScheduledBatch,
        decode_owner: list[int],
        ids: list[int],
        pos: list[int],
        slots: list[int],
        rows: list[int],
        step_rows: StepRows,
        lora: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_run_mixed`'s step through the native CPU decode: every row a decode row of its own
        context (the causal mask of a prefill chunk is each row's context length, its K/V stored before
        the layer's attention reads it). ``decode_owner``: the batch index of each decode row, in row
        order; ``ids``, ``pos``, ``slots``: every flat row's; returns the logits of the flat ``rows`` and
        the final hidden states of ``step_rows.pool_at`` (None when it is empty)."""
        nd = batch.num_decodes
        row_tables = [batch.seqs[o].block_table for o in decode_owner] + [
            batch.seqs[i].block_table for i in range(nd, len(batch)) for _ in range(batch.num_new_tokens[i])
        ]
        w, scratch = max(len(t) for t in row_tables), self.kv.scratch_block
        hidden = self.fused_decode(
            self._tensor([ids]),
            self._tensor([pos]),
            self._tensor(slots),
            self._tensor([t + [scratch] * (w - len(t)) for t in row_tables]),
            self._tensor([p + 1 for p in pos]),
            self.lora.batch.token_lora_ids if lora else None,
        )[0]
        pooled = (
            hidden if step_rows.keep_all else hidden[self._tensor(step_rows.pool_at)] if step_rows.pool_at else None
        )
        return self.fused_decode.logits(hidden[self._tensor(rows)]), pooled

    def _prompt_logprobs(self, batch: ScheduledBatch, scored: list[torch.Tensor], rows: StepRows) -> dict:
        """:meth:`_run_mixed`'s prompt logprobs from the scored rows' logits (``scored[0]``)."""
        prompt_lps: dict[int, tuple[int, list]] = {}
        if rows.score_at:
            k = max(batch.seqs[i].prompt_logprobs for i, _, _ in rows.score_spans)
            lps = target_logprobs(scored[0], self._tensor(rows.score_targets), k)
            at = 0
            for i, first, n in rows.score_spans:
                want = batch.seqs[i].prompt_logprobs
                prompt_lps[i] = (first, [Logprobs(lp.token_id, lp.logprob, lp.top[:want]) for lp in lps[at : at + n]])
                at += n
        return prompt_lps

    def _step(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list, dict, list]:
        """The step's forward: ``(logits, spans, prompt logprobs, pooled)`` as :meth:`_run_mixed`. A step
        with pooling sequences always takes the mixed path (it returns hidden states)."""
        self.kv.copy_blocks(batch.block_copies)  # copy-on-write of forked blocks, before anything writes them
        with kernels.batch_invariant(self.batch_invariant):
            if batch.num_decodes == len(batch) and all(s.pooling is None for s in batch.seqs) and not self.keep_hidden:
                return (*self._run_decode(batch), {}, [])
            return self._run_mixed(batch)

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[tuple[int, int, int]], dict]:
        """Run the step's forward: ``(logits, spans, prompt logprobs)`` as :meth:`_run_mixed`."""
        return self._step(batch)[:3]

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        rows: list[SamplerRow | None],
        token_masks: Callable[[], dict[int, torch.Tensor]] | None = None,
    ) -> tuple[list[list[int]], list[list[Logprobs | None]], dict[int, tuple[int, list[Logprobs]]]]:
        """Run the step, sample, and verify draft tokens.

        Args:
            batch: the scheduler's step.
            rows: per sequence of ``batch.sampling_seqs`` (the scheduled ones, then the forked children) its
                sampling inputs (read only for sequences that sample).
            token_masks: called after the forward, before sampling (so masks computed on another
                thread overlap the forward): ``{index into batch.sampling_seqs: (vocab,) bool allowed
                tokens}`` for the constrained sequences.
        Returns:
            Per sequence of ``batch.sampling_seqs``: the tokens it emits (a forked child: one, sampled from
            its parent's logits row with its own sampling inputs) (none for a chunk that does not end its
            prefill, one for a plain sample, 1 .. k + 1 for a sequence verifying k drafts) and their
            logprobs from the target's raw distribution (None entries unless asked for); and the
            prompt logprobs of this step's prefill chunks that ask for them (see :meth:`_run_mixed`).
            A pooling sequence (``seq.pooling`` set) emits nothing: the final hidden states of its rows
            that its pooling needs are added to ``seq.pooling`` once the whole step has succeeded.
        """
        logits, spans, prompt_lps, pooled = self._step(batch)
        tokens: list[list[int]] = [[] for _ in batch.sampling_seqs]
        logprobs: list[list[Logprobs | None]] = [[] for _ in batch.sampling_seqs]
        if token_masks is not None:
            rows = list(rows)
            for i, mask in token_masks().items():
                rows[i] = replace(rows[i], token_mask=mask)  # (vocab,), or (drafts + 1, vocab) per position
        plain = [(i, first) for i, first, n in spans if not batch.seqs[i].spec_token_ids]
        if batch.forks:
            row_of = dict(plain)
            plain += [(len(batch.seqs) + k, row_of[p]) for k, (p, _) in enumerate(batch.forks) if p in row_of]
        if plain:
            got, lps = sample_batch(self._rows_of(logits, [f for _, f in plain]), [rows[i] for i, _ in plain])
            for (i, _), t, lp in zip(plain, got, lps):
                tokens[i], logprobs[i] = [t], [lp]
        spec = [(i, first, n) for i, first, n in spans if batch.seqs[i].spec_token_ids]
        if spec:
            verify_drafts(batch, rows, logits, spec, tokens, logprobs)
        for i, start, hidden in pooled:  # last: a step that raised above has pooled nothing
            batch.seqs[i].pooling.add(hidden, start)
        return tokens, logprobs, prompt_lps
