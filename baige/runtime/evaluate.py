"""Perplexity and model-to-model agreement over a text file.

Perplexity follows HF transformers' perplexity guide ("Perplexity of fixed-length models",
https://huggingface.co/docs/transformers/perplexity) with ``stride = max_length``: the first N
tokens are cut into consecutive non-overlapping windows of ``seq_len`` tokens (the last may be
shorter); inside a window every token after the first is predicted from the ones before it and no
context crosses a window boundary. ``ppl = exp(sum of token NLLs / number of predicted tokens)``,
each window contributing ``len(window) - 1`` predictions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baige.errors import BaigeError
from baige.runtime.config import EvalConfig
from baige.runtime.model.device import resolve_device
from baige.runtime.model.tokenizer import Tokenizer, read_tokens
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model

ProgressFn = Callable[[int, int], None]  # (windows done, windows total)


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """Non-overlapping [begin, end) windows of ``seq_len`` over ``n_tokens``; a last window of 1 token
    (nothing to predict) is dropped."""
    if seq_len < 2:
        raise BaigeError(f"--seq-len must be at least 2, got {seq_len}")
    return [(b, min(b + seq_len, n_tokens)) for b in range(0, n_tokens, seq_len) if min(b + seq_len, n_tokens) - b >= 2]


@torch.no_grad()
def window_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """(T,) token ids -> (T-1, vocab) float32 log-probabilities of tokens 1..T-1 under causal attention."""
    device = next(model.parameters()).device
    x = ids.to(device)[None]  # (1, T)
    positions = torch.arange(x.shape[1], device=device)[None]  # (1, T)
    logits = model.compute_logits(model(x, positions))[0, :-1]  # (T-1, vocab)
    return F.log_softmax(logits.float(), dim=-1)


@dataclass
class PerplexityResult:
    perplexity: float
    nll_per_token: float  # nats
    predicted_tokens: int
    n_windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "nll_per_token_nats": self.nll_per_token,
            "predicted_tokens": self.predicted_tokens,
            "windows": self.n_windows,
            "seq_len_tokens": self.seq_len,
        }


def perplexity(model, ids: torch.Tensor, seq_len: int = 1024, progress: ProgressFn | None = None) -> PerplexityResult:
    """Token-level perplexity of ``model`` over ``ids`` (N,) with non-overlapping windows (module docstring).

    Raises BaigeError when ``seq_len`` < 2.
    """
    spans = windows(len(ids), seq_len)
    nll, count = 0.0, 0
    for i, (b, e) in enumerate(spans):
        logp = window_logprobs(model, ids[b:e])  # (T-1, vocab)
        target = ids[b + 1 : e].to(logp.device)
        nll += -logp.gather(1, target[:, None]).sum().item()
        count += e - b - 1
        if progress:
            progress(i + 1, len(spans))
    return PerplexityResult(math.exp(nll / count), nll / count, count, len(spans), seq_len)


@dataclass
class CompareResult:
    a: PerplexityResult
    b: PerplexityResult
    kl_divergence: float  # mean over predicted positions of KL(P_a || P_b), nats
    top1_agreement: float  # fraction of positions where both argmax tokens agree

    def to_dict(self) -> dict:
        return {
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "mean_kl_divergence_nats": self.kl_divergence,
            "top1_agreement": self.top1_agreement,
        }


def compare(
    model_a, model_b, ids: torch.Tensor, seq_len: int = 1024, progress: ProgressFn | None = None
) -> CompareResult:
    """Perplexity of both models plus ``mean KL(P_a || P_b)`` of the next-token distributions
    (``sum_v p_a(v) (log p_a(v) - log p_b(v))``, nats, averaged over every predicted position) and the
    top-1 agreement (fraction of positions with equal argmax), on the same windows as :func:`perplexity`.

    Raises BaigeError when the two vocabularies differ in size.
    """
    spans = windows(len(ids), seq_len)
    nll_a = nll_b = kl = 0.0
    agree = count = 0
    for i, (b, e) in enumerate(spans):
        la, lb = window_logprobs(model_a, ids[b:e]), window_logprobs(model_b, ids[b:e])  # (T-1, vocab)
        if la.shape[-1] != lb.shape[-1]:
            raise BaigeError(f"the models' vocabularies differ ({la.shape[-1]} vs {lb.shape[-1]} tokens)")
        lb = lb.to(la.device)
        target = ids[b + 1 : e].to(la.device)[:, None]
        nll_a += -la.gather(1, target).sum().item()
        nll_b += -lb.gather(1, target).sum().item()
        kl += (la.exp() * (la - lb)).sum().item()
        agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
        count += e - b - 1
        if progress:
            progress(i + 1, len(spans))
    pa = PerplexityResult(math.exp(nll_a / count), nll_a / count, count, len(spans), seq_len)
    pb = PerplexityResult(math.exp(nll_b / count), nll_b / count, count, len(spans), seq_len)
    return CompareResult(pa, pb, kl / count, agree / count)


def _load(spec: str | None, cfg: EvalConfig):
    model_dir = resolve_model(spec)
    return model_dir, load_model(model_dir, cfg.dtype, resolve_device(cfg.device))


def evaluate_ppl(cfg: EvalConfig, progress: ProgressFn | None = None) -> dict:
    """``baige eval ppl``: the JSON-ready result for ``cfg.models[0]`` (adds ``model`` and ``data``)."""
    model_dir, model = _load(cfg.models[0], cfg)
    ids = read_tokens(Tokenizer.from_dir(model_dir), cfg.data, cfg.max_tokens)
    result = perplexity(model, ids, cfg.seq_len, progress)
    return {"model": str(model_dir), "data": str(cfg.data), **result.to_dict()}


def evaluate_compare(cfg: EvalConfig, progress: ProgressFn | None = None) -> dict:
    """``baige eval compare``: both perplexities, mean KL(P_a || P_b) and top-1 agreement, tokenized
    with model A's tokenizer."""
    dir_a, model_a = _load(cfg.models[0], cfg)
    dir_b, model_b = _load(cfg.models[1], cfg)
    ids = read_tokens(Tokenizer.from_dir(dir_a), cfg.data, cfg.max_tokens)
    result = compare(model_a, model_b, ids, cfg.seq_len, progress)
    return {"model_a": str(dir_a), "model_b": str(dir_b), "data": str(cfg.data), **result.to_dict()}
