"""The learning-rate schedule: linear warmup, then constant, cosine or warmup-stable-decay (``lr_scheduler.*``)."""

from __future__ import annotations

import functools
import math

import torch

from baige.runtime.train.config import LRSchedulerSection


def lr_lambda(step: int, *, name: str, warmup: int, total: int, min_ratio: float, decay_ratio: float) -> float:
    """Learning-rate multiplier after ``step`` optimizer steps (LambdaLR convention: step 0 = the first).

    Linear warmup over ``warmup`` steps, then ``constant``; ``cosine`` decay to ``min_ratio`` at
    ``total`` (Loshchilov & Hutter 2017, arXiv:1608.03983); or ``wsd`` warmup-stable-decay: flat,
    then a linear decay to ``min_ratio`` over the last ``decay_ratio * total`` steps (Hu et al. 2024,
    MiniCPM, arXiv:2404.06395).
    """
    s = step + 1
    if s <= warmup:
        return s / warmup
    if name == "constant":
        return 1.0
    if name == "cosine":
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(decay_ratio * total))
    decay_start = total - decay_steps
    if s <= decay_start:
        return 1.0
    return 1.0 - (1 - min_ratio) * min(1.0, (s - decay_start) / decay_steps)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, sc: LRSchedulerSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_lambda` with the ``lr_scheduler`` settings, to ``total_steps`` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        functools.partial(
            lr_lambda,
            name=sc.name,
            warmup=sc.warmup_steps,
            total=total_steps,
            min_ratio=sc.min_lr_ratio,
            decay_ratio=sc.decay_ratio,
        ),
    )
