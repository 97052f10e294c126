"""The native CPU kernels (baige/kernels/cpu): the exact quantized linears (qlinear.c) and the
integer-dot ones (qdot.c) against the reference and fp64 on every instruction-set variant this CPU
runs, the dispatch rules, the small per-layer ops, and the fallback when nothing can be built."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import baige.kernels as kernels
from baige.kernels import reference
from baige.kernels.cpu import build as cpu_library
from baige.kernels.cpu import qlinear as cpu
from baige.runtime.quant.scheme import QuantScheme, pack_int4, quantize_weight
from tests.kernel_checks import assert_close_fp64

pytestmark = pytest.mark.usefixtures("native_kernel")

SCHEMES = {
    "int8": QuantScheme(8, None),
    "int4-g32-sym": QuantScheme(4, 32),
    "int4-g128-sym": QuantScheme(4, 128),
    "int4-g128-asym": QuantScheme(4, 128, symmetric=False),
    "int4-g64-asym": QuantScheme(4, 64, symmetric=False),
}


def _weights(scheme, out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    q, scale, zp = quantize_weight(w, scheme)
    return (q if scheme.num_bits == 8 else pack_int4(q)), scale, zp


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.usefixtures("exact_quant_kernels")
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 17])
@pytest.mark.parametrize("in_f,out_f", [(96, 7), (1000, 75), (4097, 9)])
def test_native_matches_reference(name, rows, in_f, out_f):
    """Odd in_features (96, 1000 = 7 x 128 + 104, 4097: partial groups and a partial int4 word), out
    rows not a multiple of the 4-row tile, 1-3 and 17 input rows (both tile heights and the tail)."""
    scheme = SCHEMES[name]
    qweight, scale, zp = _weights(scheme, out_f, in_f)
    x = _randn(rows, in_f, seed=1)
    bias = _randn(out_f, seed=2) if "asym" in name or name == "int8" else None
    assert cpu.supports(x, qweight, scheme.group_size, bias)
    out = cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    ref = reference.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    exact = reference.quantized_linear(d(x), qweight, d(scale), zp, scheme.group_size, d(bias))
    assert out.dtype == torch.float32 and out.shape == (rows, out_f)
    assert_close_fp64(out, ref, exact, name=f"{name} rows={rows} in={in_f}")


@pytest.mark.usefixtures("exact_quant_kernels")
def test_native_strided_input_and_leading_dims():
    """A (B, T, in) input whose rows are strided views, and an fp16 scale: same values as contiguous."""
    scheme = SCHEMES["int4-g128-asym"]
    qweight, scale, zp = _weights(scheme, 40, 256)
    wide = _randn(2, 3, 300, seed=3)
    x = wide[..., :256]  # row stride 300
    out = cpu.quantized_linear(x, qweight, scale.half(), zp, 128)
    ref = reference.quantized_linear(x.contiguous(), qweight, scale.half().float(), zp, 128)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- integer dot products over int8 block-quantized activations (qdot.c) -------------------------

from baige.kernels.cpu import isa  # noqa: E402

DOT_SCHEMES = {
    **SCHEMES,
    "int4-g32-asym": QuantScheme(4, 32, symmetric=False),
    "int4-g96-asym": QuantScheme(4, 96, symmetric=False),
}  # g96: a pair of blocks spans two groups


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("name", list(DOT_SCHEMES))
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
@pytest.mark.parametrize("in_f,out_f", [(96, 7), (1000, 75), (4097, 9)])
@pytest.mark.parametrize("passes", [1, 2])
def test_int_dot_matches_reference(use_isa, variant, name, rows, in_f, out_f, passes):
    """The integer-dot kernels on every variant, one activation pass and two: against the same math in
    fp32 and fp64 (2x rule), and against the fp64 product of the dequantized weight within the
    activation rounding bound sum_k e_b(k) / 2 * |W[n, k]|, e_b the last pass's block scale of column
    k's block (|x - q d| <= d / 2; with the residual pass |x - q d - q2 d2| <= d2 / 2, ~254x tighter)."""
    use_isa(variant)
    scheme = DOT_SCHEMES[name]
    qweight, scale, zp = _weights(scheme, out_f, in_f)
    x = _randn(rows, in_f, seed=1) * 3
    x[:, in_f // 3] = 900.0  # an outlier channel (this model class has them): its block's scale is ~7
    bias = _randn(out_f, seed=2) if "asym" in name or name == "int8" else None
    out = cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias, passes=passes)
    ref = reference.quantized_linear_int_dot(x, qweight, scale, zp, scheme.group_size, bias, passes=passes)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    exact = reference.quantized_linear_int_dot(d(x), qweight, d(scale), zp, scheme.group_size, d(bias), passes=passes)
    assert out.dtype == torch.float32 and out.shape == (rows, out_f)
    assert_close_fp64(out, ref, exact, name=f"{variant} {name} rows={rows} in={in_f} passes={passes}")
    w = reference.dequantize_weight(
        qweight if scheme.num_bits == 8 else reference.unpack_int4(qweight, in_f), scale.double(), zp, scheme.group_size
    )
    product = reference.quantized_linear(d(x), qweight, d(scale), zp, scheme.group_size, d(bias))
    blocks = reference.quantize_activation_residual(x)[3 if passes == 2 else 1]
    d_col = blocks.double().repeat_interleave(reference.ACT_BLOCK, dim=-1)[:, :in_f]  # (rows, in)
    bound = (d_col / 2) @ w.abs().T * (1 + 1e-3) + 1e-5 * max(1.0, product.abs().max().item())
    assert ((out.double() - product).abs() <= bound).all(), f"{variant} {name}: outside the rounding bound"
    assert not torch.equal(out, reference.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias))


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("name", ["int4-g32-sym", "int4-g96-asym"])
def test_int_dot_reads_bf16_scales_as_they_are(use_isa, variant, name):
    """A bf16 model's int4 scales stay bf16 in the repacked tiles (half the bytes streamed) and give,
    bit for bit, what the same values in fp32 give (bf16 widens to fp32 exactly), rows 1 and 5."""
    from baige.kernels.cpu.qlinear import repacked

    use_isa(variant)
    scheme = DOT_SCHEMES[name]
    qweight, scale, zp = _weights(scheme, 40, 1000)
    s16 = scale.bfloat16()
    q16, q32 = qweight.clone(), qweight.clone()  # repacked() keeps one entry per weight tensor
    assert (
        repacked(q16, s16, zp)[1].dtype == torch.bfloat16 and repacked(q32, s16.float(), zp)[1].dtype == torch.float32
    )
    for rows in (1, 5):
        x = _randn(rows, 1000, seed=rows) * 3
        a = cpu.quantized_linear(x, q16, s16, zp, scheme.group_size)
        assert torch.equal(a, cpu.quantized_linear(x, q32, s16.float(), zp, scheme.group_size))
        assert not torch.equal(a, cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size))  # scales did round


@pytest.mark.parametrize("name", ["int8", "int4-g32-asym"])
def test_int_dot_many_rows_in_chunks(name):
    """1100 rows (three kernel calls of at most DOT_CHUNK_ROWS): against the reference math (2x rule), and
    each row bitwise what it gives alone, across the chunk boundaries."""
    scheme = DOT_SCHEMES[name]
    qweight, scale, zp = _weights(scheme, 40, 200)
    x = _randn(1100, 200, seed=6)
    bias = _randn(40, seed=7)
    out = cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    ref = reference.quantized_linear_int_dot(x, qweight, scale, zp, scheme.group_size, bias)
    exact = reference.quantized_linear_int_dot(
        x.double(), qweight, scale.double(), zp, scheme.group_size, bias.double()
    )
    assert_close_fp64(out, ref, exact, name=f"{name} 1100 rows")
    for m in (0, 511, 512, 1023, 1024, 1099):
        alone = cpu.quantized_linear(x[m : m + 1], qweight, scale, zp, scheme.group_size, bias)[0]
        assert torch.equal(out[m], alone), m


