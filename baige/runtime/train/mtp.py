"""Training DeepSeek-V3's multi-token-prediction modules (:mod:`baige.runtime.model.mtp`) as an extra loss.

Loss (DeepSeek-V3, arXiv:2412.19437 eq. 24-25; Megatron-LM's ``--mtp-num-layers`` /
``--mtp-loss-scaling-factor``)::

    L_MTP = lambda / D * sum_{k=1..D} L_k,   L_k = mean over valid targets of -log P_k(t_{i+k+1})

where depth k at position i reads ``t_{i+k}`` and predicts ``t_{i+k+1}``, i.e. the labels shifted left by
k (the last k positions of a window have no depth-k prediction). ``L_k``'s mean is over the valid
(``!= -100``) depth-k targets of the whole step (all micro-batches, all data-parallel ranks), as the main
loss's is. The trainer adds ``L_MTP`` to the main loss and logs ``mtp_loss`` = ``sum_k L_k / D``
(unscaled).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from baige import kernels

IGNORE = -100


def set_mtp_depth(model: nn.Module, depth: int, std: float) -> None:
    """Give ``model`` (a plain Transformer, fp32) ``depth`` MTP modules: keep its first ``depth`` and add
    new ones initialised as :func:`~baige.runtime.train.presets.init_weights` does (N(0, std), norms 1,
    biases 0); the config (and the ``num_nextn_predict_layers`` its export writes) follows."""
    have = list(model.mtp)[:depth]
    for k in range(len(have), depth):
        layer = model.mtp_layer(k)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.zero_() if name.endswith("bias") else p.fill_(1.0) if p.ndim == 1 else p.normal_(0.0, std)
        have.append(layer)
    model.mtp = nn.ModuleList(have)
    raw = dict(model.config.raw, num_nextn_predict_layers=depth)
    model.config = dataclasses.replace(model.config, mtp_depth=depth, raw=raw)


def num_valid(labels: torch.Tensor, depth: int) -> list[int]:
    """Per depth k = 1 .. ``depth`` the valid depth-k targets of (B, T) ``labels`` (``labels[:, k:]``)."""
    return [int((labels[:, k:] != IGNORE).sum()) for k in range(1, depth + 1)]


def mtp_loss_sums(
    mtp_hidden: list[torch.Tensor], weight: torch.Tensor, labels: torch.Tensor, normalizers: list[float]
) -> list[torch.Tensor]:
    """Per depth k the summed depth-k cross-entropy / ``normalizers[k-1]`` (fp32 scalars).

    Args:
        mtp_hidden: per depth the (B, T - k, hidden) normed MTP states (``Transformer.forward``'s
            ``mtp_hidden``).
        weight: (vocab, hidden) the output head, the dtype of the states.
        labels: (B, T) int64 next-token labels of the main loss (-100: no loss).
        normalizers: per depth its valid target count over the step (> 0; 1.0 for a sum).
    """
    out = []
    for k, (h, n) in enumerate(zip(mtp_hidden, normalizers), 1):
        out.append(kernels.fused_linear_cross_entropy(h, weight, labels[:, k:], normalizer=max(n, 1.0)))
    return out
