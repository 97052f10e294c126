"""Tiny random HF checkpoints written with transformers: the parity oracle for the decoder."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama-llama3-rope": dict(
        model_type="llama",
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32),
    ),
    "llama-linear-rope": dict(model_type="llama", rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    "llama-yarn-rope": dict(
        model_type="llama",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    ),
    "mistral-head-dim": dict(model_type="mistral", head_dim=24, sliding_window=None),
    "qwen2-bias": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),
}


def make_checkpoint(path: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """Write a random tiny HF checkpoint of ``variant`` with transformers; returns the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**BASE, **VARIANTS[variant], **overrides}
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 2.0)  # large q/k/v biases (Qwen2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)  # non-unit norms (incl. Qwen3 q_norm/k_norm)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path
