"""Offline throughput of baige's engine (`LLM.generate`) vs HF transformers `generate`.

Two measurements on the embedded SmolLM2-135M-Instruct (its GGUF, dequantized, as both load it):

1. mixed batch: 64 prompts with input lengths uniform in [32, 256] tokens (slices of wikitext-2)
   and output lengths uniform in [16, 256], greedy, EOS ignored. HF runs static batches of 64
   (left-padded, every sequence generates the batch's longest output); baige runs continuous
   batching with each request's own max_tokens. Metric: useful output tokens / wall seconds.
2. batch 1: one 128-token prompt, 128 greedy tokens. Metric: output tokens / wall seconds.

Usage: python scripts/bench_serve_vs_hf.py [--dtype float32] [--threads 2] [--enforce-eager]
           [--skip-hf | --hf-result PREVIOUS.json] [--skip-baige] [--out RESULT.json]
(HF is slow: run it once with --skip-baige --out hf.json, then compare with --hf-result hf.json.)
Not a test: numbers depend on the machine and its load; record them with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def make_prompts(tok, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    from data_files import data_dir  # scripts/: $BAIGE_DATA, else tests/data

    text = (data_dir() / "wikitext-2-raw-test.txt").read_text()
    ids = tok.encode(text[:400_000], add_special_tokens=False)
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        length = rng.randint(32, 256)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
        outs.append(rng.randint(16, 256))
    return prompts, outs


def bench_baige(args, prompts, out_lens) -> dict:
    from baige import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_memory=int(1.5e9),
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    warm = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)] * 2
    llm.generate(prompts[:2], warm)  # warm-up (and compile for small batches)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    mixed_s = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(out_lens)
    one = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    llm.generate([prompts[0][:128]], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=8)])
    t = time.perf_counter()
    llm.generate([prompts[0][:128]], [one])
    b1_s = time.perf_counter() - t
    return {
        "mixed_output_tok_per_s": n_out / mixed_s,
        "mixed_seconds": mixed_s,
        "mixed_output_tokens": n_out,
        "batch1_tok_per_s": 128 / b1_s,
        "preemptions": llm.engine.scheduler.num_preemptions,
    }


def bench_hf(args, prompts, out_lens) -> dict:
    from conftest import embedded_gguf
    from transformers import AutoModelForCausalLM

    path = embedded_gguf()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    pad = 0

    def run(batch, max_new):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )

    run(prompts[:2], 4)
    t = time.perf_counter()
    for i in range(0, len(prompts), 64):
        run(prompts[i : i + 64], max(out_lens[i : i + 64]))
    mixed_s = time.perf_counter() - t
    t = time.perf_counter()
    run([prompts[0][:128]], 128)
    b1_s = time.perf_counter() - t
    return {"mixed_output_tok_per_s": sum(out_lens) / mixed_s, "mixed_seconds": mixed_s, "batch1_tok_per_s": 128 / b1_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--quantization", default=None, choices=["fp16-weight"], help="baige's engine only (HF runs the fp32 model)"
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="baige's engine only (HF keeps its fp32 cache)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="baige's engine only: e.g. an int8 directory from `baige quantize` (HF runs the fp32 GGUF)",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-baige", action="store_true")
    ap.add_argument("--hf-result", type=Path, default=None, help="reuse the 'hf' numbers of an earlier --out JSON")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.hub import resolve_model

    tok = Tokenizer.from_dir(resolve_model(None))
    prompts, out_lens = make_prompts(tok, args.num_prompts, args.seed)
    result = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "enforce_eager": args.enforce_eager,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "model": args.model,
        "load_avg_1min_start": os.getloadavg()[0],
    }
    if not args.skip_baige:
        result["baige"] = bench_baige(args, prompts, out_lens)
        print(json.dumps(result, indent=2), flush=True)
    if args.hf_result:
        result["hf"] = json.loads(args.hf_result.read_text())["hf"]
        result["hf_from"] = str(args.hf_result)
    elif not args.skip_hf:
        result["hf"] = bench_hf(args, prompts, out_lens)
    result["load_avg_1min_end"] = os.getloadavg()[0]
    if "hf" in result and "baige" in result:
        for k in ("mixed_output_tok_per_s", "batch1_tok_per_s"):
            result[f"speedup_{k}"] = result["baige"][k] / result["hf"][k]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
