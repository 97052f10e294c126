"""The engine's structured outputs (:class:`EngineStructured`, a part of the one
:class:`~baige.runtime.infer.engine.Engine`): the constraint compiler of its vocabulary, built on the first
constrained request, its counters, and each step's grammar masks, started on the compiler's worker thread
while the forward runs (``structured.py`` holds the grammars themselves)."""

from __future__ import annotations

from baige.runtime.infer.scheduler import ScheduledBatch
from baige.runtime.infer.structured import GrammarCompiler


class EngineStructured:
    """Structured outputs of :class:`~baige.runtime.infer.engine.Engine` (which provides ``tokenizer``,
    ``vocab_size``, ``eos_token_ids`` and ``_grammars``, None until the compiler is built)."""

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer and vocabulary."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, self.eos_token_ids)
        return self._grammars

    @property
    def grammar_stats(self) -> dict[str, float]:
        """The constraint compiler's counters (:attr:`GrammarCompiler.stats`, a copy); empty before
        the first constrained request, so reading them never builds the compiler."""
        return {} if self._grammars is None else dict(self._grammars.stats)

    def _start_masks(self, batch: ScheduledBatch):
        """Start the grammar masks of the constrained sequences that sample this step (on the
        compiler's worker thread, overlapping the forward), keyed by index into ``batch.sampling_seqs``;
        returns the callable that waits for them, or None."""
        constrained, opens = {}, {}
        counts = batch.num_new_tokens + [0] * len(batch.forks)  # a forked child samples, computing nothing
        for i, (s, n) in enumerate(zip(batch.sampling_seqs, counts)):
            if s.pooling is not None or s.num_computed_tokens + n - len(s.spec_token_ids) != len(s.token_ids):
                continue  # no token sampled this step
            if s.payload.grammar is not None:
                constrained[i] = s.payload.grammar
            elif s.payload.undecided:  # the first token: the constraint's, or the one that opens reasoning
                constrained[i], opens[i] = s.payload.pending_grammar, s.payload.params.reasoning_start_token_id
        if not constrained:
            return None
        seqs = batch.sampling_seqs
        drafts = {i: seqs[i].spec_token_ids for i in constrained if seqs[i].spec_token_ids}
        future = self._grammars.start_masks(constrained, drafts)
        if not opens:
            return future.result

        def result() -> dict:
            masks = future.result()
            for i, token in opens.items():
                masks[i] = masks[i].clone()
                masks[i][..., token] = True
            return masks

        return result
