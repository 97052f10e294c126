"""Checks of a parsed ``config.json`` before anything is built from it: types, signs, ranges and the
divisibility the decoder relies on. Torch-free, and bounded in time for any input (no loop runs over
a count the file declares), so a crafted or corrupt file fails at once, in one line naming the field.

The machine-dependent check (the model's bytes against free memory) is made where the model is
loaded: :func:`baige.runtime.weights.validate.check_model_memory`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from baige.errors import BaigeError

# No tensor dimension or count past int32's range: beyond every published model by orders of
# magnitude, and the largest index the native CPU kernels and torch's int32 index paths take.
MAX_DIM = 2**31 - 1
# The deepest published decoders have ~10**2 layers; a config past this is corrupt, not a model.
MAX_LAYERS = 2**16
# The JSON side files of a checkpoint (config.json, generation_config.json, tokenizer_config.json,
# adapter_config.json, the safetensors index) are kilobytes to a few megabytes.
MAX_JSON_BYTES = 64 * 2**20
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")

_DIMS = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
_OPTIONAL_DIMS = (
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_k",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "moe_layer_interval",
)
_BOOLS = ("tie_word_embeddings", "attention_bias", "qkv_bias", "norm_topk_prob", "use_bias", "use_sliding_window")


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The parsed JSON file at ``path``, at most ``max_bytes`` long.

    Raises:
        BaigeError: naming ``path``: unreadable, larger than ``max_bytes``, not UTF-8, not JSON,
        nested too deep or holding an integer too long for Python to parse.
    """
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise BaigeError(f"{path}: {size} bytes, more than the {max_bytes} a JSON side file may have")
        return json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise BaigeError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise BaigeError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise BaigeError(f"{path}: not a readable JSON file ({type(e).__name__}: {str(e)[:80]})") from None


def bad(field: str, requirement: str, value: Any) -> BaigeError:
    """The one-line error for a config.json field (``value`` shown as JSON would, shortened)."""
    text = repr(value)
    return BaigeError(f"field {field!r} must be {requirement}, got {text[:80]}")


def check_int(cfg: dict[str, Any], name: str, minimum: int = 1, maximum: int = MAX_DIM) -> int | None:
    """``cfg[name]`` checked to be an integer in [minimum, maximum] (None when absent or null).
    Raises BaigeError naming the field."""
    value = cfg.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, "an integer", value)
    if not minimum <= value <= maximum:
        raise bad(name, f"in [{minimum}, {maximum}]", value)
    return value


def check_positive_float(cfg: dict[str, Any], name: str) -> None:
    """``cfg[name]``, when present, is a finite number > 0. Raises BaigeError naming the field."""
    value = cfg.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise bad(name, "a finite number > 0", value)


