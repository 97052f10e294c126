"""Multi-LoRA serving overhead on the embedded model: decode tokens/s of one batch of 16 sequences
spread over 4 adapters against the same batch on the base model alone.

Adapters: rank 8 on all 7 projections of every layer, random (``init_lora_weights=False``: B is not
zero, so the adapters change the outputs), made with peft's ``get_peft_model`` + ``save_pretrained``
once into ``--adapter-dir``. One ``LLM(enable_lora=True, max_loras=4, max_num_seqs=16)``; 16 chat
prompts, greedy, ``--max-tokens`` each (``ignore_eos``), all admitted in the first step.

Rows (interleaved, the fastest of ``--repeats`` kept, so a busy machine slows them alike):

- ``base``: every sequence on the base model (decode steps take the native CPU decode step);
- ``base, per-op path``: the same with the native step off (what a LoRA step runs);
- ``4 adapters``: sequence i on adapter i % 4 (decode steps in the native step with the stacks);
- ``4 adapters, per-op path``: the same through the module hooks (``kernels.lora_apply``).

Decode tokens/s = sum over sequences of (output tokens - 1) / (last finish - last first token).

    .venv/bin/python scripts/bench_lora.py --threads 1 --out bench-results/lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path

import torch

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines work.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
    "Give some advice to a new programmer.",
    "Why do leaves change colour in autumn?",
    "How does a bicycle stay upright?",
    "What is the capital of France?",
]
N_ADAPTERS, N_SEQS = 4, 16


def make_adapters(model_dir: Path, out: Path) -> list[Path]:
    """Four random rank-8 PEFT adapters of the model on all seven projections (made once)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = [out / f"adapter{i}" for i in range(N_ADAPTERS)]
    for i, d in enumerate(dirs):
        if (d / "adapter_config.json").is_file():
            continue
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        pm = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
        for name, p in pm.named_parameters():  # peft's random init is large; keep the outputs sane
            if "lora_B" in name:
                p.data.mul_(0.01)
        pm.save_pretrained(d)
    return dirs


def run(llm, prompts, params, loras) -> dict:
    outs = llm.generate(prompts, params, lora_request=loras)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    window = max(o.finished_time for o in outs) - max(o.first_token_time for o in outs)
    return {
        "decode_tokens": tokens,
        "decode_s": window,
        "decode_tokens_per_s": tokens / window,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapter-dir", type=Path, default=Path("bench-results/lora-adapters"))
    ap.add_argument("--out", type=Path, default=Path("bench-results/lora.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from baige import LLM, LoRARequest, SamplingParams
    from baige.runtime.weights.hub import resolve_model

    model_dir = resolve_model("smollm2-135m-instruct")
    adapters = make_adapters(model_dir, args.adapter_dir)
    llm = LLM(
        str(model_dir),
        enable_lora=True,
        max_loras=N_ADAPTERS,
        max_num_seqs=N_SEQS,
        max_model_len=512,
        kv_cache_memory="256MB",
    )
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(N_SEQS)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spread = [
        LoRARequest(f"adapter{i % N_ADAPTERS}", 1 + i % N_ADAPTERS, str(adapters[i % N_ADAPTERS]))
        for i in range(N_SEQS)
    ]
    run(llm, prompts[:2], params, spread[:2])  # warm-up (loads the adapters, builds the native table with them)
    native = llm.engine.runner.fused_decode
    rows = {
        "base": (None, native),
        "base, per-op path": (None, None),
        "4 adapters": (spread, native),
        "4 adapters, per-op path": (spread, None),
    }
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, (loras, fused) in rows.items():
            llm.engine.runner.fused_decode = fused
            r = run(llm, prompts, params, loras)
            if name not in best or r["decode_tokens_per_s"] > best[name]["decode_tokens_per_s"]:
                best[name] = r
    llm.engine.runner.fused_decode = native
    base = best["base"]["decode_tokens_per_s"]
    flags = (
        sorted(set(re.findall(r"\bavx\w*", Path("/proc/cpuinfo").read_text())))
        if os.path.exists("/proc/cpuinfo")
        else []
    )
    report = {
        "model": "smollm2-135m-instruct",
        "num_seqs": N_SEQS,
        "num_adapters": N_ADAPTERS,
        "lora_rank": 8,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "load_average": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "adapters_change_outputs": best["4 adapters"]["token_ids"] != best["base"]["token_ids"],
        "native_tokens_equal_per_op": best["4 adapters"]["token_ids"] == best["4 adapters, per-op path"]["token_ids"],
        "rows": {k: {f: v[f] for f in ("decode_tokens", "decode_s", "decode_tokens_per_s")} for k, v in best.items()},
        "overhead_vs_base": 1 - best["4 adapters"]["decode_tokens_per_s"] / base,
    }
    print(f"{'row':<24} {'decode tok/s':>12}")
    for k, v in report["rows"].items():
        print(f"{k:<24} {v['decode_tokens_per_s']:>12.1f}")
    print(
        f"overhead of 4 adapters vs base: {100 * report['overhead_vs_base']:.1f}% "
        f"(threads {report['threads']}, load average {report['load_average'][0]:.2f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
