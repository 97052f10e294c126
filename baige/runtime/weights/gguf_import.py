"""Import a GGUF file (llama.cpp's format) into an HF-layout directory.

Tensors are dequantized to fp32 by the ``gguf`` library, renamed to HF parameter names, and the
q/k projections of the ``llama`` architecture are un-permuted: llama.cpp's converter interleaves
the two rotary halves of each head (``convert_hf_to_gguf.py``, ``LlamaModel.permute``), while HF
keeps the rotate-half layout. Config fields come from the GGUF metadata (keys as in the GGUF
spec, ``ggml/docs/gguf.md``); the tokenizer from ``gguf_tokenizer``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.transformer import Transformer
from baige.runtime.weights.loader import check_state_dict
from baige.runtime.weights.safetensors_io import atomic_dir
from baige.runtime.weights.validate import check_fits, check_layer_count
from baige.runtime.weights.validate_gguf import GGUFSummary, check_gguf

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


def _int(reader, key: str, default: int | None = None) -> int:
    """Metadata ``key`` as an integer (``default`` when absent). Raises BaigeError naming the key."""
    value = _field(reader, key, default)
    if value is None:
        raise BaigeError(f"metadata {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BaigeError(f"metadata {key!r} must be an integer, got {str(value)[:60]}")
    return value


def _float(reader, key: str, default: float) -> float:
    """Metadata ``key`` as a number (``default`` when absent). Raises BaigeError naming the key."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BaigeError(f"metadata {key!r} must be a number, got {str(value)[:60]}")
    return float(value)


_BLOCK_TENSOR = re.compile(r"blk\.(\d{1,9})\.(\w+)\.(weight|bias)")
_TOP_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str) -> str:
    """HF name of a GGUF tensor (``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight``).
    Raises BaigeError for a name with no HF equivalent."""
    if (m := _BLOCK_TENSOR.fullmatch(gguf_name)) and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if (m := _TOP_TENSOR.fullmatch(gguf_name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise BaigeError(f"GGUF tensor {gguf_name!r} has no HF equivalent in baige")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # (n_head * D, in) with the rotary pairs interleaved -> rotate-half layout.
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> dict:
    """HF ``config.json`` contents from GGUF metadata, checked as config.json is
    (:meth:`ModelConfig.from_dict`). Raises BaigeError for other architectures, a missing or
    mistyped key, or a config that fails those checks (naming the key or field)."""
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in _ARCHS:
        raise BaigeError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")

    def a(key, default=None):
        return _int(reader, f"{arch}.{key}", default)

    n_heads, hidden = a("attention.head_count"), a("embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    cfg = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "model_type": _ARCHS[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": a("attention.head_count_kv", n_heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length")
        or _field(reader, f"{arch}.rope.dimension_count")
        or (hidden // n_heads if n_heads > 0 else None),
        "max_position_embeddings": a("context_length", 2048),
        "rms_norm_eps": _float(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _float(reader, f"{arch}.rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": _float(reader, f"{arch}.rope.scaling.factor", 1.0)}
        if scaling == "yarn":
            cfg["rope_scaling"]["original_max_position_embeddings"] = a("rope.scaling.original_context_length")
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
        try:
            w = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise BaigeError(f"tensor {t.name!r}: baige cannot dequantize its type {t.tensor_type.name}") from None
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost first
        name = _hf_name(t.name)
        if unpermute and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif unpermute and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
    return out


def _check_tensors(summary: GGUFSummary, cfg: dict) -> None:
    """Every tensor the GGUF declares has an HF name, the layers are those of the config, and the
    names and shapes are exactly the model's (checked on the meta device: nothing allocated)."""
    mc = ModelConfig.from_dict(cfg)
    shapes = {_hf_name(t.name): tuple(reversed(t.shape)) for t in summary.tensors}  # GGUF: innermost first
    if len(shapes) != len(summary.tensors):
        raise BaigeError("two of its tensors map to one HF tensor (a layer index written twice, as 1 and 01)")
    check_layer_count(list(shapes), mc, "the file")
    with torch.device("meta"):
        model = Transformer(mc)
    state = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    check_state_dict(state, model, "the file")


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF-layout directory (config, generation config, fp32 safetensors, tokenizer) for a GGUF.

    The file's structure is checked first (:func:`~baige.runtime.weights.validate_gguf.check_gguf`),
    then its metadata as a config and its tensors' names and shapes against that config, then the
    fp32 bytes of the dequantized tensors against the memory free, all before a tensor is read. The
    directory is written under a temporary name and renamed when complete, so a crash never leaves a
    half-written import behind.

    Raises:
        BaigeError: naming ``gguf_path``: a malformed file, unsupported architecture, tensor type,
        tensor or tokenizer, a model larger than the memory free.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from baige.runtime.weights.gguf_tokenizer import build_tokenizer_files

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    summary = check_gguf(gguf_path)
    check_fits(4 * sum(t.numel for t in summary.tensors), [torch.device("cpu")], f"{gguf_path}: its float32 import")
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as e:  # gguf raises ValueError, KeyError, IndexError, ...; the file passed check_gguf
        raise BaigeError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:120]})") from None
    try:
        cfg = gguf_config(reader)
        _check_tensors(summary, cfg)
        tok_json, tok_cfg = build_tokenizer_files(reader)
        state = gguf_state_dict(reader, cfg)
    except BaigeError as e:
        raise BaigeError(f"{gguf_path}: {e}") from None
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}

    with atomic_dir(out_dir, "model directory") as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    return out_dir
