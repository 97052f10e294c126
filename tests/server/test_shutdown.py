"""`baige serve`'s shutdown (baige/runtime/server/lifecycle.py), on a real server subprocess and a tiny
random checkpoint: a stop signal drains the requests in flight to their normal end while /health and
new requests answer 503; past --shutdown-timeout the rest end with an error; a second signal exits at
once; tensor-parallel serving stops its worker cleanly, even when the worker got the signal too.

The engine's steps are held or slowed by a hook the test injects into the server process (no delay
exists in baige itself): they wait while the file GATE exists, and take 0.1 s each while SLOW exists.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import launched, parse_metrics
from tiny import make_checkpoint, write_tiny_tokenizer

HOOK = """
import os as _os, time as _time
from baige.runtime.infer import engine as _engine_mod
_real_step = _engine_mod.Engine.step
def _step(self):
    while _os.path.exists({gate!r}):
        _time.sleep(0.02)
    if _os.path.exists({slow!r}):
        _time.sleep(0.1)
    return _real_step(self)
_engine_mod.Engine.step = _step
"""
PROMPT = "t5 t6 t7"
MAX_TOKENS = 12
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the tiny tokenizer has none
ENGINE = ["--max-num-seqs", "8", "--kv-cache-memory", "8MB", "--log-level", "info", "--chat-template", TEMPLATE]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("shutdown") / "llama", "llama"))


class Hook:
    """The files the injected step hook watches."""

    def __init__(self, root: Path):
        self.gate, self.slow = root / "gate", root / "slow"

    @property
    def code(self) -> str:
        return HOOK.format(gate=str(self.gate), slow=str(self.slow))


def completion(model_dir, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": str(model_dir),
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def chat(model_dir, stream: bool) -> dict:
    return {
        "model": str(model_dir),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def read_stream(url: str, path: str, body: dict, first: threading.Event | None = None) -> list:
    """The stream's events: parsed JSON objects, and the string "[DONE]". Sets ``first`` at the first event."""
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if first is not None:
                    first.set()
    return events


def stream_text(events: list) -> tuple[str, str | None]:
    """(the text of a completion or chat stream's chunks, the last finish_reason)."""
    text, finish = "", None
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason") or finish
    return text, finish


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def engine_requests(url: str) -> int:
    """Requests the engine holds (running or waiting), from /metrics."""
    m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    return int(m["baige:num_requests_running"] + m["baige:num_requests_waiting"])


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).status_code


def assert_shutting_down(r: httpx.Response) -> dict:
    """A 503 of the shutdown in OpenAI's shape; returns the error object."""
    assert r.status_code == 503, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "service_unavailable" and err["code"] == "server_shutting_down", err
    return err


def test_sigterm_drains_streams_to_done_refusing_new_requests_and_exits_0(model_dir, tmp_path):
    hook = Hook(tmp_path)
    with launched(model_dir, *ENGINE, "--shutdown-timeout", "120", code=hook.code) as (url, proc):
        ref = httpx.post(f"{url}/v1/completions", json=completion(model_dir, False), timeout=60).json()
        ref_chat = httpx.post(f"{url}/v1/chat/completions", json=chat(model_dir, False), timeout=60).json()
        ref_text, ref_chat_text = ref["choices"][0]["text"], ref_chat["choices"][0]["message"]["content"]
        assert len(ref_text.split()) == MAX_TOKENS  # word-level tokenizer: one word per token
        hook.gate.touch()  # steps wait: the streams stay in flight until the test has seen the drain
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streams = [
                pool.submit(read_stream, url, "/v1/completions", completion(model_dir, True)),
                pool.submit(read_stream, url, "/v1/chat/completions", chat(model_dir, True)),
            ]
            wait_for(lambda: engine_requests(url) == 2, "both streams in the engine")
            assert health(url) == 200
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health(url) == 503, "/health to turn 503")
            for path, body in (("/v1/completions", completion(model_dir, False)), ("/v1/models", None)):
                r = httpx.request("POST" if body else "GET", f"{url}{path}", json=body, timeout=10)
                assert_shutting_down(r)
                assert r.headers["retry-after"] == "5" and r.headers["connection"] == "close"
            assert proc.poll() is None and not any(s.done() for s in streams)
            hook.gate.unlink()
            done = [s.result(timeout=120) for s in streams]
        assert proc.wait(timeout=60) == 0
    for events, want in zip(done, (ref_text, ref_chat_text)):
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        assert stream_text(events) == (want, "length")
    log = proc.stderr.read()
    assert "SIGTERM: draining 2 requests in flight" in log and "drained: no request in flight" in log


