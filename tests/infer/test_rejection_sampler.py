"""The rejection sampler is exact: emitted tokens follow the target distribution whatever the draft
distribution (chi-square goodness of fit over a 16-token vocabulary), and a wrong acceptance rule
is caught by the same test."""

import math

import numpy as np
import pytest
import torch

from baige.runtime.infer.sampling import SamplerRow, SamplingParams, target_probs
from baige.runtime.infer.spec_decode import rejection
from baige.runtime.infer.spec_decode.rejection import verify

V, K, N_TOKENS = 16, 3, 20_000
TARGET_LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.3, 0.0, -0.2, -0.5, -0.8, -1.0, -1.5, -2.0, -2.5, -3.0])
DRAFT_LOGITS = TARGET_LOGITS.roll(5) * 0.5  # a flatter distribution that favours other tokens


def expected(temperature: float, top_p: float) -> np.ndarray:
    """The target distribution by hand (numpy): softmax(logits / T), then the smallest prefix of the
    sorted tokens whose mass reaches top_p, renormalised."""
    z = TARGET_LOGITS.numpy().astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(V, bool)
    mass = 0.0
    for t in order:
        if mass >= top_p:
            break
        keep[t] = True
        mass += p[t]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test; tokens of zero probability must never appear."""
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    exp = probs[support] * counts.sum()
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def emitted_counts(temperature: float, top_p: float, deterministic_draft: bool, seed: int = 0) -> np.ndarray:
    params = SamplingParams(temperature=temperature, top_p=top_p)
    p = target_probs(TARGET_LOGITS.expand(K + 1, V), [SamplerRow(params)] * (K + 1))  # (K + 1, V)
    q = torch.softmax(DRAFT_LOGITS, -1).expand(K, V)
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(V, np.int64)
    n = 0
    while n < N_TOKENS:
        if deterministic_draft:  # an n-gram proposal: always the same tokens, a one-hot q
            drafts, probs = [5, 0, 9], None
        else:
            drafts, probs = torch.multinomial(q, 1, generator=gen)[:, 0].tolist(), q
        for t in verify(p, drafts, probs, greedy=False, generator=gen):
            counts[t] += 1
            n += 1
    return counts


@pytest.mark.parametrize("top_p, deterministic_draft", [(1.0, False), (0.8, False), (0.8, True)])
def test_emitted_tokens_follow_the_target(top_p, deterministic_draft):
    counts = emitted_counts(1.0, top_p, deterministic_draft)
    assert chi_square_p(counts, expected(1.0, top_p)) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch):
    # accept any draft the target allows at all (too lenient; min(p, q), too strict, fails as well)
    monkeypatch.setattr(rejection, "accept_probability", lambda p, q: (p > 0).float())
    probs = expected(1.0, 0.8)
    counts = emitted_counts(1.0, 0.8, False)
    assert counts[probs == 0].sum() == 0  # the residual still never leaves top-p's support...
    assert chi_square_p(counts, probs) < 1e-3  # ...but the frequencies inside it are off


def test_greedy_keeps_the_prefix_equal_to_the_argmax():
    target = torch.zeros(4, V)
    target[0, 3] = target[1, 7] = target[2, 1] = target[3, 2] = 1.0  # one-hot: argmax 3, 7, 1, 2
    assert verify(target, [3, 7, 1], None, greedy=True) == [3, 7, 1, 2]  # all accepted + the bonus token
    assert verify(target, [3, 8, 1], None, greedy=True) == [3, 7]  # first mismatch: the target's token
    assert verify(target, [4, 7, 1], None, greedy=True) == [3]
    assert verify(target[:1], [], None, greedy=True) == [3]


def test_a_sure_draft_is_always_accepted_and_an_impossible_one_never():
    p = torch.zeros(2, V)
    p[0, 4], p[1, 6] = 1.0, 1.0  # the target is certain
    gen = torch.Generator().manual_seed(1)
    assert all(verify(p, [4], None, greedy=False, generator=gen) == [4, 6] for _ in range(50))
    assert all(verify(p, [5], None, greedy=False, generator=gen) == [4] for _ in range(50))  # residual = p


def test_chi_square_p_value_by_hand():
    # 2 bins, expected 50/50 of 100, observed 60/40: stat = 4, df = 1, p = erfc(sqrt(2)) = 0.0455
    assert chi_square_p(np.array([60, 40]), np.array([0.5, 0.5])) == pytest.approx(math.erfc(math.sqrt(2)), rel=1e-6)
