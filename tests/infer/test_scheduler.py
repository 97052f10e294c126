"""Scheduler without a model: token budget, sequence cap, chunked prefill, preemption, FIFO."""

import pytest

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.scheduler import Scheduler, Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_step=32, max_model_len=64):
    return Scheduler(BlockManager(num_blocks, block_size, False), max_num_seqs, max_tokens_step, max_model_len)


def run_step(sched, next_token=7):
    batch = sched.schedule()
    sampled = [
        next_token if s.num_computed_tokens + n == len(s.token_ids) else None
        for s, n in zip(batch.seqs, batch.num_new_tokens)
    ] + [next_token] * len(batch.forks)  # a forked child samples beside its parent
    sched.postprocess(batch, sampled)
    return batch


def test_token_budget_and_chunked_prefill():
    sched = make(max_tokens_step=16)
    a = Sequence(list(range(40)), max_tokens=3)
    sched.add(a)
    b1 = run_step(sched)
    assert b1.num_new_tokens == [16] and a.num_computed_tokens == 16 and a.num_output_tokens == 0
    b2 = run_step(sched)
    assert b2.num_new_tokens == [16] and a.num_output_tokens == 0
    b3 = run_step(sched)
    assert b3.num_new_tokens == [8] and a.num_output_tokens == 1  # prefill done: first token sampled
    b4 = run_step(sched)
    assert b4.num_new_tokens == [1] and b4.num_decodes == 1


def test_decodes_first_then_waiting_fill_the_budget():
    sched = make(max_tokens_step=10)
    a = Sequence([1, 2, 3], max_tokens=10)
    sched.add(a)
    run_step(sched)  # a prefilled, 1 token out
    b, c = Sequence(list(range(6)), max_tokens=5), Sequence(list(range(6)), max_tokens=5)
    sched.add(b)
    sched.add(c)
    batch = run_step(sched)
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 6, 3] and batch.num_decodes == 1
    assert batch.num_tokens == 10


