"""DeepSeek-V2 / V3's architecture fields in ``config.json``: Multi-head Latent Attention
(:class:`MLAConfig`) and group-limited routing (:class:`GroupedRouting`), read with transformers'
meanings (``models/deepseek_v3`` and ``models/deepseek_v2``). Torch-free, below ``config.py``,
which calls :func:`deepseek_overrides` for these model types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from baige.errors import BaigeError

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, section 2.1).

    Attributes:
        q_lora_rank: width of the query's low-rank bottleneck (``q_a_proj`` -> ``q_a_layernorm`` ->
            ``q_b_proj``), or None for a plain ``q_proj``.
        kv_lora_rank: width of the compressed KV latent ``c_kv`` (what the cache holds per token).
        qk_nope_head_dim, qk_rope_head_dim: per-head query/key widths without and with RoPE (the rope
            key is shared by all heads).
        v_head_dim: per-head value width.
        scale: the softmax scale, ``qk_head_dim ** -0.5`` times ``yarn_get_mscale(factor,
            mscale_all_dim) ** 2`` under a scaled RoPE (transformers' ``yarn_apply_mscale``).
        rope_interleave: RoPE rotates pairs ``(2i, 2i + 1)`` of the rope dims (V2 always; V3's
            ``rope_interleave``), else halves ``(i, i + D/2)``.
        expanded_cache: False (what ``config.json`` gives): the cache holds the latent, decode is
            absorbed. True (set by :func:`baige.runtime.model.mla.use_expanded_cache`, never read from
            a file): the cache holds every head's K and V (``expanded_width`` values each), the
            MHA-sized cache a comparison runs against.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    rope_interleave: bool
    expanded_cache: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expanded_width(self) -> int:
        """Values per head of K (and of V) in the expanded cache: ``max(qk_head_dim, v_head_dim)``
        (the paged kernels take one head width for K and V, so the narrower is zero-padded)."""
        return max(self.qk_head_dim, self.v_head_dim)

    def attn_params(self, hidden: int, n_heads: int, bias: bool) -> int:
        """Parameters of one MLA block (projections, the two latent norms, biases when ``bias``)."""
        r = self.q_lora_rank
        q = hidden * n_heads * self.qk_head_dim if r is None else hidden * r + r + r * n_heads * self.qk_head_dim
        kv = (
            hidden * self.latent_dim
            + self.kv_lora_rank
            + self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        o = n_heads * self.v_head_dim * hidden
        biases = (r or 0) + self.latent_dim + hidden if bias else 0
        return q + kv + o + biases


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router (:func:`baige.kernels.grouped_topk`): ``scoring_func`` sigmoid (V3) or
    softmax (V2), ``n_group`` expert groups of which ``topk_group`` are kept per token, the final
    weights times ``routed_scaling_factor``."""

    scoring_func: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float


