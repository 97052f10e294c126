"""From sampled tokens to what a request's caller sees (vLLM v1's ``OutputProcessor``): each new
token's text, stop strings and structured-output grammar, in order, and the cumulative and delta
:class:`RequestOutput` of a request after a step. The engine keeps one per model; the per-request
state (:class:`RequestState`) lives in the engine's request table."""

from __future__ import annotations

from dataclasses import dataclass, replace

from baige.errors import BaigeError
from baige.runtime.infer.outputs import CompletionOutput, RequestOutput
from baige.runtime.infer.pooling import PoolingParams
from baige.runtime.infer.sampling import Logprobs, SamplingParams
from baige.runtime.infer.scheduler import Scheduler, Sequence
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats
from baige.runtime.infer.structured import engine_error
from baige.runtime.infer.text import SeqText


@dataclass
class RequestState:
    """One request in flight: its prompt, parameters and sequences (``params.n`` of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first in a step
    last_token_time: float | None = None  # the last step that produced tokens
    prompt_logprobs: list[Logprobs | None] | None = None
    spec_stats: SpecDecodeStats | None = None


class OutputProcessor:
    """Text, stop strings and grammar of new tokens, and request outputs.

    Args:
        scheduler: finishes a sequence that a stop string or its grammar ends.
        eos_token_ids: the model's end-of-sequence tokens (a finish on one reports ``stop_reason``
            None, as vLLM does).
    """

    def __init__(self, scheduler: Scheduler, eos_token_ids: list[int]):
        self.scheduler = scheduler
        self.eos_only = frozenset(eos_token_ids)

    def process_tokens(self, seq: Sequence, lps: list[Logprobs | None]) -> int:
        """Text, stop strings and grammar for the tokens the last step appended to ``seq``, in order.
        A stop string completed inside an accepted run of drafts ends the sequence there: the tokens
        after it are dropped, as if they had never been generated. Returns the tokens kept.

        Raises:
            BaigeError: the grammar cannot go on (the request's own constraint); anything the
            detokenizer raises. Either fails this request alone (the engine's caller).
        """
        n = seq.num_new_output
        first = len(seq.token_ids) - n
        for j in range(n):
            ended = self.process_token(seq, seq.token_ids[first + j], lps[j] if j < len(lps) else None, last=j == n - 1)
            if ended and j < n - 1:
                del seq.token_ids[first + j + 1 :]
                return j + 1
        return n

    def process_token(self, seq: Sequence, token: int, lp: Logprobs | None, last: bool = True) -> bool:
        """One new token's text, stop strings and grammar; ``last``: the last token the step appended
        (only then can the sequence's finish come from the scheduler). Returns whether a stop string
        or the grammar ended the sequence at this token."""
        st: SeqText = seq.payload
        finished = seq.is_finished and last
        is_stop_token = finished and seq.finish_reason == "stop" and seq.stop_reason == token
        stop = st.add(token, is_stop_token, finished, lp)
        if stop is not None:
            if seq.is_finished:
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)
            return True
        if st.pending_grammar is not None:
            opened = not st.undecided or token == st.params.reasoning_start_token_id
            st.undecided = False
            if not opened or token == st.params.reasoning_end_token_id:
                st.grammar, st.pending_grammar = st.pending_grammar, None  # the answer starts here / after it
            if opened:
                return False
        if st.grammar is not None:
            # An error while computing this step's mask (an engine limit: then the mask allowed only
            # EOS), or a refused token (allowed_token_ids left nothing the constraint allows).
            if st.grammar.is_error() or not st.grammar.consume_token(token):
                raise BaigeError(
                    f"structured_outputs: the constraint cannot go on after {len(seq.output_token_ids) - 1} "
                    f"tokens ({engine_error(st.grammar)}); allowed_token_ids, if given, must keep tokens "
                    "the constraint allows",
                    param="structured_outputs",
                )
            if st.grammar.is_stopped() and not seq.is_finished:  # the language is complete: end here
                self.scheduler.finish(seq, "stop")
                return True
        return False

    def make_output(self, req: RequestState, now: float) -> RequestOutput:
        """The request's output after a step: cumulative text, tokens and logprobs per sequence, and
        the delta since the previous output (which this marks as sent). ``now``: monotonic seconds."""
        outs = []
        for seq in req.seqs:
            st: SeqText = seq.payload
            upto = st.emit_upto(seq.is_finished)
            out_ids = seq.output_token_ids
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=st.text[:upto],
                    token_ids=list(out_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=None if seq.stop_reason in self.eos_only else seq.stop_reason,  # EOS: None (vLLM)
                    logprobs=list(st.logprobs) if st.logprobs is not None else None,
                    delta_text=st.text[st.sent : upto],
                    delta_token_ids=out_ids[st.sent_tokens :],
                    delta_logprobs=st.logprobs[st.sent_logprobs :] if st.logprobs is not None else [],
                )
            )
            st.sent, st.sent_tokens = upto, len(out_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        finished = all(s.is_finished for s in req.seqs)
        interval = None if req.last_token_time is None else now - req.last_token_time
        req.last_token_time = now
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=now if finished else None,
            spec_decode=replace(req.spec_stats, accepted_per_pos=list(req.spec_stats.accepted_per_pos))
            if req.spec_stats is not None
            else None,
            first_scheduled_time=req.scheduled_time,
            token_interval=interval,
            n=req.params.n,
            max_tokens=req.params.max_tokens,
        )
