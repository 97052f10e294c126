"""The ``{arch}.*`` hyper-parameter keys of a GGUF written by :mod:`baige.runtime.weights.gguf_export`.

Keys and their meanings are those llama.cpp's loader reads (``src/llama-model.cpp``, ``load_hparams``;
names from the ``gguf`` package's ``Keys``), set as llama.cpp's ``convert_hf_to_gguf.py`` sets them for
each family (``TextModel.set_gguf_parameters`` and the family classes named in ``gguf_export``).

Where llama.cpp's graph for an architecture fixes something the HF config may vary -- gpt-oss's SwiGLU
clamp (alpha 1.702, limit 7.0), YaRN's correction range (always rounded to whole dims: transformers'
``truncate: true``), DeepSeek's YaRN magnitude (``llama-context.cpp`` takes ``mscale == mscale_all_dim``),
Gemma 3's softmax scale (``head_dim ** -0.5``) and final soft-cap (none in its sliding-window graph) -- a
config that differs raises BaigeError naming the field, so a written file never runs a different model
than the checkpoint (``bench compare``'s conversion, which times the same shapes, lists them instead).
"""

from __future__ import annotations

import math

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig

# HF model_type -> llama.cpp general.architecture
ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "ernie4_5": "ernie4_5",
    "gemma3_text": "gemma3",
    "deepseek_v3": "deepseek2",
    "gpt_oss": "gpt-oss",
}
OSS_SWIGLU = (1.702, 7.0)  # llama.cpp's gpt-oss clamped SwiGLU: alpha, limit (fixed in its graph)


def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture name for ``cfg``'s family. Raises BaigeError for a family baige does not map."""
    arch = ARCHS.get(cfg.model_type)
    if arch is None:
        raise BaigeError(
            f"model_type {cfg.model_type!r}: baige writes GGUF for {', '.join(sorted(ARCHS))} "
            "(the families whose llama.cpp architecture baige maps)"
        )
    return arch


def _refuse(field: str, value, why: str) -> None:
    """A field the GGUF cannot hold at all."""
    raise BaigeError(f"config field {field} = {value!r}: {why}")


def _differs(notes: list[str] | None, field: str, value, why: str) -> None:
    """A field llama.cpp's graph fixes otherwise: BaigeError, or (``notes`` a list: a benchmark's
    conversion, where the timing is that of the same shapes) one line appended to ``notes``."""
    line = f"config field {field} = {value!r}: {why}"
    if notes is None:
        raise BaigeError(f"{line}; llama.cpp would not run the checkpoint's model")
    notes.append(line)


def _add_rope_scaling(writer, rs: dict | None, arch: str, notes: list[str] | None) -> None:
    """``rope.scaling.*`` for linear and YaRN scaling (llama.cpp's ``LLAMA_ROPE_SCALING_TYPE_*``)."""
    import gguf

    kind = None if rs is None else rs.get("rope_type", "default")
    if kind in (None, "default") or (kind == "llama3" and arch == "llama"):  # llama3: the rope_freqs tensor
        return
    factor = float(rs.get("factor", 1.0))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
        return
    if kind != "yarn":
        _refuse("rope_scaling.rope_type", kind, "baige maps default, linear, yarn (and llama3 for llama) RoPE to GGUF")
    if rs.get("attention_factor") is not None:
        _differs(notes, "rope_scaling.attention_factor", rs["attention_factor"], "llama.cpp derives it from the factor")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(factor)
    orig = rs.get("original_max_position_embeddings")
    if orig is None:
        _refuse("rope_scaling.original_max_position_embeddings", None, "YaRN needs it")
    writer.add_rope_scaling_orig_ctx_len(int(orig))
    if float(rs.get("beta_fast", 32.0)) != 32.0:
        writer.add_rope_scaling_yarn_beta_fast(float(rs["beta_fast"]))
    if float(rs.get("beta_slow", 1.0)) != 1.0:
        writer.add_rope_scaling_yarn_beta_slow(float(rs["beta_slow"]))
    if not rs.get("truncate", True):
        _differs(notes, "rope_scaling.truncate", False, "llama.cpp always rounds YaRN's correction range to whole dims")
    m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if arch == "deepseek2":
        if not (m and m_all and float(m) == float(m_all)):  # llama-context.cpp: [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]
            _differs(notes, "rope_scaling.mscale", m, f"llama.cpp's deepseek2 takes mscale == mscale_all_dim ({m_all})")
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(m_all or 0.0))
    elif m or m_all:
        _differs(notes, "rope_scaling.mscale", m, f"llama.cpp's {arch} takes no YaRN mscale")


def _add_common(writer, cfg: ModelConfig) -> None:
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.mla is None:  # MLA's head sizes: _add_deepseek2
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)


