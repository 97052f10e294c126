"""Tiny gpt_oss checkpoints written by transformers (tests/tiny.py's initialisation), shared by the
model-family tests (tests/model/test_gpt_oss.py) and the quantizer's (tests/quant/test_quant_gpt_oss.py):
hidden 72, 3 layers (sliding, full, sliding) with a 5-token window, four sink values per head, biased
router and experts with the clamped SwiGLU (limit 3), YaRN RoPE; and the same model with its experts
stored as published MXFP4 blocks / scales."""

import json

import torch
from tiny import make_checkpoint

SPEC = dict(
    model_type="gpt_oss",
    hidden_size=72,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=18,
    num_local_experts=5,
    num_experts_per_tok=2,
    sliding_window=5,
    swiglu_limit=3.0,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=8.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    ),
)
SINKS = torch.tensor([-2.0, 0.0, 1.5, 4.0])  # per head; layer i adds 0.5 * i


def write_gpt_oss(path, seed=0, **overrides):
    """A tiny gpt_oss checkpoint (tests/tiny.py's initialisation), its sinks set to :data:`SINKS`."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(path, "llama", seed=seed, **{**SPEC, **overrides})
    state = load_file(str(path / "model.safetensors"))
    for i in range(SPEC["num_hidden_layers"]):
        state[f"model.layers.{i}.self_attn.sinks"] = SINKS + 0.5 * i
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def mxfp4_checkpoint(path):
    """A gpt_oss checkpoint (hidden 96, experts 64 wide: multiples of the 32-element block) whose
    experts are stored as published: ``*_blocks`` of random E2M1 codes, ``*_scales`` of exponents
    2 ** -6 .. 2 ** -3, and ``quantization_config: {quant_method: mxfp4}``."""
    from safetensors.torch import load_file, save_file

    write_gpt_oss(path, hidden_size=96, intermediate_size=64, head_dim=24)
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for i in range(SPEC["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        for name, rows, k in (("gate_up_proj", 128, 96), ("down_proj", 96, 64)):
            del state[p + name]
            state[f"{p}{name}_blocks"] = torch.randint(0, 256, (5, rows, k // 32, 16), generator=g, dtype=torch.uint8)
            state[f"{p}{name}_scales"] = torch.randint(121, 125, (5, rows, k // 32), generator=g, dtype=torch.uint8)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path