def _check_token_ids(cfg: dict[str, Any], vocab: int) -> None:
    """``bos/eos/pad_token_id``: null, or ids in [0, vocab_size) (``eos_token_id`` may be a list)."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.get(name)
        ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
        for i in ids:
            if i is None and ids == [None]:
                continue
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise bad(name, f"null or a token id in [0, vocab_size={vocab})", value)


def _check_rope(cfg: dict[str, Any]) -> None:
    for name in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(name)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise bad(name, "an object", rope)
        for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
            check_positive_float({f"{name}.{key}": rope.get(key)}, f"{name}.{key}")
        check_int({f"{name}.orig": rope.get("original_max_position_embeddings")}, f"{name}.orig")


def _check_moe(cfg: dict[str, Any]) -> None:
    """Expert counts >= top-k; layer lists of indices; steps and intervals >= 1 (they divide)."""
    experts = next((cfg[k] for k in ("num_experts", "num_local_experts", "moe_num_experts") if cfg.get(k)), None)
    top_k = next((cfg[k] for k in ("num_experts_per_tok", "moe_k") if cfg.get(k)), None)
    if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
        raise BaigeError(f"{top_k} experts per token (num_experts_per_tok) but only {experts} experts")
    only = cfg.get("mlp_only_layers")
    if only is not None and (
        not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only)
    ):
        raise bad("mlp_only_layers", "a list of layer indices", only)
    for name in ("moe_layer_start_index", "moe_layer_end_index"):
        if not isinstance(cfg.get(name), list):
            check_int(cfg, name, minimum=-1, maximum=MAX_LAYERS)
    check_int(cfg, "moe_num_shared_experts", minimum=0)
    for name in ("router_aux_loss_coef", "moe_norm_min"):
        value = cfg.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad(name, "a number", value)


def check_config_fields(cfg: dict[str, Any]) -> None:
    """Check a parsed config.json before :class:`~baige.runtime.model.config.ModelConfig` reads it.

    Checked: the sizes are integers in [1, 2**31 - 1] (``num_hidden_layers`` in [1, 2**16]);
    ``hidden_size`` divisible by ``num_attention_heads`` when ``head_dim`` is absent;
    ``num_attention_heads`` divisible by ``num_key_value_heads`` (grouped-query attention shares each
    KV head among a whole number of query heads); ``rms_norm_eps`` and ``rope_theta`` finite and > 0;
    flags are booleans; ``torch_dtype`` a float type name; special token ids inside the vocabulary;
    MoE: top-k <= experts, sparse steps and intervals >= 1.

    Raises:
        BaigeError: one line naming the first bad field.
    """
    for name in _DIMS:
        if cfg.get(name) is None:
            raise BaigeError(f"missing required field {name!r}")
        check_int(cfg, name)
    if cfg.get("num_hidden_layers") is None:
        raise BaigeError("missing required field 'num_hidden_layers'")
    check_int(cfg, "num_hidden_layers", maximum=MAX_LAYERS)
    for name in _OPTIONAL_DIMS:
        check_int(cfg, name)
    for name in ("rms_norm_eps", "rope_theta"):
        check_positive_float(cfg, name)
    for name in _BOOLS:
        if cfg.get(name) is not None and not isinstance(cfg[name], bool):
            raise bad(name, "true or false", cfg[name])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise BaigeError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
            "(each KV head serves a whole group of query heads)"
        )
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise BaigeError(
            f"hidden_size={cfg['hidden_size']} is not a multiple of num_attention_heads={heads} "
            "(and no head_dim is given)"
        )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim % 2:
        raise BaigeError(f"head_dim={head_dim} is odd (rotary embeddings rotate pairs of dimensions)")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype is not None and (not isinstance(dtype, str) or dtype.removeprefix("torch.") not in FLOAT_DTYPES):
        raise bad("torch_dtype", f"one of {', '.join(FLOAT_DTYPES)}", dtype)
    _check_token_ids(cfg, cfg["vocab_size"])
    _check_rope(cfg)
    _check_moe(cfg)
    if cfg.get("quantization_config") is not None:
        _check_quantization_config(cfg["quantization_config"])


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_quantization_config(q: Any) -> None:
    """The structure of a compressed-tensors ``quantization_config`` (its meaning is checked where it is
    applied, ``quant.format.prepare_quantized_model``): objects where objects go, lists of strings for
    ``targets`` and ``ignore``, ``re:`` patterns that compile, integer bit widths and group sizes."""
    if not isinstance(q, dict):
        raise bad("quantization_config", "an object", q)
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise bad("quantization_config.config_groups", "an object of objects", groups)
    if not _strings(q.get("ignore") or []):
        raise bad("quantization_config.ignore", "a list of strings", q.get("ignore"))
    patterns = list(q.get("ignore") or [])
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not _strings(group.get("targets", [])):
            raise bad(f"{where}.targets", "a list of strings", group.get("targets"))
        patterns += group.get("targets", [])
        weights = group.get("weights") or {}
        if not isinstance(weights, dict):
            raise bad(f"{where}.weights", "an object", weights)
        check_int(weights, "num_bits", maximum=64)
        check_int(weights, "group_size")
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise bad("quantization_config", f"holding valid re: patterns ({e})", pattern) from None
