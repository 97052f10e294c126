"""One flat configuration dataclass per command (the CLI builds them; the runtime reads them)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.json_flag import json_flag_object
from baige.runtime.kv_transfer_config import KVTransferConfig

# torch.Generator.manual_seed takes any 64-bit integer, signed or unsigned (the engine's RNG)
TORCH_SEED_RANGE = (-(2**63), 2**64 - 1)
# seeds of data order and random prompts (numpy's SeedSequence takes no negative seed)
DATA_SEED_RANGE = (0, 2**63 - 1)


def parse_size(text: str, option: str | None = None) -> int:
    """'2GB' -> 2_000_000_000 bytes (decimal units as HF uses; GiB/MiB are binary).

    Raises BaigeError (naming ``option`` when given) for text that is not a number with an optional unit.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise BaigeError(f"{option + ': ' if option else ''}bad size {text!r} (examples: 500MB, 2GB, 1GiB)")
    unit = (m.group(2) or "B").upper()
    mult = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    return int(float(m.group(1)) * mult)


def check_int(option: str, value: int, low: int, high: int | None = None) -> None:
    """``value`` an integer in [low, high]. Raises BaigeError naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BaigeError(f"{option} must be an integer {bounds} (got {value!r})")


def check_float(
    option: str, value: float, low: float, high: float = math.inf, low_open: bool = False, inf_ok: bool = False
) -> None:
    """``value`` a finite number (or +inf with ``inf_ok``) in [low, high] ((low, high] with ``low_open``).
    Raises BaigeError naming ``option``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and inf_ok and value == math.inf:
        return
    if not (number and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
        bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        raise BaigeError(f"{option} must be a {'number' if inf_ok else 'finite number'} {bounds} (got {value!r})")


def check_input_file(option: str, path: str | Path) -> None:
    """An existing regular file. Raises BaigeError naming ``option``."""
    p = Path(path)
    if p.is_dir():
        raise BaigeError(f"{option} {path}: a directory, not a file")
    if not p.is_file():
        raise BaigeError(f"{option} {path}: no such file")


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists())