def test_int_dot_known_values():
    """Hand-computed: x = [1, 2, ..., 32] (d = 32/127, q = rint(k * 127/32)) against int8 rows of
    ones and of (-1)^k, scale 0.5; int4 g32 rows of nibble 9 (q_w = 1) and 7 (q_w = -1), scale 0.25.
    One activation pass, then two: the residual r_k = k - q_k d (fp32) as its own block, d2 =
    max|r| / 127, q2 = rint(r * (1 / d2)), all in numpy float32."""
    x = torch.arange(1, 33, dtype=torch.float32).unsqueeze(0)
    f = np.float32
    d = f(32) / f(127)
    q = [float(np.rint(f(k) * (f(1) / d))) for k in range(1, 33)]  # half to even, as the kernel
    r = [f(k) - f(qk) * d for k, qk in zip(range(1, 33), q)]
    d2 = max(abs(v) for v in r) / f(127)
    q2 = [float(np.rint(v * (f(1) / d2))) for v in r]
    alt = torch.tensor([(-1) ** k for k in range(32)], dtype=torch.int8)
    w8 = torch.stack([torch.ones(32, dtype=torch.int8), alt])
    w4 = pack_int4(torch.tensor([[1] * 32, [-1] * 32], dtype=torch.int8))
    for passes, parts in [(1, [(d, q)]), (2, [(d, q), (d2, q2)])]:
        y8 = cpu.quantized_linear(x, w8, torch.tensor([0.5, 0.5]), None, None, passes=passes)
        exp = [
            sum(0.5 * float(s) * sum(v) for s, v in parts),
            sum(0.5 * float(s) * sum(v * (-1) ** k for k, v in enumerate(qs)) for s, qs in parts),
        ]
        torch.testing.assert_close(y8, torch.tensor([exp]), rtol=1e-6, atol=1e-6)
        y4 = cpu.quantized_linear(x, w4, torch.full((2, 1), 0.25), None, 32, passes=passes)
        total = sum(0.25 * float(s) * sum(v) for s, v in parts)
        torch.testing.assert_close(y4, torch.tensor([[total, -total]]), rtol=1e-6, atol=1e-6)
    # the residual pass recovers what one int8 pass rounds away: sum(k) = 528 exactly
    assert abs(float(cpu.quantized_linear(x, w8, torch.tensor([1.0, 1.0]), None, None, passes=2)[0, 0]) - 528) < 1e-3
    assert abs(float(cpu.quantized_linear(x, w8, torch.tensor([1.0, 1.0]), None, None, passes=1)[0, 0]) - 528) > 1e-2


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("passes", [1, 2])
def test_int_dot_int4_extreme_products_exact(use_isa, variant, rows, passes):
    """int4 g32 at the integer extremes, 19 rows x 200 columns (a partial tile, a partial block): x = +-127
    (d = 1 exactly, q = x, the residual pass all zero), weights -8 and 7 (stored nibbles 0 and 15) with row 0
    all 7 and row 1 all -8, so a lane's 8 pair sums of a block reach 2 * 15 * 127 * 8 = 30480 (the AVX2
    kernel adds them in int16 before widening). Scales 0.25: every partial sum is a multiple of 0.25 below
    2^24, exact in fp32 in any order, so the result equals the int64 product bit for bit."""
    use_isa(variant)
    out_f, in_f = 19, 200
    g = torch.Generator().manual_seed(4)
    q = torch.where(torch.rand(out_f, in_f, generator=g) < 0.5, -8, 7).to(torch.int8)
    q[0], q[1] = 7, -8
    x = torch.full((rows, in_f), 127.0)
    if rows > 1:
        x[1] = -127.0
        x[2, 1::2] = -127.0
        x[2, 5:40:3] = 127.0 * -torch.sign(x[2, 5:40:3])
    scale = torch.full((out_f, in_f // 32 + 1), 0.25)  # 7 groups: the last one 8 columns
    out = cpu.quantized_linear(x, pack_int4(q), scale, None, 32, passes=passes)
    want = (x.to(torch.int64) @ q.to(torch.int64).T).double() * 0.25
    assert torch.equal(out.double(), want), (out.double() - want).abs().max()
    assert float(out[0, 0]) == 127 * 7 * in_f * 0.25


def test_repack_layouts_hand_indexed():
    """qdot.c's tiles, element by element from the documented formulas: int8 byte [t][b][j][r][i] =
    w[16t + r][32b + 4j + i] + 128 (128 padding); int4 word [t][4b + j][r] = word 4b + j of row 16t + r
    (0x88888888 padding), scales [t][g][r] (0 padding), scaled zeros = scale * zero point."""
    n, k = 19, 40  # one full tile and a partial one; a partial 32-column block
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    r8 = cpu.repack_int8(w8)
    assert r8.shape == (2, 2, 8, 16, 4) and r8.dtype == torch.uint8
    for t, b, j, r, i in [(0, 0, 0, 0, 0), (0, 1, 1, 5, 3), (1, 0, 7, 2, 1), (1, 1, 0, 2, 3), (0, 0, 3, 15, 2)]:
        row, col = 16 * t + r, 32 * b + 4 * j + i
        want = int(w8[row, col]) + 128 if row < n and col < k else 128
        assert int(r8[t, b, j, r, i]) == want, (t, b, j, r, i)
    assert int(r8[1, 0, 0, 3, 0]) == 128 and int(r8[0, 1, 2, 0, 0]) == 128  # row 19, column 40: padding
    words = torch.randint(-(2**31), 2**31 - 1, (n, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    scale, zp = torch.rand(n, 2) + 0.5, torch.randint(-8, 8, (n, 2), dtype=torch.int8)
    wr, sr, zr = cpu.repack_int4(words, scale, zp)
    assert wr.shape == (2, 8, 16) and sr.shape == (2, 2, 16) and zr.shape == (2, 2, 16)
    assert int(wr[0, 4, 7]) == int(words[7, 4]) and int(wr[1, 2, 2]) == int(words[18, 2])
    assert int(wr[1, 2, 3]) == -0x77777778 and int(wr[0, 5, 0]) == -0x77777778  # row 19; word 5 of 5
    assert float(sr[1, 1, 2]) == float(scale[18, 1]) and float(sr[1, 0, 3]) == 0.0
    assert float(zr[0, 1, 4]) == float(scale[4, 1] * zp[4, 1].float())  # the fp32 product
    assert cpu.repack_int4(words, scale, None)[2] is None


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("name", ["int8", "int4-g32-asym", "int4-g128-sym"])
def test_int_dot_rows_independent_of_the_batch(use_isa, variant, name):
    """A row's output is bitwise the same alone or in a batch of any size (the kernels take 2 or 4
    activation rows per pass), on every variant."""
    use_isa(variant)
    scheme = DOT_SCHEMES[name]
    qweight, scale, zp = _weights(scheme, 37, 200)
    x = _randn(11, 200, seed=3)
    batch = cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size)
    for m in range(11):
        assert torch.equal(batch[m], cpu.quantized_linear(x[m : m + 1], qweight, scale, zp, scheme.group_size)[0]), m
    assert torch.equal(batch[5:9], cpu.quantized_linear(x[5:9], qweight, scale, zp, scheme.group_size))


@pytest.mark.skipif("avx512_amx" not in isa.supported(), reason="this CPU has no AMX-INT8 (avx512_amx variant)")
@pytest.mark.parametrize("name", ["int8", "int4-g32-sym", "int4-g32-asym", "int4-g96-asym", "int4-g128-asym"])
@pytest.mark.parametrize("in_f,out_f", [(1000, 75), (4097, 32)])
def test_int_dot_amx_tiles_bitwise_the_vnni_kernel(use_isa, name, in_f, out_f):
    """Calls of at least baige_qdot_amx_rows() activation rows (passes x rows) take qdot_amx.c's AMX-INT8
    tiles under avx512_amx; they give, bit for bit, the 512-bit VNNI kernel's results (the avx512_bf16
    variant): the threshold itself, partial 32-row chunks (34, 40, 80 activation rows), one pass and two, an odd
    count of 16-row weight tiles (75 rows: the last paired with itself) and an even one, partial blocks
    (1000, 4097 columns), bf16 int4 scales, 1 and 2 threads."""
    from baige.kernels.cpu.qlinear import repacked

    scheme = DOT_SCHEMES[name]
    qweight, scale, zp = _weights(scheme, out_f, in_f)
    bias = _randn(out_f, seed=2)
    use_isa("avx512_amx")
    least = cpu_library.library().baige_qdot_amx_rows()
    assert least == 32  # the OS granted the tiles; the threshold the rows below are chosen around
    cases = [(rows, passes) for rows in (16, 17, 40) for passes in (1, 2) if rows * passes >= least]
    assert cases == [(16, 2), (17, 2), (40, 1), (40, 2)]  # 32 (the threshold), 34, 40, 80 activation rows
    scales = [scale] + ([scale.bfloat16()] if scheme.num_bits == 4 else [])
    got = {}
    for variant in ("avx512_amx", "avx512_bf16"):
        use_isa(variant)
        for rows, passes in cases:
            x = _randn(rows, in_f, seed=rows) * 3
            x[:, in_f // 3] = 900.0
            for i, sc in enumerate(scales):
                q = qweight.clone()  # repacked() keeps one entry per weight tensor (per scale dtype here)
                assert repacked(q, sc, zp) is not None
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    try:
                        got[variant, rows, passes, i, threads] = cpu.quantized_linear(
                            x, q, sc, zp, scheme.group_size, bias, passes=passes
                        )
                    finally:
                        torch.set_num_threads(1)
    for key, out in got.items():
        if key[0] == "avx512_amx":
            assert torch.equal(out, got[("avx512_bf16", *key[1:])]), key
    assert not torch.equal(got["avx512_amx", 40, 2, 0, 1][:, 0], got["avx512_amx", 40, 1, 0, 1][:, 0])  # passes differ


@pytest.mark.parametrize("variant", isa.supported())
def test_int8_prefetch_changes_no_bit(use_isa, variant):
    """qdot.c's int8 software prefetch (on for Intel CPUs, off elsewhere: isa.INT8_PREFETCH_VENDORS)
    only asks for lines early: the same bits with it on and off, 1 and 3 rows, on every variant."""
    use_isa(variant)
    scheme = DOT_SCHEMES["int8"]
    qweight, scale, zp = _weights(scheme, 40, 4097)
    x = _randn(3, 4097, seed=4)
    lib = cpu_library.library()
    try:
        outs = []
        for on in (0, 1):
            lib.baige_set_int8_prefetch(on)
            outs.append([cpu.quantized_linear(x[:m], qweight, scale, zp, scheme.group_size) for m in (1, 3)])
    finally:
        lib.baige_set_int8_prefetch(int(isa.int8_prefetch()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_int8_prefetch_by_vendor():
    """Intel turns the int8 prefetch on; AMD (measured slower with it) and unknown vendors keep it off."""
    assert isa.int8_prefetch("GenuineIntel") is True
    assert isa.int8_prefetch("AuthenticAMD") is False
    assert isa.int8_prefetch("") is False


def test_repacked_cache_follows_in_place_writes():
    """The repacked tiles are built once per weight tensor (same objects on the next call) and rebuilt
    when the weight is written in place, as loading a checkpoint does."""
    qweight, scale, zp = _weights(SCHEMES["int4-g32-sym"], 24, 64)
    first = cpu.repacked(qweight, scale, zp)
    assert cpu.repacked(qweight, scale, zp)[0] is first[0]
    x = _randn(2, 64, seed=1)
    before = cpu.quantized_linear(x, qweight, scale, zp, 32)
    new_q, new_scale, _ = _weights(SCHEMES["int4-g32-sym"], 24, 64, seed=9)
    qweight.copy_(new_q)
    scale.copy_(new_scale)
    after = cpu.quantized_linear(x, qweight, scale, zp, 32)
    assert cpu.repacked(qweight, scale, zp)[0] is not first[0]
    assert not torch.equal(before, after)
    assert torch.equal(after, cpu.quantized_linear(x, new_q, new_scale, None, 32))


@pytest.mark.parametrize("name", ["int8", "int4-g32-sym", "int4-g16"])
def test_column_strided_weights(name):
    """A weight whose rows are not unit-strided (a transposed copy's view): the integer-dot kernels
    repack it once (no per-call copy, so the cache hits), the exact int4 g16 kernel reads a contiguous
    copy; results equal those of the contiguous weight."""
    scheme = QuantScheme(4, 16) if name == "int4-g16" else SCHEMES[name]
    qweight, scale, zp = _weights(scheme, 24, 128)
    strided = qweight.t().contiguous().t()
    assert strided.stride(-1) != 1
    x = _randn(3, 128, seed=2)
    want = cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size)
    assert torch.equal(cpu.quantized_linear(x, strided, scale, zp, scheme.group_size), want)
    if name != "int4-g16":
        assert cpu.repacked(strided, scale, zp)[0] is cpu.repacked(strided, scale, zp)[0]


def test_arena_places_copies_back_to_back():
    """Arena.place: equal copies, 64-byte aligned, in placement order inside one chunk; a tensor
    larger than the chunk gets a chunk of its own."""
    from baige.kernels.cpu.arena import Arena

    a = Arena(chunk=1 << 16)
    ts = [torch.arange(10, dtype=torch.int32), torch.randn(3, 5), torch.ones(100, dtype=torch.uint8)]
    placed = [a.place(t) for t in ts]
    for t, p in zip(ts, placed):
        assert torch.equal(t, p) and p.dtype == t.dtype and p.is_contiguous() and p.data_ptr() % 64 == 0
    assert placed[1].data_ptr() - placed[0].data_ptr() == 64 and placed[2].data_ptr() - placed[1].data_ptr() == 64
    big = a.place(torch.zeros(1 << 17, dtype=torch.uint8))
    assert big.numel() == 1 << 17 and not big.any()
    placed[0].zero_()
    assert ts[0][3] == 3  # a copy, not a view of the input


def test_zeroed_pages_are_zero_writable_and_outlive_their_buffer():
    """zeroed_pages: zeros of the shape and dtype, contiguous, page aligned; writes read back; the
    memory stays valid with no other reference (the tensor holds the mapping); zero elements work."""
    import gc

    from baige.kernels import zeroed_pages

    for shape, dtype in (((3, 5, 16, 64), torch.bfloat16), ((2, 1 << 20), torch.float32), ((7,), torch.float16)):
        t = zeroed_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 4096 == 0
        assert not t.any()
        gc.collect()
        t.view(-1)[-1] = 3.0
        t[0].fill_(1.5)
        assert t.view(-1)[-1].item() == 3.0 and t[0].sum().item() == 1.5 * t[0].numel()
    assert zeroed_pages((0, 4), torch.float32).shape == (0, 4)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")
def test_keep_freed_heap_is_accepted_by_glibc():
    """keep_freed_heap: glibc's mallopt takes both settings (True). (Its effect, far fewer page faults per
    offline-throughput run, depends on the whole allocation pattern of an engine and is recorded in
    docs/benchmarks/archive.md, not asserted here.)"""
    from baige.kernels import keep_freed_heap

    assert keep_freed_heap() is True


def test_int_dot_dispatch(monkeypatch):
    """int8 always takes qdot; int4 only with a group size that is a multiple of 32 (any number of rows, as
    int8); BAIGE_CPU_INT_DOT=0 never."""
    lib = cpu_library.library()
    calls = []
    for fn in ("baige_qdot_int8", "baige_qdot_int4", "baige_qlinear_int8", "baige_qlinear_int4"):
        real = getattr(lib, fn)
        monkeypatch.setattr(lib, fn, lambda *a, _f=fn, _r=real: calls.append(_f) or _r(*a))

    def kinds(scheme, rows):
        calls.clear()
        qweight, scale, zp = _weights(scheme, 8, 128)
        cpu.quantized_linear(_randn(rows, 128, seed=0), qweight, scale, zp, scheme.group_size)
        return calls[:]

    assert kinds(SCHEMES["int8"], 1) == ["baige_qdot_int8"] and kinds(SCHEMES["int8"], 300) == ["baige_qdot_int8"]
    assert kinds(SCHEMES["int4-g32-sym"], 1) == ["baige_qdot_int4"]
    assert kinds(SCHEMES["int4-g32-sym"], cpu.MAX_ROWS) == ["baige_qdot_int4"]
    # any number of rows, in chunks of DOT_CHUNK_ROWS (1100 = 512 + 512 + 76)
    assert kinds(SCHEMES["int4-g32-sym"], 1100) == ["baige_qdot_int4"] * 3
    assert kinds(SCHEMES["int8"], 1100) == ["baige_qdot_int8"] * 3
    assert kinds(QuantScheme(4, 16), 1) == ["baige_qlinear_int4"]
    monkeypatch.setenv("BAIGE_CPU_INT_DOT", "0")
    reload_settings()
    assert kinds(SCHEMES["int8"], 1) == ["baige_qlinear_int8"]
    assert kinds(SCHEMES["int4-g128-sym"], 1) == ["baige_qlinear_int4"]


@pytest.mark.usefixtures("exact_quant_kernels")
@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("name", ["int8", "int4-g128-asym", "int4-g32-sym"])
def test_exact_kernels_on_every_variant(use_isa, variant, name):
    """The exact dequantizing kernels (qlinear.c) compiled for each variant against the reference."""
    use_isa(variant)
    scheme = SCHEMES[name]
    qweight, scale, zp = _weights(scheme, 9, 1000)
    x, bias = _randn(17, 1000, seed=4), _randn(9, seed=5)
    out = cpu.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    ref = reference.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    exact = reference.quantized_linear(x.double(), qweight, scale.double(), zp, scheme.group_size, bias.double())
    assert_close_fp64(out, ref, exact, name=f"{variant} {name}")


@pytest.mark.parametrize("name", ["int8", "int4-g32-sym"])
def test_bf16_activations_take_the_native_quantized_kernels(name, monkeypatch):
    """A bf16 model's int8/int4 layers: bf16 x (and bias) widened to fp32, the native kernel, the result
    rounded back to bf16, bitwise; the kernel really ran (not the dequantizing reference)."""
    scheme = SCHEMES[name]
    qweight, scale, zp = _weights(scheme, 75, 1000)
    x, bias = _randn(5, 1000, seed=4).bfloat16(), _randn(75, seed=5).bfloat16()
    want = cpu.quantized_linear(x.float(), qweight, scale, zp, scheme.group_size, bias.float()).bfloat16()
    calls = []
    real = cpu.quantized_linear
    monkeypatch.setattr(cpu, "quantized_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = kernels.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and calls == [1]


@pytest.mark.skipif(
    "avx512_amx" not in isa.supported(), reason="the AMX dequantize path needs avx512_amx: this CPU lacks it"
)
@pytest.mark.parametrize("name", ["int8", "int4-g32-sym", "int4-g64-asym"])
def test_many_bf16_rows_on_amx_take_the_weight_dequantized_to_bf16(name, monkeypatch, use_isa):
    """Under avx512_amx a bf16 batch of at least AMX_DEQUANT_MIN_ROWS rows (a prefill chunk) multiplies
    the weight dequantized to bf16 through F.linear (oneDNN's AMX matmul): bitwise the product computed
    here from the unpacked integers, (q - zp) * scale rounded once to bf16 (an integer times a bf16
    scale is exact in fp32); one row fewer, fp32 rows, ``int_dot=False`` and the avx512_bf16 variant
    keep the native kernels."""
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    use_isa("avx512_amx")
    scheme = SCHEMES[name]
    w = torch.randn(75, 1000, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale, zp = quantize_weight(w, scheme)
    qweight = q if scheme.num_bits == 8 else pack_int4(q)
    scale = scale.bfloat16()
    rows = cpu.AMX_DEQUANT_MIN_ROWS[qweight.dtype]
    x, bias = _randn(rows, 1000, seed=7).bfloat16(), _randn(75, seed=8).bfloat16()
    g = scheme.group_size or 1000
    ints = q.float() - (0 if zp is None else zp.float().repeat_interleave(g, 1)[:, :1000])
    w16 = (ints * scale.float().repeat_interleave(g, 1)[:, :1000]).bfloat16()
    want = torch.nn.functional.linear(x, w16, bias)
    calls = []
    real = cpu.quantized_linear
    monkeypatch.setattr(cpu, "quantized_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    got = kernels.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    assert got.dtype == torch.bfloat16 and calls == [] and torch.equal(got, want)
    kernels.quantized_linear(x[1:], qweight, scale, zp, scheme.group_size, bias)
    kernels.quantized_linear(x.float(), qweight, scale.float(), zp, scheme.group_size, bias.float())
    kernels.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias, int_dot=False)
    assert calls == [rows - 1, rows, rows]
    use_isa("avx512_bf16")
    kernels.quantized_linear(x, qweight, scale, zp, scheme.group_size, bias)
    assert calls == [rows - 1, rows, rows, rows]


@pytest.mark.parametrize("name", ["int4-g32-sym", "int4-g64-asym", "int4-g128-asym", "int8"])
@pytest.mark.parametrize("in_f", [96, 1001])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_dequantized_bf16_is_the_reference_weight_bit_for_bit(name, in_f, scale_dtype):
    """qlinear.dequantized_bf16 (int4: qlinear.c's one-pass unpacking; int8: torch's ops) equals the weight
    computed here from the unpacked integers, bit for bit: (q - zp) * scale with a bf16 scale (an exact
    product rounded once to bf16) or an fp32 one (rounded to fp32, then to bf16), as the reference's
    dequantize_weight(...).to(bfloat16) rounds; 1001 columns = a partial last word and a partial last group;
    on 1 and 2 threads (70 x 1001 weights: above the split size)."""
    scheme = SCHEMES[name]
    w = torch.randn(70, in_f, generator=torch.Generator().manual_seed(in_f)) * 0.05  # 70 x 1001 > 65536: split
    q, scale, zp = quantize_weight(w, scheme)
    qweight = q if scheme.num_bits == 8 else pack_int4(q)
    scale = scale.to(scale_dtype)
    g = scheme.group_size or in_f
    ints = q.float() - (0 if zp is None else zp.float().repeat_interleave(g, 1)[:, :in_f])
    want = (ints * scale.float().repeat_interleave(g, 1)[:, :in_f]).to(scale_dtype).bfloat16()
    x = torch.zeros(1, in_f, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = cpu.dequantized_bf16(x, qweight, scale, zp, scheme.group_size)
            assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16)), n
    finally:
        torch.set_num_threads(threads)


def test_native_zero_rows():
    qweight, scale, zp = _weights(SCHEMES["int8"], 8, 64)
    assert cpu.quantized_linear(torch.empty(0, 64), qweight, scale, zp, None).shape == (0, 8)


def test_dispatch(monkeypatch):
    """auto: CPU fp32 batches go native (the exact kernels up to MAX_ROWS rows, the integer-dot ones at
    any count); BAIGE_KERNELS=reference, a gradient to compute or fp16 activations go to the reference."""
    scheme = SCHEMES["int8"]
    qweight, scale, zp = _weights(scheme, 16, 64)
    calls = []
    real = cpu.quantized_linear
    monkeypatch.setattr(cpu, "quantized_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    small = _randn(2, 64, seed=0)
    kernels.quantized_linear(small, qweight, scale, zp, None)
    assert calls == [(2, 64)]
    big = _randn(cpu.MAX_ROWS + 1, 64, seed=0)
    kernels.quantized_linear(big, qweight, scale, zp, None, int_dot=False)  # the exact kernels: up to MAX_ROWS
    kernels.quantized_linear(small.half(), qweight, scale.half(), zp, None)
    grad_x = small.clone().requires_grad_()
    y = kernels.quantized_linear(grad_x, qweight, scale, zp, None)
    y.sum().backward()  # the reference path keeps autograd
    assert grad_x.grad is not None
    assert calls == [(2, 64)]
    kernels.quantized_linear(big, qweight, scale, zp, None)  # integer dot: native at any row count
    assert calls == [(2, 64), (cpu.MAX_ROWS + 1, 64)]
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    reload_settings()
    kernels.quantized_linear(small, qweight, scale, zp, None)
    assert len(calls) == 2
    q4, s4, _ = _weights(SCHEMES["int4-g128-sym"], 16, 64)
    assert not cpu.supports(_randn(cpu.MAX_ROWS + 1, 64, seed=0), q4, 128, None, int_dot=False)
    assert cpu.supports(_randn(cpu.MAX_ROWS + 1, 64, seed=0), q4, 128, None)  # integer dot: any rows
    assert not cpu.supports(_randn(cpu.MAX_ROWS + 1, 64, seed=0), q4, 32, None, int_dot=False)
    assert not cpu.supports(small, q4, 12, None)  # group not a multiple of 8: reference


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """No usable compiler: one warning, library() is None, and the public op still answers (reference)."""
    monkeypatch.setattr(cpu_library, "_libs", {})
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path))
    reload_settings()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    reload_settings()
    with pytest.warns(UserWarning, match="native CPU kernels unavailable"):
        assert cpu_library.library() is None
    qweight, scale, zp = _weights(SCHEMES["int8"], 8, 64)
    x = _randn(1, 64, seed=0)
    torch.testing.assert_close(
        kernels.quantized_linear(x, qweight, scale, zp, None), reference.quantized_linear(x, qweight, scale, zp, None)
    )
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache


def test_build_is_cached(monkeypatch, tmp_path):
    """The first build writes one .so under $BAIGE_CACHE/cpu_kernels; a second load reuses it."""
    monkeypatch.setattr(cpu_library, "_libs", {})
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path))
    reload_settings()
    assert cpu_library.library() is not None
    built = list((tmp_path / "cpu_kernels").glob(f"baige_cpu-{cpu_library.current_isa()}-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_library, "_libs", {})
    assert cpu_library.library() is not None
    assert built[0].stat().st_mtime_ns == mtime
    assert len(list((tmp_path / "cpu_kernels").glob("*.so"))) == 1


def test_concurrent_first_builds_compile_once(monkeypatch, tmp_path):
    """Four threads asking for one variant's library at once: one compiles (under the lock file), the
    others wait and find its .so (a stand-in compiler: the lock, not the C build, is under test)."""
    calls = []

    def slow_compile(cc, flags, files, out):
        calls.append(out)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        out.write_bytes(b"stand-in")

    monkeypatch.setattr(cpu_library, "_compile", slow_compile)
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path))
    reload_settings()
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: cpu_library.compile_variant("avx2"), range(4)))
    assert len(calls) == 1 and len(set(paths)) == 1 and paths[0].read_bytes() == b"stand-in"


# ---- the small per-layer ops (ops.c) --------------------------------------------------------------

from baige.kernels.cpu import ops as cpu_ops  # noqa: E402
from baige.runtime.settings import reload_settings  # noqa: E402


@pytest.mark.parametrize("shape", [(3, 5, 576), (2, 1023), (1, 1, 7)])
def test_rms_norm_and_add_rms_norm(shape):
    x, res = _randn(*shape, seed=0) * 3, _randn(*shape, seed=1)
    w = _randn(shape[-1], seed=2)
    eps = 1e-5
    exact = reference.rms_norm(x.double(), w.double(), eps)
    assert_close_fp64(cpu_ops.rms_norm(x, w, eps), reference.rms_norm(x, w, eps), exact, name=f"rms {shape}")
    out, summed = cpu_ops.add_rms_norm(x, res, w, eps)
    ref_out, ref_sum = reference.add_rms_norm(x, res, w, eps)
    assert torch.equal(summed, ref_sum)  # one fp32 add: bitwise
    assert_close_fp64(out, ref_out, reference.rms_norm((x + res).double(), w.double(), eps), name=f"add_rms {shape}")


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("shape", [(3, 5, 576), (2, 1023), (1, 1, 7)])
def test_bf16_silu_mul_and_norms_on_every_variant(use_isa, variant, shape):
    """act_bf16.c on bf16 tensors: the reference's roundings (silu rounded before the multiply, the
    normalised x before the weight, the residual sum before its statistics), so equal to the reference
    bit for bit but for rare last-bit ties of a differently ordered fp32 sum (<= 1 bf16 step, < 0.5% of
    elements), and within the 2x rule of fp64; tails under 8 (1023, 7)."""
    use_isa(variant)
    x, res = (_randn(*shape, seed=0) * 3).bfloat16(), _randn(*shape, seed=1).bfloat16()
    w, eps = (_randn(shape[-1], seed=2) + 1).bfloat16(), 1e-5

    def close_to_reference(out, ref, exact, name):
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        diff = (out.float() - ref.float()).abs()
        step = ref.float().abs().clamp_min(1e-30) * 2.0**-7  # one bf16 rounding step, generously
        assert (diff <= step).all() and (diff > 0).float().mean().item() < 0.005, name
        assert_close_fp64(out, ref, exact, name=name)

    g, u = x, res
    close_to_reference(
        cpu_ops.silu_mul(g, u),
        reference.silu_mul(g, u),
        reference.silu_mul(g.double(), u.double()),
        f"silu_mul {variant} {shape}",
    )
    close_to_reference(
        cpu_ops.rms_norm(x, w, eps),
        reference.rms_norm(x, w, eps),
        reference.rms_norm(x.double(), w.double(), eps),
        f"rms {variant} {shape}",
    )
    out, summed = cpu_ops.add_rms_norm(x, res, w, eps)
    ref_out, ref_sum = reference.add_rms_norm(x, res, w, eps)
    assert torch.equal(summed, ref_sum)  # one fp32 add, one rounding: bitwise
    close_to_reference(
        out, ref_out, reference.rms_norm(ref_sum.double(), w.double(), eps), f"add_rms {variant} {shape}"
    )


def test_bf16_silu_mul_writes_the_same_bits_on_every_variant(use_isa):
    """The AVX-512 variants' 16-lane silu_mul does the 8-lane AVX2 arithmetic lane by lane: the same
    bf16 bits on every variant (1023 = 63 x 16 + 8 + 7: every loop and the scalar tail), NaN/inf included."""
    g, u = (_randn(2, 1023, seed=3) * 6).bfloat16(), _randn(2, 1023, seed=4).bfloat16()
    g[0, :4] = torch.tensor([float("nan"), float("inf"), 90.0, -90.0])
    outs = {}
    for variant in isa.supported():
        use_isa(variant)
        outs[variant] = cpu_ops.silu_mul(g, u).view(torch.int16)
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


def test_bf16_silu_mul_and_norms_split_over_threads_give_the_one_thread_result():
    """Above 65,536 elements act_bf16.c splits silu_mul into 8192-element chunks and the norms by rows
    over the torch threads: bitwise the one-thread result, tail (n % 8 = 5) included."""
    x, res = (_randn(97, 1541, seed=0) * 3).bfloat16(), _randn(97, 1541, seed=1).bfloat16()
    w = (_randn(1541, seed=2) + 1).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(
                (cpu_ops.silu_mul(x, res), cpu_ops.rms_norm(x, w, 1e-5), *cpu_ops.add_rms_norm(x, res, w, 1e-5))
            )
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    assert torch.equal(outs[0][0], cpu_ops.silu_mul(x.view(-1), res.view(-1)).view(97, 1541))


def test_bf16_ops_dispatch(monkeypatch):
    """kernels.silu_mul / rms_norm / add_rms_norm send all-bf16 CPU tensors to the native ops; a bf16 x
    with an fp32 weight, or fp16, stays on the reference."""
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    calls = []
    for name in ("silu_mul", "rms_norm", "add_rms_norm"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    x, w = _randn(2, 8, seed=0).bfloat16(), torch.ones(8, dtype=torch.bfloat16)
    kernels.silu_mul(x, x)
    kernels.rms_norm(x, w, 1e-6)
    kernels.add_rms_norm(x, x, w, 1e-6)
    assert calls == ["silu_mul", "rms_norm", "add_rms_norm"]
    kernels.rms_norm(x, w.float(), 1e-6)
    kernels.silu_mul(x.half(), x.half())
    assert len(calls) == 3


@pytest.mark.parametrize("head_dim", [64, 110])
def test_apply_rope_is_bitwise_the_reference(head_dim):
    """Same products and sums in the same order as the reference (no FMA contraction): bitwise equal;
    strided q (a view into a wider buffer) and GQA head counts."""
    q = _randn(2, 3, 9, head_dim + 4, seed=0)[..., :head_dim]
    k = _randn(2, 3, 3, head_dim, seed=1)
    cos, sin = _randn(2, 3, head_dim, seed=2), _randn(2, 3, head_dim, seed=3)
    out_q, out_k = cpu_ops.apply_rope(q, k, cos, sin)
    ref_q, ref_k = reference.apply_rope(q, k, cos, sin)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    bq, bk = cpu_ops.apply_rope(q, k, cos[:1], sin[:1])  # cos/sin broadcast over the batch
    assert torch.equal(bq, reference.apply_rope(q, k, cos[:1], sin[:1])[0]) and bk.shape == k.shape


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("head_dim", [64, 54, 110])
def test_bf16_apply_rope_is_bitwise_the_reference_on_every_variant(use_isa, variant, head_dim):
    """act_bf16.c's RoPE on bf16 q/k/cos/sin rounds x * cos and rotate_half(x) * sin, then their sum, as
    the reference's bf16 ops do (each product of two bf16 values is exact in fp32): bitwise equal on
    every variant; half widths 32, 27 (= 16 + 8 + 3: every loop and the scalar tail) and 55; strided q,
    GQA head counts, cos/sin broadcast over the batch; through kernels.apply_rope's dispatch too."""
    use_isa(variant)
    q = (_randn(2, 3, 9, head_dim + 4, seed=0) * 4)[..., :head_dim].bfloat16()
    k = (_randn(2, 3, 3, head_dim, seed=1) * 4).bfloat16()
    cos, sin = _randn(2, 3, head_dim, seed=2).bfloat16(), _randn(2, 3, head_dim, seed=3).bfloat16()
    q[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -3e38])
    for c, s in ((cos, sin), (cos[:1], sin[:1])):
        out_q, out_k = cpu_ops.apply_rope(q, k, c, s)
        ref_q, ref_k = reference.apply_rope(q, k, c, s)
        assert out_q.dtype == out_k.dtype == torch.bfloat16 and out_q.shape == q.shape and out_k.shape == k.shape
        assert _same_bits_or_both_nan(out_q, ref_q) and _same_bits_or_both_nan(out_k, ref_k), variant
    got = kernels.apply_rope(q, k, cos, sin)
    assert _same_bits_or_both_nan(got[0], reference.apply_rope(q, k, cos, sin)[0])


def _same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns wherever either is not NaN, NaN at the same places (NaN payloads differ: the
    native kernels write the quiet NaN 0x7fc0, torch may keep other bits)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def test_bf16_apply_rope_split_over_threads_gives_the_one_thread_result(monkeypatch):
    """Above 65,536 elements the bf16 RoPE splits its tokens over the torch threads: bitwise the one-thread
    result; kernels.apply_rope sends all-bf16 tensors to it and a bf16 q with fp32 cos/sin to the reference."""
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    q, k = _randn(300, 9, 64, seed=0).bfloat16(), _randn(300, 3, 64, seed=1).bfloat16()
    cos, sin = _randn(300, 64, seed=2).bfloat16(), _randn(300, 64, seed=3).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_ops.apply_rope(q, k, cos, sin))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert torch.equal(outs[0][0], other[0]) and torch.equal(outs[0][1], other[1])
    calls = []
    real = cpu_ops.apply_rope
    monkeypatch.setattr(cpu_ops, "apply_rope", lambda *a: calls.append(a[0].dtype) or real(*a))
    kernels.apply_rope(q, k, cos, sin)
    mixed = kernels.apply_rope(q, k, cos.float(), sin.float())
    assert calls == [torch.bfloat16]
    assert torch.equal(mixed[0], reference.apply_rope(q, k, cos.float(), sin.float())[0])


