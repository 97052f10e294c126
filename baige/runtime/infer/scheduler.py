"""Continuous batching in plain Python (no torch): which sequences run each step, and how many tokens.

Policy (vLLM's, simplified):

- Every running sequence is scheduled each step, in admission order: a decoding sequence for its
  one new token plus its draft tokens when it speculates (``spec_token_ids``; the drafts are cut
  to the token budget, and dropped before anything is preempted for their KV slots), a sequence in the middle of a
  chunked prefill for as much of the rest of its
  prompt as the token budget (``max_num_batched_tokens``) allows.
- When the pool has no block for a running sequence, the most recently admitted running sequence
  is preempted by *recompute*: its blocks are freed and it goes back to the front of the waiting
  queue; when readmitted it prefills its prompt plus the tokens it had generated.
- Waiting sequences are admitted first come, first served (a sequence that does not fit blocks the
  ones behind it), while the budget, ``max_num_seqs`` and the pool allow; a long prompt is split
  into chunks (chunked prefill). Nothing is admitted in a step that preempted.
- ``long_prefill_token_threshold`` (vLLM's, > 0): no sequence computes more than that many prompt
  tokens in one step, so a long prompt's prefill leaves the rest of the budget to the prompts queued
  behind it (short ones are not held until it ends) and no step runs the whole long prompt at once.
- LoRA (``max_loras`` set): the running sequences use at most ``max_loras`` distinct adapters
  (``lora_int_id`` > 0; the base model does not count), so no step mixes more. A waiting sequence
  whose adapter would be one too many is passed over (it keeps its place at the front) and the
  ones behind it may be admitted (vLLM's policy).

- Forking (``fork`` on, a request with ``n`` > 1, vLLM's sequence-group fork): the request's other
  sequences wait while its first one computes the prompt; in the step that computes the prompt's last
  chunk they are forked from it (:meth:`BlockManager.fork`: its blocks by reference, the partial last
  block copied on the first write) and sample their first tokens from the same logits
  (``ScheduledBatch.forks``), so the prompt is computed once and all ``n`` decode from the next step on.
  Siblings that cannot be forked then (no free seat or block, a step that preempted) are admitted as
  usual afterwards, reusing the prompt's full blocks through the prefix cache.
- P/D disaggregation (vLLM's ``WAITING_FOR_REMOTE_KVS``): a sequence whose prompt's KV blocks are
  being pulled from another engine is held aside, its blocks already allocated, until
  :meth:`Scheduler.remote_kv_done` queues it (its computed count then covers the pulled tokens).

Finishing a sequence (stop, length, abort) is O(1): it is marked finished and its blocks freed at
once, and the queues drop finished entries when they next pass them (the running list at the start
of each step, the waiting queue at its head), so aborting a request of ``n`` sequences costs O(n).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.model.config import window_pairs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prompt's KV is being pulled (kv_transfer/)
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One generated continuation of one prompt (a request with ``n`` > 1 has ``n`` sequences).

    ``token_ids`` holds the prompt followed by the generated tokens; ``num_computed_tokens`` of
    them have their K/V in the cache. Stop conditions on ids (``eos_token_ids`` unless ignored,
    ``stop_token_ids``, ``max_tokens``, ``min_tokens``) are checked by :meth:`Scheduler.postprocess`;
    stop strings are the engine's (they need text).
    """

    token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # EOS included unless ignore_eos
    request_id: str = ""
    index: int = 0  # which of the request's n sequences
    payload: Any = None  # the engine's per-sequence state (sampling, detokenizer)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # the sliding-window layers' blocks when they have a pool of their own (block_manager.py)
    sliding_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens found in the prefix cache at the last admission
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    prompt_logprobs: int | None = None  # set: the runner returns prompt-token logprobs; no prefix-cache reuse
    # speculative decoding: this step's draft tokens (verified with the last token in one forward; never
    # part of token_ids, so the block manager only ever hashes verified tokens) and their draft
    # distribution, (len, vocab) or None for deterministic proposals
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    num_new_output: int = 0  # tokens the last postprocess appended (1 + accepted drafts)
    spec_budget: Any = None  # the engine's DraftBudget of this sequence (speculative decoding on)
    lora_int_id: int = 0  # the engine's id of the LoRA adapter it runs with; 0 = the base model
    # a pooling request (prefill only): its pooling.PoolingState; the runner adds the hidden states of
    # each chunk to it instead of sampling, and the engine finishes the sequence once its prompt is computed
    pooling: Any = None
    # the request's n sequences (this one included, in index order) when n > 1: the ones a fork may take
    siblings: list[Sequence] | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def prefix_sharing(seq: Sequence) -> bool:
    """Whether ``seq``'s prompt blocks go into the prefix cache for its siblings to reuse (not when it
    scores its prompt: those runs bypass the cache)."""
    return seq.request_id != "" and seq.prompt_logprobs is None


