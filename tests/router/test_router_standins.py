"""`baige router` over stand-in OpenAI servers (apps on threads of the test, :mod:`router_utils`):
streams relayed event by event, a backend that breaks mid-stream (error event, marked down, later
requests elsewhere, re-admitted by a health check), fail-over before streaming (connection refused,
a 503 answer), 503 in OpenAI's shape when no backend is healthy, the newer endpoints
(/v1/embeddings, /tokenize, /detokenize, /version, /v1/responses and its stored responses followed to
their backend), 404 ``not_found_error`` for unknown paths, least_load from /metrics, the pd
flow's request fields, and the router's own /health and /metrics."""

from __future__ import annotations

import gc
import threading

import httpx
import pytest
from router_utils import StandIn, client, dead_url, prom, router_over, serve_app, sse_data, wait_until

from baige.runtime.router.pd import PRODUCER_KV_TRANSFER_PARAMS

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 5}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


@pytest.fixture
def pair():
    a, b = StandIn("a"), StandIn("b")
    with serve_app(a.app) as ua, serve_app(b.app) as ub:
        yield (a, ua), (b, ub)


def texts(events: list) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e]


def test_round_robin_alternates_and_passes_answers_through(pair):
    (a, ua), (b, ub) = pair
    with router_over("round_robin", backends=[ua, ub]) as (url, _), client(url) as c:
        answers = [c.post("/v1/completions", json=BODY).json()["choices"][0]["text"] for _ in range(4)]
        assert sorted(answers) == ["a", "a", "b", "b"] and answers[0] != answers[1]
        assert c.get("/v1/models").json()["data"][0]["id"] in ("a", "b")
        a.status = b.status = 400  # a backend's own 4xx is the client's answer, tried once
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 400 and r.json()["error"]["message"] in ("a says 400", "b says 400")
        assert len(a.bodies()) + len(b.bodies()) == 5
        # the request id reaches the backend (made by the router when the client sent none)
        c.post("/v1/completions", json=BODY, headers={"X-Request-Id": "rid-7"})
        assert "rid-7" in {h["x-request-id"] for _, _, h in a.received + b.received}


def test_stream_is_relayed_event_by_event(pair):
    """The backend holds its stream after the first event until the test has read that event through
    the router: a router that gathered the stream would never deliver it (the test would time out)."""
    (a, ua), _ = pair
    a.gate, a.events = threading.Event(), 4
    with router_over("round_robin", backends=[ua]) as (url, _), client(url) as c:
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert sse_data(first) and texts(sse_data(first)) == ["a-0"]
            a.gate.set()
            rest = sse_data("\n".join(lines))
        assert texts(rest) == ["a-1", "a-2", "a-3"] and rest[-1] == "[DONE]"


def test_a_client_that_leaves_mid_stream_frees_its_backend(pair):
    """The client closes its stream while the backend holds its own (gated): the router notices at once,
    closes the backend's connection and stops counting the request there."""
    (a, ua), _ = pair
    a.gate = threading.Event()
    with router_over("round_robin", backends=[ua]) as (url, state), client(url) as c:
        backend = state.pool.backends[0]
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            # The line iterator lives as long as the stream: a dropped one, once collected, closes the
            # connection (httpcore closes its stream on GeneratorExit), so the client would leave early.
            lines = r.iter_lines()
            assert texts(sse_data(next(lines))) == ["a-0"]
            gc.collect()  # the outcome does not hang on when the collector runs
            wait_until(lambda: backend.in_flight == 1, "the stream counted at its backend")
        wait_until(lambda: backend.in_flight == 0, "the router to drop the stream", timeout=10)
        a.gate.set()


