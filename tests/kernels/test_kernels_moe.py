"""MoE ops (router top-k, block alignment, fused experts): Triton (interpreted on CPU) against the
reference and fp64, forward and backward; the alignment against a hand-computed layout and its
defining properties; the router against hand-computed weights per variant."""

import math
from collections import Counter

import pytest
import torch

from baige import kernels
from baige.kernels import reference
from baige.kernels.triton_ops import moe
from tests.kernel_checks import (
    DEVICE,
    DTYPES,
    assert_close_fp64,
    noncontiguous,
    rand,
    triton_kernels,
)

# ---- moe_topk ------------------------------------------------------------------------------------------

# probs = softmax(log([1, 2, 3, 4])) = [0.1, 0.2, 0.3, 0.4]
LOGITS = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()
BIAS = torch.tensor([0.5, 0.0, 0.0, 0.0])  # scores [0.6, 0.2, 0.3, 0.4]: expert 0 is chosen, weighted 0.1
TOPK_CASES = [  # (top_k, renormalize, bias, norm_min, ids, weights)
    (2, True, None, 0.0, [3, 2], [4 / 7, 3 / 7]),  # softmax + renormalize (Mixtral, Qwen norm_topk_prob)
    (2, False, None, 0.0, [3, 2], [0.4, 0.3]),  # no renormalize (Qwen norm_topk_prob=False)
    (2, True, BIAS, 0.9, [0, 3], [0.1 / 0.9, 0.4 / 0.9]),  # ERNIE: biased choice, sum 0.5 clamped to norm_min
    (2, True, BIAS, 0.1, [0, 3], [0.2, 0.8]),  # norm_min below the sum: plain renormalize
    (1, True, None, 0.0, [3], [1.0]),
    (4, False, BIAS, 0.0, [0, 3, 2, 1], [0.1, 0.4, 0.3, 0.2]),  # every expert
]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("case", range(len(TOPK_CASES)))
def test_moe_topk_hand_computed(monkeypatch, impl, case):
    top_k, renorm, bias, norm_min, ids, weights = TOPK_CASES[case]
    fn = reference.moe_topk if impl == "reference" else moe.moe_topk
    w, i = fn(LOGITS.to(DEVICE), top_k, renorm, None if bias is None else bias.to(DEVICE), norm_min)
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == i.shape == (1, top_k)
    assert i.tolist() == [ids]
    torch.testing.assert_close(w.cpu(), torch.tensor([weights]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,top_k,with_bias", [(97, 60, 8, True), (7, 7, 1, False), (7, 7, 7, True)])
def test_moe_topk_against_reference(monkeypatch, dtype, T, E, top_k, with_bias):
    logits = rand(T, E, dtype=dtype, scale=2.0, seed=0)
    bias = rand(E, dtype=torch.float32, scale=0.05, seed=1) if with_bias else None
    with triton_kernels(monkeypatch):
        w, i = kernels.moe_topk(logits, top_k, True, bias, 0.2)
    w_ref, i_ref = reference.moe_topk(logits, top_k, True, bias, 0.2)
    w_exact, i_exact = reference.moe_topk(logits.double(), top_k, True, None if bias is None else bias.double(), 0.2)
    assert torch.equal(i, i_ref) and torch.equal(i, i_exact)  # random logits: no ties
    assert_close_fp64(w, w_ref, w_exact, name=f"topk weights {dtype}")


def test_moe_topk_ties_lowest_index_first(monkeypatch):
    with triton_kernels(monkeypatch):
        w, i = kernels.moe_topk(torch.zeros(3, 7, device=DEVICE), 3, True)
    assert i.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(w.cpu(), torch.full((3, 3), 1 / 3))
    w_ref, i_ref = reference.moe_topk(torch.zeros(3, 7, device=DEVICE), 3, True)  # torch.topk: any 3 of the 7
    assert all(len(set(row)) == 3 for row in i_ref.tolist())
    torch.testing.assert_close(w_ref, w)


def test_moe_topk_gradient_runs_the_reference(monkeypatch):
    logits = rand(5, 6, dtype=torch.float64, seed=3)
    bias = rand(6, dtype=torch.float64, scale=0.1, seed=4)
    assert torch.autograd.gradcheck(
        lambda z: reference.moe_topk(z, 3, True, bias, 0.5)[0], (logits.clone().requires_grad_(),)
    )
    z = rand(5, 6, dtype=torch.float32, seed=3).requires_grad_()
    with triton_kernels(monkeypatch):
        w, _ = kernels.moe_topk(z, 3, True, None, 0.0)  # needs a gradient: the reference runs
    (g,) = torch.autograd.grad(w[:, 0].sum(), z)
    z2 = z.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(reference.moe_topk(z2, 3, True)[0][:, 0].sum(), z2)
    assert torch.equal(g, g_ref) and g.abs().sum() > 0


def test_moe_topk_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k 5"):
        moe.moe_topk(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="correction_bias"):
        moe.moe_topk(torch.zeros(2, 4), 2, True, torch.zeros(3))


# ---- moe_align_block_size ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_moe_align_hand_computed(impl):
    # pairs 0..5 route to experts [0, 2, 2, 1, 0, 2]; expert 3 gets none; block_size 4, sentinel 6
    ids = torch.tensor([[0, 2], [2, 1], [0, 2]], device=DEVICE)
    fn = reference.moe_align_block_size if impl == "reference" else moe.moe_align_block_size
    sorted_ids, expert_ids, ntpp = fn(ids, 4, 4)
    assert sorted_ids.dtype == expert_ids.dtype == ntpp.dtype == torch.int32
    assert sorted_ids.tolist() == [0, 4, 6, 6, 3, 6, 6, 6, 1, 2, 5, 6] + [6] * 6  # 6 + 4 * 3 = 18 slots
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]  # ceil(18 / 4) blocks
    assert ntpp.tolist() == [12]


def _check_layout(ids: torch.Tensor, num_experts: int, bs: int, sorted_ids, expert_ids, ntpp):
    """The defining properties of the block layout, brute force."""
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    max_len = n + num_experts * (bs - 1)
    assert sorted_ids.shape == (max_len,) and expert_ids.shape == (math.ceil(max_len / bs),) and ntpp.shape == (1,)
    counts = Counter(flat)
    padded = int(ntpp)
    assert padded == sum(math.ceil(c / bs) * bs for c in counts.values())
    s, ex = sorted_ids.tolist(), expert_ids.tolist()
    assert s[padded:] == [n] * (max_len - padded) and ex[padded // bs :] == [-1] * (len(ex) - padded // bs)
    assert sorted(v for v in s[:padded] if v != n) == list(range(n))  # every pair exactly once
    blocks_of = Counter(ex[: padded // bs])
    assert blocks_of == {e: math.ceil(c / bs) for e, c in counts.items()}  # no block for an expert without pairs
    assert ex[: padded // bs] == sorted(ex[: padded // bs])
    for e in counts:
        seg = [v for b, x in enumerate(ex) if x == e for v in s[b * bs : (b + 1) * bs]]
        real = [v for v in seg if v != n]
        assert real == sorted(real) and all(flat[v] == e for v in real)  # stable, right expert
        assert seg == real + [n] * (len(seg) - len(real)) and len(seg) - len(real) < bs  # padded at the end


@pytest.mark.parametrize(
    "T,top_k,E,bs,used",
    [
        (1, 1, 7, 16, 7),
        (97, 8, 60, 16, 40),
        (7, 7, 7, 4, 7),
        (97, 2, 7, 64, 5),
        (97, 1, 3, 1, 3),
        (40, 4, 9, 8, 9),
    ],
)
def test_moe_align_properties(T, top_k, E, bs, used):
    g = torch.Generator().manual_seed(T * E + bs)
    allowed = torch.randperm(E, generator=g)[:used]  # experts outside it receive no pair
    ids = allowed[torch.rand(T, used, generator=g).argsort(-1)[:, :top_k]].to(DEVICE)
    ref = reference.moe_align_block_size(ids, E, bs)
    tri = moe.moe_align_block_size(ids, E, bs)
    _check_layout(ids, E, bs, *ref)
    for r, t in zip(ref, tri):  # both are stable, so the layouts are identical
        assert torch.equal(r, t)


# ---- fused_moe -----------------------------------------------------------------------------------------


def _problem(T, H, inter, E, top_k, used, dtype):
    """Inputs with ``top_k`` distinct experts per token drawn from ``used`` of them (the rest get none)."""
    g = torch.Generator().manual_seed(T * 1000 + H + E)
    allowed = torch.randperm(E, generator=g)[:used]
    ids = allowed[torch.rand(T, used, generator=g).argsort(-1)[:, :top_k]].to(DEVICE)
    weights = torch.softmax(rand(T, top_k, dtype=torch.float32, seed=5), -1)
    x = rand(T, H, dtype=dtype, seed=6)
    w13 = rand(E, 2 * inter, H, dtype=dtype, scale=H**-0.5, seed=7)
    w2 = rand(E, H, inter, dtype=dtype, scale=inter**-0.5, seed=8)
    return x, w13, w2, weights, ids


def _run(fn, x, w13, w2, weights, ids, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = fn(*leaves, ids)
    return (out, *torch.autograd.grad(out, leaves, dout))


FUSED_CASES = [  # (T, H, I, E, top_k, experts used)
    (7, 1023, 40, 7, 2, 7),  # odd hidden size
    (1, 1023, 24, 7, 1, 7),  # one token, top-1
    (97, 64, 48, 60, 8, 40),  # 60 experts, 20 without tokens
    (97, 40, 24, 7, 1, 5),  # top-1, 2 experts without tokens
    (7, 48, 40, 7, 7, 7),  # top_k = every expert
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "T{}-H{}-I{}-E{}-k{}-used{}".format(*c))
def test_fused_moe_forward_backward(monkeypatch, dtype, case):
    T, H, inter, E, top_k, used = case
    x, w13, w2, weights, ids = _problem(T, H, inter, E, top_k, used, dtype)
    dout = rand(T, H, dtype=dtype, seed=9)
    with triton_kernels(monkeypatch):
        out = _run(kernels.fused_moe, x, w13, w2, weights, ids, dout)
    ref = _run(reference.fused_moe, x, w13, w2, weights, ids, dout)
    exact = _run(reference.fused_moe, x.double(), w13.double(), w2.double(), weights.double(), ids, dout.double())
    for name, o, r, e in zip(("out", "dx", "dw13", "dw2", "dtopk_weights"), out, ref, exact):
        assert o.dtype == r.dtype, name
        assert_close_fp64(o, r, e, name=f"{name} {dtype} {case}")


def test_fused_moe_inference_path_equals_training_path(monkeypatch):
    x, w13, w2, weights, ids = _problem(9, 40, 24, 7, 2, 6, torch.float32)
    with triton_kernels(monkeypatch):
        with torch.no_grad():
            y = kernels.fused_moe(noncontiguous(x), w13, w2, weights, ids)  # rows of a wider buffer
        y_grad = kernels.fused_moe(x.requires_grad_(), w13, w2, weights, ids)
        assert y_grad.grad_fn is not None and y.grad_fn is None
        assert torch.equal(y, y_grad.detach())
        empty = kernels.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 40) and reference.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 40)


def test_fused_moe_rejects_mismatched_shapes():
    x, w13, w2, weights, ids = _problem(3, 40, 24, 7, 2, 7, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        moe.fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        moe.fused_moe(x, w13, w2, weights[:, :1], ids)
