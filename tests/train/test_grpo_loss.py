"""GRPO's loss pieces against hand-computed values: group advantages, the asymmetric clipped
surrogate, the k3 KL, truncated importance sampling, the aggregation modes and the token masks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from train_utils import tiny_model

from baige.runtime.train.rl import loss as L
from baige.runtime.train.rl.batch import micro_batches, policy_logprobs
from baige.runtime.train.rl.rollout import Sample


def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 1.0]])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal; group 3: mean 1, std sqrt(2/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    b = 1.0 / (math.sqrt(2 / 3) + 1e-6)
    expected = torch.tensor([[a, -a, -a, a], [0.0] * 4, [b, 0.0, -b, 0.0]])
    torch.testing.assert_close(L.group_advantages(rewards), expected, rtol=1e-6, atol=1e-7)
    centred = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [1.0, 0.0, -1.0, 0.0]])
    torch.testing.assert_close(L.group_advantages(rewards, norm_by_std=False), centred)


def test_clipped_objective_with_asymmetric_clips():
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.7, 1.25]])
    old = torch.log(torch.tensor([[0.2, 0.4, 0.3, 0.5, 0.4]]))
    logprobs = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])  # per token
    loss, clipped = L.policy_loss(logprobs, old, adv, clip_low=0.2, clip_high=0.28)
    # max(-A r, -A clip(r, 0.8, 1.28)): r=1.5,A=+1 -> -1.28 (clipped); r=0.5,A=+1 -> -0.5 (the pessimistic
    # unclipped term); r=1.1,A=-1 -> 1.1; r=0.7,A=-1 -> 0.8 (clipped); r=1.25,A=+1 -> -1.25 (inside 1.28:
    # a symmetric 0.2 clip would have cut it to -1.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, 1.1, 0.8, -1.25]]))
    assert clipped.tolist() == [[True, False, False, True, False]]
    loss.sum().backward()
    # d/dlogp of -A r is -A r where unclipped; clipped tokens pass no gradient
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, 1.1, 0.0, -1.25]]))
    # per-sequence advantages broadcast over the tokens; weights multiply the per-token loss
    loss_seq, _ = L.policy_loss(old, old, torch.tensor([2.0]), 0.2, 0.2, weights=torch.full((1, 5), 0.5))
    torch.testing.assert_close(loss_seq, torch.full((1, 5), -1.0))


def test_k3_kl():
    p, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    k3 = L.kl_k3(p.log(), ref.log())
    # one value by hand: d = log(0.2/0.5); exp(d) - d - 1 = 0.4 - log(0.4) - 1
    assert k3[0].item() == pytest.approx(0.4 - math.log(0.4) - 1, rel=1e-6)
    assert k3[1].item() == 0.0  # equal probabilities
    # its expectation under p is KL(p || ref) exactly: sum p (ref/p) - sum p log(ref/p) - 1
    kl = sum(pi * math.log(pi / ri) for pi, ri in zip(p.tolist(), ref.tolist()))
    assert (p * k3).sum().item() == pytest.approx(kl, rel=1e-6)
    assert (k3 >= 0).all()


def test_tis_weights():
    old = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    engine = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    torch.testing.assert_close(L.tis_weights(old, engine, cap=1.5), torch.tensor([1.5, 0.5, 1.0]))


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / (2 * 4)),  # Dr. GRPO: / (sequences x max_tokens)
    ],
)
def test_aggregation_modes_ignore_what_is_off_the_mask(mode, expected):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = torch.tensor([[1.0, 2.0, math.inf], [4.0, 1e9, -math.inf]])
    assert L.aggregate(loss, mask, mode, num_tokens=3, num_seqs=2, max_tokens=4).item() == pytest.approx(expected)


def _sample(prompt, completion, lps=None, group=0):
    return Sample(group, prompt, completion, lps or [-1.0] * len(completion), "", "stop")


def test_micro_batch_packs_each_prompt_once():
    """Hand-written layout: samples 0 and 1 share prompt [5, 6, 7] (group 0) and go in one row; sample 2
    (group 1) starts another; the third micro-batch of size 3 is not reached."""
    s0 = _sample([5, 6, 7], [8, 9], [-0.5, -0.25])
    s1 = _sample([5, 6, 7], [4, 4, 4], [-1.0, -2.0, -3.0])
    s2 = _sample([3, 3], [2], group=1)
    s3 = _sample([3, 3], [1, 1], group=1)
    (mb, rest) = micro_batches([s0, s1, s2, s3], [1.0, -1.0, 0.5, 0.25], 3, torch.device("cpu"))
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 4, 4], [3, 3, 2, 0, 0, 0, 0, 0]]  # right-padded
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert mb.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, -1, -1, -1, -1, -1]]
    # row width 8: sample 0's tokens come from positions 2 (the prompt's last) and 3; sample 1's from 2, 5, 6
    assert mb.sources.tolist() == [[2, 3, 0], [2, 5, 6], [9, 0, 0]]
    assert mb.targets.tolist() == [[8, 9, 0], [4, 4, 4], [2, 0, 0]]
    assert mb.mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert mb.engine_logprobs.tolist() == [[-0.5, -0.25, 0], [-1, -2, -3], [-1, 0, 0]]
    assert mb.advantages.tolist() == [1.0, -1.0, 0.5] and mb.num_seqs == 3
    assert mb.forward_tokens(False) == 8 + 3 and mb.forward_tokens(True) == 5 + 6 + 3
    m = mb.attention_mask()[0].int().tolist()
    assert m[4] == [1, 1, 1, 1, 1, 0, 0, 0]  # sample 0's second token: the prompt and its own first token
    assert m[6] == [1, 1, 1, 0, 0, 1, 1, 0]  # sample 1's second token: not sample 0's tokens
    assert mb.attention_mask()[1, 5].int().tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # padding: itself only
    assert rest.input_ids.tolist() == [[3, 3, 1, 1]] and rest.sources.tolist() == [[1, 2]]


def test_prompt_and_padding_carry_no_loss(tmp_path, one_thread):
    """On a tiny model: packed logprobs equal each sequence's own causal forward (so the shared-prefix
    mask hides the other completions), the policy loss has no gradient off the mask, changing the
    padding changes nothing, and the per-sequence path (batch-invariant) gives the same logprobs."""
    from baige.runtime.model.logprobs import sequence_logprobs
    from baige.runtime.weights.loader import load_model

    model = load_model(tiny_model(tmp_path / "m"), dtype=torch.float32, device="cpu")
    samples = [
        _sample([1, 20, 21, 22], [30, 31]),
        _sample([1, 20, 21, 22], [35, 36, 37]),
        _sample([1, 40], [41, 42, 43, 44, 45], group=1),
    ]
    (mb,) = micro_batches(samples, [1.0, -1.0, 0.5], 3, torch.device("cpu"))
    assert mb.input_ids.shape[0] == 2  # the first two share a row
    lp, entropy = policy_logprobs(model, mb, batch_invariant=False, entropy=True)
    assert ((lp != 0) == mb.mask.bool()).all() and ((entropy > 0) == mb.mask.bool()).all()
    for i, s in enumerate(samples):
        alone = sequence_logprobs(model, torch.tensor(s.prompt_ids + s.completion_ids), batch_invariant=False)
        n = len(s.completion_ids)
        torch.testing.assert_close(lp[i, :n], alone[-n:].detach(), rtol=0, atol=1e-5)
    leaf = lp.detach().requires_grad_()
    per_token, _ = L.policy_loss(leaf, lp.detach(), mb.advantages, 0.2, 0.2)
    L.aggregate(per_token, mb.mask, "token-mean", float(mb.mask.sum()), 3, 8).backward()
    on = mb.mask.bool()
    assert (leaf.grad[~on] == 0).all() and (leaf.grad[on] != 0).all()
    repadded = copy.copy(mb)
    repadded.input_ids = mb.input_ids.clone()
    repadded.input_ids[1, 7:] = 77  # row 1's padding
    lp2, _ = policy_logprobs(model, repadded, batch_invariant=False)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-6)
    lp3, _ = policy_logprobs(model, mb, batch_invariant=True)
    torch.testing.assert_close(lp3, lp, rtol=0, atol=1e-5)


def test_block_attention_equals_the_shared_prefix_mask():
    """The bf16 / fp16 CPU attention of packed rows by blocks (each prompt over itself, each completion
    over its prompt and itself) equals masked attention under the full (R, L, L) mask at every real
    position, outputs and gradients (fp64, to rounding); padding positions get zeros (the block
    kernel itself, materialised in bf16, is checked in tests/kernels/test_train_attention.py)."""
    from baige import kernels
    from baige.runtime.train.rl.batch import _block_attention

    samples = [
        _sample([5, 6, 7], [8, 9]),
        _sample([5, 6, 7], [4, 4, 4]),
        _sample([3, 3], [2], group=1),
        _sample([3, 3], [1, 1, 1, 1], group=1),
        _sample([9], [1], group=2),
    ]
    (mb,) = micro_batches(samples, [1.0] * 5, 5, torch.device("cpu"))
    # rows of width 8: prompts at 0-2, 8-9, 16; completions at 3-4, 5-7 | 10, 11-14 | 17
    assert mb.blocks.out.tolist() == [0, 1, 2, 8, 9, 16, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 17]
    R, L = mb.input_ids.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(R, L, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    real = (mb.segments != -1)[..., None, None]
    do = torch.randn(R, L, 4, 8, generator=g, dtype=torch.float64) * real
    ref = kernels.masked_attention(q, k, v, 0.3, mb.attention_mask())
    got = _block_attention(mb.blocks, q, k, v, 0.3)
    assert (got * ~real == 0).all()
    torch.testing.assert_close(got * real, ref * real, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bf16_packed_logprobs_take_the_block_attention(tmp_path, one_thread, monkeypatch):
    """A bf16 model's packed logprobs go through the block attention (not the full mask) and agree with
    each sequence's own causal forward (the same materialised attention scheme) to well within bf16 rounding."""
    from baige.runtime.model.logprobs import sequence_logprobs
    from baige.runtime.train.rl import batch as B
    from baige.runtime.weights.loader import load_model

    model = load_model(tiny_model(tmp_path / "m"), dtype=torch.bfloat16, device="cpu")
    samples = [_sample([1, 20, 21, 22], [30, 31]), _sample([1, 20, 21, 22], [35, 36, 37]), _sample([1, 40], [41])]
    (mb,) = micro_batches(samples, [1.0, -1.0, 0.5], 3, torch.device("cpu"))
    calls, block = [], B._block_attention
    monkeypatch.setattr(B, "_block_attention", lambda *a: calls.append(1) or block(*a))
    lp, _ = policy_logprobs(model, mb, batch_invariant=False)
    assert len(calls) == model.config.num_hidden_layers
    for i, s in enumerate(samples):
        alone = sequence_logprobs(model, torch.tensor(s.prompt_ids + s.completion_ids), batch_invariant=False)
        n = len(s.completion_ids)
        torch.testing.assert_close(lp[i, :n], alone[-n:].detach(), rtol=0, atol=1e-3)
