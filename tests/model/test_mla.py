"""DeepSeek-V2 / V3 (Multi-head Latent Attention, group-limited routing) against transformers on
tiny random checkpoints (tests/mla_tiny.py): full-forward and cached-decode logits, the absorbed
(latent-cache) form against the expanded one, the latent cache's size, greedy generation through
the Engine (mixed batch, prefix caching, chunked prefill), the HF export, and the config errors."""

import pytest
import torch
from hf_parity import assert_hf_export_reloads, copy_tokenizer, hf_greedy, mixed_prompts, run_mixed_batch
from mla_tiny import MLA_VARIANTS, make_mla_checkpoint
from oracle_generate import ContiguousKVCache

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.kv_cache import KVCache, num_blocks_for
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(MLA_VARIANTS))
def ckpt(request, tmp_path_factory, embedded_dir):
    path = make_mla_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    copy_tokenizer(embedded_dir, path)
    return request.param, path


@pytest.fixture(scope="module")
def pair(ckpt):
    from transformers import AutoModelForCausalLM

    name, path = ckpt
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return name, hf, load_model(path, dtype="float32")


def test_full_forward_matches_transformers(pair):
    name, hf, model = pair
    ids = torch.randint(0, 160, (2, 45), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(45)[None].expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        out = model.compute_logits(model(ids, positions))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < TOL, name


def test_cached_decode_matches_transformers(pair):
    """Prefill 11 tokens, then 20 more one at a time through the (latent) cache."""
    name, hf, model = pair
    ids = torch.randint(0, 160, (1, 31), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        cache = ContiguousKVCache(model, 1, 31)
        got = [model.compute_logits(model(ids[:, :11], torch.arange(11)[None], cache))[0]]
        cache.advance()
        for t in range(11, 31):
            got.append(model.compute_logits(model(ids[:, t : t + 1], torch.tensor([[t]]), cache))[0])
            cache.advance()
    assert (torch.cat(got) - ref).abs().max().item() < TOL, name


def test_absorbed_equals_expanded_and_cache_holds_the_latent(pair):
    """The attention output of one MLA block through the latent cache (absorbed W_UK / W_UV) equals
    the expanded per-head K/V form within 1e-5; the cache rows are [c_kv, k_pe], one per token."""
    name, _, model = pair
    attn = model.model.layers[0].self_attn
    m = model.config.mla
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 13, model.config.hidden_size, generator=g)
    positions = torch.arange(13)[None].expand(2, -1)
    cos, sin = model.rotary_emb(positions, x.dtype)
    cache = ContiguousKVCache(model, 2, 13)
    with torch.no_grad():
        expanded = attn(x, cos, sin, None)
        absorbed = attn(x, cos, sin, cache)
    assert (absorbed - expanded).abs().max().item() < 1e-5, name
    assert cache.k[0].shape == (2, 13, 1, m.kv_lora_rank + m.qk_rope_head_dim)
    c_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., : m.kv_lora_rank])
    assert torch.allclose(cache.k[0][:, :, 0, : m.kv_lora_rank], c_kv, atol=1e-6)


def test_latent_cache_bytes_per_token_and_admission(ckpt):
    """(kv_lora_rank + qk_rope_head_dim) x dtype bytes per token per layer, one pool per layer (V is
    K's latent columns), and --kv-cache-memory admits tokens by that size."""
    name, path = ckpt
    cfg = ModelConfig.from_file(path / "config.json")
    spec = MLA_VARIANTS[name]
    per_layer = spec["kv_lora_rank"] + spec["qk_rope_head_dim"]
    assert cfg.kv_bytes_per_token(2) == 3 * per_layer * 2
    assert cfg.kv_bytes_per_token(4) == 3 * per_layer * 4
    mha = 2 * 3 * cfg.num_attention_heads * (spec["qk_nope_head_dim"] + spec["qk_rope_head_dim"]) * 4
    assert cfg.kv_bytes_per_token(4) < mha
    budget = 1_000_000
    blocks = num_blocks_for(cfg, 16, torch.float32, torch.device("cpu"), budget, 64)
    assert blocks == budget // (16 * 3 * per_layer * 4)
    kv = KVCache(cfg, 5, 16, torch.float32, torch.device("cpu"))
    assert kv.k[0].shape == (1, 6, 16, per_layer) and all(v is k for k, v in zip(kv.k, kv.v))


