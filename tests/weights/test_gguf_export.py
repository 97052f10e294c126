"""``baige convert SRC OUT.gguf``: tiny random HF checkpoints (written by transformers) of every family the
GGUF writer maps, written as GGUF and checked three ways:

- against the ``gguf`` package's own tables: every tensor name one ``MODEL_TENSORS`` lists for the
  architecture, the hyper-parameter keys llama.cpp's loader requires, shapes as llama.cpp creates them;
- tensor values against the checkpoint on disk, each layout rewritten here by hand from the HF layout
  (per-expert DeepSeek tensors, gpt-oss's interleaved gate/up, Llama's rotary permutation -- the last also
  round-tripped through baige's GGUF importer, which un-permutes independently);
- logits of llama.cpp (llama-cpp-python, skipped where it is not installed: CI) against transformers.

Parity tolerance: 1e-4 on logits of magnitude ~3 (the issue's fp32 bound). The GGUF is F32, llama.cpp's KV
cache F32 (``type_k = type_v = 0``) and one thread, so only the summation order differs from torch: fp32
rounding, orders of magnitude below the bound. Gemma 3 gets 5e-3: llama.cpp's CPU GEGLU looks GELU up in a
65536-entry fp16 table (ggml-cpu ``vec.h``, ``GGML_GELU_FP16``: the input and the output rounded to fp16,
relative 2^-11 each), an error fp32 rounding does not explain and the 1e-4 bound does not hold.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mla_tiny import make_mla_checkpoint
from tiny import make_checkpoint, write_bpe_tokenizer, write_spm_tokenizer, write_tiny_tokenizer

from baige.errors import BaigeError
from baige.runtime.weights.convert import convert_checkpoint

V = 264  # the BPE tokenizer's 259 tokens and 5 padding ids
YARN_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
OSS = dict(
    model_type="gpt_oss",
    hidden_size=72,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=18,
    num_local_experts=5,
    num_experts_per_tok=2,
    sliding_window=5,
    swiglu_limit=7.0,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=8.0, truncate=True, original_max_position_embeddings=64
    ),
)


def _gpt_oss(path, mxfp4: bool = False):
    """A tiny gpt_oss checkpoint, four distinct sinks per layer; ``mxfp4``: hidden 96 and experts 64 wide
    (whole 32-element blocks), the experts stored as published (random E2M1 codes, scales 2 ** -6 .. 2 ** -3,
    ``quantization_config.quant_method: mxfp4``)."""
    from safetensors.torch import load_file, save_file

    shape = dict(hidden_size=96, intermediate_size=64, head_dim=24) if mxfp4 else {}
    make_checkpoint(path, "llama", vocab_size=V, **{**OSS, **shape})
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for i in range(OSS["num_hidden_layers"]):
        state[f"model.layers.{i}.self_attn.sinks"] = torch.tensor([-2.0, 0.0, 1.5, 4.0]) + 0.5 * i
        for name, rows, k in (("gate_up_proj", 128, 96), ("down_proj", 96, 64)) if mxfp4 else ():
            p = f"model.layers.{i}.mlp.experts."
            del state[p + name]
            state[f"{p}{name}_blocks"] = torch.randint(0, 256, (5, rows, k // 32, 16), generator=g, dtype=torch.uint8)
            state[f"{p}{name}_scales"] = torch.randint(121, 125, (5, rows, k // 32), generator=g, dtype=torch.uint8)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if mxfp4:
        cfg = json.loads((path / "config.json").read_text())
        keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": keep}
        (path / "config.json").write_text(json.dumps(cfg))


# family -> (writer of the checkpoint, llama.cpp architecture, logits tolerance)
FAMILIES = {
    "llama": (lambda p: make_checkpoint(p, "llama", vocab_size=V), "llama", 1e-4),
    # Llama 3's RoPE scaling: the per-frequency divisors as the rope_freqs tensor
    "llama3-rope": (lambda p: make_checkpoint(p, "llama-llama3-rope", vocab_size=V), "llama", 1e-4),
    "mistral-head-dim": (lambda p: make_checkpoint(p, "mistral-head-dim", vocab_size=V), "llama", 1e-4),
    "qwen2": (lambda p: make_checkpoint(p, "qwen2-bias", vocab_size=V), "qwen2", 1e-4),
    "ernie4.5": (lambda p: make_checkpoint(p, "ernie4.5", vocab_size=V), "ernie4_5", 1e-4),
    # both layer kinds, each its RoPE (local base 100, full layers linear x2), a 12-token window
    "gemma3": (
        lambda p: make_checkpoint(p, "gemma3", vocab_size=V, query_pre_attn_scalar=16, final_logit_softcapping=None),
        "gemma3",
        5e-3,
    ),
    # q LoRA, interleaved RoPE, YaRN (mscale = mscale_all_dim), sigmoid group-limited routing, dense first
    "deepseek-v3": (
        lambda p: make_mla_checkpoint(
            p, "deepseek-v3", vocab_size=V, rope_parameters={**YARN_V3, "mscale": 1.0, "mscale_all_dim": 1.0}
        ),
        "deepseek2",
        1e-4,
    ),
    # no q LoRA, half-split RoPE (its rope rows permuted), v wider than qk, two dense layers
    "deepseek-v3-no-q-lora": (
        lambda p: make_mla_checkpoint(p, "deepseek-v3-no-q-lora", vocab_size=V, attention_bias=False),
        "deepseek2",
        1e-4,
    ),
    "gpt-oss": (_gpt_oss, "gpt-oss", 1e-4),
    # tied embeddings: llama.cpp's gpt-oss loader requires output.weight, so the embedding is written again
    "gpt-oss-tied": (
        lambda p: make_checkpoint(p, "llama", vocab_size=V, **OSS, tie_word_embeddings=True),
        "gpt-oss",
        1e-4,
    ),
    # MXFP4 experts, written dequantized (llama.cpp against transformers' own dequantized load)
    "gpt-oss-mxfp4": (lambda p: _gpt_oss(p, mxfp4=True), "gpt-oss", 1e-4),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (checkpoint dir, F32 GGUF path), written once."""
    out = {}
    for name, (write, _, _) in FAMILIES.items():
        d = tmp_path_factory.mktemp(name.replace(".", "_")) / "ckpt"
        write(d)
        write_bpe_tokenizer(d)
        out[name] = (d, convert_checkpoint(str(d), d.parent / "m.gguf", "float32"))
    return out


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _tensors(path) -> dict[str, np.ndarray]:
    """GGUF tensors as float32 arrays in torch's (outer-first) shape."""
    from gguf import quants

    out = {}
    for t in _reader(path).tensors:
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = w.reshape([int(x) for x in reversed(t.shape)])
    return out


