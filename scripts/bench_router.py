"""The router's policies on one prefix-sharing workload: prefix-cache hit tokens over the backends.

Starts ``--backends`` `baige serve` processes (``--enable-rl-endpoints``: their prefix caches are reset
between policies) and, for each policy, a `baige router` process over them; sends ``--families`` prompt
families of ``--per-family`` completions each (a family shares a ``--prefix-chars`` passage of
tinyshakespeare, each request adds a question of its own), shuffled, one at a time; and reads the
backends' ``baige:prefix_cache_hits_total`` before and after. The ideal is every family's later requests
hitting the whole shared prefix (its common token prefix, in whole blocks). Writes a record
``docs/benchmarks/records/router-*.json`` (``--output-dir``) that ``scripts/bench_report.py`` reports.

    python scripts/bench_router.py [--model SPEC] [--backends 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from baige.runtime.bench.common import environment, write_result
from baige.runtime.bench.serve_run import free_port, server_env, stop_server, wait_healthy
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.hub import resolve_model

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16  # baige serve's default --block-size
POLICIES = ("prefix", "round_robin", "least_load")


def workload(text: str, families: int, per_family: int, prefix_chars: int, seed: int) -> list[tuple[int, str]]:
    """(family, prompt) pairs, shuffled: each family a distinct passage of ``text`` plus a question."""
    rng = random.Random(seed)
    starts = rng.sample(range(0, len(text) - prefix_chars, prefix_chars), families)
    out = []
    for f, s in enumerate(starts):
        passage = text[s : s + prefix_chars]
        out += [
            (f, f"{passage}\n\nQuestion {j + 1}: who speaks line {rng.randrange(1, 40)}?") for j in range(per_family)
        ]
    rng.shuffle(out)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ideal_hits(tok: Tokenizer, prompts: list[tuple[int, str]]) -> int:
    """Prefix-cache hit tokens if every family lived on one backend with room for all: each request
    finds the longest token prefix it shares with an earlier request of its family (the prompt's last
    token always computed), in whole blocks. ``prompts`` in the order they are sent; tokenized as the
    server does (``Tokenizer.encode``, special tokens added)."""
    seen: dict[int, list[list[int]]] = {}
    total = 0
    for family, prompt in prompts:
        ids = tok.encode(prompt)
        shared = max((common_prefix(ids, earlier) for earlier in seen.get(family, [])), default=0)
        total += min(shared, len(ids) - 1) // BLOCK * BLOCK
        seen.setdefault(family, []).append(ids)
    return total


def hits(urls: list[str]) -> float:
    """Prefix-cache hit tokens summed over the backends (vLLM's counter name where exported, else baige's)."""
    total = 0.0
    for url in urls:
        found = {}
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("vllm:prefix_cache_hits_total", "baige:prefix_cache_hits_total"):
                found[name] = float(value)
        total += found.get("vllm:prefix_cache_hits_total", found.get("baige:prefix_cache_hits_total", 0.0))
    return total


def run_policy(policy: str, urls: list[str], prompts: list[tuple[int, str]], log) -> dict:
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
    port = free_port()
    argv = [sys.executable, "-m", "baige", "router", "--port", str(port), "--policy", policy, "--log-level", "warning"]
    for url in urls:
        argv += ["--backend", url]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 120)
        before, latencies = hits(urls), []
        with httpx.Client(base_url=base, timeout=600) as c:
            for _, p in prompts:
                t0 = time.perf_counter()
                c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0}).raise_for_status()
                latencies.append(time.perf_counter() - t0)
        return {"hit_tokens": hits(urls) - before, "mean_latency_s": sum(latencies) / len(latencies)}
    finally:
        stop_server(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--per-family", type=int, default=4)
    ap.add_argument("--prefix-chars", type=int, default=1200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default=str(REPO / "docs" / "benchmarks" / "records"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)  # server_env gives the backends this many threads
    model_dir = resolve_model(args.model)
    text = (REPO / "tests" / "data" / "tinyshakespeare.txt").read_text()
    prompts = workload(text, args.families, args.per_family, args.prefix_chars, args.seed)
    ideal = ideal_hits(Tokenizer.from_dir(model_dir), prompts)
    procs, urls = [], []
    log = tempfile.NamedTemporaryFile(prefix="bench-router-", suffix=".log", delete=False)  # noqa: SIM115
    try:
        for _ in range(args.backends):
            port = free_port()
            cmd = [sys.executable, "-m", "baige", "serve", "--model", args.model, "--port", str(port)]
            cmd += ["--enable-rl-endpoints", "--max-model-len", "1024", "--log-level", "warning"]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env()))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc, 900)
        results = {}
        for policy in POLICIES:
            r = run_policy(policy, urls, prompts, log)
            r["fraction_of_ideal"] = r["hit_tokens"] / ideal
            results[policy] = r
            print(
                f"{policy:12s} hit tokens {r['hit_tokens']:7.0f} / ideal {ideal} "
                f"({100 * r['fraction_of_ideal']:.1f}%), mean latency {r['mean_latency_s']:.3f} s"
            )
    finally:
        for proc in procs:
            stop_server(proc)
        log.close()
        print(f"the servers' and routers' log: {log.name}")
    env = environment()
    env["command"] = shlex.join(["python", "scripts/bench_router.py", *sys.argv[1:]])
    record = {
        "benchmark": "router",
        "args": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "environment": env,
        "num_requests": len(prompts),
        "ideal_hit_tokens": ideal,
        "results": results,
    }
    out = write_result(args.output_dir, "router", record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
