"""Tiny random HF checkpoints written with transformers: the parity oracle for the decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama-llama3-rope": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama-linear-rope": dict(
        model_type="llama", rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
    ),
    "llama-yarn-rope": dict(
        model_type="llama",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    ),
    "mistral-head-dim": dict(model_type="mistral", head_dim=24, sliding_window=None),
    "qwen2-bias": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),
}

# ERNIE-4.5 dense and the Gemmas: hidden not a power of two (tests/model/test_model_families.py)
GEMMA = dict(
    hidden_size=56, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=88, sliding_window=12
)
FAMILY_VARIANTS = {
    # the 0.3B layout: interleaved RoPE, embeddings tied by default
    "ernie4.5": dict(model_type="ernie4_5", hidden_size=72, head_dim=18, num_hidden_layers=3),
    # a 12-token window (prompts are longer), both layer kinds, each kind its own RoPE (the full layers'
    # with linear scaling), a softmax scale from query_pre_attn_scalar, final logits soft-capped hard
    "gemma3": dict(
        model_type="gemma3_text",
        **GEMMA,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=20,
        final_logit_softcapping=2.0,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1_000_000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=100.0),
        },
    ),
    # the default alternation (sliding, full, sliding), attention scores and logits soft-capped hard, untied
    "gemma2": dict(
        model_type="gemma2",
        **GEMMA,
        num_hidden_layers=3,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
}
VARIANTS.update(FAMILY_VARIANTS)

# Mixture-of-Experts: hidden 72 (not a power of two), dense and sparse layers mixed, shared
# experts where the family has them, an odd number of experts
MOE = dict(hidden_size=72, num_attention_heads=4, num_key_value_heads=2, head_dim=18, num_hidden_layers=3)
MOE_VARIANTS = {
    "qwen3-moe": dict(
        model_type="qwen3_moe",
        **MOE,
        num_experts=7,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "qwen2-moe-shared": dict(
        model_type="qwen2_moe",
        **MOE,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=36,
        shared_expert_intermediate_size=56,
        decoder_sparse_step=2,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        model_type="mixtral",
        **{**MOE, "num_hidden_layers": 2},
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=44,
    ),
    "ernie4.5-moe": dict(
        model_type="ernie4_5_moe",
        **MOE,
        moe_num_experts=6,
        moe_k=3,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        tie_word_embeddings=True,
    ),
}
VARIANTS.update(MOE_VARIANTS)


def write_random_checkpoint(path: Path, spec: dict, seed: int, init: Callable, *, buffers: bool = False) -> Path:
    """Build the model ``spec`` describes (``model_type`` and its config's fields) with transformers in fp32
    after ``torch.manual_seed(seed)``, call ``init(name, tensor, model_type)`` on every parameter (and buffer
    with ``buffers``) under ``torch.no_grad`` to refill it in place, and save it to ``path``; returns ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *(model.named_buffers() if buffers else ())]:
            init(name, p, model_type)
    model.save_pretrained(path)
    return path


def make_checkpoint(path: Path, variant: str, seed: int = 0, *, embed_std: float = 0.1, **overrides) -> Path:
    """Write a random tiny HF checkpoint of ``variant`` with transformers; returns the directory.

    Weights N(0, 0.1), biases N(0, 2), norms scale by U(0.5, 1.5) (Gemma's stored offsets from one U(-0.5,
    0.5)). ``embed_std``: the token embeddings' std (the tied lm_head's too). At 0.1 the residual stream starts
    at RMS 0.1 and the first attention adds RMS ~0.4 (measured on the tiny Mixtral and Llama), so the token's
    embedding is soon a small part of the stream; 1.0 starts the stream at unit RMS, as the embedding scaling of
    the original Transformer and of Gemma (x sqrt(hidden)) does. The quantization-accuracy tests use 1.0."""

    def init(name: str, p: torch.Tensor, model_type: str) -> None:
        if name.endswith("e_score_correction_bias"):
            p.normal_(0.0, 0.05)  # ERNIE's selection bias: changes which experts win, not all of them
        elif name.endswith("bias"):
            p.normal_(0.0, 2.0)  # large q/k/v biases (Qwen2)
        elif "norm" in name:  # non-unit norms (incl. Qwen3 q_norm/k_norm): scales U(0.5, 1.5)
            p.uniform_(-0.5, 0.5) if model_type.startswith("gemma") else p.uniform_(0.5, 1.5)  # Gemma: 1 + w
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, embed_std)
        else:
            p.normal_(0.0, 0.1)

    return write_random_checkpoint(path, {**BASE, **VARIANTS[variant], **overrides}, seed, init)


