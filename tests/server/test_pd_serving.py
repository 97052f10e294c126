"""P/D disaggregation across processes: a `baige serve` producer and a consumer
(--kv-transfer-config, ZeroMQ transport), driven as a router's `pd` policy drives them (vLLM's
kv_transfer_params flow: max_tokens 1 + do_remote_decode to the producer, then the original request
with the producer's kv_transfer_params to the consumer), half of the prompts through `baige router
--policy pd` (in-process), half by those two requests done here. Greedy outputs are held to one plain
engine."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_utils import router_over
from server_utils import launched, parse_metrics
from tiny import BASE, make_checkpoint, write_tiny_tokenizer

from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams

BLOCK = 4
MAX_TOKENS = 8
TIMEOUT = 60.0  # seconds any one HTTP call may take
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the tiny tokenizer has none
SERVE = ["--dtype", "float32", "--block-size", str(BLOCK), "--kv-cache-memory", "4MB", "--max-model-len", "160"]
SERVE += ["--chat-template", TEMPLATE]
LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 23, 31, 40, 57, 64]  # 16 prompts, block-aligned and not


def kv_config(role: str, **extra) -> list[str]:
    cfg = {"kv_connector": "auto", "kv_role": role, "kv_connector_extra_config": {"transfer_timeout": 10, **extra}}
    return ["--kv-transfer-config", json.dumps(cfg)]


def prompt(n: int, salt: int) -> list[int]:
    return [(11 * i + 17 * salt) % (BASE["vocab_size"] - 1) + 1 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("pd") / "llama", "llama"))


@pytest.fixture(scope="module")
def expected(model_dir):
    """One plain engine's greedy completions of every prompt (the parity oracle)."""
    eng = Engine.from_config(EngineConfig(model=str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=160))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = {n: prompt(n, n) for n in LENGTHS} | {-1: prompt(13, 99)}
    for key, ids in prompts.items():
        eng.add_request(str(key), ids, params)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id)] = o.outputs[0].text
    return prompts, outs


