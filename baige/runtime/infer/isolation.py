"""Failure isolation of an engine step: a step whose batched forward raises is rerun one sequence at a
time, so only the requests that still fail are failed and the others go on (``tests/infer/test_isolation.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from baige.runtime.infer.outputs import EngineDeadError
from baige.runtime.infer.sampling import Logprobs, SamplerRow
from baige.runtime.infer.scheduler import ScheduledBatch

logger = logging.getLogger("baige.engine")


def execute_isolated(
    runner,
    batch: ScheduledBatch,
    rows: list[SamplerRow],
    masks,
    in_flight: Callable[[str], bool],
    fail: Callable[[str, BaseException], None],
):
    """``runner.execute(batch, rows, masks)``; when the batched step raises, each sequence still in
    flight (``in_flight(request_id)``) runs alone and the ones that still raise are handed to
    ``fail(request_id, error)`` (their tokens stay empty). K/V slots of a failed step are rewritten on
    retry (a sequence's forked children run with it). Returns ``runner.execute``'s ``(tokens, logprobs,
    prompt logprobs)`` for the whole batch.

    Raises:
        EngineDeadError: a tensor-parallel rank is gone (nothing can run, so nothing is retried).
    """
    try:
        return runner.execute(batch, rows, masks)
    except EngineDeadError:  # a tensor-parallel rank is gone: nothing can run
        raise
    except Exception as e:
        if len(batch) == 1:
            fail(batch.seqs[0].request_id, e)
            return [[]], [[]], {}
        logger.exception("a step of %d sequences failed; running them one at a time", len(batch))
    seqs = batch.sampling_seqs
    tokens: list[list[int]] = [[] for _ in seqs]
    logprobs: list[list[Logprobs | None]] = [[] for _ in seqs]
    prompt_lps: dict = {}
    full = masks() if masks is not None else {}
    nb = len(batch.seqs)
    for i, seq in enumerate(batch.seqs):
        if not in_flight(seq.request_id):
            continue
        # its forked children sample from its logits: they run with it (indices into `seqs`)
        own = [i] + [nb + k for k, (p, _) in enumerate(batch.forks) if p == i]
        one = ScheduledBatch(
            [seq], [batch.num_new_tokens[i]], int(i < batch.num_decodes), forks=[(0, seqs[j]) for j in own[1:]]
        )
        one_masks = {a: full[j] for a, j in enumerate(own) if j in full}
        try:
            toks, lps_, lps = runner.execute(
                one, [rows[j] for j in own], (lambda m=one_masks: m) if one_masks else None
            )
        except EngineDeadError:
            raise
        except Exception as e:
            fail(seq.request_id, e)
            continue
        for a, j in enumerate(own):
            tokens[j], logprobs[j] = toks[a], lps_[a]
        if 0 in lps:
            prompt_lps[i] = lps[0]
    return tokens, logprobs, prompt_lps
