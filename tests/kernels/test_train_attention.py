"""The materialised causal attention for short bf16 / fp16 CPU training sequences
(baige/kernels/train_attention.py): its forward and gradients against the fp64 definition (SDPA in fp64),
no worse than PyTorch's own attention at the same precision, and the dispatch of kernels.attention."""

import pytest
import torch
from kernel_checks import assert_close_fp64

from baige import kernels
from baige.kernels import reference, train_attention


def _inputs(B, T, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, h, D, generator=g) for h in (H, Hkv, Hkv, H))
    return [t.to(dtype) for t in (q, k, v)], do.to(dtype)


def _run(fn, ins, do, cast):
    xs = [t.detach().to(cast).requires_grad_() for t in ins]
    o = fn(*xs)
    o.backward(do.to(cast))
    return [o.detach()] + [t.grad for t in xs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,T,H,Hkv,D", [(2, 37, 6, 2, 16), (1, 128, 4, 4, 32), (2, 9, 3, 1, 8)])
def test_materialized_attention_against_fp64(dtype, B, T, H, Hkv, D):
    # GQA (3 query heads per K/V head), MHA and MQA, odd lengths; out and the three gradients
    ins, do = _inputs(B, T, H, Hkv, D, dtype)
    scale = D**-0.5
    got = _run(lambda q, k, v: train_attention.causal_attention(q, k, v, scale), ins, do, dtype)
    sdpa = _run(lambda q, k, v: reference.attention(q, k, v, scale), ins, do, dtype)
    exact = _run(lambda q, k, v: reference.attention(q, k, v, scale), ins, do, torch.float64)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert got[i].dtype == dtype
        assert_close_fp64(got[i], sdpa[i], exact[i], name=f"{what} {dtype}")


def test_materialized_attention_is_the_causal_definition():
    # fp32 inputs (the scores' precision): equal to the masked-softmax definition in fp64 to fp32 rounding
    ins, do = _inputs(2, 21, 4, 2, 8, torch.float32, seed=3)
    got = _run(lambda q, k, v: train_attention.causal_attention(q, k, v, 0.3), ins, do, torch.float32)
    exact = _run(lambda q, k, v: reference.attention(q, k, v, 0.3), ins, do, torch.float64)
    for a, b in zip(got, exact):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_kernels_attention_dispatch(monkeypatch):
    ins, _ = _inputs(1, 64, 4, 2, 16, torch.bfloat16, seed=5)
    q, k, v = (t.clone().requires_grad_() for t in ins)
    assert train_attention.use_materialized(q, k, 0)
    assert torch.equal(kernels.attention(q, k, v, 0.25), train_attention.causal_attention(q, k, v, 0.25))
    assert not train_attention.use_materialized(q, k, 1)  # an offset query block: the general path
    with torch.no_grad():  # inference: PyTorch's attention
        assert not train_attention.use_materialized(q, k, 0)
    long_q = torch.zeros(1, train_attention.MAX_LEN + 1, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    assert not train_attention.use_materialized(long_q, long_q, 0)
    fp32 = q.detach().float().requires_grad_()
    assert not train_attention.use_materialized(fp32, fp32, 0)  # fp32 keeps the flash kernel
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    kernels.reload_settings()
    try:
        assert not train_attention.use_materialized(q, k, 0)
        assert torch.equal(kernels.attention(q, k, v, 0.25), reference.attention(q, k, v, 0.25))
    finally:
        monkeypatch.delenv("BAIGE_KERNELS")
        kernels.reload_settings()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_materialized_masked_attention_against_fp64(dtype):
    # an arbitrary mask (every query row keeps key 0), more keys than queries, GQA; out and the gradients
    ins, do = _inputs(2, 23, 6, 2, 16, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    k_more = [torch.randn(2, 31, 2, 16, generator=g).to(dtype) for _ in range(2)]
    ins = [ins[0], *k_more]
    mask = torch.rand(2, 23, 31, generator=g) < 0.4
    mask[:, :, 0] = True
    scale = 0.25
    got = _run(lambda q, k, v: train_attention.masked_attention(q, k, v, scale, mask), ins, do, dtype)
    sdpa = _run(lambda q, k, v: reference.masked_attention(q, k, v, scale, mask), ins, do, dtype)
    exact = _run(lambda q, k, v: reference.masked_attention(q, k, v, scale, mask), ins, do, torch.float64)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert got[i].dtype == dtype
        assert_close_fp64(got[i], sdpa[i], exact[i], name=f"{what} {dtype}")


def test_kernels_masked_attention_dispatch():
    ins, _ = _inputs(2, 40, 4, 2, 16, torch.bfloat16, seed=9)
    q, k, v = (t.clone().requires_grad_() for t in ins)
    mask = torch.ones(40, 40, dtype=torch.bool).tril(3)[None].expand(2, 40, 40)
    assert train_attention.use_materialized_masked(q, k)
    got = kernels.masked_attention(q, k, v, 0.25, mask)
    assert torch.equal(got, train_attention.masked_attention(q, k, v, 0.25, mask))
    with torch.no_grad():  # inference: PyTorch's attention
        assert not train_attention.use_materialized_masked(q, k)
    long_k = torch.zeros(2, train_attention.MAX_LEN + 1, 2, 16, dtype=torch.bfloat16)
    assert not train_attention.use_materialized_masked(q, long_k)
    fp32 = q.detach().float().requires_grad_()
    assert not train_attention.use_materialized_masked(fp32, fp32)
    sinks = torch.zeros(4)  # sinks / soft-cap: the reference
    assert torch.equal(
        kernels.masked_attention(q, k, v, 0.25, mask, sinks=sinks),
        reference.masked_attention(q, k, v, 0.25, mask, sinks=sinks),
    )
