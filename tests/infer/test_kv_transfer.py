"""P/D disaggregation inside one process: a producer engine and a consumer engine over each KV
transport (baige/runtime/infer/kv_transfer/: ZeroMQ always, NIXL where installed), against a plain
engine's greedy tokens."""

from __future__ import annotations

import time

import pytest
from tiny import BASE, make_checkpoint, write_tiny_tokenizer

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig, KVTransferConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("kvt") / "llama", "llama"))


@pytest.fixture(scope="module", params=["zmq", "nixl"])
def engines(request, model_dir):
    from baige.runtime.infer.kv_transfer.registry import CONNECTORS

    why = CONNECTORS[request.param].unavailable()
    if why is not None:
        pytest.skip(why)
    base = dict(model=str(model_dir), dtype="float32", kv_cache_memory="2MB", block_size=BLOCK, max_model_len=128)
    kv = {"kv_connector": request.param, "kv_connector_extra_config": {"transfer_timeout": 2}}
    prod = Engine.from_config(EngineConfig(**base, kv_transfer_config={**kv, "kv_role": "kv_producer"}))
    cons = Engine.from_config(EngineConfig(**base, kv_transfer_config={**kv, "kv_role": "kv_consumer"}))
    # the plain reference: the producer's engine serving requests without kv_transfer_params
    yield prod, prod, cons
    for e in (prod, cons):
        e.close()


def run(eng: Engine, rid: str, ids: list[int], params: SamplingParams, kv: dict | None = None):
    eng.add_request(rid, ids, params, kv_transfer_params=kv)
    for _ in range(1000):
        for out in eng.step():
            if out.finished:
                return out
    raise AssertionError("request did not finish")


