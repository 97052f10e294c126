"""Mixture-of-Experts families against transformers on tiny random checkpoints (hidden 72, dense
and sparse layers mixed, shared experts): the config's sparse layout, greedy generation through the
Engine (mixed batch, prefix caching) token-identical to transformers' ``generate``, and the HF
export reloading in transformers with identical logits. Full-forward and cached-decode parity run
for these variants in test_model_parity.py (they are part of tiny.VARIANTS)."""

import pytest
import torch
from hf_parity import assert_hf_export_reloads, copy_tokenizer, hf_greedy, mixed_prompts, run_mixed_batch
from tiny import MOE_VARIANTS, make_checkpoint

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

# what each variant's config must resolve to (sparse layers, experts, top-k, shared width)
LAYOUT = {
    "qwen3-moe": ((1, 2), 7, 2, 0),
    "qwen2-moe-shared": ((1,), 5, 2, 56),
    "mixtral": ((0, 1), 6, 2, 0),
    "ernie4.5-moe": ((1, 2), 6, 3, 32),
}


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def ckpt(request, tmp_path_factory, embedded_dir):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    copy_tokenizer(embedded_dir, path)
    return request.param, path


def test_config_layout(ckpt):
    name, path = ckpt
    cfg = ModelConfig.from_file(path / "config.json")
    sparse, experts, top_k, shared = LAYOUT[name]
    assert (cfg.moe.sparse_layers, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.shared_intermediate_size) == (
        sparse,
        experts,
        top_k,
        shared,
    )
    model = load_model(path)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert kinds == [i in sparse for i in range(cfg.num_hidden_layers)]
    assert model.model.layers[sparse[0]].mlp.experts.gate_up_proj.shape == (experts, 2 * cfg.moe.intermediate_size, 72)
    assert cfg.rope_interleaved == (name == "ernie4.5-moe")
    assert cfg.num_params(active=True) < cfg.num_params()


def test_engine_greedy_equals_transformers_generate(ckpt):
    """A mixed batch (prompts of 3..40 tokens, two sharing a 32-token prefix: prefix-cache hits)."""
    from transformers import AutoModelForCausalLM

    name, path = ckpt
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, n_new = mixed_prompts(160), [12, 9, 15, 10, 8]
    expected = hf_greedy(hf, prompts, n_new)
    eng = Engine(
        load_model(path),
        Tokenizer.from_dir(path),
        EngineConfig(max_model_len=128, kv_cache_memory=4_000_000, block_size=16, max_num_seqs=8),
    )
    finals = run_mixed_batch(eng, prompts, n_new, warm_steps=2)
    assert [finals[f"r{i}"].token_ids for i in range(len(prompts))] == expected, name
    assert eng.block_manager.prefix_hits >= 32  # the shared prefix was served from the cache
    assert eng.block_manager.num_used_blocks == 0


def test_hf_export_reloads_in_transformers_with_identical_logits(ckpt, tmp_path):
    name, path = ckpt
    assert_hf_export_reloads(load_model(path), path, tmp_path / "export", name)


def test_a_missing_expert_is_one_line_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path / "ckpt", "qwen3-moe")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.4.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BaigeError, match="model.layers.2.mlp.experts.4.up_proj.weight"):
        load_model(path)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"use_sliding_window": True}, "sliding"),
        ({"num_experts": "eight"}, "num_experts"),
    ],
)
def test_unsupported_fields_are_named(change, needle):
    base = {
        "model_type": "qwen2_moe",
        "hidden_size": 72,
        "num_attention_heads": 4,
        "vocab_size": 160,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    with pytest.raises(BaigeError, match=needle):
        ModelConfig.from_dict({**base, **change})


def test_ernie_with_biases_is_refused():
    cfg = {
        "model_type": "ernie4_5_moe",
        "hidden_size": 72,
        "num_attention_heads": 4,
        "vocab_size": 160,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_intermediate_size": 32,
        "use_bias": True,
    }
    with pytest.raises(BaigeError, match="use_bias"):
        ModelConfig.from_dict(cfg)
