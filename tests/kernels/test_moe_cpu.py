"""CPU inference's routed experts (kernels.moe_cpu) and oneDNN's fp32 linear against fp64."""

import pytest
import torch

from baige import kernels
from baige.kernels import moe_cpu, reference


def _oracle(x, w13, w2, tw, ti):
    return reference.fused_moe(x.double(), w13.double(), w2.double(), tw.double(), ti)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 7, 2), (97, 7, 2), (300, 4, 1), (200, 3, 3)])
@pytest.mark.parametrize("onednn", ["1", "0"])
def test_moe_cpu_matches_fp64(monkeypatch, tokens, experts, top_k, onednn):
    # 300 tokens over 4 experts: ~75 rows each (the transposed, 16-padded path); 1 token: the few-rows path
    monkeypatch.setenv("BAIGE_CPU_ONEDNN", onednn)
    kernels.reload_settings()
    g = torch.Generator().manual_seed(tokens)
    H, inter = 60, 23
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(experts, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(experts, H, inter, generator=g) * 0.2
    tw, ti = kernels.moe_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    with torch.inference_mode():
        got = moe_cpu.fused_moe(x, w13, w2, tw, ti)
    want = _oracle(x, w13, w2, tw, ti)
    assert got.dtype == torch.float32 and got.shape == (tokens, H)
    assert (got.double() - want).abs().max().item() < 1e-4
    kernels.reload_settings()


def test_onednn_linear_matches_fp64_with_bias_and_strided_x():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 130, generator=g)[:, 1:129]  # non-contiguous rows
    w, b = torch.randn(33, 128, generator=g), torch.randn(33, generator=g)
    got = kernels.onednn_linear(x, w, b)
    want = x.double() @ w.double().t() + b.double()
    assert got.shape == (70, 33) and (got.double() - want).abs().max().item() < 1e-4


def test_dense_linear_keeps_autograd_off_onednn():
    w = torch.randn(8, 16, requires_grad=True)
    y = kernels.dense_linear(torch.randn(200, 16), w)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (8, 16)
