"""Per-token cost of the reasoning parser and of the Responses API's streaming path, against plain chat
streaming (µs per generated token, on the CPU, no model).

The server's own streaming generators run on one synthetic output of ``--tokens`` tokens (``<think>``,
reasoning words, ``</think>``, answer words; one token per engine step, as a decode step delivers
them): ``stream_chat`` of ``/v1/chat/completions`` without a reasoning parser (the baseline: every
token becomes a content chunk), ``stream_chat`` with the qwen3 parser (reasoning then content chunks),
and ``stream_response`` of ``/v1/responses`` with it (the typed events). Each path's wall time is
divided by the tokens; the median of ``--repeats`` runs is reported, and the overheads are the
differences to the baseline. What it measures is the serving layer (parsing, event building, JSON and
SSE framing) that every token of a stream pays on the event loop, apart from the engine.

    .venv/bin/python scripts/bench_reasoning.py --out docs/benchmarks/records/reasoning-$(date +%Y%m%d-%H%M%S).json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from baige.runtime.infer.outputs import CompletionOutput, RequestOutput
from baige.runtime.server.chat import ChatJob
from baige.runtime.server.chat_routes import stream_chat
from baige.runtime.server.protocol import ChatCompletionRequest
from baige.runtime.server.reasoning import ReasoningConfig
from baige.runtime.server.responses import ResponseStore
from baige.runtime.server.responses_protocol import ResponsesRequest
from baige.runtime.server.responses_routes import Turn, stream_response
from baige.runtime.server.tool_parsers import HermesToolParser
from baige.runtime.server.tools import ToolPlan

START, END = 1, 2


def outputs(n: int) -> list[RequestOutput]:
    """One request's step outputs: ``<think>``, n/2 - 2 reasoning words, ``</think>``, the rest answer words."""
    tokens = [(START, "<think>")]
    tokens += [(100 + k, f" w{k}") for k in range(n // 2 - 2)] + [(END, "</think>")]
    tokens += [(100 + k, f" a{k}") for k in range(n - len(tokens))]
    outs, text, ids = [], "", []
    for k, (t, piece) in enumerate(tokens):
        text, ids = text + piece, [*ids, t]
        done = k == len(tokens) - 1
        o = CompletionOutput(0, text, ids, "stop" if done else None, delta_text=piece, delta_token_ids=[t])
        outs.append(RequestOutput("r", None, [5, 6], [o], done))
    return outs


async def replay(steps: list[RequestOutput]):
    for out in steps:
        yield out


async def drain(chunks) -> int:
    n = 0
    async for chunk in chunks:
        n += len(chunk)
    return n


def state(reasoning: ReasoningConfig | None) -> SimpleNamespace:
    return SimpleNamespace(reasoning=reasoning, responses=ResponseStore(), served_model_name="m", tokenizer=None)


def chat_path(st, steps):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    plan = ToolPlan([], {}, "plain", HermesToolParser)
    job = ChatJob([5, 6], None, plan, True, st)
    base = {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m"}
    return stream_chat(st, req, base, 2, 1, replay(steps), job)


def responses_path(st, steps):
    req = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    plan = ToolPlan([], {}, "plain", HermesToolParser)
    job = ChatJob([5, 6], None, plan, True, st)
    turn = Turn(st, req, "owner", [{"role": "user", "content": "hi"}], job)
    return stream_response(turn, replay(steps))


def timed(make, repeats: int, n: int) -> list[float]:
    """µs per token of each run."""
    runs = []
    for _ in range(repeats):
        chunks = make()
        start = time.perf_counter()
        asyncio.run(drain(chunks))
        runs.append(1e6 * (time.perf_counter() - start) / n)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    steps = outputs(args.tokens)
    qwen3 = ReasoningConfig("qwen3", START, END)
    paths = {
        "chat_plain": lambda: chat_path(state(None), steps),
        "chat_reasoning": lambda: chat_path(state(qwen3), steps),
        "responses_reasoning": lambda: responses_path(state(qwen3), steps),
    }
    timed(paths["chat_plain"], 2, args.tokens)  # warm-up
    samples = {name: timed(make, args.repeats, args.tokens) for name, make in paths.items()}
    med = {name: statistics.median(v) for name, v in samples.items()}
    summary = {
        **{f"{name}_us_per_token": round(v, 3) for name, v in med.items()},
        "reasoning_overhead_us_per_token": round(med["chat_reasoning"] - med["chat_plain"], 3),
        "responses_overhead_us_per_token": round(med["responses_reasoning"] - med["chat_plain"], 3),
    }
    from baige.runtime.bench.common import environment

    record = {
        "benchmark": "reasoning",
        "args": {"tokens": args.tokens, "repeats": args.repeats},
        "environment": environment(),
        "samples": samples,
        "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
