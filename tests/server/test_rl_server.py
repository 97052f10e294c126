"""`baige serve --enable-rl-endpoints` on tiny models: POST /update_weights_from_disk with a stream in
flight (the stream finishes on the old weights, its tokens those of an old-weights run; the next request
sees the new ones), /sleep and /wake_up around a stream, /reset_prefix_cache, bad bodies and paths
(OpenAI-shaped 400s), the API key (401), and the paths absent (404) without the flag. The app runs in a
thread of the test over its own engine; the CLI flag is checked once on a `baige serve` process."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from server_utils import launched

from baige.runtime.infer.llm import LLM
from baige.runtime.infer.sampling import SamplingParams
from tests.tiny import make_checkpoint, write_tiny_tokenizer

PROMPT = [5, 17, 33, 2, 91, 40, 12, 7, 150, 3]
ENGINE = dict(max_model_len=128, max_num_seqs=8, block_size=4, kv_cache_memory=4_000_000)
LONG = 100  # tokens of the request that streams while the weights change
KEY = "rl-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_server")
    return [write_tiny_tokenizer(make_checkpoint(root / f"w{s}", "llama", seed=s)) for s in (0, 1)]


def _tokens(model_dir, n: int) -> list[str]:
    """The greedy completion of PROMPT on ``model_dir`` (offline engine), as the server's words."""
    llm = LLM(str(model_dir), dtype="float32", **ENGINE)
    ids = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
    return [f"t{i}" for i in ids]


@contextmanager
def serving(model_dir, **app_options):
    """The app over an engine on ``model_dir`` (engine steps slowed to >= 10 ms, so a stream of LONG
    tokens stays in flight for a second whatever the host: the admin calls meet it running)."""
    import uvicorn

    from baige.runtime.infer.async_engine import AsyncEngine
    from baige.runtime.server.app import build_app, listen

    engine = LLM(str(model_dir), dtype="float32", **ENGINE).engine
    real_step = engine.step
    engine.step = lambda: time.sleep(0.01) or real_step()
    sock = listen("127.0.0.1", 0)
    driver = AsyncEngine(engine)
    server = uvicorn.Server(uvicorn.Config(build_app(driver, "tiny", **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
            assert thread.is_alive()
        yield httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", headers=AUTH, timeout=60)
    finally:
        server.should_exit = True
        thread.join(10)
        driver.shutdown()
        sock.close()


def _complete(http: httpx.Client, n: int) -> httpx.Response:
    body = dict(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0, ignore_eos=True)
    return http.post("/v1/completions", json=body)


@contextmanager
def streaming(http: httpx.Client):
    """A completion of LONG tokens streaming in a thread; yields once its first token has arrived and
    a list that holds its words when the block ends."""
    first, words = threading.Event(), []

    def read():
        body = dict(model="tiny", prompt=PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    words.extend(json.loads(line[6:])["choices"][0]["text"].split())
                    first.set()
        first.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert first.wait(30)
    result: list[str] = []
    yield result
    thread.join(60)
    result.extend(words)


def test_update_weights_from_disk_with_a_stream_in_flight(dirs):
    old, new = dirs
    want_old, want_new = _tokens(old, LONG), _tokens(new, 12)
    assert want_old[:12] != want_new
    with serving(old, enable_rl_endpoints=True, api_key=KEY) as http:
        with streaming(http) as words:
            r = http.post("/update_weights_from_disk", json={"model_path": str(new)})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert words == want_old  # every token of the stream came from the old weights
        assert _complete(http, 12).json()["choices"][0]["text"].split() == want_new
        assert http.post("/reset_prefix_cache").status_code == 200
        assert _complete(http, 12).json()["choices"][0]["text"].split() == want_new


def test_sleep_and_wake_up_with_a_stream_in_flight(dirs):
    old, _ = dirs
    want = _tokens(old, LONG)
    with serving(old, enable_rl_endpoints=True, api_key=KEY) as http:
        with streaming(http) as words:
            assert http.post("/sleep", params={"level": 1}).status_code == 200
        assert words == want
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        asleep = _complete(http, 4)
        assert asleep.status_code == 400 and "asleep" in asleep.json()["error"]["message"]
        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _complete(http, 12).json()["choices"][0]["text"].split() == want[:12]


def test_a_wake_up_sent_while_a_sleep_drains_runs_after_it(dirs):
    """/sleep waits for the stream in flight; a /wake_up sent meanwhile used to run first (a no-op on an
    awake engine) and the sleep then left the engine asleep, after both had answered 200."""
    from baige.runtime.infer.async_engine import AsyncEngine

    engine = LLM(str(dirs[0]), dtype="float32", **ENGINE).engine
    real_step = engine.step
    engine.step = lambda: time.sleep(0.01) or real_step()
    driver = AsyncEngine(engine)

    async def run() -> int:
        stream = driver.generate(PROMPT, SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))
        await stream.__anext__()
        sleep = asyncio.ensure_future(driver.sleep(1))
        while not driver._drains:  # the sleep is queued behind the stream
            await asyncio.sleep(0.001)
        wake = asyncio.ensure_future(driver.wake_up())
        outs = [o async for o in stream]
        await sleep
        await wake
        return len(outs[-1].outputs[0].token_ids)

    try:
        assert asyncio.run(run()) == LONG
        assert not engine.is_sleeping
    finally:
        driver.shutdown()


def test_bad_calls_are_openai_shaped_400s(dirs, tmp_path):
    old, _ = dirs
    wide = make_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    broken = tmp_path / "broken"
    shutil.copytree(old, broken)
    (broken / "config.json").write_text("{nope")
    with serving(old, enable_rl_endpoints=True) as http:
        for body, message in [
            ({"model_path": str(tmp_path / "nowhere")}, "no such directory"),
            ({"model_path": str(wide)}, "hidden_size is 96, the served model's is 64"),
            ({"path": str(wide)}, "model_path"),
            ({"model_path": ""}, "model_path: String should have at least 1 character"),  # not the working directory
            ({"model_path": str(tmp_path)}, "not an HF model directory (no config.json)"),
            ({"model_path": str(broken)}, "config.json: not valid JSON"),
            ({"model_path": "/tmp/" + "x" * 5000}, "x...: cannot be read (File name too long)"),  # was a 500
            ({"model_path": "~baige-no-such-user-q/m"}, "cannot be read (Could not determine home directory.)"),
        ]:
            r = http.post("/update_weights_from_disk", json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
            assert err["param"] == "model_path", r.text
            assert message in err["message"] and "\n" not in err["message"]
        for level, message in [(2, "level 2 is not supported"), ("x", "'x': 1 or 2")]:
            r = http.post("/sleep", params={"level": level})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert _complete(http, 12).json()["choices"][0]["text"].split() == _tokens(old, 12)  # unchanged


def test_absent_without_the_flag(dirs):
    with serving(dirs[0]) as http:
        for path in ("/update_weights_from_disk", "/sleep", "/wake_up", "/reset_prefix_cache"):
            assert http.post(path, json={"model_path": str(dirs[1])}).status_code == 404
        assert http.get("/is_sleeping").status_code == 404


def test_the_cli_flag_and_the_api_key(dirs):
    with launched(dirs[0], "--dtype", "float32", "--kv-cache-memory", "4MB", "--enable-rl-endpoints", api_key=KEY) as (
        url,
        _,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{url}/reset_prefix_cache", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert httpx.post(f"{url}/sleep", headers=headers).status_code == 401
        assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(dirs[1])}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
