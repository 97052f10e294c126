"""``baige bench serve``: an async load generator for any OpenAI-compatible completions endpoint.

Metric definitions follow ``vllm bench serve`` so numbers compare directly:

- TTFT: request start -> the first streamed chunk that carries text.
- ITL: the gaps between consecutive chunks that carry text.
- TPOT: ``(e2e latency - TTFT) / (output tokens - 1)``, for requests with more than one output
  token; output tokens come from the server's ``usage`` (re-tokenized without special tokens only
  when usage is absent).
- E2EL: request start -> the end of the stream.
- goodput: requests per second that meet every ``--slo`` (a one-token request counts TPOT as 0).

A request that fails (HTTP error, broken stream, or a stream with no text chunk) is counted in
``failed`` and left out of every latency statistic. Arrivals are a gamma process with rate
``request_rate`` and shape ``burstiness`` (1 = Poisson), as vLLM generates them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from baige.errors import BaigeError
from baige.runtime.bench.common import random_token_prompts, summarize


@dataclass
class RequestInput:
    """One benchmark request: prompt text, its length in tokens, and the tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What the client saw of one request. Times in seconds."""

    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int | None = None  # from the server's usage, when it sent one
    generated_text: str = ""
    error: str = ""
    start: float = 0.0
    index: int = -1  # position in the request list (set by run_requests)


# ----------------------------------------------------------------------------- datasets


def random_requests(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[RequestInput]:
    """vLLM's random dataset as text: :func:`common.random_token_prompts` decoded by ``tokenizer``.

    Raises BaigeError for a range_ratio outside [0, 1).
    """
    pairs = random_token_prompts(tokenizer.vocab_size, num_prompts, input_len, output_len, range_ratio, seed)
    return [RequestInput(tokenizer.decode(ids), len(ids), n_out) for ids, n_out in pairs]


def sharegpt_requests(
    path: str | Path, tokenizer, num_prompts: int, seed: int = 0, output_len: int | None = None
) -> list[RequestInput]:
    """Prompts from a ShareGPT-format JSON (``[{"conversations": [{"value": ...}, ...]}]``), with
    vLLM's filters: the first turn is the prompt, the second sets the output length; pairs with a
    prompt or completion under 4 tokens, a prompt over 1024 tokens, or a total over 2048 are skipped.

    Raises BaigeError when the file is unreadable or yields too few requests.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BaigeError(f"{path}: cannot read ShareGPT JSON ({e})") from None
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[RequestInput] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, completion = conv[0].get("value"), conv[1].get("value")
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise BaigeError(
                f'{path}: each conversation\'s turns need a string "value" (got '
                f"{type(prompt).__name__} and {type(completion).__name__})"
            )
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        o_len = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append(RequestInput(prompt, p_len, o_len))
    if len(out) < num_prompts:
        raise BaigeError(f"{path}: only {len(out)} conversations pass the length filters, {num_prompts} asked for")
    return out


# ----------------------------------------------------------------------------- arrivals


def arrival_intervals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds to wait before each of ``n`` requests.

    Gamma-distributed with shape ``burstiness`` and scale ``1 / (request_rate * burstiness)``: mean
    interval ``1/request_rate`` whatever the burstiness, coefficient of variation
    ``1/sqrt(burstiness)`` (burstiness 1 is a Poisson process). ``request_rate = inf`` sends all at once.
    """
    if request_rate == float("inf"):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise BaigeError("--request-rate and --burstiness must be > 0")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


# ----------------------------------------------------------------------------- the client


async def send_completion(
    client, url: str, model: str, req: RequestInput, headers: dict[str, str], ignore_eos: bool = True
) -> RequestResult:
    """POST one streaming ``/v1/completions`` request and time its chunks."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    res = RequestResult()
    start = last = time.perf_counter()
    res.start = start
    text = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens")
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    if not text:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    text.append(piece)
    except Exception as e:  # a broken connection or stream is a failed request, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.generated_text = "".join(text)
    res.success = bool(text)
    if not res.success:
        res.error = "stream ended without a content chunk"
    return res


