"""The decoder against HF transformers on tiny random checkpoints of every supported variant."""

import pytest
import torch
from oracle_generate import ContiguousKVCache
from tiny import VARIANTS, make_checkpoint

from baige.runtime.weights.loader import load_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, load_model(path)


def test_full_forward_matches_transformers(pair):
    name, hf, model = pair
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (2, 67))
    positions = torch.arange(67)[None].expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        out = model.compute_logits(model(ids, positions))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < TOL, name


def test_cached_decode_matches_transformers(pair):
    """Prefill 11 tokens, then feed 20 more one at a time through the KV cache."""
    name, hf, model = pair
    torch.manual_seed(2)
    ids = torch.randint(0, hf.config.vocab_size, (1, 31))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # (31, vocab): causal, so row t is the cached-decode answer at t
        cache = ContiguousKVCache(model, 1, 31)
        got = [model.compute_logits(model(ids[:, :11], torch.arange(11)[None], cache))[0]]
        cache.advance()
        for t in range(11, 31):
            got.append(model.compute_logits(model(ids[:, t : t + 1], torch.tensor([[t]]), cache))[0])
            cache.advance()
    got = torch.cat(got)
    assert (got - ref).abs().max().item() < TOL, name


def test_variant_features_are_exercised(pair):
    """Guard against a vacuous pass: each variant really has the feature it is named for."""
    name, hf, model = pair
    cfg = model.config
    if "rope" in name:
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == name.split("-")[-2]
    if name == "qwen2-bias":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().max() > 1.0
    if name == "qwen3-qk-norm":
        assert not torch.allclose(model.model.layers[0].self_attn.q_norm.weight, torch.ones(32))
    if name.startswith("gemma"):  # both layer kinds, a window shorter than the prompts
        assert {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)} == {12, None}
        assert cfg.gemma.final_logit_softcapping is not None
    if name.startswith("ernie4.5"):
        assert cfg.rope_interleaved
    if name == "mistral-head-dim":
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_attention_heads
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == cfg.tie_word_embeddings == hf.config.tie_word_embeddings
