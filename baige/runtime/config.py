"""One flat configuration dataclass per command (the CLI builds them; the runtime reads them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from baige.errors import BaigeError


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 bytes (decimal units as HF uses; GiB/MiB are binary).

    Raises BaigeError for text that is not a number with an optional unit.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise BaigeError(f"bad size {text!r} (examples: 500MB, 2GB, 1GiB)")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


@dataclass
class GenerateConfig:
    """Resolved arguments of ``baige generate`` / ``baige chat``."""

    model: str | None
    prompt: str | None = None
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    chat: bool | None = None
    system: str | None = None


@dataclass
class QuantizeConfig:
    """Resolved arguments of ``baige quantize``."""

    model: str | None
    method: str  # int8 | int4 | gptq
    output: str
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    calib_data: str | None = None
    calib_samples: int = 128
    calib_seq_len: int = 512  # tokens
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    device: str = "auto"
    clip_search: bool | None = None  # None: on for int4 when calib_data is given


@dataclass
class EvalConfig:
    """Resolved arguments of ``baige eval ppl`` / ``baige eval compare``."""

    models: list[str | None]
    data: str
    seq_len: int = 1024  # tokens per window
    max_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"


@dataclass
class EngineConfig:
    """Engine settings (vLLM's names). ``max_model_len`` None: the model's ``max_position_embeddings``;
    ``kv_cache_memory`` None: a fraction of the memory free after a warm-up step, less that step's
    activation peak (see ``kv_cache.num_blocks_for`` and ``kv_cache.profile_activation_peak``)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes, or a size such as "2GB" / "512MiB" (parse_size)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    quantization: str | None = None  # None or "fp16-weight" (CPU fp32; see quant_dynamic.py)
    kv_cache_dtype: str = "auto"  # auto (the model's) | float32 | float16 | bfloat16; others than auto: CPU
