"""Forking a request's ``n`` samples (scheduler.py, ``BlockManager.fork``) on tiny random checkpoints: an
n = 4 request computes its prompt once (the engine's step shapes count every computed token) and its
samples equal those of the unforked path (each sibling admitted a step later through the prefix cache):
bitwise in batch-invariant mode, tokens and logprobs within float noise otherwise; the same on the MLA
latent cache (one pool for K and V) and with the KV offload tier; a model whose sliding-window layers
have a pool of their own keeps the unforked path."""

import pytest
import torch
from mla_tiny import make_mla_checkpoint
from tiny import make_checkpoint, write_tiny_tokenizer

from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

PROMPT_LEN, MAX_TOKENS, N = 37, 6, 4  # block 4: 9 full blocks and a partial one of 1 token
SEEDED = SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 160, (n,), generator=g).tolist() for n in (PROMPT_LEN, 9, 16)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("fork") / "qwen2", "qwen2-bias"))


def _engine(ckpt, fork: bool, **kw) -> Engine:
    cfg = dict(max_model_len=128, kv_cache_memory=4_000_000, block_size=4, max_num_seqs=16, seed=0)
    eng = Engine(load_model(ckpt, dtype="float32"), Tokenizer.from_dir(ckpt), EngineConfig(**{**cfg, **kw}))
    assert eng.scheduler.fork  # on by default for these models
    eng.scheduler.fork = fork
    eng.step_shapes = []
    return eng


def _run(eng: Engine, reqs) -> list:
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(f"r{i}", p, sp)
    return eng.run_to_completion([f"r{i}" for i in range(len(reqs))])


def _samples(out) -> list[tuple[list[int], list[float], list]]:
    return [(o.token_ids, [lp.logprob for lp in o.logprobs], [lp.top for lp in o.logprobs]) for o in out.outputs]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_n4_request_computes_its_prompt_once_and_samples_as_unforked(qwen2, prompts, batch_invariant):
    got = {}
    for fork in (True, False):
        eng = _engine(qwen2, fork, batch_invariant=batch_invariant)
        (out,) = _run(eng, [(prompts[0], SEEDED)])
        computed = sum(s.tokens for s in eng.step_shapes)
        got[fork] = (out, computed, eng.step_shapes)
    (forked, n_fork, shapes), (plain, n_plain, _) = got[True], got[False]
    # forked: the prompt once, then N rows per step for the tokens after the first
    assert n_fork == PROMPT_LEN + N * (MAX_TOKENS - 1)
    assert shapes[0].tokens == PROMPT_LEN and [s.tokens for s in shapes[1:]] == [N] * (MAX_TOKENS - 1)
    # unforked: each of the other N - 1 recomputes the prompt's partial last block (1 token) a step later
    assert n_plain == PROMPT_LEN + (N - 1) * (PROMPT_LEN % 4) + N * (MAX_TOKENS - 1)
    a, b = _samples(forked), _samples(plain)
    assert len({tuple(t) for t, _, _ in a}) > 1  # the samples differ (each its own seeded generator)
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    if batch_invariant:
        assert a == b  # every logprob and top-2 entry bit for bit, the siblings' first ones included
    else:
        diff = max(abs(x - y) for (_, la, _), (_, lb, _) in zip(a, b) for x, y in zip(la, lb))
        assert diff < 1e-5
    assert forked.num_cached_tokens == plain.num_cached_tokens == 0  # the first sample's admission


def test_mixed_batch_greedy_prompt_logprobs_and_chunked_prompt(qwen2, prompts):
    """n = 3 greedy with prompt logprobs, n = 2 seeded with the prompt split into 8-token chunks, beside a
    plain request: every output and the prompt logprobs equal the unforked path's."""
    greedy = SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    seeded = SamplingParams(n=2, max_tokens=5, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=1)
    one = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    reqs = [(prompts[1], greedy), (prompts[0], seeded), (prompts[2], one)]
    outs = {}
    for fork in (True, False):
        eng = _engine(qwen2, fork, batch_invariant=True, max_num_batched_tokens=16)
        outs[fork] = _run(eng, reqs)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # every reference dropped
    for a, b in zip(outs[True], outs[False]):
        assert _samples(a) == _samples(b)
        assert a.prompt_logprobs == b.prompt_logprobs
    assert len({tuple(o.token_ids) for o in outs[True][0].outputs}) == 1  # greedy: the same 3 samples


def test_mla_latent_cache(tmp_path, prompts):
    """DeepSeek-V3's latent cache (K and V one pool): the forked copy-on-write copies it once per block."""
    path = write_tiny_tokenizer(make_mla_checkpoint(tmp_path / "mla", "deepseek-v3"))
    outs = {}
    for fork in (True, False):
        eng = _engine(path, fork, block_size=8, kv_cache_memory=2_000_000)
        assert eng.kv_cache.v is eng.kv_cache.k
        outs[fork] = _run(eng, [(prompts[0], SEEDED), (prompts[2], SEEDED)])
    for a, b in zip(outs[True], outs[False]):
        sa, sb = _samples(a), _samples(b)
        assert [t for t, _, _ in sa] == [t for t, _, _ in sb]
        assert max(abs(x - y) for (_, la, _), (_, lb, _) in zip(sa, sb) for x, y in zip(la, lb)) < 1e-5


def test_kv_offload_tier(qwen2, prompts, tmp_path):
    """With the second KV tier (every layer's blocks in one pool) a forked request equals the unforked one."""
    outs = {}
    for fork in (True, False):
        eng = _engine(
            qwen2, fork, batch_invariant=True, kv_offload_size="1MiB", kv_offload_dir=str(tmp_path / str(fork))
        )
        assert eng.kv_offload is not None
        outs[fork] = _run(eng, [(prompts[0], SEEDED)])
        eng.close()
    assert _samples(outs[True][0]) == _samples(outs[False][0])


def test_sliding_window_pool_keeps_the_unforked_path(tmp_path, prompts):
    """Gemma 3's sliding layers get a pool of their own, whose tables are not forked: fork is off, and an
    n = 3 greedy request still gives 3 equal samples."""
    path = write_tiny_tokenizer(make_checkpoint(tmp_path / "gemma3", "gemma3"))
    eng = Engine(
        load_model(path, dtype="float32"),
        Tokenizer.from_dir(path),
        EngineConfig(max_model_len=128, kv_cache_memory=2_000_000, block_size=4, max_num_seqs=8),
    )
    assert eng.block_manager.sliding is not None and not eng.scheduler.fork
    (out,) = _run(eng, [(prompts[0], SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True))])
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1 and len(out.outputs[0].token_ids) == 5
