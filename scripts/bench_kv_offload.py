"""TTFT of a prompt whose 2k-token prefix was evicted from the paged pool: loaded back from the second
KV tier (``--kv-offload-size``, files under a temporary directory: a CPU pool) against recomputed
(no tier), with a pool hit beside them (the prefix never left the pool).

On the embedded SmolLM2 (or ``--model``; dtype auto: bf16 on a CPU with native bf16), one engine per
mode with a pool that holds one sequence of ``--prefix`` + 64 tokens. Each repeat runs an *evictor*
prompt (other random tokens, as long) that pushes the prefix's blocks out of the pool (into the tier
when there is one; the writer is flushed, as a server's background thread would have finished long
before), then times the measured request: the prefix plus a fresh 8-token suffix, ``max_tokens=1``,
from ``add_request`` to its output (its TTFT; the engine is idle, so no queueing). The pool-hit mode
runs the same with a pool four times as large, so the evictor leaves the prefix in the pool. Medians
of ``--repeats`` runs; the record keeps every sample, the tier's counters and the load average.

    .venv/bin/python scripts/bench_kv_offload.py --out docs/benchmarks/records/kv-offload-$(date +%Y%m%d-%H%M%S).json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model

BLOCK = 16
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def timed(eng: Engine, rid: str, prompt: list[int]) -> float:
    """Seconds from add_request to the request's (only) output token."""
    start = time.perf_counter()
    eng.add_request(rid, prompt, ONE)
    eng.run_to_completion([rid])
    return time.perf_counter() - start


def measure(model, tok, blocks: int, offload: str | None, prefix, suffixes, evictors) -> tuple[list[float], dict]:
    per_block = KVCache.bytes_per_block(model.config, BLOCK, next(model.parameters()).dtype)
    cfg = EngineConfig(
        max_model_len=len(prefix) + 64, kv_cache_memory=blocks * per_block, block_size=BLOCK, kv_offload_size=offload
    )
    eng = Engine(model, tok, cfg)
    timed(eng, "warm", prefix + suffixes[0])  # the prefix computed once (stored when later evicted)
    samples = []
    for i, (suffix, evictor) in enumerate(zip(suffixes[1:], evictors)):
        timed(eng, f"evict{i}", evictor)
        if eng.kv_offload is not None:
            eng.kv_offload.flush()
        samples.append(timed(eng, f"r{i}", prefix + suffix))
    stats = asdict(eng.kv_offload.stats) if eng.kv_offload is not None else {}
    eng.close()
    return samples, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2)")
    ap.add_argument("--prefix", type=int, default=2048, help="prefix tokens (a multiple of 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

    prefix = rand(args.prefix)
    suffixes = [rand(8) for _ in range(args.repeats + 1)]
    evictors = [rand(args.prefix + 8) for _ in range(args.repeats)]
    seq_blocks = -(-(args.prefix + 64) // BLOCK)
    modes = {
        "recompute": (seq_blocks + 2, None),
        "tier_hit": (seq_blocks + 2, "8GB"),
        "pool_hit": (4 * seq_blocks, None),
    }
    samples, tier = {}, {}
    for name, (blocks, offload) in modes.items():
        samples[name], st = measure(model, tok, blocks, offload, prefix, suffixes, evictors)
        tier = st or tier
    med = {name: statistics.median(v) for name, v in samples.items()}
    summary = {
        **{f"{name}_ttft_s": round(v, 4) for name, v in med.items()},
        "tier_speedup_vs_recompute": round(med["recompute"] / med["tier_hit"], 2),
        "tier_hit_blocks_per_request": tier["hit_blocks"] // args.repeats,
    }
    from baige.runtime.bench.common import environment

    record = {
        "benchmark": "kv_offload",
        "model": str(args.model or "smollm2-135m-instruct"),
        "args": {"prefix": args.prefix, "repeats": args.repeats, "threads": args.threads, "block_size": BLOCK},
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "environment": environment(),
        "samples": samples,
        "tier_stats": tier,
        "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
