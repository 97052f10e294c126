"""The native CPU paged attention with a sliding window, attention sinks and a logit soft-cap
(``baige_paged_attention_ext`` in attention.c) on every instruction-set variant the machine runs, against the
reference and fp64 with the kernels' 2x rule: decode rows, prefill chunks one row per token, and blocks wholly
before the window left as ids the kernel must never read."""

import pytest
import torch

import baige.kernels as kernels
from baige.kernels import reference
from baige.kernels.cpu import isa
from baige.kernels.cpu import ops as cpu_ops
from tests.kernel_checks import assert_close_fp64

pytestmark = pytest.mark.usefixtures("native_kernel")

VARIANTS = [
    {"window": 7},
    {"window": 1},
    {"sinks": [0.5, -1.0, 2.0, -1e4, 0.0, 1.5]},
    {"softcap": 1.3},
    {"window": 12, "sinks": [3.0, 0.1, -0.3, 0.0, 1.0, -2.0], "softcap": 4.0},
]


def _extra(v: dict) -> dict:
    return {k: torch.tensor(x) if k == "sinks" else x for k, x in v.items()}


def _case(lens, H, Hkv, D, bs, kv_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    W = max(-(-n // bs) for n in lens)
    nb = len(lens) * W + 3
    kc = torch.randn(Hkv, nb, bs, D, generator=g).to(kv_dtype)
    vc = torch.randn(Hkv, nb, bs, D, generator=g).to(kv_dtype)
    tables = torch.randperm(nb, generator=g)[: len(lens) * W].view(len(lens), W)
    return kc, vc, tables, torch.tensor(lens)


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["kv32", "kv16", "kvbf16"])
@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 64), (6, 6, 59)])  # GQA, and MHA with an odd head size
def test_decode_and_prefill_on_every_variant(use_isa, variant, v, kv_dtype, H, Hkv, D):
    use_isa(variant)
    extra = _extra(v)
    bs = 5
    lens = [1, 3, 7, 13, 41]
    kc, vc, tables, ctx = _case(lens, H, Hkv, D, bs, kv_dtype, seed=D + H)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(1))
    scale = D**-0.5
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, ctx, scale, **extra)
    ref = reference.paged_decode_attention(q, kc, vc, tables, ctx, scale, **extra)
    exact = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, ctx, scale, **extra)
    assert_close_fp64(out, ref, exact, name=f"decode {variant} {v} {kv_dtype}")
    chunks = [1, 2, 7, 4, 20]  # the last T_i tokens of each sequence
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist())
    qp = torch.randn(sum(chunks), H, D, generator=torch.Generator().manual_seed(2))
    out = cpu_ops.paged_prefill_attention(qp, kc, vc, tables, cu, ctx, scale, **extra)
    ref = reference.paged_prefill_attention(qp, kc, vc, tables, cu, ctx, scale, **extra)
    exact = reference.paged_prefill_attention(qp.double(), kc.double(), vc.double(), tables, cu, ctx, scale, **extra)
    assert_close_fp64(out, ref, exact, name=f"prefill {variant} {v} {kv_dtype}")


@pytest.mark.parametrize("variant", isa.supported())
def test_blocks_before_the_window_are_never_read(use_isa, variant):
    """Table entries of blocks wholly before the window point past the pool (any read would fault or give
    garbage): the output equals the one with the real table."""
    use_isa(variant)
    H, Hkv, D, bs, window = 4, 2, 16, 4, 6
    kc, vc, tables, ctx = _case([30], H, Hkv, D, bs, torch.float32, seed=3)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(4))
    full = cpu_ops.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, window=window)
    dropped = tables.clone()
    dropped[0, : (30 - window) // bs] = 1 << 40  # blocks 0..5 end before key 24
    assert torch.equal(cpu_ops.paged_decode_attention(q, kc, vc, dropped, ctx, 0.25, window=window), full)
    torch.testing.assert_close(full, reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, window=window))


def test_the_public_ops_take_the_native_kernel_for_variants(monkeypatch):
    calls = []
    real = cpu_ops.paged_decode_attention

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(cpu_ops, "paged_decode_attention", spy)
    kc, vc, tables, ctx = _case([9], 4, 2, 16, 4, torch.float32, seed=5)
    q = torch.randn(1, 4, 16)
    kernels.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, window=5, softcap=2.0)
    assert calls and calls[0]["window"] == 5 and calls[0]["softcap"] == 2.0
