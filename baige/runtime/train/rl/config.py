"""``baige train --method grpo``'s section of the config (``[rl]`` in TOML, ``--set rl.field=value``).

Names follow the field: ``group_size`` (GRPO's G), ``clip_low`` / ``clip_high`` (DAPO's
asymmetric clip, Yu et al. 2025, arXiv:2503.14476), ``loss_agg_mode`` and ``norm_adv_by_std_in_grpo``
(verl's), ``tis_cap`` (truncated importance sampling, verl's ``tis_imp_ratio_cap``), and the
sampling fields of ``SamplingParams``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.config import check_float, check_int

# How the per-token loss becomes the step's loss (verl's loss_agg_mode values):
#   token-mean: sum over every response token of the batch / their number (DAPO);
#   seq-mean-token-mean: each sequence's token mean, averaged over sequences (the GRPO paper);
#   seq-mean-token-sum: each sequence's token sum, averaged over sequences;
#   seq-mean-token-sum-norm: token sums / rl.max_tokens, averaged over sequences (Dr. GRPO, Liu et al.
#     2025, arXiv:2503.20783: no length normalisation, a constant instead).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
BUILTIN_REWARDS = ("exact_answer", "regex", "json_schema", "length_penalty")
BINARY_REWARDS = ("exact_answer", "regex", "json_schema")  # always 0 or 1: their mean is an accuracy


@dataclass
class RLSection:
    """GRPO (Shao et al. 2024, arXiv:2402.03300, sec. 4.1) with the DAPO / Dr. GRPO variants."""

    # NAME[=WEIGHT] each: a built-in (BUILTIN_REWARDS) or module:function on the Python path
    rewards: list[str] = field(default_factory=list)
    group_size: int = 8  # samples per prompt (SamplingParams.n)
    prompts_per_step: int = 8  # prompts per step over all data-parallel ranks (each rank takes its share)
    max_tokens: int = 256  # most tokens per sample
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings (SamplingParams.stop)
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # DAPO's clip-higher: 0.28
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen initial policy; 0: no reference model kept
    epochs_per_step: int = 1  # optimizer steps per rollout batch; > 1 reuses the stored old logprobs
    tis_cap: float = 0.0  # truncated importance sampling cap; 0: off
    loss_agg_mode: str = "token-mean"  # one of LOSS_AGG_MODES
    norm_adv_by_std_in_grpo: bool = True  # false: Dr. GRPO's advantages (reward - group mean)
    batch_invariant: bool = False  # engine and trainer logprobs bitwise equal (--batch-invariant)
    reward_regex: str | None = None  # the regex reward's pattern (re.search)
    reward_json_schema: str | None = None  # json_schema reward: a JSON schema (text or a .json path)
    overlong_buffer: int | None = None  # length_penalty: DAPO's soft overlong buffer (tokens); None: max_tokens // 4


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """``"exact_answer=0.5"`` -> ``("exact_answer", 0.5)``; no ``=WEIGHT`` -> weight 1.

    Raises:
        BaigeError: an empty name, a weight that is not a finite number, or an unknown built-in name
        (a name with ``:`` is a ``module:function`` and is imported later).
    """
    name, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "")
    name = name.strip()
    value = 1.0
    if sep:
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise BaigeError(f"--reward {spec!r}: the weight {weight.strip()!r} is not a finite number (NAME=WEIGHT)")
    if not name:
        raise BaigeError(f"--reward {spec!r}: no reward name (NAME[=WEIGHT])")
    if ":" in name:
        module, _, function = name.partition(":")
        if not module or not function:
            raise BaigeError(f"--reward {spec!r}: a custom reward is module:function")
    elif name not in BUILTIN_REWARDS:
        raise BaigeError(
            f"--reward {name!r}: unknown reward (built-ins: {', '.join(BUILTIN_REWARDS)}; or module:function)"
        )
    return name, value


def load_json_schema(text: str) -> dict:
    """The ``rl.reward_json_schema`` value as a schema: JSON text, or the path of a JSON file.

    Raises:
        BaigeError: an unreadable or non-UTF-8 file, not JSON, not an object, or not a valid JSON schema.
    """
    source, what = text, "rl.reward_json_schema"
    if not text.lstrip().startswith("{"):
        path = Path(text)
        try:
            is_file = path.is_file()
        except OSError as e:  # a name the file system refuses (too long, ...)
            raise BaigeError(f"{what} {text[:120]!r}: {e.strerror or type(e).__name__}") from None
        if not is_file:
            raise BaigeError(f"{what} {text!r}: neither a JSON object nor a file")
        what = f"{what} {text}"
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise BaigeError(f"{what}: not UTF-8 text (it holds the byte {e.object[e.start]:#04x})") from None
        except OSError as e:
            raise BaigeError(f"{what}: cannot read it ({e.strerror or type(e).__name__})") from None
    return parse_json_schema(source, what)


def parse_json_schema(value: object, what: str) -> dict:
    """A JSON schema given as JSON text or as the parsed object, checked against its draft's
    metaschema (``jsonschema``); ``what`` names it in errors.

    Raises:
        BaigeError: text that is not JSON, a value that is not an object, or an invalid schema.
    """
    import jsonschema

    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise BaigeError(f"{what}: not valid JSON ({e.msg})") from None
    if not isinstance(schema, dict):
        raise BaigeError(f"{what}: a JSON schema is an object (got {type(schema).__name__})")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise BaigeError(f"{what}: not a valid JSON schema ({' '.join(e.message.split())[:200]})") from None
    return schema


def validate_rl(rl: RLSection) -> None:
    """The rl section of a ``--method grpo`` run. Raises BaigeError naming the field."""
    if not rl.rewards:
        raise BaigeError("--method grpo needs a reward: pass --reward NAME[=WEIGHT] (or set rl.rewards)")
    names = [parse_reward_spec(s)[0] for s in rl.rewards]
    if len(set(names)) != len(names):
        raise BaigeError(f"--reward: a reward is named twice ({', '.join(names)}); give each once with its weight")
    check_int("rl.group_size", rl.group_size, 2)  # one sample per prompt has no group to compare against
    check_int("rl.prompts_per_step", rl.prompts_per_step, 1)
    check_int("rl.max_tokens", rl.max_tokens, 1)
    check_int("rl.epochs_per_step", rl.epochs_per_step, 1)
    check_float("rl.temperature", rl.temperature, 0.0, low_open=True)
    check_float("rl.top_p", rl.top_p, 0.0, 1.0, low_open=True)
    check_float("rl.clip_low", rl.clip_low, 0.0, 1.0)
    if rl.clip_low == 1.0:
        raise BaigeError("rl.clip_low must be < 1 (the ratio's lower clip 1 - clip_low must stay positive)")
    check_float("rl.clip_high", rl.clip_high, 0.0)
    check_float("rl.kl_coef", rl.kl_coef, 0.0)
    check_float("rl.tis_cap", rl.tis_cap, 0.0)
    if rl.loss_agg_mode not in LOSS_AGG_MODES:
        raise BaigeError(f"rl.loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)} (got {rl.loss_agg_mode!r})")
    if "regex" in names:
        if rl.reward_regex is None:
            raise BaigeError("the regex reward needs a pattern: --set rl.reward_regex='...'")
    if rl.reward_regex is not None:
        try:
            re.compile(rl.reward_regex)
        except re.error as e:
            raise BaigeError(f"rl.reward_regex {rl.reward_regex!r}: not a valid regular expression ({e})") from None
    if rl.reward_json_schema is not None:
        load_json_schema(rl.reward_json_schema)
    if rl.overlong_buffer is not None:
        check_int("rl.overlong_buffer", rl.overlong_buffer, 1, rl.max_tokens)