def test_a_stream_broken_midway_ends_with_an_error_event_and_the_backend_goes_down(pair):
    (a, ua), (b, ub) = pair
    a.break_after, a.events = 2, 5
    with router_over("round_robin", backends=[ua, ub]) as (url, state), client(url) as c:
        backend_a = next(x for x in state.pool.backends if x.url == ua)
        wait_until(lambda: backend_a.healthy, "the first health check")
        got = None
        for _ in range(2):  # round robin: one of two requests meets a
            r = c.post("/v1/completions", json={**BODY, "stream": True})
            events = sse_data(r.text)
            if texts(events)[:1] == ["a-0"]:
                got = events
        assert got is not None
        assert texts(got) == ["a-0", "a-1"] and got[-1] == "[DONE]"
        error = got[-2]["error"]
        assert error["code"] == "backend_failed" and ua in error["message"] and error["type"] == "server_error"
        assert not backend_a.healthy
        health = c.get("/health").json()
        assert {x["url"]: x["healthy"] for x in health["router"]["backends"]} == {ua: False, ub: True}
        before = len(a.bodies())
        for _ in range(4):  # the next requests go to the healthy backend
            assert texts(sse_data(c.post("/v1/completions", json={**BODY, "stream": True}).text)) == [
                "b-0",
                "b-1",
                "b-2",
            ]
        assert len(a.bodies()) == before
        m = prom(c.get("/metrics").text)
        assert m[f'baige:router_stream_errors_total{{backend="{ua}",role="backend"}}'] == 1
        assert m[f'baige:router_backend_up{{backend="{ua}",role="backend"}}'] == 0
        a.health, a.break_after = 200, None  # re-admission by a health check
        wait_until(lambda: backend_a.healthy, "re-admission")
        answers = {c.post("/v1/completions", json=BODY).json()["choices"][0]["text"] for _ in range(2)}
        assert answers == {"a", "b"}


def test_fail_over_before_streaming(pair):
    (a, ua), (b, ub) = pair
    gone = dead_url()
    with router_over("round_robin", backends=[gone, ua]) as (url, state), client(url) as c:
        dead = next(x for x in state.pool.backends if x.url == gone)
        assert not dead.healthy  # the first health check, before serving
        dead.healthy = True  # as if it died after its last check: the request finds out
        r = c.post("/v1/completions", json={**BODY, "stream": True})
        assert texts(sse_data(r.text)) == ["a-0", "a-1", "a-2"]
        assert not dead.healthy and "ConnectError" in dead.last_error
    b.status = 503  # an answer of 503: the next backend is tried, and this one stays up
    with router_over("round_robin", backends=[ub, ua]) as (url, state), client(url) as c:
        assert [c.post("/v1/completions", json=BODY).json()["choices"][0]["text"] for _ in range(2)] == ["a", "a"]
        assert all(x.healthy for x in state.pool.backends)
        m = prom(c.get("/metrics").text)
        assert m[f'baige:router_retries_total{{backend="{ub}",role="backend"}}'] == 1


def test_503_when_no_backend_is_healthy():
    with router_over("least_load", backends=[dead_url(), dead_url()]) as (url, _), client(url) as c:
        assert c.get("/health").status_code == 503
        for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", {**CHAT, "stream": True})):
            r = c.post(path, json=body)
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "service_unavailable"
            assert r.json()["error"]["code"] == "no_healthy_backend"
        assert c.get("/v1/models").status_code == 503
        assert prom(c.get("/metrics").text)["baige:router_no_backend_total"] == 3


def test_least_load_reads_baige_and_vllm_metrics(pair):
    (a, ua), (b, ub) = pair
    a.metrics = "baige:num_requests_running 5.0\nbaige:num_requests_waiting 2.0\n"
    b.metrics = 'vllm:num_requests_running{model_name="m"} 1.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
    with router_over("least_load", backends=[ua, ub]) as (url, state), client(url) as c:
        loads = {x.url: x.reported_load for x in state.pool.backends}
        assert loads == {ua: 7.0, ub: 1.0}
        assert {c.post("/v1/completions", json=BODY).json()["choices"][0]["text"] for _ in range(3)} == {"b"}


def test_body_limit_and_unknown_paths(pair):
    (_, ua), _ = pair
    with router_over("round_robin", backends=[ua], max_request_bytes=2048) as (url, _), client(url) as c:
        r = c.post("/v1/completions", json={**BODY, "prompt": "x" * 4096})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert r.json()["error"]["message"] == "not found: /v1/nothing"
        assert c.post("/v1/responses/x/cancel", json={}).json()["error"]["type"] == "not_found_error"
        assert c.get("/v1/completions").status_code == 405


