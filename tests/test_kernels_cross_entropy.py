"""Triton fused linear + cross-entropy against the PyTorch reference and fp64 (interpreter on CPU)."""

import pytest
import torch

from baige import kernels
from baige.kernels import reference
from kernel_checks import DEVICE, DTYPES, assert_close_fp64, rand, triton_kernels


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
