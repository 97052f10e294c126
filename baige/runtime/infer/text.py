"""Per-sequence text state of the engine: incremental detokenization, stop strings, and what has
been streamed so far (plain Python apart from the generator it carries)."""

from __future__ import annotations

import torch

from baige.runtime.infer.sampling import Logprobs, SamplingParams
from baige.runtime.infer.stop import StopMatcher, StopState
from baige.runtime.model.tokenizer import IncrementalDetokenizer, Tokenizer


class SeqText:
    """The text of one sequence as its tokens arrive.

    Args:
        tokenizer: decodes the tokens.
        params: the request's sampling parameters (stop strings, logprobs, skip_special_tokens).
        generator: the sequence's RNG (None: greedy or the engine's shared one).
        matcher: the request's stop-string automaton (None: no stop strings); shared by its sequences.
        grammar: this sequence's structured-output matcher (llguidance ``LLMatcher``), or None. With
            ``params.reasoning_end_token_id`` it waits in ``pending_grammar`` (``grammar`` None: no mask)
            until that token is generated (:meth:`OutputProcessor.process_token` moves it), or, with
            ``params.reasoning_start_token_id``, until a first token other than that one.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        generator: torch.Generator | None,
        matcher: StopMatcher | None,
        grammar=None,
    ):
        self.params = params
        self.generator = generator
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.text = ""
        self.sent = 0  # characters of text already emitted
        self.stop = StopState(matcher) if matcher is not None else None
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.sent_tokens = 0
        self.sent_logprobs = 0
        pending = grammar is not None and params.reasoning_end_token_id is not None
        self.grammar = None if pending else grammar
        self.pending_grammar = grammar if pending else None
        # the first token decides whether the output reasons (params.reasoning_start_token_id)
        self.undecided = pending and params.reasoning_start_token_id is not None

    def add(self, token: int, is_stop_token: bool, finished: bool, lp: Logprobs | None) -> str | None:
        """Append a generated token's text (a stop token adds none); flush the detokenizer when the
        sequence has finished. Returns the stop string that now ends the text (the text is cut
        before it), or None."""
        if self.logprobs is not None and lp is not None:
            self.logprobs.append(lp)
        if not is_stop_token:
            self.text += self.detok.add(token)
        if finished:
            self.text += self.detok.flush()
        if self.stop is None:
            return None
        hit = self.stop.feed(self.text)
        if hit is None:
            return None
        start, stop = hit
        self.text = self.text[:start]
        return stop

    def emit_upto(self, finished: bool) -> int:
        """Characters of the text that may be streamed now: all when finished, else all but the
        longest tail that is a prefix of a stop string (it could still become one)."""
        if finished or self.stop is None:
            return len(self.text)
        return max(len(self.text) - self.stop.held_back(), self.sent)
