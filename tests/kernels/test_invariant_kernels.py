"""Batch-invariant mode's ops (baige/kernels/invariant.py: cpu/invariant.c natively, reference_invariant.py
without the library) on every instruction-set variant this CPU runs and on the PyTorch twins, fp32 and bf16:
a row's result is bitwise the same alone, among other rows (in any order), on 1 or 2 threads, and -- for
attention -- over contiguous K/V or paged at any block size, as a decode row or a prefill-chunk row; the
values agree with the ordinary ops (fp64 for fp32); gradients through the mode are the ordinary ops'; the
mode is scoped to its ``with`` block and thread."""

import threading

import pytest
import torch
import torch.nn.functional as F

import baige.kernels as kernels
from baige.kernels import invariant, reference
from baige.kernels.cpu import isa
from baige.runtime.settings import reload_settings

BACKENDS = [*isa.supported(), "reference"]  # native variants, then the PyTorch twins (BAIGE_KERNELS=reference)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # against the fp64 ordinary op (bf16: rounding of the result)


@pytest.fixture
def backend(request, monkeypatch, use_isa, native_kernel):
    name = request.param
    if name == "reference":
        monkeypatch.setenv("BAIGE_KERNELS", "reference")
        reload_settings()
    else:
        use_isa(name)
    assert invariant.native.available() == (name != "reference")
    return name


def _rows_alone(fn, x, *rest):
    """fn on each row of x separately (the other operands shared), concatenated."""
    return torch.cat([fn(x[i : i + 1], *rest) for i in range(x.shape[0])])


def _close(a, b, dtype, scale=1.0):
    assert (a.double() - b.double()).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_norm_silu_rows_are_independent_of_the_batch_and_threads(backend, dtype):
    g = torch.Generator().manual_seed(1)
    M, K, N = 23, 70, 37  # K % 8 = 6: every dot product has a scalar tail
    x = torch.randn(M, K, generator=g).to(dtype)
    w, b = (torch.randn(N, K, generator=g) / 8).to(dtype), torch.randn(N, generator=g).to(dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    perm = torch.randperm(M, generator=g)
    ops = {
        "linear": (lambda t: invariant.linear(t, w, b), lambda t: F.linear(t.double(), w.double(), b.double()), 8),
        "rms_norm": (lambda t: invariant.rms_norm(t, nw, 1e-6), lambda t: reference.rms_norm(t.double(), nw, 1e-6), 4),
        "silu_mul": (lambda t: invariant.silu_mul(t, t.flip(-1)), lambda t: F.silu(t.double()) * t.flip(-1), 8),
    }
    for name, (op, ordinary, scale) in ops.items():
        torch.set_num_threads(1)
        y = op(x)
        assert y.dtype == dtype and torch.equal(y, _rows_alone(op, x)), name
        assert torch.equal(op(x[perm]), y[perm]), name
        torch.set_num_threads(2)
        assert torch.equal(op(x), y), name
        _close(y, ordinary(x), dtype, scale)
    s, r = invariant.add_rms_norm(x, x.flip(0), nw, 1e-6)
    assert torch.equal(r, x + x.flip(0)) and torch.equal(s, invariant.rms_norm(x + x.flip(0), nw, 1e-6))


def _paged(k, v, bs, g):
    """One sequence's (S, Hkv, D) K/V scattered over a pool of blocks of bs slots: (pool_k, pool_v, table (1, W))."""
    S, Hkv, D = k.shape
    W = -(-S // bs)
    nb = W + 5
    order = torch.randperm(nb, generator=g)[:W]
    pk = torch.full((Hkv, nb, bs, D), float("nan"), dtype=k.dtype)  # unwritten slots: never read
    pv = pk.clone()
    for t in range(S):
        pk[:, order[t // bs], t % bs], pv[:, order[t // bs], t % bs] = k[t], v[t]
    return pk, pv, order[None]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_one_kernel_for_training_decode_and_prefill_at_any_block_size(backend, dtype):
    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D, scale = 19, 6, 2, 20, 0.3  # D % 8 = 4: scalar tails; 3 query heads per KV head
    q, k, v = (torch.randn(1, T, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    torch.set_num_threads(1)
    ref = invariant.attention(q, k, v, scale)[0]  # the training forward's call: contiguous K/V, causal
    _close(ref, reference.attention(q.double(), k.double(), v.double(), scale)[0], dtype)
    torch.set_num_threads(2)
    assert torch.equal(invariant.attention(q, k, v, scale)[0], ref)
    assert torch.equal(invariant.attention(q[:, 7:], k, v, scale, q_offset=7)[0], ref[7:])  # a later chunk
    two = invariant.attention(torch.cat([q.flip(1), q]), torch.cat([k.flip(1), k]), torch.cat([v.flip(1), v]), scale)
    assert torch.equal(two[1], ref)  # beside another sequence
    for bs in (1, 3, 16, 32):
        pk, pv, table = _paged(k[0], v[0], bs, g)
        decode = kernels.paged_decode_attention  # one row per position, each its own context
        with kernels.batch_invariant():
            rows = decode(q[0], pk, pv, table.expand(T, -1), torch.arange(1, T + 1), scale)
            assert torch.equal(rows, ref), bs
            for start in (0, 5, T - 1):  # a prefill chunk of positions start..T-1 after a cached prefix
                cu, lens = torch.tensor([0, T - start]), torch.tensor([T])
                chunk = kernels.paged_prefill_attention(q[0, start:], pk, pv, table, cu, lens, scale)
                assert torch.equal(chunk, ref[start:]), (bs, start)


def test_gradients_through_the_mode_are_the_ordinary_ops(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=g, requires_grad=True)
    w = torch.randn(16, 24, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    nw = (torch.rand(16, generator=g) + 0.5).requires_grad_()
    q, k, v = (torch.randn(1, 5, 4, 8, generator=g).requires_grad_() for _ in range(3))

    def loss(lin, norm, act, attn):
        y = norm(lin(x, w, b), nw, 1e-6)
        return (act(y, y) ** 2).sum() + (attn(q, k, v, 0.5) ** 3).sum()

    ordinary = loss(F.linear, reference.rms_norm, reference.silu_mul, reference.attention)
    want = torch.autograd.grad(ordinary, [x, w, b, nw, q, k, v])
    with kernels.batch_invariant():
        mode = loss(invariant.linear, kernels.rms_norm, kernels.silu_mul, kernels.attention)
    got = torch.autograd.grad(mode, [x, w, b, nw, q, k, v])
    torch.testing.assert_close(mode, ordinary, rtol=1e-5, atol=1e-5)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_mode_is_scoped_to_its_block_and_thread():
    assert not kernels.batch_invariant_enabled()
    seen = []
    with kernels.batch_invariant():
        assert kernels.batch_invariant_enabled()
        worker = threading.Thread(target=lambda: seen.append(kernels.batch_invariant_enabled()))
        worker.start()
        worker.join()
        with kernels.batch_invariant(False):
            assert not kernels.batch_invariant_enabled()
        assert kernels.batch_invariant_enabled()
    assert seen == [False] and not kernels.batch_invariant_enabled()
    with pytest.raises(RuntimeError), kernels.batch_invariant():
        raise RuntimeError
    assert not kernels.batch_invariant_enabled()
