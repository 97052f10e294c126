"""The serving benchmark's math and accounting, against hand-computed values and a fake server."""

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from baige.errors import BaigeError
from baige.runtime.bench.common import summarize
from baige.runtime.bench.serve import (
    RequestInput,
    RequestResult,
    arrival_intervals,
    calculate_metrics,
    parse_slo,
    run_requests,
)


def test_summary_statistics_by_hand():
    s = summarize([1.0, 2.0, 3.0, 4.0], percentiles=(50, 90, 99))
    assert s["mean"] == 2.5 and s["median"] == 2.5
    assert s["std"] == pytest.approx(1.25**0.5)  # population std
    # linear interpolation: rank (n-1)*p/100; p90 -> 2.7 -> 3 + 0.7 = 3.7; p99 -> 2.97 -> 3.97
    assert s["p90"] == pytest.approx(3.7) and s["p99"] == pytest.approx(3.97) and s["p50"] == 2.5


def test_metrics_by_hand():
    inputs = [RequestInput("a", 10, 5), RequestInput("b", 20, 5), RequestInput("c", 30, 5), RequestInput("d", 7, 1)]
    results = [
        # ttft 0.1 s, 4 gaps, e2e 0.5 s, 5 tokens: tpot (0.5-0.1)/4 = 0.1 s
        RequestResult(True, ttft=0.1, itl=[0.1, 0.1, 0.1, 0.1], latency=0.5, output_tokens=5, generated_text="x"),
        # ttft 0.3, e2e 0.9, 4 tokens: tpot 0.2
        RequestResult(True, ttft=0.3, itl=[0.2, 0.2, 0.2], latency=0.9, output_tokens=4, generated_text="y"),
        RequestResult(False, error="HTTP 500: boom"),
        # one token: no tpot sample, TPOT counts as 0 for goodput
        RequestResult(True, ttft=0.2, itl=[], latency=0.2, output_tokens=1, generated_text="z"),
    ]
    m = calculate_metrics(inputs, results, duration=2.0, slo={"ttft": 250, "tpot": 150})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 10 + 20 + 7  # failed request's prompt not counted
    assert m["total_output_tokens"] == 10
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 5.0 and m["total_token_throughput"] == 23.5
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(150.0)  # (100 + 200) / 2, the 1-token request has no sample
    assert m["mean_itl_ms"] == pytest.approx((4 * 100 + 3 * 200) / 7)
    assert m["mean_e2el_ms"] == pytest.approx((500 + 900 + 200) / 3)
    assert m["p99_e2el_ms"] == pytest.approx(900 - 0.02 * 400)  # between 500 and 900 at rank 1.98
    # goodput: request 1 (ttft 100, tpot 100) and request 4 (ttft 200, tpot 0) meet both SLOs; request 2 does not
    assert m["request_goodput"] == 1.0
    assert m["errors"][2] == "HTTP 500: boom" and m["output_lens"] == [5, 4, 0, 1]


def test_usage_absent_falls_back_to_retokenizing():
    class WordTokenizer:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return text.split()

    res = RequestResult(True, ttft=0.1, itl=[0.1, 0.1], latency=0.3, output_tokens=None, generated_text="one two three")
    m = calculate_metrics([RequestInput("p", 3, 3)], [res], 1.0, tokenizer=WordTokenizer())
    assert m["total_output_tokens"] == 3 and m["mean_tpot_ms"] == pytest.approx(100.0)


def test_seeded_arrivals_have_the_asked_rate_and_burstiness():
    poisson = arrival_intervals(20000, request_rate=4.0, burstiness=1.0, seed=0)
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV 1
    bursty = arrival_intervals(20000, request_rate=4.0, burstiness=4.0, seed=0)
    assert bursty.mean() == pytest.approx(0.25, rel=0.03)
    assert bursty.std() / bursty.mean() == pytest.approx(0.5, rel=0.03)  # gamma(k): CV 1/sqrt(k)
    assert np.array_equal(poisson, arrival_intervals(20000, 4.0, 1.0, seed=0))
    assert not arrival_intervals(5, float("inf")).any()


