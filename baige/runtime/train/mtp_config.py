"""The checks of ``model.mtp_depth`` / ``model.mtp_loss_scaling_factor`` in a TrainConfig (torch-free, as the
config module that calls them; the MTP loss itself is :mod:`baige.runtime.train.mtp`)."""

from __future__ import annotations

from baige.errors import BaigeError


def validate_mtp(cfg) -> None:
    """``model.mtp_depth`` / ``model.mtp_loss_scaling_factor`` of a TrainConfig and what MTP does not compose
    with yet. Raises BaigeError naming the field."""
    m, p = cfg.model, cfg.parallelism
    if m.mtp_depth is not None and (isinstance(m.mtp_depth, bool) or m.mtp_depth < 0):
        raise BaigeError(f"model.mtp_depth must be an integer >= 0 (got {m.mtp_depth!r})")
    if not m.mtp_loss_scaling_factor >= 0.0:
        raise BaigeError(f"model.mtp_loss_scaling_factor must be >= 0 (got {m.mtp_loss_scaling_factor})")
    if not m.mtp_depth:
        return
    for what, on in (
        ("--pp", p.pipeline_parallel_degree != 1),
        ("--tp", p.tensor_parallel_degree != 1),
        ("--cp", p.context_parallel_degree != 1),
        ("training.attn_mask_type=block_causal", cfg.training.attn_mask_type == "block_causal"),
        ("--method grpo", cfg.method == "grpo"),
        ("--lora-rank", cfg.lora.rank is not None),
    ):
        if on:
            raise BaigeError(f"model.mtp_depth={m.mtp_depth} does not support {what} yet")