def test_newer_endpoints_pass_through_by_policy(pair):
    (a, ua), (b, ub) = pair
    with router_over("round_robin", backends=[ua, ub]) as (url, _), client(url) as c:
        for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
            got = [c.post(path, json={**BODY, "n": i}).json()["choices"][0]["text"] for i in range(2)]
            assert sorted(got) == ["a", "b"]
            assert {x["n"] for x in a.bodies(path) + b.bodies(path)} == {0, 1}
        assert c.get("/version").json()["version"] in ("a", "b")
        a.status = b.status = 400  # the backend's 4xx passes through
        r = c.post("/v1/embeddings", json=BODY)
        assert r.status_code == 400 and r.json()["error"]["message"] in ("a says 400", "b says 400")


def test_responses_stream_and_follow_their_backend(pair):
    """A stored response lives on the backend that made it: GET, DELETE and previous_response_id reach
    that backend whichever one round robin would pick next."""
    (a, ua), (b, ub) = pair
    a.gate, a.events = threading.Event(), 3
    with router_over("round_robin", backends=[ua, ub]) as (url, _), client(url) as c:
        ids = [c.post("/v1/responses", json={"model": "m", "input": "hi"}).json()["id"] for _ in range(2)]
        assert sorted(ids) == ["resp_a0", "resp_b0"]
        for rid in ids * 2:  # twice each: round robin alone would send one of each pair to the other
            r = c.get(f"/v1/responses/{rid}")
            assert r.status_code == 200 and r.json()["id"] == rid
        for _ in range(2):
            r = c.post("/v1/responses", json={"model": "m", "input": "more", "previous_response_id": "resp_b0"})
            assert r.status_code == 200 and r.json()["previous"] == "resp_b0" and r.json()["id"].startswith("resp_b")
        assert not [x for x in a.bodies("/v1/responses") if x.get("previous_response_id")]
        r = c.post("/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "resp_zz"})
        assert r.status_code == 404  # held nowhere: the backend's own 404
        assert c.delete("/v1/responses/resp_a0").json()["deleted"] is True
        r = c.get("/v1/responses/resp_a0")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert r.json()["error"]["code"] == "response_not_found" and "resp_b0" in b.stored
        # stream: relayed event by event as chat is (the stand-in holds after its first event)
        b.status = 503  # so the stream goes to a
        with c.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            assert texts(sse_data(next(line for line in lines if line.startswith("data: ")))) == ["a-0"]
            a.gate.set()
            rest = sse_data("\n".join(lines))
        assert texts(rest) == ["a-1", "a-2"] and rest[-1] == "[DONE]"


# ---- pd ---------------------------------------------------------------------------------------
KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0", "remote_block_ids": [3, 4]}


def test_pd_flow_sends_the_producer_one_token_and_the_consumer_its_params():
    prod, cons = StandIn("prod"), StandIn("cons")
    prod.kv_transfer_params = {**KV, "remote_host": "10.0.0.1", "remote_port": 5600}
    with serve_app(prod.app) as up, serve_app(cons.app) as uc:
        with router_over("pd", prefill=[dead_url(), up], decode=[uc]) as (url, _), client(url) as c:
            asked = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 20}
            r = c.post("/v1/chat/completions", json=asked, headers={"Authorization": "Bearer k"})
            assert texts(sse_data(r.text)) == ["cons-0", "cons-1", "cons-2"]
            ((p_path, p_body, p_headers),) = prod.received
            ((c_path, c_body, c_headers),) = cons.received
            assert p_path == c_path == "/v1/chat/completions"
            # the producer: one token, no stream, the remote-decode request (vLLM's NIXL-connector flow)
            assert p_body["kv_transfer_params"] == PRODUCER_KV_TRANSFER_PARAMS
            assert p_body["kv_transfer_params"]["do_remote_decode"] is True
            assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1 and p_body["stream"] is False
            assert "stream_options" not in p_body and p_body["messages"] == CHAT["messages"]
            # the consumer: the client's request as sent, plus the producer's kv_transfer_params
            assert c_body == {**asked, "kv_transfer_params": prod.kv_transfer_params}
            assert p_headers["x-request-id"] == c_headers["x-request-id"]
            assert p_headers["authorization"] == c_headers["authorization"] == "Bearer k"

            prod.kv_transfer_params = None  # a producer without a connector: the consumer computes the prompt
            r = c.post("/v1/completions", json=BODY)
            assert r.json()["choices"][0]["text"] == "cons" and "kv_transfer_params" not in cons.bodies()[-1]
            assert prom(c.get("/metrics").text)["baige:router_pd_without_kv_transfer_params_total"] == 1

            prod.status = 400  # the producer refuses the request: that is the answer, no consumer call
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 400 and len(cons.received) == 2
            assert c.post("/v1/completions", content=b"not json").status_code == 400