def body(ids: list[int]) -> dict:
    return {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def pd_request(producer: str, consumer: str, ids: list[int]) -> tuple[dict, str]:
    """The router's two requests: the producer's kv_transfer_params, the consumer's text."""
    pre = dict(body(ids), max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    r = httpx.post(f"{producer}/v1/completions", json=pre, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    r = httpx.post(f"{consumer}/v1/completions", json=dict(body(ids), kv_transfer_params=params), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return params, r.json()["choices"][0]["text"]


def routed_request(router: str, ids: list[int]) -> str:
    """One request through the router's pd policy: the consumer's text."""
    r = httpx.post(f"{router}/v1/completions", json=body(ids), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metrics(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample of ``/metrics``."""
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=TIMEOUT).text)


def sample(m: dict[str, float], name: str, **labels) -> float:
    """The value of the sample ``name`` whose labels include ``labels``."""
    hits = [v for k, v in m.items() if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_pd_pair_matches_one_instance_moves_every_prompt_token_and_survives_a_killed_producer(model_dir, expected):
    prompts, want = expected
    with (
        launched(model_dir, *SERVE, *kv_config("kv_producer")) as (producer, proc),
        launched(model_dir, *SERVE, *kv_config("kv_consumer")) as (consumer, _),
    ):
        direct, routed = LENGTHS[::2], LENGTHS[1::2]
        with router_over("pd", prefill=[producer], decode=[consumer]) as (router, _), ThreadPoolExecutor(4) as pool:
            # half as `baige router --policy pd` sends them, half by the router's two requests done here
            got = pool.map(lambda n: routed_request(router, prompts[n]), routed)
            results = dict(zip(direct, pool.map(lambda n: pd_request(producer, consumer, prompts[n]), direct)))
            for n, text in zip(routed, got):
                assert text == want[n], n
        for n in direct:
            params, text = results[n]
            assert text == want[n], n
            assert params["remote_num_tokens"] == n and len(params["remote_block_ids"]) == -(-n // BLOCK)
        m, p = metrics(consumer), metrics(producer)
        assert sample(m, "baige:kv_transfer_failures_total") == 0
        # every transferred request computed exactly its last prompt token (vLLM's design: its logits
        # give the first output token); each observation is >= 1, so sum == count means all are 1
        name = "vllm:request_prefill_kv_computed_tokens"
        assert sample(m, f"{name}_count") == sample(m, f"{name}_sum") == len(LENGTHS)
        assert sample(m, f"{name}_bucket", le="1.0") == len(LENGTHS)
        blocks = sum(-(-n // BLOCK) for n in LENGTHS)
        per_block = 2 * BASE["num_hidden_layers"] * BASE["num_key_value_heads"] * BLOCK * 16 * 4  # K+V, fp32
        assert sample(m, "baige:kv_transfer_block_bytes") == per_block
        assert sample(m, "baige:kv_transfer_blocks_total", direction="received") == blocks
        assert sample(m, "baige:kv_transfer_bytes_total", direction="received") == blocks * per_block
        assert sample(p, "baige:kv_transfer_bytes_total", direction="sent") == blocks * per_block
        assert sample(m, "baige:kv_transfer_pulls_total") == len(LENGTHS)
        assert sample(m, "baige:kv_transfer_failures_total") == 0
        # a malformed kv_transfer_params is the client's 400, naming the field
        bad = dict(body([1, 2]), kv_transfer_params={"do_remote_prefill": True, "remote_port": "x"})
        r = httpx.post(f"{consumer}/v1/completions", json=bad, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        # the chat endpoint carries kv_transfer_params both ways too
        chat = {"messages": [{"role": "user", "content": " ".join(f"t{i}" for i in prompt(21, 5))}]}
        chat |= {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        pre = dict(chat, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        r = httpx.post(f"{producer}/v1/chat/completions", json=pre, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        decode = dict(chat, kv_transfer_params=r.json()["kv_transfer_params"])
        got = httpx.post(f"{consumer}/v1/chat/completions", json=decode, timeout=TIMEOUT).json()
        plain = httpx.post(f"{producer}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
        assert got["choices"][0]["message"] == plain["choices"][0]["message"]
        assert sample(metrics(consumer), "baige:kv_transfer_pulls_total") == len(LENGTHS) + 1
        # the producer dies after its prefill: the consumer's pull times out (transfer_timeout) and it
        # computes the prompt itself, with the same text
        ids = prompts[-1]
        pre = dict(body(ids), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = httpx.post(f"{producer}/v1/completions", json=pre, timeout=TIMEOUT).json()["kv_transfer_params"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        r = httpx.post(f"{consumer}/v1/completions", json=dict(body(ids), kv_transfer_params=params), timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[-1]
        m = metrics(consumer)
        assert sample(m, "baige:kv_transfer_failures_total") == 1
        assert sample(m, "baige:kv_transfer_pulls_total") == len(LENGTHS) + 1
        assert sample(m, f"{name}_sum") == len(LENGTHS) + 1 + len(ids)  # this one computed its whole prompt


def test_a_server_with_the_nixl_transport_shuts_down_with_exit_status_0(model_dir):
    """SIGTERM to a producer on NIXL: a graceful shutdown, exit status 0 (NIXL's UCX backend loads a library whose
    destructor crashed every such process at exit with signal 11; baige.cli.exit_process skips it)."""
    from baige.runtime.infer.kv_transfer.nixl_connector import NixlConnector

    why = NixlConnector.unavailable()
    if why:
        pytest.skip(why)
    cfg = {"kv_connector": "nixl", "kv_role": "kv_producer"}
    with launched(model_dir, *SERVE, "--kv-transfer-config", json.dumps(cfg)) as (url, proc):
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
