"""The native decode step's Mixture-of-Experts MLP (decode.c moe_mlp, cpu_decode._describe_moe) against
the per-op module path: every MoE family of the tiny checkpoints (softmax top-k with and without
renormalisation, a gated shared expert, ERNIE-4.5's selection bias, norm floor and ungated shared experts),
fp32 and bf16, ERNIE-4.5's interleaved RoPE, and what keeps a MoE model on the per-op path."""

import pytest
import torch

from baige.runtime.infer.cpu_decode import FusedDecoder
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.experts import QuantizedExperts
from baige.runtime.quant.scheme import QuantScheme
from baige.runtime.settings import reload_settings
from baige.runtime.weights.loader import load_model
from tests.infer.test_cpu_decode import BS, CTX, _bf16_step, _check, _native, _step_inputs  # noqa: F401  (fixture)
from tests.tiny import MOE_VARIANTS, make_checkpoint


def _selection_bias(model, seed=0):
    """A non-zero e_score_correction_bias (the checkpoints' is zero), large enough to change the choice."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        statics = getattr(layer.mlp, "moe_statics", None)
        if statics is not None:
            statics.e_score_correction_bias.data = torch.rand(statics.e_score_correction_bias.shape, generator=g) * 0.3
    return model


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_native_moe_step_matches_the_module_path(tmp_path, monkeypatch, variant):
    """ERNIE-4.5 with its interleaved RoPE (permuted q/k copies in the native step)."""
    model = _selection_bias(load_model(make_checkpoint(tmp_path / variant, variant), "float32"))
    kv, *_ = _step_inputs(model)
    fused, why = FusedDecoder.build(model, kv)
    assert fused is not None and why == ""
    assert any(fused._layers._table[i].moe for i in range(model.config.num_hidden_layers))
    _check(model, monkeypatch)


@pytest.mark.parametrize("variant", ["qwen2-moe-shared", "mixtral", "ernie4.5-moe"])
def test_native_moe_step_bf16(tmp_path, monkeypatch, variant):
    """bf16 experts through bf16.c with fp32 activations: at least as close to an fp64 oracle (same bf16
    weights) as torch's per-op bf16 path (the 2x rule), as for dense bf16 models."""
    path = make_checkpoint(tmp_path / variant, variant)
    bf16 = load_model(path, "bfloat16")
    oracle = _bf16_step(load_model(path, "bfloat16").double(), torch.bfloat16, monkeypatch, "per-op").double()
    per_op = _bf16_step(bf16, torch.bfloat16, monkeypatch, "per-op").double()
    fused = _bf16_step(bf16, torch.bfloat16, monkeypatch, "fused").double()
    assert (fused - oracle).abs().max() <= 2 * (per_op - oracle).abs().max() + 1e-6


def test_interleaved_rope_with_quantized_q_k_keeps_the_per_op_path(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "e", "ernie4.5-moe"), "float32")
    assert model.model.layers[0].self_attn.rope_perm is not None
    quantize_model(model, QuantScheme(8, None), ignore=["lm_head"])
    kv = KVCache(model.config, 4, BS, torch.float32, torch.device("cpu"))
    assert FusedDecoder.build(model, kv) == (
        None,
        "layer 0: interleaved RoPE takes the native step with plain fp32 / bf16 q and k projections only",
    )


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe-shared"])
@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=["int8", "int4-g32"])
@pytest.mark.parametrize("int_dot", [False, True], ids=["exact", "int-dot"])
def test_native_moe_step_quantized_experts(tmp_path, monkeypatch, variant, scheme, int_dot):
    """Quantized experts (per-expert QuantizedLinear, the router kept float) in the native step: the exact
    kernels against the PyTorch reference, the integer-dot ones against the per-op path calling them.
    Expert widths 40 / 48 (int4 needs in_features % 8 == 0; g32 leaves a partial group)."""
    monkeypatch.setenv("BAIGE_CPU_INT_DOT", "1" if int_dot else "0")
    reload_settings()
    width = {"mixtral": dict(intermediate_size=48), "qwen2-moe-shared": dict(moe_intermediate_size=40)}[variant]
    model = load_model(make_checkpoint(tmp_path / variant, variant, **width), "float32")
    quantize_model(model, scheme, ignore=["lm_head"])
    assert any(
        isinstance(layer.mlp.experts, QuantizedExperts) for layer in model.model.layers if hasattr(layer.mlp, "experts")
    )
    _check(model, monkeypatch, against="native" if int_dot else "reference")


def test_moe_blocks_the_native_step_cannot_run_say_why(tmp_path):
    """top_k outside 1..num_experts, and LoRA stacks on MoE projections (the step's LoRA scratch and row
    grouping cover the dense projections only), keep the per-op path."""
    model = load_model(make_checkpoint(tmp_path / "m", "qwen2-moe-shared"), "float32")
    kv = KVCache(model.config, 4, BS, torch.float32, torch.device("cpu"))
    sparse = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    block = model.model.layers[sparse].mlp
    block.top_k = 6  # 5 experts
    assert FusedDecoder.build(model, kv) == (
        None,
        f"layer {sparse} Mixture-of-Experts: top_k 6 is outside 1..5 experts",
    )
    block.top_k = 2
    proj = block.shared_expert.up_proj
    proj.lora_stack = (torch.zeros(1, 4, proj.in_features), torch.zeros(1, proj.out_features, 4), torch.ones(1))
    assert FusedDecoder.build(model, kv) == (
        None,
        f"layer {sparse} Mixture-of-Experts: LoRA adapters on its projections run on the per-op path",
    )
