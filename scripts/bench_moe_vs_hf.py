"""MoE forward on CPU: baige's grouped experts path against transformers' eager MoE, same weights.

A random mid-size Qwen3-MoE (16 experts, top-2, hidden 512, expert width 512; 2 layers, one dense
and one sparse ... see --layers) is written with transformers, loaded by both, and a batch of
``--tokens`` tokens is run forward. Two numbers per thread count:

- the sparse block alone (router + experts + combine): baige's ``SparseMoeBlock`` (``kernels.moe_topk``
  + ``kernels.fused_moe``, the grouped reference on CPU: tokens sorted by expert, one matmul chain
  per expert) against ``Qwen3MoeSparseMoeBlock`` with ``experts_implementation="eager"``;
- the whole model's forward to the final hidden states, no lm_head on either side (tokens/s).

Median of ``--repeats`` timed runs after one warm-up. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_moe_vs_hf.py --threads 1 2 --out bench-results/moe_vs_hf.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def make(path: Path, args) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=args.hidden // 8, moe_intermediate_size=args.expert_width,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(path)


def save(src: Path, dst: Path) -> None:
    import shutil

    from baige.runtime.weights.hub import resolve_model
    from baige.runtime.weights.safetensors_io import TOKENIZER_FILES

    shutil.copytree(src, dst)
    embedded = resolve_model(None)
    for name in TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copy(embedded / name, dst / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--save", type=Path, default=None,
                    help="Also keep the random checkpoint here, with the embedded model's tokenizer (for "
                         "`baige bench latency --model DIR`: the MoE decode roofline)")
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from baige.runtime.model.moe import SparseMoeBlock
    from baige.runtime.weights.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        make(Path(tmp), args)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, experts_implementation="eager").eval()
        ours = load_model(tmp)
        if args.save:
            save(Path(tmp), args.save)
    layer = next(i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mlp, SparseMoeBlock))
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(args.tokens)[None]
    with torch.inference_mode():
        diff = (hf.model.layers[layer].mlp(x) - ours.model.layers[layer].mlp(x)).abs().max().item()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            hf_block = timed(lambda: hf.model.layers[layer].mlp(x), args.repeats)
            our_block = timed(lambda: ours.model.layers[layer].mlp(x), args.repeats)
            hf_model = timed(lambda: hf.model(ids), args.repeats)  # hidden states, as ours: no lm_head
            our_model = timed(lambda: ours(ids, positions), args.repeats)
        rows.append({"threads": threads,
                     "block_tokens_per_s": {"baige": args.tokens / our_block, "hf_eager": args.tokens / hf_block},
                     "model_tokens_per_s": {"baige": args.tokens / our_model, "hf_eager": args.tokens / hf_model},
                     "block_speedup": hf_block / our_block, "model_speedup": hf_model / our_model})
    result = {"args": vars(args) | {"out": str(args.out)}, "max_abs_diff_block": diff, "rows": rows,
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    print(f"{'threads':>7} {'block baige':>12} {'block HF':>10} {'x':>6} {'model baige':>12} {'model HF':>10} {'x':>6}"
          "   (tokens/s)")
    for r in rows:
        b, m = r["block_tokens_per_s"], r["model_tokens_per_s"]
        print(f"{r['threads']:>7} {b['baige']:>12.0f} {b['hf_eager']:>10.0f} {r['block_speedup']:>6.2f}"
              f" {m['baige']:>12.0f} {m['hf_eager']:>10.0f} {r['model_speedup']:>6.2f}")
    print(f"max |block difference| = {diff:.2e}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
