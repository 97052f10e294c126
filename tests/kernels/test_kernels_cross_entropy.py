"""Triton fused linear + cross-entropy against the PyTorch reference and fp64 (interpreter on CPU)."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, assert_close_fp64, rand, triton_kernels

from baige import kernels
from baige.kernels import reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalizer", [None, 250.0])
def test_fused_linear_cross_entropy_loss_and_grads(dtype, normalizer, monkeypatch):
    N, hidden, vocab = 97, 67, 32001
    h = rand(N, hidden, dtype=dtype, seed=0)
    w = rand(vocab, hidden, dtype=dtype, scale=0.3, seed=1)
    gen = torch.Generator().manual_seed(2)
    t = torch.randint(0, vocab, (N,), generator=gen)
    t[::7] = -100  # ignored positions
    t[3] = vocab - 1
    t = t.to(DEVICE)
    results = {}
    for name, cast in (("triton", dtype), ("ref", dtype), ("exact", torch.float64)):
        hh, ww = h.detach().to(cast).requires_grad_(), w.detach().to(cast).requires_grad_()
        if name == "triton":
            with triton_kernels(monkeypatch):
                loss = kernels.fused_linear_cross_entropy(hh, ww, t, normalizer=normalizer)
        else:
            loss = reference.fused_linear_cross_entropy(hh, ww, t, normalizer=normalizer)
        (2.0 * loss).backward()  # a non-unit upstream gradient
        results[name] = (loss.detach(), hh.grad, ww.grad)
    assert results["triton"][0].dtype == torch.float32
    for i, what in enumerate(("loss", "grad hidden", "grad weight")):
        assert_close_fp64(results["triton"][i], results["ref"][i], results["exact"][i], name=f"{what} {dtype}")


def test_fused_linear_cross_entropy_matches_unfused_cross_entropy(monkeypatch):
    # the definition: torch's F.cross_entropy over materialised logits, 3-D (batch, seq, hidden) input
    h = rand(2, 9, 32, dtype=torch.float32, seed=3)
    w = rand(1000, 32, dtype=torch.float32, seed=4)
    t = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    t[0, :4] = -100
    with triton_kernels(monkeypatch):
        loss = kernels.fused_linear_cross_entropy(h, w, t)
    expected = torch.nn.functional.cross_entropy((h @ w.t()).view(-1, 1000), t.view(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def _unfused_fp64(h, w, t, normalizer, upstream):
    """Loss and gradients of the definition: F.cross_entropy over materialised fp64 logits."""
    hh, ww = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    n = normalizer if normalizer is not None else float((t != -100).sum())
    loss = torch.nn.functional.cross_entropy(hh @ ww.t(), t, ignore_index=-100, reduction="sum") / n
    (upstream * loss).backward()
    return loss.detach(), hh.grad, ww.grad


@pytest.mark.parametrize(
    "n_tokens,vocab,block",
    [
        (97, 5000, 512),  # one token chunk, a partial last vocabulary block
        (700, 30000, 512),  # two token chunks (2**24 // 30000 = 559 rows): grad_w written, then accumulated
        (6, 300, 64),  # several blocks; every target lands in some block
        (5, 40, 64),  # vocabulary smaller than one block
    ],
)
@pytest.mark.parametrize("upstream", [1.0, 3.0])  # 1.0 takes the unscaled-return path of backward
def test_reference_blocked_cross_entropy_is_exact_in_fp64(n_tokens, vocab, block, upstream, monkeypatch):
    # the blocked reference (vocab tiles, per-block max/sum merged afterwards) computes the same
    # numbers as the materialised definition: in fp64 they agree to rounding
    monkeypatch.setattr(reference, "_VOCAB_BLOCK", block)
    g = torch.Generator().manual_seed(n_tokens)
    h = torch.randn(n_tokens, 24, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, 24, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, vocab, (n_tokens,), generator=g)
    t[::4] = -100
    t[1] = vocab - 1  # the last row of the last block
    for normalizer in (None, 1000.0):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = reference.fused_linear_cross_entropy(hh, ww, t, normalizer=normalizer)
        (upstream * loss).backward()
        exp_loss, exp_gh, exp_gw = _unfused_fp64(h, w, t, normalizer, upstream)
        assert loss.dtype == torch.float32  # the loss is accumulated in fp32
        torch.testing.assert_close(loss.double(), exp_loss, rtol=1e-6, atol=0)
        assert hh.grad.dtype == ww.grad.dtype == torch.float64
        torch.testing.assert_close(hh.grad, exp_gh, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(ww.grad, exp_gw, rtol=1e-12, atol=1e-15)


def test_reference_cross_entropy_fp32_against_fp64():
    # the fp32 training path (SmolLM2-like shapes scaled down) against the fp64 definition
    g = torch.Generator().manual_seed(7)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(3000, 64, generator=g) * 0.2
    t = torch.randint(0, 3000, (300,), generator=g)
    t[:10] = -100
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = reference.fused_linear_cross_entropy(hh, ww, t)
    loss.backward()
    exp_loss, exp_gh, exp_gw = _unfused_fp64(h, w, t, None, 1.0)
    assert abs(loss.item() - exp_loss.item()) <= 1e-6 * exp_loss.item()
    for got, exp in ((hh.grad, exp_gh), (ww.grad, exp_gw)):
        assert got.dtype == torch.float32
        assert (got.double() - exp).abs().max().item() <= 1e-5 * exp.abs().max().item()


def test_reference_cross_entropy_without_weight_grad_and_all_ignored():
    h = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(100, 16)  # frozen head: only the hidden gradient
    t = torch.randint(0, 100, (8,))
    loss = reference.fused_linear_cross_entropy(h, w, t)
    loss.backward()
    expected = torch.nn.functional.cross_entropy(h.detach().double() @ w.double().t(), t)
    assert abs(loss.item() - expected.item()) < 1e-5
    assert h.grad is not None and w.grad is None
    # every target ignored, normalizer given: zero loss, zero gradients
    h2, w2 = h.detach().clone().requires_grad_(), w.clone().requires_grad_()
    loss = reference.fused_linear_cross_entropy(h2, w2, torch.full((8,), -100), normalizer=8.0)
    loss.backward()
    assert loss.item() == 0.0 and h2.grad.abs().max().item() == 0.0 and w2.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("n_tokens", [97, 700])  # one token chunk; two (grad_w written, then accumulated)
def test_reference_cross_entropy_fp32_weight_with_bf16_hidden(n_tokens):
    # mixed precision (fp32 master weight, bf16 activations): the op casts the weight itself and returns
    # an fp32 weight gradient with no bf16 round trip; loss and hidden gradient equal the all-bf16 call's
    # bitwise, the weight gradient equals its fp32 accumulator (the all-bf16 call rounds that to bf16),
    # and all three follow the fp64 definition
    g = torch.Generator().manual_seed(11)
    vocab = 30000
    h = (torch.randn(n_tokens, 64, generator=g)).to(torch.bfloat16)
    w = torch.randn(vocab, 64, generator=g) * 0.2
    t = torch.randint(0, vocab, (n_tokens,), generator=g)
    t[::5] = -100
    hm, wm = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = reference.fused_linear_cross_entropy(hm, wm, t, normalizer=500.0)
    (2.0 * loss).backward()
    assert wm.grad.dtype == torch.float32 and hm.grad.dtype == torch.bfloat16
    hb, wb = h.clone().requires_grad_(), w.to(torch.bfloat16).requires_grad_()
    loss_b = reference.fused_linear_cross_entropy(hb, wb, t, normalizer=500.0)
    (2.0 * loss_b).backward()
    assert torch.equal(loss, loss_b)
    assert torch.equal(hm.grad, hb.grad)
    assert torch.equal(wm.grad.to(torch.bfloat16), wb.grad)  # bf16(fp32 accumulator) both ways
    exp_loss, exp_gh, exp_gw = _unfused_fp64(h.float(), w.to(torch.bfloat16).float(), t, 500.0, 2.0)
    assert abs(loss.item() - exp_loss.item()) <= 2e-3 * exp_loss.item()
    assert (wm.grad.double() - exp_gw).abs().max().item() <= 2e-2 * exp_gw.abs().max().item()