def test_max_num_seqs_cap_and_fifo():
    sched = make(max_num_seqs=2)
    seqs = [Sequence([i] * 3, max_tokens=2) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = run_step(sched)
    assert batch.seqs == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    run_step(sched)  # seqs 0, 1 reach max_tokens=2 and finish
    assert seqs[0].finish_reason == "length" and seqs[0].is_finished
    batch = run_step(sched)
    assert batch.seqs == seqs[2:]


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 2 tokens; two sequences of 4 prompt tokens each take 4 blocks, decoding needs more
    sched = make(num_blocks=6, block_size=2, max_tokens_step=16)
    a, b = Sequence([1, 2, 3, 4], max_tokens=6), Sequence([5, 6, 7, 8], max_tokens=6)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 4 tokens + 1 sampled each, 2 blocks each
    run_step(sched)  # both decode into a 3rd block -> 6 blocks used
    assert sched.block_manager.num_free_blocks == 0
    run_step(sched)  # position 5 still fits in the 3rd block
    run_step(sched)  # position 6 needs a 4th block: b (newest) is preempted
    assert sched.num_preemptions >= 1 and b.status is SequenceStatus.WAITING and b.block_table == []
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    assert len(b.token_ids) == 7  # its generated tokens are kept and recomputed on readmission
    while not a.is_finished:
        run_step(sched)
    while not b.is_finished:
        run_step(sched)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert sched.block_manager.num_used_blocks == 0


def test_stop_tokens_min_tokens_and_max_model_len():
    sched = make(max_model_len=8)
    s = Sequence([1, 2, 3], max_tokens=50, stop_token_ids=frozenset({7}))
    sched.add(s)
    run_step(sched, next_token=7)
    assert s.finish_reason == "stop" and s.stop_reason == 7
    t = Sequence([1, 2, 3], max_tokens=50)
    sched.add(t)
    while not t.is_finished:
        run_step(sched, next_token=5)
    assert t.finish_reason == "length" and len(t.token_ids) == 8


def test_finish_aborts_waiting_and_running():
    sched = make(max_num_seqs=1)
    a, b = Sequence([1, 2], max_tokens=5), Sequence([3, 4], max_tokens=5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0


def test_max_loras_limits_distinct_adapters_per_step():
    """max_loras=2: a third adapter waits (its place kept) while base and known adapters go past it."""
    sched = Scheduler(BlockManager(64, 4, False), 8, 64, 64, max_loras=2)
    a, b = Sequence([1, 2, 3], max_tokens=2, lora_int_id=1), Sequence([1, 2], max_tokens=2, lora_int_id=2)
    c, base, a2 = (
        Sequence([4, 5], max_tokens=2, lora_int_id=3),
        Sequence([6, 9], max_tokens=2),
        Sequence([7, 8], max_tokens=5, lora_int_id=1),
    )
    for s in (a, b, c, base, a2):
        sched.add(s)
    batch = run_step(sched)
    assert batch.seqs == [a, b, base, a2] and sched.waiting == [c]
    assert len({s.lora_int_id for s in batch.seqs if s.lora_int_id}) == 2
    batch = run_step(sched)  # a and b reach max_tokens and finish after this step; c still waits
    assert c not in batch.seqs and a.is_finished and b.is_finished
    batch = run_step(sched)
    assert c in batch.seqs and {s.lora_int_id for s in batch.seqs} == {1, 3}


def test_samples_of_one_prompt_compute_its_full_blocks_once():
    """n = 3 samples of a 10-token prompt (block 4): the first computes all 10 tokens; the others wait one
    step, find its two full blocks in the prefix cache and compute the last 2 prompt tokens each. Another
    request admitted meanwhile is not held back."""
    sched = Scheduler(BlockManager(64, 4, True), 8, 64, 64)
    prompt = list(range(10, 20))
    samples = [Sequence(list(prompt), max_tokens=3, request_id="r", index=i) for i in range(3)]
    other = Sequence([1, 2, 3, 4, 5], max_tokens=3, request_id="q")
    for s in samples + [other]:
        sched.add(s)
    b1 = run_step(sched)
    assert b1.seqs == [samples[0], other] and b1.num_new_tokens == [10, 5]
    b2 = run_step(sched)
    assert b2.seqs == [samples[0], other, samples[1], samples[2]] and b2.num_new_tokens == [1, 1, 2, 2]
    assert [s.num_cached_tokens for s in samples] == [0, 8, 8]


def test_without_prefix_caching_samples_prefill_together():
    sched = make()
    samples = [Sequence(list(range(10)), max_tokens=2, request_id="r", index=i) for i in range(3)]
    for s in samples:
        sched.add(s)
    assert run_step(sched).num_new_tokens == [10, 10, 10]


def test_long_prefill_token_threshold_leaves_the_budget_to_the_prompts_behind():
    # vLLM's long_prefill_token_threshold: the 20-token prompt computes at most 8 tokens a step, and the
    # two short prompts queued behind it are admitted whole in its first step instead of after it
    sched = Scheduler(BlockManager(64, 4, False), 8, 32, 64, long_prefill_token_threshold=8)
    long, s1, s2 = (
        Sequence(list(range(20)), max_tokens=2),
        Sequence([1] * 6, max_tokens=3),
        Sequence([2] * 5, max_tokens=3),
    )
    for s in (long, s1, s2):
        sched.add(s)
    b1 = run_step(sched)
    assert b1.seqs == [long, s1, s2] and b1.num_new_tokens == [8, 6, 5] and b1.num_decodes == 0
    assert long.num_output_tokens == 0 and s1.num_output_tokens == s2.num_output_tokens == 1
    b2 = run_step(sched)  # decodes first; the long prompt's next chunk
    assert b2.seqs == [s1, s2, long] and b2.num_new_tokens == [1, 1, 8] and b2.num_decodes == 2
    b3 = run_step(sched)  # its last 4 prompt tokens: its first token is sampled
    assert b3.num_new_tokens == [1, 1, 4] and long.num_output_tokens == 1
    b4 = run_step(sched)
    assert b4.num_decodes == 1 and b4.num_new_tokens == [1]  # s1, s2 finished (3 tokens); long decodes


def test_without_threshold_a_long_prompt_takes_the_budget_first():
    sched = Scheduler(BlockManager(64, 4, False), 8, 24, 64)
    long, short = Sequence(list(range(20)), max_tokens=2), Sequence([1] * 6, max_tokens=3)
    sched.add(long)
    sched.add(short)
    b1 = run_step(sched)
    assert b1.seqs == [long, short] and b1.num_new_tokens == [20, 4]  # the short prompt gets what is left


def test_long_prefill_token_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(BlockManager(8, 4, False), 2, 8, 16, long_prefill_token_threshold=-1)
    with pytest.raises(BaigeError, match="--long-prefill-token-threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def _group(prompt, n, max_tokens=3, request_id="r"):
    seqs = [Sequence(list(prompt), max_tokens=max_tokens, request_id=request_id, index=i) for i in range(n)]
    for s in seqs:
        s.siblings = seqs
    return seqs


def test_fork_computes_a_prompt_once_and_copies_its_partial_block_on_write():
    """n = 3 samples of a 10-token prompt (block 4), fork on: the first computes all 10 tokens and the others
    are forked in the same step (its 3 blocks by reference, nothing computed, each samples a token); in the
    next step all three decode, and the first two writers of the shared partial block get a copy of it (the
    last one is then its only owner). Every block is back in the pool once they finish."""
    bm = BlockManager(64, 4, True)
    sched = Scheduler(bm, 8, 64, 64, fork=True)
    samples = _group(range(10, 20), 3)
    other = Sequence([1, 2, 3, 4, 5], max_tokens=3, request_id="q")
    for s in samples + [other]:
        sched.add(s)
    b1 = run_step(sched)
    assert b1.seqs == [samples[0], other] and b1.num_new_tokens == [10, 5]
    assert b1.forks == [(0, samples[1]), (0, samples[2])] and b1.block_copies == []
    assert samples[1].block_table == samples[2].block_table == samples[0].block_table
    partial = samples[0].block_table[2]
    assert bm.blocks[partial].ref_count == 3 and bm.blocks[samples[0].block_table[0]].ref_count == 3
    assert [s.num_computed_tokens for s in samples] == [10, 10, 10]
    assert [s.num_cached_tokens for s in samples] == [0, 10, 10]
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 5 + 10 + 10, 8 + 8)
    b2 = sched.schedule()
    assert b2.seqs == [samples[0], other, samples[1], samples[2]] and b2.num_new_tokens == [1, 1, 1, 1]
    copies = b2.block_copies
    assert [src for src, _ in copies] == [partial, partial]
    assert [dst for _, dst in copies] == [samples[0].block_table[2], samples[1].block_table[2]]
    assert samples[2].block_table[2] == partial and bm.blocks[partial].ref_count == 1
    assert len({s.block_table[2] for s in samples}) == 3
    assert samples[1].block_table[:2] == samples[0].block_table[:2]  # full blocks stay shared
    sched.postprocess(b2, [7, 7, 7, 7])
    while sched.has_unfinished():
        run_step(sched)
    assert all(s.num_output_tokens == 3 for s in samples) and bm.num_free_blocks == 64
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_fork_without_prefix_caching_and_a_child_sampled_nothing():
    """Fork needs no prefix cache: a block-aligned 8-token prompt's 2 blocks are shared, the next tokens go
    to fresh blocks (no copy). A forked child given no token (its parent's sample failed) computes its last
    prompt token itself, into a copy of the shared block."""
    bm = BlockManager(32, 4, False)
    sched = Scheduler(bm, 8, 64, 64, fork=True)
    a, b = _group(range(8), 2)
    sched.add(a)
    sched.add(b)
    b1 = sched.schedule()
    assert b1.seqs == [a] and b1.forks == [(0, b)]
    sched.postprocess(b1, [7])  # nothing for the child
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0 and b.num_computed_tokens == 7
    b2 = sched.schedule()
    assert b2.seqs == [a, b] and b2.num_new_tokens == [1, 1] and b2.num_decodes == 2
    assert b2.block_copies == [(a.block_table[1], b.block_table[1])]
    assert a.block_table[0] == b.block_table[0] and len(a.block_table) == 3


def test_fork_falls_back_to_the_prefix_cache_without_a_free_seat():
    """max_num_seqs 2: one sibling is forked beside the first, the third is admitted once a seat is free,
    finding the prompt's 2 full blocks cached and computing its last 2 prompt tokens."""
    sched = Scheduler(BlockManager(64, 4, True), 2, 64, 64, fork=True)
    samples = _group(range(10, 20), 3, max_tokens=1)
    for s in samples:
        sched.add(s)
    b1 = run_step(sched)
    assert b1.seqs == [samples[0]] and b1.forks == [(0, samples[1])]
    assert samples[0].is_finished and samples[1].is_finished and not samples[2].is_finished
    b2 = run_step(sched)
    assert b2.seqs == [samples[2]] and b2.num_new_tokens == [2] and samples[2].num_cached_tokens == 8
