import pytest
import torch

from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplingParams, apply_filters, sample


def test_temperature_zero_is_greedy_whatever_the_filters():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.99]])
    p = SamplingParams(temperature=0.0, top_p=0.01, top_k=3, min_p=0.9)
    assert sample(logits, p).tolist() == [1, 0]


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    out = apply_filters(logits, top_k=2, top_p=1.0, min_p=0.0)
    assert torch.isfinite(out).tolist() == [[False, True, True, False, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two tokens survive
    assert torch.isfinite(apply_filters(logits, 0, 0.7, 0.0)).tolist() == [[True, True, False, False]]
    # p = 0.5 exactly is reached by the first token alone
    assert torch.isfinite(apply_filters(logits, 0, 0.5, 0.0)).tolist() == [[True, False, False, False]]


def test_min_p_scales_with_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # threshold 0.4 * 0.5 = 0.2 keeps 0.5 and 0.3
    assert torch.isfinite(apply_filters(probs.log(), 0, 1.0, 0.4)).tolist() == [[True, True, False, False]]


def test_seed_reproduces_and_frequencies_follow_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(4000, -1)
    p = SamplingParams(temperature=1.0, seed=7)
    a = sample(logits, p, torch.Generator().manual_seed(7))
    b = sample(logits, p, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / len(a)
    expected = torch.tensor([0.0, 1.0, 2.0]).softmax(0)  # 0.090, 0.245, 0.665
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(min_p=2), dict(max_tokens=0)])
def test_bad_params_are_user_errors(kwargs):
    with pytest.raises(BaigeError):
        SamplingParams(**kwargs)
