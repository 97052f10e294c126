"""Triton weight-only quantized linear against the reference and fp64 (interpreted on CPU)."""

import pytest
import torch

import baige.kernels as kernels
from baige.kernels import reference
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.quant.scheme import QuantScheme, pack_int4, quantize_weight
from tests.kernel_checks import DTYPES, assert_close_fp64, noncontiguous, rand, triton_kernels

IN, OUT = 1000, 75  # 1000 = 7 * 128 + 104: the last group of 128 is partial; 75 leaves a partial N block

SCHEMES = {
    "int8": QuantScheme(8, None),
    "int4-g128-sym": QuantScheme(4, 128),
    "int4-g128-asym": QuantScheme(4, 128, symmetric=False),
}


def _quantized(scheme: QuantScheme, dtype: torch.dtype, seed: int = 0):
    """(qweight, scale, zero_point) of a random (OUT, IN) weight in the layouts QuantizedLinear stores."""
    w = rand(OUT, IN, dtype=dtype, scale=0.05, seed=seed)
    q, scale, zp = quantize_weight(w, scheme)
    qweight = q if scheme.num_bits == 8 else pack_int4(q)
    return qweight, scale, zp


def _check(monkeypatch, x, qweight, scale, zp, group_size, bias, tag):
    with triton_kernels(monkeypatch):
        out = kernels.quantized_linear(x, qweight, scale, zp, group_size, bias)
    ref = reference.quantized_linear(x, qweight, scale, zp, group_size, bias)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    exact = reference.quantized_linear(d(x), qweight, d(scale), zp, group_size, d(bias))
    assert out.dtype == x.dtype
    assert_close_fp64(out, ref, exact, name=tag)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("lead", [(2, 7), (97,)])
def test_quantized_linear(monkeypatch, dtype, name, lead):
    scheme = SCHEMES[name]
    qweight, scale, zp = _quantized(scheme, dtype)
    x = rand(*lead, IN, dtype=dtype, seed=1)
    bias = rand(OUT, dtype=dtype, seed=2) if name != "int4-g128-sym" else None
    _check(monkeypatch, x, qweight, scale, zp, scheme.group_size, bias, f"{name} {dtype} {lead}")


def test_quantized_linear_noncontiguous_x_fp32_scale(monkeypatch):
    """Row-strided fp16 activations with an fp32 scale (the other dtype the public API allows)."""
    qweight, scale, zp = _quantized(SCHEMES["int4-g128-asym"], torch.float32, seed=3)
    x = noncontiguous(rand(3, IN, dtype=torch.float16, seed=4))
    assert not x.is_contiguous() and scale.dtype == torch.float32
    _check(monkeypatch, x, qweight, scale, zp, 128, None, "noncontiguous x")


@pytest.mark.parametrize("name", ["int8", "int4-g128-asym"])
def test_quantized_linear_module_dispatches_to_triton(monkeypatch, name):
    """QuantizedLinear.forward with BAIGE_KERNELS=triton: packed zero points are unpacked into a
    transposed (non-contiguous) view, which the kernel reads through its strides."""
    scheme = SCHEMES[name]
    linear = torch.nn.Linear(IN, OUT, bias=True)
    q, scale, zp = quantize_weight(linear.weight.detach(), scheme)
    module = QuantizedLinear.from_quantized(linear, scheme, q, scale, zp)
    x = rand(5, IN, dtype=torch.float32, seed=5)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, module.dequantized_weight(), module.bias)
        with triton_kernels(monkeypatch):
            assert kernels.backend(x) == "triton"
            out = module(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_quantized_linear_rejects_mismatched_scale(monkeypatch):
    qweight, scale, zp = _quantized(SCHEMES["int4-g128-sym"], torch.float32)
    with triton_kernels(monkeypatch), pytest.raises(ValueError, match="scale"):
        kernels.quantized_linear(rand(2, IN, dtype=torch.float32), qweight, scale[:, :-1], zp, 128)
