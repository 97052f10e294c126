"""Prefill/decode disaggregation against colocated data parallelism, on one machine.

Two layouts of two `baige serve` processes (``--threads`` torch threads each), each behind a `baige
router`:

- ``pd``: a producer (``kv_role: kv_producer``) and a consumer (``kv_consumer``), ZeroMQ transport,
  router ``--policy pd`` (the producer prefills, the consumer pulls the prompt's KV blocks and decodes);
  the producer runs ``--long-prefill-token-threshold`` (``--producer-long-prefill-threshold``), so the
  long prompt's prefill does not hold the short ones queued behind it, which would then reach the
  consumer all at once and decode there in one large batch;
- ``colocated``: two plain instances, router ``--policy least_load`` (each prefills and decodes its own;
  ``--colocated-long-prefill-threshold`` gives them the same chunking).

The workload, the same for both and every rate: steady short chats (``--short-prompt`` tokens of
tinyshakespeare, ``--short-output`` tokens out) arriving as a Poisson process at the rate under test,
plus one long-prompt request (``--long-prompt`` tokens, ``--long-output`` out) every ``--long-every``
seconds; every prompt distinct (no prefix-cache hits between requests). Streams are timed on the client
(``baige.runtime.bench.serve.send_completion``): the short chats' inter-token latencies (ITL) and
everyone's time to first token (TTFT). The question (issue #49): at the lowest rate where the colocated
layout's P99 ITL of the short chats passes 100 ms, is P/D's at least 2x lower, and what does P/D cost in
TTFT? Writes ``docs/benchmarks/records/pd-vs-colocated-*.json``.

    python scripts/bench_pd.py [--rates 1,2,4] [--duration 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from baige.runtime.bench.common import environment, summarize, write_result
from baige.runtime.bench.serve import RequestInput, send_completion
from baige.runtime.bench.serve_run import free_port, server_env, stop_server, wait_healthy
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.hub import resolve_model

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("colocated", "pd")


def text_prompts(tok: Tokenizer, text: str, n: int, length: int, rng: random.Random) -> list[RequestInput]:
    """``n`` distinct prompts of about ``length`` tokens: passages of ``text`` from random offsets,
    cut to ``length`` tokens and decoded back (so no two share a prefix block)."""
    ids = tok.encode(text, add_special_tokens=False)
    out = []
    for _ in range(n):
        s = rng.randrange(0, len(ids) - length - 1)
        prompt = tok.decode(ids[s : s + length])
        out.append(RequestInput(prompt, len(tok.encode(prompt)), 0))
    return out


def schedule(rate: float, duration: float, long_every: float, seed: int) -> list[tuple[float, str]]:
    """(send time in s, kind) sorted by time: short chats as a Poisson process at ``rate`` per second,
    a long-prompt request at ``long_every / 2``, then every ``long_every`` seconds."""
    rng = np.random.default_rng(seed)
    events, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration:
            break
        events.append((t, "short"))
    events += [(t, "long") for t in np.arange(long_every / 2, duration, long_every).tolist()]
    return sorted(events)


async def drive(base: str, model: str, events, shorts, longs, args) -> list[tuple[str, object]]:
    """Send every event at its time; returns (kind, RequestResult) in event order."""
    import httpx

    url = base + "/v1/completions"
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000)) as client:
        t0 = time.perf_counter()
        tasks = []
        si = li = 0
        for at, kind in events:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if kind == "short":
                req = RequestInput(shorts[si].prompt, shorts[si].prompt_len, args.short_output)
                si += 1
            else:
                req = RequestInput(longs[li].prompt, longs[li].prompt_len, args.long_output)
                li += 1
            tasks.append((kind, asyncio.create_task(send_completion(client, url, model, req, {}))))
        return [(kind, await task) for kind, task in tasks]


def launch(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())


def start_layout(layout: str, args, log) -> tuple[list[subprocess.Popen], str]:
    """The two servers and the router of ``layout``; returns (processes, router base URL)."""
    serve = [sys.executable, "-m", "baige", "serve", "--model", args.model, "--max-model-len", str(args.max_model_len)]
    serve += ["--log-level", "warning", "--dtype", args.dtype]
    procs, urls, roles = [], [], []
    for i in range(2):
        port = free_port()
        extra = []
        if layout == "pd":
            role = ("kv_producer", "kv_consumer")[i]
            cfg = {"kv_connector": "zmq", "kv_role": role}
            extra = ["--kv-transfer-config", json.dumps(cfg)]
            if role == "kv_producer":
                extra += ["--long-prefill-token-threshold", str(args.producer_long_prefill_threshold)]
            roles.append(role)
        elif args.colocated_long_prefill_threshold:
            extra = ["--long-prefill-token-threshold", str(args.colocated_long_prefill_threshold)]
        procs.append(launch([*serve, "--port", str(port), *extra], log))
        urls.append(f"http://127.0.0.1:{port}")
    for url, proc in zip(urls, procs):
        wait_healthy(url, proc, 900)
    port = free_port()
    router = [sys.executable, "-m", "baige", "router", "--port", str(port), "--log-level", "warning"]
    if layout == "pd":
        router += ["--policy", "pd", "--prefill", urls[0], "--decode", urls[1]]
    else:
        router += ["--policy", "least_load", "--backend", urls[0], "--backend", urls[1]]
    procs.append(subprocess.Popen(router, stdout=log, stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, procs[-1], 120)
    return procs, base


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize_run(results, duration: float) -> dict:
    """Client-side metrics of one (layout, rate) run; times in ms."""
    short = [r for k, r in results if k == "short"]
    long = [r for k, r in results if k == "long"]
    ok_short = [r for r in short if r.success]
    itl = [x * 1000 for r in ok_short for x in r.itl]
    return {
        "short_requests": len(short),
        "short_failed": sum(not r.success for r in short),
        "long_requests": len(long),
        "long_failed": sum(not r.success for r in long),
        "errors": sorted({r.error for _, r in results if r.error})[:5],
        "short_itl_ms": summarize(itl, (50, 90, 99)),
        "short_ttft_ms": summarize([r.ttft * 1000 for r in ok_short], (50, 90, 99)),
        "long_ttft_ms": summarize([r.ttft * 1000 for r in long if r.success], (50, 90, 99)),
        "wall_s": duration,
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rates", default="0.5,1,2", help="short-chat arrival rates (requests/s), comma-separated")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per (layout, rate)")
    ap.add_argument("--short-prompt", type=int, default=64)
    ap.add_argument("--short-output", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=1536)
    ap.add_argument("--long-output", type=int, default=4)
    ap.add_argument("--long-every", type=float, default=10.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--producer-long-prefill-threshold",
        type=int,
        default=256,
        help="the P/D producer's --long-prefill-token-threshold (0: none): a long prompt's prefill in chunks "
        "of this many tokens, so the short prompts behind it are not held until it ends",
    )
    ap.add_argument(
        "--colocated-long-prefill-threshold",
        type=int,
        default=0,
        help="the colocated instances' --long-prefill-token-threshold (0: none; run it both ways to give colocated "
        "its better setting: chunks let short prompts in sooner but stall the instance's running streams more often)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="which layouts to run (both for the verdict)")
    ap.add_argument("--output-dir", default=str(REPO / "docs" / "benchmarks" / "records"))
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)  # server_env hands this to the servers as OMP_NUM_THREADS
    rates = [float(r) for r in args.rates.split(",")]
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_dir(model_dir)
    text = (REPO / "tests" / "data" / "tinyshakespeare.txt").read_text()
    load_before = os.getloadavg()
    log = tempfile.NamedTemporaryFile(prefix="bench-pd-", suffix=".log", delete=False)  # noqa: SIM115
    layouts = [x for x in args.layouts.split(",") if x]
    runs: dict[str, dict[str, dict]] = {layout: {} for layout in layouts}
    try:
        for layout in layouts:
            procs, base = start_layout(layout, args, log)
            try:
                for i, rate in enumerate(rates):
                    rng = random.Random(args.seed + i)
                    events = schedule(rate, args.duration, args.long_every, args.seed + i)
                    n_short = sum(k == "short" for _, k in events)
                    shorts = text_prompts(tok, text, n_short, args.short_prompt, rng)
                    longs = text_prompts(tok, text, len(events) - n_short, args.long_prompt, rng)
                    names = ["server_0", "server_1", "router", "client"]
                    pids = [p.pid for p in procs] + [os.getpid()]
                    cpu0 = [cpu_seconds(pid) for pid in pids]
                    t0 = time.perf_counter()
                    results = asyncio.run(drive(base, args.model, events, shorts, longs, args))
                    r = summarize_run(results, time.perf_counter() - t0)
                    r["cpu_seconds"] = {n: cpu_seconds(pid) - c for n, pid, c in zip(names, pids, cpu0)}
                    r["loadavg_1m_after"] = os.getloadavg()[0]
                    runs[layout][str(rate)] = r
                    print(
                        f"{layout:9s} rate {rate:4.2f}/s: short ITL p50 {r['short_itl_ms']['p50']:7.1f} "
                        f"p99 {r['short_itl_ms']['p99']:7.1f} ms; short TTFT p50 {r['short_ttft_ms']['p50']:7.1f} "
                        f"p99 {r['short_ttft_ms']['p99']:7.1f} ms; long TTFT p50 {r['long_ttft_ms']['p50']:7.1f} ms; "
                        f"failed {r['short_failed']}+{r['long_failed']}; wall {r['wall_s']:.0f} s, CPU s "
                        + " ".join(f"{k} {v:.1f}" for k, v in r["cpu_seconds"].items()),
                        flush=True,
                    )
            finally:
                for proc in procs:
                    stop_server(proc)
    finally:
        log.close()
        print(f"the servers' and routers' log: {log.name}")
    verdict = compare(runs, rates) if set(runs) == set(LAYOUTS) else {"note": "one layout only: no verdict"}
    print(json.dumps(verdict))
    env = environment()
    env["command"] = shlex.join(["python", "scripts/bench_pd.py", *sys.argv[1:]])
    env["loadavg_before"] = load_before
    record = {
        "benchmark": "pd_vs_colocated",
        "args": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "environment": env,
        "runs": runs,
        "verdict": verdict,
    }
    out = write_result(args.output_dir, "pd-vs-colocated", record)
    print(f"wrote {out}")
    return 0


def compare(runs: dict, rates: list[float]) -> dict:
    """The issue's question, from the runs: the first rate where colocated's short-chat P99 ITL passes
    100 ms, the two P99 ITLs there and their ratio, and the short chats' P50 TTFT under both."""
    for rate in rates:
        col, pd = runs["colocated"][str(rate)], runs["pd"][str(rate)]
        if col["short_itl_ms"]["p99"] > 100.0:
            ratio = col["short_itl_ms"]["p99"] / max(pd["short_itl_ms"]["p99"], 1e-9)
            return {
                "rate": rate,
                "colocated_p99_itl_ms": col["short_itl_ms"]["p99"],
                "pd_p99_itl_ms": pd["short_itl_ms"]["p99"],
                "itl_p99_ratio": ratio,
                "target_2x_met": ratio >= 2.0,
                "colocated_short_ttft_p50_ms": col["short_ttft_ms"]["p50"],
                "pd_short_ttft_p50_ms": pd["short_ttft_ms"]["p50"],
                "colocated_long_ttft_p50_ms": col["long_ttft_ms"]["p50"],
                "pd_long_ttft_p50_ms": pd["long_ttft_ms"]["p50"],
            }
    return {"rate": None, "note": "colocated P99 ITL stayed under 100 ms at every rate: raise the rates"}


if __name__ == "__main__":
    sys.exit(main())
