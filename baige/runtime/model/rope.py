"""Rotary-embedding frequencies for every rope type the Llama family uses.

Formulas follow the references their configs come from: linear position interpolation (Chen et
al. 2023, arXiv:2306.15595), dynamic NTK scaling (bloc97/emozilla, as in HF transformers),
Llama 3.1's frequency-dependent scaling (Meta's llama-models reference code) and YaRN (Peng et
al. 2023, arXiv:2309.00071) including its attention factor.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from baige import kernels
from baige.runtime.model.config import ModelConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (dim/2,)


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") for ``cfg``'s rope type.

    Args:
        cfg: model config; ``cfg.rope_scaling`` selects the rope type.
        seq_len: current sequence length; only the ``dynamic`` type uses it.
    Returns:
        ``(inv_freq, attention_scaling)``: fp32 tensor (head_dim/2,) and a float multiplier of cos/sin.
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    rs = cfg.rope_scaling or {"rope_type": "default"}
    kind = rs["rope_type"]
    if kind == "default":
        return _base_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(base, dim) / float(rs["factor"]), 1.0
    if kind == "dynamic":
        max_pos = cfg.max_position_embeddings
        factor = float(rs["factor"])
        n = max(seq_len or max_pos, max_pos)
        base = base * ((factor * n / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv = _base_inv_freq(base, dim)
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        orig = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
        factor = rs.get("factor") or cfg.max_position_embeddings / orig

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = rs.get("attention_factor")
        if attn is None:
            m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
        beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

        def corr_dim(n_rot: float) -> float:
            return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp  # 1 keeps the original frequency, 0 interpolates fully
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
        return inv, float(attn)
    raise ValueError(f"unhandled rope type {kind}")  # ModelConfig already validated it


class RotaryEmbedding(torch.nn.Module):
    """Computes ``cos``/``sin`` for arbitrary absolute positions.

    Forward: positions (...,) int64 -> cos, sin each (..., head_dim) in ``dtype``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.dynamic = (cfg.rope_scaling or {}).get("rope_type") == "dynamic"
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.dynamic:
            seq_len = int(positions.max()) + 1
            if seq_len > self.cfg.max_position_embeddings:
                inv_freq = rope_inv_freq(self.cfg, seq_len)[0].to(positions.device)
        freqs = positions.float()[..., None] * inv_freq.float()  # (..., head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., head_dim)
        if kernels.batch_invariant_enabled():  # each position's values whatever the tensor it sits in
            cos, sin = (
                kernels.batch_invariant_pointwise(torch.cos, emb),
                kernels.batch_invariant_pointwise(torch.sin, emb),
            )
        else:
            cos, sin = emb.cos(), emb.sin()
        return (cos * self.attention_scaling).to(dtype), (sin * self.attention_scaling).to(dtype)


class LayerKindRotaryEmbedding(torch.nn.Module):
    """Two RoPE bases for two kinds of layer (Gemma 3: ``rope_theta`` / ``rope_scaling`` for the full
    layers, ``rope_local_base_freq`` for the sliding ones): the full layers' and the sliding layers'
    tables side by side, each layer reading its half.

    Forward: positions (...,) int64 -> cos, sin each (..., 2 * head_dim) in ``dtype``: ``[..., :head_dim]``
    the full layers', ``[..., head_dim:]`` the sliding layers'.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        g = cfg.gemma
        local = dataclasses.replace(cfg, rope_theta=g.local_rope_theta, rope_scaling=g.local_rope_scaling)
        self.full, self.local = RotaryEmbedding(cfg), RotaryEmbedding(local)
        self.dynamic = self.full.dynamic or self.local.dynamic

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        (cos_f, sin_f), (cos_l, sin_l) = self.full(positions, dtype), self.local(positions, dtype)
        return torch.cat((cos_f, cos_l), dim=-1), torch.cat((sin_f, sin_l), dim=-1)


def rotary_embedding(cfg: ModelConfig) -> torch.nn.Module:
    """The model's rotary module: :class:`LayerKindRotaryEmbedding` when the sliding layers have their own
    base (Gemma 3), else :class:`RotaryEmbedding`."""
    if cfg.gemma is not None and cfg.gemma.local_rope_theta is not None:
        return LayerKindRotaryEmbedding(cfg)
    return RotaryEmbedding(cfg)