async def run_requests(
    base_url: str,
    model: str,
    requests: Sequence[RequestInput],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    ignore_eos: bool = True,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` with the given arrival process and concurrency cap.

    Returns ``(results in request order, benchmark duration in seconds)``. Requests not yet sent
    when the coroutine is cancelled (Ctrl-C) are left out of the results.
    """
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    intervals = arrival_intervals(len(requests), request_rate, burstiness, seed)
    results: list[RequestResult | None] = [None] * len(requests)
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(i: int) -> None:
            if limit:
                async with limit:
                    results[i] = await send_completion(client, url, model, requests[i], headers, ignore_eos)
            else:
                results[i] = await send_completion(client, url, model, requests[i], headers, ignore_eos)
            results[i].index = i
            if on_done:
                on_done(results[i])

        t0 = time.perf_counter()
        tasks = []
        try:
            for i, wait in enumerate(intervals):
                if wait > 0:
                    await asyncio.sleep(float(wait))
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        duration = time.perf_counter() - t0
    return [r for r in results if r is not None], duration


# ----------------------------------------------------------------------------- metrics


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50,e2el:3000"`` -> ``{"ttft": 500.0, ...}`` in milliseconds. Raises BaigeError."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, _, value = part.partition(":")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2el"):
            raise BaigeError(f"--slo: unknown metric {name!r} (use ttft, tpot, e2el)")
        try:
            out[name] = float(value)
        except ValueError:
            raise BaigeError(f"--slo: {part!r} is not METRIC:MILLISECONDS") from None
        if not 0 < out[name] < math.inf:
            raise BaigeError(f"--slo: {name} must be a finite number of ms > 0 (got {value.strip()!r})")
    return out


def calculate_metrics(
    inputs: Sequence[RequestInput],
    results: Sequence[RequestResult],
    duration: float,
    tokenizer=None,
    percentiles: Sequence[float] = (50, 90, 99),
    slo: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate per-request results into ``vllm bench serve``'s result fields.

    Latency fields are in milliseconds (``mean_ttft_ms``, ``p99_itl_ms``, ...), throughputs per
    second of ``duration``. ``tokenizer`` is only needed when a successful result lacks usage.
    """
    slo = slo or {}
    completed = failed = good = 0
    total_in = total_out = 0
    ttfts, tpots, itls, e2els = [], [], [], []
    output_lens, input_lens, texts, errors = [], [], [], []
    for req, res in zip(inputs, results):
        if not res.success:
            failed += 1
            output_lens.append(0)
            input_lens.append(req.prompt_len)
            texts.append("")
            errors.append(res.error)
            continue
        n_out = res.output_tokens
        if n_out is None:
            if tokenizer is None:
                raise ValueError("a result has no usage and no tokenizer was given to count its tokens")
            n_out = len(tokenizer.encode(res.generated_text, add_special_tokens=False))
        completed += 1
        total_in += req.prompt_len
        total_out += n_out
        tpot = (res.latency - res.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        ttfts.append(res.ttft)
        itls.extend(res.itl)
        e2els.append(res.latency)
        output_lens.append(n_out)
        input_lens.append(req.prompt_len)
        texts.append(res.generated_text)
        errors.append("")
        ok = all(
            {"ttft": res.ttft, "tpot": tpot, "e2el": res.latency}[name] * 1000 <= limit for name, limit in slo.items()
        )
        good += ok
    out: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": failed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": completed / duration if duration > 0 else 0.0,
        "request_goodput": (good / duration if duration > 0 else 0.0) if slo else None,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in summarize([v * 1000 for v in values], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    out.update(
        input_lens=input_lens,
        output_lens=output_lens,
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        generated_texts=texts,
        errors=errors,
    )
    return out