@dataclass(frozen=True)
class StepShape:
    """The work of one engine step, as the scheduler ran it (:meth:`ScheduledBatch.shape`; recorded by
    ``LLMEngine.step`` when its ``step_shapes`` is a list), for ``roofline.workload_roofline``.

    ``tokens``: tokens computed (prefill chunks + decode rows); ``kv_tokens``: cached tokens the step's
    attention has to read, summed over its sequences (each sequence's context after the step: a chunk
    reads its sequence's cache once); ``attn_pairs``: (query, key) pairs scored, summed over the
    computed tokens (a chunk of n tokens after c cached ones: ``n * c + n * (n + 1) / 2``);
    ``sampled``: rows the lm_head projects (sequences that sample a token this step);
    ``window_kv_tokens`` / ``window_attn_pairs``: the same two counts for a sliding-window layer (a query
    at p sees keys ``p - w < s <= p``: a chunk of n after c cached reads ``min(c + n, w - 1 + n)`` keys),
    None when the step was taken without a window (then a layer's counts are the ones above).
    """

    tokens: int
    kv_tokens: int
    attn_pairs: int
    sampled: int
    window_kv_tokens: int | None = None
    window_attn_pairs: int | None = None


@dataclass
class ScheduledBatch:
    """One step's work: ``(sequence, number of tokens to compute)``, decodes first.

    A sequence whose scheduled tokens reach the end of its ``token_ids`` samples a new token.
    ``forks``: ``(batch index of the parent, child)``: a sequence forked from a parent whose prompt this
    step completes; it computes nothing and samples its first token from the parent's logits.
    ``block_copies``: copy-on-write ``(src, dst)`` block pairs to apply to the K/V before the forward
    (:meth:`BlockManager.take_copies`).
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int  # the first num_decodes entries compute exactly one token after a full cache
    preempted: list[Sequence] = field(default_factory=list)
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """``seqs`` then the forked children: the order of the runner's per-sequence outputs."""
        return self.seqs + [c for _, c in self.forks] if self.forks else self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def shape(self, window: int | None = None) -> StepShape:
        """The :class:`StepShape` of this batch, taken before it runs
        (the sequences' ``num_computed_tokens`` not yet advanced). Draft tokens count as computed.
        ``window``: the model's sliding window in tokens (its window counts), None for none."""
        kv = pairs = sampled = w_kv = w_pairs = 0
        for s, n in zip(self.seqs, self.num_new_tokens):
            c = s.num_computed_tokens
            kv += c + n
            pairs += n * c + n * (n + 1) // 2
            sampled += c + n - len(s.spec_token_ids) >= len(s.token_ids)
            if window is not None:
                w_kv += min(c + n, window - 1 + n)
                w_pairs += window_pairs(c, n, window)
        if window is None:
            return StepShape(tokens=self.num_tokens, kv_tokens=kv, attn_pairs=pairs, sampled=sampled)
        return StepShape(self.num_tokens, kv, pairs, sampled, window_kv_tokens=w_kv, window_attn_pairs=w_pairs)


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`.

    Args:
        block_manager: owns the KV blocks.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens computed in one step; must be >= max_num_seqs so every
            running sequence can decode each step.
        max_model_len: longest sequence (prompt + output) in tokens; a sequence reaching it finishes
            with reason "length".
        on_release: called with a sequence whose blocks are freed (finished or preempted), so a
            draft proposer can free its own state.
        max_loras: most distinct LoRA adapters among the running sequences (None: no limit).
        on_finish: called with a sequence that finishes, with its reason, before its blocks are
            freed (a KV producer pins them for a consumer to pull).
        long_prefill_token_threshold: most prompt tokens one sequence computes in a step (0: only
            the budget limits it).
        fork: fork a request's other sequences from the one that computed its prompt (module
            docstring); needs a block manager without a sliding-window pool.
    Raises:
        ValueError: ``max_num_batched_tokens`` < ``max_num_seqs``, a negative threshold, or ``fork``
            with a sliding-window pool.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        on_release: Callable[[Sequence], None] | None = None,
        max_loras: int | None = None,
        on_finish: Callable[[Sequence, str], None] | None = None,
        long_prefill_token_threshold: int = 0,
        fork: bool = False,
    ):
        if fork and block_manager.sliding is not None:
            raise ValueError("fork: the sliding-window pool's tables are not forked")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})"
            )
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold ({long_prefill_token_threshold}) must be >= 0")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._waiting: deque[Sequence] = deque()  # may hold finished entries (dropped lazily)
        self._running: list[Sequence] = []  # likewise
        self._num_unfinished = 0
        self.num_preemptions = 0
        self.on_release = on_release
        self.max_loras = max_loras
        self.on_finish = on_finish
        self._remote: dict[int, Sequence] = {}  # seq_id -> sequence waiting for its remote KV
        self.fork = fork

    @property
    def waiting(self) -> list[Sequence]:
        """Unfinished sequences waiting for admission, front first, then those waiting for their remote
        KV (O(queue); for metrics and tests)."""
        return [s for s in self._waiting if not s.is_finished] + list(self._remote.values())

    @property
    def running(self) -> list[Sequence]:
        """Unfinished running sequences in admission order (O(running))."""
        return [s for s in self._running if not s.is_finished]

    def add(self, seq: Sequence, remote_kv: bool = False) -> None:
        """Queue a sequence; ``remote_kv``: hold it aside (its blocks allocated, their KV being pulled)
        until :meth:`remote_kv_done`."""
        self._num_unfinished += 1
        if remote_kv:
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
            self._remote[seq.seq_id] = seq
            return
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)

    def remote_kv_done(self, seq: Sequence) -> None:
        """Queue a sequence held by ``add(seq, remote_kv=True)`` (a no-op once it has finished: aborted
        meanwhile). Its ``block_table`` and ``num_computed_tokens`` say what the pull filled (an empty
        table: nothing, it computes its prompt)."""
        if self._remote.pop(seq.seq_id, None) is not None and not seq.is_finished:
            seq.status = SequenceStatus.WAITING
            self._waiting.append(seq)

    def has_unfinished(self) -> bool:
        return self._num_unfinished > 0

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts, allocating their KV slots."""
        self._running = [s for s in self._running if not s.is_finished]
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = self._chunk(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.spec_token_ids:
                n = self._fit_drafts(seq, budget)
            while not bm.can_append(seq, n):
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, n)
                is_decode = n == 1 + len(seq.spec_token_ids) and seq.num_computed_tokens == len(seq.token_ids) - 1
                (decodes if is_decode else prefills).append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: the ones after it are gone too
        loras = {s.lora_int_id for s in self._running if s.lora_int_id}
        # Requests whose prompt is being computed: their other samples (n > 1) wait until it is in the
        # prefix cache, so a prompt's full blocks are computed once for all n samples (or forked).
        share = self.block_manager.enable_prefix_caching or self.fork
        prefilling = self._prefilling_requests() if share else set()
        passed: list[Sequence] = []  # waiting sequences held back this step (max_loras, a sibling's prefill)
        while self._waiting and budget > 0 and not preempted and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            if seq.is_finished:
                self._waiting.popleft()
                continue
            if seq.request_id in prefilling and seq.num_computed_tokens == 0:
                passed.append(self._waiting.popleft())
                continue
            if (
                self.max_loras is not None
                and seq.lora_int_id
                and seq.lora_int_id not in loras
                and len(loras) >= self.max_loras
            ):
                passed.append(self._waiting.popleft())
                continue
            want = self._chunk(len(seq.token_ids), budget)
            if not bm.can_allocate(seq, want):
                break
            n = bm.allocate(seq, want)
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            is_decode = n == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1
            (decodes if is_decode else prefills).append((seq, n))
            budget -= n
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
            if share and self._computes_shared_blocks(seq):
                prefilling.add(seq.request_id)
        self._waiting.extendleft(reversed(passed))  # back at the front, in their order
        both = decodes + prefills
        forks = self._fork_siblings(both) if self.fork and not preempted else []
        return ScheduledBatch(
            [s for s, _ in both], [n for _, n in both], len(decodes), preempted, forks, bm.take_copies()
        )

    def _fork_siblings(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[int, Sequence]]:
        """Fork the waiting siblings of each scheduled sequence whose prompt this step completes (it then
        samples its first token), while seats and free blocks last (one block per child: its first
        write); returns ``(batch index of the parent, child)`` in order, the children running."""
        forks: list[tuple[int, Sequence]] = []
        bm = self.block_manager
        for i, (parent, n) in enumerate(scheduled):
            if parent.siblings is None or parent.pooling is not None:
                continue
            if parent.num_output_tokens or parent.num_computed_tokens + n != parent.num_prompt_tokens:
                continue
            for child in parent.siblings:
                if len(self._running) >= self.max_num_seqs or bm.num_free_blocks <= len(forks):
                    return forks
                if child.status is not SequenceStatus.WAITING or child.block_table or child.num_output_tokens:
                    continue
                self._waiting.remove(child)  # held behind its parent: near the front
                bm.fork(parent, child, parent.num_prompt_tokens)
                child.status = SequenceStatus.RUNNING
                self._running.append(child)
                forks.append((i, child))
        return forks

    def _chunk(self, left: int, budget: int) -> int:
        """Tokens a sequence with ``left`` tokens to compute gets this step: at most the budget, and a
        prefill (``left`` > 1) at most ``long_prefill_token_threshold`` when that is set."""
        limit = self.long_prefill_token_threshold
        return min(left, budget, limit) if limit and left > 1 else min(left, budget)

    def _prefilling_requests(self) -> set[str]:
        """Request ids with a running sequence that still computes full blocks of its prompt (with
        ``fork``: any of its prompt)."""
        return {s.request_id for s in self._running if self._computes_shared_blocks(s)}

    def _computes_shared_blocks(self, seq: Sequence) -> bool:
        """Whether ``seq`` has full prompt blocks not yet computed (``num_computed_tokens`` counts what
        earlier steps and the prefix cache gave it): blocks its siblings would find cached later. With
        ``fork``, whether any of its prompt is left to compute (its siblings are forked when it is done)."""
        if self.fork and seq.siblings is not None and seq.pooling is None:
            return seq.num_computed_tokens < seq.num_prompt_tokens
        full = seq.num_prompt_tokens // self.block_manager.block_size * self.block_manager.block_size
        return prefix_sharing(seq) and seq.num_computed_tokens < full

    def _fit_drafts(self, seq: Sequence, budget: int) -> int:
        """Cut ``seq``'s drafts to the token budget and to the free blocks (a draft never preempts
        anything); returns the tokens to schedule (1 + drafts kept)."""
        keep = min(len(seq.spec_token_ids), budget - 1)
        while keep > 0 and not self.block_manager.can_append(seq, 1 + keep):
            keep -= 1
        if keep < len(seq.spec_token_ids):
            seq.spec_token_ids = seq.spec_token_ids[:keep]
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:keep] if keep else None
        return 1 + keep

    def postprocess(self, batch: ScheduledBatch, sampled: list[list[int] | int | None]) -> list[Sequence]:
        """Advance the computed counts, append the emitted tokens and finish sequences on id stops.

        A speculating sequence emits 1 .. k + 1 tokens: its computed count advances over the last
        token and the accepted drafts only, and blocks that held only rejected drafts go back to
        the pool. Tokens are appended one at a time with the same stop checks as single tokens, so a
        stop id or ``max_tokens`` inside an accepted run ends the sequence exactly there.

        Args:
            batch: what :meth:`schedule` returned.
            sampled: per sequence of ``batch.sampling_seqs`` the emitted tokens (a list, an int for one, or None / []
                for a prefill chunk that did not reach the end of the sequence).
        Returns:
            The sequences that got new tokens (finished ones included, already freed); each one's
            ``num_new_output`` says how many.
        """
        got: list[Sequence] = []
        seqs = batch.sampling_seqs
        counts = batch.num_new_tokens + [0] * len(batch.forks)  # a forked child computed nothing
        sampled = list(sampled) + [None] * (len(seqs) - len(sampled))  # none given for a child: it got none
        for seq, n, tokens in zip(seqs, counts, sampled):
            tokens = [] if tokens is None else [tokens] if isinstance(tokens, int) else tokens
            n_spec = len(seq.spec_token_ids)
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            if seq.is_finished:  # aborted while the step ran
                continue
            if n == 0 and not tokens:  # a child whose parent's sample failed: it computes its last prompt token
                seq.num_computed_tokens = len(seq.token_ids) - 1
                continue
            seq.num_computed_tokens += n - n_spec + max(len(tokens) - 1, 0)
            finish: tuple[str, int | None] | None = None
            seq.num_new_output = 0
            for token in tokens:
                seq.token_ids.append(token)
                seq.num_new_output += 1
                n_out = seq.num_output_tokens
                if token in seq.stop_token_ids and n_out > seq.min_tokens:  # the sampler masks them before
                    finish = ("stop", token)
                elif n_out >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
                    finish = ("length", None)
                if finish:
                    break
            if tokens:
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
            if n_spec:
                self.block_manager.trim(seq)
            self.block_manager.cache_computed_blocks(seq)
            if not tokens:
                continue
            got.append(seq)
            if finish:
                self.finish(seq, *finish)
        return got

    def _release(self, seq: Sequence) -> None:
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        if self.on_release is not None:
            self.on_release(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence (stop, length or abort) in O(1): blocks freed now, queue entry dropped lazily."""
        if seq.is_finished:
            return
        self._num_unfinished -= 1
        self._remote.pop(seq.seq_id, None)
        if self.on_finish is not None:
            self.on_finish(seq, reason)
        self.block_manager.free(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
