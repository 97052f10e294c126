"""The model architecture read from an HF ``config.json``: :class:`ModelConfig`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baige.errors import BaigeError

# HF model_type -> the architecture features our single decoder switches on.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


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
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json as read

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json.

        Raises:
            BaigeError: unknown ``model_type`` or rope type, or a missing required field.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise BaigeError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            vocab_size = int(cfg["vocab_size"])
            intermediate = int(cfg["intermediate_size"])
            n_layers = int(cfg["num_hidden_layers"])
        except KeyError as e:
            raise BaigeError(f"config.json is missing required field {e.args[0]!r}") from None
        # transformers >= 5 writes rope settings as `rope_parameters` (with rope_theta inside);
        # older files use top-level `rope_theta` and `rope_scaling` with `rope_type` or legacy `type`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise BaigeError(
                f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
            rope_scaling["rope_type"] = rope_type
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            torch_dtype=str(dtype),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            raw=dict(cfg),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json``. Raises BaigeError if it is absent or not JSON."""
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise BaigeError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise BaigeError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied embeddings counted once); ``non_embedding`` drops embeddings and lm_head."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        body = self.num_hidden_layers * per_layer + h
        if non_embedding:
            return body
        emb = self.vocab_size * h
        return body + emb + (0 if self.tie_word_embeddings else emb)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies in the cache across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def softmax_scale(cfg: ModelConfig) -> float:
    """``1/sqrt(head_dim)`` (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(cfg.head_dim)