REQUIRED = [
    "context_length",
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
]
FAMILY_KEYS = {
    "gemma3": ["attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"],
    "deepseek2": [
        "attention.q_lora_rank",
        "attention.kv_lora_rank",
        "attention.key_length_mla",
        "attention.value_length_mla",
        "leading_dense_block_count",
        "expert_count",
        "expert_used_count",
        "expert_shared_count",
        "expert_gating_func",
        "expert_weights_scale",
    ],
    "gpt-oss": ["attention.sliding_window", "expert_count", "expert_used_count", "expert_feed_forward_length"],
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_names_keys_and_shapes_follow_the_gguf_tables(exported, family):
    import gguf

    arch = FAMILIES[family][1]
    reader = _reader(exported[family][1])
    assert reader.fields["general.architecture"].contents() == arch
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    cfg = json.loads((exported[family][0] / "config.json").read_text())
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i) + suffix
        for t in gguf.MODEL_TENSORS[arch_id]
        for i in range(cfg["num_hidden_layers"])
        for suffix in (".weight", ".bias")
    }
    names = [t.name for t in reader.tensors]
    assert set(names) <= allowed, sorted(set(names) - allowed)
    for key in REQUIRED + FAMILY_KEYS.get(arch, []):
        assert f"{arch}.{key}" in reader.fields, key
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert key in reader.fields, key
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == V
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 258
    assert reader.fields["tokenizer.ggml.merges"].contents() == ["Ġ t", "h e"]
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}  # GGUF order: innermost first
    h = cfg["hidden_size"]
    assert shapes["token_embd.weight"] == [h, V]
    if arch == "deepseek2":  # llama.cpp's create_tensor shapes for MLA
        heads, r, nope, v = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        assert shapes["blk.0.attn_k_b.weight"] == [nope, r, heads]
        assert shapes["blk.0.attn_v_b.weight"] == [r, v, heads]
        assert shapes["blk.0.attn_kv_a_mqa.weight"] == [h, r + cfg["qk_rope_head_dim"]]
        assert "blk.0.attn_kv_b.weight" not in shapes
        last = cfg["num_hidden_layers"] - 1
        assert shapes[f"blk.{last}.ffn_gate_exps.weight"] == [h, cfg["moe_intermediate_size"], cfg["n_routed_experts"]]
        assert f"blk.{last}.exp_probs_b.bias" in shapes
    if arch == "gpt-oss":
        e, inter = OSS["num_local_experts"], cfg["intermediate_size"]
        assert shapes["blk.0.ffn_up_exps.weight"] == [h, inter, e] and shapes["blk.0.ffn_up_exps.bias"] == [inter, e]
        assert shapes["blk.0.ffn_down_exps.weight"] == [inter, h, e] and shapes["blk.0.attn_sinks.weight"] == [4]
    if arch == "gemma3":
        pattern = reader.fields["gemma3.attention.sliding_window_pattern"].contents()
        assert pattern == [True, False, True, False]
        assert reader.fields["gemma3.rope.freq_base_swa"].contents() == 100.0


