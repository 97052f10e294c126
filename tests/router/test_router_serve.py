"""`baige router` over real `baige serve` processes on a tiny random checkpoint (word-level tokenizer:
one word, one token, so prompt lengths are exact):

- prefix policy over 4 backends: 8 prompt families x 4 requests sharing a 96-token prefix, shuffled:
  the prefix-cache hit tokens summed over the backends' /metrics are >= 90% of the ideal (every
  family's 3 later requests hitting the whole prefix); round_robin on a workload of the same shape
  hits less;
- a client that leaves mid-stream: the backend aborts the request (it never finishes there);
- a backend killed mid-stream: the client gets an error event and [DONE], the router marks it down,
  the next requests go to the healthy one; a backend killed before streaming: the request is retried
  on another; 503 when none is left;
- `baige bench serve --base-url` on a router records it measured a router;
- `baige serve --data-parallel-size 2`: one command, two engines behind a router, the same greedy
  tokens as one engine; one SIGTERM stops it all with exit code 0.

Four backends live for the module (each a process with one thread), started together; the kill test
comes after the tests that need all four. Every wait is bounded."""

from __future__ import annotations

import random
import signal

import httpx
import pytest
from router_utils import TIMEOUT, client, launched_all, prom, router_over, sse_data, wait_until
from server_utils import launched

from tests.tiny import make_checkpoint, write_tiny_tokenizer

