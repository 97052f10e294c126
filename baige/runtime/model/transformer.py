"""One decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and its Mixture-of-Experts
relatives (Qwen3-MoE, Qwen2-MoE, Mixtral, ERNIE-4.5-MoE), used by training and serving. Dense and
sparse layers mix by config (:class:`~baige.runtime.model.moe.SparseMoeBlock`).

Module and parameter names mirror HF transformers' ``LlamaForCausalLM`` so state dicts load and
save without renaming. ``forward`` returns hidden states; ``compute_logits`` applies ``lm_head`` so
callers project only the positions they need (the last ones when generating, none when the
trainer uses a fused linear + cross-entropy).

Attention metadata is passed explicitly: ``None`` means plain causal attention over the batch
(training, one-shot scoring); otherwise it is an object with
``attend(layer_idx, q, k, v, scale, *, window=None, sinks=None, softcap=None) -> out`` that owns the KV
cache (the engine's paged metadata in ``infer/runner.py``; ``tests/oracle_generate.py`` has a
contiguous one).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from baige import kernels
from baige.runtime.model import gemma
from baige.runtime.model.config import ModelConfig, softmax_scale
from baige.runtime.model.linear import project
from baige.runtime.model.mla import MLAttention
from baige.runtime.model.moe import SparseMoeBlock, SwiGLU
from baige.runtime.model.mtp import MTPLayer
from baige.runtime.model.rope import rotary_embedding


class AttentionMetadata(Protocol):
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: (B, T, n_heads, D); k, v: (B, T, n_kv_heads, D) for the new tokens -> (B, T, n_heads, D).

        ``window``, ``sinks`` (n_heads,) and ``softcap`` mean what they mean in :func:`baige.kernels.attention`;
        an implementer that cannot honour one raises :class:`~baige.errors.BaigeError` naming it."""
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
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # interleaved RoPE (pairs 2i, 2i+1) is half-split RoPE (pairs i, i + D/2) on q and k with
        # their head dims permuted [0, 2, 4, ..., 1, 3, 5, ...]; q.k is unchanged by the shared
        # permutation, so the weights keep their layout and the cache holds the permuted keys
        self.rope_perm = (
            list(range(0, self.head_dim, 2)) + list(range(1, self.head_dim, 2)) if cfg.rope_interleaved else None
        )
        self._perm: dict[torch.device, torch.Tensor] = {}  # rope_perm as an index tensor per device
        # what the attention kernels add to plain causal attention (kernels.attention): this layer's
        # sliding window (None: full), its per-head sink logits (an (n_heads,) parameter or None) and
        # the logit soft-cap (None: none); the families that have them set them
        self.sliding_window: int | None = cfg.layer_window(layer_idx)
        self.sinks: torch.Tensor | None = nn.Parameter(torch.empty(self.n_heads)) if cfg.attention_sinks else None
        self.softcap: float | None = None

    def forward(self, x, cos, sin, attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = project(self.q_proj, x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = project(self.k_proj, x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = project(self.v_proj, x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_perm is not None:
            perm = self._perm.get(q.device)
            if perm is None:
                perm = self._perm[q.device] = torch.tensor(self.rope_perm, dtype=torch.long, device=q.device)
            q, k = q.index_select(-1, perm), k.index_select(-1, perm)
        q, k = kernels.apply_rope(q, k, cos, sin)
        extra = {"window": self.sliding_window, "sinks": self.sinks, "softcap": self.softcap}
        if attn_metadata is None:
            o = kernels.attention(q, k, v, self.scale, **extra)
        else:
            o = attn_metadata.attend(self.layer_idx, q, k, v, self.scale, **extra)
        return project(self.o_proj, o.reshape(B, T, self.n_heads * self.head_dim))  # (B, T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx, RMSNorm) if cfg.mla is not None else Attention(cfg, layer_idx)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_idx)
        self.mlp = SparseMoeBlock(cfg) if sparse else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn_metadata, router_logits: list | None = None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata)
        norm = self.post_attention_layernorm
        if torch.is_grad_enabled():  # training: the residual add and the norm keep their own backward
            x = x + h
            return x + self._mlp(norm(x), router_logits)
        normed, x = kernels.add_rms_norm(h, x, norm.weight, norm.eps)  # inference: one fused pass
        return x + self._mlp(normed, router_logits)

    def _mlp(self, x: torch.Tensor, router_logits: list | None) -> torch.Tensor:
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(x, router_logits)
        return self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.gemma is not None:  # Gemma 2 / 3: scaled embedding, four-norm GeGLU layers (model/gemma.py)
            self.embed_tokens, self.layers, self.norm = gemma.decoder_parts(cfg, Attention)
            return
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
        self.rotary_emb = rotary_embedding(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(self.mtp_layer(k) for k in range(cfg.mtp_depth))

    def mtp_layer(self, k: int) -> MTPLayer:
        """A fresh MTP module of depth ``k + 1`` (its block is layer ``num_hidden_layers + k``'s kind)."""
        c = self.config
        block = DecoderLayer(c, c.num_hidden_layers + k)
        return MTPLayer(c.hidden_size, block, lambda: RMSNorm(c.hidden_size, c.rms_norm_eps))

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (needed after weights are assigned into a tied model)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
        router_logits: list[torch.Tensor] | None = None,
        mtp_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the decoder.

        Args:
            input_ids: (B, T) int64 token ids.
            positions: (B, T) int64 absolute positions (RoPE).
            attn_metadata: ``None`` for causal attention within the batch, else a KV-cache owner.
            router_logits: a list to receive each sparse layer's (B*T, num_experts) router logits,
                in layer order (the load-balancing loss reads them); None: not collected.
            mtp_hidden: a list to receive, per MTP depth k = 1 .. ``mtp_depth``, ``shared_head.norm(h^k)``
                of shape (B, T - k, hidden): position i predicts token ``t_{i+k+1}`` (training's MTP
                loss; ``attn_metadata`` must be None). None: the MTP modules do not run.
        Returns:
            (B, T, hidden) final hidden states (after the last norm), in the model dtype.
        """
        emb = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = self.rotary_emb(positions, emb.dtype)  # (B, T, D) each
        x = emb
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn_metadata, router_logits)
        x = self.model.norm(x)
        if mtp_hidden is not None:
            h = x
            for k, mtp in enumerate(self.mtp, 1):  # depth k: inputs t_{i+k} and h_i^{k-1}, i = 0 .. T-1-k
                h = mtp(emb[:, k:], h[:, :-1], cos[:, :-k], sin[:, :-k], None, router_logits)
                mtp_hidden.append(mtp.shared_head.norm(h))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab) logits in the model dtype (soft-capped when the config says so:
        Gemma's ``final_logit_softcapping``)."""
        logits = project(self.lm_head, hidden)
        cap = self.config.gemma.final_logit_softcapping if self.config.gemma is not None else None
        return logits if cap is None else gemma.softcap(logits, cap)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; see :meth:`ModelConfig.num_params`."""
        return self.config.num_params(non_embedding)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 N + 12 L H Q T`` (Kaplan et al. 2020; PaLM appendix B),

        N = non-embedding parameters a token uses (for MoE the active ones: top-k routed experts,
        router and shared experts), L layers, H heads, Q head_dim, T sequence length.
        """
        n = self.config.num_params(non_embedding=True, active=True)
        return int(6 * n + 12 * self.config.attn_dims() * seq_len)  # MLA: ModelConfig.attn_dims' widths
