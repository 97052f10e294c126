"""Sliding-window layers in the paged KV cache (issue #47): their blocks live in a pool of their own and are
given back once wholly before the window (block_manager.py, sliding_blocks.py). The block manager's counts
stay bounded by the window over a 4x-window generation; the engine's greedy tokens on a tiny Llama given
sliding layers by hand equal the contiguous reference (kernels.attention with the window), with chunked
prefill and prefix-cache hits; step-by-step cached decode equals one full forward."""

from __future__ import annotations

import pytest
import torch
from oracle_generate import ContiguousKVCache, generate_tokens
from tiny import make_checkpoint, write_tiny_tokenizer

from baige import SamplingParams
from baige.runtime.config import EngineConfig
from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.scheduler import Scheduler, Sequence
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

WINDOW, BS = 6, 4
BOUND = -(-WINDOW // BS) + 1  # the acceptance bound: ceil(window / block) + 1 sliding blocks per sequence


def _step(sched: Scheduler, token: int = 7):
    batch = sched.schedule()
    sampled = [
        token if s.num_computed_tokens + n == len(s.token_ids) else None
        for s, n in zip(batch.seqs, batch.num_new_tokens)
    ]
    sched.postprocess(batch, sampled)
    return batch


@pytest.mark.parametrize("prompt_len,budget", [(3, 32), (23, 8)])  # short prompt; long one in chunks
def test_a_4x_window_generation_keeps_the_sliding_blocks_bounded(prompt_len, budget):
    bm = BlockManager(64, BS, True, sliding_window=WINDOW, num_sliding_blocks=12)
    sched = Scheduler(bm, 2, budget, 256)
    seq = Sequence(list(range(1, prompt_len + 1)), max_tokens=4 * WINDOW)
    sched.add(seq)
    held, pool_used = [], []
    while not seq.is_finished:
        _step(sched)
        if not seq.is_finished:
            assert len(seq.sliding_table) == len(seq.block_table)  # the same positions in both tables
            held.append(bm.sliding.held(seq))
            pool_used.append(bm.sliding.pool.num_used_blocks)
            assert all(
                b == bm.sliding.null_block
                for b in seq.sliding_table[: bm.sliding.first_needed(seq.num_computed_tokens)]
            )
    assert len(seq.token_ids) >= 4 * WINDOW
    assert max(held) <= BOUND and max(pool_used) <= BOUND
    assert bm.num_used_blocks == 0 and bm.sliding.pool.num_used_blocks == 0  # everything back after finishing


def test_prefix_hit_needs_only_the_window_blocks_of_the_sliding_pool():
    bm = BlockManager(64, BS, True, sliding_window=WINDOW, num_sliding_blocks=16)
    sched = Scheduler(bm, 4, 64, 256)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks, hits up to 5 blocks (the last token is computed)
    a = Sequence(prompt + [1], max_tokens=4 * WINDOW)
    sched.add(a)
    while len(a.token_ids) < len(prompt) + 12:  # a decodes on: its early sliding blocks go back (cached, evictable)
        _step(sched)
    b = Sequence(prompt + [2, 3], max_tokens=2)
    sched.add(b)
    _step(sched)
    # the full layers' hit is blocks 0..4 (20 tokens); the sliding pool still has the blocks covering the
    # window before token 20 (positions 15..19: blocks 3, 4), so the hit is usable as a whole
    assert b.num_cached_tokens == 20
    first = bm.sliding.first_needed(20)
    assert first == 3 and b.sliding_table[:first] == [bm.sliding.null_block] * first
    assert bm.sliding.held(b) <= BOUND + 1  # the window blocks of the hit, the block of the new tokens


def test_prefix_hit_is_cut_to_what_the_sliding_pool_still_has():
    bm = BlockManager(64, BS, True, sliding_window=WINDOW, num_sliding_blocks=3)  # tiny: cached blocks get evicted
    sched = Scheduler(bm, 2, 4, 256)  # prefill chunks of 4 tokens: a window and a chunk fit in 3 blocks
    prompt = list(range(40, 61))
    a = Sequence(prompt + [1], max_tokens=4 * WINDOW)
    sched.add(a)
    while not a.is_finished:
        _step(sched)
    b = Sequence(prompt + [2], max_tokens=1)
    sched.add(b)
    _step(sched)
    # every sliding block a held was reused by its own later blocks: no window is left cached for b
    assert b.num_cached_tokens == 0 and bm.prefix_hits == 0


@pytest.fixture(scope="module")
def sliding_llama(tmp_path_factory):
    """A tiny Llama (3 layers) whose layers 0 and 2 get a window of 6 by hand (the families' config
    parsing is not under test here)."""
    ckpt = write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("sw") / "llama", "llama", num_hidden_layers=3))
    model = load_model(ckpt, "float32")
    cfg = model.config
    cfg.layer_types, cfg.sliding_window = ("sliding_attention", "full_attention", "sliding_attention"), WINDOW
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.sliding_window = cfg.layer_window(i)
    return ckpt, model