def _add_gemma3(writer, cfg: ModelConfig, notes: list[str] | None) -> None:
    """Gemma 3: llama.cpp reads the layer kinds and the sliding layers' RoPE base, and fixes the softmax
    scale at ``head_dim ** -0.5`` (``hidden / heads`` for its 62-layer 27B), with no final soft-cap."""
    g = cfg.gemma
    if g.final_logit_softcapping is not None:
        _differs(notes, "final_logit_softcapping", g.final_logit_softcapping, "llama.cpp's gemma3 has no final cap")
    if (g.local_rope_scaling or {}).get("rope_type", "default") != "default":
        _differs(notes, "rope_parameters.sliding_attention", g.local_rope_scaling, "llama.cpp scales no sliding layer")
    fixed = cfg.hidden_size / cfg.num_attention_heads if cfg.num_hidden_layers == 62 else cfg.head_dim
    if not math.isclose(g.query_pre_attn_scalar, fixed):
        _differs(notes, "query_pre_attn_scalar", g.query_pre_attn_scalar, f"llama.cpp's gemma3 fixes it at {fixed:g}")
    writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    writer.add_rope_freq_base_swa(float(g.local_rope_theta if g.local_rope_theta is not None else cfg.rope_theta))


def _add_deepseek2(writer, cfg: ModelConfig) -> None:
    import gguf

    m, moe = cfg.mla, cfg.moe
    if cfg.attention_bias:
        _refuse("attention_bias", True, "llama.cpp's deepseek2 has no attention biases")
    writer.add_q_lora_rank(m.q_lora_rank or 0)  # 0: a plain q_proj (llama.cpp reads the key always)
    writer.add_kv_lora_rank(m.kv_lora_rank)
    writer.add_key_length(m.kv_lora_rank + m.qk_rope_head_dim)  # MLA runs as MQA over the latent
    writer.add_value_length(m.kv_lora_rank)
    writer.add_key_length_mla(m.qk_head_dim)
    writer.add_value_length_mla(m.v_head_dim)
    writer.add_rope_dimension_count(m.qk_rope_head_dim)
    if moe is None:
        writer.add_leading_dense_block_count(cfg.num_hidden_layers)
        return
    first = min(moe.sparse_layers)
    if tuple(moe.sparse_layers) != tuple(range(first, cfg.num_hidden_layers)):
        _refuse("moe_layer_freq", cfg.raw.get("moe_layer_freq"), "llama.cpp's deepseek2 wants dense layers then MoE")
    writer.add_leading_dense_block_count(first)
    writer.add_expert_feed_forward_length(moe.intermediate_size)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    writer.add_expert_shared_count(int(cfg.raw.get("n_shared_experts") or 0))
    writer.add_expert_weights_norm(bool(moe.renormalize))
    r = moe.routing
    writer.add_expert_weights_scale(float(r.routed_scaling_factor) if r else 1.0)
    sigmoid = r is not None and r.scoring_func == "sigmoid"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if r is not None and r.n_group > 1 and r.topk_group < r.n_group:
        writer.add_expert_group_count(r.n_group)
        writer.add_expert_group_used_count(r.topk_group)


def _add_gpt_oss(writer, cfg: ModelConfig, notes: list[str] | None) -> None:
    moe = cfg.moe
    if (moe.swiglu_alpha, moe.swiglu_limit) != OSS_SWIGLU:
        _differs(notes, "swiglu_limit", moe.swiglu_limit, f"llama.cpp's gpt-oss fixes (alpha, limit) at {OSS_SWIGLU}")
    writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    writer.add_expert_feed_forward_length(moe.intermediate_size)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)


def add_hparams(writer, cfg: ModelConfig, arch: str, notes: list[str] | None = None) -> None:
    """Add ``cfg`` as ``arch``'s hyper-parameter keys to ``writer`` (a ``gguf.GGUFWriter``).

    ``notes``: None (``baige convert``) makes a field llama.cpp would compute differently an error; a
    list (``bench compare``'s conversion) collects one line per such field instead.

    Raises:
        BaigeError: a config field the GGUF cannot hold, or (``notes`` None) one llama.cpp's ``arch``
        graph computes differently (named).
    """
    _add_common(writer, cfg)
    _add_rope_scaling(writer, cfg.rope_scaling, arch, notes)
    if arch in ("llama", "qwen2", "ernie4_5"):
        if cfg.sliding_window is not None and cfg.layer_types is not None:
            _differs(notes, "sliding_window", cfg.sliding_window, f"llama.cpp's {arch} has no sliding window")
        if cfg.moe is not None:
            _refuse("model_type", cfg.model_type, "an MoE config under a dense architecture")
    elif arch == "gemma3":
        _add_gemma3(writer, cfg, notes)
    elif arch == "deepseek2":
        _add_deepseek2(writer, cfg)
    elif arch == "gpt-oss":
        _add_gpt_oss(writer, cfg, notes)


def differing_fields(cfg: ModelConfig) -> list[str]:
    """One line per field of ``cfg`` that llama.cpp's graph computes differently (what :func:`add_hparams`
    collects as ``notes``), found without writing anything. Raises BaigeError as :func:`add_hparams` does for
    a field the GGUF cannot hold, or a family baige does not map."""
    import gguf

    arch = gguf_arch(cfg)
    notes: list[str] = []
    add_hparams(gguf.GGUFWriter(None, arch), cfg, arch, notes)
    return notes
