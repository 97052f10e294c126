"""The 2026 architectures (issue 47) on random mid-size checkpoints written by transformers:

- ``mla``: a deepseek_v3-shaped model (DeepSeek-V3's attention widths: kv_lora_rank 512, rope 64,
  nope 128, v 128, 16 heads) decoding at batch 1 after prompts of ``--contexts`` tokens, through the
  latent cache (absorbed decode) and through the same model's MHA-sized cache
  (``baige.runtime.model.mla.use_expanded_cache``: per-head K and V, not absorbed): decode tokens/s
  (1 / median step time), the cache's bytes per token, and the tokens one ``--kv-cache-memory`` budget
  admits in each mode.
- ``window``: gemma3_text (5 sliding : 1 full) and gpt_oss (1 : 1) models with a 128-token window
  generating 4x the window for two sequences at once; the blocks and bytes the sliding and the full
  layers hold per step (peak and a trace) against the bound ``ceil(window / block) + 1`` blocks per
  sequence and against what a cache without the window would hold (every layer, every block).
- ``quant``: deepseek_v3, gpt_oss, gemma3_text and ernie4_5 models in fp32, int8 and int4 (RTN,
  group 128; ``baige quantize``): batch-1 decode tokens/s through the Engine and the logits' distance
  from fp32 on a wikitext-2 window (mean |logit diff|, top-1 agreement, perplexity).

Weights are transformers' default random initialisation (normal, std ``initializer_range``); the
tokenizer is the embedded SmolLM2's (its 49152 ids are the models' vocabulary). Every part writes
``<out>/arch_<part>-<timestamp>.json`` (``bench.common.write_result``: the environment with the load
average; the machine may be shared) and prints its summary.

    (echo -20 > /proc/self/autogroup; nice -n -20 .venv/bin/python scripts/bench_arch.py mla)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from baige.runtime.bench.common import environment, write_result
from baige.runtime.config import EngineConfig, QuantizeConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model

VOCAB = 49152  # the embedded SmolLM2 tokenizer's
BLOCK = 16
COMMON = dict(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-6)
SHAPES = {
    # DeepSeek-V3's attention widths; two dense layers, then 8 routed experts (top 2) and a shared one
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=2,
        rope_interleave=True,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
        rope_parameters=dict(rope_type="default", rope_theta=150000.0),
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        sliding_window=128,
        query_pre_attn_scalar=128,
    ),
    "ernie4_5": dict(
        model_type="ernie4_5",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
    ),
}


def write_checkpoint(root: Path, family: str) -> Path:
    """A random ``family`` checkpoint of :data:`SHAPES` (seed 0) with the embedded tokenizer; its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    spec = {**COMMON, **SHAPES[family]}
    model_type = spec.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec), dtype=torch.float32)
    model.save_pretrained(path)
    embedded = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, path / name)
    del model
    return path


def engine_for(model, path: Path, max_model_len: int, kv_bytes: int, max_num_seqs: int = 1) -> Engine:
    cfg = EngineConfig(
        max_model_len=max_model_len,
        kv_cache_memory=kv_bytes,
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    return Engine(model, Tokenizer.from_dir(path), cfg)


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(32, VOCAB, (n,), generator=g).tolist()


def timed_decode(eng: Engine, prompt: list[int], n_decode: int, rid: str) -> dict:
    """One request of ``prompt`` then ``n_decode`` + 1 tokens (greedy): the prefill's seconds (add to
    first token) and every later step's (each one decode token at batch 1)."""
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n_decode + 1, ignore_eos=True))
    start, first, steps = time.perf_counter(), None, []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        if first is not None:
            steps.append(t1 - t0)
        elif any(len(o.outputs[0].token_ids) for o in outs):
            first = t1 - start
    return {"prefill_s": first, "decode_step_s": steps, "decode_tokens_per_s": 1 / statistics.median(steps)}


