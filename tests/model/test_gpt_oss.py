"""gpt-oss against transformers on tiny random checkpoints written by transformers: hidden 72 (not a
power of two), 3 layers (sliding, full, sliding) with a 5-token window (prompts far longer), four
distinct sink values per layer, q/k/v/o biases, a biased router, biased experts whose clamped SwiGLU
clips (biases N(0, 2) against a limit of 3), YaRN RoPE with an untruncated correction range.

Checked: full-forward and step-by-step cached-decode logits within 1e-4 (fp32); the HF export
reloading in transformers with identical logits; the sinks' and experts' gradients equal
transformers'; MXFP4 experts in the published layout (blocks/scales written here from chosen codes)
loading to logits within 1e-4 of transformers' own dequantized load of the same directory."""

import json

import pytest
import torch
from gpt_oss_tiny import SINKS, mxfp4_checkpoint, write_gpt_oss
from hf_parity import copy_tokenizer, hf_greedy, mixed_prompts, run_mixed_batch
from oracle_generate import ContiguousKVCache

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.quant.mxfp4 import E2M1_VALUES, dequantize_mxfp4
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import save_hf_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "ckpt")


@pytest.fixture(scope="module")
def pair(ckpt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return hf, load_model(ckpt, dtype=torch.float32)


def test_config_reads_the_family(pair):
    hf, model = pair
    cfg = model.config
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.sparse_layers) == (
        5,
        2,
        40,
        (0, 1, 2),
    )
    assert (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 3.0)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.sinks, SINKS + 0.5) and attn.o_proj.bias is not None
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (5, 80, 72) and experts.gate_up_proj_bias.shape == (5, 80)
    # the biases are large enough that the clamp (limit 3) is reached: the variant is really exercised
    assert experts.gate_up_proj_bias.abs().max() > 3.0


