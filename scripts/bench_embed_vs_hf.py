"""Embeddings throughput (inputs/s) of baige's pooling runner (`LLM(runner="pooling").embed`) vs HF
transformers on the same model: the embedded SmolLM2-135M-Instruct (GGUF, dequantized to fp32 by both),
last-token pooling, L2-normalised.

Inputs: ``--num-inputs`` texts cut from tests/data/tinyshakespeare.txt, lengths drawn uniformly from
``--min-len``..``--max-len`` tokens (seeded). baige gets them all at once (its scheduler batches and
chunks them); transformers runs sentence-transformers' recipe: inputs sorted by length, batches of
``--hf-batch-size``, right padding with an attention mask, the last real token's final hidden state
(``AutoModelForCausalLM.model``: the decoder without its head). One warm-up call each, then the timed
call. The largest difference between the two sets of vectors is reported (a correctness check, fp32).

    .venv/bin/python scripts/bench_embed_vs_hf.py --threads 1 --output-dir docs/benchmarks/records
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def make_inputs(tok, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    text = (REPO / "tests" / "data" / "tinyshakespeare.txt").read_text()
    ids = tok.encode(text[:200_000], add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def bench_baige(llm, inputs: list[list[int]]) -> tuple[float, torch.Tensor]:
    llm.embed(inputs[:4])  # warm-up
    t = time.perf_counter()
    outs = llm.embed(inputs)
    seconds = time.perf_counter() - t
    return seconds, torch.tensor([o.outputs.embedding for o in outs])


def bench_hf(inputs: list[list[int]], batch_size: int) -> tuple[float, torch.Tensor]:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import embedded_gguf
    from transformers import AutoModelForCausalLM

    path = embedded_gguf()
    decoder = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).model.eval()

    def embed(batch: list[list[int]]) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
        with torch.inference_mode():
            hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, hidden)
        last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]  # (B, hidden)
        return torch.nn.functional.normalize(last, dim=-1)

    embed(inputs[:4])  # warm-up
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out = torch.empty(len(inputs), decoder.config.hidden_size)
    t = time.perf_counter()
    for k in range(0, len(order), batch_size):
        rows = order[k : k + batch_size]
        out[rows] = embed([inputs[i] for i in rows])
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-inputs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from baige import LLM
    from baige.runtime.bench.common import environment, write_result

    llm = LLM(
        None,
        runner="pooling",
        dtype="float32",
        max_model_len=512,
        kv_cache_memory="400MiB",
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    inputs = make_inputs(llm.get_tokenizer(), args.num_inputs, args.min_len, args.max_len, args.seed)
    n_tokens = sum(len(p) for p in inputs)
    baige_s, baige_vecs = bench_baige(llm, inputs)
    hf_s, hf_vecs = bench_hf(inputs, args.hf_batch_size)
    result = {
        "benchmark": "embed",
        "args": {**vars(args), "output_dir": None, "model": None},
        "environment": {
            **environment(),
            "command": shlex.join(["python", "scripts/bench_embed_vs_hf.py", *sys.argv[1:]]),
        },
        "dtype": "float32",
        "pooling": "LAST, normalised",
        "num_inputs": len(inputs),
        "prompt_tokens": n_tokens,
        "baige": {"seconds": baige_s, "inputs_per_s": len(inputs) / baige_s, "tokens_per_s": n_tokens / baige_s},
        "hf": {"seconds": hf_s, "inputs_per_s": len(inputs) / hf_s, "tokens_per_s": n_tokens / hf_s},
        "speedup": hf_s / baige_s,
        "max_abs_diff": float((baige_vecs - hf_vecs).abs().max()),
    }
    print(f"{len(inputs)} inputs, {n_tokens} tokens, {args.threads} thread(s), fp32")
    for name in ("baige", "hf"):
        r = result[name]
        print(
            f"{name:>6}: {r['inputs_per_s']:8.2f} inputs/s  {r['tokens_per_s']:8.1f} tokens/s  ({r['seconds']:.2f} s)"
        )
    print(f"speed-up {result['speedup']:.2f}x; largest |baige - hf| {result['max_abs_diff']:.2e}")
    if args.output_dir:
        print(write_result(args.output_dir, "embed", result))


if __name__ == "__main__":
    main()