def mla_part(root: Path, args) -> dict:
    from baige.runtime import roofline
    from baige.runtime.model.mla import use_expanded_cache

    path = write_checkpoint(root, "deepseek_v3")
    contexts = [int(c) for c in args.contexts.split(",")]
    budget = args.kv_cache_memory
    modes = {}
    for mode in ("latent", "expanded"):
        model = load_model(path, dtype="float32")
        if mode == "expanded":
            use_expanded_cache(model)
        cfg = model.config
        eng = engine_for(model, path, max(contexts) + args.decode_tokens + 2 * BLOCK, budget)
        timed_decode(eng, random_ids(64, 99), 8, f"{mode}-warmup")  # first-touch of weights and pools, untimed
        runs = {}
        weights = roofline.step_weight_bytes(roofline.model_counts(model), 1)  # batch 1: top-k experts a layer
        for i, ctx in enumerate(contexts):
            runs[str(ctx)] = run = timed_decode(eng, random_ids(ctx, i), args.decode_tokens, f"{mode}{ctx}")
            kv_read = cfg.kv_bytes_per_token(4) * ctx
            run["kv_bytes_read_per_step"] = kv_read
            run["decode_bytes_per_step"] = weights + kv_read  # the decode roofline's count
            print(mode, ctx, f"{run['decode_tokens_per_s']:.2f} tok/s", flush=True)
        modes[mode] = {
            "kv_bytes_per_token": cfg.kv_bytes_per_token(4),
            "kv_bytes_per_token_per_layer": cfg.kv_bytes_per_token(4) // cfg.num_hidden_layers,
            "pool_shape_per_layer": list(eng.kv_cache.k[0].shape),
            "pools_per_layer": 1 if eng.kv_cache.v[0] is eng.kv_cache.k[0] else 2,
            "admitted_tokens": eng.kv_cache.num_blocks * BLOCK,
            "contexts": runs,
        }
        eng.close()
        del eng, model
    m = load_model(path, dtype="float32").config
    mha = m.num_hidden_layers * m.num_attention_heads * (m.mla.qk_head_dim + m.mla.v_head_dim) * 4
    summary = {
        "latent_kv_bytes_per_token": modes["latent"]["kv_bytes_per_token"],
        "expanded_kv_bytes_per_token": modes["expanded"]["kv_bytes_per_token"],
        "mha_formula_kv_bytes_per_token": mha,  # n_heads x (qk_nope + qk_rope + v) per layer, unpadded
        "mha_formula_admitted_tokens": budget // (BLOCK * mha) * BLOCK,
        "latent_admitted_tokens": modes["latent"]["admitted_tokens"],
        "expanded_admitted_tokens": modes["expanded"]["admitted_tokens"],
        **{
            f"{mode}_decode_tokens_per_s_at_{ctx}": round(modes[mode]["contexts"][str(ctx)]["decode_tokens_per_s"], 3)
            for mode in modes
            for ctx in contexts
        },
    }
    return {
        "model": {"family": "deepseek_v3", **COMMON, **SHAPES["deepseek_v3"], "num_params": m.num_params()},
        "args": {
            "contexts": contexts,
            "decode_tokens": args.decode_tokens,
            "kv_cache_memory": budget,
            "dtype": "float32",
        },
        "modes": modes,
        "summary": summary,
    }


