"""DeepSeek-V3's multi-token prediction (MTP) modules (DeepSeek-AI 2024, arXiv:2412.19437 §2.2).

MTP module k (1-based depth, ``k = 1 .. D``) predicts the token ``k + 1`` places ahead. At position i it
combines the previous depth's representation ``h_i^{k-1}`` (depth 0: the main model's final hidden
state, after its last norm, as vLLM's ``deepseek_mtp.py`` feeds the published weights) with the
embedding of token ``t_{i+k}``::

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])      # concatenation in this order (vLLM)
    h_i^k = Block_k(h'_{0..i})                                     # one causal decoder block
    P(t_{i+k+1}) = softmax(OutHead(shared_head.norm(h_i^k)))

The embedding and the output head are the main model's (shared, as in the paper); the block is the
model's own :class:`~baige.runtime.model.transformer.DecoderLayer` built for layer index
``num_hidden_layers + k - 1``, so an MoE / MLA model's MTP block is MoE / MLA too. DeepSeek-V3's
checkpoints keep module k under ``model.layers.{num_hidden_layers + k - 1}.`` (with copies of the
embedding and head as ``embed_tokens`` and ``shared_head.head``); baige holds it as ``mtp.{k-1}.`` and
renames at load and export (:mod:`baige.runtime.weights.mtp_layout`). vLLM masks the embedding at
position 0 to zero; baige does not (no reference says why, and the target verifies every draft).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from baige.runtime.model.linear import project


class SharedHead(nn.Module):
    """``shared_head``: the norm before the (shared) output head; the head itself is the main model's."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


class MTPLayer(nn.Module):
    """One MTP module (see the module docstring).

    Args:
        hidden_size: the model's hidden width h.
        block: the decoder block (the model's ``DecoderLayer`` for its layer index).
        make_norm: ``() -> RMSNorm(h)`` as the model's norms (eps from the config).
    """

    def __init__(self, hidden_size: int, block: nn.Module, make_norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm = make_norm()
        self.hnorm = make_norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(make_norm())

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata=None,
        router_logits: list | None = None,
    ) -> torch.Tensor:
        """(B, T, h) embeddings of ``t_{i+k}`` and (B, T, h) ``h_i^{k-1}`` at positions with RoPE tables
        ``cos``, ``sin`` (B, T, rotary dim) -> (B, T, h) ``h_i^k`` (before ``shared_head.norm``), in the
        model dtype. ``attn_metadata`` None: causal attention within the T positions."""
        x = project(self.eh_proj, torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(x, cos, sin, attn_metadata, router_logits)