@torch.inference_mode()
def test_cached_decode_equals_the_full_forward(sliding_llama):
    _, model = sliding_llama
    ids = torch.randint(1, 160, (1, 4 * WINDOW + 3), generator=torch.Generator().manual_seed(0))
    full = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))[0]  # kernels.attention with window
    no_window = [layer.self_attn.sliding_window for layer in model.model.layers]
    cache = ContiguousKVCache(model, 1, ids.shape[1])
    P = 5
    steps = [model.compute_logits(model(ids[:, :P], torch.arange(P)[None], cache))[0]]
    cache.advance()
    for t in range(P, ids.shape[1]):
        steps.append(model.compute_logits(model(ids[:, t : t + 1], torch.tensor([[t]]), cache))[0])
        cache.advance()
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=0)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    try:
        plain = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
    finally:
        for layer, w in zip(model.model.layers, no_window):
            layer.self_attn.sliding_window = w
    assert (plain[WINDOW:] - full[WINDOW:]).abs().max() > 1e-3  # the window is in effect past its length
    torch.testing.assert_close(plain[:WINDOW], full[:WINDOW], atol=1e-5, rtol=0)


def test_engine_greedy_equals_the_contiguous_reference(sliding_llama):
    ckpt, model = sliding_llama
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(1, 160, (17,), generator=g).tolist()
    prompts = [
        shared + [5, 9],  # longer than the window, in chunks
        torch.randint(1, 160, (3,), generator=g).tolist(),
        shared + [11],  # admitted later: a prefix hit on the first prompt's blocks
    ]
    params = SamplingParams(max_tokens=4 * WINDOW, temperature=0, ignore_eos=True)
    expected = [list(generate_tokens(model, p, params)) for p in prompts]
    cfg = EngineConfig(
        max_model_len=128, kv_cache_memory=2_000_000, block_size=BS, max_num_batched_tokens=8, max_num_seqs=4, seed=0
    )
    eng = Engine(model, Tokenizer.from_dir(ckpt), cfg)
    assert eng.kv_cache.sliding_layers == {0, 2} and eng.block_manager.sliding is not None
    assert eng.kv_cache.k[0].shape[1] == eng.kv_cache.num_sliding_blocks + 1 < eng.kv_cache.k[1].shape[1]
    for i, p in enumerate(prompts[:2]):
        eng.add_request(f"r{i}", p, params)
    steps, final = 0, {}
    while eng.scheduler.has_unfinished() or steps <= 8:
        if steps == 8:
            eng.add_request("r2", prompts[2], params)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        steps += 1
        for seq in eng.scheduler.running:
            if seq.num_computed_tokens >= len(seq.token_ids) - 1:  # decoding: the bound holds
                assert eng.block_manager.sliding.held(seq) <= BOUND
    assert [final[f"r{i}"] for i in range(3)] == expected
    assert eng.block_manager.prefix_hits > 0  # r2 reused r0's prompt blocks


def test_batch_invariant_mode_refuses_a_window(sliding_llama):
    from baige.errors import BaigeError
    from baige.runtime.model.logprobs import check_batch_invariant

    _, model = sliding_llama
    with pytest.raises(
        BaigeError, match=r"does not support attention with sliding_window \(model.layers.0.self_attn\)"
    ):
        check_batch_invariant(model)


def test_roofline_counts_a_sliding_layers_bounded_reads(sliding_llama):
    from baige.runtime import roofline

    _, model = sliding_llama
    cfg = model.config  # 3 layers, 2 KV heads x 16 dims: 256 bytes of fp32 K+V per token and layer
    assert cfg.kv_bytes_per_token(4) == 3 * 256
    assert roofline.kv_read_bytes_per_token(cfg, 4, 4) == 3 * 256  # a context inside the window: every layer whole
    # a context of 4 windows: the full layer reads 24 keys, each sliding layer 6 -> (24 + 6 + 6) / 24 of a layer
    assert roofline.kv_read_bytes_per_token(cfg, 4, 4 * WINDOW) == 256 * (24 + 6 + 6) / 24