def _hf(ckpt):
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def test_values_llama_permuted_and_round_tripped_by_the_importer(exported, tmp_path):
    from baige.runtime.weights.gguf_import import import_gguf

    ckpt, path = exported["llama"]
    hf, got = _hf(ckpt), _tensors(path)
    q = hf["model.layers.1.self_attn.q_proj.weight"].numpy()  # 4 heads of 16 rows, rotate-half
    for h in range(4):
        for i in range(8):  # pair (i, i + 8) of head h lands on rows 2i, 2i + 1
            assert np.array_equal(got["blk.1.attn_q.weight"][16 * h + 2 * i], q[16 * h + i])
            assert np.array_equal(got["blk.1.attn_q.weight"][16 * h + 2 * i + 1], q[16 * h + 8 + i])
    back = _hf(import_gguf(path, tmp_path / "imported"))
    assert back.keys() == hf.keys()
    for name, w in hf.items():
        assert torch.equal(back[name], w), name


def test_values_gemma3_norms_plus_one(exported):
    ckpt, path = exported["gemma3"]
    hf, got = _hf(ckpt), _tensors(path)
    pairs = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }
    for theirs, ours in pairs.items():
        assert np.array_equal(got[f"blk.2.{ours}.weight"], hf[f"model.layers.2.{theirs}.weight"].numpy() + 1.0)
    assert np.array_equal(got["output_norm.weight"], hf["model.norm.weight"].numpy() + 1.0)
    assert np.array_equal(got["blk.2.attn_q.weight"], hf["model.layers.2.self_attn.q_proj.weight"].numpy())
    assert "output.weight" not in got  # tied


def test_values_deepseek_mla_split_and_experts(exported):
    ckpt, path = exported["deepseek-v3"]
    hf, got = _hf(ckpt), _tensors(path)
    kv_b = hf["model.layers.1.self_attn.kv_b_proj.weight"].numpy()  # (3 heads x (10 nope + 12 v), 20)
    for h in range(3):
        rows = kv_b[22 * h : 22 * (h + 1)]
        assert np.array_equal(got["blk.1.attn_k_b.weight"][h], rows[:10].T)
        assert np.array_equal(got["blk.1.attn_v_b.weight"][h], rows[10:])
    for j in range(8):
        for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            assert np.array_equal(got[f"blk.2.{name}.weight"][j], hf[f"model.layers.2.mlp.experts.{j}.{proj}.weight"])
    bias = hf["model.layers.2.mlp.gate.e_score_correction_bias"].numpy()
    assert np.array_equal(got["blk.2.exp_probs_b.bias"], bias)
    assert np.array_equal(got["blk.2.ffn_up_shexp.weight"], hf["model.layers.2.mlp.shared_experts.up_proj.weight"])


