"""End-to-end smoke test of the Triton kernels inside the engine and the training step (run by
scripts/gpu_check.sh on a CUDA machine; runs on CPU too, under TRITON_INTERPRET=1, for checking the
script itself).

Needs no download and no GGUF: a random Llama with SmolLM2-135M's layer shapes (hidden 576, 9 / 3
heads of 64; 4 layers, vocab 512) is written with transformers, with a word-level tokenizer; the
same with Qwen3-MoE sparse layers (8 experts, top-2, expert width 384) for the fused-MoE path; and
the attention variants on the Triton kernels: a gpt-oss (sliding window of 32 on alternate layers,
attention sinks of -2..3, biased MoE experts) and a Gemma 2 (sliding window of 32, attention scores
soft-capped at 2), their prompts longer than the window (the sliding layers' own block pool).

1. Engine: greedy 24 tokens for 6 token-id prompts, Triton kernels with decode capture (the
   default on CUDA; the fp32 run also sizes its KV cache the default way, after a warm-up step) vs
   ``BAIGE_KERNELS=reference`` with ``--enforce-eager``; fp32 must agree token for token, bf16
   agreement is reported (dense and MoE; the variant models run fp32 only).
2. Training step: loss (fused linear cross-entropy) and gradient norms of one forward + backward on
   the Triton kernels vs the reference kernels, fp32 (the sinks' gradients included).

Usage: ``python scripts/gpu_smoke.py [KIND ...]`` (KIND: dense, moe, gpt_oss, gemma2; all by default).
Prints one line per check and exits 1 when an fp32 check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

KINDS = ("dense", "moe", "gpt_oss", "gemma2")


def _variant_config(kind: str, shape: dict):
    """The gpt_oss / gemma2 configs (sliding window 32 on alternate layers; sinks or a score soft-cap)."""
    from transformers import AutoConfig

    shape = {**shape, "head_dim": 64, "sliding_window": 32}
    if kind == "gpt_oss":
        shape["intermediate_size"] = 384  # per expert
        return AutoConfig.for_model("gpt_oss", **shape, num_local_experts=4, num_experts_per_tok=2)
    return AutoConfig.for_model(
        "gemma2", **shape, query_pre_attn_scalar=64, attn_logit_softcapping=2.0, final_logit_softcapping=30.0
    )


def write_checkpoint(path: Path, kind: str = "dense") -> Path:
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
    if kind in ("gpt_oss", "gemma2"):
        cfg = _variant_config(kind, shape)
    elif kind == "moe":
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
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if kind == "gpt_oss":  # distinct sinks per head and layer, large enough to matter
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.data = torch.linspace(-2.0, 3.0, cfg.num_attention_heads) + 0.25 * i
    model.save_pretrained(path)
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
    from baige.runtime.settings import reload_settings

    os.environ["BAIGE_KERNELS"] = kernels
    reload_settings()  # settings are read once: without this every run keeps the first run's kernels
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
    from baige.runtime.settings import reload_settings
    from baige.runtime.weights.loader import load_model

    os.environ["BAIGE_KERNELS"] = kernels
    reload_settings()
    model = load_model(model_dir, "float32", device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 512, (2, 97), generator=g).to(device)
    positions = torch.arange(96, device=device).expand(2, 96)
    hidden = model(ids[:, :-1], positions, None)
    loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, ids[:, 1:])
    loss.backward()
    norms = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
    return loss.item(), norms


def main(kinds: list[str]) -> int:
    """Check each of ``kinds`` (names from :data:`KINDS`; all when empty); 1 when an fp32 check failed,
    2 for an unknown kind."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        print(f"gpu_smoke: unknown kind {bad[0]!r} (one of {', '.join(KINDS)})", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds or KINDS:
            model_dir = write_checkpoint(Path(tmp) / kind, kind)
            failed |= check(model_dir, kind, device)
    return 1 if failed else 0


def check(model_dir: Path, kind: str, device: str) -> bool:
    """The engine and training-step comparisons for one checkpoint; True when an fp32 check failed."""
    failed = False
    for dtype in ("float32", "bfloat16") if device == "cuda" and kind in ("dense", "moe") else ("float32",):
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
    sys.exit(main(sys.argv[1:]))