def test_past_the_shutdown_timeout_streams_end_with_an_error_event_and_exit_0(model_dir, tmp_path):
    hook = Hook(tmp_path)
    hook.slow.touch()  # 0.1 s a step: 200 tokens take far longer than the 1 s timeout
    with launched(model_dir, *ENGINE, "--shutdown-timeout", "1", code=hook.code) as (url, proc):
        first = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = pool.submit(read_stream, url, "/v1/completions", completion(model_dir, True, 200), first)
            plain = pool.submit(
                httpx.post, f"{url}/v1/chat/completions", json={**chat(model_dir, False), "max_tokens": 200}, timeout=60
            )
            assert first.wait(60), "the stream did not start"
            wait_for(lambda: engine_requests(url) == 2, "both requests in the engine")
            proc.send_signal(signal.SIGINT)
            events, r = stream.result(timeout=60), plain.result(timeout=60)
        assert proc.wait(timeout=60) == 0
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "server_shutting_down"
    assert "--shutdown-timeout (1 s)" in err["message"]
    text, finish = stream_text(events[:-2])
    assert 1 <= len(text.split()) < 200 and finish is None  # cut mid-generation, after some tokens
    assert "--shutdown-timeout (1 s)" in assert_shutting_down(r)["message"]
    assert "aborted 2 engine requests" in proc.stderr.read()


def test_a_second_signal_exits_at_once(model_dir, tmp_path):
    hook = Hook(tmp_path)
    hook.gate.touch()  # the stream never finishes by itself
    with launched(model_dir, *ENGINE, "--shutdown-timeout", "600", code=hook.code) as (url, proc):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(read_stream, url, "/v1/completions", completion(model_dir, True))
            wait_for(lambda: engine_requests(url) == 1, "the stream in the engine")
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health(url) == 503, "/health to turn 503")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 128 + signal.SIGINT  # not the 600 s drain
            with pytest.raises(httpx.TransportError):  # its connection was cut
                stream.result(timeout=20)
    assert "SIGINT again: exiting now, cutting 1 requests in flight" in proc.stderr.read()


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def test_tensor_parallel_server_drains_and_stops_its_worker_on_ctrl_c(model_dir, tmp_path):
    hook = Hook(tmp_path)
    with launched(model_dir, "--tensor-parallel-size", "2", *ENGINE, code=hook.code) as (url, proc):
        ref = httpx.post(f"{url}/v1/completions", json=completion(model_dir, False), timeout=60).json()
        (worker,) = _children(proc.pid)
        hook.gate.touch()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(read_stream, url, "/v1/completions", completion(model_dir, True))
            wait_for(lambda: engine_requests(url) == 1, "the stream in the engine")
            for pid in (worker, proc.pid):  # what Ctrl-C in a terminal does: the whole process group
                os.kill(pid, signal.SIGINT)
            wait_for(lambda: health(url) == 503, "/health to turn 503")
            hook.gate.unlink()
            events = stream.result(timeout=120)
        assert proc.wait(timeout=60) == 0
    assert events[-1] == "[DONE]" and stream_text(events) == (ref["choices"][0]["text"], "length")
    log = proc.stderr.read()
    assert "tensor-parallel worker rank 1" not in log, log[-2000:]  # it exited 0, on rank 0's stop message
    assert not Path(f"/proc/{worker}").exists()
