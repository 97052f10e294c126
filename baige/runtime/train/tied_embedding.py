"""The tied input embedding's gradient routed into the lm_head's (one index-add instead of a dense table).

Applied by :func:`~baige.runtime.train.parallel.parallelize` when no FSDP, TP or PP shards the weights.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from baige.runtime.model.gemma import ScaledEmbedding


def _embed_into_tied_grad(embed: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """``embed(input_ids)`` (a :class:`ScaledEmbedding`'s scale included) whose backward index-adds the
    looked-up rows' gradient into ``weight.grad``.

    Autograd's embedding backward builds a dense (vocab, hidden) gradient (a zero fill of the whole
    table, then a scatter of the B*T rows) and adds it to the lm_head's dense gradient: two passes
    over the table for a few hundred rows. Here the lookup reads a detached weight and a hook on the
    output adds its (B*T, hidden) gradient into ``weight.grad`` in place. That is correct because of
    the order of the backward: the tied lm_head's gradient comes first (the loss), and autograd runs a
    parameter's AccumulateGrad as soon as its inputs are in, so ``weight.grad`` holds it by the time
    the backward reaches the embedding output, the last node. (No grad yet, e.g. a frozen head: a
    zero-filled gradient is made.)
    """
    weight = embed.weight
    scaled = embed.scale_rows if isinstance(embed, ScaledEmbedding) else (lambda rows: rows)  # Gemma's sqrt(h)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return scaled(nn.functional.embedding(input_ids, weight))
    out = nn.functional.embedding(input_ids, weight.detach()).requires_grad_()  # (B, T, hidden)
    ids = input_ids.reshape(-1)  # (B*T,)

    def accumulate(grad: torch.Tensor) -> None:
        rows = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)  # (B*T, hidden)
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, rows)

    out.register_hook(accumulate)
    return scaled(out)


def apply_tied_embedding_grad(model: nn.Module) -> None:
    """Route the input embedding's gradient into the tied lm_head's gradient (see
    :func:`_embed_into_tied_grad`). Only for tied weights held as plain tensors (no FSDP/TP): an
    untied table has no dense gradient to add into. The module, its class and its parameter names
    are unchanged; only this instance's ``forward`` is replaced."""
    embed = model.model.embed_tokens
    if model.lm_head.weight is not embed.weight:
        return
    embed.forward = functools.partial(_embed_into_tied_grad, embed)
