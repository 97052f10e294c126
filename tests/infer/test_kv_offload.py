"""The second KV tier (``--kv-offload-size``, infer/kv_offload.py) on tiny random checkpoints: a prefix
evicted from a small pool comes back from the tier (counted, its prefill skipped) with the output of
a pool hit bit for bit; corrupted or foreign records are detected and recomputed; the LRU bound holds."""

import copy
import shutil

import pytest
import torch

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.block_manager import chain_hash
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model
from tests.tiny import make_checkpoint, write_tiny_tokenizer

BLOCK = 16
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # (K, V) x 2 layers x 2 KV heads x 16 tokens x head_dim 16 x fp32
g = torch.Generator().manual_seed(0)
A, B, C = (torch.randint(3, 160, (100,), generator=g).tolist() for _ in range(3))  # 6 full blocks each
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_offload")
    out = {}
    for seed in (3, 4):
        d = write_tiny_tokenizer(make_checkpoint(root / f"m{seed}", "llama", seed=seed))
        out[seed] = (load_model(d), Tokenizer.from_dir(d))
    return out


def engine(models, seed=3, blocks=8, **kw) -> Engine:
    model, tok = models[seed]
    cfg = EngineConfig(max_model_len=128, kv_cache_memory=blocks * BLOCK_BYTES, enforce_eager=True, **kw)
    return Engine(model, tok, cfg)


def run(eng, prompt, rid):
    eng.add_request(rid, prompt, PARAMS)
    (out,) = eng.run_to_completion([rid])
    if eng.kv_offload is not None:
        eng.kv_offload.flush()
    return out


def a_b_a(eng):
    """A, then B (whose blocks evict A's from the 8-block pool: all but A's first), then A again."""
    return run(eng, A, "a1"), run(eng, B, "b"), run(eng, A, "a2")


def tokens_and_logprobs(out):
    o = out.outputs[0]
    return o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]