def _int(cfg: dict[str, Any], name: str, default: int | None = None, minimum: int = 1) -> int:
    value = cfg.get(name)
    if value is None:
        if default is None:
            raise BaigeError(f"missing required field {name!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BaigeError(f"field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(cfg: dict[str, Any], name: str, default: float) -> float:
    value = cfg.get(name, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BaigeError(f"field {name!r} must be a finite number > 0, got {value!r}")
    return float(value)


def _require(cfg: dict[str, Any], name: str, allowed: tuple, model_type: str) -> None:
    """A field transformers reads one way only (or ignores) must hold that value when present."""
    if cfg.get(name) is not None and cfg[name] not in allowed:
        raise BaigeError(f"{model_type}: field {name!r}={cfg[name]!r} is not supported (supported: {allowed})")


def _softmax_scale(cfg: dict[str, Any], qk_head_dim: int, rope: dict[str, Any]) -> float:
    """transformers' ``yarn_apply_mscale``: under a non-default RoPE with ``mscale_all_dim``, the
    scale is multiplied by ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` (1 when factor <= 1)."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def _mla(cfg: dict[str, Any], model_type: str) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    rope_dim = _int(cfg, "qk_rope_head_dim")
    if rope_dim % 2:
        raise BaigeError(f"field 'qk_rope_head_dim' must be even (RoPE rotates pairs), got {rope_dim}")
    nope = _int(cfg, "qk_nope_head_dim", minimum=0)
    interleave = True if model_type == "deepseek_v2" else cfg.get("rope_interleave", True) is not False
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    return MLAConfig(
        None if q_lora is None else _int(cfg, "q_lora_rank"),
        _int(cfg, "kv_lora_rank"),
        nope,
        rope_dim,
        _int(cfg, "v_head_dim"),
        _softmax_scale(cfg, nope + rope_dim, rope),
        interleave,
    )


def _routing(cfg: dict[str, Any], model_type: str, experts: int, top_k: int) -> GroupedRouting:
    if model_type == "deepseek_v3":
        _require(cfg, "scoring_func", ("sigmoid",), model_type)
        _require(cfg, "topk_method", ("noaux_tc",), model_type)
        scoring, n_group, topk_group = "sigmoid", _int(cfg, "n_group", 1), _int(cfg, "topk_group", 1)
    else:
        _require(cfg, "scoring_func", ("softmax",), model_type)
        _require(cfg, "topk_method", ("greedy", "group_limited_greedy"), model_type)
        grouped = cfg.get("topk_method") == "group_limited_greedy"
        scoring = "softmax"
        n_group, topk_group = (_int(cfg, "n_group"), _int(cfg, "topk_group")) if grouped else (1, 1)
    if experts % n_group:
        raise BaigeError(f"field 'n_group'={n_group} does not divide n_routed_experts={experts}")
    if topk_group > n_group:
        raise BaigeError(f"field 'topk_group'={topk_group} is more than n_group={n_group}")
    size = experts // n_group
    if model_type == "deepseek_v3" and n_group > 1 and size < 2:
        raise BaigeError(f"deepseek_v3: groups of {size} expert (n_group={n_group}); a group's score needs two")
    if top_k > topk_group * size:
        raise BaigeError(
            f"field 'num_experts_per_tok'={top_k} is more than the {topk_group * size} experts "
            f"of topk_group={topk_group} groups"
        )
    return GroupedRouting(scoring, n_group, topk_group, _float(cfg, "routed_scaling_factor", 1.0))


def deepseek_overrides(cfg: dict[str, Any], model_type: str, n_layers: int, moe_cls: type) -> dict[str, Any]:
    """The :class:`~baige.runtime.model.config.ModelConfig` fields a DeepSeek config sets beyond the
    Llama ones: ``mla``, ``moe`` (a ``moe_cls`` over layers ``first_k_dense_replace ..``, router in
    fp32, shared experts of ``n_shared_experts * moe_intermediate_size``, V3's selection bias and
    ``norm_topk_prob``; V2 never renormalizes, as transformers' V2 router), ``head_dim`` (the rope
    dims: what RoPE's frequencies are computed over) and one KV "head" (the shared latent).

    Raises:
        BaigeError: a field baige does not implement or a bad value, named.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise BaigeError(f"{model_type}: field 'hidden_act'={cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise BaigeError(f"{model_type}: field 'mlp_bias'=true is not supported")
    _require(cfg, "moe_layer_freq", (1,), model_type)
    if cfg.get("num_key_value_heads") not in (None, cfg["num_attention_heads"]):
        raise BaigeError(
            f"{model_type}: field 'num_key_value_heads' must equal num_attention_heads "
            "(MLA expands the latent to every head)"
        )
    mla = _mla(cfg, model_type)
    experts, top_k = _int(cfg, "n_routed_experts"), _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise BaigeError(f"field 'num_experts_per_tok'={top_k} is more than n_routed_experts={experts}")
    inter = _int(cfg, "moe_intermediate_size")
    first_dense = _int(cfg, "first_k_dense_replace", 3 if model_type == "deepseek_v3" else 0, minimum=0)
    moe = moe_cls(
        experts,
        top_k,
        inter,
        tuple(range(first_dense, n_layers)),
        renormalize=model_type == "deepseek_v3" and cfg.get("norm_topk_prob", True) is not False,
        shared_intermediate_size=inter * _int(cfg, "n_shared_experts", 1, minimum=0),
        correction_bias=model_type == "deepseek_v3",
        norm_min=1e-20,
        router_fp32=True,
        routing=_routing(cfg, model_type, experts, top_k),
    )
    return dict(mla=mla, moe=moe, head_dim=mla.qk_rope_head_dim, num_key_value_heads=1, rope_interleaved=False)
