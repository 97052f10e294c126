"""Write an HF checkpoint as a GGUF file that llama.cpp loads (``baige convert SRC OUT.gguf``).

The checkpoint goes through baige's strict load (:func:`~baige.runtime.weights.loader.load_model`: the
config checked, every tensor present with its shape, MXFP4 experts dequantized, routed experts stacked),
and the model's tensors are written under llama.cpp's names for the architecture, in F32, F16 or BF16
(1-D tensors -- norms, biases, sinks -- always F32, as llama.cpp's converter writes them).

Architectures (``model_type`` -> ``general.architecture``) and the layout conventions of llama.cpp's
``convert_hf_to_gguf.py`` (ggml-org/llama.cpp; classes ``LlamaModel``, ``Qwen2Model``, ``Ernie4_5Model``,
``Gemma3Model``, ``DeepseekV2Model``, ``GptOssModel``) and of its model loader (``src/llama-model.cpp``):

- ``llama`` / ``mistral`` -> ``llama``: q/k rows permuted from HF's rotate-half RoPE layout to the pairwise
  one llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` rotates (``LlamaModel.permute``).
- ``qwen2`` -> ``qwen2`` (NEOX RoPE: no permutation; q/k/v biases).
- ``ernie4_5`` -> ``ernie4_5``: HF's ERNIE already rotates pairs, llama.cpp's ``ernie4_5`` too.
- ``gemma3_text`` -> ``gemma3``: every RMSNorm weight stored as ``1 + w`` (llama.cpp multiplies by the
  weight; Gemma's HF norm by ``1 + w``); the pre/post norms under ``post_attention_norm`` / ``ffn_norm`` /
  ``post_ffw_norm``; the sliding layers' pattern and RoPE base as ``attention.sliding_window_pattern`` and
  ``rope.freq_base_swa``.
- ``deepseek_v3`` -> ``deepseek2`` (MLA): ``kv_b_proj`` (H * (nope + v), kv_lora) split per head into
  ``attn_k_b`` (H, kv_lora, nope) -- transposed, for the absorbed query -- and ``attn_v_b`` (H, v, kv_lora);
  the MLA head sizes as ``key_length = kv_lora + rope``, ``value_length = kv_lora`` and the ``*_mla`` keys;
  ``e_score_correction_bias`` as ``exp_probs_b``; YaRN's ``mscale_all_dim`` as ``yarn_log_multiplier =
  0.1 * mscale_all_dim``. A half-split RoPE (``rope_interleave: false``) has its rope rows permuted as
  Llama's are.
- ``gpt_oss`` -> ``gpt-oss``: sinks as ``attn_sinks``, the router with its bias as ``ffn_gate_inp``,
  experts stacked ``ffn_{gate,up,down}_exps`` (E, out, in) with their biases, ``post_attention_layernorm``
  as ``post_attention_norm``; MXFP4 experts are written dequantized.

Shapes: a tensor baige holds as (out, in) is written with GGUF dims (in, out) -- GGUF lists the innermost
dimension first -- exactly the bytes of the row-major torch tensor.

A family llama.cpp lacks, or a config field whose meaning llama.cpp's graph for the architecture cannot
express, raises :class:`~baige.errors.BaigeError` naming it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.weights.gguf_export_hparams import add_hparams, gguf_arch

# baige parameter name inside ``model.layers.{i}.`` -> llama.cpp tensor name inside ``blk.{i}.``
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.bias": "ffn_gate_inp.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}
_LAYER_BY_ARCH = {
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
GGUF_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _to_pairs(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows (n_head * D, ...) of a rotate-half RoPE layout (dims i and i + D/2 rotate together) into the
    pairwise one (dims 2i and 2i + 1): llama.cpp's ``LlamaModel.permute``; the inverse of the GGUF
    importer's ``_unpermute``."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """Llama 3's RoPE scaling as llama.cpp takes it: ``rope_freqs`` (head_dim / 2,) fp32, the divisor of each
    frequency (1 for wavelengths under ``original / high_freq_factor``, ``factor`` over ``original /
    low_freq_factor``, a smooth blend between). Formula: transformers' ``_compute_llama3_parameters``,
    written as ``LlamaModel.generate_extra_tensors`` writes it."""
    rs, d = cfg.rope_scaling, cfg.head_dim
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    orig = float(rs["original_max_position_embeddings"])
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    wavelen = 2 * math.pi / freqs
    smooth = ((orig / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blend = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = torch.where(wavelen < orig / high, 1.0, torch.where(wavelen > orig / low, factor, blend))
    return out.to(torch.float32)


def _mla_tensors(cfg: ModelConfig, i: int, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``kv_b_proj`` (H * (nope + v), kv_lora) -> ``attn_k_b`` (H, kv_lora, nope) and ``attn_v_b``
    (H, v, kv_lora) (``DeepseekV2Model.modify_tensors``)."""
    m = cfg.mla
    kv_b = w.reshape(cfg.num_attention_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    k_b, v_b = kv_b.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
    yield f"blk.{i}.attn_k_b.weight", k_b.transpose(1, 2)
    yield f"blk.{i}.attn_v_b.weight", v_b


def _rope_rows_to_pairs(w: torch.Tensor, n_head: int, width: int, rope: int) -> torch.Tensor:
    """Within each of ``n_head`` row groups of ``width`` rows, the last ``rope`` rows (the RoPE part of
    an MLA head) permuted from rotate-half to pairs; the rest unchanged."""
    g = w.reshape(n_head, width, *w.shape[1:]).clone()
    for h in range(n_head):
        g[h, width - rope :] = _to_pairs(g[h, width - rope :], 1)
    return g.reshape(w.shape)


def _layer_tensor(cfg: ModelConfig, arch: str, i: int, key: str, w: torch.Tensor):
    """The llama.cpp tensors of baige's ``model.layers.{i}.{key}``. Raises BaigeError when it has none."""
    if key == "self_attn.kv_b_proj.weight" and cfg.mla is not None:
        yield from _mla_tensors(cfg, i, w)
        return
    if key in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):  # (E, 2I, ...): gate rows, up rows
        gate, up = w.chunk(2, dim=1)
        kind = "weight" if key.endswith("proj") else "bias"
        yield f"blk.{i}.ffn_gate_exps.{kind}", gate
        yield f"blk.{i}.ffn_up_exps.{kind}", up
        return
    name = _LAYER_BY_ARCH.get(arch, {}).get(key, _LAYER.get(key))
    if name is None:
        raise BaigeError(f"tensor model.layers.{i}.{key} has no llama.cpp {arch!r} equivalent baige writes")
    if arch == "llama" and key == "self_attn.q_proj.weight":
        w = _to_pairs(w, cfg.num_attention_heads)
    elif arch == "llama" and key == "self_attn.k_proj.weight":
        w = _to_pairs(w, cfg.num_key_value_heads)
    elif cfg.mla is not None and not cfg.mla.rope_interleave:
        m = cfg.mla
        if key in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
            w = _rope_rows_to_pairs(w, cfg.num_attention_heads, m.qk_head_dim, m.qk_rope_head_dim)
        elif key == "self_attn.kv_a_proj_with_mqa.weight":
            w = _rope_rows_to_pairs(w, 1, m.latent_dim, m.qk_rope_head_dim)
    if arch == "gemma3" and key.endswith("norm.weight"):
        w = w + 1.0  # Gemma's RMSNorm scales by (1 + w) (Gemma3Model.modify_tensors: norm_shift)
    yield f"blk.{i}.{name}", w


