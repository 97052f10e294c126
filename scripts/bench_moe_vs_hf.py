"""MoE forward on CPU: baige's grouped experts path against transformers' eager MoE, same weights.

A random mid-size Qwen3-MoE (16 experts, top-2, hidden 512, expert width 512; 2 layers, one dense
and one sparse ... see --layers) is written with transformers, loaded by both, and a batch of
``--tokens`` tokens is run forward. Two numbers per thread count:

- the sparse block alone (router + experts + combine): baige's ``SparseMoeBlock`` (``kernels.moe_topk``
  + ``kernels.fused_moe``, the grouped reference on CPU: tokens sorted by expert, one matmul chain
  per expert on its contiguous slice) against ``Qwen3MoeSparseMoeBlock`` with
  ``experts_implementation="eager"`` (transformers' per-expert loop; its default on CPU with torch
  >= 2.9 is ``grouped_mm``, timed too as ``block_hf_grouped_mm``);
- the whole model's forward to the final hidden states, no lm_head on either side (tokens/s);
- the block's expert matmuls alone (:func:`gemm_only`): the floor of a ``torch.mm`` path, so
  ``block_speedup_bound`` is the most any such path could gain over HF eager on this machine.

Both sides in one dtype (``--dtype``: fp32 by default, or bf16, where CPUs with AMX run baige's
``moe_amx.c`` and HF's eager loop is faster than in fp32), under ``torch.inference_mode``, the same
``torch.set_num_threads``; the best of ``--repeats`` rounds after two warm-ups (the median is written too), each round
timing every
variant once in turn. The load average and the CPU's AVX flags go into the JSON: the host may be
shared. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_moe_vs_hf.py --threads 1 2 --out bench-results/moe_vs_hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def timed(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """{name: (best, median) seconds} over ``repeats`` rounds, each round calling every function once
    in turn (so drift in the host's speed falls on all of them alike), after two warm-up calls each."""
    for fn in fns.values():
        fn(), fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {name: (min(v), statistics.median(v)) for name, v in samples.items()}


def gemm_only(block, x: torch.Tensor):
    """A zero-argument function running only the block's expert matmuls on ``x`` (B, T, H): per expert
    with tokens, ``rows @ gate_up.T`` then ``act @ down.T`` on rows gathered and sorted beforehand --
    a floor for any implementation built on ``torch.mm`` (no routing, activation or combine)."""
    x2 = x.reshape(-1, x.shape[-1])  # (N, H)
    _, _, ids = block.route(x2)
    flat = ids.reshape(-1)
    xs = x2[torch.argsort(flat, stable=True) // ids.shape[1]]  # (N * k, H) sorted by expert
    bounds = torch.bincount(flat, minlength=block.experts.num_experts).cumsum(0).tolist()
    w13, w2, inter = block.experts.gate_up_proj, block.experts.down_proj, block.experts.intermediate_size
    segments = [(e, s, t) for e, (s, t) in enumerate(zip([0] + bounds[:-1], bounds)) if t > s]

    def run():
        for e, s, t in segments:
            torch.mm(torch.mm(xs[s:t], w13[e].t())[:, :inter], w2[e].t())

    return run


def cpu_flags() -> list[str]:
    """The ``avx*`` flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({w for w in text.split() if w.startswith("avx")})


def make(path: Path, args) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        moe_intermediate_size=args.expert_width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
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
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--save",
        type=Path,
        default=None,
        help="Also keep the random checkpoint here, with the embedded model's tokenizer (for "
        "`baige bench latency --model DIR`: the MoE decode roofline)",
    )
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="The dtype of both sides (weights and activations)",
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM

    from baige.runtime.model.moe import SparseMoeBlock
    from baige.runtime.weights.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        make(Path(tmp), args)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, experts_implementation="eager").eval()
        ours = load_model(tmp, dtype=dtype)  # one dtype on both sides (auto would pick bf16 on some CPUs)
        if args.save:
            save(Path(tmp), args.save)
    layer = next(i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mlp, SparseMoeBlock))
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.arange(args.tokens)[None]
    with torch.inference_mode():
        diff = (hf.model.layers[layer].mlp(x).float() - ours.model.layers[layer].mlp(x).float()).abs().max().item()
    hf_block, ours_block = hf.model.layers[layer].mlp, ours.model.layers[layer].mlp
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        load = os.getloadavg()[0]
        with torch.inference_mode():
            t = timed(
                {
                    "block_hf_eager": lambda: hf_block(x),
                    "block_baige": lambda: ours_block(x),
                    "block_gemm_only": gemm_only(ours_block, x),
                    "model_hf_eager": lambda: hf.model(ids),  # hidden states, as ours: no lm_head
                    "model_baige": lambda: ours(ids, positions),
                },
                args.repeats,
            )
            hf.set_experts_implementation("grouped_mm")
            t |= timed({"block_hf_grouped_mm": lambda: hf_block(x)}, args.repeats)
            hf.set_experts_implementation("eager")
        rows.append(
            {
                "threads": threads,
                "load_1min_before": load,
                "tokens_per_s_best": {n: args.tokens / v[0] for n, v in t.items()},
                "tokens_per_s_median": {n: args.tokens / v[1] for n, v in t.items()},
                "block_speedup": t["block_hf_eager"][0] / t["block_baige"][0],
                "model_speedup": t["model_hf_eager"][0] / t["model_baige"][0],
                "block_speedup_bound": t["block_hf_eager"][0] / t["block_gemm_only"][0],
            }
        )
    result = {
        "args": vars(args) | {"out": str(args.out)},
        "max_abs_diff_block": diff,
        "rows": rows,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
    }
    print(
        f"{'threads':>7} {'block baige':>12} {'HF eager':>9} {'x':>5} {'HF grouped_mm':>14} {'GEMMs only':>11}"
        f" {'x max':>6} {'model baige':>12} {'HF eager':>9} {'x':>5} {'load':>5}   (tokens/s, best of {args.repeats})"
    )
    for r in rows:
        b = r["tokens_per_s_best"]
        print(
            f"{r['threads']:>7} {b['block_baige']:>12.0f} {b['block_hf_eager']:>9.0f} {r['block_speedup']:>5.2f}"
            f" {b['block_hf_grouped_mm']:>14.0f} {b['block_gemm_only']:>11.0f} {r['block_speedup_bound']:>6.2f}"
            f" {b['model_baige']:>12.0f} {b['model_hf_eager']:>9.0f} {r['model_speedup']:>5.2f}"
            f" {r['load_1min_before']:>5.2f}"
        )
    print(f"max |block difference| = {diff:.2e}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
