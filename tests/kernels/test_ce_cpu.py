"""The native bf16 row pass of the CPU fused linear + cross-entropy (baige/kernels/ce_cpu.py, cpu/ce_bf16.c)
against its PyTorch twin (reference._ce_rows_torch) on every instruction-set variant, and the whole op with
it against the reference op and the fp64 definition."""

import pytest
import torch

from baige import kernels
from baige.kernels import ce_cpu, reference
from baige.kernels.cpu import isa


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (2^(exponent - 7)), the smallest normal's for zeros."""
    e = torch.floor(torch.log2(x.double().abs().clamp(min=2.0**-126)))
    return 2.0 ** (e - 7)


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("vocab", [1000, 49157])  # a tail past the 16- and 8-lane loops; SmolLM2-sized
def test_native_rows_match_torch(native_kernel, use_isa, variant, vocab):
    use_isa(variant)
    g = torch.Generator().manual_seed(vocab)
    n = 37
    logits = (torch.randn(n, vocab, generator=g) * 4).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[0], t[1] = vocab - 1, 0  # the last and first columns
    valid = torch.ones(n, dtype=torch.bool)
    valid[5::6] = False
    scale = valid.float() / 123.0
    loss_t, grad_t = reference._ce_rows_torch(logits.clone(), t, valid, scale, True)
    loss_n, grad_n = ce_cpu._rows_native(logits.clone(), t, valid, scale, True)
    assert grad_n.dtype == torch.bfloat16 and grad_n.shape == (n, vocab)
    torch.testing.assert_close(loss_n, loss_t, rtol=1e-6, atol=0)
    # the same fp32 values up to a few ulps before the rounding to bf16: at most one bf16 step apart
    diff = (grad_n.double() - grad_t.double()).abs()
    assert (diff <= _bf16_ulp(grad_t) + 1e-30).all(), diff.max()
    assert not grad_n[~valid].any()  # ignored rows: zero gradient
    loss_only, none = ce_cpu._rows_native(logits.clone(), t, valid, scale, False)
    assert none is None and torch.equal(loss_only, loss_n)


def test_native_rows_refuse_a_target_outside_the_vocabulary(native_kernel):
    logits = torch.zeros(2, 10, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match="outside"):
        ce_cpu._rows_native(logits, torch.tensor([3, 10]), torch.tensor([True, True]), torch.ones(2), True)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fused_ce_with_native_rows_against_reference_and_fp64(native_kernel, weight_dtype):
    # the op as the trainer calls it (kernels.fused_linear_cross_entropy, bf16 hidden): loss and gradients
    # as the pure-PyTorch reference's, and near the fp64 definition; two token chunks (grad_w accumulated)
    g = torch.Generator().manual_seed(3)
    n, hidden, vocab = 700, 48, 30000
    h = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(weight_dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::9] = -100
    assert ce_cpu.native_usable(h)
    out = {}
    for name, fn in (("native", kernels.fused_linear_cross_entropy), ("ref", reference.fused_linear_cross_entropy)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww, t, normalizer=600.0)
        (3.0 * loss).backward()
        out[name] = (loss.detach(), hh.grad, ww.grad)
    hh, ww = h.double().requires_grad_(), w.to(torch.bfloat16).double().requires_grad_()
    exact = torch.nn.functional.cross_entropy(hh @ ww.t(), t, ignore_index=-100, reduction="sum") / 600.0
    (3.0 * exact).backward()
    exact = (exact.detach(), hh.grad, ww.grad)
    torch.testing.assert_close(out["native"][0], out["ref"][0], rtol=1e-6, atol=0)
    for i, what in ((1, "grad hidden"), (2, "grad weight")):
        got, ref, ex = (x[i].double() for x in (out["native"], out["ref"], exact))
        assert out["native"][i].dtype == out["ref"][i].dtype
        err, ref_err = (got - ex).abs().max().item(), (ref - ex).abs().max().item()
        assert err <= 1.5 * ref_err + 1e-6, f"{what}: {err} vs the reference's {ref_err}"
    assert abs(out["native"][0].item() - exact[0].item()) <= 1e-3 * exact[0].item()
