"""Paged KV-cache bookkeeping in plain Python (no torch): which block holds which tokens.

The KV cache is a pool of ``num_blocks`` fixed-size blocks of ``block_size`` token slots each (the
tensors live in :mod:`baige.runtime.infer.kv_cache`). A sequence owns a *block table*: the list of block
ids that hold its tokens in order, so token ``i`` sits in slot
``block_table[i // block_size] * block_size + i % block_size`` (vLLM's PagedAttention layout,
Kwon et al. 2023, arXiv:2309.06180).

Prefix caching: a block whose ``block_size`` tokens have all been computed gets a *chained key*,
``sha256(parent_key + tokens as little-endian int64)``, so equal keys mean equal whole prefixes. A
lookup compares the 32-byte keys themselves (and the block's own tokens), never Python's 64-bit
``hash``, whose collisions a client could craft to be served another client's cached KV (vLLM
moved to sha256 prefix keys for the same reason). A new sequence whose
prompt starts with cached blocks reuses them (ref count + 1) and skips computing those tokens.
The chain of a sequence served with a LoRA adapter (``lora_int_id`` > 0) starts from the
adapter's own root key (:func:`root_key`) instead of nothing, so the KV of two adapters (or of an
adapter and the base) is never shared: the same tokens give different K/V under each adapter.
Blocks nobody references stay cached until the pool runs out, then the least recently freed one is
evicted (LRU).

A second tier (``offload``, an :class:`OffloadTier` such as ``kv_offload.KVOffload``) keeps evicted
blocks: the manager hands it every cached block it evicts (before the block is reused), and a prefix
walk that misses the pool asks it for the key; a hit is loaded into a fresh block, cached under its
key again, and its tokens are not computed. ``prefix_hits`` counts pool hits only.

Forking (:meth:`BlockManager.fork`, vLLM's ``fork`` of a sequence group): a sequence whose prompt another
sequence of the same request has just computed takes that sequence's block table by reference (every block's
ref count + 1) instead of computing the prompt again. A write into a block that more than one sequence
references is *copy-on-write*: the writer gets a fresh block and a pending copy ``(src, dst)``
(:meth:`BlockManager.take_copies`) that the runner applies to every layer's K/V before the step's forward:
the prompt's partial last block, when a sample first writes its next token there (writes never reach a
shared block otherwise, except the one of a forked child's last prompt token if that child recomputes it).

Sliding-window layers (``sliding_window`` set): their blocks live in a second pool and a second table per
sequence, ``seq.sliding_table``, and are given back once wholly before the window
(:mod:`baige.runtime.infer.sliding_blocks`); every method below keeps both tables in step.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from baige.runtime.infer.sliding_blocks import SlidingPool


class SequenceLike(Protocol):
    """What the block manager reads and writes on a sequence (see ``scheduler.Sequence``)."""

    token_ids: list[int]
    block_table: list[int]
    sliding_table: list[int]  # the sliding-window layers' blocks (read only with a sliding pool)
    num_computed_tokens: int
    num_cached_tokens: int
    lora_int_id: int  # 0: the base model; else the engine's id of the sequence's LoRA adapter


class OffloadTier(Protocol):
    """A second KV tier keyed by chain keys (``kv_offload.KVOffload``); all calls on the engine thread."""

    def contains(self, key: bytes) -> bool: ...

    def save(self, block_id: int, key: bytes, token_ids: tuple[int, ...]) -> None: ...

    def load(self, block_id: int, key: bytes, token_ids: tuple[int, ...]) -> bool: ...

    def clear(self) -> None: ...


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # the chained sha256 key, set once the block is full and computed
    token_ids: tuple[int, ...] = field(default=())  # the tokens behind `hash`, checked on a hit


def chain_hash(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The sha256 key (32 bytes) of a full block given the key of the block before it (None for
    the first block). Token ids are encoded as little-endian int64 after the parent key."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def root_key(lora_int_id: int) -> bytes | None:
    """The parent key of a sequence's first block: None for the base model (``lora_int_id`` 0),
    else ``sha256(b"lora" + lora_int_id as little-endian int64)``, 32 bytes."""
    return hashlib.sha256(b"lora" + struct.pack("<q", lora_int_id)).digest() if lora_int_id else None


class BlockManager:
    """Ref-counted allocation of KV blocks with prefix caching and LRU eviction.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: reuse computed full blocks across sequences.
        sliding_window: the window of the model's sliding-window layers, whose blocks then come from a
            pool of their own (``sliding``); None: one pool for every layer.
        num_sliding_blocks: the sliding pool's blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        num_sliding_blocks: int = 0,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # unreferenced, not cached; handed out from the left, given back to the left (the most recently
        # used first: warm in the caches, and on the CPU the pool's untouched pages stay unallocated)
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; oldest first
        self._cached: dict[bytes, int] = {}  # chained sha256 key -> block id
        # blocks in use when the prefix cache was reset (reset_prefix_cache): their K/V came from
        # weights since replaced, so they are never cached again, nor anything chained after them
        self._stale: set[int] = set()
        # prefix-cache statistics, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.offload: OffloadTier | None = None  # the second tier (kv_offload.py), set by the engine
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet taken by a step
        self.sliding: SlidingPool | None = None
        if sliding_window is not None:
            pool = BlockManager(num_sliding_blocks, block_size, enable_prefix_caching)
            self.sliding = SlidingPool(pool, sliding_window)

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of prompt tokens looked up in the prefix cache that were found (0 when none)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ------------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            del self._cached[block.hash]
            if self.offload is not None:
                self.offload.save(block_id, block.hash, block.token_ids)
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        self._stale.discard(block_id)  # handed out afresh: its slots are written before they are read
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id)
        block.ref_count += 1

    def _unref(self, block_id: int) -> int:
        block = self.blocks[block_id]
        block.ref_count -= 1
        return block.ref_count

    def _cached_prefix(self, seq: SequenceLike) -> list[int | bytes]:
        """The cached blocks that hold a prefix of ``seq``'s tokens (at least one token is left): a pool
        block's id, or the chain key of a block found in the second tier. None for a sequence that
        asks for prompt logprobs (``seq.prompt_logprobs`` set): those need logits at every prompt
        position, so its prompt is computed in full; likewise a pooling sequence whose pooling reads
        every position's hidden state (``seq.pooling.needs_whole_prompt``)."""
        if not self.enable_prefix_caching or getattr(seq, "prompt_logprobs", None) is not None:
            return []
        pooling = getattr(seq, "pooling", None)
        if pooling is not None and pooling.needs_whole_prompt:
            return []
        hits: list[int | bytes] = []
        parent = root_key(getattr(seq, "lora_int_id", 0))
        # never the whole sequence: the last token must be computed to get its logits
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is not None and self.blocks[block_id].token_ids == tokens:
                hits.append(block_id)
            elif block_id is None and self.offload is not None and self.offload.contains(h):
                hits.append(h)
            else:
                break
            parent = h
        return hits

    def _prefix_hits(self, seq: SequenceLike) -> tuple[list[int | bytes], list[bytes]]:
        """:meth:`_cached_prefix`, cut to what the sliding pool can serve (:meth:`SlidingPool.usable_hit`),
        and the hit blocks' chained keys."""
        hits = self._cached_prefix(seq)
        keys = [b if isinstance(b, bytes) else self.blocks[b].hash for b in hits]
        if self.sliding is not None and hits:
            j = self.sliding.usable_hit(keys, self._tokens_of(seq))
            hits, keys = hits[:j], keys[:j]
        return hits, keys

    def _tokens_of(self, seq: SequenceLike):
        bs = self.block_size
        return lambda i: tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def _load_offloaded(self, seq: SequenceLike, hits: list[int | bytes]) -> list[int]:
        """Reference ``hits``' pool blocks and load its second-tier blocks into fresh ones (cached under
        their keys again); the hits up to the first block that fails to load, as block ids (the pool
        blocks after it are released again)."""
        for b in hits:
            if isinstance(b, int):
                self._ref(b)  # first, so loading the tier's blocks never evicts one of them
        got: list[int] = []
        for i, b in enumerate(hits):
            if isinstance(b, bytes):
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block_id = self._take_block()
                if not self.offload.load(block_id, b, tokens):
                    self.blocks[block_id].ref_count = 0
                    self._free.appendleft(block_id)
                    for x in hits[i + 1 :]:  # pool hits after the gap: cached, so evictable again
                        if isinstance(x, int) and self._unref(x) == 0:
                            self._evictable[x] = None
                    break
                block = self.blocks[block_id]
                block.hash, block.token_ids = b, tokens
                self._cached[b] = block_id
                b = block_id
            got.append(b)
        return got

    def can_allocate(self, seq: SequenceLike, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed."""
        if seq.block_table:
            return self.can_append(seq, min(num_new_tokens, len(seq.token_ids) - seq.num_computed_tokens))
        hits, keys = self._prefix_hits(seq)
        n_cached = len(hits) * self.block_size
        pool = [b for b in hits if isinstance(b, int)]  # the tier's hits need fresh blocks
        evictable_hits = sum(1 for b in pool if self.blocks[b].ref_count == 0)
        n_tokens = n_cached + min(num_new_tokens, len(seq.token_ids) - n_cached)
        need = self.blocks_needed(n_tokens) - len(pool)
        if self.sliding is not None and not self.sliding.can_allocate(keys, self._tokens_of(seq), n_tokens):
            return False
        return need <= self.num_free_blocks - evictable_hits

    def allocate(self, seq: SequenceLike, num_new_tokens: int) -> int:
        """Give a sequence without blocks its cached prefix plus blocks for ``num_new_tokens`` more.

        Sets ``seq.block_table``, ``seq.num_cached_tokens`` and ``seq.num_computed_tokens`` (both
        to the cached prefix length). Returns the number of tokens to compute now (the request
        minus nothing; capped at what is left of the sequence). A sequence that arrives with its
        blocks and computed count (its prompt's KV pulled from another engine, ``kv_transfer/``) only
        gets slots for the tokens left. Raises RuntimeError when the pool is too small (call
        :meth:`can_allocate` first).
        """
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("out of KV blocks")
        if seq.block_table:
            num_new_tokens = min(num_new_tokens, len(seq.token_ids) - seq.num_computed_tokens)
            self.append_slots(seq, num_new_tokens)
            return num_new_tokens
        hits, keys = self._prefix_hits(seq)
        n_pool = sum(isinstance(b, int) for b in hits)
        hits = self._load_offloaded(seq, hits)
        n_cached = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += min(n_pool, len(hits)) * self.block_size
        seq.block_table = list(hits)
        seq.num_cached_tokens = seq.num_computed_tokens = n_cached
        num_new_tokens = min(num_new_tokens, len(seq.token_ids) - n_cached)
        if self.sliding is not None:
            self.sliding.allocate(seq, keys[: len(hits)], self._tokens_of(seq), n_cached + num_new_tokens)
        self.append_slots(seq, num_new_tokens)
        return num_new_tokens

    def _shared_writes(self, seq: SequenceLike, num_new_tokens: int) -> list[int]:
        """Indices into ``seq.block_table`` of the blocks the next ``num_new_tokens`` tokens are written into
        that other sequences reference too (a forked prompt's partial last block): copied on write."""
        if num_new_tokens <= 0:
            return []
        first = seq.num_computed_tokens // self.block_size
        end = min(len(seq.block_table), self.blocks_needed(seq.num_computed_tokens + num_new_tokens))
        return [i for i in range(first, end) if self.blocks[seq.block_table[i]].ref_count > 1]

    def can_append(self, seq: SequenceLike, num_new_tokens: int) -> bool:
        """Whether the pool has the blocks to hold ``num_new_tokens`` more computed tokens (copies on write
        included)."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        need += len(self._shared_writes(seq, num_new_tokens))
        if self.sliding is not None and not self.sliding.can_append(seq, num_new_tokens):
            return False
        return need <= self.num_free_blocks

    def append_slots(self, seq: SequenceLike, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_computed_tokens + num_new_tokens`` tokens; a shared block
        those tokens are written into is replaced by a fresh one and a pending copy (:meth:`take_copies`)."""
        shared = self._shared_writes(seq, num_new_tokens)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need + len(shared) > self.num_free_blocks:
            raise RuntimeError("out of KV blocks")
        if self.sliding is not None:
            self.sliding.append_slots(seq, num_new_tokens)
        for i in shared:
            src = seq.block_table[i]
            self._unref(src)  # still referenced by the others: never freed here
            seq.block_table[i] = self._take_block()
            self._copies.append((src, seq.block_table[i]))
        for _ in range(need):
            seq.block_table.append(self._take_block())

    def fork(self, parent: SequenceLike, child: SequenceLike, num_tokens: int) -> None:
        """Give ``child`` (no blocks yet, the same first ``num_tokens`` tokens as ``parent``) the blocks
        holding ``parent``'s first ``num_tokens`` tokens by reference, as computed (``num_computed_tokens``
        and ``num_cached_tokens`` = ``num_tokens``); the K/V must be in them before ``child``'s next step
        reads them (the parent computes them in the step that forks). Prefix statistics count the query with
        the full blocks as hits, as a prefix-cache admission would have. Raises ValueError for a child with
        blocks or a sliding-window pool (whose tables are not forked)."""
        if child.block_table or self.sliding is not None:
            raise ValueError("fork: the child must have no blocks, and the pool no sliding-window tables")
        child.block_table = parent.block_table[: self.blocks_needed(num_tokens)]
        for block_id in child.block_table:
            self._ref(block_id)
        child.num_computed_tokens = child.num_cached_tokens = num_tokens
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_tokens // self.block_size * self.block_size

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src block, dst block)`` pairs since the last call, in order; the caller
        copies every layer's K/V of ``src`` into ``dst`` before anything reads or writes ``dst``."""
        copies, self._copies = self._copies, []
        return copies

    def trim(self, seq: SequenceLike) -> None:
        """Give back the tail blocks that hold no computed token (the slots of rejected draft
        tokens). Such blocks were never hashed, so they go straight to the free list."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None
            self._free.appendleft(block_id)
        if self.sliding is not None:
            self.sliding.trim(seq)

    def cache_computed_blocks(self, seq: SequenceLike) -> None:
        """Register the hashes of ``seq``'s full blocks whose tokens are all computed now (in the sliding
        pool too), then give back the sliding blocks wholly before the window (:meth:`SlidingPool.slide`)."""
        if self.enable_prefix_caching:
            self._cache_blocks(seq)
        if self.sliding is not None:
            self.sliding.slide(seq)

    def _cache_blocks(self, seq: SequenceLike) -> None:
        parent = root_key(getattr(seq, "lora_int_id", 0))
        for i in range(seq.num_computed_tokens // self.block_size):
            if seq.block_table[i] in self._stale:
                return
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block.hash is None:
                h = chain_hash(parent, tokens)
                if h not in self._cached:  # an identical block cached by another sequence keeps its entry
                    block.hash, block.token_ids = h, tokens
                    self._cached[h] = block.block_id
                parent = h
            else:
                parent = block.hash
            if self.sliding is not None:
                self.sliding.cache_block(seq, i, parent, tokens)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (vLLM's ``reset_prefix_cache``; after the model's weights change,
        cached K/V no longer match what the model computes). Unreferenced cached blocks become free;
        blocks in use keep their sequences' K/V but lose their keys and are never cached again (nor
        the blocks after them in those sequences), so no later sequence reuses K/V of the old weights.
        Returns the number of keys dropped."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids = None, ()
        self._cached.clear()
        if self.offload is not None:
            self.offload.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._stale = {b.block_id for b in self.blocks if b.ref_count > 0}
        if self.sliding is not None:
            self.sliding.pool.reset_prefix_cache()
        return dropped

    def hold(self, block_ids: list[int]) -> None:
        """One more reference on each block (a KV transfer pins a finished prefill's blocks until a
        consumer has pulled them, and a pull's destination blocks until it ends); :meth:`release`
        drops it."""
        for block_id in block_ids:
            self._ref(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (last-first, so a tail is evicted before its prefix);
        cached blocks nobody references become evictable, the others free."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.appendleft(block_id)

    def free(self, seq: SequenceLike) -> None:
        """Drop ``seq``'s references (:meth:`release`) and clear its block table."""
        self.release(seq.block_table)
        seq.block_table = []
        if self.sliding is not None:
            self.sliding.free(seq)
        seq.num_computed_tokens = 0  # num_cached_tokens keeps its value: the last admission's (reported)
