"""Triton attention kernels (flash attention forward/backward, paged attention, store_kv) against
their PyTorch references, under Triton's interpreter on CPU (natively on a GPU). Pass rule in
tests/kernel_checks.py: error vs fp64 <= 2x the reference op's error at the same precision + floor."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, assert_close_fp64, noncontiguous, rand, triton_kernels

from baige import kernels
from baige.kernels import reference


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _varlen_case(lens_q, lens_k, H, Hkv, D, dtype, monkeypatch, seed=0):
    """Forward and backward of the Triton kernel, the reference at ``dtype`` and in fp64."""
    cq, ck = _cu(lens_q), _cu(lens_k)
    q = rand(sum(lens_q), H, D, dtype=dtype, seed=seed)
    k = rand(sum(lens_k), Hkv, D, dtype=dtype, seed=seed + 1)
    v = rand(sum(lens_k), Hkv, D, dtype=dtype, seed=seed + 2)
    do = rand(sum(lens_q), H, D, dtype=dtype, seed=seed + 3)
    scale = D**-0.5
    results = {}
    for name, cast, fn in (
        ("triton", dtype, kernels.flash_attention_varlen),
        ("ref", dtype, reference.flash_attention_varlen),
        ("exact", torch.float64, reference.flash_attention_varlen),
    ):
        ins = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        if name == "triton":
            with triton_kernels(monkeypatch):
                o = fn(*ins, cq, ck, max(lens_q), max(lens_k), scale)
        else:
            o = fn(*ins, cq, ck, max(lens_q), max(lens_k), scale)
        o.backward(do.to(cast))
        results[name] = [o.detach()] + [t.grad for t in ins]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert_close_fp64(results["triton"][i], results["ref"][i], results["exact"][i], name=f"{what} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_varlen_forward_backward(dtype, monkeypatch):
    # GQA (3 query heads per KV head), odd head_dim, a 1-token sequence, a 97-token one, and a
    # chunk whose keys extend past its queries (bottom-right causal alignment)
    _varlen_case([1, 97, 20], [1, 97, 45], H=6, Hkv=2, D=59, dtype=dtype, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_varlen_long(dtype, monkeypatch):
    _varlen_case([1025], [1025], H=2, Hkv=1, D=111, dtype=dtype, monkeypatch=monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_batched_with_offset_and_noncontiguous_query(dtype, monkeypatch):
    # (B, T, H, D) with keys beyond the last query (q_offset) and q a strided view
    B, T, S, H, Hkv, D = 7, 5, 12, 4, 4, 32
    q = noncontiguous(rand(B, T, H, D, dtype=dtype, seed=4))
    k, v = rand(B, S, Hkv, D, dtype=dtype, seed=5), rand(B, S, Hkv, D, dtype=dtype, seed=6)
    with triton_kernels(monkeypatch):
        out = kernels.attention(q, k, v, 0.2, q_offset=S - T)
    ref = reference.attention(q, k, v, 0.2, q_offset=S - T)
    exact = reference.attention(q.double(), k.double(), v.double(), 0.2, q_offset=S - T)
    assert_close_fp64(out, ref, exact, name="attention")


def _paged_setup(lens, H, Hkv, D, block_size, dtype, seed=0):
    """A shuffled block pool holding each sequence's K/V; padded tables (padding points at the scratch block)."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // block_size) for L in lens) + 2
    kc = rand(Hkv, n_blocks + 1, block_size, D, dtype=dtype, seed=seed)  # random junk in unused slots
    vc = rand(Hkv, n_blocks + 1, block_size, D, dtype=dtype, seed=seed + 1)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-L // block_size))] for L in lens]
    W = max(map(len, tables)) + 1
    bt = torch.tensor([t + [n_blocks] * (W - len(t)) for t in tables], device=DEVICE)
    return kc, vc, bt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_decode_and_prefill(dtype, block_size, monkeypatch):
    H, Hkv, D = 9, 3, 64  # the embedded model's grouping (3 query heads per KV head)
    lens = [1, 97, 33, 16]
    kc, vc, bt = _paged_setup(lens, H, Hkv, D, block_size, dtype)
    ctx = torch.tensor(lens, device=DEVICE)
    scale = D**-0.5
    qd = rand(len(lens), H, D, dtype=dtype, seed=7)
    chunks = [1, 40, 33, 2]  # prefill chunk lengths: a cached prefix of L - T tokens before each
    qp = rand(sum(chunks), H, D, dtype=dtype, seed=8)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), device=DEVICE)
    with triton_kernels(monkeypatch):
        dec = kernels.paged_decode_attention(qd, kc, vc, bt, ctx, scale)
        pre = kernels.paged_prefill_attention(qp, kc, vc, bt, cu, ctx, scale)
    dec_ref = reference.paged_decode_attention(qd, kc, vc, bt, ctx, scale)
    dec_exact = reference.paged_decode_attention(qd.double(), kc.double(), vc.double(), bt, ctx, scale)
    assert_close_fp64(dec, dec_ref, dec_exact, name="decode")
    pre_ref = reference.paged_prefill_attention(qp, kc, vc, bt, cu, ctx, scale)
    pre_exact = reference.paged_prefill_attention(qp.double(), kc.double(), vc.double(), bt, cu, ctx, scale)
    assert_close_fp64(pre, pre_ref, pre_exact, name="prefill")