def gguf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """baige's state dict (fp32, HF names, experts stacked) under llama.cpp's names and layouts, in
    llama.cpp's order (embeddings, the blocks, the final norm and head). ``lm_head`` is left out of a
    tied model, except for gpt-oss, whose llama.cpp loader requires ``output.weight`` (no fallback to
    ``token_embd``): there the embedding is written again as the head. Raises BaigeError for a tensor with no
    llama.cpp name (naming it)."""
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    per_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, w in state.items():
        if name.startswith("model.layers."):
            i, key = name.removeprefix("model.layers.").split(".", 1)
            per_layer.setdefault(int(i), []).append((key, w))
        elif name not in (*_TOP, "lm_head.weight"):
            raise BaigeError(f"tensor {name} has no llama.cpp {arch!r} equivalent baige writes")
    for i in sorted(per_layer):
        for key, w in per_layer[i]:
            yield from _layer_tensor(cfg, arch, i, key, w)
    norm = state["model.norm.weight"]
    yield "output_norm.weight", norm + 1.0 if arch == "gemma3" else norm
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(cfg)
    if not cfg.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]
    elif arch == "gpt-oss":
        yield "output.weight", state["model.embed_tokens.weight"]


def check_names(names: list[str], arch: str) -> None:
    """Every name is one the ``gguf`` package's tables list for ``arch`` (``MODEL_TENSORS`` /
    ``TENSOR_NAMES``, with ``.weight`` or ``.bias``). Raises BaigeError naming the first that is not."""
    import gguf

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch_id]}
    for name in names:
        base, _, kind = name.rpartition(".")
        parts = base.split(".")
        pattern = "blk.{bid}." + ".".join(parts[2:]) if parts[0] == "blk" else base
        if pattern not in known or kind not in ("weight", "bias"):
            raise BaigeError(f"tensor {name} is not one the gguf package lists for architecture {arch!r}")


