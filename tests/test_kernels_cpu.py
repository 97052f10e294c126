"""The native CPU quantized-linear kernel (baige/kernels/cpu): values against the reference and
fp64, the dispatch rules, and the fallback when it cannot be built."""

import shutil

import pytest
import torch

import baige.kernels as kernels
from baige.kernels import cpu, reference
from baige.runtime.quant import QuantScheme, pack_int4, quantize_weight
from tests.kernel_checks import assert_close_fp64



@pytest.fixture(autouse=True)
def _native_kernel():
    """Skip only where the kernel is not meant to build (no C compiler, no AVX2); elsewhere it must."""
    if not (shutil.which("cc") or shutil.which("gcc")) or not cpu._cpu_has_avx2():
        pytest.skip("no C compiler or no AVX2: the native kernel is not built here")
    assert cpu.library() is not None, "the native CPU kernel failed to build (see the warning)"

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


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
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


def test_native_zero_rows():
    qweight, scale, zp = _weights(SCHEMES["int8"], 8, 64)
    assert cpu.quantized_linear(torch.empty(0, 64), qweight, scale, zp, None).shape == (0, 8)


def test_dispatch(monkeypatch):
    """auto: small CPU fp32 batches go native; BAIGE_KERNELS=reference, too many rows, a gradient to
    compute or fp16 activations go to the reference."""
    scheme = SCHEMES["int8"]
    qweight, scale, zp = _weights(scheme, 16, 64)
    calls = []
    real = cpu.quantized_linear
    monkeypatch.setattr(cpu, "quantized_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.delenv("BAIGE_KERNELS", raising=False)
    small = _randn(2, 64, seed=0)
    kernels.quantized_linear(small, qweight, scale, zp, None)
    assert calls == [(2, 64)]
    big = _randn(cpu.MAX_ROWS[8] + 1, 64, seed=0)
    kernels.quantized_linear(big, qweight, scale, zp, None)
    kernels.quantized_linear(small.half(), qweight, scale.half(), zp, None)
    grad_x = small.clone().requires_grad_()
    y = kernels.quantized_linear(grad_x, qweight, scale, zp, None)
    y.sum().backward()  # the reference path keeps autograd
    assert grad_x.grad is not None
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    kernels.quantized_linear(small, qweight, scale, zp, None)
    assert calls == [(2, 64)]
    q4, s4, _ = _weights(SCHEMES["int4-g128-sym"], 16, 64)
    assert not cpu.supports(_randn(cpu.MAX_ROWS[4] + 1, 64, seed=0), q4, 128, None)
    assert not cpu.supports(small, q4, 12, None)  # group not a multiple of 8: reference


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """No usable compiler: one warning, library() is None, and the public op still answers (reference)."""
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="native CPU quantized-linear kernel unavailable"):
        assert cpu.library() is None
    qweight, scale, zp = _weights(SCHEMES["int8"], 8, 64)
    x = _randn(1, 64, seed=0)
    torch.testing.assert_close(kernels.quantized_linear(x, qweight, scale, zp, None),
                               reference.quantized_linear(x, qweight, scale, zp, None))
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache


def test_build_is_cached(monkeypatch, tmp_path):
    """The first build writes one .so under $BAIGE_CACHE/cpu_kernels; a second load reuses it."""
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path))
    assert cpu.library() is not None
    built = list((tmp_path / "cpu_kernels").glob("qlinear-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu, "_tried", False)
    assert cpu.library() is not None
    assert built[0].stat().st_mtime_ns == mtime and len(list((tmp_path / "cpu_kernels").iterdir())) == 1
