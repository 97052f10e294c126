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


def test_int8_weight_under_a_bf16_model():
    """int8-weight takes a bf16 model (what --dtype auto runs on a native-bf16 CPU): each Linear becomes
    int8 per channel quantized from its bf16 weight; bf16 activations in, bf16 out, equal to the same
    int8 weight's product in fp32 rounded to bf16; fp16-weight still refuses bf16 (fbgemm is fp32)."""
    from baige.runtime.quant.linear import QuantizedLinear

    lin, x = _linear(n_in=96, n_out=40)
    model = nn.Sequential(lin).to(torch.bfloat16)
    w = model[0].weight.detach().float()
    assert apply_quantization(model, "int8-weight") == 1 and isinstance(model[0], QuantizedLinear)
    q = model[0]
    scale = w.abs().amax(1) / 127.5  # symmetric per channel, compressed-tensors' (qmax - qmin) / 2, by hand
    torch.testing.assert_close(q.weight_scale.float().flatten(), scale, rtol=1e-6, atol=0)
    assert torch.equal(q.weight, torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
    with torch.inference_mode():
        y = q(x.bfloat16())
    want = (x.bfloat16().float() @ (q.weight.float() * scale[:, None]).T + model[0].bias.float()).bfloat16()
    assert y.dtype == torch.bfloat16 and (y.float() - want.float()).abs().max() <= 0.02
    with pytest.raises(BaigeError, match="needs a float32 model"):
        apply_quantization(nn.Sequential(nn.Linear(2, 2)).to(torch.bfloat16), "fp16-weight")
