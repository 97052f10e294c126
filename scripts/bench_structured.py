"""Structured-output overhead on the embedded model (CPU): the first-request grammar compile time,
and the token-mask time per generated token as a fraction of a decode step, at batch 1 and with 32
constrained sequences in one batch.

For each batch size, the same greedy requests run twice through one Engine: free, then constrained
by a JSON schema whose language every greedy output can follow for ``--tokens`` tokens (a JSON
object with one long free string). The engine's ``grammars().stats`` time every mask computation;
the decode step time comes from the free run (wall time / decode steps). The overlap with the
forward (masks run on a worker thread) is reported too: constrained wall time minus free wall time,
after one constrained warm-up run (whose extra time is reported as "1st run +": llguidance builds
its lexer states lazily, the first time a grammar meets them).

    .venv/bin/python scripts/bench_structured.py --threads 1 --out bench-results/structured.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def run(llm, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from baige import LLM, SamplingParams
    from baige.runtime.infer.structured import StructuredOutputsParams

    llm = LLM(max_model_len=512, kv_cache_memory="400MiB", max_num_seqs=64)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story as JSON."}])
    constraint = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    llm.engine.grammars().matcher(constraint)  # the first constrained request: tokenizer + grammar
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    llm.engine.grammars().matcher(StructuredOutputsParams(json={**SCHEMA, "title": "other"}))
    second_compile = time.perf_counter() - start
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.tokens, structured_outputs=constraint)
    rows = []
    for b in args.batches:
        prompts = [prompt] * b
        run(llm, prompts, free)  # warm-up
        t_free = run(llm, prompts, free)
        t_cons_first = run(llm, prompts, constrained)  # warm-up: llguidance builds its lexer states lazily
        stats = llm.engine.grammars().stats
        mask0, n0 = stats["mask_seconds"], stats["masked_tokens"]
        t_cons = run(llm, prompts, constrained)
        mask_s, masked = stats["mask_seconds"] - mask0, stats["masked_tokens"] - n0
        steps = args.tokens  # decode steps (prefill folded in: a bound, not a refinement)
        step = t_free / steps
        per_step_mask = mask_s / steps
        rows.append(
            {
                "batch": b,
                "free_s": t_free,
                "constrained_s": t_cons,
                "decode_step_s": step,
                "mask_s_per_step": per_step_mask,
                "mask_fraction_of_step": per_step_mask / step,
                "mask_us_per_token": 1e6 * mask_s / max(masked, 1),
                "wall_overhead_fraction": (t_cons - t_free) / t_free,
                "first_constrained_s": t_cons_first,
            }
        )
    result = {
        "first_compile_s": first_compile,
        "next_compile_s": second_compile,
        "threads": args.threads,
        "tokens": args.tokens,
        "rows": rows,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(
        f"first-request compile (tokenizer + grammar): {first_compile:.2f} s; "
        f"another schema: {second_compile * 1e3:.1f} ms"
    )
    print(
        f"{'batch':>5} {'step ms':>8} {'mask ms/step':>13} {'mask/step':>10} {'us/token':>9} {'wall +':>7}"
        f" {'1st run +':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {1e3 * r['decode_step_s']:>8.1f} {1e3 * r['mask_s_per_step']:>13.2f} "
            f"{100 * r['mask_fraction_of_step']:>9.1f}% {r['mask_us_per_token']:>9.0f} "
            f"{100 * r['wall_overhead_fraction']:>6.1f}% {100 * (r['first_constrained_s'] / r['free_s'] - 1):>8.1f}%"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
