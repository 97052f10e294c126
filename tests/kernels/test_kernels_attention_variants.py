"""Sliding windows, attention sinks and logit soft-capping in the Triton attention kernels (flash attention
forward and backward, paged decode with and without its split over the keys, paged prefill), through the
public ops under Triton's interpreter on CPU (natively on a GPU), against the reference: the pass rule of
tests/kernel_checks.py (error vs fp64 <= 2x the reference's error at the same precision + floor). The
reference itself is held to a Python loop of the definitions in tests/kernels/test_attention_variants.py.
Shapes are odd on purpose: head_dim 20 (not a power of two), 3 query heads per KV head, contexts that are
not multiples of the tile or the KV block, windows shorter and longer than the context."""

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, assert_close_fp64, rand, triton_kernels

from baige import kernels
from baige.kernels import reference

H, HKV, D = 6, 2, 20
SINKS = [0.5, 8.0, -1e4, 2.0, 0.0, -1.0]  # a large one, one with no effect, ordinary ones

CASES = {
    "window-sinks": {"window": 5, "sinks": SINKS},
    "softcap-long-window": {"window": 60, "softcap": 1.5},
    "all-three": {"window": 17, "sinks": [-2.0, 3.0, 0.3, -0.5, 1.0, 0.0], "softcap": 0.8},
}


def _variants(case: str, dtype=torch.float32) -> dict:
    extra = dict(CASES[case])
    if "sinks" in extra:
        extra["sinks"] = torch.tensor(extra["sinks"], dtype=dtype, device=DEVICE)
    return extra


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_variants_forward_backward(dtype, case, monkeypatch):
    # 37 queries after 8 cached keys: three query tiles of 16 (the interpreter's tile), so a window of 5
    # skips whole key tiles forward and whole query tiles in the dK/dV pass
    B, T, S = 2, 37, 45
    q, k = rand(B, T, H, D, dtype=dtype, seed=1), rand(B, S, HKV, D, dtype=dtype, seed=2)
    v, do = rand(B, S, HKV, D, dtype=dtype, seed=3), rand(B, T, H, D, dtype=dtype, seed=4)
    results = {}
    for name, cast in (("triton", dtype), ("ref", dtype), ("exact", torch.float64)):
        ins = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        extra = _variants(case, torch.float64 if cast == torch.float64 else torch.float32)
        if "sinks" in extra:
            extra["sinks"].requires_grad_()
        if name == "triton":
            with triton_kernels(monkeypatch):
                out = kernels.attention(*ins, 0.3, q_offset=S - T, **extra)
        else:
            out = reference.attention(*ins, 0.3, q_offset=S - T, **extra)
        out.backward(do.to(cast))
        results[name] = [out.detach()] + [t.grad for t in ins] + ([extra["sinks"].grad] if "sinks" in extra else [])
    names = ("out", "dq", "dk", "dv", "dsinks")
    for i, (got, ref, exact) in enumerate(zip(results["triton"], results["ref"], results["exact"])):
        if names[i] == "dsinks":  # fp32 on both paths: the reference's own error is ~0, hold to the floor of q's dtype
            got, ref = got.to(dtype), ref.to(dtype)
        assert_close_fp64(got, ref, exact, name=f"{names[i]} {case} {dtype}")


def _paged_pool(lens, block_size, dtype, seed=0):
    """A shuffled pool of random K/V (junk in unused slots), tables padded with the spare last block."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // block_size) for L in lens) + 2
    kc = rand(HKV, n_blocks + 1, block_size, D, dtype=dtype, seed=seed)
    vc = rand(HKV, n_blocks + 1, block_size, D, dtype=dtype, seed=seed + 1)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-L // block_size))] for L in lens]
    W = max(map(len, tables)) + 1
    return kc, vc, torch.tensor([t + [n_blocks] * (W - len(t)) for t in tables], device=DEVICE)


def _paged_case(q, kc, vc, tables, ctx, extra, monkeypatch, cu=None):
    """Decode (``cu`` None) or prefill through Triton, the reference at q's dtype and in fp64."""

    def run(fn, q, kc, vc):
        if cu is None:
            return fn(q, kc, vc, tables, ctx, 0.3, **extra)
        return fn(q, kc, vc, tables, cu, ctx, 0.3, **extra)

    name = "paged_decode_attention" if cu is None else "paged_prefill_attention"
    with triton_kernels(monkeypatch):
        out = run(getattr(kernels, name), q, kc, vc)
    ref = run(getattr(reference, name), q, kc, vc)
    exact = run(getattr(reference, name), q.double(), kc.double(), vc.double())
    return out, ref, exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_decode_and_prefill_variants(dtype, case, monkeypatch):
    lens = [1, 37, 70, 16]
    kc, vc, tables = _paged_pool(lens, 5, dtype)  # KV blocks of 5: key tiles straddle them
    ctx = torch.tensor(lens, device=DEVICE)
    extra = _variants(case)
    qd = rand(len(lens), H, D, dtype=dtype, seed=7)
    assert_close_fp64(*_paged_case(qd, kc, vc, tables, ctx, extra, monkeypatch), name=f"decode {case}")
    chunks = [1, 20, 33, 2]  # a cached prefix of L - T tokens before each chunk
    qp = rand(sum(chunks), H, D, dtype=dtype, seed=8)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), device=DEVICE)
    assert_close_fp64(*_paged_case(qp, kc, vc, tables, ctx, extra, monkeypatch, cu), name=f"prefill {case}")


