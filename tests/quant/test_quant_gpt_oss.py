"""Quantizing gpt-oss (tests/gpt_oss_tiny.py: biased router and experts, clamped SwiGLU that clips,
sinks, sliding window): the per-expert modules carry each expert's de-interleaved biases and the
clamped activation, int8 / int4 RTN and GPTQ run on it (also from a checkpoint whose experts are
published MXFP4: dequantized, then quantized), the per-expert compressed-tensors directory (with
``.bias`` tensors, as llm-compressor's linearised gpt-oss) reloads exactly, and the engine serves it."""

import json

import pytest
import torch
from gpt_oss_tiny import mxfp4_checkpoint, write_gpt_oss
from hf_parity import copy_tokenizer
from quant_ref import fake_quant, own_storage
from torch import nn

from baige.runtime.config import EngineConfig, QuantizeConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.moe import Experts
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.experts import QuantizedExperts, unstack_experts
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.quant.scheme import QuantScheme, quantize_weight
from baige.runtime.quantize import quantize_checkpoint, save_quantized
from baige.runtime.weights.loader import load_model

SCHEMES = {"int8": QuantScheme(8, None), "int4": QuantScheme(4, 32)}
LAYERS, EXPERTS, TOP_K = 3, 5, 2
ROWS = LAYERS * (4 + EXPERTS * 3)  # per layer: q/k/v/o + gate/up/down of 5 experts; lm_head and routers stay float
PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_quant")
    return {"float": write_gpt_oss(root / "float"), "mxfp4": mxfp4_checkpoint(root / "mxfp4")}


def _batch():
    ids = torch.randint(0, 160, (3, 19), generator=torch.Generator().manual_seed(11))
    return ids, torch.arange(19)[None].expand(3, -1)


def _logits(model, ids, pos):
    with torch.no_grad():
        return model.compute_logits(model(ids, pos))


def _published(path, name):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def test_float_per_expert_modules_equal_the_stacked_experts(ckpts):
    """Unstacked (float per-expert Linears, no quantization): each expert's gate / up bias is the
    even / odd half of the published interleaved ``gate_up_proj_bias`` and the logits equal the
    stacked model's within 1e-5; the clamped SwiGLU matters here (plain SwiGLU moves them)."""
    src = ckpts["float"]
    ids, pos = _batch()
    model = load_model(src, dtype=torch.float32)
    ref = _logits(model, ids, pos)
    assert unstack_experts(model) == LAYERS
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts."
        w13, b13 = _published(src, p + "gate_up_proj"), _published(src, p + "gate_up_proj_bias")  # (E, H, 2I), (E, 2I)
        w2, b2 = _published(src, p + "down_proj"), _published(src, p + "down_proj_bias")  # (E, I, H), (E, H)
        experts = model.model.layers[i].mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts.swiglu_limit == 3.0
        for j, e in enumerate(experts):
            assert torch.equal(e.gate_proj.weight, w13[j, :, ::2].T) and torch.equal(
                e.up_proj.weight, w13[j, :, 1::2].T
            )
            assert torch.equal(e.gate_proj.bias, b13[j, ::2]) and torch.equal(e.up_proj.bias, b13[j, 1::2])
            assert torch.equal(e.down_proj.weight, w2[j].T) and torch.equal(e.down_proj.bias, b2[j])
    assert (_logits(model, ids, pos) - ref).abs().max().item() < 1e-5
    for layer in model.model.layers:
        for e in layer.mlp.experts:
            e.swiglu_limit = None
    assert (_logits(model, ids, pos) - ref).abs().max().item() > 1e-2


