"""kernels.token_logprobs (baige/kernels/logprobs_cpu.py): the native bf16 CPU path's logprobs, gradient
and entropies against the PyTorch reference and the fp64 definition on every instruction-set variant;
other dtypes and BAIGE_KERNELS=reference take the reference itself; a bad target id is an IndexError."""

import pytest
import torch

from baige import kernels
from baige.kernels import logprobs_cpu
from baige.kernels.cpu import isa


def _inputs(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 4).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[0], t[1] = vocab - 1, 0  # the last and first columns
    return logits, t, torch.randn(n, generator=g)


def _run(fn, logits, t, grad):
    z = logits.clone().requires_grad_()
    lp, ent = fn(z, t, True)
    lp.backward(grad)
    return lp.detach(), ent, z.grad


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("vocab", [1000, 49157])  # a tail past the vector loops; SmolLM2-sized
def test_native_token_logprobs_against_reference_and_fp64(native_kernel, use_isa, variant, vocab):
    use_isa(variant)
    logits, t, grad = _inputs(37, vocab, vocab)
    assert logprobs_cpu.native_usable(logits)
    lp, ent, dz = _run(kernels.token_logprobs, logits, t, grad)
    ref_lp, ref_ent, ref_dz = _run(logprobs_cpu.reference_token_logprobs, logits, t, grad)
    assert lp.dtype == ent.dtype == torch.float32 and dz.dtype == torch.bfloat16
    # the fp64 definition on the same bf16 logits
    logp = torch.log_softmax(logits.double(), -1)
    exact_lp, exact_ent = logp.gather(1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    exact_dz = grad.double()[:, None] * (torch.nn.functional.one_hot(t, vocab).double() - logp.exp())
    for got, ref, exact, what in ((lp, ref_lp, exact_lp, "logprob"), (ent, ref_ent, exact_ent, "entropy")):
        err, ref_err = (got.double() - exact).abs().max(), (ref.double() - exact).abs().max()
        assert err <= 2 * ref_err + 1e-5, f"{what}: {err} vs the reference's {ref_err}"
    # the gradient: fp32 values rounded once to bf16, as the reference's (at most one bf16 step apart)
    step = 2.0 ** (torch.floor(torch.log2(exact_dz.abs().clamp(min=2.0**-126))) - 7)
    assert ((dz.double() - exact_dz).abs() <= step + 1e-30).all()
    assert ((dz.double() - ref_dz.double()).abs() <= step + 1e-30).all()


def test_token_logprobs_refuses_a_target_outside_the_vocabulary(native_kernel):
    with pytest.raises(IndexError, match="outside"):
        kernels.token_logprobs(torch.zeros(2, 10, dtype=torch.bfloat16), torch.tensor([3, 10]))


def test_other_dtypes_and_the_reference_setting_take_the_reference(monkeypatch):
    logits, t, grad = _inputs(5, 300, 1)
    fp32 = logits.float()
    got, ref = _run(kernels.token_logprobs, fp32, t, grad), _run(logprobs_cpu.reference_token_logprobs, fp32, t, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))  # fp32: the reference itself, bit for bit
    lp, none = kernels.token_logprobs(fp32, t)
    assert none is None and torch.equal(lp, ref[0])
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    kernels.reload_settings()
    try:
        assert not logprobs_cpu.native_usable(logits)
        got, ref = (
            _run(kernels.token_logprobs, logits, t, grad),
            _run(logprobs_cpu.reference_token_logprobs, logits, t, grad),
        )
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    finally:
        monkeypatch.delenv("BAIGE_KERNELS")
        kernels.reload_settings()
