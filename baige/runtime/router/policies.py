"""How the router orders backends for a request: ``round_robin``, ``least_load``, ``prefix``
(consistent hashing of the prompt's leading characters), and ``pd``'s two roles. Plain Python over
URLs and load numbers (no HTTP): each policy returns every healthy backend, the one to try first
first and the rest in the order a retry takes them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

POLICIES = ("round_robin", "least_load", "prefix", "pd")
DEFAULT_PREFIX_CHARS = 256  # `baige router --prefix-chars`: 4 blocks of 16 tokens at ~4 characters a token
DEFAULT_BALANCE_ABS_THRESHOLD = 32  # `--balance-abs-threshold` (SGLang router's balance_abs_threshold)
CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text: a token is ~4 characters
VNODES = 64  # points per backend on the hash ring (more: a more even share of the keys)


def _text_of(content: Any) -> str:
    """A message's content as text: a string as it is, a list of parts as their texts (other parts
    as sorted JSON), anything else as sorted JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                parts.append(json.dumps(p, sort_keys=True, ensure_ascii=False))
        return "".join(parts)
    return json.dumps(content, sort_keys=True, ensure_ascii=False)


def prompt_prefix(body: Any, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> bytes:
    """The key the ``prefix`` policy hashes: the request's ``model`` and the first ``prefix_chars``
    characters of its prompt, UTF-8 encoded.

    The prompt is ``prompt`` for /v1/completions (a string; of a batch, the first; token ids count
    ``CHARS_PER_TOKEN`` characters each, so the first ``prefix_chars // CHARS_PER_TOKEN`` ids), and for
    /v1/chat/completions a stable serialisation of ``messages``: each message's role and its content's
    text, in order (``tools`` and sampling fields are left out: they do not change the leading tokens of
    the rendered prompt that a server's prefix cache keys on). Two requests whose prompts agree on
    these characters get the same key. A body that is not a JSON object gives ``b""``.
    """
    if not isinstance(body, Mapping):
        return b""
    model = str(body.get("model", ""))
    if "messages" in body and isinstance(body["messages"], list):
        text = "".join(
            f"\x1e{m.get('role', '')}\x1f{_text_of(m.get('content'))}" if isinstance(m, Mapping) else f"\x1e{m!r}"
            for m in body["messages"]
        )
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, list):  # token ids
            text = " ".join(str(t) for t in prompt[: max(1, prefix_chars // CHARS_PER_TOKEN)])
        else:
            text = str(prompt)
    return f"{model}\x1d{text[:prefix_chars]}".encode("utf-8", errors="surrogatepass")


def _h64(data: bytes) -> int:
    """The first 8 bytes of SHA-256, an unsigned 64-bit integer (stable across processes and hosts,
    unlike Python's ``hash``): several routers map a key to the same backend."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class HashRing:
    """A consistent-hash ring (Karger et al., 1997) of backend URLs, ``vnodes`` points each: a key
    maps to the first point clockwise of its hash. Removing a backend moves only the keys it held,
    each to the next backend on the ring, which is also the order :meth:`walk` gives for retries."""

    def __init__(self, nodes: Sequence[str], vnodes: int = VNODES):
        points = sorted((_h64(f"{node}#{i}".encode()), node) for node in nodes for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]
        self.num_nodes = len(set(nodes))

    def walk(self, key: bytes) -> list[str]:
        """Every node once, in ring order from ``key``'s point."""
        if not self._nodes:
            return []
        start = bisect_right(self._hashes, _h64(key))
        out: list[str] = []
        for i in range(len(self._nodes)):
            node = self._nodes[(start + i) % len(self._nodes)]
            if node not in out:
                out.append(node)
                if len(out) == self.num_nodes:
                    break
        return out


class RoundRobin:
    """Each request starts one backend further along the healthy list."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def rotation(self, urls: Sequence[str]) -> list[str]:
        if not urls:
            return []
        with self._lock:
            k = self._next % len(urls)
            self._next += 1
        return [*urls[k:], *urls[:k]]

    def order(self, urls: Sequence[str], loads: Mapping[str, float], key: bytes) -> list[str]:
        return self.rotation(urls)


class LeastLoad(RoundRobin):
    """The backends by load (running + waiting requests, :mod:`.backends`), lightest first; equal
    loads in round-robin order, so an idle fleet is not sent everything to its first backend."""

    def order(self, urls: Sequence[str], loads: Mapping[str, float], key: bytes) -> list[str]:
        return sorted(self.rotation(urls), key=lambda u: loads.get(u, 0.0))  # stable: ties keep the rotation


class Prefix:
    """Cache-aware routing (SGLang's router idea) by consistent hashing: requests whose prompts share
    their first characters (:func:`prompt_prefix`) go to the same backend, whose prefix cache then
    holds that prefix's KV blocks. The ring spans every configured backend, healthy or not, so a
    backend going down moves only its own keys and its return brings them back.

    Hashing alone can pile one hot prefix (a shared system prompt) onto one backend: when the chosen
    backend's load exceeds the lightest healthy backend's by more than ``balance_abs_threshold``
    requests, the request goes by least load instead (SGLang's ``balance_abs_threshold``)."""

    def __init__(self, urls: Sequence[str], balance_abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD):
        self.ring = HashRing(urls)
        self.balance_abs_threshold = balance_abs_threshold
        self._least = LeastLoad()

    def order(self, urls: Sequence[str], loads: Mapping[str, float], key: bytes) -> list[str]:
        healthy = set(urls)
        walk = [u for u in self.ring.walk(key) if u in healthy]
        if not walk:
            return []
        lightest = min(loads.get(u, 0.0) for u in walk)
        if loads.get(walk[0], 0.0) - lightest > self.balance_abs_threshold:
            return self._least.order(urls, loads, key)
        return walk


def make_policy(name: str, urls: Sequence[str], balance_abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD):
    """The policy object of ``name`` (one of POLICIES but ``pd``) over backends ``urls``."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "prefix":
        return Prefix(urls, balance_abs_threshold)
    raise ValueError(f"no single-role policy {name!r}")
