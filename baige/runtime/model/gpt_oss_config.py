"""The config.json fields of OpenAI's gpt-oss (HF ``model_type: gpt_oss``), read with transformers'
meanings (``models/gpt_oss/configuration_gpt_oss.py`` and ``modeling_gpt_oss.py``, transformers 5.24).
Torch-free, like the rest of the config parsing.

What the fields mean:

- every layer is a Mixture-of-Experts layer: ``num_local_experts`` experts of width
  ``intermediate_size``, ``num_experts_per_tok`` of them per token;
- the router ``mlp.router`` is a linear with a bias; the experts are the ``top_k`` largest logits and
  their weights the softmax over those ``top_k`` logits, which equals the softmax over all logits
  restricted to the chosen experts and renormalized (``kernels.moe_topk`` with ``renormalize``);
- the experts carry biases and apply the clamped SwiGLU variant ``(clamp(up, -limit, limit) + 1) *
  g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)`` (``swiglu_alpha``, default 1.702;
  ``swiglu_limit``, default 7.0);
- attention: q/k/v/o projections with biases (``attention_bias``, default true), a learned per-head
  sink logit ``self_attn.sinks`` (n_heads,), ``layer_types`` of ``sliding_attention`` /
  ``full_attention`` with ``sliding_window``, YaRN RoPE (``rope_parameters``; transformers' default
  when absent, :data:`DEFAULT_ROPE`).

A field that changes the computation in a way baige does not implement raises one BaigeError naming it.
"""

from __future__ import annotations

import math
from typing import Any

from baige.errors import BaigeError
from baige.runtime.model.config_checks import bad, check_int

MODEL_TYPE = "gpt_oss"
# transformers' GptOssConfig.__post_init__ default when config.json has no rope_parameters
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def _number(cfg: dict[str, Any], name: str, default: float) -> float:
    """``cfg[name]`` (default when absent or null), a finite number; else BaigeError naming it."""
    value = cfg.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, "a finite number", value)
    return float(value)


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope settings as ModelConfig reads them: the file's, else transformers' gpt-oss default (YaRN,
    factor 32 over 4096 positions, theta 150000, untruncated correction range)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rope:
        return rope
    return {**DEFAULT_ROPE, "rope_theta": cfg.get("rope_theta") or DEFAULT_ROPE["rope_theta"]}


def layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """``layer_types`` checked (one of :data:`LAYER_TYPES` per layer), or transformers' default when
    absent: sliding for even layer indices, full for odd ones. Raises BaigeError naming the field."""
    value = cfg.get("layer_types")
    if value is None:
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers))
    if not isinstance(value, list) or len(value) != n_layers or not all(v in LAYER_TYPES for v in value):
        raise bad("layer_types", f"a list of {n_layers} entries from {LAYER_TYPES}", value)
    return tuple(value)


def sliding_window(cfg: dict[str, Any], types: tuple[str, ...]) -> int | None:
    """The window of the sliding layers (transformers' default 128), None when no layer slides.
    Raises BaigeError naming ``sliding_window`` when a sliding layer has no positive window."""
    if "sliding_attention" not in types:
        return None
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        raise BaigeError("gpt_oss: layer_types has sliding_attention layers but sliding_window is null")
    return check_int(cfg, "sliding_window") or 128


def moe_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The :class:`~baige.runtime.model.config.MoEConfig` keyword arguments of a gpt_oss config.json.

    Raises:
        BaigeError: naming ``num_local_experts`` / ``num_experts_per_tok`` / ``intermediate_size``
        (missing or not positive integers), ``swiglu_alpha`` / ``swiglu_limit`` (not finite numbers,
        limit not > 0) or ``hidden_act`` other than silu (the expert activation is fixed by the family).
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", "'silu' (gpt_oss experts apply their clamped SwiGLU)", cfg.get("hidden_act"))
    experts = check_int(cfg, "num_local_experts") or check_int(cfg, "num_experts") or 128
    top_k = check_int(cfg, "num_experts_per_tok") or 4
    if top_k > experts:
        raise BaigeError(f"{top_k} experts per token (num_experts_per_tok) but only {experts} experts")
    limit = _number(cfg, "swiglu_limit", 7.0)
    if limit <= 0:
        raise bad("swiglu_limit", "> 0", limit)
    return dict(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=cfg["intermediate_size"],
        sparse_layers=tuple(range(n_layers)),
        renormalize=True,
        router_aux_loss_coef=_number(cfg, "router_aux_loss_coef", 0.0),
        router_bias=True,
        expert_bias=True,
        swiglu_alpha=_number(cfg, "swiglu_alpha", 1.702),
        swiglu_limit=limit,
    )


def check_unsupported(cfg: dict[str, Any]) -> None:
    """Refuse the gpt_oss fields whose declared values baige does not implement, naming the field:
    ``attention_dropout`` other than 0 is a training-time option transformers applies and baige does
    not; ``rope_parameters.partial_rotary_factor`` other than 1 rotates part of each head only."""
    if _number(cfg, "attention_dropout", 0.0) != 0.0:
        raise BaigeError(f"gpt_oss: attention_dropout={cfg['attention_dropout']} is not supported (0 only)")
    rope = rope_parameters(cfg)
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise BaigeError("gpt_oss: rope_parameters.partial_rotary_factor other than 1 is not supported")


def model_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The attention-side :class:`~baige.runtime.model.config.ModelConfig` keyword arguments of a
    gpt_oss config.json (``{}`` for other model types): ``layer_types``, ``sliding_window``,
    ``attention_sinks`` and ``o_proj_bias`` (``attention_bias`` covers all four projections).

    Raises:
        BaigeError: a bad ``layer_types`` or ``sliding_window`` (named).
    """
    if cfg.get("model_type") != MODEL_TYPE:
        return {}
    types = layer_types(cfg, n_layers)
    return dict(
        layer_types=types,
        sliding_window=sliding_window(cfg, types),
        attention_sinks=True,
        o_proj_bias=bool(cfg.get("attention_bias", True)),
    )
