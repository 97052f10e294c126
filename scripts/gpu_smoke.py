"""End-to-end smoke test of the Triton kernels inside the engine and the training step (run by
scripts/gpu_check.sh on a CUDA machine; runs on CPU too, under TRITON_INTERPRET=1, for checking the
script itself).

Needs no download and no GGUF: a random Llama with SmolLM2-135M's layer shapes (hidden 576, 9 / 3
heads of 64; 4 layers, vocab 512) is written with transformers, with a word-level tokenizer; and
the same with Qwen3-MoE sparse layers (8 experts, top-2, expert width 384) for the fused-MoE path.

1. Engine: greedy 24 tokens for 6 token-id prompts, Triton kernels with decode capture (the
   default on CUDA; the fp32 run also sizes its KV cache the default way, after a warm-up step) vs
   ``BAIGE_KERNELS=reference`` with ``--enforce-eager``; fp32 must agree token for token, bf16
   agreement is reported.
2. Training step: loss (fused linear cross-entropy) and gradient norms of one forward + backward on
   the Triton kernels vs the reference kernels, fp32.

Prints one line per check and exits 1 when an fp32 check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def write_checkpoint(path: Path, moe: bool = False) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(
        vocab_size=512,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=1,
    )
    if moe:
        cfg = AutoConfig.for_model(
            "qwen3_moe",
            **shape,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=384,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        )
    else:
        cfg = AutoConfig.for_model("llama", **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    vocab = {"<eos>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": "<bos>"}))
    return path


def engine_tokens(model_dir: Path, dtype: str, kernels: str, eager: bool, default_kv: bool = False) -> list[list[int]]:
    """Greedy tokens of 6 prompts. ``default_kv``: size the KV cache the default way (warm-up step,
    a fraction of free memory) instead of a fixed 256 MB."""
    import gc

    from baige import LLM, SamplingParams

    os.environ["BAIGE_KERNELS"] = kernels
    llm = LLM(
        str(model_dir),
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=256,
        kv_cache_memory=None if default_kv else 256 << 20,
    )
    if default_kv:
        kv = llm.engine.kv_cache
        print(f"default KV sizing after warm-up: {kv.num_blocks} blocks of {kv.block_size} tokens")
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (n,), generator=g).tolist()} for n in (3, 17, 40, 64, 5, 99)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def train_step(model_dir: Path, device: str, kernels: str) -> tuple[float, list[float]]:
    from baige.kernels import fused_linear_cross_entropy
    from baige.runtime.weights.loader import load_model

    os.environ["BAIGE_KERNELS"] = kernels
    model = load_model(model_dir, "float32", device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 512, (2, 97), generator=g).to(device)
    positions = torch.arange(96, device=device).expand(2, 96)
    hidden = model(ids[:, :-1], positions, None)
    loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, ids[:, 1:])
    loss.backward()
    norms = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
    return loss.item(), norms


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense", "moe"):
            model_dir = write_checkpoint(Path(tmp) / kind, moe=kind == "moe")
            failed |= check(model_dir, kind, device)
    return 1 if failed else 0


def check(model_dir: Path, kind: str, device: str) -> bool:
    """The engine and training-step comparisons for one checkpoint; True when an fp32 check failed."""
    failed = False
    for dtype in ("float32", "bfloat16") if device == "cuda" else ("float32",):
        ref = engine_tokens(model_dir, dtype, "reference", eager=True)
        out = engine_tokens(
            model_dir,
            dtype,
            "auto" if device == "cuda" else "triton",
            eager=False,
            default_kv=device == "cuda" and dtype == "float32",
        )
        same = sum(a == b for x, y in zip(out, ref) for a, b in zip(x, y))
        total = sum(len(x) for x in ref)
        ok = out == ref
        print(
            f"engine {kind} {dtype}: {same}/{total} greedy tokens equal (Triton + capture vs reference eager)"
            f"{'' if ok else ' -- DIFFERENT'}"
        )
        failed |= dtype == "float32" and not ok
    loss_r, norms_r = train_step(model_dir, device, "reference")
    loss_t, norms_t = train_step(model_dir, device, "auto" if device == "cuda" else "triton")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms_t, norms_r))
    ok = abs(loss_t - loss_r) <= 1e-4 * abs(loss_r) and worst <= 1e-3 and len(norms_t) == len(norms_r)
    print(
        f"train step {kind} fp32: loss {loss_t:.6f} vs reference {loss_r:.6f}; worst relative gradient-norm "
        f"difference {worst:.2e} over {len(norms_r)} parameters{'' if ok else ' -- DIFFERENT'}"
    )
    return failed or not ok


if __name__ == "__main__":
    sys.exit(main())