def test_values_deepseek_half_split_rope_rows_interleaved(exported):
    ckpt, path = exported["deepseek-v3-no-q-lora"]
    hf, got = _hf(ckpt), _tensors(path)
    q = hf["model.layers.0.self_attn.q_proj.weight"].numpy()  # 3 heads x (6 nope + 4 rope)
    for h in range(3):
        base = 10 * h
        assert np.array_equal(got["blk.0.attn_q.weight"][base : base + 6], q[base : base + 6])
        assert np.array_equal(
            got["blk.0.attn_q.weight"][base + 6 : base + 10], q[[base + 6, base + 8, base + 7, base + 9]]
        )
    kv_a = hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].numpy()  # 18 latent + 4 rope
    assert np.array_equal(got["blk.0.attn_kv_a_mqa.weight"], kv_a[[*range(18), 18, 20, 19, 21]])


def test_values_gpt_oss_experts_deinterleaved_and_transposed(exported):
    ckpt, path = exported["gpt-oss"]
    hf, got = _hf(ckpt), _tensors(path)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"].numpy()  # (E, H, 2I): gate even, up odd columns
    gate_up_b = hf["model.layers.1.mlp.experts.gate_up_proj_bias"].numpy()
    down = hf["model.layers.1.mlp.experts.down_proj"].numpy()  # (E, I, H)
    assert np.array_equal(got["blk.1.ffn_gate_exps.weight"], gate_up[:, :, ::2].transpose(0, 2, 1))
    assert np.array_equal(got["blk.1.ffn_up_exps.weight"], gate_up[:, :, 1::2].transpose(0, 2, 1))
    assert np.array_equal(got["blk.1.ffn_gate_exps.bias"], gate_up_b[:, ::2])
    assert np.array_equal(got["blk.1.ffn_up_exps.bias"], gate_up_b[:, 1::2])
    assert np.array_equal(got["blk.1.ffn_down_exps.weight"], down.transpose(0, 2, 1))
    assert np.array_equal(got["blk.1.attn_sinks.weight"], [-1.5, 0.5, 2.0, 4.5])
    assert np.array_equal(got["blk.1.ffn_gate_inp.bias"], hf["model.layers.1.mlp.router.bias"].numpy())
    norm = hf["model.layers.1.post_attention_layernorm.weight"].numpy()
    assert np.array_equal(got["blk.1.post_attention_norm.weight"], norm)


def test_values_gpt_oss_mxfp4_experts_dequantized_as_transformers_does(exported):
    from transformers import AutoModelForCausalLM

    ckpt, path = exported["gpt-oss-mxfp4"]
    got = _tensors(path)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # CPU: transformers dequantizes on load
    experts = hf.model.layers[2].mlp.experts
    gate_up, down = experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy()  # (E, H, 2I), (E, I, H)
    assert np.array_equal(got["blk.2.ffn_gate_exps.weight"], gate_up[:, :, ::2].transpose(0, 2, 1))
    assert np.array_equal(got["blk.2.ffn_up_exps.weight"], gate_up[:, :, 1::2].transpose(0, 2, 1))
    assert np.array_equal(got["blk.2.ffn_down_exps.weight"], down.transpose(0, 2, 1))
    assert {t.tensor_type.name for t in _reader(path).tensors if "_exps" in t.name} == {"F32"}


@pytest.mark.parametrize(
    "dtype,qtype,torch_dtype", [("float16", "F16", torch.float16), ("bfloat16", "BF16", torch.bfloat16)]
)
def test_half_dtypes_round_the_weights_and_keep_norms_f32(exported, tmp_path, dtype, qtype, torch_dtype):
    ckpt, path = exported["ernie4.5"]
    half = convert_checkpoint(str(ckpt), tmp_path / "new" / "h.gguf", dtype)  # its directory made
    kinds = {t.name: t.tensor_type.name for t in _reader(half).tensors}
    assert kinds["blk.0.attn_q.weight"] == qtype and kinds["token_embd.weight"] == qtype
    assert kinds["blk.0.attn_norm.weight"] == "F32" and kinds["output_norm.weight"] == "F32"
    got, full = _tensors(half), _tensors(path)
    want = torch.from_numpy(full["blk.2.ffn_down.weight"]).to(torch_dtype).float().numpy()
    assert np.array_equal(got["blk.2.ffn_down.weight"], want)
    assert np.array_equal(got["blk.2.attn_norm.weight"], full["blk.2.attn_norm.weight"])