def settle(eng: Engine, seconds: float = 0.5) -> None:
    """Step an idle engine for ``seconds``: pulls confirmed meanwhile are released."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        eng.step()
        time.sleep(0.02)


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % (BASE["vocab_size"] - 1) + 1 for i in range(n)]


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 23])
def test_consumer_decodes_pulled_blocks_computing_only_the_last_prompt_token(engines, n):
    plain, prod, cons = engines
    ids = prompt(n, n)
    want = run(plain, f"plain-{n}", ids, GREEDY).outputs[0].token_ids
    before = (cons.kv_transfer.stats.blocks_received, cons.kv_transfer.stats.bytes_received)
    params = run(prod, f"prefill-{n}", ids, PREFILL, {"do_remote_decode": True}).kv_transfer_params
    nblocks = -(-n // BLOCK)
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == n
    assert len(params["remote_block_ids"]) == len(params["remote_block_hashes"]) == nblocks
    out = run(cons, f"decode-{n}", ids, GREEDY, params)
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == n - 1  # every prompt token but the last came over the wire
    st = cons.kv_transfer.stats
    per_block = 2 * BASE["num_hidden_layers"] * BASE["num_key_value_heads"] * BLOCK * 16 * 4  # K+V, fp32
    assert st.block_bytes == per_block
    assert (st.blocks_received - before[0], st.bytes_received - before[1]) == (nblocks, nblocks * per_block)


def test_mismatched_prompt_and_dead_producer_fall_back_to_computing_the_prompt(engines):
    plain, prod, cons = engines
    ids = prompt(11, 101)
    want = run(plain, "plain-fb", ids, GREEDY).outputs[0].token_ids
    params = run(prod, "prefill-fb", ids, PREFILL, {"do_remote_decode": True}).kv_transfer_params
    failures = cons.kv_transfer.stats.pull_failures
    other = prompt(11, 102)  # another prompt: the block keys differ, nothing is pulled
    out = run(cons, "decode-other", other, GREEDY, params)
    assert out.outputs[0].token_ids == run(plain, "plain-other", other, GREEDY).outputs[0].token_ids
    assert out.num_cached_tokens == 0
    dead = dict(params, remote_port=1)  # nobody listens: the pull times out after transfer_timeout
    free = cons.block_manager.num_free_blocks
    out = run(cons, "decode-dead", ids, GREEDY, dead)
    assert out.outputs[0].token_ids == want and out.num_cached_tokens == 0
    assert cons.kv_transfer.stats.pull_failures == failures + 2
    assert cons.block_manager.num_free_blocks == free  # the pull's blocks went back to the pool


def test_a_transfer_is_pulled_once_and_released(engines):
    _, prod, cons = engines
    ids = prompt(9, 7)
    settle(prod)  # earlier tests' pulls confirmed (NIXL confirms on the producer's side-channel thread)
    pinned, used = prod.kv_transfer.stats.pinned, prod.block_manager.num_used_blocks  # earlier tests' pins
    params = run(prod, "prefill-once", ids, PREFILL, {"do_remote_decode": True}).kv_transfer_params
    assert prod.kv_transfer.stats.pinned == pinned + 1
    assert prod.block_manager.num_used_blocks == used + 3
    run(cons, "decode-once-a", ids, GREEDY, params)
    cons.reset_prefix_cache()  # the second pull cannot be served from the consumer's own cache
    failures = cons.kv_transfer.stats.pull_failures
    out = run(cons, "decode-once-b", ids, GREEDY, params)  # already pulled: refused, computed here
    assert cons.kv_transfer.stats.pull_failures == failures + 1 and out.num_cached_tokens == 0
    settle(prod)  # the producer releases pulled pins at its next step
    assert prod.kv_transfer.stats.pinned == pinned
    assert prod.block_manager.num_used_blocks == used


def test_abort_while_pulling_frees_every_block(engines):
    _, prod, cons = engines
    ids = prompt(17, 9)
    params = run(prod, "prefill-abort", ids, PREFILL, {"do_remote_decode": True}).kv_transfer_params
    cons.reset_prefix_cache()
    free = cons.block_manager.num_free_blocks
    cons.add_request("decode-abort", ids, GREEDY, kv_transfer_params=params)
    cons.abort("decode-abort")
    for _ in range(200):
        cons.step()
        if cons.block_manager.num_free_blocks == free and not cons.has_unfinished():
            break
    assert cons.block_manager.num_free_blocks == free and not cons.has_unfinished()


def test_bad_kv_transfer_params_are_the_callers_error(engines):
    _, prod, cons = engines
    with pytest.raises(BaigeError, match="not a KV producer"):
        cons.add_request("x2", [1, 2], GREEDY, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(BaigeError, match="remote_port: expected int"):
        cons.add_request("x3", [1, 2], GREEDY, kv_transfer_params={"do_remote_prefill": True, "remote_host": "h"})
    assert not cons.has_unfinished()
    with pytest.raises(BaigeError, match="not supported under --kv-transfer-config"):
        prod.sleep()  # pinned blocks would outlive the released pools


@pytest.mark.parametrize(
    "value, message",
    [
        ("{", "not valid JSON"),
        ('{"kv_role": "kv_producer"}', 'give "kv_connector"'),
        ('{"kv_connector": "auto", "kv_role": "prefill"}', "kv_role 'prefill'"),
        ('{"kv_connector": "auto", "kv_role": "kv_both", "kv_port": 70000}', "kv_port"),
        ('{"kv_connector": "auto", "kv_role": "kv_both", "x": 1}', "unknown key 'x'"),
        (
            '{"kv_connector": "auto", "kv_role": "kv_both", "kv_connector_extra_config": {"transfer_timeout": 0}}',
            "transfer_timeout",
        ),
    ],
)
def test_kv_transfer_config_errors_name_the_bad_key(value, message):
    with pytest.raises(BaigeError, match=message):
        KVTransferConfig.parse(value)


def test_transport_names():
    from baige.runtime.infer.kv_transfer.nixl_connector import NixlConnector
    from baige.runtime.infer.kv_transfer.registry import resolve_connector

    with pytest.raises(BaigeError, match="unknown kv_connector 'rdma'"):
        resolve_connector("rdma")
    assert resolve_connector("zmq").name == "zmq"
    nixl_here = NixlConnector.unavailable() is None  # NIXL where installed (one READ between the pools)
    assert resolve_connector("auto").name == ("nixl" if nixl_here else "zmq")


def test_write_blocks_lands_read_block_bytes_in_other_blocks():
    """A block's bytes (K of every layer, then V of every layer) written by write_blocks into other
    block ids: every layer's K and V there equal the source's, other blocks untouched, a short
    payload refused."""
    import torch

    from baige.runtime.infer.kv_transfer.blocks import block_bytes, read_block, write_blocks

    class Pool:  # the two attributes of a KVCache these functions read
        def __init__(self, seed: int):
            g = torch.Generator().manual_seed(seed)
            self.k = [torch.randn(3, 7, 4, 5, generator=g).to(torch.bfloat16) for _ in range(2)]
            self.v = [torch.randn(3, 7, 4, 5, generator=g).to(torch.bfloat16) for _ in range(2)]
            self.dtype = torch.bfloat16

    src, dst = Pool(0), Pool(1)
    before = [t.clone() for t in dst.k + dst.v]
    write_blocks(dst, [5, 0], [read_block(src, 2), read_block(src, 6)])
    assert block_bytes(src) == 2 * 2 * 3 * 4 * 5 * 2
    for s, d, b in zip(src.k + src.v, dst.k + dst.v, before):
        assert torch.equal(d[:, 5], s[:, 2]) and torch.equal(d[:, 0], s[:, 6])
        assert torch.equal(d[:, 1:5], b[:, 1:5]) and torch.equal(d[:, 6], b[:, 6])
    with pytest.raises(ValueError, match="bytes"):
        write_blocks(dst, [1], [memoryview(b"\0" * 10)])
