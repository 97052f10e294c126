"""The Gemma 2 and Gemma 3 (text) fields of ``config.json``, read with transformers' meanings and defaults
(``Gemma2Config``, ``Gemma3TextConfig``, transformers 5): :class:`GemmaConfig` and the
:class:`~baige.runtime.model.config.ModelConfig` fields these families set. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from baige.errors import BaigeError
from baige.runtime.model.config_checks import bad, check_int, check_positive_float

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' defaults where a file leaves a field out (Gemma2Config / Gemma3TextConfig)
_DEFAULTS = {
    "gemma2": dict(
        head_dim=256,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        head_dim=256,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    ),
}
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclass(frozen=True)
class GemmaConfig:
    """What a Gemma decoder adds to the Llama family's (transformers' field names).

    Attributes:
        query_pre_attn_scalar: the softmax scale is ``query_pre_attn_scalar ** -0.5`` (not head_dim's).
        attn_logit_softcapping: attention scores become ``c * tanh(scores / c)`` (Gemma 2; transformers
            does not apply Gemma 3's, so neither does baige); None: no cap.
        final_logit_softcapping: the same cap on the output logits; None: no cap.
        local_rope_theta, local_rope_scaling: the sliding layers' own RoPE base and scaling (Gemma 3's
            ``rope_local_base_freq`` / ``rope_parameters["sliding_attention"]``); None: every layer uses
            the model's ``rope_theta`` / ``rope_scaling`` (Gemma 2).
    """

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None


def _cap(cfg: dict[str, Any], name: str, model_type: str) -> float | None:
    value = cfg[name] if name in cfg else _DEFAULTS[model_type][name]
    check_positive_float({name: value}, name)
    return None if value is None else float(value)


def _layer_types(cfg: dict[str, Any], model_type: str, n_layers: int) -> tuple[str, ...]:
    """``layer_types`` as written, else transformers' pattern: Gemma 2 alternates sliding (even layers)
    and full; Gemma 3 makes every ``sliding_window_pattern``-th layer (default 6) full."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
            raise bad("layer_types", f"a list of {n_layers} of {', '.join(map(repr, LAYER_TYPES))}", types)
        return tuple(types)
    pattern = 2 if model_type == "gemma2" else check_int(cfg, "sliding_window_pattern") or 6
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers))


def _rope(params: dict[str, Any], where: str, theta: float, rope_types: tuple[str, ...]):
    """One kind's ``(rope_theta, rope_scaling)`` from its rope parameters (the config's normal form:
    ``rope_scaling`` has ``rope_type``, None for the default type)."""
    if not isinstance(params, dict):
        raise bad(where, "an object", params)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in rope_types:
        raise BaigeError(f"unsupported rope type {kind!r} in {where} (supported: {', '.join(rope_types)})")
    theta = params.get("rope_theta", theta)
    check_positive_float({f"{where}.rope_theta": theta}, f"{where}.rope_theta")
    if kind == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    return float(theta), scaling


def _gemma3_rope(cfg: dict[str, Any], rope_types: tuple[str, ...]) -> tuple[tuple, tuple]:
    """((global theta, scaling), (local theta, scaling)): transformers 5's ``rope_parameters`` keyed by
    layer type, or the older top-level ``rope_theta`` / ``rope_scaling`` (global) and
    ``rope_local_base_freq`` (local, default RoPE)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:
        full = dict(params or cfg.get("rope_scaling") or {})
        local = {}
    full_theta = cfg.get("rope_theta") or _GEMMA3_THETA["full_attention"]
    local_theta = cfg.get("rope_local_base_freq") or _GEMMA3_THETA["sliding_attention"]
    return (
        _rope(full, "rope_parameters.full_attention", full_theta, rope_types),
        _rope(local, "rope_parameters.sliding_attention", local_theta, rope_types),
    )


def gemma_fields(cfg: dict[str, Any], rope_types: tuple[str, ...]) -> dict[str, Any]:
    """The :class:`~baige.runtime.model.config.ModelConfig` fields of a Gemma 2 / Gemma 3 (text)
    config.json that differ from the Llama family's reading (transformers' defaults where absent).

    Raises:
        BaigeError: one line naming a field baige does not implement (``attention_bias``,
        ``use_bidirectional_attention``, an activation other than ``gelu_pytorch_tanh``) or a bad value.
    """
    model_type = cfg["model_type"]
    if cfg.get("attention_bias"):
        raise BaigeError(f"{model_type} with attention_bias=true (biases on q/k/v/o) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise BaigeError(f"{model_type} with use_bidirectional_attention=true (non-causal) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise bad("hidden_activation", "'gelu_pytorch_tanh' (the GeGLU of Gemma)", act)
    d = _DEFAULTS[model_type]
    n_layers = cfg["num_hidden_layers"]
    types = _layer_types(cfg, model_type, n_layers)
    window = cfg.get("sliding_window", 4096)
    if "sliding_attention" in types:
        window = check_int({"sliding_window": window}, "sliding_window")
        if window is None:
            raise bad("sliding_window", "an integer >= 1 (the model has sliding layers)", None)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    check_positive_float({"query_pre_attn_scalar": scalar}, "query_pre_attn_scalar")
    head_dim = int(cfg.get("head_dim") or d["head_dim"])
    if head_dim % 2:
        raise BaigeError(f"head_dim={head_dim} is odd (rotary embeddings rotate pairs of dimensions)")
    fields: dict[str, Any] = dict(
        head_dim=head_dim,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or d["num_key_value_heads"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or d["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=False,
        qk_norm=model_type == "gemma3_text",
        layer_types=types,
        sliding_window=window if "sliding_attention" in types else None,
    )
    local_theta = local_scaling = None
    if model_type == "gemma3_text":
        (fields["rope_theta"], fields["rope_scaling"]), (local_theta, local_scaling) = _gemma3_rope(cfg, rope_types)
    attn_cap = _cap(cfg, "attn_logit_softcapping", model_type) if model_type == "gemma2" else None
    fields["gemma"] = GemmaConfig(
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=_cap(cfg, "final_logit_softcapping", model_type),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )
    heads = cfg["num_attention_heads"]
    if heads % fields["num_key_value_heads"]:
        raise BaigeError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={fields['num_key_value_heads']}"
        )
    return fields


def softmax_scale(gemma: GemmaConfig) -> float:
    """``query_pre_attn_scalar ** -0.5`` (Gemma 2 and 3; transformers' ``Gemma2Attention.scaling``)."""
    return 1.0 / math.sqrt(gemma.query_pre_attn_scalar)