def _paged_case(seed, S=4, H=6, Hkv=2, D=59, nb=12, bs=4, W=3):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(Hkv, nb, bs, D, generator=g), torch.randn(Hkv, nb, bs, D, generator=g)
    tables = torch.randperm(nb, generator=g)[: S * W].view(S, W)  # scattered blocks, no sharing
    lens = torch.tensor([1, bs, bs * W, 7])[:S]  # one token, one full block, every slot, a partial block
    q = torch.randn(S, H, D, generator=g)
    return q, kc, vc, tables, lens


def test_paged_decode_attention_reads_blocks_in_place():
    q, kc, vc, tables, lens = _paged_case(0)
    scale = 59**-0.5
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, scale)
    ref = reference.paged_decode_attention(q, kc, vc, tables, lens, scale)
    exact = reference.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, lens, scale)
    assert_close_fp64(out, ref, exact, name="paged decode")
    # a key outside every sequence's context must not matter: poison the unused slots
    kc2, vc2 = kc.clone(), vc.clone()
    used = torch.zeros(kc.shape[1] * kc.shape[2], dtype=torch.bool)
    for s in range(tables.shape[0]):
        for pos in range(int(lens[s])):
            used[int(tables[s, pos // kc.shape[2]]) * kc.shape[2] + pos % kc.shape[2]] = True
    kc2.view(kc.shape[0], -1, kc.shape[-1])[:, ~used] = float("nan")
    vc2.view(vc.shape[0], -1, vc.shape[-1])[:, ~used] = float("nan")
    assert torch.equal(cpu_ops.paged_decode_attention(q, kc2, vc2, tables, lens, scale), out)


def test_store_kv_matches_reference_and_skips_negative_slots():
    Hkv, nb, bs, D = 2, 5, 4, 16
    k, v = _randn(3, Hkv, D, seed=0), _randn(3, Hkv, D, seed=1)
    kc, vc = torch.zeros(Hkv, nb, bs, D), torch.zeros(Hkv, nb, bs, D)
    slots = torch.tensor([17, 2, 9])
    rk, rv = kc.clone(), vc.clone()
    reference.store_kv(k, v, rk, rv, slots)
    cpu_ops.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    cpu_ops.store_kv(k, v, kc, vc, torch.tensor([-1, -1, 3]))  # padding slots: untouched
    assert torch.equal(kc.view(Hkv, -1, D)[:, 3], k[2]) and torch.equal(
        kc.view(Hkv, -1, D)[:, 17], rk.view(Hkv, -1, D)[:, 17]
    )


def test_store_kv_into_an_fp16_cache_rounds_like_torch():
    """fp32 K/V into an fp16 cache: round to nearest even, bitwise what ``.to(torch.float16)`` gives
    (values at fp16 rounding ties and beyond its range included); head_dim 20: the scalar tail too."""
    Hkv, nb, bs, D = 2, 5, 4, 20
    k, v = _randn(3, Hkv, D, seed=0) * 3, _randn(3, Hkv, D, seed=1)
    k[0, 0, :4] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 70000.0, -1e-8])  # ties to even, overflow, underflow
    k[0, 0, 19] = 1 + 2**-11  # a tie in the scalar tail
    kc, vc = torch.zeros(Hkv, nb, bs, D, dtype=torch.float16), torch.zeros(Hkv, nb, bs, D, dtype=torch.float16)
    rk, rv = kc.clone(), vc.clone()
    slots = torch.tensor([17, 2, 9])
    reference.store_kv(k, v, rk, rv, slots)
    cpu_ops.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    assert kc.view(Hkv, -1, D)[0, 17, 0] == 1.0 and kc.view(Hkv, -1, D)[0, 17, 2] == float("inf")


def test_store_kv_into_a_bf16_cache_rounds_like_torch():
    """fp32 K/V into a bf16 cache: round to nearest even, bitwise what ``.to(torch.bfloat16)`` gives
    (ties both ways, a value rounding up to inf, NaN, a subnormal); head_dim 20."""
    Hkv, nb, bs, D = 2, 5, 4, 20
    k, v = _randn(3, Hkv, D, seed=0) * 3, _randn(3, Hkv, D, seed=1)
    k[0, 0, :6] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.397e38, float("nan"), 1e-40, -(1 + 2**-8)])
    kc, vc = torch.zeros(Hkv, nb, bs, D, dtype=torch.bfloat16), torch.zeros(Hkv, nb, bs, D, dtype=torch.bfloat16)
    rk, rv = kc.clone(), vc.clone()
    slots = torch.tensor([17, 2, 9])
    reference.store_kv(k, v, rk, rv, slots)
    cpu_ops.store_kv(k, v, kc, vc, slots)
    got = kc.view(Hkv, -1, D)[0, 17, :6].float()
    assert got[0] == 1.0 and got[1] == 1 + 2**-6 and got[2] == float("inf") and got[5] == -1.0  # hand-rounded
    assert torch.isnan(got[3])
    k_ok = torch.equal(kc.view(torch.int16), rk.view(torch.int16)) or torch.equal(  # NaN payloads may differ
        torch.nan_to_num(kc.float(), nan=7.0), torch.nan_to_num(rk.float(), nan=7.0)
    )
    assert k_ok and torch.equal(vc, rv)


