"""The JSON-object command-line flags (vLLM's ``--speculative-config``, ``--kv-transfer-config``): one
parser for their text, their shape and their keys."""

from __future__ import annotations

import json
from typing import Any

from baige.errors import BaigeError


def json_flag_object(value: Any, flag: str, example: str, known: set[str]) -> dict:
    """``value`` (a JSON object's text or a dict) as a new dict whose keys are all in ``known``.

    Args:
        value: the flag's text, or an already parsed dict (the Python API).
        flag: the flag's name with its dashes (``--kv-transfer-config``); errors name it, and their
            ``param`` is its field name (``kv_transfer_config``).
        example: a JSON object the error for a non-object shows.
        known: the accepted keys.
    Raises:
        BaigeError: not valid JSON (with the position), not an object, or an unknown key (the first, with
        the known ones).
    """
    param = flag.lstrip("-").replace("-", "_")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BaigeError(f"{flag}: not valid JSON ({e.msg} at character {e.pos})", param=param) from None
    if not isinstance(value, dict):
        raise BaigeError(f"{flag}: a JSON object such as {example}", param=param)
    unknown = sorted(set(value) - known)
    if unknown:
        raise BaigeError(f"{flag}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})", param=param)
    return dict(value)
