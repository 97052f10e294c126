"""Tiny random DeepSeek-V2 / V3 checkpoints (Multi-head Latent Attention, group-limited routing)
written with transformers: the parity oracle for ``baige/runtime/model/mla.py``.

Odd shapes throughout: hidden 56 (not a power of two), three heads, head widths that differ
(qk 16 vs v 12; qk 10 vs v 14), q LoRA on and off, dense-then-MoE layers, YaRN with mscale.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import write_random_checkpoint

BASE = dict(
    vocab_size=160,
    hidden_size=56,
    intermediate_size=88,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

MLA_VARIANTS = {
    # q LoRA, interleaved RoPE, YaRN (mscale in the softmax scale), 8 experts in 4 groups of which
    # 2 are kept, sigmoid scores with the correction bias, one dense layer first
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_nope_head_dim=10,
        qk_rope_head_dim=6,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=0.707,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    # no q LoRA, half-split RoPE, v wider than qk, biases on the projections that have them,
    # no renormalization, two dense layers
    "deepseek-v3-no-q-lora": dict(
        model_type="deepseek_v3",
        q_lora_rank=None,
        kv_lora_rank=18,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=14,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_group=3,
        topk_group=1,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        first_k_dense_replace=2,
        rope_interleave=False,
        attention_bias=True,
        max_position_embeddings=256,
    ),
    # V2: softmax scores, group-limited greedy (group score = best expert), no bias
    "deepseek-v2": dict(
        model_type="deepseek_v2",
        num_attention_heads=4,  # transformers' V2 config wants hidden_size divisible by the heads
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=22,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_group=3,
        topk_group=1,
        topk_method="group_limited_greedy",
        n_shared_experts=2,
        routed_scaling_factor=1.25,
        first_k_dense_replace=1,
        max_position_embeddings=256,
    ),
}


def make_mla_checkpoint(path: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """Write a random tiny checkpoint of ``variant`` with transformers; returns the directory.

    Weights N(0, 0.1) (the routers N(0, 0.5), so scores spread), biases N(0, 0.5), norms
    U(0.5, 1.5), V3's ``e_score_correction_bias`` N(0, 0.1) (it changes which experts win)."""

    def init(name: str, p: torch.Tensor, model_type: str) -> None:
        if name.endswith("e_score_correction_bias"):
            p.normal_(0.0, 0.1)
        elif not p.is_floating_point() or "inv_freq" in name:
            return
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.5)
        elif "norm" in name:
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0.0, 0.1)

    return write_random_checkpoint(path, {**BASE, **MLA_VARIANTS[variant], **overrides}, seed, init, buffers=True)
