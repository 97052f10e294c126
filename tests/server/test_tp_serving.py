"""`baige serve --tensor-parallel-size 2` (2 processes, gloo, CPU) through the official openai client:
16 concurrent mixed greedy requests give the same tokens as one process, for a model with fewer KV
heads than ranks, a Qwen2 checkpoint with q/k/v biases, and an int8 checkpoint; a killed worker
turns /health to 503, fails the request in flight with a 503, and the server exits non-zero."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI
from server_utils import launched
from tiny import make_checkpoint, write_tiny_tokenizer

from baige.runtime.infer.llm import LLM
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.scheme import QuantScheme
from baige.runtime.quantize import save_quantized
from baige.runtime.weights.loader import load_model

# word-level tiny tokenizer: token i is the word "t{i}", so equal text is equal tokens
PROMPTS = [" ".join(f"t{(11 * i + 3 * j) % 150 + 1}" for j in range(2 + 5 * i)) for i in range(16)]
MAX_TOKENS = [4 + (i % 5) * 3 for i in range(16)]
ENGINE = ["--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--kv-cache-memory", "8MB"]


def _model(root, case: str):
    if case == "fewer-kv-heads-than-ranks":
        return write_tiny_tokenizer(make_checkpoint(root, "llama", num_key_value_heads=1))
    if case == "qwen2-qkv-bias":
        return write_tiny_tokenizer(make_checkpoint(root, "qwen2-bias"))
    src = write_tiny_tokenizer(make_checkpoint(root / "src", "llama"))
    model, scheme = load_model(src), QuantScheme(8, None)
    return save_quantized(model, scheme, quantize_model(model, scheme), root / "int8", src)


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


@pytest.mark.usefixtures("exact_quant_kernels")
@pytest.mark.parametrize("case", ["fewer-kv-heads-than-ranks", "qwen2-qkv-bias", "int8"])
def test_tp2_server_greedy_equals_one_process_through_the_openai_client(tmp_path, case):
    model_dir = _model(tmp_path / case, case)
    llm = LLM(str(model_dir), max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory="8MB")
    ref = [
        o.outputs[0].text
        for o in llm.generate(
            PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
        )
    ]
    assert all(len(t.split()) == n for t, n in zip(ref, MAX_TOKENS))
    with launched(model_dir, "--tensor-parallel-size", "2", *ENGINE) as (url, proc):
        assert len(_children(proc.pid)) == 1  # one worker process beside rank 0
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def one(i: int) -> str:
            r = client.completions.create(
                model=str(model_dir),
                prompt=PROMPTS[i],
                max_tokens=MAX_TOKENS[i],
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(16) as pool:  # all at once: batched, prefill chunks mixed
            got = list(pool.map(one, range(16)))
    assert got == ref


def test_killed_worker_fails_the_request_in_flight_503_and_the_server_exits_nonzero(tmp_path):
    model_dir = _model(tmp_path, "fewer-kv-heads-than-ranks")
    with launched(model_dir, "--tensor-parallel-size", "2", *ENGINE) as (url, proc):
        result = {}

        def long_request():
            body = {"model": str(model_dir), "prompt": "t5 t6", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
            result["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)  # the request is decoding
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        t.join(timeout=30)
        assert not t.is_alive(), "the request in flight hung"
        r = result["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503  # it answers 503 for 2 s, then exits
        assert proc.wait(timeout=15) == 1
        assert time.monotonic() - killed < 15
        assert "tensor-parallel worker rank 1" in proc.stderr.read()
