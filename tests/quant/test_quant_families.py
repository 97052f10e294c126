"""`baige quantize` on ERNIE-4.5 dense, Gemma 2 and Gemma 3 (tiny random checkpoints, tests/tiny.py): int8 and
int4 directories reload with the quantized model's exact logits and stay close to fp32; GPTQ runs through
the Gemma layers (scaled embedding, two RoPE bases); transformers reads a Gemma 3 int4 directory."""

import pytest
import torch
import torch.nn.functional as F
from tiny import make_checkpoint

from baige.runtime.config import QuantizeConfig
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.quant.scheme import QuantScheme
from baige.runtime.quantize import quantize_checkpoint, save_quantized
from baige.runtime.weights.loader import load_model

# cosine of the logits to fp32 on the batch below (embeddings std 1, as test_quant_moe.py's checkpoints)
MIN_COSINE = 0.99


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)))


def _ids():
    return torch.randint(0, 160, (3, 30), generator=torch.Generator().manual_seed(11))


@pytest.mark.usefixtures("exact_quant_kernels")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("variant", ["ernie4.5", "gemma2", "gemma3"])
def test_quantize_command_reloads_exactly_and_stays_close(tmp_path, variant, method):
    src = make_checkpoint(tmp_path / "src", variant, embed_std=1.0)
    out, report = quantize_checkpoint(
        QuantizeConfig(model=str(src), method=method, output=str(tmp_path / "q"), group_size=32)
    )
    cfg = load_model(src).config
    assert len(report) == cfg.num_hidden_layers * 7  # every attention and MLP projection; lm_head ignored
    loaded = load_model(out)
    assert all(isinstance(layer.mlp.down_proj, QuantizedLinear) for layer in loaded.model.layers)
    ids = _ids()
    ref, got = _logits(load_model(src), ids), _logits(loaded, ids)
    cosine = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    assert cosine > MIN_COSINE, cosine
    model = load_model(src)
    quantize_model(model, QuantScheme(8, None) if method == "int8" else QuantScheme(4, 32))
    torch.testing.assert_close(_logits(model, ids), got, rtol=1e-5, atol=1e-5)


def test_gptq_through_gemma_layers(tmp_path):
    """GPTQ runs each layer on its calibration activations: the Gemma 3 layers take the two-base RoPE
    tables and the scaled embedding; the result is closer to fp32 than round-to-nearest at int4 g32 or
    within a hair of it."""
    src = make_checkpoint(tmp_path / "src", "gemma3", embed_std=1.0)
    calib = torch.randint(0, 160, (8, 40), generator=torch.Generator().manual_seed(3))
    ids = _ids()
    ref = _logits(load_model(src), ids)
    gptq, rtn = load_model(src), load_model(src)
    quantize_model(gptq, QuantScheme(4, 32), method="gptq", calib_ids=calib)
    quantize_model(rtn, QuantScheme(4, 32))
    err = {name: (_logits(m, ids) - ref).pow(2).mean().item() for name, m in (("gptq", gptq), ("rtn", rtn))}
    assert err["gptq"] < 1.1 * err["rtn"], err


@pytest.mark.usefixtures("exact_quant_kernels")
def test_transformers_reads_a_gemma3_int4_directory(tmp_path):
    """compressed-tensors refuses partial groups: widths here are multiples of 32. The exact dequantizing
    kernels, as transformers computes with the dequantized weights."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("compressed_tensors")
    src = make_checkpoint(tmp_path / "src", "gemma3", hidden_size=64, intermediate_size=96)
    scheme = QuantScheme(4, 32)
    model = load_model(src)
    out = save_quantized(model, scheme, quantize_model(model, scheme), tmp_path / "q", None)
    ids = _ids()
    ours = _logits(load_model(out), ids)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4