def test_full_forward_matches_transformers(pair):
    hf, model = pair
    ids = torch.randint(0, 160, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model.compute_logits(model(ids, torch.arange(37)[None].expand(2, -1)))
    assert (out - ref).abs().max().item() < TOL


def test_cached_decode_matches_transformers(pair):
    """Prefill 9 tokens, then 22 more one at a time through the contiguous KV cache."""
    hf, model = pair
    ids = torch.randint(0, 160, (1, 31), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        cache = ContiguousKVCache(model, 1, 31)
        got = [model.compute_logits(model(ids[:, :9], torch.arange(9)[None], cache))[0]]
        cache.advance()
        for t in range(9, 31):
            got.append(model.compute_logits(model(ids[:, t : t + 1], torch.tensor([[t]]), cache))[0])
            cache.advance()
    assert (torch.cat(got) - ref).abs().max().item() < TOL


def test_gradients_match_transformers(pair):
    """One causal-LM loss: the gradients of the sinks, the router bias and the expert biases equal
    transformers' (the sinks' backward goes through the attention kernel's autograd)."""
    hf, model = pair
    ids = torch.randint(0, 160, (2, 19), generator=torch.Generator().manual_seed(4))
    hf.zero_grad()
    model.zero_grad()
    hf(ids, labels=ids).loss.backward()
    logits = model.compute_logits(model(ids, torch.arange(19)[None].expand(2, -1)))
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 160), ids[:, 1:].reshape(-1)).backward()
    hp, bp = dict(hf.named_parameters()), dict(model.named_parameters())
    for i in range(3):
        p = f"model.layers.{i}."
        assert bp[f"{p}self_attn.sinks"].grad.abs().max() > 0
        torch.testing.assert_close(bp[f"{p}self_attn.sinks"].grad, hp[f"{p}self_attn.sinks"].grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(bp[f"{p}mlp.gate.bias"].grad, hp[f"{p}mlp.router.bias"].grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            bp[f"{p}mlp.experts.down_proj_bias"].grad, hp[f"{p}mlp.experts.down_proj_bias"].grad, atol=1e-5, rtol=1e-4
        )
    model.zero_grad()


def test_engine_greedy_equals_transformers_generate(pair, ckpt, embedded_dir, tmp_path):
    """A mixed batch through the Engine: prompts of 3..40 tokens (all but one longer than the 5-token
    window), two sharing a 32-token prefix (prefix-cache hits), chunked prefill (16-token budget),
    8-token blocks; greedy tokens equal transformers' ``generate``, and every decode step's top-5
    logprobs (the paged cache's step-by-step logits) are within 1e-4 of transformers' on the whole sequence."""
    from baige.runtime.config import EngineConfig
    from baige.runtime.infer.engine import Engine
    from baige.runtime.model.tokenizer import Tokenizer

    hf, model = pair
    copy_tokenizer(embedded_dir, tmp_path)
    prompts, n_new = mixed_prompts(160), [12, 9, 15, 10, 8]
    expected = hf_greedy(hf, prompts, n_new)
    eng = Engine(
        load_model(ckpt, dtype=torch.float32),
        Tokenizer.from_dir(tmp_path),
        EngineConfig(
            max_model_len=128, kv_cache_memory=4_000_000, block_size=8, max_num_seqs=8, max_num_batched_tokens=16
        ),
    )
    # 16-token chunks: in 8 steps the 34-token prompt is computed and its blocks cached
    finals = run_mixed_batch(eng, prompts, n_new, warm_steps=8, logprobs=5)
    assert [finals[f"r{i}"].token_ids for i in range(len(prompts))] == expected
    with torch.no_grad():
        for i, (p, gen) in enumerate(zip(prompts, expected)):
            ref = torch.log_softmax(hf(torch.tensor([p + gen])).logits[0, len(p) - 1 : -1], -1)  # (n_new, vocab)
            got = finals[f"r{i}"].logprobs
            assert max(abs(v - ref[j, t].item()) for j, lp in enumerate(got) for t, v in lp.top) < TOL
    assert eng.kv_cache.sliding_window == 5  # the sliding layers' blocks came from their own pool
    assert eng.block_manager.prefix_hits >= 32
    assert eng.block_manager.num_used_blocks == 0


def test_hf_export_reloads_in_transformers_with_identical_logits(pair, ckpt, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf, model = pair
    out = save_hf_checkpoint(model.state_dict(), model.config.raw, tmp_path / "export", ckpt)
    with (
        safe_open(str(out / "model.safetensors"), framework="pt") as f,
        safe_open(str(ckpt / "model.safetensors"), framework="pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in g.keys())  # the published layout
    ids = torch.randint(0, 160, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        assert torch.equal(hf(ids).logits, b)


# ---- MXFP4 ------------------------------------------------------------------------------------------------


def test_mxfp4_decodes_hand_computed_values():
    """Byte 0x2F: low nibble 0xF = -6, high nibble 0x2 = +1; byte 0x91: 0x1 = +0.5, 0x9 = -0.5; scale
    128 = 2 ** 1, scale 125 = 2 ** -2 (OCP MX v1.0: E2M1 elements, E8M0 scales with bias 127)."""
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 15], blocks[1, 0, 1] = 0x2F, 0x91, 0x2F
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (2, 32)
    expected = torch.zeros(2, 32)
    expected[0, 0], expected[0, 1], expected[0, 30], expected[0, 31] = -12.0, 2.0, 1.0, -1.0
    expected[1, 2], expected[1, 3] = -1.5, 0.25
    assert torch.equal(out, expected)
    with pytest.raises(BaigeError, match="255"):
        dequantize_mxfp4(blocks, torch.tensor([[255], [127]], dtype=torch.uint8), torch.float32)
    with pytest.raises(BaigeError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[:, :, None], torch.float32)


def test_mxfp4_checkpoint_matches_transformers_dequantized(tmp_path):
    from transformers import AutoModelForCausalLM

    path = mxfp4_checkpoint(tmp_path / "mxfp4")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # CPU: dequantizes on load
    model = load_model(path, dtype=torch.float32)
    assert "quantization_config" not in model.config.raw  # the model in memory is a float one
    ref_w = hf.model.layers[0].mlp.experts.gate_up_proj  # (E, H, 2I) interleaved, transformers' dequantization
    got_w = model.model.layers[0].mlp.experts.gate_up_proj  # (E, 2I, H) gate rows, then up rows
    assert torch.equal(torch.cat([ref_w[..., ::2], ref_w[..., 1::2]], -1).transpose(1, 2), got_w)
    ids = torch.randint(0, 160, (2, 29), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model.compute_logits(model(ids, torch.arange(29)[None].expand(2, -1)))
    assert (out - ref).abs().max().item() < TOL


def test_mxfp4_errors_name_the_field(tmp_path):
    from safetensors.torch import load_file, save_file

    path = mxfp4_checkpoint(tmp_path / "mxfp4")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BaigeError, match="model.layers.2.mlp.experts.down_proj_scales"):
        load_model(path, dtype=torch.float32)
    llama = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 160,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))
    with pytest.raises(BaigeError, match="mxfp4"):
        load_model(tmp_path / "llama")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"layer_types": ["sliding_attention", "bogus"]}, "layer_types"),
        ({"swiglu_limit": "seven"}, "swiglu_limit"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": None}, "sliding_window"),
    ],
)
def test_unsupported_fields_are_named(change, needle):
    base = {
        "model_type": "gpt_oss",
        "hidden_size": 72,
        "num_attention_heads": 4,
        "vocab_size": 160,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    with pytest.raises(BaigeError, match=needle):
        ModelConfig.from_dict({**base, **change})
