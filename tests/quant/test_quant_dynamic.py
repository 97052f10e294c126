"""Serving-time linear rewrites (baige.runtime.quant.fp16_weight): fbgemm fp16-weight."""

import pytest
import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.quant.fp16_weight import Fp16WeightLinear, apply_quantization

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm")


def _linear(n_in=96, n_out=40, bias=True):
    torch.manual_seed(0)
    lin = nn.Linear(n_in, n_out, bias=bias)
    return lin, torch.randn(2, 5, n_in)  # (B, T, in)


def test_fp16_weight_linear_is_fp32_linear_up_to_fp16_weight_rounding():
    lin, x = _linear()
    y = Fp16WeightLinear(lin)(x)
    w16 = lin.weight.detach().half().float()  # the only error: weights rounded to fp16
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y, nn.functional.linear(x, w16, lin.bias.detach()), atol=1e-5, rtol=1e-5)


def test_apply_quantization_swaps_matching_linears_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert apply_quantization(model, "fp16-weight", ignore=("2.*",)) == 1
    assert isinstance(model[0], Fp16WeightLinear) and isinstance(model[2][0], nn.Linear)
    with pytest.raises(BaigeError, match="unknown quantization"):
        apply_quantization(nn.Sequential(nn.Linear(2, 2)), "int8-dynamic")
    with pytest.raises(BaigeError, match="float32"):
        apply_quantization(nn.Sequential(nn.Linear(2, 2)).to(torch.bfloat16), "fp16-weight")
