"""One decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), used by training and serving.

Module and parameter names mirror HF transformers' ``LlamaForCausalLM`` so state dicts load and
save without renaming. ``forward`` returns hidden states; ``compute_logits`` applies ``lm_head`` so
callers project only the positions they need (the last ones when generating, none when the
trainer uses a fused linear + cross-entropy).

Attention metadata is passed explicitly: ``None`` means plain causal attention over the batch
(training, one-shot scoring); otherwise it is an object with
``attend(layer_idx, q, k, v, scale) -> out`` that owns the KV cache (the engine's paged
metadata in ``infer/runner.py``; ``tests/oracle_generate.py`` has a contiguous one).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from baige import kernels
from baige.runtime.model.config import ModelConfig, softmax_scale
from baige.runtime.model.rope import RotaryEmbedding


class AttentionMetadata(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: (B, T, n_heads, D); k, v: (B, T, n_kv_heads, D) for the new tokens -> (B, T, n_heads, D)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = softmax_scale(cfg)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, k, cos, sin)
        if attn_metadata is None:
            o = kernels.attention(q, k, v, self.scale)
        else:
            o = attn_metadata.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim))  # (B, T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn_metadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata)
        norm = self.post_attention_layernorm
        if torch.is_grad_enabled():  # training: the residual add and the norm keep their own backward
            x = x + h
            return x + self.mlp(norm(x))
        normed, x = kernels.add_rms_norm(h, x, norm.weight, norm.eps)  # inference: one fused pass
        return x + self.mlp(normed)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The Llama-family causal LM.

    State-dict keys are HF's: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
    ..., ``model.norm.weight``, ``lm_head.weight`` (the same tensor as the embedding when tied).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (needed after weights are assigned into a tied model)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Run the decoder.

        Args:
            input_ids: (B, T) int64 token ids.
            positions: (B, T) int64 absolute positions (RoPE).
            attn_metadata: ``None`` for causal attention within the batch, else a KV-cache owner.
        Returns:
            (B, T, hidden) final hidden states (after the last norm), in the model dtype.
        """
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = self.rotary_emb(positions, x.dtype)  # (B, T, D) each
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn_metadata)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab) logits in the model dtype."""
        return self.lm_head(hidden)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; see :meth:`ModelConfig.num_params`."""
        return self.config.num_params(non_embedding)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 N + 12 L H Q T`` (Kaplan et al. 2020; PaLM appendix B),

        N = non-embedding parameters, L layers, H heads, Q head_dim, T sequence length.
        """
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len