def test_refusals_are_one_line_and_leave_no_file(cli_error, exported, tmp_path):
    ckpt = exported["ernie4.5"][0]
    assert "already exists; choose a new file name" in cli_error("convert", ckpt, exported["ernie4.5"][1])
    moe = make_checkpoint(tmp_path / "moe", "qwen3-moe", vocab_size=V)
    write_bpe_tokenizer(moe)
    err = cli_error("convert", moe, tmp_path / "moe.gguf")
    assert err.startswith("error: model_type 'qwen3_moe': baige writes GGUF for deepseek_v3, ernie4_5, gemma3_text")
    gemma = make_checkpoint(tmp_path / "gemma", "gemma3", vocab_size=V)  # query_pre_attn_scalar 20, a final cap
    write_bpe_tokenizer(gemma)
    err = cli_error("convert", gemma, tmp_path / "gemma.gguf")
    assert "config field final_logit_softcapping = 2.0: llama.cpp's gemma3 has no final cap" in err
    words = make_checkpoint(tmp_path / "words", "llama")
    write_tiny_tokenizer(words)
    err = cli_error("convert", words, tmp_path / "words.gguf")
    assert "tokenizer.json: a WordLevel tokenizer (decoder WordPiece) has no GGUF equivalent" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma", "moe", "words"]  # no OUT, no temporary


def test_fields_llama_cpp_computes_differently_are_collected_when_asked(tmp_path):
    from baige.runtime.weights.gguf_export import export_gguf

    gemma = make_checkpoint(tmp_path / "gemma", "gemma3", vocab_size=V)
    write_bpe_tokenizer(gemma)
    with pytest.raises(BaigeError, match="final_logit_softcapping"):
        export_gguf(gemma, tmp_path / "strict.gguf")
    notes: list[str] = []
    export_gguf(gemma, tmp_path / "bench.gguf", "float32", notes)
    assert notes == [
        "config field final_logit_softcapping = 2.0: llama.cpp's gemma3 has no final cap",
        "config field query_pre_attn_scalar = 20.0: llama.cpp's gemma3 fixes it at 16",
    ]
    assert (tmp_path / "bench.gguf").is_file() and not (tmp_path / "strict.gguf").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_logits_equal_transformers(exported, family):
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    ckpt, path = exported[family]
    ids = [int(x) for x in np.random.RandomState(1).randint(0, 259, 40)]  # longer than the 5/12-token windows
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    llm = Llama(
        model_path=str(path),
        n_ctx=64,
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32 caches
        type_v=0,
        flash_attn=False,
        verbose=False,
    )
    try:
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    assert np.abs(got - want).max() <= FAMILIES[family][2]


def test_llama_cpp_tokenizes_text_as_the_hf_tokenizer(embedded_dir, tmp_path):
    """SmolLM2's byte-level BPE (49152 tokens, digits split off first: ``tokenizer.ggml.pre`` smollm) on a
    one-layer checkpoint: llama.cpp's tokenization of mixed text equals the HF tokenizer's."""
    import shutil

    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama
    from tokenizers import Tokenizer

    shape = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    ckpt = make_checkpoint(tmp_path / "smol", "llama", vocab_size=49152, num_key_value_heads=1, **shape)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, ckpt / name)
    path = convert_checkpoint(str(ckpt), tmp_path / "smol.gguf", "float32")
    assert _reader(path).fields["tokenizer.ggml.pre"].contents() == "smollm"
    text = "Hello world!  It's 2026: 12345 tokens, naïve café\n\tdone <|im_end|>"
    want = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == want
        assert llm.token_eos() == _reader(path).fields["tokenizer.ggml.eos_token_id"].contents()
    finally:
        llm.close()