def test_slo_parsing():
    assert parse_slo("ttft:500,tpot:50,e2el:3000") == {"ttft": 500.0, "tpot": 50.0, "e2el": 3000.0}
    for bad in ("ttfb:5", "ttft:fast", "tpot:0"):
        with pytest.raises(BaigeError):
            parse_slo(bad)


# ----------------------------------------------------------------------------- fake server

FIRST_DELAY, GAP, CHUNKS = 0.15, 0.03, 4


def fake_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        mode = body["prompt"]
        if mode == "error":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

        async def stream():
            def event(obj):
                return f"data: {json.dumps(obj)}\n\n"

            await asyncio.sleep(FIRST_DELAY)
            if mode != "nocontent":
                for i in range(CHUNKS):
                    if i:
                        await asyncio.sleep(GAP)
                    yield event({"choices": [{"index": 0, "text": f"w{i} "}]})
            if mode != "nousage":
                yield event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_against_fake_server_counts_failures_and_uses_usage(fake_server):
    class WordTokenizer:
        def encode(self, text, add_special_tokens=True):
            return text.split()

    inputs = [RequestInput(m, 3, 7) for m in ("ok", "nousage", "nocontent", "error")]
    results, duration = asyncio.run(run_requests(fake_server, "fake", inputs, max_concurrency=2))
    m = calculate_metrics(inputs, results, duration, tokenizer=WordTokenizer())
    assert (m["completed"], m["failed"]) == (2, 2)
    assert m["output_lens"] == [7, CHUNKS, 0, 0]  # usage when sent, else the re-tokenized text
    assert m["errors"][2] == "stream ended without a content chunk"
    assert m["errors"][3].startswith("HTTP 500")
    ok = results[0]
    assert ok.generated_text == "w0 w1 w2 w3 "
    assert len(ok.itl) == CHUNKS - 1
    # a chunk cannot arrive before the server sent it
    assert ok.ttft >= FIRST_DELAY and ok.latency >= FIRST_DELAY + (CHUNKS - 1) * GAP
    assert m["ttfts"][2] == 0.0 and 2 == sum(1 for e in m["errors"] if e)
    # no latency statistic includes a failed request: 2 TTFT samples
    assert m["mean_ttft_ms"] == pytest.approx(1000 * (results[0].ttft + results[1].ttft) / 2)


def test_serve_roofline_counts_the_servers_kv_cache_dtype(tmp_path, monkeypatch):
    from tiny import make_checkpoint

    from baige.runtime import roofline
    from baige.runtime.bench.serve_run import serve_roofline, server_option
    from baige.runtime.model.config import ModelConfig

    assert server_option(["--kv-cache-dtype", "float16", "--max-num-seqs=4"], "--kv-cache-dtype") == "float16"
    assert server_option(["--kv-cache-dtype=bfloat16"], "--kv-cache-dtype") == "bfloat16"
    assert server_option(["--kv-cache-dtype"], "--kv-cache-dtype") is None  # no value: nothing to read
    limits = roofline.HardwareLimits(device="cpu", dtype="float32", bandwidth=1e10, matmul_peak=1e11)
    monkeypatch.setattr(roofline, "hardware_limits", lambda *a, **k: limits)
    src = make_checkpoint(tmp_path / "src", "llama")  # fp32 checkpoint
    kv32 = ModelConfig.from_file(src / "config.json").kv_bytes_per_token(4)
    # two requests of 1 s each over 2 s: mean batch 1; context 20 / 2 + 10 / 2 / 2 = 12.5 tokens
    metrics = {
        "duration": 2.0,
        "completed": 2,
        "total_input_tokens": 20,
        "total_output_tokens": 10,
        "output_throughput": 5.0,
    }
    ok = [RequestResult(True, ttft=0.1, latency=1.0, output_tokens=5)] * 2
    wbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    default = serve_roofline(src, metrics, ok)["decode"]["bytes_per_step"]
    half = serve_roofline(src, metrics, ok, ["--kv-cache-dtype", "float16"])["decode"]["bytes_per_step"]
    assert default == wbytes + 12.5 * kv32 and half == wbytes + 12.5 * kv32 / 2