def test_deepseek_v3_full_size_formula():
    """DeepSeek-V3's own shapes: (512 + 64) values per token per layer, 61 layers."""
    cfg = ModelConfig.from_dict(
        dict(
            model_type="deepseek_v3",
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        )
    )
    assert cfg.kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    assert cfg.moe.sparse_layers == tuple(range(3, 61))  # first_k_dense_replace defaults to 3
    assert 670e9 < cfg.num_params() < 672e9  # DeepSeek-V3 without its MTP module: 671B


def test_engine_greedy_equals_transformers_generate(ckpt):
    """A mixed batch (prompts of 3..40 tokens, two sharing a 32-token prefix: prefix-cache hits),
    chunked prefill (at most 24 tokens a step), through the paged latent cache."""
    from transformers import AutoModelForCausalLM

    name, path = ckpt
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, n_new = mixed_prompts(160), [12, 9, 15, 10, 8]
    expected = hf_greedy(hf, prompts, n_new)
    eng = Engine(
        load_model(path, dtype="float32"),
        Tokenizer.from_dir(path),
        EngineConfig(
            max_model_len=96, kv_cache_memory=400_000, block_size=8, max_num_seqs=8, max_num_batched_tokens=24
        ),
    )
    assert eng.kv_cache.k[0].shape[0] == 1 and eng.kv_cache.v[0] is eng.kv_cache.k[0]
    finals = run_mixed_batch(eng, prompts, n_new, warm_steps=8)
    assert [finals[f"r{i}"].token_ids for i in range(len(prompts))] == expected, name
    assert eng.block_manager.prefix_hits >= 32
    assert eng.block_manager.num_used_blocks == 0


def test_hf_export_reloads_in_transformers_with_identical_logits(ckpt, tmp_path):
    name, path = ckpt
    assert_hf_export_reloads(load_model(path, dtype="float32"), path, tmp_path / "export", name)


