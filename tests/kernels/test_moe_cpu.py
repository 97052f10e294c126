"""CPU inference's routed experts (kernels.moe_cpu, the native moe.c) and oneDNN's fp32 linear
against fp64."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from baige import kernels
from baige.kernels import moe_cpu, reference
from baige.kernels.cpu import isa
from baige.kernels.cpu import ops as cpu_ops
from tests.kernel_checks import assert_close_fp64

sys.path.insert(0, str(Path(__file__).parent))


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


def _experts_by_hand(xs, offsets, w13, w2):
    """ys[i] = w2[e] @ (silu(w13[e, :I] @ xs[i]) * (w13[e, I:] @ xs[i])), expert by expert, in xs's dtype."""
    inter = w2.shape[-1]
    ys = torch.zeros_like(xs)
    for e in range(w13.shape[0]):
        rows = xs[offsets[e] : offsets[e + 1]]
        gate_up = rows @ w13[e].T
        ys[offsets[e] : offsets[e + 1]] = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].T
    return ys


# per-expert row counts: empty experts, the few-rows ones moe.c leaves alone (<= 4), a row past a
# 16-lane vector, 64 +- 1 (one 4-vector group), 97 and 300 (several column groups and, at H 1023, chunks)
COUNTS = [0, 1, 4, 5, 16, 17, 63, 64, 65, 97, 300]


def _has_kernel(variant: str, dtype: torch.dtype) -> bool:
    """Whether the native experts compute on this variant: fp32 on the AVX-512 ones (moe.c), bf16 on
    avx512_amx (moe_amx.c)."""
    return variant.startswith("avx512") if dtype == torch.float32 else variant == "avx512_amx"


def _native_rows(xs, offsets, w13, w2, skip, wts):
    """(ran, (n, H)) from the dtype's native kernel, one row per sorted pair: fp32 moe_experts' ys (the
    rows it owns), bf16 moe_experts_combine with each pair its own token (tok = 0..n-1) and weight wts[i]
    (wts[i] * its output, in fp32). Rows the kernel leaves alone stay NaN."""
    n, H = xs.shape
    counts = offsets[1:] - offsets[:-1]
    owned = torch.repeat_interleave(counts > skip, counts)  # (n,) rows of experts past skip
    if xs.dtype == torch.float32:
        ys = torch.full((n, H), float("nan"))
        return cpu_ops.moe_experts(xs, offsets, w13, w2, skip, ys), ys
    out = torch.zeros(n, H)
    out[~owned] = float("nan")
    return cpu_ops.moe_experts_combine(xs, torch.arange(n), wts, offsets, w13, w2, skip, out), out


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,inter", [(1023, 60), (17, 5), (40, 33), (256, 7), (96, 48)])
def test_native_moe_experts_match_fp64(native_kernel, use_isa, variant, dtype, H, inter):
    """moe.c (fp32) and moe_amx.c (bf16, with its routing weights) on every variant: those with a kernel
    compute every expert with more than skip_rows rows (2x rule against the same math through torch in
    that dtype, fp64 exact) and leave the other rows as they were (NaN sentinel kept); the others report
    they have no kernel and write nothing. Shapes: K and I tails under 32 and 16 (AMX tiles), I a whole
    number of 16-feature blocks but not of 32 (96, 48)."""
    use_isa(variant)
    g = torch.Generator().manual_seed(H)
    counts = torch.tensor(COUNTS)[torch.randperm(len(COUNTS), generator=g)]  # counts in a shuffled order
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    n, E = int(offsets[-1]), len(counts)
    xs = torch.randn(n, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * inter**-0.5).to(dtype)
    wts = torch.rand(n, generator=g) + 0.5 if dtype == torch.bfloat16 else torch.ones(n)
    with torch.inference_mode():
        ran, got = _native_rows(xs, offsets, w13, w2, moe_cpu.NATIVE_SKIP_ROWS, wts)
    computed = torch.repeat_interleave(counts > moe_cpu.NATIVE_SKIP_ROWS, counts)  # (n,) rows the kernel owns
    if not _has_kernel(variant, dtype):
        assert ran is False and torch.isnan(got[~computed]).all()  # nothing written: the sentinels as they were
        assert torch.isnan(got[computed]).all() if dtype == torch.float32 else (got[computed] == 0).all()
        return
    assert ran is True
    assert torch.isnan(got[~computed]).all()
    ref = _experts_by_hand(xs, offsets, w13, w2).double() * wts.double()[:, None]
    exact = _experts_by_hand(xs.double(), offsets, w13.double(), w2.double()) * wts.double()[:, None]
    assert_close_fp64(got[computed], ref[computed], exact[computed], name=f"{variant} {dtype} H={H} I={inter}")