class TickClock:
    """A fake ``time`` for the client: every ``perf_counter()`` reading is ``tick`` seconds after the
    previous one (the first is 0); everything else is the real module."""

    def __init__(self, tick: float):
        self.tick, self.readings = tick, 0

    def perf_counter(self) -> float:
        self.readings += 1
        return (self.readings - 1) * self.tick

    def __getattr__(self, name):
        return getattr(time, name)


def test_cli_against_fake_server_on_a_fake_clock(fake_server, embedded_dir, tmp_path, monkeypatch):
    """``baige bench serve --base-url`` end to end with every number known: 4 requests one at a time
    (--max-concurrency 1), each answered with 4 content chunks and a usage of 7 tokens; the client's
    clock advances 0.125 s per reading. Readings: the start of the run, then per request its start,
    one per content chunk and its end, then the end of the run: 1 + 4 x 6 + 1."""
    from typer.testing import CliRunner

    from baige.cli import app
    from baige.runtime.bench import serve

    clock = TickClock(0.125)
    monkeypatch.setattr(serve, "time", clock)
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "serve",
            "--base-url",
            fake_server,
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "7",
            "--max-concurrency",
            "1",
            "--slo",
            "ttft:125,tpot:100",
            "--output-dir",
            str(tmp_path),
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    assert clock.readings == 26
    (path,) = tmp_path.glob("serve-*.json")
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["max_concurrency"], r["request_rate"]) == (4, 0, 1, "inf")
    assert r["duration"] == 25 * 0.125
    assert r["total_input_tokens"] == 4 * 8 and r["total_output_tokens"] == 4 * 7 and r["output_lens"] == [7] * 4
    # 4 requests, 28 generated tokens and 32 + 28 in all over 3.125 s
    assert r["request_throughput"] == pytest.approx(1.28)
    assert r["output_throughput"] == pytest.approx(8.96) and r["total_token_throughput"] == pytest.approx(19.2)
    # per request: TTFT 1 tick, 3 gaps of 1 tick, end-to-end 5 ticks, TPOT (625 - 125) ms / (7 - 1) tokens
    for stat in ("mean", "median", "p99"):
        assert r[f"{stat}_ttft_ms"] == pytest.approx(125.0) and r[f"{stat}_itl_ms"] == pytest.approx(125.0)
        assert r[f"{stat}_e2el_ms"] == pytest.approx(625.0) and r[f"{stat}_tpot_ms"] == pytest.approx(500 / 6)
    assert r["itls"] == [[0.125] * 3] * 4 and r["ttfts"] == [0.125] * 4
    # the SLO bounds are inclusive: TTFT 125 <= 125 ms and TPOT 83.3 <= 100 ms, every request is good
    assert r["request_goodput"] == pytest.approx(1.28)
    assert "roofline" not in r  # --base-url: a server this run did not start, of unknown size


def test_sharegpt_file_parses_and_refuses_non_text_turns(embedded_dir, tmp_path):
    import json

    from baige.errors import BaigeError
    from baige.runtime.bench.serve import sharegpt_requests
    from baige.runtime.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_dir)
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "Tell me about the sea, please."},
                        {"from": "gpt", "value": "The sea is large and deep and blue."},
                    ]
                }
            ]
        )
    )
    (req,) = sharegpt_requests(good, tok, 1)
    assert (req.prompt_len, req.output_len) == (
        len(tok.encode("Tell me about the sea, please.", add_special_tokens=False)),
        len(tok.encode("The sea is large and deep and blue.", add_special_tokens=False)),
    )
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": [1, 2, 3]}, {"from": "gpt", "value": "x"}]}])
    )
    with pytest.raises(BaigeError, match=r"need a string \"value\" \(got list and str\)"):
        sharegpt_requests(bad, tok, 1)