def make_lora_adapter(
    base: Path, out: Path, rank: int, targets: list[str], seed: int, alpha: float = 16, use_rslora: bool = False
) -> Path:
    """A random PEFT LoRA adapter of ``base`` (B random too, so it changes the outputs), saved with
    peft's ``save_pretrained``; returns ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    pm = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, init_lora_weights=False),
    )
    pm.save_pretrained(out)
    return Path(out)


def merge_lora_adapter(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights by peft's ``merge_and_unload``, saved as an
    HF checkpoint at ``out`` (the oracle of adapter serving)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(hf, adapter).merge_and_unload().save_pretrained(out)
    return Path(out)


def write_tiny_tokenizer(path: Path, vocab_size: int = BASE["vocab_size"]) -> Path:
    """A word-level ``tokenizer.json`` for a tiny checkpoint: token ``i`` is the word ``t{i}``
    (whitespace-split, decoded with spaces), ``t0`` doubling as EOS; written into ``path``."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))
    return Path(path)


def write_bpe_tokenizer(path: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` (GPT-2's byte alphabet as ids 0-255, the merges ``Ġ t`` -> 256
    and ``h e`` -> 257, ``<|endoftext|>`` -> 258 as BOS and EOS) that llama.cpp accepts as a ``gpt2``
    vocabulary; written into ``path`` beside a ``tokenizer_config.json``. Checkpoints using it need a
    ``vocab_size`` of at least 259."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from baige.runtime.weights.gguf_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)} | {"Ġt": 256, "he": 257}
    tok = HFTokenizer(models.BPE(vocab, [("Ġ", "t"), ("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(Path(path) / "tokenizer.json"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(special))
    return Path(path)


SPLIT_MERGES = [
    ("1", "2"),
    ("12", "3"),
    ("123", "4"),
    ("Ġ", "1"),
    ("Ġ", "t"),
    ("h", "e"),
    (".", "he"),
    ("!", "!"),
    ("Ġ", "ä"),
    ("a", "b"),
    ("ab", "c"),
    ("Ġ", "abc"),
    ("b", "C"),
    ("e", "'"),
]


def write_split_bpe_tokenizer(path: Path, pre_tokenizer: dict) -> Path:
    """A byte-level BPE ``tokenizer.json`` with the given ``pre_tokenizer`` (a tokenizer.json dict): GPT-2's
    byte alphabet as ids 0-255, then :data:`SPLIT_MERGES` in rank order, then ``<|endoftext|>`` as BOS and
    EOS; written into ``path`` beside a ``tokenizer_config.json``. The merges cross boundaries one split
    rule draws and another does not: digit runs past three, a space before a digit or before a CJK lead
    byte ``ä`` (0xE4), punctuation before letters, a lower-to-upper case change, a contraction.
    Checkpoints using it need ``vocab_size`` >= 271."""
    import json

    from baige.runtime.weights.gguf_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for a, b in SPLIT_MERGES:
        vocab[a + b] = len(vocab)
    tok = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": len(vocab),
                "content": "<|endoftext|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in SPLIT_MERGES],
        },
    }
    (Path(path) / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(special))
    return Path(path)


def write_spm_tokenizer(path: Path, space_prefix: bool = True) -> Path:
    """A SentencePiece-style BPE ``tokenizer.json`` (``byte_fallback``, ``▁`` for spaces, as Llama 2's,
    ERNIE 4.5's and Gemma's): ``<unk>``, ``<s>``, ``</s>``, the 256 ``<0xNN>`` byte tokens, then a few
    characters and merged pieces numbered in merge order (so SentencePiece's rule -- the highest-scored,
    i.e. earliest, piece merges first -- is HF's merge rank). ``space_prefix``: a ``▁`` is prepended to the
    text (Llama 2; Gemma prepends none). Checkpoints using it need a ``vocab_size`` of at least 278."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "a", "b", "e", "h", "l", "o", "t"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("▁t", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(Path(path) / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(special))
    return Path(path)