NUM_BACKENDS = 4
ARGS = ("--max-model-len", "256", "--kv-cache-memory", "4MB", "--max-num-seqs", "8", "--enforce-eager")
ARGS += ("--dtype", "float32", "--log-level", "warning")
BLOCK = 16  # baige serve's default --block-size
FAMILIES, PER_FAMILY, PREFIX, SUFFIX = 8, 4, 96, 8  # tokens; PREFIX is a whole number of blocks
# the test that kills backends comes after those that need all four: VICTIM is killed mid-stream (its
# engine steps take >= 20 ms, so its stream is still going when it dies), BEFORE before a request
VICTIM, BEFORE = 3, 2
SLOW = (
    "import time\nfrom baige.runtime.infer.engine import Engine\n"
    "_s = Engine.step\nEngine.step = lambda self: time.sleep(0.02) or _s(self)\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("router") / "tiny", "llama", seed=0))


@pytest.fixture(scope="module")
def backends(model_dir):
    from baige import kernels

    kernels.native_cpu_available()  # built once into the session's cache here, not by four servers at once
    with launched_all(model_dir, NUM_BACKENDS, *ARGS, codes={VICTIM: SLOW}) as servers:
        yield servers


def workload(seed: int) -> list[str]:
    """FAMILIES x PER_FAMILY prompts (PREFIX words shared in a family, SUFFIX words of their own), shuffled."""
    rng = random.Random(seed)
    words = lambda n: " ".join(f"t{rng.randrange(1, 160)}" for _ in range(n))  # noqa: E731
    prompts = []
    for _ in range(FAMILIES):
        prefix = words(PREFIX)
        prompts += [f"{prefix} {words(SUFFIX)}" for _ in range(PER_FAMILY)]
    rng.shuffle(prompts)
    return prompts


def hit_tokens(urls: list[str]) -> float:
    """Prefix-cache hit tokens summed over the backends (vLLM's counter name, or baige's)."""
    total = 0.0
    for url in urls:
        m = prom(httpx.get(f"{url}/metrics", timeout=TIMEOUT).text)
        total += m.get("vllm:prefix_cache_hits_total", m.get("baige:prefix_cache_hits_total"))
    return total


def send_all(router_url: str, prompts: list[str]) -> None:
    with client(router_url) as c:
        for p in prompts:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text


def test_prefix_policy_keeps_families_on_one_cache(backends):
    urls = [u for u, _ in backends]
    ideal = FAMILIES * (PER_FAMILY - 1) * (PREFIX // BLOCK * BLOCK)
    before = hit_tokens(urls)
    with router_over("prefix", backends=urls) as (url, _):
        send_all(url, workload(seed=1))
    prefix_hits = hit_tokens(urls) - before
    assert prefix_hits >= 0.9 * ideal, (prefix_hits, ideal)
    before = hit_tokens(urls)
    with router_over("round_robin", backends=urls) as (url, _):
        send_all(url, workload(seed=2))  # new families: nothing of the first run's cache applies
    rr_hits = hit_tokens(urls) - before
    assert rr_hits < prefix_hits, (rr_hits, prefix_hits)


def test_bench_serve_through_a_router(backends, model_dir):
    from baige.runtime.bench.serve_run import ServeBenchConfig, run_serve

    urls = [u for u, _ in backends[:2]]
    with router_over("least_load", backends=urls) as (url, _):
        cfg = ServeBenchConfig(model=str(model_dir), base_url=url, num_prompts=6, input_len=12, output_len=4)
        result = run_serve(cfg)
    assert result["completed"] == 6
    assert result["target"] == {
        "kind": "router",
        "base_url": url,
        "policy": "least_load",
        "backends": [{"url": u, "role": "backend"} for u in urls],
    }


def finished(url: str) -> dict:
    """A backend's baige:request_success_total by finish reason (an aborted request never finishes)."""
    m = prom(httpx.get(f"{url}/metrics", timeout=TIMEOUT).text)
    return {k: v for k, v in m.items() if k.startswith("baige:request_success_total")}


def test_a_client_leaving_mid_stream_aborts_the_request_at_the_backend(backends):
    url_b = backends[VICTIM][0]
    before = finished(url_b)
    body = {"prompt": "t5 t6 t7", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with router_over("round_robin", backends=[url_b]) as (url, _), client(url) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert sse_data(next(x for x in r.iter_lines() if x.startswith("data: ")))[0]["choices"]
        running = lambda: prom(httpx.get(f"{url_b}/metrics", timeout=TIMEOUT).text)["baige:num_requests_running"]  # noqa: E731
        wait_until(lambda: running() == 0, "the backend to drop the request")
    assert finished(url_b) == before  # dropped, not run to its 200 tokens


def test_backend_killed_mid_stream_and_before_streaming(backends):
    healthy, (victim, proc) = backends[0][0], backends[VICTIM]
    with router_over("round_robin", backends=[victim, healthy]) as (url, state), client(url) as c:
        down = next(b for b in state.pool.backends if b.url == victim)
        wait_until(lambda: all(b.healthy for b in state.pool.backends), "both backends up")
        body = {"prompt": "t5 t6 t7", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:  # round robin's first: the victim
            lines = r.iter_lines()
            assert sse_data(next(x for x in lines if x.startswith("data: ")))[0]["choices"][0]["text"]
            assert down.in_flight == 1
            proc.kill()
            events = sse_data("\n".join(lines))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "backend_failed"
        assert victim in events[-2]["error"]["message"] and len(events) < 200
        assert not down.healthy
        for _ in range(3):  # the next requests: the healthy backend
            assert c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2}).status_code == 200
        m = prom(c.get("/metrics").text)
        assert m[f'baige:router_requests_total{{backend="{healthy}",role="backend",status="200"}}'] == 3
        assert m[f'baige:router_stream_errors_total{{backend="{victim}",role="backend"}}'] == 1
        proc.wait(TIMEOUT)

    victim, proc = backends[BEFORE]
    # health checks a minute apart: the router learns of the death from the request itself
    with router_over("round_robin", backends=[victim, healthy], health_interval=60) as (url, state):
        proc.kill()
        proc.wait(TIMEOUT)
        with client(url) as c:
            r = c.post("/v1/completions", json={"prompt": "t5 t6", "max_tokens": 3, "stream": True})
            assert [e for e in sse_data(r.text) if e != "[DONE]"][-1]["choices"][0]["finish_reason"] == "length"
            assert prom(c.get("/metrics").text)[f'baige:router_retries_total{{backend="{victim}",role="backend"}}'] == 1
    with router_over("round_robin", backends=[victim]) as (url, _), client(url) as c:
        r = c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"


def test_serve_data_parallel_one_command(backends, model_dir):
    body = {"prompt": "t9 t8 t7 t6", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    one = httpx.post(f"{backends[0][0]}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    with (
        launched(model_dir, *ARGS, "--device", "cpu", "--data-parallel-size", "2", timeout=600) as (url, proc),
        client(url) as c,
    ):
        health = c.get("/health").json()["router"]
        assert health["policy"] == "least_load" and len(health["backends"]) == 2
        assert all(b["healthy"] for b in health["backends"])
        texts = [c.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(4)]
        assert texts == [one] * 4
        ranks = [b["url"] for b in health["backends"]]
        assert all(httpx.get(f"{r}/health", timeout=TIMEOUT).status_code == 200 for r in ranks)
        proc.send_signal(signal.SIGTERM)  # one signal: the router and the ranks drain, and the command exits 0
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    for rank in ranks:  # the command stopped its ranks on the way out
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{rank}/health", timeout=TIMEOUT)