def test_pd_retries_the_consumer_and_503s_without_one():
    prod, cons = StandIn("prod"), StandIn("cons")
    prod.kv_transfer_params = KV
    with serve_app(prod.app) as up, serve_app(cons.app) as uc:
        with router_over("pd", prefill=[up], decode=[dead_url(), uc]) as (url, state), client(url) as c:
            for x in state.pool.backends:
                x.healthy = True  # the dead consumer too: each request must find out and go on
            for _ in range(2):
                r = c.post("/v1/completions", json={**BODY, "stream": True})
                assert texts(sse_data(r.text)) == ["cons-0", "cons-1", "cons-2"]
            assert all(b["kv_transfer_params"] == KV for b in cons.bodies())
            assert c.get("/health").status_code == 200
            cons.health = 503
            consumer = next(x for x in state.pool.backends if x.url == uc)
            wait_until(lambda: not consumer.healthy, "the consumer to go down")
            assert c.get("/health").status_code == 503  # a role without a healthy backend
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and "decode backend" in r.json()["error"]["message"]


def test_router_config_errors(cli_error):
    assert "--backend 'localhost:1'" in cli_error("router", "--backend", "localhost:1")
    assert "needs at least one --backend" in cli_error("router", "--policy", "prefix")
    assert "--policy pd needs" in cli_error("router", "--policy", "pd", "--prefill", "http://a:1")
    assert "not --backend" in cli_error("router", "--policy", "pd", "--backend", "http://a:1")
    assert "for --policy pd" in cli_error("router", "--backend", "http://a:1", "--decode", "http://b:1")
    assert "given twice" in cli_error("router", "--backend", "http://a:1", "--backend", "http://a:1/")
    assert "--policy" in cli_error("router", "--policy", "random", "--backend", "http://a:1")


def test_router_stream_with_httpx_async_client(pair):
    """Concurrent streams through the router all complete (one connection pool, no cross-talk)."""
    (a, ua), (b, ub) = pair
    a.events = b.events = 6

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as ac:

            async def one():
                r = await ac.post("/v1/completions", json={**BODY, "stream": True})
                return texts(sse_data(r.text))

            import asyncio

            return await asyncio.gather(*(one() for _ in range(16)))

    import asyncio

    with router_over("round_robin", backends=[ua, ub]) as (url, state):
        outs = asyncio.run(run(url))
        assert sorted(o[0][0] for o in outs) == ["a"] * 8 + ["b"] * 8
        assert all(o == [f"{o[0][0]}-{i}" for i in range(6)] for o in outs)
        assert all(x.in_flight == 0 for x in state.pool.backends)


def test_request_timeout_secs_bounds_a_hung_backend(pair):
    """A backend that keeps the connection open and never answers: the client gets a 504
    request_timeout after --request-timeout-secs; a stream that stalls after its first event ends with a
    request_timeout error event and [DONE]. The backend is not marked down; both are counted."""
    (a, ua), _ = pair
    a.stall = threading.Event()
    with router_over("round_robin", backends=[ua], request_timeout_secs=1.0) as (url, state), client(url) as c:
        backend = state.pool.backends[0]
        wait_until(lambda: backend.healthy, "the first health check")
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "request_timeout" and "--request-timeout-secs" in error["message"]
        a.stall.set()
        a.gate = threading.Event()  # now the stream stalls after its first event
        events = sse_data(c.post("/v1/completions", json={**BODY, "stream": True}).text)
        assert texts(events) == ["a-0"] and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "request_timeout"
        a.gate.set()
        assert backend.healthy
        wait_until(lambda: backend.in_flight == 0, "the router to close both backend requests")
        m = prom(c.get("/metrics").text)
        assert m[f'baige:router_request_timeouts_total{{backend="{ua}",role="backend"}}'] == 2
