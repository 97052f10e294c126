"""The model architecture read from an HF ``config.json``: :class:`ModelConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from baige.errors import BaigeError
from baige.runtime.model import gpt_oss_config
from baige.runtime.model.config_checks import check_config_fields, read_json
from baige.runtime.model.config_gemma import GEMMA_MODEL_TYPES, GemmaConfig, gemma_fields
from baige.runtime.model.mla_config import MLA_MODEL_TYPES, GroupedRouting, MLAConfig, deepseek_overrides

# HF model_type -> the architecture features our single decoder switches on.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "ernie4_5") + GEMMA_MODEL_TYPES
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "ernie4_5_moe", gpt_oss_config.MODEL_TYPE)
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES + MLA_MODEL_TYPES
ERNIE_MODEL_TYPES = ("ernie4_5", "ernie4_5_moe")  # interleaved RoPE, embeddings tied unless the file says not
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# The projections of a Llama-family block (HF names), the usual LoRA targets. Here, beside the other
# torch-free facts of the architecture, so that option help and config checks need no torch.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class MoEConfig:
    """The sparse MLP of a Mixture-of-Experts model, read from config.json (transformers' meanings).

    Routing (``kernels.moe_topk``): ``probs = softmax(router_logits)`` in fp32; the ``top_k``
    experts by ``probs`` (plus ``e_score_correction_bias`` when ``correction_bias``: ERNIE-4.5's
    selection rule); their ``probs`` as weights, divided by ``max(sum, norm_min)`` when
    ``renormalize`` (Mixtral always; Qwen's ``norm_topk_prob``; ERNIE with ``moe_norm_min``).

    Attributes:
        num_experts, top_k: routed experts and experts per token.
        intermediate_size: each routed expert's SwiGLU width.
        sparse_layers: indices of the layers whose MLP is sparse (the others are dense, with the
            model's ``intermediate_size``).
        shared_intermediate_size: width of the shared expert every token also goes through (0: none).
        shared_gate: the shared expert's output is scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).
        router_fp32: the router's matmul runs in fp32 with fp32 weights (ERNIE-4.5).
        router_aux_loss_coef: weight of the load-balancing loss in training (Switch/GShard form).
        router_bias: the router's linear has a bias (``router.bias``, gpt-oss), added to the logits.
        expert_bias: the experts' projections have biases (``gate_up_proj_bias``, ``down_proj_bias``).
        swiglu_alpha, swiglu_limit: gpt-oss's clamped SwiGLU (None: the plain one); see
            :mod:`baige.runtime.model.gpt_oss_config`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    renormalize: bool
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    correction_bias: bool = False
    norm_min: float = 0.0
    router_fp32: bool = False
    router_aux_loss_coef: float = 0.0
    routing: GroupedRouting | None = None  # DeepSeek's group-limited router (mla_config.py); None: moe_topk
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx in self.sparse_layers


@dataclass
class ModelConfig:
    """The Llama-family architecture, from ``config.json`` only.

    Field names follow HF transformers' config classes.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # normalised: always has "rope_type" when set
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_interleaved: bool = False  # RoPE rotates pairs (2i, 2i+1) instead of (i, i + D/2) (ERNIE-4.5)
    moe: MoEConfig | None = None  # None: every layer dense
    mla: MLAConfig | None = None  # Multi-head Latent Attention (DeepSeek, mla_config.py); None: GQA
    # per layer "full_attention" or "sliding_attention" (HF ``layer_types``); None: every layer full
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # the sliding layers' window in tokens (HF ``sliding_window``)
    attention_sinks: bool = False  # a learned per-head logit in each softmax denominator (gpt-oss)
    o_proj_bias: bool = False  # the output projection carries a bias (gpt-oss)
    # DeepSeek-V3's multi-token-prediction modules (model/mtp.py), ``num_nextn_predict_layers``; 0: none
    mtp_depth: int = 0
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    gemma: GemmaConfig | None = None  # Gemma 2 / 3: norms, embedding scale, soft-caps, two RoPE bases
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json as read

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json.

        Raises:
            BaigeError: unknown ``model_type`` or rope type, a missing required field, or a field
            value the decoder does not implement (named in the message).
        """
        if not isinstance(cfg, dict):
            raise BaigeError(f"not a JSON object but {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise BaigeError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        check_config_fields(cfg)
        hidden, n_heads, vocab_size, intermediate, n_layers = (
            cfg[name]
            for name in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers")
        )
        # transformers >= 5 writes rope settings as `rope_parameters` (with rope_theta inside);
        # older files use top-level `rope_theta` and `rope_scaling` with `rope_type` or legacy `type`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if model_type == gpt_oss_config.MODEL_TYPE:
            gpt_oss_config.check_unsupported(cfg)
            rope = dict(gpt_oss_config.rope_parameters(cfg))
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise BaigeError(f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
            rope_scaling["rope_type"] = rope_type
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        config = cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in ERNIE_MODEL_TYPES)),
            attention_bias=_attention_bias(cfg, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_interleaved=model_type in ERNIE_MODEL_TYPES,
            moe=_moe_config(cfg, model_type, n_layers),
            **gpt_oss_config.model_fields(cfg, n_layers),
            mtp_depth=_int_field(cfg, "num_nextn_predict_layers", default=0, minimum=0),
            torch_dtype=str(dtype),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            raw=dict(cfg),
        )
        if model_type in MLA_MODEL_TYPES:
            config = replace(config, **deepseek_overrides(cfg, model_type, n_layers, MoEConfig))
        if model_type in GEMMA_MODEL_TYPES:  # Gemma 2 / 3 (config_gemma.py)
            config = replace(config, **gemma_fields(cfg, SUPPORTED_ROPE_TYPES))
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (:func:`~baige.runtime.model.config_checks.check_config_fields`).

        Raises:
            BaigeError: naming ``path``: absent, unreadable, not UTF-8 JSON, or a bad field.
        """
        path = Path(path)
        if not path.is_file():
            raise BaigeError(f"{path}: config.json not found")
        raw = read_json(path)
        try:
            return cls.from_dict(raw)
        except BaigeError as e:
            raise BaigeError(f"{path}: {e}", param=e.param) from None

    def num_params(self, non_embedding: bool = False, active: bool = False) -> int:
        """Parameter count (tied embeddings counted once); ``non_embedding`` drops embeddings and
        lm_head; ``active`` counts, in sparse layers, only the ``top_k`` routed experts a token
        uses (plus router and shared expert): the N of ``6 N`` training FLOPs for MoE models."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.mla is not None:
            attn = self.mla.attn_params(h, self.num_attention_heads, self.attention_bias)
        attn += (h if self.o_proj_bias else 0) + (self.num_attention_heads if self.attention_sinks else 0)
        body = h
        for i in range(self.num_hidden_layers):
            body += attn + self._mlp_params(i, active) + (4 if self.gemma else 2) * h  # Gemma: 4 norms
        if non_embedding:
            return body
        emb = self.vocab_size * h
        return body + emb + (0 if self.tie_word_embeddings else emb)

    def _mlp_params(self, layer_idx: int, active: bool) -> int:
        h, m = self.hidden_size, self.moe
        if m is None or not m.is_sparse(layer_idx):
            return 3 * h * self.intermediate_size
        experts = m.top_k if active else m.num_experts
        n = experts * 3 * h * m.intermediate_size + m.num_experts * h  # experts + router
        n += experts * (2 * m.intermediate_size + h) if m.expert_bias else 0
        n += m.num_experts if m.router_bias else 0
        n += 3 * h * m.shared_intermediate_size + (h if m.shared_gate else 0)
        return n + (m.num_experts if m.correction_bias else 0)

    def attn_dims(self) -> float:
        """``L * H * Q`` of the attention FLOP count ``4 L H Q T`` (PaLM, appendix B: QK^T and PV, 2
        FLOPs a multiply-add): Q = ``head_dim``; MLA's mean of the QK^T and PV widths,
        ``(qk_head_dim + v_head_dim) / 2`` (the expanded form's: of MLA's two equal forms, the one of
        fewer FLOPs; the absorbed decode reads fewer bytes, ``kv_bytes_per_token``)."""
        dim = (self.mla.qk_head_dim + self.mla.v_head_dim) / 2 if self.mla is not None else self.head_dim
        return self.num_hidden_layers * self.num_attention_heads * dim

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` in tokens (a query at position p sees keys
        ``p - w < s <= p``), or None for a full-attention layer (every layer when ``layer_types`` is None)."""
        if self.layer_types is None or self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies in the cache across all layers (MLA: the latent and the
        rope key, ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes`` per layer; MLA with
        ``expanded_cache``: K and V of every head, ``2 * n_heads * expanded_width * dtype_bytes``)."""
        if self.mla is not None and not self.mla.expanded_cache:
            return self.num_hidden_layers * self.mla.latent_dim * dtype_bytes
        if self.mla is not None:
            return 2 * self.num_hidden_layers * self.num_attention_heads * self.mla.expanded_width * dtype_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def window_pairs(c: int, n: int, w: int) -> int:
    """(query, key) pairs a sliding-window layer of window ``w`` tokens scores for ``n`` queries at
    positions ``c .. c + n - 1`` (a query at p sees ``min(p + 1, w)`` keys): ``sum_p min(p + 1, w)``."""
    ramp_end = min(c + n, w)  # queries p < w see p + 1 keys
    ramp = (ramp_end * (ramp_end + 1) - c * (c + 1)) // 2 if ramp_end > c else 0
    return ramp + w * max(0, c + n - max(c, w))


def kv_cache_dims(cfg: ModelConfig) -> tuple[int, int]:
    """``(heads, head_dim)`` of one layer's cached K (and V) per token: the KV heads, or MLA's one
    shared latent row of ``kv_lora_rank + qk_rope_head_dim`` (its value is the same row, one pool),
    or with ``expanded_cache`` every head at ``expanded_width``."""
    if cfg.mla is not None and cfg.mla.expanded_cache:
        return cfg.num_attention_heads, cfg.mla.expanded_width
    return (1, cfg.mla.latent_dim) if cfg.mla is not None else (cfg.num_key_value_heads, cfg.head_dim)


def softmax_scale(cfg: ModelConfig) -> float:
    """``1/sqrt(head_dim)`` (Vaswani et al. 2017); MLA's own (``MLAConfig.scale``)."""
    if cfg.mla is not None:
        return cfg.mla.scale
    return 1.0 / math.sqrt(cfg.head_dim)


def _attention_bias(cfg: dict[str, Any], model_type: str) -> bool:
    """q/k/v biases: ``attention_bias`` (Llama), Qwen2's always, Qwen2-MoE's ``qkv_bias`` (transformers
    5's name; older files have no key and a bias); ERNIE-4.5's ``use_bias`` must be false."""
    if model_type in ERNIE_MODEL_TYPES:
        if cfg.get("use_bias"):
            raise BaigeError(f"{model_type} with use_bias=true (biases on every linear) is not supported")
        return False
    if model_type in ("qwen2_moe", gpt_oss_config.MODEL_TYPE):
        return bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
    return bool(cfg.get("attention_bias", model_type == "qwen2"))


def _int_field(cfg: dict[str, Any], *names: str, default: Any = None, minimum: int | None = None) -> int:
    """The first of ``names`` present in ``cfg``, checked to be an integer (>= ``minimum``), else
    ``default``. Raises BaigeError naming the field when it is absent without a default or bad."""
    for name in names:
        if cfg.get(name) is not None:
            value = cfg[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise BaigeError(f"field {name!r} must be an integer, got {value!r}")
            if minimum is not None and value < minimum:
                raise BaigeError(f"field {name!r} must be >= {minimum}, got {value}")
            return value
    if default is None:
        raise BaigeError(f"missing required field {names[0]!r}")
    return default


def _moe_config(cfg: dict[str, Any], model_type: str, n_layers: int) -> MoEConfig | None:
    """The sparse-MLP settings of the MoE families (transformers' config fields and defaults).

    Raises BaigeError naming a field whose value the decoder does not implement."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    if cfg.get("use_sliding_window") or (model_type == "mixtral" and cfg.get("sliding_window") is not None):
        raise BaigeError(f"{model_type}: sliding-window attention (sliding_window/use_sliding_window) is not supported")
    coef = float(cfg.get("router_aux_loss_coef") or 0.0)
    if model_type == "mixtral":
        e = _int_field(cfg, "num_local_experts", default=8)
        return MoEConfig(
            e,
            _int_field(cfg, "num_experts_per_tok", default=2),
            _int_field(cfg, "intermediate_size"),
            tuple(range(n_layers)),
            renormalize=True,
            router_aux_loss_coef=coef,
        )
    if model_type == "ernie4_5_moe":
        return _ernie_moe(cfg, n_layers, coef)
    if model_type == gpt_oss_config.MODEL_TYPE:
        return MoEConfig(**gpt_oss_config.moe_fields(cfg, n_layers))
    e = _int_field(cfg, "num_experts", "num_local_experts")  # transformers 5 saves the second name
    step = _int_field(cfg, "decoder_sparse_step", default=1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(n_layers) if i not in dense and e > 0 and (i + 1) % step == 0)
    shared = _int_field(cfg, "shared_expert_intermediate_size", default=0) if model_type == "qwen2_moe" else 0
    return MoEConfig(
        e,
        _int_field(cfg, "num_experts_per_tok"),
        _int_field(cfg, "moe_intermediate_size"),
        sparse,
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,
        router_aux_loss_coef=coef,
    )


def _ernie_moe(cfg: dict[str, Any], n_layers: int, coef: float) -> MoEConfig:
    """ERNIE-4.5-MoE (21B-A3B layout): MoE layers from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (-1: the last) every ``moe_layer_interval`` layers (counted as
    ``(i + 1) % interval == 0``, transformers' rule); shared experts of ``moe_num_shared_experts``
    times the expert width, no gate; selection through ``e_score_correction_bias``."""
    if isinstance(cfg.get("moe_num_experts"), list) or isinstance(cfg.get("moe_layer_start_index"), list):
        raise BaigeError(
            "ernie4_5_moe with several expert groups (list-valued moe_num_experts / "
            "moe_layer_start_index, the VL layout) is not supported"
        )
    start = _int_field(cfg, "moe_layer_start_index", default=1)
    end = _int_field(cfg, "moe_layer_end_index", default=-1)
    end = n_layers - 1 if end == -1 else end
    interval = _int_field(cfg, "moe_layer_interval", default=1)
    inter = _int_field(cfg, "moe_intermediate_size")
    sparse = tuple(i for i in range(n_layers) if (i + 1) % interval == 0 and start <= i <= end)
    return MoEConfig(
        _int_field(cfg, "moe_num_experts", "num_experts"),
        _int_field(cfg, "moe_k", "num_experts_per_tok"),
        inter,
        sparse,
        renormalize=True,
        shared_intermediate_size=inter * _int_field(cfg, "moe_num_shared_experts", default=2),
        correction_bias=True,
        norm_min=float(cfg.get("moe_norm_min") or 1e-12),
        router_fp32=True,
        router_aux_loss_coef=coef,
    )
