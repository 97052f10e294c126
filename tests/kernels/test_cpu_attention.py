"""The native CPU paged attention (attention.c) on every instruction-set variant the machine runs:
its 8-lane path (every variant, any head size) and its 16-lane AVX-512 path (head sizes that are a
multiple of 16: four keys x up to four query heads per K load, V in 64- and 16-column pieces), against
the reference and fp64 with the kernels' 2x rule; the AMX scores of bf16 caches (attention_amx.c, q
rounded to bf16) against the same math in fp64 and, separately, against unrounded q within the bound
that rounding allows; prefill chunks through it, one query row per token."""

import math

import pytest
import torch

import baige.kernels as kernels
from baige.kernels import reference
from baige.kernels.cpu import isa
from baige.kernels.cpu import ops as cpu_ops
from tests.kernel_checks import assert_close_fp64

pytestmark = pytest.mark.usefixtures("native_kernel")


def _case(lens, H, Hkv, D, bs, kv_dtype, seed):
    """Scattered blocks (a random permutation of the pool), one table row per sequence."""
    g = torch.Generator().manual_seed(seed)
    W = max(-(-n // bs) for n in lens)
    nb = len(lens) * W + 3
    kc = torch.randn(Hkv, nb, bs, D, generator=g).to(kv_dtype)
    vc = torch.randn(Hkv, nb, bs, D, generator=g).to(kv_dtype)
    tables = torch.randperm(nb, generator=g)[: len(lens) * W].view(len(lens), W)
    return kc, vc, tables, torch.tensor(lens)


# head sizes: 64 and 128 (whole 64-column pieces), 80 (64 + 16), 48 (three 16s), 24, 59 and 20 (8-lane
# path everywhere; 59 and 20 with scalar tails), 16, 32, 96, 256; groups of 1-8 query heads per KV head (the 16-lane
# path takes four at a time)
SHAPES = [
    (9, 3, 64),
    (8, 1, 128),
    (10, 2, 80),
    (7, 1, 48),
    (16, 2, 24),
    (6, 6, 59),
    (20, 4, 64),
    (8, 2, 20),
    (4, 2, 16),
    (12, 2, 32),
    (6, 1, 96),
    (8, 1, 256),
]


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("H,Hkv,D", SHAPES, ids=[f"{h}-{k}-{d}" for h, k, d in SHAPES])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["kv32", "kv16", "kvbf16"])
@pytest.mark.parametrize("bs", [5, 8])
def test_decode_on_every_variant(use_isa, variant, H, Hkv, D, kv_dtype, bs):
    """Contexts of 1, 2, 3 and 5 keys (short 4-key groups), one and several blocks of 5 (a partial last
    group in each block) or 8, 203 keys."""
    use_isa(variant)
    kc, vc, tables, lens = _case([1, 2, 3, 5, 17, 203], H, Hkv, D, bs, kv_dtype, seed=D + H)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(1))
    scale = D**-0.5
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, scale)
    ref = reference.paged_decode_attention(q, kc, vc, tables, lens, scale)
    exact = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, lens, scale)
    assert out.dtype == torch.float32
    assert_close_fp64(out, ref, exact, name=f"decode {variant} {H}/{Hkv}/{D} {kv_dtype}")