def test_bf16_kv_into_a_bf16_cache_is_copied_as_the_reference_writes_it(monkeypatch):
    """A bf16 model's K/V into its bf16 cache (kernels.store_kv's native row copies): bitwise what the
    reference's index_copy_ writes, other slots untouched, padding slots (-1) skipped; a bf16 K/V into
    an fp16 cache stays on the reference (a conversion the copy does not do)."""
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    Hkv, nb, bs, D = 3, 6, 4, 24
    k, v = _randn(5, Hkv, D, seed=0).bfloat16(), _randn(5, Hkv, D, seed=1).bfloat16()
    kc, vc = _randn(Hkv, nb, bs, D, seed=2).bfloat16(), _randn(Hkv, nb, bs, D, seed=3).bfloat16()
    rk, rv = kc.clone(), vc.clone()
    slots = torch.tensor([17, 2, 9, 23, 0])
    reference.store_kv(k, v, rk, rv, slots)
    calls = []
    real = cpu_ops.store_kv
    monkeypatch.setattr(cpu_ops, "store_kv", lambda *a: calls.append(a[2].dtype) or real(*a))
    kernels.store_kv(k, v, kc, vc, slots)
    assert calls == [torch.bfloat16]
    assert torch.equal(kc.view(torch.int16), rk.view(torch.int16)) and torch.equal(
        vc.view(torch.int16), rv.view(torch.int16)
    )
    assert torch.equal(kc.view(Hkv, -1, D)[:, 23], k[3])  # hand-checked: token 3 of each head at slot 23
    before = kc.clone()
    real(k[:2], v[:2], kc, vc, torch.tensor([-1, 5]))
    assert torch.equal(kc.view(Hkv, -1, D)[:, 5], k[1])
    changed = (kc != before).view(Hkv, -1, D).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == [5]
    fk, fv = torch.zeros(Hkv, nb, bs, D, dtype=torch.float16), torch.zeros(Hkv, nb, bs, D, dtype=torch.float16)
    kernels.store_kv(k, v, fk, fv, slots)
    assert calls == [torch.bfloat16] and torch.equal(fk.view(Hkv, -1, D)[:, 17], k[0].half())


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 33])
@pytest.mark.parametrize("in_f,out_f", [(96, 7), (1000, 75), (4097, 9)])
def test_bf16_weight_linear_on_every_variant(use_isa, variant, rows, in_f, out_f):
    """bf16 weights (bf16.c): on AVX-512 BF16 vdpbf16ps over x rounded to bf16 -- and on avx512_amx, from 4
    rows, AMX tiles over the same rounded x (amx_linear.c) --, so the reference is F.linear on the
    bf16-rounded x (and fp64 of the same); elsewhere the exact widening kernel against F.linear on fp32 x.
    Odd shapes: K tails under 32 and 8, output tails under 4 and 16 rows, row counts past one and two
    16-row blocks; bias fp32."""
    use_isa(variant)
    dot = bool(cpu_library.library().baige_bf16_dot())
    assert dot == (variant in ("avx512_bf16", "avx512_amx"))
    x = _randn(rows, in_f, seed=1)
    w = (_randn(out_f, in_f, seed=2) * 0.05).bfloat16()
    bias = _randn(out_f, seed=3)
    xr = x.bfloat16().float() if dot else x
    ref = torch.nn.functional.linear(xr, w.float(), bias)
    exact = torch.nn.functional.linear(xr.double(), w.double(), bias.double())
    out = cpu.linear_f16(x, w, bias)
    assert out.dtype == torch.float32
    assert_close_fp64(out, ref, exact, name=f"bf16 {variant} rows={rows} in={in_f}")
    nob = cpu.linear_f16(x, w, None)  # full 4 x 4 tiles store their 16 sums at once: without a bias too
    assert_close_fp64(nob, ref - bias, exact - bias.double(), name=f"bf16 {variant} rows={rows} no bias")
    threads = torch.get_num_threads()
    try:  # 1, 2 and 3 threads split the output tiles into ranges: each sum computed as on one thread
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(cpu.linear_f16(x, w, bias), out), (variant, rows, in_f, n)
    finally:
        torch.set_num_threads(threads)


