"""`baige serve` end to end on the embedded model: the official openai client, SSE streaming,
32 concurrent streams, every bad input (status + OpenAI error shape, then a good request), API key,
client disconnects, /metrics. One server (a subprocess) for the module."""

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
import torch
from server_utils import launched, parse_metrics

KEY = "test-key"
NAME = "smol"
MAX_LEN = 1024


@pytest.fixture(scope="module")
def server(embedded_dir):
    with launched(
        embedded_dir,
        "--served-model-name",
        NAME,
        "--max-model-len",
        str(MAX_LEN),
        "--kv-cache-memory",
        "150MB",
        "--max-num-seqs",
        "32",
        "--enforce-eager",
        "--log-level",
        "warning",
        api_key=KEY,
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def metrics(http) -> dict[str, float]:
    return parse_metrics(http.get("/metrics").text)


def sse_events(text: str) -> list:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_openai_client_chat_models_and_streaming(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=30)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=30, stream=True)
    )
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_echo_with_logprobs_scores_the_prompt(client, embedded_dir):
    # lm-eval's loglikelihood request: echo the prompt, generate nothing, logprobs of the prompt tokens
    from baige.runtime.weights.loader import load_model

    ids = [504, 3575, 282, 4649, 314, 7042]
    only = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = only.choices[0].logprobs
    assert only.usage.completion_tokens == 0 and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model = load_model(embedded_dir, "float32")
    with torch.inference_mode():
        ref = torch.log_softmax(model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0], -1)
    assert max(abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) for j in range(1, len(ids))) < 1e-4
    assert all(len(t) == 1 for t in lp.top_logprobs[1:]) and "".join(lp.tokens) == only.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(ids))]
    # with generated tokens: prompt entries first (the same numbers), then one entry per generated token
    more = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp2 = more.choices[0].logprobs
    assert len(lp2.tokens) == len(ids) + 3 and lp2.token_logprobs[: len(ids)] == lp.token_logprobs
    assert "".join(lp2.tokens) == more.choices[0].text
    # streamed: the echo chunk carries the prompt's logprobs; echo-only streams too
    chunks = list(
        client.completions.create(
            model=NAME, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert "".join(c.choices[0].text for c in chunks) == more.choices[0].text
    streamed_only = list(
        client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True)
    )
    assert [c.choices[0].text for c in streamed_only] == [only.choices[0].text]


def test_completions_prompt_forms_echo_n_seed_stop_logprobs(client):
    r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0)
    text = r.choices[0].text
    ids = client.completions.create(model=NAME, prompt=[[504, 3575, 282, 4649, 314]], max_tokens=1).usage
    assert ids.prompt_tokens == 5
    many = client.completions.create(
        model=NAME, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == text
    echo = client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0, echo=True
    )
    assert echo.choices[0].text == "The capital of France is" + text
    only = client.completions.create(model=NAME, prompt="Hello there", max_tokens=0, echo=True)
    assert only.choices[0].text == "Hello there" and only.usage.completion_tokens == 0
    s1 = client.completions.create(model=NAME, prompt="Once upon", max_tokens=8, seed=7, temperature=1)
    s2 = client.completions.create(model=NAME, prompt="Once upon", max_tokens=8, seed=7, temperature=1)
    assert s1.choices[0].text == s2.choices[0].text
    cut = text[2:5]
    stopped = client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0, stop=[cut]
    )
    assert stopped.choices[0].text == text[: text.index(cut)] and stopped.choices[0].finish_reason == "stop"
    lp = client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    assert len(lp.choices[0].logprobs.tokens) == 3 and all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
    assert "".join(lp.choices[0].logprobs.tokens) == lp.choices[0].text
    chat = client.chat.completions.create(
        model=NAME, messages=FRANCE, max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert chat.usage.completion_tokens == 3


def test_stream_equals_non_stream_with_stop(http):
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 - 1 : len(full) // 2 + 2]
    body["stop"] = stop
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    streamed = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    deltas = [e["choices"][0]["text"] for e in streamed]
    assert "".join(deltas) == plain == full[: full.index(stop)]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_streamed_choices_end_once_each(http, path):
    """With n > 1 a choice cut by a stop string before the others gets one finish chunk and nothing
    after it (the engine's later outputs still list it, finished), and the stream's texts and finish
    reasons are the plain response's."""
    body = {"n": 4, "max_tokens": 12, "stop": [" "], "temperature": 1.0, "seed": 3}
    body |= {"prompt": "Once upon a time"} if path == "/v1/completions" else {"messages": FRANCE}
    plain = http.post(path, json=body).json()["choices"]
    chunks = [c["choices"][0] for c in sse_events(http.post(path, json={**body, "stream": True}).text)]
    key = "text" if path == "/v1/completions" else "message"
    texts, finishes, after_end = {}, {}, set()
    for c in chunks:
        i = c["index"]
        if i in finishes:
            after_end.add(i)
        piece = c["text"] if key == "text" else c["delta"].get("content") or ""
        texts[i] = texts.get(i, "") + piece
        if c["finish_reason"] is not None:
            finishes.setdefault(i, []).append(c["finish_reason"])
    assert not after_end, chunks
    assert finishes == {c["index"]: [c["finish_reason"]] for c in plain}
    ends = {c["index"]: c["stop_reason"] for c in chunks if c["finish_reason"] is not None}
    assert ends == {c["index"]: c["stop_reason"] for c in plain} and " " in ends.values()  # the stop string
    got = {c["index"]: (c["text"] if key == "text" else c["message"]["content"]) for c in plain}
    assert texts == got
    order = [c["index"] for c in chunks]
    first_end = next(k for k, c in enumerate(chunks) if c["finish_reason"] is not None)
    assert set(order[first_end + 1 :]) - {order[first_end]}  # another choice ran on after one ended


def test_32_concurrent_streams_match_solo_runs(server, http):
    words = "the quick brown fox jumps over the lazy dog and keeps running far away".split()
    reqs = [
        {
            "prompt": " ".join(words[: 2 + i % 13]) + f" {i}",
            "max_tokens": 3 + (i * 7) % 14,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(32)
    ]
    solo = [http.post("/v1/completions", json=r).json()["choices"][0]["text"] for r in reqs]

    async def one(c, r):
        async with c.stream("POST", "/v1/completions", json={**r, "stream": True}) as resp:
            assert resp.status_code == 200
            text = "".join([line async for line in resp.aiter_lines()])
        return "".join(e["choices"][0]["text"] for e in sse_events(text.replace("data: ", "\ndata: ")))

    async def main():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
            return await asyncio.gather(*(one(c, r) for r in reqs))

    assert asyncio.run(main()) == solo
    m = metrics(http)
    assert m["baige:num_requests_running"] == 0 and m["baige:kv_cache_blocks_used"] == 0


GOOD = {"prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'"text"', 400, None),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "3"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/completions", {"prompt": [1, 49152]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_LEN}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_LEN, "stream": True}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": MAX_LEN, "stream": True}, 400, "messages"),
        ("/v1/chat/completions", {"messages": FRANCE * 200, "max_tokens": 2}, 400, "messages"),
        ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": FRANCE, "model": "gpt-4", "stream": True}, 404, "model"),
    ],
)
def test_bad_input_is_4xx_with_openai_error_then_good_request_works(http, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert err["param"] == param
    if isinstance(body, dict) and body.get("max_tokens") == MAX_LEN:  # the message gives limit and request
        assert (
            f"maximum context length is {MAX_LEN}" in err["message"]
            and f"{MAX_LEN} in the completion" in err["message"]
        )
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_api_key_required(server, http):
    assert httpx.post(f"{server}/v1/completions", json=GOOD).status_code == 401
    bad = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/health").status_code == 200
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def _wait_idle(http, timeout=60.0) -> dict:
    """/metrics once no request runs and no KV block is used (polled; the timeout only ends a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["baige:num_requests_running"] == 0 and m["baige:kv_cache_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


LONG = 800  # tokens the disconnected request would generate if it were not aborted


def _finished(m: dict) -> dict:
    """baige:request_success_total by finish reason (an aborted request never finishes)."""
    return {k: v for k, v in m.items() if k.startswith("baige:request_success_total")}


def _assert_aborted(before: dict, after: dict) -> None:
    """Idle again because the disconnected request was dropped, not because it ran to its end
    (finish_reason "length" after LONG tokens): no request finished meanwhile, for any reason."""
    assert _finished(after) == _finished(before)


def test_disconnect_mid_stream_frees_request_and_blocks(server, http):
    before = metrics(http)
    body = {"prompt": "Tell me a long story.", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
            m = metrics(http)
            assert m["baige:num_requests_running"] == 1 and m["baige:kv_cache_blocks_used"] > 0
    _assert_aborted(before, _wait_idle(http))
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_disconnect_non_stream_frees_request_and_blocks(server, http):
    before = metrics(http)
    host, port = server.removeprefix("http://").split(":")
    payload = json.dumps({"prompt": "Tell me a long story.", "max_tokens": LONG, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    deadline = time.monotonic() + 30
    while metrics(http)["baige:kv_cache_blocks_used"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()
    _assert_aborted(before, _wait_idle(http))


def test_metrics_exposed(http):
    for _ in range(2):  # the same chat prompt twice: the second finds its full blocks cached
        http.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 2})
    m = metrics(http)
    for name in (
        "baige:num_requests_running",
        "baige:num_requests_waiting",
        "baige:kv_cache_blocks_used",
        "baige:prefix_cache_hit_rate",
        "baige:generation_tokens_total",
        "baige:time_to_first_token_seconds_count",
        "baige:time_per_output_token_seconds_count",
        "baige:e2e_request_latency_seconds_count",
    ):
        assert name in m, name
    assert m["baige:generation_tokens_total"] > 0 and m["baige:e2e_request_latency_seconds_count"] > 0
    assert 0 < m["baige:prefix_cache_hit_rate"] < 1
    # the token counters behind the rate (vLLM's prefix_cache_queries / prefix_cache_hits), one snapshot
    hits, queries = m["baige:prefix_cache_hits_total"], m["baige:prefix_cache_queries_total"]
    assert hits % 16 == 0 and 0 < hits < queries  # whole blocks of the default --block-size
    assert hits / queries == pytest.approx(m["baige:prefix_cache_hit_rate"])