@pytest.mark.parametrize("extra", [{"window": 700, "sinks": SINKS, "softcap": 2.0}, {"sinks": SINKS}])
def test_split_decode_variants(extra, monkeypatch):
    # long enough for the split over the keys on CPU and GPU alike: with a window the ranges cover only
    # the window (700 of 1025 keys), and the sinks join once, in the merge of the ranges
    from baige.kernels.triton_ops import paged_attention

    merges = []
    real = paged_attention.merge_splits
    monkeypatch.setattr(paged_attention, "merge_splits", lambda ws_m, *a: merges.append(ws_m.shape) or real(ws_m, *a))
    lens = [1025, 7]
    kc, vc, tables = _paged_pool(lens, 16, torch.float32, seed=3)
    extra = {**extra, "sinks": torch.tensor(extra["sinks"], device=DEVICE)}
    q = rand(len(lens), H, D, dtype=torch.float32, seed=9)
    out, ref, exact = _paged_case(q, kc, vc, tables, torch.tensor(lens, device=DEVICE), extra, monkeypatch)
    assert_close_fp64(out, ref, exact, name="split decode")
    assert merges and merges[0][2] > 1, merges  # (S, n_kv, n_splits, rows): the split path ran


def test_keys_outside_every_window_are_never_read(monkeypatch):
    # NaN in every key tile wholly before the queries' windows: a kernel that read one would return NaN
    # (0 * NaN in the P V product), the reference run on the clean data is what the kernels must give.
    # Queries at 148 and 149 with a window of 6 need keys 143..149: the tiles from key 128 on (64-key
    # tiles on a GPU, 16 in the interpreter).
    L, window, bs = 150, 6, 4
    q, k = rand(1, L, H, D, dtype=torch.float32, seed=11), rand(1, L, HKV, D, dtype=torch.float32, seed=12)
    v = rand(1, L, HKV, D, dtype=torch.float32, seed=13)
    sinks = torch.tensor(SINKS, device=DEVICE)
    extra = {"window": window, "sinks": sinks, "softcap": 2.5}
    want = reference.attention(q, k, v, 0.3, **extra)[:, -2:]
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :128], poisoned_v[:, :128] = float("nan"), float("nan")
    qi = q[:, -2:].clone().requires_grad_()
    ki, vi = poisoned_k.requires_grad_(), poisoned_v.requires_grad_()
    with triton_kernels(monkeypatch):
        out = kernels.attention(qi, ki, vi, 0.3, q_offset=L - 2, **extra)
        out.sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    clean = [t.clone().requires_grad_() for t in (q[:, -2:], k, v)]
    reference.attention(*clean, 0.3, q_offset=L - 2, **extra).sum().backward()
    for got, exp in zip((qi.grad, ki.grad, vi.grad), (c.grad for c in clean)):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)

    # the paged ops: the table entries of blocks 0..31 (keys 0..127) point at a NaN block
    n_blocks = -(-L // bs)
    kc = torch.full((HKV, n_blocks + 1, bs, D), float("nan"), device=DEVICE)
    vc = kc.clone()
    slots = torch.arange(L, device=DEVICE)
    reference.store_kv(k[0], v[0], kc, vc, slots)
    tables = torch.arange(n_blocks, device=DEVICE)[None].clone()
    tables[0, : 128 // bs] = n_blocks  # the NaN block
    ctx = torch.tensor([L], device=DEVICE)
    with triton_kernels(monkeypatch):
        dec = kernels.paged_decode_attention(q[0, -1:], kc, vc, tables, ctx, 0.3, **extra)
        pre = kernels.paged_prefill_attention(
            q[0, -2:], kc, vc, tables, torch.tensor([0, 2], device=DEVICE), ctx, 0.3, **extra
        )
    torch.testing.assert_close(dec, want[0, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre, want[0], atol=1e-5, rtol=1e-5)