def _fake_quantized_reference(model, scheme):
    """The float stacked model with every quantized weight replaced by its RTN value (tests/quant_ref.py):
    the attention projections and each expert's gate, up and down rows (per-row scales, so the stacked
    (2I, H) rows quantize as gate and up apart); biases, router, lm_head untouched."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name != "lm_head":
                m.weight.copy_(fake_quant(m.weight, scheme))
            elif isinstance(m, Experts):
                m.gate_up_proj.copy_(torch.stack([fake_quant(w, scheme) for w in m.gate_up_proj]))
                m.down_proj.copy_(torch.stack([fake_quant(w, scheme) for w in m.down_proj]))
    return model


def _assert_published_layout(out, src, scheme):
    """The written directory: per-expert quantized projections with float ``.bias`` (the halves of the
    source's interleaved bias), the router as ``mlp.router`` in fp32 and ignored, no stacked tensors."""
    from safetensors import safe_open

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and {"lm_head", "re:.*mlp.router$"} <= set(qc["ignore"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert not any("gate_up_proj" in k or k.endswith(("experts.down_proj", "_blocks", "_scales")) for k in keys)
        for i in range(LAYERS):
            p = f"model.layers.{i}.mlp."
            assert f.get_tensor(p + "router.weight").dtype == torch.float32 and p + "router.bias" in keys
            b13 = _published(src, p + "experts.gate_up_proj_bias")
            for j in range(EXPERTS):
                t = f"{p}experts.{j}."
                weight = ("weight_packed", "weight_shape") if scheme.num_bits == 4 else ("weight",)
                assert {t + f"{n}.{w}" for n in PROJS for w in (*weight, "weight_scale", "bias")} <= keys
                assert torch.equal(f.get_tensor(t + "gate_proj.bias"), b13[j, ::2])
                assert torch.equal(f.get_tensor(t + "up_proj.bias"), b13[j, 1::2])


@pytest.mark.usefixtures("exact_quant_kernels")
@pytest.mark.parametrize("source", ["float", "mxfp4"])
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_rtn_matches_dequantized_reference_and_reloads_exactly(ckpts, tmp_path, scheme_name, source):
    scheme, src = SCHEMES[scheme_name], ckpts[source]
    ids, pos = _batch()
    model = load_model(src, dtype=torch.float32)
    report = quantize_model(model, scheme)
    assert len(report) == ROWS and not any("router" in r["name"] or r["name"].endswith(".gate") for r in report)
    e = model.model.layers[1].mlp.experts[3]
    assert all(isinstance(getattr(e, n), QuantizedLinear) and getattr(e, n).bias is not None for n in PROJS)
    got = _logits(model, ids, pos)
    ref = _logits(_fake_quantized_reference(load_model(src, dtype=torch.float32), scheme), ids, pos)
    assert (got - ref).abs().max().item() < 1e-4

    out = save_quantized(model, scheme, report, tmp_path / "q", None)
    _assert_published_layout(out, src, scheme)
    loaded = load_model(out, dtype=torch.float32)
    assert isinstance(loaded.model.layers[0].mlp.experts, QuantizedExperts)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(_logits(own_storage(loaded), ids, pos), _logits(own_storage(model), ids, pos))


def test_ignored_experts_keep_biases_and_round_trip(ckpts, tmp_path):
    """All experts ignored: they go back to the stacked float experts, biases and activation with them, and
    reload stacked; one expert ignored: its float Linears keep their biases inside the per-expert module."""
    src, scheme = ckpts["float"], QuantScheme(4, 32)
    ids, pos = _batch()
    model = load_model(src, dtype=torch.float32)
    report = quantize_model(model, scheme, ignore=["lm_head", "*.experts.*"])
    assert len(report) == LAYERS * 4
    original = load_model(src, dtype=torch.float32).model.layers[2].mlp.experts
    experts = model.model.layers[2].mlp.experts
    assert isinstance(experts, Experts) and experts.swiglu_limit == original.swiglu_limit
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert torch.equal(getattr(experts, name), getattr(original, name)), name
    loaded = load_model(save_quantized(model, scheme, report, tmp_path / "none", None), dtype=torch.float32)
    assert isinstance(loaded.model.layers[2].mlp.experts, Experts)
    assert torch.equal(_logits(own_storage(loaded), ids, pos), _logits(own_storage(model), ids, pos))

    model = load_model(src, dtype=torch.float32)
    report = quantize_model(model, scheme, ignore=["lm_head", "model.layers.1.mlp.experts.2.*"])
    assert len(report) == ROWS - 3
    assert type(model.model.layers[1].mlp.experts[2].up_proj) is nn.Linear
    loaded = load_model(save_quantized(model, scheme, report, tmp_path / "one", None), dtype=torch.float32)
    kept = loaded.model.layers[1].mlp.experts[2].up_proj
    assert type(kept) is nn.Linear and torch.equal(kept.bias, model.model.layers[1].mlp.experts[2].up_proj.bias)
    assert torch.equal(_logits(own_storage(loaded), ids, pos), _logits(own_storage(model), ids, pos))


def test_gptq_runs_on_the_experts_and_reloads(ckpts, tmp_path):
    """Every routed (token, expert) pair of the calibration set reaches one expert's Hessian: per layer
    the experts' ``calibration_tokens`` sum to tokens x top-k; an expert with tokens gets other codes
    than round-to-nearest; the directory reloads with the same logits."""
    src = ckpts["float"]
    scheme = QuantScheme(4, 32)
    calib = torch.randint(0, 160, (3, 16), generator=torch.Generator().manual_seed(5))
    model = load_model(src, dtype=torch.float32)
    stacked = [layer.mlp.experts for layer in model.model.layers]
    report = quantize_model(model, scheme, method="gptq", calib_ids=calib, clip_search=False)
    rows = {r["name"]: r for r in report}
    assert len(rows) == ROWS
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts."
        counts = [rows[f"{p}{j}.gate_proj"]["calibration_tokens"] for j in range(EXPERTS)]
        assert sum(counts) == calib.numel() * TOP_K
        j = max(range(EXPERTS), key=counts.__getitem__)
        rtn = quantize_weight(stacked[i].down_proj[j].detach(), scheme)[0]
        assert not torch.equal(model.model.layers[i].mlp.experts[j].down_proj.int_weight(), rtn)
    out = save_quantized(model, scheme, report, tmp_path / "gptq", None)
    ids, pos = _batch()
    loaded = load_model(out, dtype=torch.float32)
    assert torch.equal(_logits(own_storage(loaded), ids, pos), _logits(own_storage(model), ids, pos))


def _engine_greedy(model, tokenizer, prompts, n_new):
    eng = Engine(model, tokenizer, EngineConfig(max_model_len=64, kv_cache_memory=2_000_000, block_size=8))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))
    finals = {}
    while eng.has_unfinished():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)
    return [finals[f"r{i}"] for i in range(len(prompts))]


