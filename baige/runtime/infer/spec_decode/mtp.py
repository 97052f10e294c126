"""MTP proposals: the target's own multi-token-prediction modules (DeepSeek-V3, arXiv:2412.19437 §2.2;
:mod:`baige.runtime.model.mtp`) guess the next tokens from its final hidden states.

For a sequence of n tokens whose target hidden states ``h_i`` are known for positions ``base .. n-2``
(the last token, sampled from ``h_{n-2}``, is not yet fed), draft j (0-based) is, as vLLM's MTP
proposer chains them:

- j < D (the model's MTP depth): module j over positions ``base .. n-2`` with tokens ``t_{i+j+1}`` (the
  drafts so far standing in for tokens past the sequence) and module j-1's outputs (j = 0: ``h``); the
  draft is read at position n-2;
- j >= D: module D-1 reused one position further each time, its input hidden at the new position its
  own output at the previous one (vLLM's reuse of the last MTP layer).

Greedy rows take the argmax, random ones sample under the request's settings (their distributions go
to the rejection sampler). The modules run over the whole kept context each proposal (plain causal
attention, no MTP KV cache): correct, but a proposal costs ``budget x context`` rows of one decoder block
per sequence. Positions served from the prefix cache have no hidden state: the modules then see the
context from the first computed position (drafts may be worse; the verified output is the same).
"""

from __future__ import annotations

import torch

from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplerRow, adjusted_logits, target_probs
from baige.runtime.infer.scheduler import Sequence, SequenceStatus
from baige.runtime.infer.spec_decode.proposer import Proposal, Proposer
from baige.runtime.model.transformer import Transformer


class _Hidden:
    """One sequence's target hidden states for positions ``base .. base + len(h) - 1``."""

    def __init__(self, base: int, h: torch.Tensor):
        self.base, self.h = base, h

    def add(self, first: int, h: torch.Tensor) -> None:
        """Rows for positions ``first ..``: a rerun position replaces what was kept from it on; a gap
        (rows never seen) restarts the kept context at ``first``."""
        end = self.base + len(self.h)
        if first < self.base or first > end:
            self.base, self.h = first, h
        else:
            self.h = torch.cat([self.h[: first - self.base], h])


class MTPProposer(Proposer):
    """Proposals from ``model.mtp`` (module docstring).

    Args:
        model: the target (eval mode) with its MTP modules.
        num_speculative_tokens: k.
        vocab_size: the target's vocabulary size.
    Raises:
        BaigeError: the model has no MTP modules (naming the tensors a checkpoint would need).
    """

    needs_hidden = True

    def __init__(self, model: Transformer, num_speculative_tokens: int, vocab_size: int):
        if not len(model.mtp):
            L = model.config.num_hidden_layers
            raise BaigeError(
                f"--speculative-config: method mtp needs the model's MTP weights (config.json "
                f"num_nextn_predict_layers >= 1 and the tensors model.layers.{L}.enorm.weight, hnorm, eh_proj, "
                f"shared_head.norm and its decoder block); this checkpoint has none",
                param="speculative_config",
            )
        self.model, self.k, self.vocab_size = model, num_speculative_tokens, vocab_size
        self.device = next(model.parameters()).device
        self.states: dict[int, _Hidden] = {}

    def observe(self, hidden: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        for seq, first, h in hidden:
            if seq.status != SequenceStatus.RUNNING:  # finished or preempted since: released already
                continue
            state = self.states.get(seq.seq_id)
            if state is None:
                self.states[seq.seq_id] = _Hidden(first, h)
            else:
                state.add(first, h)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int], rows: list[SamplerRow]) -> list[Proposal]:
        out = []
        for seq, budget, row in zip(seqs, budgets, rows):
            state = self.states.get(seq.seq_id)
            n = len(seq.token_ids)
            if state is not None and state.base + len(state.h) > n - 1:  # rows of rejected drafts
                state.h = state.h[: n - 1 - state.base]
            if budget <= 0 or state is None or len(state.h) == 0 or state.base + len(state.h) != n - 1:
                out.append(Proposal([]))
                continue
            out.append(self._draft(seq.token_ids, state, budget, row))
        return out

    def _run(self, depth: int, ids: list[int], hidden: torch.Tensor, base: int) -> torch.Tensor:
        """MTP module ``depth`` over positions ``base ..``: (L,) ``ids`` and (L, h) inputs -> (L, h) outputs."""
        m = self.model
        emb = m.model.embed_tokens(torch.tensor([ids], dtype=torch.long, device=self.device))
        positions = torch.arange(base, base + len(ids), device=self.device)[None]
        cos, sin = m.rotary_emb(positions, emb.dtype)
        return m.mtp[depth](emb, hidden[None].to(emb.dtype), cos, sin, None)[0]

    def _draft(self, tokens: list[int], state: _Hidden, budget: int, row: SamplerRow) -> Proposal:
        D, base, L = len(self.model.mtp), state.base, len(state.h)
        ext, drafts, probs = list(tokens), [], []
        prev = state.h
        reuse_in = reuse_out = None
        for j in range(budget):
            if j < D:  # module j at positions base .. n-2, tokens t_{i+j+1}
                h_in = prev
                out = self._run(j, ext[base + j + 1 : base + j + 1 + L], h_in, base)
                prev = out
            else:  # the last module one position further, fed its own previous output
                h_in = torch.cat([reuse_in, reuse_out[-1:]])
                out = self._run(D - 1, ext[base + D : base + D + len(h_in)], h_in, base)
            if j >= D - 1:
                reuse_in, reuse_out = h_in, out
            mtp = self.model.mtp[min(j, D - 1)]
            logits = self.model.compute_logits(mtp.shared_head.norm(out[-1:]))[:, : self.vocab_size]  # (1, V)
            step_row = row.with_outputs(drafts)
            if row.params.greedy:
                token = int(adjusted_logits(logits, [step_row]).argmax(-1)[0])
            else:
                q = target_probs(logits, [step_row])[0]
                token = int(torch.multinomial(q, 1, generator=row.generator))
                probs.append(q)
            drafts.append(token)
            ext.append(token)
        return Proposal(drafts, torch.stack(probs) if probs else None)
