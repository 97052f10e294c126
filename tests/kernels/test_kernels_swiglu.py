"""Triton SwiGLU (silu(gate) * up) against the reference and fp64 (interpreted on CPU), fwd and bwd."""

import pytest
import torch

import baige.kernels as kernels
from baige.kernels import reference
from baige.kernels.triton_ops import swiglu
from tests.kernel_checks import DTYPES, assert_close_fp64, rand, triton_kernels


def _run(fn, gate, up, dy):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    y = fn(gate, up)
    return (y, *torch.autograd.grad(y, (gate, up), dy))


def _check(monkeypatch, gate, up, tag):
    dy = rand(*gate.shape, dtype=gate.dtype, seed=9)
    with triton_kernels(monkeypatch):
        out = _run(kernels.silu_mul, gate, up, dy)
    ref = _run(reference.silu_mul, gate, up, dy)
    exact = _run(reference.silu_mul, gate.double(), up.double(), dy.double())
    for name, o, r, e in zip(("y", "dgate", "dup"), out, ref, exact):
        assert o.dtype == r.dtype, name
        assert_close_fp64(o, r, e, name=f"{name} {tag}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1023), (7, 11, 96), (3, 2500)])
def test_silu_mul(monkeypatch, dtype, shape):
    # (3, 2500) spans three column blocks per row (MAX_BLOCK = 1024) with a partial last one.
    gate = rand(*shape, dtype=dtype, scale=3.0, seed=0)
    up = rand(*shape, dtype=dtype, seed=1)
    _check(monkeypatch, gate, up, f"{dtype} {shape}")


def test_shapes_cover_several_column_blocks():
    assert swiglu.MAX_BLOCK < 2500 < 3 * swiglu.MAX_BLOCK


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_halves_of_fused_projection(monkeypatch, dtype):
    """gate and up as the two halves of one (B, T, 2 * I) tensor: row-strided views."""
    inter = 300
    fused = rand(2, 5, 2 * inter, dtype=dtype, scale=2.0, seed=2)
    gate, up = fused[..., :inter], fused[..., inter:]
    assert not gate.is_contiguous()
    _check(monkeypatch, gate, up, f"halves {dtype}")
