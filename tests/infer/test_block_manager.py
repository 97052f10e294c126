"""BlockManager without a model: allocation, ref counts, prefix-cache hits, LRU eviction."""

import subprocess
import sys

import pytest

from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.scheduler import Sequence


def seq(tokens):
    return Sequence(list(tokens), max_tokens=100)


def test_bookkeeping_modules_do_not_import_torch():
    code = (
        "import sys; import baige.runtime.infer.block_manager, baige.runtime.infer.scheduler; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_append_free_counts_blocks():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    s = seq(range(10))
    assert bm.can_allocate(s, 10)
    assert bm.allocate(s, 10) == 10
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    s.num_computed_tokens = 10
    s.token_ids += [10, 11]
    bm.append_slots(s, 2)  # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    s.token_ids.append(12)
    bm.append_slots(s, 1)  # the 13th token opens a 4th block
    assert len(s.block_table) == 4 and bm.num_used_blocks == 4
    assert len(set(s.block_table)) == 4
    bm.free(s)
    assert s.block_table == [] and bm.num_used_blocks == 0 and bm.num_free_blocks == 10


def test_freed_blocks_are_reused_most_recent_first():
    """Without prefix caching a freed sequence's blocks are handed out again before blocks never used
    (LIFO: warm, and on the CPU the pool's untouched pages stay unallocated)."""
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a, b = seq(range(8)), seq(range(4))
    bm.allocate(a, 8)
    bm.allocate(b, 4)
    assert a.block_table == [0, 1] and b.block_table == [2]
    bm.free(a)  # released last-first: 1, then 0
    c = seq(range(12))
    bm.allocate(c, 12)
    assert c.block_table == [0, 1, 3]


def test_out_of_blocks():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    s = seq(range(9))  # needs 3 blocks
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 9)
    assert bm.can_allocate(s, 8)  # a chunk of 8 fits
    assert bm.allocate(s, 8) == 8
    assert not bm.can_append(s, 1) or s.num_computed_tokens + 1 <= 8


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(10))
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_computed_blocks(a)  # two full blocks get hashes
    b = seq(list(range(8)) + [99, 98, 97])
    assert bm.allocate(b, 11) == 3  # 8 tokens from the cache, 3 to compute
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.prefix_hits == 8 and bm.prefix_queries == 10 + 11
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_used_blocks == 0
    # a different first block breaks the chain: no hit for the second block even though it is equal
    c = seq([7, 7, 7, 7] + [4, 5, 6, 7, 1])
    assert bm.allocate(c, 9) == 9 and c.num_cached_tokens == 0


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_computed_blocks(a)
    b = seq(range(8))
    assert bm.allocate(b, 8) == 4  # only the first block is reused: the last token needs its logits
    assert b.num_cached_tokens == 4


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_computed_blocks(a)
    first, second = a.block_table[:2]
    bm.free(a)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 4
    # still cached after free: a new sequence with the same prefix hits
    b = seq([1, 2, 3, 4, 9])
    assert bm.allocate(b, 5) == 1 and b.block_table[:2] == [first, second]
    bm.free(b)
    # fill the pool with unrelated tokens: cached blocks are evicted, the tail ([3, 4]) before the head
    c = seq([50, 51, 52, 53, 54, 55])
    bm.allocate(c, 6)
    assert second in c.block_table and first not in c.block_table
    d = seq([1, 2, 3, 4, 9])
    assert not bm.can_allocate(d, 5)  # c holds 3 of the 4 blocks
    bm.free(c)
    assert bm.can_allocate(d, 5)
    assert bm.allocate(d, 5) == 3 and d.block_table[0] == first  # [1, 2] survived, [3, 4] did not


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_computed_blocks(a)
    b = seq([1, 2, 3, 4, 5])
    assert bm.allocate(b, 5) == 5 and not set(a.block_table) & set(b.block_table)


def test_prefix_cache_keys_include_the_lora_adapter():
    """The same tokens under two adapters (or an adapter and the base) never share a block; the same
    adapter does."""
    from baige.runtime.infer.scheduler import Sequence as Seq

    bm = BlockManager(32, 4, True)
    first = Seq(list(range(13)), max_tokens=4, lora_int_id=1)
    bm.allocate(first, 13)
    first.num_computed_tokens = 13
    bm.cache_computed_blocks(first)
    for lora_int_id, hit in ((2, 0), (0, 0), (1, 12)):
        other = Seq(list(range(13)), max_tokens=4, lora_int_id=lora_int_id)
        assert bm.allocate(other, 13) == 13 - hit and other.num_cached_tokens == hit
        assert len(set(other.block_table) & set(first.block_table)) == hit // 4
        bm.free(other)


def test_reset_prefix_cache_drops_keys_and_never_recaches_blocks_in_use():
    """After a reset (new weights) no block computed before it is found again: cached free blocks
    are free, and the blocks of a sequence still running are not hashed again as it goes on (nor the
    blocks after them); a sequence started after the reset caches normally."""
    bm = BlockManager(num_blocks=12, block_size=4)
    done, running = seq(range(8)), seq(range(100, 112))
    for s in (done, running):
        bm.allocate(s, len(s.token_ids))
        s.num_computed_tokens = len(s.token_ids)
        bm.cache_computed_blocks(s)
    bm.free(done)  # two evictable cached blocks
    assert bm.reset_prefix_cache() == 5  # 2 of `done`, 3 of `running`
    assert bm.num_free_blocks == 9 and bm.num_used_blocks == 3
    again = seq(range(9))
    assert bm.allocate(again, 9) == 9 and again.num_cached_tokens == 0
    running.token_ids += [112, 113, 114, 115]
    bm.append_slots(running, 4)
    running.num_computed_tokens = 16
    bm.cache_computed_blocks(running)  # its 4 full blocks: 3 stale, then one chained after them
    assert all(bm.blocks[b].hash is None for b in running.block_table)
    again.num_computed_tokens = 9
    bm.cache_computed_blocks(again)  # a sequence admitted after the reset caches its full blocks
    assert [bm.blocks[b].hash is not None for b in again.block_table] == [True, True, False]
    bm.free(running)
    bm.free(again)
    follower = seq(range(100, 117))
    bm.allocate(follower, 17)
    assert follower.num_cached_tokens == 0  # none of `running`'s old-weights blocks is reused
    later = seq(range(10))
    bm.allocate(later, 10)
    assert later.num_cached_tokens == 8  # `again`'s blocks, computed after the reset, are
