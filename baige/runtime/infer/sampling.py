"""Batched token sampling under each request's :class:`~baige.runtime.infer.sampling_params.SamplingParams`.

Filters follow the usual definitions: top-k keeps the k most likely tokens; top-p (nucleus,
Holtzman et al. 2019, arXiv:1904.09751) keeps the smallest set whose probability reaches p;
min-p keeps tokens with probability >= min_p * p_max (Nguyen et al. 2024, arXiv:2407.01082).
Temperature 0 is greedy whatever the filters say.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from baige import kernels
from baige.runtime.infer.sampling_params import SamplingParams
from baige.runtime.model.logprobs import log_probs


def apply_filters(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (set to -inf) the tokens top-k, top-p and min-p exclude.

    Args:
        logits: (B, vocab) float, already divided by the temperature.
    Returns:
        (B, vocab) with excluded entries at -inf; the most likely token always survives.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False  # the most likely token stays (a top_p that rounds to 0 in fp32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token of each row.

    Args:
        logits: (B, vocab), any float dtype; computed in fp32.
        params: shared by every row.
        generator: seeded RNG for reproducible sampling (None: torch's global RNG).
    Returns:
        (B,) int64 token ids.
    """
    logits = logits.float()
    if params.greedy:
        return logits.argmax(-1)
    logits = apply_filters(
        logits / min(params.temperature, torch.finfo(torch.float32).max), params.top_k, params.top_p, params.min_p
    )
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class SamplerRow:
    """One sequence's sampling inputs for :func:`sample_batch`."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: list[int] | None = None  # needed for repetition_penalty
    output_ids: list[int] | None = None  # needed for penalties and min_tokens
    stop_ids: list[int] | None = None  # masked while len(output_ids) < params.min_tokens
    token_mask: torch.Tensor | None = None  # (vocab,) bool: the structured-output grammar's allowed tokens

    def with_outputs(self, extra: list[int]) -> "SamplerRow":
        """This row as it is after ``extra`` more output tokens (what penalties and min_tokens see at
        a later position: speculative decoding scores several positions at once)."""
        if not extra or self.output_ids is None:
            return self
        return replace(self, output_ids=list(self.output_ids) + list(extra))


@dataclass
class Logprobs:
    """Log-probability of the sampled token and the ``k`` most likely tokens (natural log)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[Logprobs]:
    """Log-probability of given tokens under raw logits, with the ``k`` most likely alternatives.

    Args:
        logits: (P, V) any float dtype (the log-softmax is taken in fp32).
        targets: (P,) int64 token ids, one per row.
        k: alternatives per row (0: none).
    Returns:
        P :class:`Logprobs` (natural log).
    """
    lp = log_probs(logits)  # (P, V)
    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [Logprobs(t, c, top) for t, c, top in zip(targets.tolist(), chosen, tops)]


def _needs_adjust(r: SamplerRow) -> bool:
    p = r.params
    return bool(
        p.has_penalties
        or p.logit_bias
        or p.allowed_token_ids is not None
        or r.token_mask is not None
        or (p.min_tokens and len(r.output_ids or ()) < p.min_tokens)
    )


def _adjust_row(row: torch.Tensor, r: SamplerRow) -> torch.Tensor:
    """One row's logit processors (see :func:`sample_batch`). ``row``: (vocab,) fp32; returns a new row."""
    p, V, dev = r.params, row.shape[0], row.device
    if r.token_mask is not None:  # the grammar's mask first: nothing below can revive a refused token
        row = row.masked_fill(~r.token_mask.to(dev)[:V], float("-inf"))
    if p.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool, device=dev)
        keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = True
        row = row.masked_fill(~keep, float("-inf"))
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
        row = row.index_add(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev))
    out = torch.tensor(r.output_ids or [], dtype=torch.long, device=dev)
    if len(r.output_ids or ()) < p.min_tokens and r.stop_ids:
        masked = row.index_fill(0, torch.tensor(r.stop_ids, dtype=torch.long, device=dev), float("-inf"))
        if torch.isfinite(masked).any():  # allowed_token_ids may hold only stop ids: then they stay
            row = masked
    if p.repetition_penalty != 1:
        seen = torch.zeros(V, dtype=torch.bool, device=dev)
        seen[torch.tensor(r.prompt_ids or [], dtype=torch.long, device=dev)] = True
        seen[out] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        # a penalty beyond fp32's range (below ~1e-38: it rounds to 0) must not turn a logit into inf,
        # or a refused one (-inf * 0) into NaN: refused tokens stay -inf, the others stay finite
        big = torch.finfo(row.dtype).max
        penalized = torch.where(torch.isneginf(row), row, penalized.nan_to_num(0.0, big, -big))
        row = torch.where(seen, penalized, row)
    if p.presence_penalty or p.frequency_penalty:
        counts = torch.bincount(out, minlength=V).float()[:V]
        row = row - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())
    return row


