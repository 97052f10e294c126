"""Speculative decoding: a proposer guesses up to k tokens per sequence, the target model scores
all k + 1 positions in one forward, and the rejection sampler keeps the longest prefix the target
agrees with plus one token of its own (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318).

- :mod:`.config`: ``SpeculativeConfig`` (vLLM's ``--speculative-config`` keys).
- :mod:`.proposer`: the ``Proposer`` interface; :mod:`.ngram` (prompt lookup), :mod:`.draft`
  (a smaller model with its own paged KV cache) and :mod:`.mtp` (the target's own MTP modules)
  implement it.
- :mod:`.rejection`: verification (greedy and exact rejection sampling), used by the runner.
- :mod:`.stats`: acceptance counters with vLLM's names.
"""
