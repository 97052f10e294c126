"""Stop strings: the Aho-Corasick matcher against brute force (hypothesis), the engine's stop cut
with a long stop list, sha256 prefix-cache keys, and O(1) lazy finishing in the scheduler."""

import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from baige.runtime.infer import block_manager as bm_mod
from baige.runtime.infer.block_manager import BlockManager, chain_hash
from baige.runtime.infer.scheduler import Scheduler, Sequence
from baige.runtime.infer.stop import StopMatcher, StopState

ALPHABET = "abc"


def brute_first_stop(chunks: list[str], stops: list[str]):
    """Feed the chunks; at the first chunk after which some stop string occurs in the text, the
    earliest start among them (what min(text.find(s)) gives) and the chunk index; else None."""
    text = ""
    for k, chunk in enumerate(chunks):
        text += chunk
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return min(hits), k
    return None


def brute_held_back(text: str, stops: list[str]) -> int:
    """Longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max(
        (k for k in range(len(text) + 1) if any(len(s) > k and s.startswith(text[len(text) - k :]) for s in stops)),
        default=0,
    )


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=6),
    chunks=st.lists(st.text(ALPHABET, max_size=4), max_size=8),
)
def test_matcher_equals_brute_force(stops, chunks):
    state = StopState(StopMatcher(stops))
    text, got = "", None
    for k, chunk in enumerate(chunks):
        text += chunk
        hit = state.feed(text)
        if hit is not None:
            got = (hit[0], k)
            assert hit[1] in stops and text[hit[0] : hit[0] + len(hit[1])] == hit[1]
            break
        assert state.held_back() == brute_held_back(text, stops)
    assert got == brute_first_stop(chunks, stops)


def test_overlapping_stops_by_hand():
    # "bc" ends first (at 2) but "abcd" starts earlier (0) and ends in the same chunk: the cut is at 0
    state = StopState(StopMatcher(["bc", "abcd"]))
    assert state.feed("abcd") == (0, "abcd")
    state = StopState(StopMatcher(["bc", "abcd"]))
    assert state.feed("xab") is None and state.held_back() == 2  # "ab" may still grow into "abcd"
    assert state.feed("xabc") == (2, "bc")  # in this chunk only "bc" is complete


def test_engine_cuts_at_a_stop_string_among_many(embedded_dir):
    from baige.runtime.config import EngineConfig
    from baige.runtime.infer.engine import Engine
    from baige.runtime.infer.sampling import SamplingParams
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.loader import load_model

    eng = Engine(
        load_model(embedded_dir),
        Tokenizer.from_dir(embedded_dir),
        EngineConfig(max_model_len=128, kv_cache_memory=20_000_000, max_num_seqs=4),
    )
    greedy = dict(temperature=0, ignore_eos=True, max_tokens=20)
    eng.add_request("free", "The capital of France is", SamplingParams(**greedy))
    full = eng.run_to_completion(["free"])[0].outputs[0].text
    word = full.split()[2]  # a word in the middle of the greedy text
    stops = [f"zz{i}qq" for i in range(60)] + [word]
    eng.add_request("cut", "The capital of France is", SamplingParams(stop=stops, **greedy))
    out = eng.run_to_completion(["cut"])[0].outputs[0]
    assert out.text == full[: full.index(word)] and out.finish_reason == "stop" and out.stop_reason == word


def test_prefix_keys_are_chained_sha256():
    first = chain_hash(None, (1, 2, 3))
    assert first == hashlib.sha256(struct.pack("<3q", 1, 2, 3)).digest()
    assert chain_hash(first, (4,)) == hashlib.sha256(first + struct.pack("<q", 4)).digest()
    assert len(first) == 32


class _Seq:
    def __init__(self, tokens):
        self.token_ids, self.block_table, self.num_computed_tokens, self.num_cached_tokens = list(tokens), [], 0, 0


def test_a_key_collision_never_serves_another_prompts_blocks(monkeypatch):
    """Even if two different blocks got the same key, a hit compares the block's tokens."""
    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, tokens: b"same key for every block")
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _Seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_computed_blocks(a)
    b = _Seq([7, 8, 9, 10, 11])
    bm.allocate(b, 5)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)


def test_finish_is_lazy_and_the_queues_skip_finished_sequences():
    sched = Scheduler(
        BlockManager(num_blocks=64, block_size=4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32
    )
    seqs = [Sequence([i + 1] * 3, max_tokens=4, request_id=f"r{i}") for i in range(6)]
    for s in seqs:
        sched.add(s)
    for s in seqs[:3]:  # the head of the waiting queue, finished before it is ever scheduled
        sched.finish(s, "abort")
    assert sched.waiting == seqs[3:] and sched.has_unfinished()
    batch = sched.schedule()
    assert batch.seqs == seqs[3:5]
    sched.finish(seqs[3], "abort")  # running: dropped at the next schedule, its blocks freed at once
    assert sched.running == [seqs[4]]
    sched.postprocess(batch, [9, 9])
    batch = sched.schedule()
    assert batch.seqs == [seqs[4], seqs[5]]
    for s in seqs[4:]:
        sched.finish(s, "abort")
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0