def adjusted_logits(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """The logit processors of :func:`sample_batch` (grammar mask, allowed ids, bias, min_tokens,
    penalties) applied per row. ``logits``: (S, vocab) any float dtype -> (S, vocab) fp32 (a new
    tensor when any row is adjusted)."""
    logits = logits.float()
    adjust = [i for i, r in enumerate(rows) if _needs_adjust(r)]
    if adjust:
        logits = logits.clone()
        for i in adjust:
            logits[i] = _adjust_row(logits[i], rows[i])
    return logits


def _filtered(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of each row (each on the renormalised result of the one
    before, as :func:`apply_filters`).

    The vocabulary is sorted only when a row asks for top-p or min-p; top-k alone takes the k-th
    largest logit from ``torch.topk`` (ties with it stay, as vLLM).

    Args:
        logits: (R, V) fp32 adjusted logits of rows that sample (temperature > 0).
    Returns:
        (R, V) fp32 the filtered distribution of each row, in vocabulary order.
    """
    R, V = logits.shape
    dev = logits.device
    if all(r.params.temperature == 1.0 for r in rows):
        scaled = logits  # x / 1.0 == x exactly: skip a vocabulary-wide pass
    else:
        # a temperature past fp32's range would be inf there, and -inf / inf (a refused token) NaN
        big = torch.finfo(torch.float32).max
        temps = torch.tensor([min(r.params.temperature, big) for r in rows], device=dev)
        scaled = logits / temps[:, None]
    if not any(r.params.top_p < 1 or r.params.min_p > 0 for r in rows):
        ks = [r.params.top_k if 0 < r.params.top_k < V else 0 for r in rows]
        if any(ks):
            top = torch.topk(scaled, max(ks), dim=-1).values  # (R, max k) descending
            kth = top.gather(-1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
            kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None], float("-inf"))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        return scaled.softmax(-1)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else V for r in rows], device=dev)
    kth = sorted_logits.gather(-1, (top_k.clamp_max(V) - 1)[:, None])  # (R, 1) the k-th largest logit
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties with it stay (vLLM)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    if (top_p < 1).any():
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False  # the most likely token stays (a top_p that rounds to 0 in fp32)
        sorted_logits = sorted_logits.masked_fill(drop & (top_p[:, None] < 1), float("-inf"))
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
    if (min_p > 0).any():
        probs = sorted_logits.softmax(-1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(-1, order, sorted_logits.softmax(-1))


def _inverse_transform(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One categorical draw per row by inverse-transform sampling.

    Each row takes one ``U ~ U[0, 1)`` (float64) from its own generator (torch's global one for None),
    sets ``x = (1 - U) * total`` (so ``0 < x <= total``) and returns the first vocabulary position whose
    cumulative mass (float64, vocabulary order) reaches ``x``: a token of probability zero is never drawn.

    Args:
        probs: (R, V) fp32 non-negative, each row with positive mass.
        generators: R generators.
    Returns:
        (R,) int64 token ids.
    """
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators])
    return kernels.inverse_cdf(probs, u.to(probs.device))  # the search over the float64 cumulative mass


def target_probs(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """The distribution :func:`sample_batch` draws each row from, in vocabulary order.

    Args:
        logits: (S, vocab) raw logits, any float dtype.
        rows: S row descriptions.
    Returns:
        (S, vocab) fp32 probabilities: greedy rows one-hot at the argmax of their adjusted logits, the
        others after the processors, temperature and filters (what speculative decoding's rejection
        sampler verifies against).
    """
    logits = adjusted_logits(logits, rows)
    S, V = logits.shape
    probs = torch.zeros(S, V, dtype=torch.float32, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        probs[idx, logits[idx].argmax(-1)] = 1.0
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs[idx] = _filtered(logits[idx], [rows[i] for i in random_rows])
    return probs


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list[Logprobs | None]:
    """Logprobs of chosen tokens under the raw distribution (vLLM's: before any processor).

    Args:
        logits: (S, vocab) raw logits, any float dtype.
        tokens: S chosen token ids.
        ks: per row the number of top alternatives, or None for no logprobs.
    Returns:
        S entries: a :class:`Logprobs`, or None where ``ks`` is None.
    """
    if all(k is None for k in ks):
        return [None] * len(tokens)
    raw = log_probs(logits)  # (S, V): the formula the trainer recomputes (model/logprobs.py)
    k = max(kk or 0 for kk in ks)
    chosen = raw.gather(-1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(-1).tolist()
    top_vals, top_ids = (t.tolist() for t in torch.topk(raw, k, dim=-1)) if k else (None, None)
    out: list[Logprobs | None] = []
    for i, kk in enumerate(ks):
        if kk is None:
            out.append(None)
            continue
        out.append(Logprobs(tokens[i], chosen[i], list(zip(top_ids[i][:kk], top_vals[i][:kk])) if kk else []))
    return out


def sample_batch(logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[list[int], list[Logprobs | None]]:
    """Sample one token per row with per-row parameters.

    Order (vLLM's): on the raw logits, the structured-output grammar's mask (``token_mask``), the
    ``allowed_token_ids`` mask, ``logit_bias``, the
    min_tokens mask of stop ids, then the repetition/presence/frequency penalties; then greedy rows
    take the argmax;
    the others divide by their temperature, apply top-k, top-p, min-p (each on the renormalised
    result of the one before, as :func:`apply_filters`) and draw with their own generator
    (:func:`_inverse_transform`: one uniform per row, no per-token noise).

    Args:
        logits: (S, vocab) float logits, any float dtype (computed in fp32).
        rows: S row descriptions.
    Returns:
        ``(token_ids, logprobs)``: S ints, and per row a :class:`Logprobs` when
        ``params.logprobs`` is set, else None.
    """
    adjusted = adjusted_logits(logits, rows)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) == len(rows):  # every row samples: no argmax, no gather of the rows
        tokens = _inverse_transform(_filtered(adjusted, rows), [r.generator for r in rows])
    else:
        tokens = kernels.argmax(adjusted)  # (S,) greedy rows keep these
    if random_rows and len(random_rows) < len(rows):
        idx = torch.tensor(random_rows, device=adjusted.device)
        probs = _filtered(adjusted[idx], [rows[i] for i in random_rows])
        tokens[idx] = _inverse_transform(probs, [rows[i].generator for i in random_rows])
    token_list = tokens.tolist()
    return token_list, token_logprobs(logits, token_list, [r.params.logprobs for r in rows])