def test_silu_mul_against_reference():
    g = _randn(5, 37, seed=0) * 6  # 37: the scalar tail; large |x| for the clamped exp
    g[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    u = _randn(5, 37, seed=1)
    out = cpu_ops.silu_mul(g, u)
    assert_close_fp64(out, reference.silu_mul(g, u), reference.silu_mul(g.double(), u.double()), name="silu_mul")


def test_ops_dispatch(monkeypatch):
    """auto + fp32 CPU without grad: native; requires grad (training), fp16 or BAIGE_KERNELS=reference:
    the reference, with autograd intact."""
    calls = []
    real = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    x, w = _randn(2, 8, seed=0), torch.ones(8)
    kernels.rms_norm(x, w, 1e-6)
    assert calls == [1]
    xg = x.clone().requires_grad_()
    kernels.rms_norm(xg, w, 1e-6).sum().backward()
    assert xg.grad is not None
    kernels.rms_norm(x.half(), w.half(), 1e-6)
    with torch.no_grad():
        kernels.rms_norm(xg, w, 1e-6)  # no grad mode: native again
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    reload_settings()
    kernels.rms_norm(x, w, 1e-6)
    assert calls == [1, 1]


def test_embedded_model_same_on_native_and_reference(embedded_dir, monkeypatch):
    """The serving engine on the native CPU kernels gives the reference kernels' greedy tokens, and
    full-sequence logits within accumulation-order noise."""
    from baige import LLM, SamplingParams
    from baige.runtime.weights.loader import load_model

    model = load_model(embedded_dir, "float32")
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 1, 42, 2000]])

    def logits():
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None], None))

    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    reload_settings()
    native = logits()
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    reload_settings()
    ref = logits()
    torch.testing.assert_close(native, ref, rtol=0, atol=1e-3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    llm = LLM(str(embedded_dir), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory=64 << 20)
    ref_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.delenv("BAIGE_KERNELS")
    reload_settings()
    out_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out_tokens == ref_tokens and all(len(t) == 8 for t in out_tokens)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 17])
