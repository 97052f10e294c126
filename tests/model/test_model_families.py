"""ERNIE-4.5 dense, Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints: greedy
generation through the Engine (a mixed batch with prefix-cache hits and chunked prefill, prompts longer
than the sliding window) token-identical to transformers' ``generate``, and the HF export reloading in
transformers with identical logits. Full-forward and cached-decode parity run for these variants in
test_model_parity.py (they are part of tiny.VARIANTS)."""

import dataclasses

import pytest
import torch
from hf_parity import assert_hf_export_reloads, copy_tokenizer, hf_greedy, mixed_prompts, run_mixed_batch
from tiny import FAMILY_VARIANTS, make_checkpoint

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def ckpt(request, tmp_path_factory, embedded_dir):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    copy_tokenizer(embedded_dir, path)
    return request.param, path


def _hf_greedy(path, prompts, n_new):
    """transformers' greedy tokens for each prompt, and the (n, vocab) fp32 log-softmax of the logits each
    generated token was picked from (a full forward over prompt + generated tokens)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, n_new)
    with torch.no_grad():
        logprobs = [
            torch.log_softmax(hf(torch.tensor([p + gen])).logits[0, len(p) - 1 : -1].float(), -1)
            for p, gen in zip(prompts, expected)
        ]
    return expected, logprobs


def test_engine_greedy_equals_transformers_generate(ckpt):
    """Prompts of 3..45 tokens (the tiny Gemmas' window is 12), two sharing a 32-token prefix (prefix-cache
    hits); a 16-token step budget splits the long prompts into chunks that join decode steps. The tokens
    and each step's log-probabilities match transformers'."""
    name, path = ckpt
    model = load_model(path)
    vocab = model.config.vocab_size
    prompts, n_new = mixed_prompts(vocab, (3, 17, 45)), [12, 9, 20, 10, 8]
    expected, hf_logprobs = _hf_greedy(path, prompts, n_new)
    eng = Engine(
        model,
        Tokenizer.from_dir(path),
        EngineConfig(
            max_model_len=128, kv_cache_memory=4_000_000, block_size=4, max_num_seqs=8, max_num_batched_tokens=16
        ),
    )
    finals = run_mixed_batch(eng, prompts, n_new, warm_steps=4, logprobs=5)
    assert [finals[f"r{i}"].token_ids for i in range(len(prompts))] == expected, name
    # every decode step's distribution (the sampled token's and the top-5 log-probabilities) within 1e-4
    for i, ref in enumerate(hf_logprobs):
        for t, lp in enumerate(finals[f"r{i}"].logprobs):
            assert abs(lp.logprob - ref[t, lp.token_id].item()) < 1e-4, (name, i, t)
            assert max(abs(v - ref[t, tok].item()) for tok, v in lp.top) < 1e-4, (name, i, t)
    assert eng.block_manager.prefix_hits >= 32  # the shared prefix was served from the cache
    assert eng.block_manager.num_used_blocks == 0
    # the Gemmas' sliding layers run on a pool of their own, blocks before the window given back
    assert (eng.block_manager.sliding is not None) == name.startswith("gemma")


def test_hf_export_reloads_in_transformers_with_identical_logits(ckpt, tmp_path):
    name, path = ckpt
    assert_hf_export_reloads(load_model(path), path, tmp_path / "export", name)


def _gemma3_dict(**fields):
    base = dict(
        model_type="gemma3_text",
        vocab_size=160,
        hidden_size=56,
        intermediate_size=88,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return {**base, **fields}


def test_gemma3_legacy_rope_fields_and_layer_pattern():
    """Published Gemma 3 configs (before transformers 5): top-level ``rope_theta`` / ``rope_scaling`` for
    the full layers, ``rope_local_base_freq`` for the sliding ones, ``sliding_window_pattern`` 6 ->
    every sixth layer full; transformers' defaults where fields are absent."""
    cfg = ModelConfig.from_dict(
        _gemma3_dict(
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window=512,
            sliding_window_pattern=6,
        )
    )
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert [cfg.layer_window(i) for i in (0, 5, 6)] == [512, None, 512]
    assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.gemma.local_rope_theta, cfg.gemma.local_rope_scaling) == (10_000.0, None)
    assert cfg.gemma.query_pre_attn_scalar == 256 and cfg.gemma.final_logit_softcapping is None
    assert cfg.tie_word_embeddings and cfg.qk_norm
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(**{k: v for k, v in _gemma3_dict().items() if k != "model_type"}, sliding_window=512)
    assert cfg.layer_types == tuple(hf.layer_types)


def test_gemma2_defaults_soft_cap_as_transformers():
    """Gemma 2 files that leave the caps out get transformers' 50 / 30; null turns them off."""
    base = _gemma3_dict(model_type="gemma2", num_hidden_layers=3)
    cfg = ModelConfig.from_dict(base)
    assert (cfg.gemma.attn_logit_softcapping, cfg.gemma.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.gemma.local_rope_theta is None and cfg.sliding_window == 4096
    off = ModelConfig.from_dict({**base, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (off.gemma.attn_logit_softcapping, off.gemma.final_logit_softcapping) == (None, None)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_bidirectional_attention": True}, "gemma3_text with use_bidirectional_attention=true"),
        ({"attention_bias": True}, "gemma3_text with attention_bias=true"),
        ({"hidden_activation": "relu"}, "field 'hidden_activation' must be 'gelu_pytorch_tanh'"),
        ({"layer_types": ["full_attention"]}, "field 'layer_types' must be a list of 7"),
        ({"sliding_window": None}, "field 'sliding_window' must be an integer >= 1"),
        ({"rope_parameters": {"full_attention": {"rope_type": "longrope"}}}, "unsupported rope type 'longrope'"),
        ({"final_logit_softcapping": -1.0}, "field 'final_logit_softcapping' must be a finite number > 0"),
    ],
)
def test_unsupported_gemma_fields_are_named(change, message):
    with pytest.raises(BaigeError) as e:
        ModelConfig.from_dict(_gemma3_dict(**change))
    assert message in str(e.value)


def test_ernie_dense_with_biases_is_refused():
    with pytest.raises(BaigeError, match="ernie4_5 with use_bias=true"):
        ModelConfig.from_dict({**_gemma3_dict(model_type="ernie4_5"), "use_bias": True})


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_each_gemma_feature_changes_the_logits(tmp_path, variant):
    """The parity tests are not vacuous: with the window, a soft-cap or the sliding layers' own RoPE base
    switched off, the tiny checkpoints' logits move well past the 1e-4 tolerance."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / variant, variant)
    ids = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
    model = load_model(path)
    attns = [layer.self_attn for layer in model.model.layers]

    def moved():
        with torch.no_grad():
            got = model.compute_logits(model(ids, torch.arange(40)[None]))
        return (got - ref).abs().max().item()

    assert moved() < 1e-4
    for a in attns:
        a.sliding_window = None
    assert moved() > 1e-3  # the window
    for a in attns:
        a.sliding_window = model.config.layer_window(a.layer_idx)
    if variant == "gemma3":
        halves = [layer.rope_half for layer in model.model.layers]
        assert halves == [1, 0, 1, 0]
        for layer in model.model.layers:
            layer.rope_half = 0  # every layer on the full layers' RoPE
        assert moved() > 1e-3
    model = load_model(path)
    g = model.config.gemma
    model.config.gemma = dataclasses.replace(g, final_logit_softcapping=None)
    assert moved() > 1e-3
    model.config.gemma = g
    if variant == "gemma2":
        for layer in model.model.layers:
            layer.self_attn.softcap = None
        assert moved() > 1e-3