def test_variant_features_are_exercised(pair):
    """Guard against a vacuous pass: q LoRA on/off, dense-then-MoE, YaRN's mscale in the scale, and
    group-limited choices that differ from a plain top-k (V3: some exclude the best expert)."""
    name, hf, model = pair
    cfg = model.config
    spec = MLA_VARIANTS[name]
    assert (cfg.mla.q_lora_rank is None) == (spec["q_lora_rank"] is None)
    assert cfg.moe.sparse_layers == tuple(range(spec["first_k_dense_replace"], 3))
    if name == "deepseek-v3":
        assert cfg.mla.scale > (spec["qk_nope_head_dim"] + spec["qk_rope_head_dim"]) ** -0.5 * 1.2
    layer = model.model.layers[cfg.moe.sparse_layers[0]]
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, _, ids = layer.mlp.route(x)
    scores = logits.sigmoid() if cfg.moe.routing.scoring_func == "sigmoid" else logits.softmax(-1)
    bias = layer.mlp.gate.e_score_correction_bias
    choice = scores + (bias if bias is not None else 0)
    plain = choice.topk(cfg.moe.top_k, dim=-1).indices.sort(-1).values
    assert 0 < int((ids.sort(-1).values != plain).any(-1).sum()) < 300, name  # the groups change the choice
    if bias is not None:  # V3: a group's score is its top-2 sum, so even the best expert can be left out
        assert int((ids != choice.argmax(-1)[:, None]).all(-1).sum()) > 0, name


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"topk_method": "noaux_tc", "model_type": "deepseek_v2"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 5, "topk_group": 1}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ],
)
def test_unsupported_fields_are_named(change, needle):
    base = {
        "model_type": "deepseek_v3",
        "hidden_size": 56,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 160,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    }
    with pytest.raises(BaigeError, match=needle):
        ModelConfig.from_dict({**base, **change})


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_deepseek_loads_and_decodes_through_the_latent_cache(tmp_path, method, exact_quant_kernels):
    """`baige quantize` on the tiny checkpoint: the reloaded model's MLA projections are quantized,
    its absorbed form (W_UK / W_UV from the dequantized kv_b_proj) equals its expanded form, and its
    logits stay near the fp32 model's where the routing agrees (the group-limited choice is
    discontinuous, so a token whose experts flip may differ more)."""
    from baige.runtime.config import QuantizeConfig
    from baige.runtime.quant.linear import QuantizedLinear
    from baige.runtime.quantize import quantize_checkpoint

    path = make_mla_checkpoint(tmp_path / "ckpt", "deepseek-v3")  # one family is enough for the quantizer's path
    out, _ = quantize_checkpoint(QuantizeConfig(str(path), method, str(tmp_path / "q"), group_size=32, device="cpu"))
    q, ref = load_model(out, dtype="float32"), load_model(path, dtype="float32")
    attn = q.model.layers[1].self_attn
    assert all(isinstance(getattr(attn, n), QuantizedLinear) for n in ("q_a_proj", "kv_b_proj", "o_proj"))
    ids = torch.randint(0, 160, (2, 21), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(21)[None].expand(2, -1)
    with torch.no_grad():
        expanded = q.compute_logits(q(ids, positions))
        absorbed = q.compute_logits(q(ids, positions, ContiguousKVCache(q, 2, 21)))
        fp32 = ref.compute_logits(ref(ids, positions))
    assert (absorbed - expanded).abs().max().item() < 1e-4
    # the absorbed form's W_UK / W_UV: dequantized once, kept, and dequantized again after an in-place change
    H, Dn = attn.n_heads, attn.nope
    w_uk, w_uv = attn.latent_weights()
    assert w_uk.data_ptr() == attn.latent_weights()[0].data_ptr()
    w = attn.kv_b_proj.dequantized_weight().view(H, Dn + attn.v_dim, attn.kv_lora_rank)
    assert torch.equal(w_uk, w[:, :Dn]) and torch.equal(w_uv, w[:, Dn:])
    with torch.no_grad():
        attn.kv_b_proj.weight_scale.mul_(2)
    assert torch.equal(attn.latent_weights()[1], 2 * w[:, Dn:])
    err = (expanded - fp32).abs().amax(-1)  # (2, 21) per token
    assert err.median().item() < (0.1 if method == "int8" else 1.2), err  # logits span about +-3


def test_expanded_cache_equals_the_latent_cache_through_the_engine(ckpt):
    """``use_expanded_cache``: the same model serving with an MHA-sized cache (per-head K and V of
    max(qk, v) values each, decode not absorbed) gives the latent cache's greedy tokens and their
    top-5 logprobs within 1e-5; its pools and --kv-cache-memory admission follow its formula."""
    from baige.runtime.model.mla import use_expanded_cache

    name, path = ckpt
    spec = MLA_VARIANTS[name]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 29)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    engine_cfg = EngineConfig(
        max_model_len=64, kv_cache_memory=2_000_000, block_size=8, max_num_seqs=4, max_num_batched_tokens=16
    )
    runs = {}
    for mode in ("latent", "expanded"):
        model = load_model(path, dtype="float32")
        if mode == "expanded":
            use_expanded_cache(model)
        eng = Engine(model, Tokenizer.from_dir(path), engine_cfg)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs = {o.request_id: o.outputs[0] for o in eng.run_to_completion(["r0", "r1"])}
        runs[mode] = (eng, [outs[f"r{i}"] for i in range(len(prompts))])
    (lat_eng, lat), (exp_eng, exp) = runs["latent"], runs["expanded"]
    assert [o.token_ids for o in exp] == [o.token_ids for o in lat], name
    for a, b in zip(lat, exp):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top)) < 1e-5, name
    H, L = exp_eng.model.config.num_attention_heads, 3
    width = max(spec["qk_nope_head_dim"] + spec["qk_rope_head_dim"], spec["v_head_dim"])
    per_token = 2 * L * H * width * 4  # fp32 K and V of every head
    assert exp_eng.model.config.kv_bytes_per_token(4) == per_token
    blocks = 2_000_000 // (8 * per_token)
    assert (
        exp_eng.kv_cache.k[0].shape == (H, blocks + 1, 8, width) and exp_eng.kv_cache.v[0] is not exp_eng.kv_cache.k[0]
    )
    lat_per_token = L * (spec["kv_lora_rank"] + spec["qk_rope_head_dim"]) * 4
    assert lat_eng.kv_cache.k[0].shape == (1, 2_000_000 // (8 * lat_per_token) + 1, 8, lat_per_token // (4 * L))