def _array(w: torch.Tensor, qtype) -> np.ndarray:
    """``w`` as the numpy array GGUFWriter takes for ``qtype`` (F32 / F16 / BF16 bits as uint16)."""
    import gguf

    a = w.detach().to(torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F16:
        return a.astype(np.float16)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return gguf.quants.quantize(a, qtype)
    return a


def _qtype(name: str, w: torch.Tensor, dtype: str):
    import gguf

    if w.dim() <= 1 or name.endswith("_norm.weight") or name.endswith("exp_probs_b.bias"):
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType[GGUF_DTYPES[dtype]]


def write_gguf(
    model_dir: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    out: Path,
    dtype: str,
    notes: list[str] | None = None,
) -> Path:
    """Write ``out`` (a new GGUF file) from ``state`` and ``cfg``, the tokenizer from ``model_dir``.

    Written to a temporary name beside ``out`` and renamed when complete; nothing is left under either
    name on failure. ``dtype``: float32, float16 or bfloat16 (the 2-D and 3-D weights'). ``notes``: see
    :func:`~baige.runtime.weights.gguf_export_hparams.add_hparams`. Raises BaigeError for a family,
    field, tensor or tokenizer llama.cpp's format cannot take (naming it)."""
    import gguf

    arch = gguf_arch(cfg)
    tensors = list(gguf_tensors(state, cfg, arch))
    check_names([n for n, _ in tensors], arch)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _write(writer, model_dir, cfg, arch, tensors, dtype, notes)
        os.replace(tmp, out)
    except OSError as e:
        raise BaigeError(f"OUT {out}: cannot write it ({e.strerror or e})") from None
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def _write(writer, model_dir: Path, cfg: ModelConfig, arch: str, tensors, dtype: str, notes) -> None:
    """Metadata, tokenizer and tensors into ``writer``'s file, then closed."""
    import gguf

    from baige.runtime.weights.gguf_export_vocab import add_vocab

    writer.add_name(str(cfg.raw.get("_name_or_path") or model_dir.name))
    ftype = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16}
    writer.add_file_type(ftype.get(dtype, gguf.LlamaFileType.MOSTLY_BF16))
    add_hparams(writer, cfg, arch, notes)
    add_vocab(writer, model_dir, cfg.vocab_size)
    for name, w in tensors:
        qtype = _qtype(name, w, dtype)
        writer.add_tensor(name, _array(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(src_dir: Path, out: Path, dtype: str = "auto", notes: list[str] | None = None) -> Path:
    """Load the HF checkpoint ``src_dir`` with baige (strictly, fp32) and write it as the GGUF ``out``.

    ``dtype``: auto (the checkpoint's own ``torch_dtype``), float32, float16 or bfloat16. ``notes``: None
    (fields llama.cpp computes differently are errors) or a list collecting them (``bench compare``).
    Raises BaigeError: an ``out`` that exists, an unknown family, an unmappable field, tensor or tokenizer."""
    import gguf

    from baige.runtime.model.device import checkpoint_dtype
    from baige.runtime.weights.gguf_export_vocab import add_vocab
    from baige.runtime.weights.loader import load_model

    out = Path(out)
    if out.exists():
        raise BaigeError(f"OUT {out}: already exists; choose a new file name")
    cfg = ModelConfig.from_file(Path(src_dir) / "config.json")
    if dtype in (None, "auto"):
        dtype = str(checkpoint_dtype(cfg)).removeprefix("torch.")
    if dtype not in GGUF_DTYPES:
        raise BaigeError(f"--dtype {dtype}: a GGUF is written as float32, float16 or bfloat16")
    arch = gguf_arch(cfg)  # an unknown family, an unmappable field or tokenizer fail before the (slow) load
    add_hparams(gguf.GGUFWriter(None, arch), cfg, arch, None if notes is None else [])
    add_vocab(gguf.GGUFWriter(None, arch), Path(src_dir), cfg.vocab_size)
    model = load_model(src_dir, "float32")
    with torch.no_grad():
        state = {k: v.float() for k, v in model.state_dict().items()}
    return write_gguf(Path(src_dir), model.config, state, out, dtype, notes)