def window_trace(eng: Engine, prompts: list[list[int]], n_out: int) -> dict:
    """Step two sequences to ``n_out`` tokens each; per step the most sliding / full blocks one
    sequence holds and both pools' used blocks."""
    bm = eng.block_manager
    for i, p in enumerate(prompts):
        eng.add_request(f"s{i}", p, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    trace = []
    while eng.has_unfinished():
        eng.step()
        seqs = list(eng.scheduler.running)
        if not seqs:
            continue
        trace.append(
            {
                "context": max(s.num_computed_tokens for s in seqs),
                "sliding_blocks_per_seq": max(bm.sliding.held(s) for s in seqs),
                "full_blocks_per_seq": max(len(s.block_table) for s in seqs),
                "sliding_pool_used": bm.sliding.pool.num_used_blocks,
                "full_pool_used": bm.num_used_blocks,
                "no_window_blocks": sum(len(s.block_table) for s in seqs),
            }
        )
    return trace


def window_part(root: Path, args) -> dict:
    out = {}
    for family in ("gemma3_text", "gpt_oss"):
        path = write_checkpoint(root, family)
        model = load_model(path, dtype="float32")
        cfg = model.config
        w = cfg.sliding_window
        n_out = 4 * w  # generate 4x the window
        prompt_len = 64
        eng = engine_for(model, path, prompt_len + n_out + BLOCK, args.kv_cache_memory, max_num_seqs=2)
        trace = window_trace(eng, [random_ids(prompt_len, 10), random_ids(prompt_len, 11)], n_out)
        n_sliding = len(eng.kv_cache.sliding_layers)
        layer_bytes = cfg.kv_bytes_per_token(4) // cfg.num_hidden_layers * BLOCK  # one block of one layer
        decoding = [t for t in trace if t["context"] >= prompt_len]
        peak = {k: max(t[k] for t in decoding) for k in decoding[0] if k != "context"}
        out[family] = {
            "window": w,
            "block_size": BLOCK,
            "layers": {"sliding": n_sliding, "full": cfg.num_hidden_layers - n_sliding},
            "prompt_len": prompt_len,
            "output_len": n_out,
            "sequences": 2,
            "bound_sliding_blocks_per_seq": -(-w // BLOCK) + 1,
            "peak": peak,
            "peak_bytes": {
                "sliding_layers": peak["sliding_pool_used"] * layer_bytes * n_sliding,
                "full_layers": peak["full_pool_used"] * layer_bytes * (cfg.num_hidden_layers - n_sliding),
                "no_window_cache": peak["no_window_blocks"] * layer_bytes * cfg.num_hidden_layers,
            },
            "trace": trace[:: max(1, len(trace) // 64)],
        }
        print(family, json.dumps(out[family]["peak"]), json.dumps(out[family]["peak_bytes"]), flush=True)
        eng.close()
        del eng, model
    return {"args": {"kv_cache_memory": args.kv_cache_memory, "dtype": "float32"}, "families": out}


def text_window(path: Path, n: int) -> torch.Tensor:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import data_files

    text = (data_files.data_dir() / "wikitext-2-raw-test.txt").read_text()[:20000]
    ids = Tokenizer.from_dir(path).encode(text)[:n]
    return torch.tensor([ids])


@torch.inference_mode()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None]
    return model.compute_logits(model(ids, positions)).float()[0]  # (T, V)


def quality(logits: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict:
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    return {
        "mean_abs_logit_diff": (logits - ref).abs().mean().item(),
        "max_abs_logit_diff": (logits - ref).abs().max().item(),
        "top1_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "perplexity": math.exp(nll.item()),
    }


def quant_family(root: Path, family: str, args) -> dict:
    from baige.errors import BaigeError
    from baige.runtime.quantize import quantize_checkpoint

    path = write_checkpoint(root, family)
    ids = text_window(path, args.text_tokens)
    rows, ref = {}, None
    for variant in ("fp32", "int8", "int4"):
        src = path
        if variant != "fp32":
            src = root / f"{family}-{variant}"
            try:
                quantize_checkpoint(QuantizeConfig(model=str(path), method=variant, group_size=128, output=str(src)))
            except BaigeError as e:
                rows[variant] = {"refused": str(e)}
                print(family, variant, "refused:", e, flush=True)
                continue
        model = load_model(src, dtype="float32")
        logits = logits_of(model, ids)
        ref = logits if ref is None else ref
        row = quality(logits, ref, ids)
        row["logit_std_fp32"] = ref.std().item()
        eng = engine_for(model, src, args.quant_prompt + args.decode_tokens + 2 * BLOCK, 256 << 20)
        timed_decode(eng, random_ids(32, 99), 8, f"{family}-{variant}-warmup")  # untimed
        run = timed_decode(eng, random_ids(args.quant_prompt, 3), args.decode_tokens, f"{family}-{variant}")
        row.update(run)
        from baige.runtime import roofline

        row["weight_bytes"] = roofline.weight_bytes(model)
        rows[variant] = row
        print(family, variant, f"{run['decode_tokens_per_s']:.2f} tok/s", f"|dlogit| {row['mean_abs_logit_diff']:.3g}")
        eng.close()
        del eng, model
    return {"model": {**COMMON, **SHAPES[family]}, "variants": rows}


def quant_part(root: Path, args) -> dict:
    families = args.families.split(",")
    out = {f: quant_family(root, f, args) for f in families}
    return {
        "args": {
            "text_tokens": args.text_tokens,
            "prompt_len": args.quant_prompt,
            "decode_tokens": args.decode_tokens,
            "group_size": 128,
            "method": "rtn",
            "dtype": "float32",
            "text": "wikitext-2-raw-test.txt (first 20000 characters)",
        },
        "families": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["mla", "window", "quant"])
    ap.add_argument("--contexts", default="512,2048,4096", help="mla: prompt lengths (tokens)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes (mla, window)")
    ap.add_argument("--families", default="deepseek_v3,gpt_oss,gemma3_text,ernie4_5", help="quant")
    ap.add_argument("--text-tokens", type=int, default=256, help="quant: wikitext tokens scored")
    ap.add_argument("--quant-prompt", type=int, default=128, help="quant: prompt before the timed decode")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a shared machine's other work cannot stall a second one)",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/records"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        result = {"mla": mla_part, "window": window_part, "quant": quant_part}[args.part](Path(tmp), args)
    env = environment()
    notes = (
        f"load average {load_before} before, {env['load_average']} after, on {env['cpu_count']} CPUs shared with "
        f"other work: timings are noisy; CPU flags {' '.join(env['cpu_flags'])}; random weights (transformers' "
        "initialisation), fp32"
    )
    record = {"benchmark": f"arch_{args.part}", **result, "environment": env, "notes": notes}
    path = write_result(args.out, f"arch_{args.part}", record)
    print(json.dumps(result.get("summary", {}), indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