@pytest.mark.parametrize("space_prefix", [True, False])
def test_llama_cpp_tokenizes_sentencepiece_style_bpe_as_the_hf_tokenizer(tmp_path, space_prefix):
    """A byte-fallback BPE (Llama 2 / ERNIE 4.5 / Gemma style) written as ``tokenizer.ggml.model llama``: pieces,
    merges by score, bytes for characters outside the vocabulary, the space prefix or not."""
    from tokenizers import Tokenizer

    ckpt = make_checkpoint(tmp_path / "spm", "ernie4.5", vocab_size=290)
    write_spm_tokenizer(ckpt, space_prefix)
    path = convert_checkpoint(str(ckpt), tmp_path / "spm.gguf", "float32")
    fields = _reader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is space_prefix
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[:4] == [2, 3, 3, 6] and types[258] == 6 and types[259] == 1 and types[-1] == 5  # unk, control, byte
    text = "hello the tall ball 7 naïve  hello"
    want = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert 273 in want and 3 + ord("7") in want  # "▁the" (two merges deep) and a byte fallback
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == want
        assert (llm.token_bos(), llm.token_eos()) == (1, 2)
    finally:
        llm.close()


# The pre_tokenizer sections of the published tokenizer.json files, as JSON text (openai/gpt-oss-20b's
# o200k split; deepseek-ai/DeepSeek-V3's three splits, whose "\r\n" are real CR LF once decoded)
_BYTE_LEVEL = '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}'
_O200K_PRE = (
    '{"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": '
    r'"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+'
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    r"[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
    r'|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false}, ' + _BYTE_LEVEL + "]}"
)
_DEEPSEEK_V3_PRE = (
    '{"type": "Sequence", "pretokenizers": ['
    r'{"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false}, '
    '{"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, '
    '"behavior": "Isolated", "invert": false}, '
    r"""{"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"""
    r'|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, '
    '"behavior": "Isolated", "invert": false}, ' + _BYTE_LEVEL + "]}"
)
_SPLIT_TEXTS = [
    "he said 1234567 then 12 and 1 2 3.",
    "x.he!!! abc abcabc  abc\n\n\tabc",
    "你好 世界 ab 你好abc 12你好34 カタカナ ひらがな",
    "It's 2026: naïve café — ok?! (abc) [12] {x} xbCx xe's a/b",
]


@pytest.mark.parametrize("pre, name", [(_O200K_PRE, "gpt-4o"), (_DEEPSEEK_V3_PRE, "deepseek-v3")])
def test_published_split_rules_are_named_and_llama_cpp_tokenizes_as_hf(tmp_path, pre, name):
    """gpt-oss's o200k split and DeepSeek-V3's three splits are written as llama.cpp's ``tokenizer.ggml.pre``
    names for them (``src/llama-vocab.cpp``), and llama.cpp then splits as the HF tokenizer does: its ids
    for text with digit runs, punctuation, CJK and whitespace equal HF's (where llama_cpp is installed)."""
    from tiny import write_split_bpe_tokenizer
    from tokenizers import Tokenizer

    shape = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    ckpt = make_checkpoint(tmp_path / "split", "llama", vocab_size=272, num_key_value_heads=1, **shape)
    write_split_bpe_tokenizer(ckpt, json.loads(pre))
    path = convert_checkpoint(str(ckpt), tmp_path / "split.gguf", "float32")
    pass  # MUT
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    want = [hf.encode(t, add_special_tokens=False).ids for t in _SPLIT_TEXTS]
    write_split_bpe_tokenizer(ckpt, json.loads(_BYTE_LEVEL.replace("false}", "true}")))
    gpt2 = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert want != [gpt2.encode(t, add_special_tokens=False).ids for t in _SPLIT_TEXTS]  # the rule matters
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        assert [llm.tokenize(t.encode(), add_bos=False, special=False) for t in _SPLIT_TEXTS] == want
    finally:
        llm.close()


def test_values_gpt_oss_tied_head_written_as_the_embedding(exported):
    ckpt, path = exported["gpt-oss-tied"]
    got = _tensors(path)
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True
    assert np.array_equal(got["output.weight"], _hf(ckpt)["model.embed_tokens.weight"].numpy())
