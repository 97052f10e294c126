"""The scheduler's WAITING_FOR_REMOTE_KVS path (P/D disaggregation), plain Python: a sequence whose
prompt's KV is being pulled is held aside with its blocks, then admitted computing only what is left."""

from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.scheduler import Scheduler, Sequence, SequenceStatus


def held_sequence(bm: BlockManager, sched: Scheduler, n: int = 9) -> Sequence:
    seq = Sequence(list(range(1, n + 1)), max_tokens=3, request_id="held")
    bm.allocate(seq, n)  # its prompt's blocks, as KVTransfer allocates them before the pull
    sched.add(seq, remote_kv=True)
    return seq


def test_held_sequence_waits_then_decodes_its_last_prompt_token_in_its_own_blocks():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    held = held_sequence(bm, sched)
    other = Sequence([1, 2, 3], 3, request_id="other")
    sched.add(other)
    batch = sched.schedule()
    assert batch.seqs == [other] and held.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert held in sched.waiting and sched.has_unfinished()
    table = list(held.block_table)
    held.num_computed_tokens = 8  # the pull filled every prompt token but the last
    sched.remote_kv_done(held)
    batch = sched.schedule()
    i = batch.seqs.index(held)
    assert batch.num_new_tokens[i] == 1 and i < batch.num_decodes  # one decode row: the last prompt token
    assert held.block_table == table and held.status is SequenceStatus.RUNNING


def test_abort_while_held_frees_its_blocks_and_calls_on_finish():
    bm = BlockManager(16, 4)
    finished = []
    sched = Scheduler(bm, 4, 64, 64, on_finish=lambda s, reason: finished.append((s.request_id, reason)))
    held = held_sequence(bm, sched)
    assert bm.num_free_blocks == 16 - 3
    sched.finish(held, "abort")
    assert finished == [("held", "abort")] and bm.num_free_blocks == 16 and not sched.has_unfinished()
    sched.remote_kv_done(held)  # the pull ends after the abort: nothing is queued
    assert not sched.schedule().seqs and sched.waiting == []


def test_hold_and_release_keep_a_block_past_its_sequence():
    bm = BlockManager(8, 4)
    seq = Sequence(list(range(1, 7)), 1, request_id="p")
    bm.allocate(seq, 6)
    table = list(seq.block_table)
    bm.hold(table)  # a producer pins a finished prefill's blocks
    bm.free(seq)
    assert bm.num_free_blocks == 8 - 2
    bm.release(table)
    assert bm.num_free_blocks == 8
