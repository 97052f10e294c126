"""Triton rotary embedding against the reference and fp64 (interpreted on CPU), forward and backward."""

import pytest
import torch

import baige.kernels as kernels
from baige.kernels import reference
from tests.kernel_checks import DTYPES, assert_close_fp64, rand, triton_kernels


def _run(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_rot, k_rot = fn(q, k, cos, sin)
    return (q_rot, k_rot, *torch.autograd.grad((q_rot, k_rot), (q, k), (dq, dk)))


def _check(monkeypatch, q, k, cos, sin, tag):
    dq = rand(*q.shape, dtype=q.dtype, seed=10)
    dk = rand(*k.shape, dtype=k.dtype, seed=11)
    with triton_kernels(monkeypatch):
        out = _run(kernels.apply_rope, q, k, cos, sin, dq, dk)
    ref = _run(reference.apply_rope, q, k, cos, sin, dq, dk)
    d = lambda t: t.double()  # noqa: E731
    exact = _run(reference.apply_rope, d(q), d(k), d(cos), d(sin), d(dq), d(dk))
    for name, o, r, e in zip(("q_rot", "k_rot", "dq", "dk"), out, ref, exact):
        assert o.dtype == r.dtype, name
        assert_close_fp64(o, r, e, name=f"{name} {tag}")


# (B, T, n_heads, n_kv_heads, head_dim); cos/sin are random full head_dim vectors whose halves differ,
# so a kernel that reads only one half (or mixes up which sine half goes where) fails.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,Hkv,D", [(1, 97, 4, 2, 58), (7, 5, 6, 2, 110), (2, 3, 3, 3, 64)])
def test_apply_rope(monkeypatch, dtype, B, T, H, Hkv, D):
    q = rand(B, T, H, D, dtype=dtype, seed=0)
    k = rand(B, T, Hkv, D, dtype=dtype, seed=1)
    cos, sin = rand(B, T, D, dtype=dtype, seed=2), rand(B, T, D, dtype=dtype, seed=3)
    _check(monkeypatch, q, k, cos, sin, f"{dtype} {(B, T, H, Hkv, D)}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_strided_qk_broadcast_cos(monkeypatch, dtype):
    """q/k as views into one fused qkv projection output (row-strided), cos/sin (1, T, D) and (T, D)
    broadcast over the batch (stride 0)."""
    B, T, H, Hkv, D = 3, 9, 4, 2, 64
    qkv = rand(B, T, (H + 2 * Hkv) * D, dtype=dtype, seed=4)
    q = qkv[..., : H * D].view(B, T, H, D)
    k = qkv[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = rand(1, T, D, dtype=dtype, seed=5), rand(T, D, dtype=dtype, seed=6)
    _check(monkeypatch, q, k, cos, sin, f"strided {dtype}")


def test_apply_rope_rejects_odd_head_dim(monkeypatch):
    q, k, cs = torch.zeros(2, 4, 5), torch.zeros(2, 2, 5), torch.zeros(2, 5)
    with triton_kernels(monkeypatch), pytest.raises(ValueError, match="odd"):
        kernels.apply_rope(q, k, cs, cs)
