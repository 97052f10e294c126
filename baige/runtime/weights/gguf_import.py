"""Import a GGUF file (llama.cpp's format) into an HF-layout directory.

Tensors are dequantized to fp32 by the ``gguf`` library, renamed to HF parameter names, and the
q/k projections of the ``llama`` architecture are un-permuted: llama.cpp's converter interleaves
the two rotary halves of each head (``convert_hf_to_gguf.py``, ``LlamaModel.permute``), while HF
keeps the rotate-half layout. Config fields come from the GGUF metadata (keys as in the GGUF
spec, ``ggml/docs/gguf.md``); the tokenizer from ``gguf_tokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from baige.errors import BaigeError
from baige.runtime.weights.safetensors_io import atomic_dir

# GGUF tensor name (inside blk.N.) -> HF name (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF general.architecture -> HF model_type
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if stem.startswith("blk."):
        _, idx, part = stem.split(".", 2)
        if part not in _LAYER_NAMES:
            raise BaigeError(f"GGUF tensor {gguf_name!r} has no HF equivalent in baige")
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{kind}"
    if stem not in _TOP_NAMES:
        raise BaigeError(f"GGUF tensor {gguf_name!r} has no HF equivalent in baige")
    return f"{_TOP_NAMES[stem]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # (n_head * D, in) with the rotary pairs interleaved -> rotate-half layout.
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> dict:
    """HF ``config.json`` contents from GGUF metadata. Raises BaigeError for other architectures."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise BaigeError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")

    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    cfg = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "model_type": _ARCHS[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(a("attention.head_count_kv", n_heads)),
        "head_dim": int(a("attention.key_length") or a("rope.dimension_count") or hidden // n_heads),
        "max_position_embeddings": int(a("context_length", 2048)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    scaling = a("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(a("rope.scaling.factor"))}
        if scaling == "yarn":
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise BaigeError(f"unsupported GGUF rope scaling type {scaling!r}")
    return cfg


def gguf_state_dict(reader, cfg: dict) -> dict[str, torch.Tensor]:
    """Dequantized fp32 tensors under HF names, q/k un-permuted for ``llama``.

    Returns: name -> fp32 tensor with HF's (out_features, in_features) layout.
    """
    from gguf import quants

    unpermute = cfg["model_type"] == "llama"
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost first
        name = _hf_name(t.name)
        if unpermute and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif unpermute and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
    return out


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF-layout directory (config, generation config, fp32 safetensors, tokenizer) for a GGUF.

    The directory is written under a temporary name and renamed when complete, so a crash never
    leaves a half-written import behind.

    Raises:
        BaigeError: unreadable file, unsupported architecture, tensor or tokenizer.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from baige.runtime.weights.gguf_tokenizer import build_tokenizer_files

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as e:
        raise BaigeError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    cfg = gguf_config(reader)
    state = gguf_state_dict(reader, cfg)
    tok_json, tok_cfg = build_tokenizer_files(reader)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}

    with atomic_dir(out_dir, "model directory") as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    return out_dir