@pytest.mark.parametrize("in_f,out_f", [(96, 7), (1000, 75), (4097, 9)])
def test_fp16_and_fp32_weight_linears(rows, in_f, out_f):
    """The fp16-weight kernel (public wrapper) and the fp32 one (called by the native decode step,
    driven here through ctypes) against F.linear in fp64 on the same weights, with odd shapes."""
    x = _randn(rows, in_f, seed=1)
    w = _randn(out_f, in_f, seed=2) * 0.05
    bias = _randn(out_f, seed=3)
    w16 = w.half()
    exact16 = torch.nn.functional.linear(x.double(), w16.double(), bias.double())
    ref16 = torch.nn.functional.linear(x, w16.float(), bias)
    assert cpu.supports_f16(x)
    assert_close_fp64(cpu.linear_f16(x, w16, bias), ref16, exact16, name=f"f16 rows={rows} in={in_f}")
    y = torch.empty(rows, out_f)
    cpu_library.library().baige_linear_f32(
        x.data_ptr(), rows, in_f, in_f, w.data_ptr(), out_f, in_f, None, bias.data_ptr(), y.data_ptr(), out_f, 1
    )
    exact = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert_close_fp64(y, torch.nn.functional.linear(x, w, bias), exact, name=f"f32 rows={rows} in={in_f}")