def test_evicted_prefix_is_served_from_the_tier(models, tmp_path):
    reference = engine(models, blocks=64)  # everything stays in the pool: A's second run is a pool hit
    ref = a_b_a(reference)
    assert ref[2].num_cached_tokens == 96
    plain = a_b_a(engine(models))  # the small pool without the tier recomputes A's evicted blocks
    assert plain[2].num_cached_tokens == 16

    eng = engine(models, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    eng.step_shapes = []  # every step's computed tokens
    outs = a_b_a(eng)
    # A: 100 prompt tokens + 3 decodes; B the same; A again: 4 prompt tokens + 3 decodes
    assert sum(shape.tokens for shape in eng.step_shapes) == 103 + 103 + 7
    st = eng.kv_offload.stats
    # B's allocation evicted A's blocks 5..1 (the tail first); A's second run finds block 0 in the pool
    # and loads 1..5 from the tier: 96 prompt tokens not computed, 4 computed
    assert (st.hit_blocks, st.hit_tokens) == (5, 80)
    assert outs[2].num_cached_tokens == 96
    assert eng.block_manager.prefix_hits == 16  # the pool's own hits only (A2's block 0)
    assert st.load_bytes == 5 * BLOCK_BYTES and st.corrupted == 0
    assert st.stores >= 5 and st.store_bytes == st.stores * BLOCK_BYTES
    for got, want, recomputed in zip(outs, ref, plain):
        # the same bytes come back: tokens and logprobs equal a pool hit's exactly
        assert tokens_and_logprobs(got) == tokens_and_logprobs(want)
        assert got.outputs[0].token_ids == recomputed.outputs[0].token_ids
    eng.close()


def test_corrupted_record_is_detected_and_recomputed(models, tmp_path):
    plain = a_b_a(engine(models))
    eng = engine(models, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    run(eng, A, "a1")
    run(eng, B, "b")
    files = {p.stem: p for p in eng.kv_offload.dir.glob("*.kv")}
    assert len(files) == 5
    bm = eng.block_manager
    keys = []  # A's chain keys, block by block
    parent = None
    for i in range(6):
        parent = chain_hash(parent, tuple(A[i * BLOCK : (i + 1) * BLOCK]))
        keys.append(parent)
    assert sorted(files) == sorted(k.hex() for k in keys[1:])
    data = bytearray(files[keys[3].hex()].read_bytes())
    data[-100] ^= 0xFF  # one flipped payload byte
    files[keys[3].hex()].write_bytes(bytes(data))
    out = run(eng, A, "a2")
    st = eng.kv_offload.stats
    assert st.corrupted == 1 and st.hit_blocks == 2  # blocks 1 and 2 loaded; 3 failed; 3..5 computed
    assert out.num_cached_tokens == 48
    assert bm.prefix_hits == 16
    assert out.outputs[0].token_ids == plain[2].outputs[0].token_ids
    eng.kv_offload.flush()
    assert not files[keys[3].hex()].exists() or keys[3] in eng.kv_offload._index  # dropped (or stored afresh)
    eng.close()


def test_records_of_another_model_are_never_used(models, tmp_path):
    first = engine(models, seed=3, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    run(first, A, "a1")
    run(first, B, "b")
    run(first, C, "c")  # evicts A's first block too (the oldest evictable one)
    first.close()
    # the same model in a new engine (an empty pool) finds all six of A's blocks on disk
    again = engine(models, seed=3, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    assert run(again, A, "a").num_cached_tokens == 96 and again.kv_offload.stats.hit_blocks == 6
    again.close()
    ref = run(engine(models, seed=4), A, "a")
    other = engine(models, seed=4, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    assert other.kv_offload.dir != first.kv_offload.dir  # another fingerprint, another directory
    out = run(other, A, "a")
    assert other.kv_offload.stats.hit_blocks == 0 and out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    other.close()
    # seed 3's files copied under seed 4's fingerprint (same names: the chain keys are the model's
    # tokens only): their headers name another fingerprint, so each is refused and recomputed
    stale = engine(models, seed=4, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    for p in first.kv_offload.dir.glob("*.kv"):
        shutil.copy(p, stale.kv_offload.dir / p.name)
    stale.close()
    stale = engine(models, seed=4, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path))
    out = run(stale, A, "a")
    assert stale.kv_offload.stats.corrupted == 1 and stale.kv_offload.stats.hit_blocks == 0
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == ref.outputs[0].token_ids
    stale.close()


def test_lru_bound(models, tmp_path):
    eng = engine(models, kv_offload_size=3 * BLOCK_BYTES, kv_offload_dir=str(tmp_path))
    run(eng, A, "a1")
    run(eng, B, "b")  # evicts A's blocks 5, 4, 3, 2, 1 in that order: the tier keeps the last three
    st, tier = eng.kv_offload.stats, eng.kv_offload
    # stored then evicted, or dropped while queued (the writer behind): the same three blocks remain
    assert st.stores - st.evictions == 3 and st.stores + st.dropped == 5
    assert st.used_bytes == 3 * BLOCK_BYTES
    parent, keys = None, []
    for i in range(6):
        parent = chain_hash(parent, tuple(A[i * BLOCK : (i + 1) * BLOCK]))
        keys.append(parent)
    assert sorted(p.stem for p in tier.dir.glob("*.kv")) == sorted(k.hex() for k in keys[1:4])
    assert [tier.contains(k) for k in keys] == [False, True, True, True, False, False]
    eng.close()


def test_reset_prefix_cache_clears_the_tier_and_temp_dir_goes(models):
    eng = engine(models, kv_offload_size="1MiB")  # a CPU pool: a temporary directory
    run(eng, A, "a1")
    run(eng, B, "b")
    tmp = eng.kv_offload.root
    eng.kv_offload.flush()  # the writer thread counts a block once it is written
    assert tmp.is_dir() and eng.kv_offload.stats.used_bytes == 5 * BLOCK_BYTES
    eng.reset_prefix_cache()
    assert run(eng, A, "a2").num_cached_tokens == 0 and eng.kv_offload.stats.hit_blocks == 0
    eng.sleep()  # clears the tier too; a weight update while asleep takes the fingerprint again
    eng.update_weights(list(models[3][0].state_dict().items()))
    eng.wake_up()
    assert eng.kv_offload.stats.used_bytes == 0
    assert run(eng, A, "a3").num_cached_tokens == 0
    eng.close()
    assert not tmp.exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_memory_tier_on_cuda(models):
    """A GPU pool spills to pinned host memory (no directory); the reply equals a pool hit's."""
    model, tok = models[3]
    gpu = copy.deepcopy(model).cuda()

    def cuda_engine(blocks, **kw):
        cfg = EngineConfig(max_model_len=128, kv_cache_memory=blocks * BLOCK_BYTES, enforce_eager=True, **kw)
        return Engine(gpu, tok, cfg)

    ref = a_b_a(cuda_engine(64))
    eng = cuda_engine(8, kv_offload_size="1MiB")
    assert eng.kv_offload.root is None  # host memory
    outs = a_b_a(eng)
    assert eng.kv_offload.stats.hit_blocks == 5 and outs[2].num_cached_tokens == 96
    for got, want in zip(outs, ref):
        assert tokens_and_logprobs(got) == tokens_and_logprobs(want)
    eng.close()


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(kv_offload_size="lots"), "--kv-offload-size: bad size"),
        (dict(kv_offload_dir="/tmp/x"), "--kv-offload-dir needs --kv-offload-size"),
        (dict(kv_offload_size="1GB", enable_prefix_caching=False), "needs prefix caching"),
        (dict(kv_offload_size=100), "holds no block"),
    ],
)
def test_bad_settings(models, kw, msg):
    with pytest.raises(BaigeError, match=msg):
        engine(models, **kw)


def test_unusable_directory(models, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BaigeError, match="--kv-offload-dir .*afile: cannot use it"):
        engine(models, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path / "afile"))
