"""Rewards: the built-ins (no network) and ``module:function`` callables, weighted into one number per sample.

Every reward is called once per step on the rank's samples as ``fn(prompts, completions, **fields)``:
``prompts[i]`` the sample's prompt as the data gives it (a string, or the ``messages`` list),
``completions[i]`` the reply text, ``fields``: each extra field of the prompt records (``answer``, ...)
as a list aligned with the samples, plus ``completion_ids`` (the reply's token ids; TRL's name). It
returns one finite number per sample.

Built-ins:

- ``exact_answer``: 1 when the reply's answer equals the record's ``answer``, else 0. The reply's answer
  is the content of its **last** ``\\boxed{...}`` (nested braces allowed) when it has one, otherwise its
  last number (``-12``, ``3.5``, ``1,234``). So a reply with two boxed answers is judged by the second
  one only: hedging with several boxes gains nothing. Two numbers compare by value (``4.0`` equals
  ``4``, exactly, as decimals); anything else compares as text with surrounding spaces, ``$`` and a final
  ``.`` dropped.
- ``regex``: 1 when ``re.search(rl.reward_regex, reply)`` finds a match.
- ``json_schema``: 1 when the reply (spaces and one Markdown code fence around it allowed) parses as
  JSON and validates against the record's ``json_schema`` field, else ``rl.reward_json_schema``, else
  any JSON value (``jsonschema``'s validator for the schema's draft).
- ``length_penalty``: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13): 0 up
  to ``L_max - L_cache`` reply tokens, then falling linearly to -1 at ``L_max`` (``L_max`` =
  ``rl.max_tokens``, ``L_cache`` = ``rl.overlong_buffer``).
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from baige.errors import BaigeError
from baige.runtime.train.rl.config import BINARY_REWARDS, RLSection, load_json_schema, parse_reward_spec

RewardFn = Callable[..., list]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*?)\n?```$", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces matched), or None (none, or unclosed)."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{") : i - 1]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: the one before it
    return None


def extract_answer(text: str) -> str | None:
    """The answer a reply gives: its last ``\\boxed{}`` content, else its last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def _normalise(text: str) -> str:
    return text.strip().strip("$").strip().rstrip(".").strip()


def _as_number(text: str) -> Decimal | None:
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def answers_match(given: str | None, expected) -> bool:
    """Whether an extracted answer equals the expected one (numbers by value, else normalised text)."""
    if given is None or expected is None:
        return False
    a, b = _normalise(given), _normalise(str(expected))
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b


def exact_answer(prompts, completions, answer, **_) -> list[float]:
    return [float(answers_match(extract_answer(c), a)) for c, a in zip(completions, answer)]


def regex_reward(prompts, completions, *, pattern: str, **_) -> list[float]:
    compiled = re.compile(pattern)
    return [float(compiled.search(c) is not None) for c in completions]


def parse_json_reply(text: str):
    """The JSON value of a reply (spaces and one ```` ``` ```` fence around it allowed). Raises ValueError."""
    text = text.strip()
    fenced = _FENCE.match(text)
    return json.loads(fenced.group(1) if fenced else text)


def json_schema_reward(prompts, completions, *, schema: dict | None, json_schema=None, **_) -> list[float]:
    import jsonschema

    out = []
    for i, c in enumerate(completions):
        own = json_schema[i] if json_schema is not None else None
        chosen = (json.loads(own) if isinstance(own, str) else own) if own is not None else schema
        try:
            value = parse_json_reply(c)
        except ValueError:
            out.append(0.0)
            continue
        ok = chosen is None or jsonschema.validators.validator_for(chosen)(chosen).is_valid(value)
        out.append(float(ok))
    return out


def length_penalty(prompts, completions, *, completion_ids, max_tokens: int, buffer: int, **_) -> list[float]:
    start = max_tokens - buffer
    return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / buffer) for ids in completion_ids]


@dataclass
class Reward:
    """One named, weighted reward. ``binary``: its values are always 0 or 1 (a built-in's promise)."""

    name: str
    weight: float
    fn: RewardFn
    binary: bool = False


def _import_callable(name: str) -> RewardFn:
    """``module:function`` imported from the Python path. Raises BaigeError (one line naming it)."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any import-time failure is theirs to fix
        raise BaigeError(
            f"--reward {name}: cannot import {module_name!r} ({type(e).__name__}: {_one_line(e)})"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise BaigeError(f"--reward {name}: {module_name!r} has no callable {attr!r}")
    return fn


def _bind(fn: RewardFn, **settings) -> RewardFn:
    """``fn`` with its settings fixed: they win over record fields of the same names (a record's
    ``max_tokens`` or ``pattern`` field must not replace ``rl.max_tokens`` or ``rl.reward_regex``)."""

    def bound(prompts, completions, **fields):
        return fn(prompts, completions, **{**fields, **settings})

    return bound


def load_rewards(rl: RLSection) -> list[Reward]:
    """The configured rewards, built-ins bound to their settings. Raises BaigeError (bad spec or import)."""
    out = []
    for spec in rl.rewards:
        name, weight = parse_reward_spec(spec)
        if name == "exact_answer":
            fn = exact_answer
        elif name == "regex":
            fn = _bind(regex_reward, pattern=rl.reward_regex)
        elif name == "json_schema":
            schema = load_json_schema(rl.reward_json_schema) if rl.reward_json_schema is not None else None
            fn = _bind(json_schema_reward, schema=schema)
        elif name == "length_penalty":
            buffer = rl.overlong_buffer or max(1, rl.max_tokens // 4)
            fn = _bind(length_penalty, max_tokens=rl.max_tokens, buffer=buffer)
        else:
            fn = _import_callable(name)
        out.append(Reward(name, weight, fn, name in BINARY_REWARDS))
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def score(
    rewards: list[Reward], prompts: list, completions: list[str], fields: dict[str, list]
) -> dict[str, list[float]]:
    """Each reward's values on the samples, by name.

    Raises:
        BaigeError: a reward that raised (or called ``sys.exit``), or returned something else than
        ``len(completions)`` finite numbers (one line naming the reward).
    """
    out = {}
    for r in rewards:
        try:
            values = r.fn(prompts, completions, **fields)
        except (Exception, SystemExit) as e:  # the reward's own failure (user code, sys.exit() included): one line
            raise BaigeError(f"reward {r.name} failed: {type(e).__name__}: {_one_line(e)}") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise BaigeError(f"reward {r.name} returned {got}; expected a list of {len(completions)} numbers")
        bad = [v for v in values if not _finite_number(v)]
        if bad:
            raise BaigeError(
                f"reward {r.name} returned {_one_line(repr(bad[0]))[:60]}; every value must be a finite number"
            )
        out[r.name] = [float(v) for v in values]
    return out


def _finite_number(v: object) -> bool:
    """A real number that converts to a finite float (an int past float's range does not)."""
    try:
        return isinstance(v, numbers.Real) and math.isfinite(float(v))
    except OverflowError:
        return False