@pytest.mark.parametrize(
    "variant,dtype",
    [(v, d) for v in isa.supported() for d in (torch.float32, torch.bfloat16) if _has_kernel(v, d)] or [("none", None)],
)
def test_native_moe_experts_independent_of_threads_and_neighbours(native_kernel, use_isa, variant, dtype):
    """Bitwise the same rows on 1 and 2 threads, and an expert's rows the same whether or not other
    experts' rows surround them (every row's sums run in one fixed order)."""
    if variant == "none":
        pytest.skip("no AVX-512 variant on this CPU: neither moe.c nor moe_amx.c has a kernel to compare")
    use_isa(variant)
    g = torch.Generator().manual_seed(5)
    H, inter, E = 96, 40, 3
    offsets = torch.tensor([0, 70, 70, 151])
    xs = torch.randn(151, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.1).to(dtype)
    wts = torch.rand(151, generator=g)
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            ran, got = _native_rows(xs, offsets, w13, w2, 0, wts)
            assert ran
            outs.append(got)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    ran, alone = _native_rows(xs[70:].contiguous(), torch.tensor([0, 0, 0, 81]), w13, w2, 0, wts[70:].contiguous())
    assert ran and torch.equal(alone, outs[0][70:])  # expert 2's rows on their own


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_cpu_every_variant_matches_fp64(native_kernel, use_isa, variant, dtype):
    """The whole CPU path (few-rows experts, moe.c / moe_amx.c or oneDNN / F.linear, weighted combine) on
    each variant, with the routing of a real top-2 over 7 experts at hidden 1023: 2x rule against the
    reference in the same dtype."""
    use_isa(variant)
    g = torch.Generator().manual_seed(11)
    T, H, inter, E = 97, 1023, 60, 7
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * inter**-0.5).to(dtype)
    logits = torch.randn(T, E, generator=g)
    logits[:, 6] -= 3.0  # expert 6 gets few tokens (the few-rows path beside the native kernel)
    tw, ti = kernels.moe_topk(logits, 2, True)
    with torch.inference_mode():
        got = moe_cpu.fused_moe(x, w13, w2, tw, ti)
    assert got.dtype == dtype
    assert_close_fp64(got, reference.fused_moe(x, w13, w2, tw, ti), _oracle(x, w13, w2, tw, ti), name=variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,inter", [(0, 0), (0, 8), (8, 0)])
def test_moe_cpu_empty_hidden_or_expert_width(native_kernel, dtype, H, inter):
    """Zero-width hidden or expert layers: the reference's (empty, or zeros) result; the native kernels
    once divided by zero sizing their scratch here (SIGFPE)."""
    x = torch.randn(10, H).to(dtype)
    w13, w2 = torch.randn(2, 2 * inter, H).to(dtype), torch.randn(2, H, inter).to(dtype)
    tw, ti = torch.ones(10, 1), torch.zeros(10, 1, dtype=torch.long)  # all 10 tokens on expert 0
    with torch.inference_mode():
        got = moe_cpu.fused_moe(x, w13, w2, tw, ti)
    assert got.shape == (10, H) and got.dtype == dtype and (got == 0).all()
