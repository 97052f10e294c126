"""Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3), the
attention block of ``deepseek_v2`` / ``deepseek_v3`` (:class:`~baige.runtime.model.mla_config.MLAConfig`).

Parameter names are transformers' (``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so checkpoints load and save
without renaming. Per token: ``c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])`` (the
latent), ``k_pe = rope(kv_a_proj_with_mqa(x)[kv_lora_rank:])`` (one rope key shared by every head);
``kv_b_proj`` maps the latent to each head's ``k_nope`` (``W_UK``) and ``v`` (``W_UV``).

Two equal forms (the score ``q_nope . (W_UK c_kv) = (W_UK^T q_nope) . c_kv``):

- expanded (``attn_metadata`` None: training, one-shot scoring): per-head K and V from the latent,
  plain causal attention (``kernels.attention``, autograd through it);
- absorbed (with a KV-cache owner): the query becomes ``[W_UK^T q_nope, q_pe]`` per head, the cache
  holds ``[c_kv, k_pe]`` per token as one shared KV "head" whose value is the same row; the output's
  first ``kv_lora_rank`` columns are the attended latent, mapped per head through ``W_UV``. So the
  cache stores ``kv_lora_rank + qk_rope_head_dim`` values per token per layer, and every paged kernel,
  prefix caching and chunked prefill work on it unchanged. A metadata with ``attend_latent`` (the
  engine's) runs decode through ``kernels.mla_decode_attention``, which reads each row once.

:func:`use_expanded_cache` switches a model to the expanded form with a cache owner too: the cache then
holds every head's K and V (an MHA-sized cache, ``2 * n_heads * max(qk_head_dim, v_head_dim)`` values
per token per layer), the baseline the latent cache is measured against (scripts/bench_arch.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from baige import kernels
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.linear import project

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


class MLAttention(nn.Module):
    """The MLA block. ``norm_cls(dim, eps)``: the model's RMSNorm (passed in, so this module does not
    import the decoder that uses it)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_cls: type[nn.Module]):
        super().__init__()
        m = cfg.mla
        self.layer_idx, self.n_heads = layer_idx, cfg.num_attention_heads
        self.n_kv_heads = 1  # the cache's one shared latent row per token (config.kv_cache_dims)
        self.expanded_cache = False  # use_expanded_cache: per-head K/V in the cache, decode not absorbed
        self._dequantized: tuple[tuple, torch.Tensor] | None = None  # a quantized kv_b_proj's float weight
        self.kv_lora_rank, self.nope, self.rope, self.v_dim = (
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        self.qk_dim, self.scale = m.qk_head_dim, m.scale
        h, bias, H = cfg.hidden_size, cfg.attention_bias, self.n_heads
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm_cls(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * self.qk_dim, bias=False)
        self.q_lora = m.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_dim, bias=bias)
        self.kv_a_layernorm = norm_cls(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, h, bias=bias)
        # interleaved RoPE (pairs 2i, 2i+1) is half-split RoPE on the rope dims permuted
        # [0, 2, 4, ..., 1, 3, 5, ...] (transformers' apply_rotary_pos_emb_interleave returns that order)
        self.rope_perm = list(range(0, self.rope, 2)) + list(range(1, self.rope, 2)) if m.rope_interleave else None
        self._perm: dict[torch.device, torch.Tensor] = {}

    def _rope(self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe (B, T, H, Dr), k_pe (B, T, 1, Dr) -> rotated, contiguous (permuted order when interleaved)."""
        if self.rope_perm is not None:
            perm = self._perm.get(q_pe.device)
            if perm is None:
                perm = self._perm[q_pe.device] = torch.tensor(self.rope_perm, dtype=torch.long, device=q_pe.device)
            q_pe, k_pe = q_pe.index_select(-1, perm), k_pe.index_select(-1, perm)
        return kernels.apply_rope(q_pe.contiguous(), k_pe.contiguous(), cos, sin)

    def latent_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK (H, Dn, Dl), W_UV (H, Dv, Dl))``: views of ``kv_b_proj``'s weight. A quantized
        projection is dequantized once and the float weight kept (as vLLM keeps W_UK / W_UV in the model
        dtype: the absorbed form multiplies by them every step) until one of its tensors changes (another
        storage, or an in-place write: ``Tensor._version``)."""
        lin = self.kv_b_proj
        if isinstance(lin, nn.Linear):
            w = lin.weight  # (H * (Dn + Dv), Dl)
        else:
            key = tuple((t.data_ptr(), t._version) for t in [*lin.parameters(), *lin.buffers()])
            if self._dequantized is None or self._dequantized[0] != key:
                self._dequantized = (key, lin.dequantized_weight())
            w = self._dequantized[1]
        w = w.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)  # (H, Dn + Dv, Dl)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, cos, sin, attn_metadata) -> torch.Tensor:
        """x: (B, T, hidden); cos, sin: (B, T, Dr) -> (B, T, hidden)."""
        B, T, _ = x.shape
        H = self.n_heads
        if self.q_lora:
            q = project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, x)))
        else:
            q = project(self.q_proj, x)
        q_nope, q_pe = q.view(B, T, H, self.qk_dim).split([self.nope, self.rope], dim=-1)  # (B, T, H, Dn / Dr)
        c_kv, k_pe = project(self.kv_a_proj_with_mqa, x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # (B, T, Dl)
        q_pe, k_pe = self._rope(q_pe, k_pe.view(B, T, 1, self.rope), cos, sin)  # (B, T, H, Dr), (B, T, 1, Dr)
        if attn_metadata is None:
            q, k, v = self._per_head(q_nope, q_pe, c_kv, k_pe)
            o = kernels.attention(q, k, v, self.scale)[..., : self.v_dim]
        elif self.expanded_cache:
            q, k, v = self._per_head(q_nope, q_pe, c_kv, k_pe)
            o = attn_metadata.attend(self.layer_idx, q, k, v, self.scale)[..., : self.v_dim]
        else:
            o = self._absorbed(q_nope, q_pe, c_kv, k_pe, attn_metadata)
        return project(self.o_proj, o.reshape(B, T, H * self.v_dim))  # (B, T, hidden)

    def _per_head(self, q_nope, q_pe, c_kv, k_pe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expanded form's q, k, v, each (B, T, H, max(Dqk, Dv)): K/V per head from the latent,
        the narrower of qk and v zero-padded to one head width for the kernels (zero columns change no
        score; the output's first Dv columns are the value)."""
        B, T, H, _ = q_nope.shape
        kv = project(self.kv_b_proj, c_kv).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, T, H, Dn), (B, T, H, Dv)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, T, H, Dqk)
        k = torch.cat([k_nope, k_pe.expand(B, T, H, self.rope)], dim=-1)  # (B, T, H, Dqk)
        width = max(self.qk_dim, self.v_dim)  # one head width for the kernels: zero columns change no score
        if self.qk_dim < width:
            q, k = F.pad(q, (0, width - self.qk_dim)), F.pad(k, (0, width - self.qk_dim))
        if self.v_dim < width:
            v = F.pad(v, (0, width - self.v_dim))
        return q, k, v

    def _absorbed(self, q_nope, q_pe, c_kv, k_pe, attn_metadata) -> torch.Tensor:
        """Attention over the latent cache (module docstring) -> (B, T, H, Dv)."""
        w_uk, w_uv = self.latent_weights()
        q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_uk)  # (B, T, H, Dl)
        q = torch.cat([q_lat, q_pe], dim=-1)  # (B, T, H, Dl + Dr)
        kv = torch.cat([c_kv, k_pe[:, :, 0]], dim=-1)[:, :, None]  # (B, T, 1, Dl + Dr)
        latent = getattr(attn_metadata, "attend_latent", None)  # the engine's paged metadata has the MLA kernel
        if latent is not None:
            o = latent(self.layer_idx, q, kv, self.scale, self.kv_lora_rank)  # (B, T, H, Dl)
        else:  # any other cache owner: one KV head whose value is the key row
            o = attn_metadata.attend(self.layer_idx, q, kv, kv, self.scale)[..., : self.kv_lora_rank]
        return torch.einsum("bthl,hvl->bthv", o, w_uv)  # (B, T, H, Dv)


def use_expanded_cache(model: nn.Module) -> nn.Module:
    """Switch an MLA model (in place) to the expanded form under a cache owner too: its config's
    ``mla.expanded_cache`` is set (so ``kv_cache_dims`` / ``kv_bytes_per_token`` size an MHA cache:
    ``n_heads`` rows of ``max(qk_head_dim, v_head_dim)`` for K and for V) and every MLA block caches
    per-head K/V and attends without absorption. Same weights, same outputs (to float rounding);
    only what the cache holds and how decode reads it change. Call before building an Engine.
    Returns ``model``.

    Raises:
        ValueError: ``model`` has no MLA layers (a programming error: only MLA models have the choice).
    """
    cfg = model.config
    if cfg.mla is None:
        raise ValueError(f"use_expanded_cache needs an MLA model, got {cfg.model_type}")
    model.config = replace(cfg, mla=replace(cfg.mla, expanded_cache=True))
    for m in model.modules():
        if isinstance(m, MLAttention):
            m.expanded_cache, m.n_kv_heads = True, m.n_heads
    return model
