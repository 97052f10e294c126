"""Weight quantization: error bounds, packing, QuantizedLinear, GPTQ, the compressed-tensors format."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tiny import make_checkpoint
from torch import nn

from baige.errors import BaigeError
from baige.kernels import unpack_int4
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.format import REPORT_FILE
from baige.runtime.quant.gptq import gptq_quantize_weight
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.quant.scheme import QuantScheme, pack_int4, quantize_weight
from baige.runtime.quantize import save_quantized
from baige.runtime.weights.loader import load_model


def _ref_dequant(q, scale, zp, group_size):
    """Dequantize column by column, written independently of the code under test."""
    out_f, in_f = q.shape
    w = torch.empty(out_f, in_f, dtype=torch.float64)
    for c in range(in_f):
        gi = 0 if group_size is None else c // group_size
        z = 0.0 if zp is None else zp[:, gi].double()
        w[:, c] = (q[:, c].double() - z) * scale[:, gi].double()
    return w


def test_int8_per_channel_scale_and_error_bound():
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.linspace(0.01, 3.0, 48)[:, None]  # very different row ranges
    q, scale, zp = quantize_weight(w, QuantScheme(8, None))
    assert q.dtype == torch.int8 and scale.shape == (48, 1) and zp is None
    # compressed-tensors symmetric: scale = max|w| / ((127 - (-128)) / 2)
    assert torch.allclose(scale[:, 0], w.abs().amax(dim=1) / 127.5, rtol=1e-6)
    err = (w.double() - _ref_dequant(q, scale, None, None)).abs()
    assert (err <= scale.double() / 2 + 1e-6).all()  # + float32 rounding of w / scale
    assert err.max() > 0.3 * scale.min()  # not vacuous: rounding really happened


@pytest.mark.parametrize("in_features", [96, 4097])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_groups_error_bound_odd_in_features(in_features, group_size, symmetric):
    torch.manual_seed(1)
    out_f = 24
    w = torch.randn(out_f, in_features)
    if not symmetric:
        w = w + 0.7  # a skewed range, where the zero point matters
    n_groups = math.ceil(in_features / group_size)
    last = slice((n_groups - 1) * group_size, in_features)
    w[:, last] *= 0.01  # the last (possibly partial) group has its own, much smaller range
    q, scale, zp = quantize_weight(w, QuantScheme(4, group_size, symmetric))
    assert scale.shape == (out_f, n_groups) and int(q.min()) >= -8 and int(q.max()) <= 7
    assert (zp is None) == symmetric
    for g in range(n_groups):
        cols = w[:, g * group_size : min((g + 1) * group_size, in_features)]
        if symmetric:
            expected = cols.abs().amax(dim=1) / 7.5
        else:
            expected = (cols.amax(dim=1).clamp_min(0) - cols.amin(dim=1).clamp_max(0)) / 15
        assert torch.allclose(scale[:, g], expected, rtol=1e-5), g
    w_hat = _ref_dequant(q, scale, zp, group_size)
    bound = scale.double().repeat_interleave(group_size, dim=1)[:, :in_features] / 2
    assert ((w.double() - w_hat).abs() <= bound + 1e-6).all()  # + float32 rounding
    # the small last group is quantized on its own fine grid, not the neighbours' coarse one
    assert (w.double() - w_hat)[:, last].abs().max() < 0.02


def test_int4_packing_order_by_hand():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -8, -1, 3]], dtype=torch.int8)
    packed = pack_int4(q)
    # stored as q + 8; element j of a word in bits 4j..4j+3: 0xFEDCBA98, then 0xB70 (padding nibbles are 0)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0xFEDCBA98 - 2**32
    assert packed[0, 1].item() == 0x00000B70
    assert torch.equal(unpack_int4(packed, 11), q)


def test_packing_matches_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    torch.manual_seed(2)
    q = torch.randint(-8, 8, (37, 4097), dtype=torch.int8)
    assert torch.equal(pack_int4(q), ct.pack_to_int32(q, 4))
    assert torch.equal(ct.unpack_from_int32(pack_int4(q), 4, torch.Size(q.shape)), q)
    zp = torch.randint(-8, 8, (37, 5), dtype=torch.int8)  # zero points pack along the output dim
    assert torch.equal(pack_int4(zp.t()).t(), ct.pack_to_int32(zp, 4, packed_dim=0))


@pytest.mark.parametrize(
    "scheme", [QuantScheme(8, None), QuantScheme(4, 32), QuantScheme(4, 128, symmetric=False)], ids=str
)
def test_quantized_linear_equals_f_linear_with_dequantized_weight(scheme):
    torch.manual_seed(3)
    lin = nn.Linear(4097, 40, bias=True)
    q, scale, zp = quantize_weight(lin.weight.detach(), scheme)
    qlin = QuantizedLinear.from_quantized(lin, scheme, q, scale, zp)
    x = torch.randn(3, 5, 4097)
    ref = F.linear(x.double(), _ref_dequant(q, scale, zp, scheme.group_size), lin.bias.double())
    out = qlin(x)
    assert out.shape == (3, 5, 40)
    assert (out.double() - ref).abs().max().item() < 1e-3
    assert torch.equal(qlin.int_weight(), q)


def test_gptq_equals_rtn_when_inputs_are_uncorrelated():
    """With a diagonal Hessian there is nothing to compensate: GPTQ rounds like RTN."""
    torch.manual_seed(4)
    w = torch.randn(16, 64)
    H = torch.diag(torch.rand(64) + 0.5)
    scheme = QuantScheme(4, 32)
    q_gptq, s_gptq, _ = gptq_quantize_weight(w, H, scheme)
    q_rtn, s_rtn, _ = quantize_weight(w, scheme)
    assert torch.equal(s_gptq, s_rtn) and torch.equal(q_gptq, q_rtn)


def test_hessian_accumulator_weights_first_token():
    """H = 2/n sum_t w_t x_t x_t^T over batches, w = first_token_weight at position 0, n = sum w."""
    from baige.runtime.quant.gptq import _HessianAccumulator

    torch.manual_seed(6)
    xs = [torch.randn(2, 5, 8), torch.randn(3, 5, 8)]
    for wt in (1.0, 4.0):
        acc = _HessianAccumulator(8, torch.device("cpu"), wt)
        for x in xs:
            acc(None, (x,))
        X = torch.cat(xs).double()  # (5, 5, 8)
        w = torch.ones(5, dtype=torch.float64)
        w[0] = wt
        ref = 2 * torch.einsum("t,bti,btj->ij", w, X, X) / (X.shape[0] * w.sum())
        assert torch.allclose(acc.H.double(), ref, atol=1e-5)


@pytest.mark.parametrize("clip_search", [False, True])
@pytest.mark.parametrize("actorder", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_lowers_output_error_on_correlated_inputs(actorder, symmetric, clip_search):
    torch.manual_seed(5)
    n, d_in, d_out = 2048, 96, 32
    mix = torch.randn(d_in, d_in) * 0.3 + torch.eye(d_in)
    X = torch.randn(n, d_in) @ mix * torch.linspace(0.2, 3.0, d_in)  # correlated, uneven scales
    w = torch.randn(d_out, d_in)
    H = 2 * X.t() @ X / n
    scheme = QuantScheme(4, 32, symmetric, actorder)
    q_g, s_g, z_g = gptq_quantize_weight(w, H, scheme, block_size=64, clip_search=clip_search)
    q_r, s_r, z_r = quantize_weight(w, QuantScheme(4, 32, symmetric))
    err_g = ((X.double() @ (w.double() - _ref_dequant(q_g, s_g, z_g, 32)).t()) ** 2).mean()
    err_r = ((X.double() @ (w.double() - _ref_dequant(q_r, s_r, z_r, 32)).t()) ** 2).mean()
    assert err_g < 0.8 * err_r, (err_g, err_r)


def test_quantize_model_preserves_biases_bitwise_and_roundtrips(tmp_path):
    src = make_checkpoint(tmp_path / "src", "qwen2-bias")
    model = load_model(src)
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("bias")}
    assert biases and max(b.abs().max() for b in biases.values()) > 1.0
    scheme = QuantScheme(4, 32, symmetric=False)
    report = quantize_model(model, scheme)
    for name, b in biases.items():
        assert torch.equal(model.get_parameter(name), b), name
    ids, pos = torch.randint(0, 160, (1, 19)), torch.arange(19)[None]
    with torch.no_grad():
        before = model.compute_logits(model(ids, pos))
    out = save_quantized(model, scheme, report, tmp_path / "q", None)
    loaded = load_model(out)
    for name, b in biases.items():
        assert torch.equal(loaded.get_parameter(name), b), name
    assert isinstance(loaded.model.layers[1].mlp.up_proj, QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(loaded.compute_logits(loaded(ids, pos)), before)


def test_tied_embeddings_untouched(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "src", "llama-tied"))
    emb = model.model.embed_tokens.weight.detach().clone()
    report = quantize_model(model, QuantScheme(8, None))
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert len(report) == 2 * 7 and all(r["name"] != "lm_head" for r in report)
    out = save_quantized(model, QuantScheme(8, None), report, tmp_path / "q", None)
    loaded = load_model(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and torch.equal(loaded.lm_head.weight, emb)
    with pytest.raises(BaigeError, match="lm_head.*tied"):
        quantize_model(load_model(tmp_path / "src"), QuantScheme(8, None), ignore=[])


def test_ignore_patterns(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "src", "llama"))
    report = quantize_model(model, QuantScheme(4, 32), ignore=["lm_head", "*.down_proj", "model.layers.0.*"])
    names = [r["name"] for r in report]
    assert names == [
        f"model.layers.1.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    ]
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize(
    "scheme,fmt",
    [(QuantScheme(4, 32), "pack-quantized"), (QuantScheme(8, None), "int-quantized")],
    ids=["int4", "int8"],
)
@pytest.mark.usefixtures("exact_quant_kernels")
def test_on_disk_format_and_transformers_load(tmp_path, scheme, fmt):
    """Config fields and tensors per the compressed-tensors spec; transformers' integration loads it."""
    from safetensors import safe_open

    src = make_checkpoint(tmp_path / "src", "llama")
    model = load_model(src)
    report = quantize_model(model, scheme)
    out = save_quantized(model, scheme, report, tmp_path / "q", None)

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == fmt
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert (w["num_bits"], w["type"], w["symmetric"]) == (scheme.num_bits, "int", True)
    assert (w["strategy"], w["group_size"]) == (("group", 32) if scheme.num_bits == 4 else ("channel", None))
    rep = json.loads((out / REPORT_FILE).read_text())
    assert [r["name"] for r in rep["layers"]] == [r["name"] for r in report]

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.mlp.down_proj."  # (64, 96)
        if scheme.num_bits == 4:
            assert {p + "weight_packed", p + "weight_scale", p + "weight_shape"} <= keys and p + "weight" not in keys
            assert f.get_tensor(p + "weight_packed").dtype == torch.int32
            assert f.get_tensor(p + "weight_packed").shape == (64, 12)
            assert f.get_tensor(p + "weight_shape").tolist() == [64, 96]
            assert f.get_tensor(p + "weight_scale").shape == (64, 3)
        else:
            assert f.get_tensor(p + "weight").dtype == torch.int8 and f.get_tensor(p + "weight").shape == (64, 96)
            assert f.get_tensor(p + "weight_scale").shape == (64, 1)
        assert f.get_tensor(p + "weight_scale").dtype == torch.float32
        assert "lm_head.weight" in keys and f.get_tensor("lm_head.weight").dtype == torch.float32
        assert not any(k.endswith("zero_point") for k in keys)

    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out)
    ids = torch.randint(0, 160, (2, 23))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(23)[None].expand(2, -1)))
    assert (got - ref).abs().max().item() < 1e-4
    with torch.no_grad():  # and the quantization really changed the model
        plain = load_model(src)
        assert (plain.compute_logits(plain(ids, torch.arange(23)[None].expand(2, -1))) - ref).abs().max() > 1e-3