def test_paged_decode_long_context_odd_head_dim(monkeypatch):
    H, Hkv, D = 4, 1, 111
    lens = [1025, 7]
    kc, vc, bt = _paged_setup(lens, H, Hkv, D, 16, torch.float32, seed=3)
    ctx = torch.tensor(lens, device=DEVICE)
    q = rand(2, H, D, dtype=torch.float32, seed=9)
    with triton_kernels(monkeypatch):
        out = kernels.paged_decode_attention(q, kc, vc, bt, ctx, 0.1)
    ref = reference.paged_decode_attention(q, kc, vc, bt, ctx, 0.1)
    exact = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), bt, ctx, 0.1)
    assert_close_fp64(out, ref, exact, name="decode 1025")


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_its_slots(dtype, monkeypatch):
    Hkv, n_blocks, bs, D = 3, 6, 5, 59
    k = noncontiguous(rand(7, Hkv, D, dtype=dtype, seed=10))
    v = rand(7, Hkv, D, dtype=dtype, seed=11)
    slots = torch.tensor([0, 4, 5, 13, 29, 17, 8], device=DEVICE)
    caches = {}
    for name in ("triton", "ref"):
        kc = torch.full((Hkv, n_blocks, bs, D), -7.0, dtype=dtype, device=DEVICE)
        vc = torch.full((Hkv, n_blocks, bs, D), -7.0, dtype=dtype, device=DEVICE)
        if name == "triton":
            with triton_kernels(monkeypatch):
                kernels.store_kv(k, v, kc, vc, slots)
        else:
            reference.store_kv(k, v, kc, vc, slots)
        caches[name] = (kc, vc)
    assert torch.equal(caches["triton"][0], caches["ref"][0]) and torch.equal(caches["triton"][1], caches["ref"][1])
    written = torch.zeros(n_blocks * bs, dtype=torch.bool)
    written[slots.cpu()] = True
    untouched = caches["triton"][0].view(Hkv, -1, D)[:, ~written.to(DEVICE)]
    assert (untouched == -7.0).all() and (caches["triton"][0].view(Hkv, -1, D)[:, slots] == k.transpose(0, 1)).all()


def test_strided_index_tensors_padding_rows_and_bad_counts(monkeypatch):
    # index tensors that are views with non-unit strides read as their values, not their storage
    f32 = torch.float32
    cu = torch.tensor([0, 9, 3, 9, 7], dtype=torch.int32, device=DEVICE)[::2]  # [0, 3, 7]
    q = rand(9, 4, 16, dtype=f32, seed=20).requires_grad_()  # rows 7, 8: padding after the last sequence
    k, v = rand(9, 2, 16, dtype=f32, seed=21).requires_grad_(), rand(9, 2, 16, dtype=f32, seed=22).requires_grad_()
    with triton_kernels(monkeypatch):
        out = kernels.flash_attention_varlen(q, k, v, cu, cu, 4, 4, 0.25)
        out[:7].sum().backward()
    ref = reference.flash_attention_varlen(
        q.detach(), k.detach(), v.detach(), cu.contiguous(), cu.contiguous(), 4, 4, 0.25
    )
    torch.testing.assert_close(out[:7], ref[:7], rtol=1e-5, atol=1e-5)
    assert (q.grad[7:] == 0).all() and (k.grad[7:] == 0).all() and (v.grad[7:] == 0).all()

    kc, vc, bt = _paged_setup([5, 9, 12], 4, 2, 16, 4, f32, seed=5)
    bt_t = bt.t().contiguous().t()  # same values, column-major storage
    lens = torch.tensor([[5, 99], [9, 99], [12, 99]], device=DEVICE)[:, 0]
    qd = rand(3, 4, 16, dtype=f32, seed=23)
    with triton_kernels(monkeypatch):
        dec = kernels.paged_decode_attention(qd, kc, vc, bt_t, lens, 0.3)
        with pytest.raises(ValueError, match="context_lens"):
            kernels.paged_decode_attention(qd, kc, vc, bt, lens[:2], 0.3)
    torch.testing.assert_close(
        dec, reference.paged_decode_attention(qd, kc, vc, bt, lens.contiguous(), 0.3), rtol=1e-5, atol=1e-5
    )

    kc = torch.zeros(2, 5, 4, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 99, -1, 99, 17, 99], device=DEVICE)[::2]  # [3, -1, 17]: -1 is a padding token
    kk = rand(3, 2, 16, dtype=f32, seed=24)
    with triton_kernels(monkeypatch):
        kernels.store_kv(kk, kk, kc, vc, slots)
    flat = kc.view(2, -1, 16)
    assert torch.equal(flat[:, 3], kk[0]) and torch.equal(flat[:, 17], kk[2])
    assert (flat.abs().sum(-1) > 0).sum().item() == 2 * 2  # nothing else written (-1 skipped)


def test_empty_inputs(monkeypatch):
    q, k = rand(2, 0, 4, 16, dtype=torch.float32), rand(2, 0, 2, 16, dtype=torch.float32)
    with triton_kernels(monkeypatch):
        assert kernels.attention(q, k, k, 0.25).shape == (2, 0, 4, 16)
        qr, kr = kernels.apply_rope(q, k, torch.zeros(2, 0, 16, device=DEVICE), torch.zeros(2, 0, 16, device=DEVICE))
    assert qr.shape == q.shape and kr.shape == k.shape