@pytest.mark.parametrize("variant", isa.supported())
def test_results_do_not_depend_on_threads_or_neighbours(use_isa, variant):
    """Each (sequence, KV head) is one thread's work: bitwise the same with 1 or 2 threads, and a
    sequence's rows are the same alone as in a batch."""
    use_isa(variant)
    kc, vc, tables, lens = _case([9, 40, 3, 77], 12, 3, 64, 16, torch.bfloat16, seed=5)
    q = torch.randn(4, 12, 64, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = cpu_ops.paged_decode_attention(q[1:2], kc, vc, tables[1:2], lens[1:2], 0.125)
    assert torch.equal(alone, one[1:2])


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q32", "qbf16"])
def test_prefill_chunks_after_cached_prefixes(use_isa, variant, q_dtype):
    """Chunks of 1, 40, 33 and 2 tokens after cached prefixes of 0, 57, 0 and 14 tokens: causal inside
    the chunk, the whole prefix before it. A bf16 query is widened and the result rounded to bf16 --
    or, under the AMX variant, prefill_amx.c runs it (``amx_prefill``: bf16 products, P rounded to bf16
    as torch's flash SDPA does), within the rule of the fp32 reference rounded once."""
    use_isa(variant)
    sdpa = q_dtype == torch.bfloat16 and variant in cpu_ops.SDPA_BF16_PREFILL_ISAS  # masked keys: zero weights
    chunks, lens = [1, 40, 33, 2], [1, 97, 33, 16]
    kc, vc, tables, ctx = _case(lens, 9, 3, 64, 16, torch.bfloat16, seed=8)
    q = torch.randn(sum(chunks), 9, 64, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    cu = torch.tensor([0, 1, 41, 74, 76])
    out = cpu_ops.paged_prefill_attention(q, kc, vc, tables, cu, ctx, 0.125)
    qs = q.bfloat16() if variant in cpu_ops.AMX_SCORES_ISAS else q  # the AMX scores round q to bf16
    ref = reference.paged_prefill_attention(qs.float(), kc, vc, tables, cu, ctx, 0.125).to(q_dtype)
    exact = reference.paged_prefill_attention(qs.double(), kc.double(), vc.double(), tables, cu, ctx, 0.125)
    assert out.dtype == q_dtype
    assert_close_fp64(out, ref, exact, name=f"prefill {variant} {q_dtype}")
    # token 5 of the second chunk (position 62) sees keys 0..62 and nothing after them (not even a NaN
    # there for the native kernel; SDPA multiplies masked keys by zero weights, so finite values for it)
    row = 1 + 5
    kc2, vc2 = kc.clone(), vc.clone()
    for pos in range(63, 97):
        blk = int(tables[1, pos // 16])
        kc2[:, blk, pos % 16] = 1e4 if sdpa else float("nan")
        vc2[:, blk, pos % 16] = -1e4 if sdpa else float("nan")
    again = cpu_ops.paged_prefill_attention(q, kc2, vc2, tables, cu, ctx, 0.125)
    assert torch.equal(again[row], out[row])


AMX = "avx512_amx" in isa.supported()


@pytest.mark.skipif(not AMX, reason="prefill_amx.c needs AMX (avx512_amx): this CPU lacks it")
@pytest.mark.parametrize(
    "H,Hkv,D,bs", [(9, 3, 64, 16), (4, 4, 128, 32), (7, 1, 96, 16), (20, 1, 32, 16), (8, 2, 256, 16), (6, 2, 160, 48)]
)
def test_amx_prefill_attention_against_the_reference_and_fp64(monkeypatch, use_isa, H, Hkv, D, bs):
    """prefill_amx.c: chunks of 1, 40, 33, 2 and 70 tokens after cached prefixes of 0, 57, 0, 14 and 230
    (a key count that is no multiple of 16 or 32, one token alone, a context spanning many scattered
    blocks); query groups of 3, 1, 7, 20 (more than one 16-column block per token) and 3 heads per KV
    head; head sizes 32-256 (one to eight 32-wide chunks, V in 64-wide passes and a 32-wide rest);
    against torch's SDPA in bf16 and fp64 with the 2x rule, and against the fp32 reference rounded
    once within 2 bf16 steps of the output scale. Dispatched by kernels.paged_prefill_attention."""
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    from baige.runtime.settings import reload_settings

    reload_settings()
    use_isa("avx512_amx")
    chunks, lens = [1, 40, 33, 2, 70], [1, 97, 33, 16, 300]
    kc, vc, tables, ctx = _case(lens, H, Hkv, D, bs, torch.bfloat16, seed=H + D)
    q = (torch.randn(sum(chunks), H, D, generator=torch.Generator().manual_seed(D)) * 2).bfloat16()
    cu = torch.tensor([0, 1, 41, 74, 76, 146])
    calls = []
    real = cpu_ops._prefill_amx
    monkeypatch.setattr(cpu_ops, "_prefill_amx", lambda *a: calls.append(1) or real(*a))
    scale = D**-0.5
    out = kernels.paged_prefill_attention(q, kc, vc, tables, cu, ctx, scale)
    assert calls == [1] and out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = reference.paged_prefill_attention(q, kc, vc, tables, cu, ctx, scale)
    exact = reference.paged_prefill_attention(q.double(), kc.double(), vc.double(), tables, cu, ctx, scale)
    assert_close_fp64(out, ref, exact, name=f"amx prefill {H}/{Hkv} x {D}, bs {bs}")
    f32 = reference.paged_prefill_attention(q.float(), kc, vc, tables, cu, ctx, scale)
    assert (out.float() - f32).abs().max() <= 2 * 2.0**-8 * f32.abs().max()


@pytest.mark.skipif(not AMX, reason="prefill_amx.c needs AMX (avx512_amx): this CPU lacks it")
def test_amx_prefill_attention_does_not_depend_on_the_thread_count(use_isa):
    """Items (sequence, KV head, 16 query columns) spread over the threads, each summed in one order:
    bitwise the one-thread result on 2 and 3 threads; a head size the kernel does not take (48) or a
    block size that is no multiple of 16 (8) goes to torch's SDPA."""
    use_isa("avx512_amx")
    kc, vc, tables, ctx = _case([50, 120, 7], 9, 3, 64, 16, torch.bfloat16, seed=5)
    q = torch.randn(50 + 30 + 7, 9, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    cu = torch.tensor([0, 50, 80, 87])
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_ops.paged_prefill_attention(q, kc, vc, tables, cu, ctx, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert cpu_ops.amx_prefill(torch.bfloat16, torch.bfloat16, 64, 16)
    assert not cpu_ops.amx_prefill(torch.bfloat16, torch.bfloat16, 48, 16)
    assert not cpu_ops.amx_prefill(torch.bfloat16, torch.bfloat16, 64, 8)
    assert not cpu_ops.amx_prefill(torch.float32, torch.bfloat16, 64, 16)
    assert not cpu_ops.amx_prefill(torch.bfloat16, torch.float16, 64, 16)


@pytest.mark.parametrize("variant", isa.supported())
def test_bf16_queries_and_prefill_dispatch_to_the_native_kernel(monkeypatch, use_isa, variant):
    """On the CPU, without autograd: decode and prefill with fp32 or bf16 queries run attention.c --
    but a bf16 prefill under the AMX variant, which takes torch's SDPA (SDPA_BF16_PREFILL_ISAS)."""
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    from baige.runtime.settings import reload_settings

    reload_settings()
    use_isa(variant)
    calls = []
    real = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    kc, vc, tables, lens = _case([5, 9], 4, 2, 16, 4, torch.bfloat16, seed=0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 4, 16).to(dtype)
        kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.25)
        kernels.paged_prefill_attention(q, kc, vc, tables, torch.tensor([0, 1, 2]), lens, 0.25)
    amx = variant in cpu_ops.SDPA_BF16_PREFILL_ISAS
    assert calls == [torch.float32, torch.float32, torch.bfloat16] + ([] if amx else [torch.bfloat16])


def test_prefill_of_a_long_context_goes_to_the_reference(monkeypatch):
    """Past PREFILL_NATIVE_MAX_BYTES of K + V per KV head the chunk runs the reference (torch's SDPA),
    not the one-row-per-token kernel; under it, the kernel."""
    calls = []
    real = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cpu_ops, "PREFILL_NATIVE_MAX_BYTES", 40 * 16 * 2 * 2)  # 40 cached bf16 tokens of 16 dims
    kc, vc, tables, ctx = _case([41], 2, 1, 16, 8, torch.bfloat16, seed=4)
    q = torch.randn(3, 2, 16)
    cu = torch.tensor([0, 3])
    out = cpu_ops.paged_prefill_attention(q, kc, vc, tables, cu, ctx, 0.25)
    assert calls == []
    torch.testing.assert_close(out, reference.paged_prefill_attention(q, kc, vc, tables, cu, ctx, 0.25))
    cpu_ops.paged_prefill_attention(q, kc, vc, tables, cu, torch.tensor([40]), 0.25)
    assert calls == [1]


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("bs", [8, 16])
def test_amx_scores_round_the_query_to_bf16(use_isa, variant, bs):
    """Hand-computed: q = 1 + 2**-10 in all 64 columns (bf16 rounds it to 1), key 0 all ones, key 1
    zeros, V rows ones and zeros, scale 1/64: the output is sigmoid(s0) with s0 = 1 + 2**-10 in fp32
    and exactly 1 where the AMX scores take the call (avx512_amx, bf16 cache, blocks of 16) --
    and only there."""
    use_isa(variant)
    kc = torch.zeros(1, 3, bs, 64, dtype=torch.bfloat16)
    vc = torch.zeros(1, 3, bs, 64, dtype=torch.bfloat16)
    kc[0, 2, 0], vc[0, 2, 0] = 1.0, 1.0  # block 2 holds the context: key 0 ones, key 1 zeros
    q = torch.full((1, 1, 64), 1 + 2.0**-10)
    out = cpu_ops.paged_decode_attention(q, kc, vc, torch.tensor([[2]]), torch.tensor([2]), 1 / 64)
    amx = variant == "avx512_amx" and bs == 16
    assert cpu_ops.amx_scores(torch.bfloat16, 64, bs, 1) == amx
    s0 = 1.0 if amx else 1 + 2.0**-10
    torch.testing.assert_close(out, torch.full((1, 1, 64), 1 / (1 + math.exp(-s0))), rtol=0, atol=2e-7)


# head sizes 32-256 (one to eight 32-column chunks; 80 is not a multiple of 32, 288 over 256: fp32
# path), groups of 1-16 query heads per KV head (17: fp32 path)
AMX_SHAPES = [
    (9, 3, 64),
    (4, 4, 32),
    (8, 1, 96),
    (16, 2, 128),
    (16, 1, 256),
    (32, 2, 64),
    (17, 1, 64),
    (6, 3, 80),
    (2, 1, 288),
]


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("H,Hkv,D", AMX_SHAPES, ids=[f"{h}-{k}-{d}" for h, k, d in AMX_SHAPES])
@pytest.mark.parametrize("bs", [16, 32])
def test_bf16_cache_with_blocks_of_16(use_isa, variant, H, Hkv, D, bs):
    """bf16 caches in blocks of 16 and 32 (the AMX scores' shapes under avx512_amx; the fp32 path
    elsewhere), contexts of 1, 15, 16, 17, 31, 32, 33 and 203 keys (partial 16-key groups and pairs of
    groups, NaN past each context in its last block): against the same math in fp64 (q rounded to bf16
    where amx_scores holds) with the 2x rule, and where q is rounded, against unrounded q in fp64
    within what the rounding allows: each score moves by at most 2**-8 * scale * sum_c |q_c k_c|
    (bf16's unit roundoff), the softmax weights then by at most 2 * max|ds| in sum, the output by that
    times max|V|."""
    use_isa(variant)
    lens = [1, 15, 16, 17, 31, 32, 33, 203]
    kc, vc, tables, ctx = _case(lens, H, Hkv, D, bs, torch.bfloat16, seed=D + H + bs)
    kp, vp = kc.clone(), vc.clone()  # the kernel's copy: NaN in the unused rows of each last block
    for s, n in enumerate(lens):
        if n % bs:
            kp[:, tables[s, n // bs], n % bs :] = float("nan")
            vp[:, tables[s, n // bs], n % bs :] = float("nan")
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(7))
    scale = D**-0.5
    out = cpu_ops.paged_decode_attention(q, kp, vp, tables, ctx, scale)
    rounded = cpu_ops.amx_scores(torch.bfloat16, D, bs, H // Hkv)
    assert rounded == (variant == "avx512_amx" and D % 32 == 0 and D <= 256 and H // Hkv <= 16)
    qs = q.bfloat16().float() if rounded else q
    ref = reference.paged_decode_attention(qs, kc, vc, tables, ctx, scale)
    exact = reference.paged_decode_attention(qs.double(), kc.double(), vc.double(), tables, ctx, scale)
    assert_close_fp64(out, ref, exact, name=f"bf16 cache {variant} {H}/{Hkv}/{D} bs {bs}")
    if rounded:
        unrounded = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, ctx, scale)
        group = H // Hkv
        for s, n in enumerate(lens):
            pos = torch.arange(n)
            rows = tables[s, pos // bs] * bs + pos % bs
            k = kc.double().flatten(1, 2)[:, rows].repeat_interleave(group, 0)  # (H, n, D)
            v = vc.double().flatten(1, 2)[:, rows].repeat_interleave(group, 0)
            ds = 2.0**-8 * scale * torch.einsum("hd,hnd->hn", q[s].double().abs(), k.abs())
            bound = 2 * ds.amax(1) * v.abs().amax((1, 2)) + 1e-6  # per head
            err = (out[s].double() - unrounded[s]).abs().amax(1)
            assert (err <= bound).all(), f"sequence {s}: {err.max():.3g} over the rounding bound"
