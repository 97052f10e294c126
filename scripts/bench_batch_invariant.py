"""The cost of batch-invariant mode (``--batch-invariant``) on the embedded SmolLM2-135M-Instruct: one engine per
(mode, dtype) in a fresh process each, interleaved, so a busy machine slows them alike.

Workloads, greedy, EOS ignored, after a 4-token warm-up request:

- ``batch1``: one 16-token prompt, 64 output tokens: tokens/s = 64 / wall time (prefill included);
- ``batch16``: 16 prompts of 16..121 tokens (1096 in all), 64 output tokens each, all admitted in the first
  step: output tokens / wall time;
- ``prefill480``: one 480-token prompt, 1 output token: prompt tokens / wall time.

    .venv/bin/python scripts/bench_batch_invariant.py --threads 1 --out bench-results/batch_invariant.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def measure(batch_invariant: bool, dtype: str, threads: int) -> dict:
    import torch

    from baige import LLM, SamplingParams, kernels

    torch.set_num_threads(threads)
    llm = LLM(None, batch_invariant=batch_invariant, dtype=dtype, max_model_len=512, kv_cache_memory=200_000_000)
    base = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 60)
    prompts = [base[: 16 + 7 * i] for i in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0))

    def timed(fn) -> tuple[float, object]:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    one, _ = timed(lambda: llm.generate([prompts[0]], params))
    many, outs = timed(lambda: llm.generate(prompts, params))
    pre, _ = timed(lambda: llm.generate([base[:480]], SamplingParams(max_tokens=1, temperature=0)))
    return {
        "batch_invariant": batch_invariant,
        "dtype": dtype,
        "threads": threads,
        "isa": kernels.cpu_isa(),
        "batch1_tokens_per_s": round(64 / one, 2),
        "batch16_tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / many, 2),
        "prefill480_tokens_per_s": round(480 / pre, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "mode,dtype" in this process
    args = ap.parse_args()
    if args.one:
        mode, dtype = args.one.split(",")
        print(json.dumps(measure(mode == "1", dtype, args.threads)))
        return
    rows = []
    for _ in range(args.repeats):
        for dtype in args.dtypes.split(","):
            for mode in ("0", "1"):
                cmd = [sys.executable, __file__, "--threads", str(args.threads), "--one", f"{mode},{dtype}"]
                row = json.loads(
                    subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
    from baige import kernels

    record = {"cpu_flags": kernels.cpu_isa_flags(), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
