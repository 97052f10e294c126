"""The checks of a TrainConfig's pipeline-parallel and context-parallel fields: the schedule, the
micro-batches, the sequence split, document masking, and what each does not compose with yet (torch-free, as
the config module that calls them; the parallelisms themselves are :mod:`baige.runtime.train.pipeline` and
:mod:`baige.runtime.train.context_parallel`)."""

from __future__ import annotations

from baige.errors import BaigeError
from baige.runtime.config import check_int

PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
CP_METHODS = ("ring", "ulysses")
ATTN_MASK_TYPES = ("causal", "block_causal")


def validate_context_parallel(cfg) -> None:
    """The context-parallel fields and document masking, and what they do not compose with. Raises
    BaigeError naming the field."""
    p, t = cfg.parallelism, cfg.training
    check_int("parallelism.context_parallel_degree", p.context_parallel_degree, 1)
    if p.context_parallel_method not in CP_METHODS:
        raise BaigeError(
            f"parallelism.context_parallel_method must be one of {', '.join(CP_METHODS)} "
            f"(got {p.context_parallel_method!r})"
        )
    if t.attn_mask_type not in ATTN_MASK_TYPES:
        raise BaigeError(
            f"training.attn_mask_type must be one of {', '.join(ATTN_MASK_TYPES)} (got {t.attn_mask_type!r})"
        )
    cp = p.context_parallel_degree
    if cp > 1 and t.seq_len % (2 * cp):
        raise BaigeError(
            f"training.seq_len {t.seq_len} must be a multiple of 2 x context_parallel_degree = {2 * cp} "
            "(each CP rank holds two of 2 x degree equal chunks)"
        )
    for what, on in (
        ("context parallel (--cp)", cp > 1),
        ("training.attn_mask_type=block_causal", t.attn_mask_type == "block_causal"),
    ):
        if on and p.pipeline_parallel_degree > 1:
            raise BaigeError(f"{what} does not compose with pipeline parallel (--pp) yet: use FSDP and TP")
        if on and cfg.method == "grpo":
            raise BaigeError(f"{what} is for next-token training (--method sft / pretrain), not --method grpo")
    if cp > 1 and p.expert_parallel_degree > 1:
        raise BaigeError("context parallel (--cp) does not compose with expert parallel (--ep) yet")
    if cp > 1 and t.compile is True:
        raise BaigeError("context parallel (--cp) runs eager: drop --compile (its ring exchanges break the graph)")


def validate_pipeline(cfg) -> None:
    """The pipeline-parallel fields (the schedule name is matched case-insensitively and normalised).
    Raises BaigeError naming the field."""
    p = cfg.parallelism
    check_int("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree, 1)
    names = {n.lower(): n for n in PIPELINE_SCHEDULES}
    if p.pipeline_parallel_schedule.lower() not in names:
        raise BaigeError(
            f"parallelism.pipeline_parallel_schedule must be one of {', '.join(PIPELINE_SCHEDULES)} "
            f"(got {p.pipeline_parallel_schedule!r})"
        )
    p.pipeline_parallel_schedule = names[p.pipeline_parallel_schedule.lower()]
    m, batch = p.pipeline_parallel_microbatches, cfg.training.batch_size
    check_int("parallelism.pipeline_parallel_microbatches", m, 0)
    if m and batch % m:
        raise BaigeError(
            f"parallelism.pipeline_parallel_microbatches {m} must divide training.batch_size {batch} "
            "(each micro-batch of the pipeline holds batch_size / microbatches windows)"
        )
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule == "ZBVZeroBubble" and cfg.data.eval:
        raise BaigeError(
            "evaluation (--eval-data) under ZBVZeroBubble is not supported: torch 2.13's ZBV schedule "
            "fails in forward-only passes; use another pipeline_parallel_schedule or drop --eval-data"
        )
    if p.pipeline_parallel_degree > 1 and p.expert_parallel_degree > 1:
        raise BaigeError("pipeline parallel (--pp) does not compose with expert parallel (--ep) yet: use one of them")
    if p.pipeline_parallel_degree > 1 and cfg.lora.rank is not None:
        raise BaigeError(
            "pipeline parallel (--pp) does not compose with LoRA (--lora-rank) yet: the adapter "
            "export gathers one rank's model; use FSDP or TP"
        )