@pytest.mark.parametrize("rows", [1, 5, 17, 129])
def test_dense_linear_matches_torch(rows):
    from baige import kernels

    torch.manual_seed(rows)
    w, b = torch.randn(1003, 96), torch.randn(1003)
    x = torch.randn(rows, 96)
    ref = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(kernels.dense_linear(x, w, b), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernels.dense_linear(x, w), ref - b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("width", [1, 7, 8, 9, 16, 23, 49152, 49157])
def test_argmax_is_torch_argmax_on_every_variant(use_isa, variant, width):
    """ops.c's argmax (greedy sampling) returns torch.argmax's index: the first of tied maxima, in the
    8-lane blocks and in the tail; a row's first NaN; 0 for a row of -inf; strided rows."""
    use_isa(variant)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1] = float("-inf")
    x[2] = 0.5  # all tied: index 0
    if width > 3:
        x[3, width - 1] = x[3, width // 2] = 50.0  # tie between a block and the tail (or two blocks)
        x[4, width // 3] = float("nan")
        x[4, width - 1] = float("nan")  # the first NaN wins, not the last
        x[5, width - 1] = 1e30  # the maximum in the tail only
        x[6, 0] = float("inf")
        x[6, width - 2] = float("inf")
        x[7, width - 1] = float("nan")  # a NaN in the tail only
    expected = x.argmax(-1)
    assert torch.equal(kernels.argmax(x), expected)
    assert torch.equal(cpu_ops.argmax(x), expected)
    wide = torch.randn(9, width + 5, generator=g)
    wide[:, :width] = x
    assert torch.equal(cpu_ops.argmax(wide[:, :width]), expected)  # row stride width + 5
    if width > 3:  # hand-checked positions, not only agreement with torch
        assert expected[1] == 0 and expected[2] == 0 and expected[3] == width // 2
        assert expected[4] == width // 3 and expected[5] == width - 1 and expected[6] == 0
        assert expected[7] == width - 1


@pytest.mark.parametrize("variant", isa.supported())
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (9, 23), (16, 49152), (17, 1000)])
def test_inverse_cdf_is_torch_searchsorted_on_every_variant(use_isa, variant, rows, width):
    """ops.c's inverse-transform draw returns the index of torch.searchsorted over the float64 cumsum of
    the probabilities (sampling's formula), bitwise: zero-mass tokens, u = 0 (the total itself: the last
    token with mass), strided and unnormalised rows, a NaN row (torch's path)."""
    use_isa(variant)
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width + 3, generator=g) * 4
    x[:, 1::3] = float("-inf")  # zero-probability tokens are never drawn
    p = x.softmax(-1)[:, :width]  # row stride width + 3, mass below 1
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[0] = 0.0

    def expected(p, u):
        cdf = p.double().cumsum(-1)
        return torch.searchsorted(cdf, ((1 - u) * cdf[:, -1])[:, None]).squeeze(-1).clamp_max(p.shape[-1] - 1)

    got = kernels.inverse_cdf(p, u)
    assert torch.equal(got, expected(p, u))
    assert bool((p.gather(1, got[:, None]) > 0).all())
    if width > 3:  # hand-checked: u = 0 draws the last token with mass
        assert int(got[0]) == max(i for i in range(width) if i % 3 != 1)
    assert cpu_ops.inverse_cdf(p, u) is not None
    p[rows // 2] = float("nan")
    assert cpu_ops.inverse_cdf(p, u) is None  # a non-finite total: the caller takes torch's path
    assert torch.equal(kernels.inverse_cdf(p, u), expected(p, u))


@pytest.mark.parametrize("variant", [v for v in isa.supported() if v == "avx512_amx"] or ["none"])
def test_amx_bf16_linear_independent_of_threads(use_isa, variant):
    """amx_linear.c: bitwise the same y on 1 and 2 threads (each output summed in one order), and a row's
    outputs the same with or without the other rows of its 16-row block."""
    if variant == "none":
        pytest.skip("no AMX on this CPU: amx_linear.c does not run here")
    use_isa(variant)
    x, w = _randn(37, 200, seed=4), (_randn(70, 200, seed=5) * 0.05).bfloat16()
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(cpu.linear_f16(x, w, None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(cpu.linear_f16(x[16:20].contiguous(), w, None), outs[0][16:20])  # 4 rows: AMX too
