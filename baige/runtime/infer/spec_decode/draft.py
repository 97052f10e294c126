"""Draft-model proposals: a smaller model with the same tokenizer guesses k tokens per sequence.

The draft has its own paged KV cache and block manager (no prefix caching) and runs through its
own :class:`~baige.runtime.infer.runner.ModelRunner`, so it gets the same batched paged attention
and, on the CPU, the native one-call decode step. Each step, for all speculating sequences at once:
one forward that catches the draft's cache up with the tokens the target emitted since the last
step (1 or 2 tokens normally; the whole context for a new sequence), then k - 1 one-token decode
forwards; each forward yields the next draft token of every sequence. Draft K/V of rejected tokens
is dropped at the next step (the longest prefix still equal to the sequence is kept).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from baige.errors import BaigeError
from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.runner import ModelRunner
from baige.runtime.infer.sampling import SamplerRow, adjusted_logits, target_probs
from baige.runtime.infer.scheduler import ScheduledBatch, Sequence
from baige.runtime.infer.spec_decode.proposer import Proposal, Proposer
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.model.transformer import Transformer

logger = logging.getLogger("baige.spec_decode")


@dataclass(eq=False)
class _DraftSeq:
    """The draft's view of one target sequence (what the runner and block manager read)."""

    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: int | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    fed: int = 0  # len(token_ids) of the target sequence at the last proposal (a verified prefix)
    pooling: None = None  # never a pooling sequence (the runner's StepRows reads it)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def check_same_vocab(target: Tokenizer, draft: Tokenizer) -> None:
    """Raise BaigeError (one line) unless both tokenizers map the same strings to the same ids."""
    a, b = target.get_vocab(), draft.get_vocab()
    if a == b:
        return
    if len(a) != len(b):
        detail = f"{len(a)} tokens in the target's vocabulary, {len(b)} in the draft's"
    else:
        tok = next(t for t in sorted(a) if b.get(t) != a[t])
        detail = f"token {tok!r} is id {a[tok]} in the target, {b.get(tok)} in the draft"
    raise BaigeError(
        f"--speculative-config: the draft model's tokenizer differs from the target's ({detail}); "
        "a draft must share the target's vocabulary",
        param="speculative_config",
    )


class DraftModelProposer(Proposer):
    """Proposals from a draft model (module docstring).

    Args:
        model: the draft decoder (eval mode), on the target's device.
        num_speculative_tokens: k.
        num_blocks, block_size: the draft's KV pool.
        kv_dtype: its dtype.
        max_num_seqs, max_model_len: as the target engine's.
        vocab_size: the target's vocabulary size (draft logits are cut or padded to it).
        enforce_eager: no captured graphs for the draft either.
    Raises:
        BaigeError: the draft's context is shorter than ``max_model_len``.
    """

    def __init__(
        self,
        model: Transformer,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
        enforce_eager: bool = False,
    ):
        if model.config.max_position_embeddings < max_model_len:
            raise BaigeError(
                f"--speculative-config: the draft model's context ({model.config.max_position_embeddings} "
                f"tokens) is shorter than --max-model-len {max_model_len}",
                param="speculative_config",
            )
        device = next(model.parameters()).device
        self.k, self.vocab_size = num_speculative_tokens, vocab_size
        self.kv = KVCache(model.config, num_blocks, block_size, kv_dtype, device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv, max_num_seqs, max_model_len, enforce_eager)
        self.states: dict[int, _DraftSeq] = {}

    def release(self, seq: Sequence) -> None:
        ds = self.states.pop(seq.seq_id, None)
        if ds is not None:
            self.block_manager.free(ds)

    def _sync(self, seq: Sequence) -> _DraftSeq:
        """The sequence's draft state with its computed count cut to the prefix still valid."""
        ds = self.states.get(seq.seq_id)
        if ds is None:
            ds = self.states[seq.seq_id] = _DraftSeq(list(seq.token_ids))
            return ds
        t, j = seq.token_ids, ds.fed
        limit = min(ds.num_computed_tokens, len(t) - 1)  # the last token is always fed: its logits propose
        while j < limit and ds.token_ids[j] == t[j]:
            j += 1
        ds.num_computed_tokens = min(ds.num_computed_tokens, j)
        ds.token_ids = ds.token_ids[: ds.num_computed_tokens] + t[ds.num_computed_tokens :]
        self.block_manager.trim(ds)
        return ds

    def propose(self, seqs: list[Sequence], budgets: list[int], rows: list[SamplerRow]) -> list[Proposal]:
        out = [Proposal([]) for _ in seqs]
        active: list[int] = []
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            if budget <= 0:
                continue
            ds = self._sync(seq)
            ds.fed = len(seq.token_ids)
            more = len(seq.token_ids) + budget - 1 - ds.num_computed_tokens  # K/V to compute this step
            if not self.block_manager.can_append(ds, more):
                self.release(seq)  # the draft's pool is full: this sequence decodes plainly this step
                continue
            self.block_manager.append_slots(ds, more)
            active.append(i)
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        while active:
            self._step(seqs, rows, active, drafts, probs)
            active = [i for i in active if len(drafts[i]) < budgets[i]]
        for i, toks in drafts.items():
            out[i] = Proposal(toks, torch.stack(probs[i]) if probs[i] else None)
        return out

    def _step(
        self,
        seqs: list[Sequence],
        rows: list[SamplerRow],
        active: list[int],
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """One draft forward for the ``active`` sequences: the next draft token of each."""
        states = [self.states[seqs[i].seq_id] for i in active]
        new = [len(ds.token_ids) - ds.num_computed_tokens for ds in states]
        order = sorted(range(len(active)), key=lambda j: new[j] != 1)  # decodes first, as the runner wants
        batch = ScheduledBatch([states[j] for j in order], [new[j] for j in order], sum(n == 1 for n in new))
        logits, spans, _ = self.runner.logits(batch)
        V = self.vocab_size
        if logits.shape[1] != V:  # a draft whose embedding is padded differently: same ids, other width
            logits = (
                logits[:, :V]
                if logits.shape[1] > V
                else torch.nn.functional.pad(logits, (0, V - logits.shape[1]), value=float("-inf"))
            )
        picked = [active[order[b]] for b, _, _ in spans]  # sequence index of each logits row
        step_rows = [rows[i].with_outputs(drafts[i]) for i in picked]
        greedy = [rows[i].params.greedy for i in picked]
        q = target_probs(logits, step_rows) if not all(greedy) else None
        best = adjusted_logits(logits, step_rows).argmax(-1).tolist() if any(greedy) else None
        for r, i in enumerate(picked):
            if greedy[r]:
                token = best[r]
            else:
                token = int(torch.multinomial(q[r], 1, generator=rows[i].generator))
                probs[i].append(q[r])
            drafts[i].append(token)
        for j, ds in enumerate(batch.seqs):
            ds.num_computed_tokens += batch.num_new_tokens[j]
        for i in picked:
            self.states[seqs[i].seq_id].token_ids.append(drafts[i][-1])
