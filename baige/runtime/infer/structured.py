"""Structured outputs: JSON schema, JSON object, regex, choice and grammar constraints on decoding.

The grammar engine is llguidance (Microsoft's Rust library behind Guidance; one wheel, no Python
dependencies, token masks computed without holding the GIL, JSON Schema / regex / Lark grammars
from one API; vLLM and SGLang ship it as a structured-output backend). One ``LLMatcher`` per
constrained sequence follows the tokens it generates; before each sampling step its token mask
(the tokens that keep the text a valid prefix of the language, EOS only once the grammar is
complete) sets every other logit to -inf (:func:`baige.runtime.infer.sampling.sample_batch`).

Compilation happens when the request is prepared (in the caller's thread, before the request is
queued): the constraint is turned into an llguidance grammar, validated (an invalid schema, regex
or grammar is a BaigeError naming it: a 400 at the server), and a prototype matcher is built and
cached by the sha256 of the constraint; each sequence gets a cheap ``deep_copy``. Masks of a step
are computed on a worker thread (llguidance's parallel executor) while the model's forward runs.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from baige.errors import BaigeError

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar larger than this is refused
CACHE_SIZE = 256  # compiled constraints kept (LRU)
# JSON as OpenAI writes it, '{"a": 1, "b": [2, 3]}': fixed separators and no other whitespace, so a
# sampled answer cannot spend its tokens on newlines (a schema's "x-guidance" may override these)
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint (vLLM's ``StructuredOutputsParams`` names); exactly one field is set.

    Attributes:
        json: a JSON schema (dict or its JSON text): the output is JSON valid against it.
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        regex: the whole output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (llguidance's dialect, which also takes GBNF-like ``start: ...`` rules).
    Raises:
        BaigeError: none or several fields set, or a field of the wrong type / empty.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise BaigeError(f"structured outputs need exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(set_) or 'none'})", param="structured_outputs")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise BaigeError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                 param="structured_outputs")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise BaigeError(f"structured_outputs.{name} must be a non-empty string", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise BaigeError("structured_outputs.json must be a JSON schema object", param="structured_outputs")

    def key(self) -> str:
        """sha256 of the canonical constraint: the compiled-grammar cache key."""
        body = {"json": self.json if not isinstance(self.json, str) else json.loads(self.json)} if self.json else {}
        body.update(json_object=self.json_object, regex=self.regex, choice=self.choice, grammar=self.grammar)
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=list).encode()).hexdigest()

    def source(self) -> str:
        """The llguidance grammar for this constraint (not yet validated)."""
        from llguidance import LLMatcher

        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            if not isinstance(schema, dict):
                raise BaigeError("structured_outputs.json: a JSON schema must be an object", param="structured_outputs")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe.

    Args:
        tokenizer_json: the tokenizer's ``tokenizer.json`` text (HF tokenizers serialisation).
        vocab_size: the model's vocabulary (mask width; may exceed the tokenizer's).
        eos_token_ids: what the grammar's end allows.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_json, self.vocab_size, self._eos = tokenizer_json, vocab_size, list(eos_token_ids)
        self._lltok = None
        self._lock = threading.Lock()
        self._protos: OrderedDict[str, Any] = OrderedDict()  # key -> prototype LLMatcher
        self._executor = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="baige-mask")
        self.stats = {"compiles": 0, "compile_seconds": 0.0, "mask_seconds": 0.0, "masked_tokens": 0}

    def _tokenizer(self):
        from llguidance import LLExecutor, LLTokenizer

        if self._lltok is None:  # ~1.5 s for a 49k vocabulary: built on the first constrained request
            self._lltok = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
            self._executor = LLExecutor()
        return self._lltok

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one sequence (a deep copy of the cached prototype).

        Raises:
            BaigeError: the schema, regex or grammar is invalid (llguidance's message, one line).
        """
        from llguidance import LLMatcher

        key = params.key()
        with self._lock:
            proto = self._protos.get(key)
            if proto is not None:
                self._protos.move_to_end(key)
                return proto.deep_copy()
            start = time.perf_counter()
            tok = self._tokenizer()
            try:
                source = params.source()
            except (ValueError, json.JSONDecodeError) as e:
                raise BaigeError(f"structured_outputs: invalid constraint ({_one_line(e)})",
                                 param="structured_outputs") from None
            if len(source) > MAX_CONSTRAINT_CHARS:
                raise BaigeError(f"structured_outputs: the constraint compiles to more than {MAX_CONSTRAINT_CHARS} "
                                 "characters", param="structured_outputs")
            proto = LLMatcher(tok, source, log_level=0)
            if proto.is_error():
                raise BaigeError(f"structured_outputs: invalid constraint ({_one_line(proto.get_error())})",
                                 param="structured_outputs")
            self.stats["compiles"] += 1
            self.stats["compile_seconds"] += time.perf_counter() - start
            self._protos[key] = proto
            if len(self._protos) > CACHE_SIZE:
                self._protos.popitem(last=False)
            return proto.deep_copy()

    def start_masks(self, matchers: dict[int, Any]) -> Future:
        """Compute the token masks of ``{row index: matcher}`` on the worker thread; the future
        resolves to ``{row index: (vocab,) bool tensor}`` (True: allowed)."""
        return self._pool.submit(self._masks, matchers)

    def _masks(self, matchers: dict[int, Any]) -> dict[int, torch.Tensor]:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        start = time.perf_counter()
        rows = list(matchers)
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)  # (R, ceil(V / 32)) int32
        fill_next_token_bitmask_par(self._executor, [(matchers[r], j) for j, r in enumerate(rows)], bitmask)
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(rows), -1)[:, : self.vocab_size]
        self.stats["mask_seconds"] += time.perf_counter() - start
        self.stats["masked_tokens"] += len(rows)
        return {r: allowed[j] for j, r in enumerate(rows)}


def _one_line(e: object) -> str:
    return " ".join(str(e).split())[:300]
