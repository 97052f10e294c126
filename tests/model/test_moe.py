"""Mixture-of-Experts families against transformers on tiny random checkpoints (hidden 72, dense
and sparse layers mixed, shared experts): the config's sparse layout, greedy generation through the
Engine (mixed batch, prefix caching) token-identical to transformers' ``generate``, and the HF
export reloading in transformers with identical logits. Full-forward and cached-decode parity run
for these variants in test_model_parity.py (they are part of tiny.VARIANTS)."""

import shutil

import pytest
import torch
from tiny import MOE_VARIANTS, make_checkpoint

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import TOKENIZER_FILES, save_hf_checkpoint

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
    for name in TOKENIZER_FILES:  # ids < 160 decode with any byte-level tokenizer; the engine needs one
        if (embedded_dir / name).is_file():
            shutil.copy(embedded_dir / name, path / name)
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
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 160, (32,), generator=g).tolist()
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (3, 17, 40)]
    prompts += [shared + [7, 8], shared + [9]]
    n_new = [12, 9, 15, 10, 8]
    expected = []
    with torch.no_grad():
        for p, n in zip(prompts, n_new):
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    eng = Engine(
        load_model(path),
        Tokenizer.from_dir(path),
        EngineConfig(max_model_len=128, kv_cache_memory=4_000_000, block_size=16, max_num_seqs=8),
    )
    finals = {}

    def step():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)

    for i, (p, n) in enumerate(zip(prompts, n_new)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        if i == 3:  # the last prompt arrives once the shared prefix is computed and cached
            step()
            step()
    while eng.has_unfinished():
        step()
    assert [finals[f"r{i}"] for i in range(len(prompts))] == expected, name
    assert eng.block_manager.prefix_hits >= 32  # the shared prefix was served from the cache
    assert eng.block_manager.num_used_blocks == 0


def test_hf_export_reloads_in_transformers_with_identical_logits(ckpt, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    name, path = ckpt
    model = load_model(path)
    out = save_hf_checkpoint(model.state_dict(), model.config.raw, tmp_path / "export", path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert keys == set(f.keys())  # the published per-expert layout, not baige's stacked one
    ids = torch.randint(0, 160, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert torch.equal(a, b), name


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
