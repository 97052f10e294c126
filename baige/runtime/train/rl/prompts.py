"""The prompts of a GRPO run: JSONL records read and checked, tokenized as serving does, and the
prompts of each step for each data-parallel rank.

A record is ``{"prompt": "..."}`` (encoded as ``LLM.generate`` encodes a string prompt: the
tokenizer's BOS rule) or ``{"messages": [...]}`` (the chat template with the generation prompt, as
``LLM.chat`` and the server apply it), plus any other fields, handed to the rewards.

Order: the prompts are visited epoch by epoch, each epoch a permutation seeded by ``training.seed +
epoch`` (``data.shuffle``; else file order). Step ``s`` takes global positions ``[s P, (s+1) P)`` of that
stream (``P`` = ``rl.prompts_per_step``) and data-parallel rank ``r`` of ``W`` its ``r``-th slice of
``P / W``; so the prompts of a step depend only on the step, which makes resume exact, and each
position's sampling seed (:func:`sampling_seed`) makes the samples independent of the rank layout.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baige.errors import BaigeError
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.train.rl.config import parse_json_schema

PROMPT_KEYS = ("prompt", "messages")
# the names rewards are called with (fn(prompts, completions, completion_ids=..., **fields)): no field may take them
RESERVED_FIELDS = ("prompts", "completions", "completion_ids")


@dataclass
class PromptRecord:
    """One prompt: ``prompt`` (a string or a ``messages`` list, as given) and its other fields."""

    prompt: str | list[dict]
    fields: dict
    where: str  # "path:line", for error messages


def read_prompts(paths: list[str], required: tuple[str, ...] = (), json_schema: bool = False) -> list[PromptRecord]:
    """Every record of the JSONL files, in order.

    Args:
        required: fields every record must have (``answer`` for ``exact_answer``: a string or a number,
            not NaN or Infinity, which Python's JSON reader accepts).
        json_schema: the ``json_schema`` reward is on: a record's ``json_schema`` field, when present,
            must be a valid JSON schema (an object, or its JSON text); it is kept parsed.
    Raises:
        BaigeError: a missing or unreadable file, a line that is not a JSON object with a ``prompt``
        string or a ``messages`` list of ``{"role": str, "content": str}`` messages, a field named as a
        reward argument (:data:`RESERVED_FIELDS`), a missing or mistyped required field, an invalid
        ``json_schema`` field, no record at all (each names the file and line).
    """
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise BaigeError(f"{path}: data file not found")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise BaigeError(f"{path}: not UTF-8 text (it holds the byte {e.object[e.start]:#04x})") from None
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                out.append(_record(line, f"{path}:{lineno}", required, json_schema))
    if not out:
        raise BaigeError(f"{', '.join(paths)}: no prompt records")
    return out


def _record(line: str, where: str, required: tuple[str, ...], json_schema: bool) -> PromptRecord:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise BaigeError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise BaigeError(f'{where}: expected a JSON object with a "prompt" string or a "messages" list')
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        prompt = record["prompt"]
    elif isinstance(record.get("messages"), list) and record["messages"]:
        prompt = [_message(m, f"{where}: messages[{i}]") for i, m in enumerate(record["messages"])]
    else:
        raise BaigeError(f'{where}: expected a non-empty "prompt" string or "messages" list')
    fields = {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    reserved = [k for k in RESERVED_FIELDS if k in fields]
    if reserved:
        raise BaigeError(
            f'{where}: the field "{reserved[0]}" is a reward argument\'s name ({", ".join(RESERVED_FIELDS)}); rename it'
        )
    for name in required:
        if fields.get(name) is None:
            raise BaigeError(f'{where}: the record has no "{name}" field, which the {_needed_by(name)} reward needs')
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not _finite(value):
            raise BaigeError(f'{where}: "{name}" must be a string or a number (got {json.dumps(value)[:60]})')
    if json_schema and fields.get("json_schema") is not None:
        fields["json_schema"] = parse_json_schema(fields["json_schema"], f'{where}: "json_schema"')
    return PromptRecord(prompt, fields, where)


def _finite(value: str | int | float) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _message(m: object, where: str) -> dict:
    """One chat message checked as the server checks it: a ``role`` string and a ``content`` string, null,
    or a list of ``{"type": "text", "text": str}`` parts (joined into one string, as the server does)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
        raise BaigeError(f'{where}: a message is an object with a "role" string and a "content" string')
    content = m.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return {**m, "content": "".join(p["text"] for p in content)}
    if content is not None and not isinstance(content, str):
        raise BaigeError(
            f'{where}: "content" must be a string or a list of {{"type": "text", "text": ...}} parts '
            f"(got {json.dumps(content)[:60]})"
        )
    return m


def _needed_by(name: str) -> str:
    return {"answer": "exact_answer"}.get(name, name)


def tokenize_prompt(tokenizer: Tokenizer, record: PromptRecord) -> list[int]:
    """The token ids the engine gets for a record (see the module docstring). Raises BaigeError."""
    if isinstance(record.prompt, str):
        return tokenizer.encode(record.prompt)
    try:
        return tokenizer.apply_chat_template(record.prompt, add_generation_prompt=True)
    except BaigeError as e:
        raise BaigeError(f"{record.where}: {e}") from None
    except Exception as e:  # the template met fields it cannot render (jinja2 type errors)
        raise BaigeError(f"{record.where}: the chat template cannot render it ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=4)
def _epoch_order(num_prompts: int, seed: int, shuffle: bool) -> np.ndarray:
    """Record indices in the order of one epoch (``seed`` = training.seed + epoch)."""
    return np.random.default_rng(seed).permutation(num_prompts) if shuffle else np.arange(num_prompts)


def step_prompts(
    num_prompts: int, step: int, per_step: int, dp_size: int, dp_rank: int, seed: int, shuffle: bool
) -> list[tuple[int, int]]:
    """``(global stream position, record index)`` of each prompt of step ``step`` (0-based) on
    data-parallel rank ``dp_rank``: ``per_step / dp_size`` of them (the caller checks divisibility)."""
    share = per_step // dp_size
    first = step * per_step + dp_rank * share
    out = []
    for position in range(first, first + share):
        epoch, k = divmod(position, num_prompts)
        out.append((position, int(_epoch_order(num_prompts, seed + epoch, shuffle)[k])))
    return out


def sampling_seed(seed: int, position: int, group_size: int) -> int:
    """The ``SamplingParams.seed`` of the prompt at global ``position``: its G samples use ``seed + i``
    (the engine's rule), distinct for every sample of the run, whatever the rank layout."""
    return (seed * 0x9E3779B97F4A7C15 + position * group_size) % 2**63
