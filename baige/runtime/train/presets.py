"""Architectures for training from scratch: the presets, their seeded init and the :class:`ModelConfig`
built from a preset name or a config.json (``model.config``)."""

from __future__ import annotations

from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.gemma import GemmaRMSNorm
from baige.runtime.model.transformer import Transformer

# Architectures for training from scratch (vocab_size comes from the tokenizer).
PRESETS: dict[str, dict] = {
    "debug": dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # A small Qwen3-MoE: 4 sparse layers of 8 experts, top-2 (~0.2M active of 0.5M non-embedding params)
    "moe-tiny": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.01,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
}


def init_weights(model: Transformer, std: float) -> None:
    """Seeded init from the current RNG: Linear/Embedding weights ~ N(0, std), biases 0, norms 1 (HF Llama);
    Gemma's norms, which scale by ``1 + weight``, 0 (HF Gemma)."""
    offset = {id(m.weight) for m in model.modules() if isinstance(m, GemmaRMSNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(0.0 if id(p) in offset else 1.0)
            else:
                p.normal_(0.0, std)


def scratch_config(spec: str, vocab_size: int, bos: int | None, eos: list[int]) -> ModelConfig:
    """A :class:`ModelConfig` from a config.json path or a preset name (vocab from the tokenizer)."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_file(path)
    if spec not in PRESETS:
        raise BaigeError(f"model.config {spec!r} is neither a config.json nor a preset ({', '.join(PRESETS)})")
    raw = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab_size,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=bos,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
    )
    raw.update(PRESETS[spec])
    return ModelConfig.from_dict(raw)
