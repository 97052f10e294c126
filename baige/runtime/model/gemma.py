"""The Gemma 2 / Gemma 3 (text) decoder parts, with transformers' parameter names (``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``) so checkpoints load and save without renaming.

What differs from the Llama family (transformers' modeling_gemma2.py / modeling_gemma3.py):

- RMSNorm scales by ``1 + weight`` (the stored weight is the offset from one) and computes in fp32
  before casting back (:class:`GemmaRMSNorm`); Gemma 3's per-head q/k norms are this norm too.
- the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype first
  (:class:`ScaledEmbedding`).
- four norms per layer: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` -> residual
  add, ``pre_feedforward_layernorm`` -> MLP -> ``post_feedforward_layernorm`` -> residual add.
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` (Shazeer 2020, arXiv:2002.05202).
- the softmax scale is ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps the attention scores and
  both may soft-cap the final logits (``c * tanh(x / c)``).
- ``layer_types`` alternate sliding-window and full attention; Gemma 3's sliding layers use their own
  RoPE base (:class:`~baige.runtime.model.rope.LayerKindRotaryEmbedding`: the model's cos/sin tables
  are the full layers' and the sliding layers' side by side, and each layer takes its half).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baige import kernels
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.config_gemma import softmax_scale
from baige.runtime.model.linear import project


class GemmaRMSNorm(nn.Module):
    """``y = x / sqrt(mean(x**2, -1) + eps) * (1 + weight)`` in fp32, cast back to x's dtype
    (transformers' ``Gemma3RMSNorm``; ``weight`` starts at zero).

    Forward: x (..., dim) any float dtype -> (..., dim) in x's dtype.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`GemmaRMSNorm`'s math: x (..., dim) any float dtype, weight (dim,) the offset from one ->
    (..., dim) in x's dtype."""
    return kernels.rms_norm(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` times ``sqrt(hidden_size)``, the scale rounded to the weight's dtype first, as
    transformers' ``Gemma3TextScaledWordEmbedding`` does (so a bf16 model multiplies by bf16(sqrt(h))).

    Forward: ids (...) int64 -> (..., hidden) in the weight's dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = embedding_dim**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scale_rows(super().forward(input_ids))

    def scale_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Looked-up rows (..., hidden) times the scale (for a replaced lookup, e.g. the trainer's tied one)."""
        w = self.weight
        scale = torch.tensor(self.embed_scale, dtype=torch.float32, device=w.device).to(w.dtype)  # () 0-dim
        return rows * scale


class GeGLU(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` with HF's parameter names (``gelu_pytorch_tanh``)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., hidden) -> (..., hidden)."""
        gate = F.gelu(project(self.gate_proj, x), approximate="tanh")
        return project(self.down_proj, gate * project(self.up_proj, x))


class GemmaDecoderLayer(nn.Module):
    """One Gemma block: the shared ``Attention`` (Gemma's norms, scale and soft-cap set on it) and a
    GeGLU MLP between four :class:`GemmaRMSNorm` s (see the module docstring).

    ``forward(x, cos, sin, attn_metadata, router_logits=None)`` as the Llama block's: x (B, T, hidden);
    cos, sin (B, T, head_dim), or (B, T, 2 * head_dim) holding the full layers' tables then the sliding
    layers' (Gemma 3's two RoPE bases); ``router_logits`` is unused (no sparse MLP).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention: nn.Module):
        super().__init__()
        g, h, eps = cfg.gemma, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = attention
        attention.scale = softmax_scale(g)
        attention.softcap = g.attn_logit_softcapping
        if cfg.qk_norm:
            attention.q_norm, attention.k_norm = GemmaRMSNorm(cfg.head_dim, eps), GemmaRMSNorm(cfg.head_dim, eps)
        self.mlp = GeGLU(h, cfg.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        # which half of a two-base rope table this layer reads (None: the table has one base)
        self.rope_half = None
        if g.local_rope_theta is not None:
            self.rope_half = 1 if cfg.layer_window(layer_idx) is not None else 0

    def forward(self, x, cos, sin, attn_metadata, router_logits: list | None = None) -> torch.Tensor:
        if self.rope_half is not None:
            d = cos.shape[-1] // 2
            at = slice(self.rope_half * d, (self.rope_half + 1) * d)
            cos, sin = cos[..., at], sin[..., at]  # (B, T, head_dim) each
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def decoder_parts(cfg: ModelConfig, attention: Callable[[ModelConfig, int], nn.Module]):
    """``(embed_tokens, layers, norm)`` of a Gemma decoder; ``attention(cfg, i)`` builds layer i's
    attention module (the one :class:`~baige.runtime.model.transformer.Attention`)."""
    layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, attention(cfg, i)) for i in range(cfg.num_hidden_layers))
    return ScaledEmbedding(cfg.vocab_size, cfg.hidden_size), layers, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's logit soft-capping), in the logits' dtype."""
    return torch.tanh(logits / cap) * cap


def lm_head_cross_entropy(
    cfg: ModelConfig,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed token cross-entropy of ``lm_head(hidden)`` / ``normalizer``, as the trainer takes it:
    :func:`baige.kernels.fused_linear_cross_entropy` (no logits materialised), or, when the config
    soft-caps the final logits (Gemma's ``final_logit_softcapping``), the capped logits materialised in
    fp32 and ``F.cross_entropy`` over them (the fused kernel has no cap).

    Args:
        hidden: (..., hidden); weight: (vocab, hidden), any float dtype (the capped path casts it to
            ``hidden``'s; the fused kernel takes an fp32 weight under bf16 hidden as it is).
        labels: (...) int64 next-token ids, -100 where no loss is taken.
        normalizer: as :func:`baige.kernels.fused_linear_cross_entropy` (None: the number of valid labels).
    Returns:
        () fp32 loss in nats per token.
    """
    cap = cfg.gemma.final_logit_softcapping if cfg.gemma is not None else None
    if cap is None:
        return kernels.fused_linear_cross_entropy(hidden, weight, labels, normalizer=normalizer)
    logits = softcap(F.linear(hidden, weight.to(hidden.dtype)).float(), cap)  # (..., vocab) fp32
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=-100, reduction="sum")
    return total / (normalizer if normalizer is not None else (flat != -100).sum())
