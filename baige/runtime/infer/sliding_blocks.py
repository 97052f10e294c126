"""The block pool of a model's sliding-window layers (:class:`SlidingPool`), owned by the
:class:`~baige.runtime.infer.block_manager.BlockManager`.

A sliding layer with window w only ever reads the last w keys of a sequence (a query at p sees
``p - w < s <= p``), so its blocks wholly before the window of the next token to compute are dead for it.
The full-attention layers and the sliding layers therefore get separate pools and separate block
tables per sequence (vLLM's hybrid KV-cache manager with its ``SlidingWindowManager``, reduced to two
kinds of layers): ``seq.block_table`` indexes the full layers' pools, ``seq.sliding_table`` the sliding
layers' (smaller) pools. Both tables always have the same length, so token ``i``'s slot in either is
``table[i // block_size] * block_size + i % block_size``; an entry of ``sliding_table`` wholly before
the window is the *null block* (the sliding pool's scratch block, ``num_blocks``), which the paged
kernels never read unmasked (their window masks it). A sequence therefore holds at most
``ceil((w - 1) / block_size) + 1`` sliding blocks while decoding (plus the blocks of a prefill chunk
while it runs).

Prefix caching: a sliding block is cached under the same chained key as the full block at the same
index. A prefix hit of ``j`` blocks is usable only if the sliding pool still has the blocks covering
the window before token ``j * block_size`` (the first token computed): :meth:`SlidingPool.usable_hit`
shortens the full pool's hit to the longest such ``j``; the sliding table then holds null blocks
before that window.
"""

from __future__ import annotations


class SlidingPool:
    """The sliding layers' blocks: allocation, window sliding and prefix caching for ``seq.sliding_table``.

    Args:
        pool: a plain ``BlockManager`` of the sliding pool's blocks (its ``num_blocks`` is the null block);
            sequences are ``block_manager.SequenceLike`` with a ``sliding_table``.
        window: the sliding layers' window w in tokens.
    """

    def __init__(self, pool, window: int):
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.pool, self.window, self.block_size = pool, window, pool.block_size
        self.null_block = pool.num_blocks

    def first_needed(self, pos: int) -> int:
        """The first block a query at position ``pos`` or later reads: the one holding ``pos - w + 1``."""
        return max(0, pos - self.window + 1) // self.block_size

    def held(self, seq) -> int:
        """Sliding blocks ``seq`` references now (its table's entries other than the null block)."""
        return sum(b != self.null_block for b in seq.sliding_table)

    def _cached(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        block_id = self.pool._cached.get(key)
        return block_id if block_id is not None and self.pool.blocks[block_id].token_ids == tokens else None

    def usable_hit(self, keys: list[bytes], tokens_of) -> int:
        """The most blocks ``j <= len(keys)`` of a full-pool prefix hit whose window the sliding pool has
        cached (blocks ``first_needed(j * block_size) .. j - 1``; ``j = 0`` always); ``keys[i]`` is block
        ``i``'s chained key, ``tokens_of(i)`` its tokens."""
        if not self.pool.enable_prefix_caching:
            return 0
        j = len(keys)
        while j > 0:
            first = self.first_needed(j * self.block_size)
            missing = [i for i in range(first, j) if self._cached(keys[i], tokens_of(i)) is None]
            if not missing:
                return j
            j = missing[-1]  # a hit ending at or below the last gap
        return 0

    def blocks_to_allocate(self, keys: list[bytes], tokens_of, n_tokens: int) -> tuple[int, int]:
        """``(new blocks, evictable hits)`` :meth:`allocate` takes for a hit of ``len(keys)`` blocks and
        ``n_tokens`` tokens in all (cached ones included)."""
        j = len(keys)
        first = self.first_needed(j * self.block_size)
        hits = [self._cached(keys[i], tokens_of(i)) for i in range(first, j)]
        evictable = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
        return self.pool.blocks_needed(n_tokens) - first - len(hits), evictable

    def can_allocate(self, keys: list[bytes], tokens_of, n_tokens: int) -> bool:
        need, evictable_hits = self.blocks_to_allocate(keys, tokens_of, n_tokens)
        return need <= self.pool.num_free_blocks - evictable_hits

    def allocate(self, seq, keys: list[bytes], tokens_of, n_tokens: int) -> None:
        """``seq.sliding_table`` for a prefix hit of ``len(keys)`` usable blocks (:meth:`usable_hit`) and
        room for ``n_tokens`` tokens in all: null blocks, the cached window, fresh blocks."""
        j = len(keys)
        first = self.first_needed(j * self.block_size)
        table = [self.null_block] * first
        for i in range(first, j):
            block_id = self._cached(keys[i], tokens_of(i))
            self.pool._ref(block_id)
            table.append(block_id)
        while len(table) < self.pool.blocks_needed(n_tokens):
            table.append(self.pool._take_block())
        seq.sliding_table = table

    def freeable(self, seq) -> int:
        """Blocks :meth:`slide` would give back now."""
        first = self.first_needed(seq.num_computed_tokens)
        return sum(b != self.null_block for b in seq.sliding_table[:first])

    def slide(self, seq) -> None:
        """Give back the blocks wholly before the window of ``seq``'s next token (position
        ``num_computed_tokens``); their entries become the null block."""
        table = seq.sliding_table
        for i in range(self.first_needed(seq.num_computed_tokens)):
            if table[i] != self.null_block:
                self.pool.release([table[i]])
                table[i] = self.null_block

    def can_append(self, seq, num_new_tokens: int) -> bool:
        need = self.pool.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.sliding_table)
        return need <= self.pool.num_free_blocks + self.freeable(seq)

    def append_slots(self, seq, num_new_tokens: int) -> None:
        """Slide, then grow ``seq.sliding_table`` to ``num_computed_tokens + num_new_tokens`` tokens."""
        self.slide(seq)
        need = self.pool.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.sliding_table)
        if need > self.pool.num_free_blocks:
            raise RuntimeError("out of KV blocks (sliding-window layers)")
        for _ in range(need):
            seq.sliding_table.append(self.pool._take_block())

    def trim(self, seq) -> None:
        """Give back the tail blocks that hold no computed token (rejected drafts; never cached)."""
        keep = self.pool.blocks_needed(seq.num_computed_tokens)
        while len(seq.sliding_table) > keep:
            self.pool.release([seq.sliding_table.pop()])

    def cache_block(self, seq, i: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """Register block ``i`` of ``seq.sliding_table`` (full, computed) under the chained ``key``."""
        block = self.pool.blocks[seq.sliding_table[i]] if seq.sliding_table[i] != self.null_block else None
        if block is not None and block.hash is None and key not in self.pool._cached:
            block.hash, block.token_ids = key, tokens
            self.pool._cached[key] = block.block_id

    def free(self, seq) -> None:
        """Drop ``seq``'s sliding blocks (last first, as :meth:`BlockManager.release`)."""
        self.pool.release([b for b in seq.sliding_table if b != self.null_block])
        seq.sliding_table = []