def check_output_path(option: str, path: str | Path, kind: str) -> None:
    """A path a command will write: ``kind`` "file", "dir" (created or written into) or "new dir"
    (must not exist or be empty; written atomically). Checked before any work, so a bad path fails
    at once rather than after minutes of compute.

    Raises BaigeError naming ``option``: a file where a directory goes or the reverse, a non-empty
    "new dir", a parent that is a file, or a nearest existing directory that is not writable.
    """
    p = Path(path)
    if p.exists():
        if kind == "file" and p.is_dir():
            raise BaigeError(f"{option} {path}: a directory; give a file name")
        if kind != "file" and not p.is_dir():
            raise BaigeError(f"{option} {path}: a file, not a directory")
        if kind == "new dir" and any(p.iterdir()):
            raise BaigeError(f"{path}: already exists and is not empty; choose a new output directory")
    base = _nearest_existing(p.parent if kind == "file" or kind == "new dir" else p)
    if not base.is_dir():
        raise BaigeError(f"{option} {path}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise BaigeError(f"{option} {path}: {base} is not writable")


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
    speculative_config: str | dict | None = None  # --speculative-config (EngineConfig parses it)
    tensor_parallel_size: int = 1
    batch_invariant: bool = False  # EngineConfig.batch_invariant


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

    def __post_init__(self) -> None:
        """Raises BaigeError for an option that does not fit the method, a bad calibration setting, a
        missing --calib-data file or an output that exists and is not empty."""
        if self.method not in ("int8", "int4", "gptq"):
            raise BaigeError(f"unknown method {self.method!r} (choose int8, int4, gptq)")
        if self.act_order and self.method != "gptq":
            raise BaigeError("--act-order applies to --method gptq only")
        if self.method == "gptq" and not self.calib_data:
            raise BaigeError("--method gptq needs --calib-data FILE (text to calibrate on)")
        if self.method == "int8" and not self.symmetric:
            raise BaigeError("int8 is symmetric per output channel; --asymmetric applies to int4 and gptq")
        if self.method != "int8" and self.group_size not in (32, 64, 128):
            raise BaigeError(f"--group-size {self.group_size}: choose 32, 64 or 128")
        check_int("--calib-samples", self.calib_samples, 1)
        check_int("--calib-seq-len", self.calib_seq_len, 2)
        if self.calib_data:
            check_input_file("--calib-data", self.calib_data)
        check_output_path("--output", self.output, "new dir")


@dataclass
class EvalConfig:
    """Resolved arguments of ``baige eval ppl`` / ``baige eval compare``."""

    models: list[str | None]
    data: str
    seq_len: int = 1024  # tokens per window
    max_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    output: str | None = None  # also write the JSON result here

    def __post_init__(self) -> None:
        """Raises BaigeError for a window under 2 tokens, a missing data file or an unwritable output."""
        check_int("--seq-len", self.seq_len, 2)
        if self.max_tokens is not None:
            check_int("--max-tokens", self.max_tokens, 2)
        check_input_file("--data", self.data)
        if self.output is not None:
            check_output_path("--output", self.output, "file")


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
    # vLLM's: most prompt tokens one sequence computes per step (0: only the budget limits it), so a long
    # prompt's chunks leave the rest of each step to the prompts behind it (infer/scheduler.py)
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes, or a size such as "2GB" / "512MiB" (parse_size)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    quantization: str | None = None  # None, "fp16-weight" or "int8-weight" (CPU fp32; see quant/fp16_weight.py)
    kv_cache_dtype: str = "auto"  # auto (the model's) | float32 | float16 | bfloat16; others than auto: CPU
    # speculative decoding: a SpeculativeConfig, or its JSON text / dict (parsed in __post_init__)
    speculative_config: "SpeculativeConfig | dict | str | None" = None
    # LoRA serving (vLLM's names): adapters loaded at start-up (name -> PEFT adapter dir), the most
    # distinct adapters in one step, the largest rank accepted
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    # directories adapters may be read from (--lora-root, as vLLM's --allowed-local-media-path); empty: any
    lora_roots: tuple[str, ...] = ()
    # serving across processes (vLLM's names): Megatron-style shards of the model and KV cache on
    # this many ranks (infer/tensor_parallel.py); MoE experts placed whole on ranks instead of split
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # a sequence's logprobs independent of its batch and chunking, equal to the trainer's bit for bit
    # (kernels/invariant.py; CPU, plain dense models); with quantization, speculation, LoRA or TP: refused
    batch_invariant: bool = False
    # prefill/decode disaggregation: a KVTransferConfig, or its JSON text / dict (infer/kv_transfer/)
    kv_transfer_config: "KVTransferConfig | dict | str | None" = None
    # vLLM's --runner: auto (pooling for a checkpoint with sentence-transformers files or a bare-decoder
    # architecture, else generate) | generate | pooling (embeddings; infer/pooling.py)
    runner: str = "auto"
    # a second KV tier (infer/kv_offload.py): bytes (or a size such as "8GB") of evicted prefix-cache
    # blocks kept in host memory (GPU pool) or in files under kv_offload_dir (CPU pool; default a
    # temporary directory removed at exit)
    kv_offload_size: int | str | None = None
    kv_offload_dir: str | None = None

    def __post_init__(self) -> None:
        """Raises BaigeError for a seed outside 64 bits, sizes below 1, a bad ``kv_cache_memory``,
        ``lora_modules`` or ``lora_roots`` without ``enable_lora``, a ``lora_roots`` entry that is not a
        directory, LoRA with tensor parallelism, ``batch_invariant`` with quantization, speculative
        decoding, LoRA or tensor parallelism, a bad ``kv_offload_size`` (or one without prefix caching, or
        with tensor parallelism), or a bad ``kv_transfer_config`` (or one with TP)."""
        check_int("--seed", self.seed, *TORCH_SEED_RANGE)
        for option, value in (
            ("--max-num-seqs", self.max_num_seqs),
            ("--block-size", self.block_size),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
        ):
            check_int(option, value, 1)
        check_int("--long-prefill-token-threshold", self.long_prefill_token_threshold, 0)
        if self.max_model_len is not None:
            check_int("--max-model-len", self.max_model_len, 1)
        if isinstance(self.kv_cache_memory, str):
            parse_size(self.kv_cache_memory, "--kv-cache-memory")
        elif self.kv_cache_memory is not None:
            check_int("--kv-cache-memory", self.kv_cache_memory, 0)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None and self.tensor_parallel_size > 1:
            raise BaigeError("--kv-transfer-config with --tensor-parallel-size > 1 is not supported yet")
        check_int("--max-loras", self.max_loras, 1)
        check_int("--max-lora-rank", self.max_lora_rank, 1)
        if self.lora_modules and not self.enable_lora:
            raise BaigeError("--lora-modules needs --enable-lora")
        if self.lora_roots and not self.enable_lora:
            raise BaigeError("--lora-root needs --enable-lora")
        for root in self.lora_roots:
            if not Path(root).expanduser().is_dir():
                raise BaigeError(f"--lora-root {root}: not a directory")
        check_int("--tensor-parallel-size", self.tensor_parallel_size, 1)
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise BaigeError("--enable-lora with --tensor-parallel-size > 1 is not supported yet")
        if self.batch_invariant:
            for option, used in (
                ("--quantization", self.quantization),
                ("--speculative-config", self.speculative_config),
                ("--enable-lora", self.enable_lora),
                ("--tensor-parallel-size > 1", self.tensor_parallel_size > 1),
            ):
                if used:
                    raise BaigeError(f"--batch-invariant does not support {option}")
        self._check_kv_offload()

    def _check_kv_offload(self) -> None:
        if isinstance(self.kv_offload_size, str):
            self.kv_offload_size = parse_size(self.kv_offload_size, "--kv-offload-size")
        if self.kv_offload_size is None:
            if self.kv_offload_dir is not None:
                raise BaigeError("--kv-offload-dir needs --kv-offload-size")
            return
        check_int("--kv-offload-size", self.kv_offload_size, 1)
        if not self.enable_prefix_caching:
            raise BaigeError("--kv-offload-size needs prefix caching (drop --no-enable-prefix-caching)")
        if self.tensor_parallel_size > 1:
            raise BaigeError("--kv-offload-size with --tensor-parallel-size > 1 is not supported yet")


# ---- speculative decoding (--speculative-config) ------------------------------------------------
METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 32  # proposals per sequence per step


@dataclass(frozen=True)
class SpeculativeConfig:
    """How sequences speculate (vLLM's ``SpeculativeConfig`` keys and meanings).

    Attributes:
        method: ``"ngram"`` (prompt lookup: proposals copied from the sequence's own prompt and
            output), ``"draft_model"`` (a smaller model with the same tokenizer proposes) or ``"mtp"``
            (the target's own multi-token-prediction modules propose, DeepSeek-V3's MTP).
        num_speculative_tokens: k, the most tokens proposed per sequence per step (1..32); mtp
            without it: 1 (vLLM: the model's MTP depth, 1 for DeepSeek-V3).
        prompt_lookup_max, prompt_lookup_min: ngram only: the longest and shortest suffix (in tokens)
            looked up in the sequence; the longest that matches wins. Defaults 4 and 1.
        model: draft_model only: the draft's model spec (a directory, a hub id, a .gguf, or a
            ``baige quantize`` output such as an int4 copy of the target).
        draft_tensor_parallel_size: accepted for vLLM compatibility; only 1.
        disable_by_batch_size: a step with more decoding sequences than this speculates none of them
            (vLLM's key; vLLM decides per incoming request from the queue, baige per step from the
            running batch). None: always speculate. Under load a verify row is no longer nearly
            free (docs/benchmarks/archive.md, "Speculative decoding").
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str):
            raise BaigeError(f"--speculative-config: {msg}", param="speculative_config")

        if self.method not in METHODS:
            bad(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not _is_plain_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.draft_tensor_parallel_size != 1:
            bad("draft_tensor_parallel_size: only 1 is supported")
        d = self.disable_by_batch_size
        if d is not None and (not _is_plain_int(d) or d < 1):
            bad(f"disable_by_batch_size must be an integer >= 1 or null, got {d!r}")
        if self.method == "ngram":
            if self.model is not None:
                bad("model is for method draft_model; ngram proposes from the sequence itself")
            lo = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(4, lo) if self.prompt_lookup_max is None else self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_plain_int(v) or v < 1:
                    bad(f"{name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                bad(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.method == "mtp":
            if self.model is not None or self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                bad("method mtp proposes with the target's own MTP modules: drop model / prompt_lookup_*")
        else:
            if not isinstance(self.model, str) or not self.model:
                bad('method draft_model needs "model": the draft\'s model spec')
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                bad("prompt_lookup_max/min are for method ngram")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a JSON object text, a dict or a config (None stays None).

        ``method`` may be left out when ``model`` is given (then ``draft_model``, as vLLM infers).
        Raises BaigeError naming the bad key or value (unknown keys are refused).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_flag_object(
            value,
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}',
            {f.name for f in fields(cls)},
        )
        if "method" not in value:
            if "model" not in value:
                raise BaigeError(
                    '--speculative-config: give "method" (ngram, draft_model or mtp)', param="speculative_config"
                )
            value["method"] = "draft_model"
        if "num_speculative_tokens" not in value and value["method"] == "mtp":
            value["num_speculative_tokens"] = 1
        if "num_speculative_tokens" not in value:
            raise BaigeError('--speculative-config: give "num_speculative_tokens"', param="speculative_config")
        return cls(**value)


def _is_plain_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


ROUTER_POLICIES = ("round_robin", "least_load", "prefix", "pd")


@dataclass
class RouterConfig:
    """``baige router`` (and the router of ``baige serve --data-parallel-size``): the policy, the
    backends' base URLs (``backends`` for round_robin / least_load / prefix; ``prefill`` and ``decode``
    for pd), the health checks' period and deadline, and each client request's deadline
    (``request_timeout_secs``, SGLang's router flag), in seconds. Raises BaigeError naming a bad
    value."""

    policy: str = "round_robin"
    backends: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    prefix_chars: int = 256
    balance_abs_threshold: float = 32
    health_interval: float = 5.0
    health_timeout: float = 5.0
    connect_timeout: float = 5.0
    request_timeout_secs: float = 1800.0
    max_request_bytes: int = 16 * 2**20
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise BaigeError(f"--policy {self.policy!r}: expected one of {', '.join(ROUTER_POLICIES)}")
        for flag, urls in (("--backend", self.backends), ("--prefill", self.prefill), ("--decode", self.decode)):
            for i, url in enumerate(urls):
                if not re.fullmatch(r"https?://[^/\s]+/?", url):
                    raise BaigeError(f"{flag} {url!r}: expected a base URL, http://HOST:PORT (or https://)")
                urls[i] = url.rstrip("/")
            if len(set(urls)) < len(urls):
                raise BaigeError(f"{flag}: a URL is given twice")
        if self.policy == "pd":
            if self.backends:
                raise BaigeError("--policy pd takes --prefill and --decode URLs, not --backend")
            if not self.prefill or not self.decode:
                raise BaigeError("--policy pd needs at least one --prefill URL and one --decode URL")
        else:
            if self.prefill or self.decode:
                raise BaigeError(f"--prefill/--decode are for --policy pd, not {self.policy}")
            if not self.backends:
                raise BaigeError(f"--policy {self.policy} needs at least one --backend URL")
        for name in ("health_interval", "health_timeout", "connect_timeout", "request_timeout_secs"):
            if not getattr(self, name) > 0:
                raise BaigeError(f"--{name.replace('_', '-')} must be > 0 seconds")
        if self.prefix_chars < 1:
            raise BaigeError("--prefix-chars must be >= 1")