def test_quantize_command_from_mxfp4_and_engine_serves_the_reload(ckpts, tmp_path, embedded_dir):
    """``baige quantize --method int4`` on the MXFP4 checkpoint; the engine's greedy tokens from the
    reloaded directory equal those of the model quantized in memory, which equal its own
    full-recompute argmax loop."""
    src = ckpts["mxfp4"]
    out, report = quantize_checkpoint(
        QuantizeConfig(model=str(src), method="int4", output=str(tmp_path / "q"), group_size=32)
    )
    assert len(report) == ROWS
    assert "mxfp4" not in (out / "config.json").read_text()
    in_memory = load_model(src, dtype=torch.float32)
    quantize_model(in_memory, QuantScheme(4, 32))
    prompts, n_new = [[5, 9, 33], list(range(40, 57)), [120, 3, 3, 77, 150]], 6
    expected = []
    for p in prompts:
        seq = list(p)
        for _ in range(n_new):
            seq.append(int(_logits(in_memory, torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1].argmax()))
        expected.append(seq[len(p) :])
    (tmp_path / "tok").mkdir()
    copy_tokenizer(embedded_dir, tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert _engine_greedy(in_memory, tok, prompts, n_new) == expected
    assert _engine_greedy(load_model(out, dtype=torch.float32), tok, prompts, n_new) == expected
