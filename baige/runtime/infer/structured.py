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
            raise BaigeError(
                f"structured outputs need exactly one of json, json_object, regex, choice, grammar "
                f"(got {', '.join(set_) or 'none'})",
                param="structured_outputs",
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise BaigeError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings",
                    param="structured_outputs",
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise BaigeError(f"structured_outputs.{name} must be a non-empty string", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise BaigeError("structured_outputs.json must be a JSON schema object", param="structured_outputs")
        if isinstance(self.json, str):  # the schema's JSON text: parsed once, here
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise BaigeError(
                    f"structured_outputs.json is not valid JSON ({_one_line(e)})", param="structured_outputs"
                ) from None
            if not isinstance(schema, dict):
                raise BaigeError("structured_outputs.json: a JSON schema must be an object", param="structured_outputs")
            object.__setattr__(self, "json", schema)

    def key(self) -> str:
        """sha256 of the canonical constraint: the compiled-grammar cache key."""
        body = {
            "json": self.json,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
        }
        try:
            text = json.dumps(body, sort_keys=True, default=list)
        except (TypeError, ValueError, RecursionError) as e:  # a schema dict of non-JSON values / too deep
            raise BaigeError(
                f"structured_outputs.json is not a JSON document ({_one_line(e)})", param="structured_outputs"
            ) from None
        return hashlib.sha256(text.encode()).hexdigest()

    def source(self) -> str:
        """The llguidance grammar for this constraint (not yet validated)."""
        from llguidance import LLMatcher

        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # one lexeme (a regex alternation) rather than a rule of alternatives: the parser's rows
            # are capped at 2000 items, the lexer has no such limit
            return LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in self.choice)
            )
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
        self._unsupported: str | None = None  # llguidance's verdict on this tokenizer, once refused
        self._lock = threading.Lock()
        self._protos: OrderedDict[str, tuple[Any, torch.Tensor]] = OrderedDict()  # key -> (prototype, first mask)
        self._executor = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="baige-mask")
        self.stats = {"compiles": 0, "compile_seconds": 0.0, "mask_seconds": 0.0, "masked_tokens": 0}

    def _tokenizer(self):
        """llguidance's view of the tokenizer, built once (costly for a large vocabulary: on the first
        constrained request).

        Raises:
            BaigeError: llguidance cannot read this tokenizer (e.g. a ``Fuse`` decoder: it cannot tell
            the bytes of each token); the verdict is cached, every later request gets the same error.
        """
        from llguidance import LLExecutor, LLTokenizer

        if self._lltok is None and self._unsupported is None:
            try:
                self._lltok = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
            except ValueError as e:
                self._unsupported = _one_line(e)
            else:
                self._executor = LLExecutor()
        if self._unsupported is not None:
            raise BaigeError(
                "structured outputs (response_format, forced tool calls) are not supported for this "
                f"model's tokenizer: the grammar engine cannot read it ({self._unsupported})",
                param="structured_outputs",
            )
        return self._lltok

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one sequence (a deep copy of the cached prototype).

        Raises:
            BaigeError: the schema, regex or grammar is invalid, exceeds the grammar engine's limits
            at its first step, or accepts no output at all (llguidance's message, one line).
        """
        return self._compiled(params)[0].deep_copy()

    def first_mask(self, params: StructuredOutputsParams) -> torch.Tensor:
        """The ``(vocab,)`` bool mask of the tokens the constraint allows first. Raises as :meth:`matcher`."""
        return self._compiled(params)[1]

    def _compiled(self, params: StructuredOutputsParams) -> tuple[Any, torch.Tensor]:
        from llguidance import LLMatcher

        key = params.key()
        with self._lock:
            hit = self._protos.get(key)
            if hit is not None:
                self._protos.move_to_end(key)
                return hit
            start = time.perf_counter()
            tok = self._tokenizer()
            try:
                source = params.source()
            except (ValueError, RecursionError) as e:
                raise BaigeError(
                    f"structured_outputs: invalid constraint ({_one_line(e)})", param="structured_outputs"
                ) from None
            if len(source) > MAX_CONSTRAINT_CHARS:
                raise BaigeError(
                    f"structured_outputs: the constraint compiles to more than {MAX_CONSTRAINT_CHARS} characters",
                    param="structured_outputs",
                )
            proto = LLMatcher(tok, source, log_level=0)
            if proto.is_error():
                raise BaigeError(
                    f"structured_outputs: invalid constraint ({_one_line(proto.get_error())})",
                    param="structured_outputs",
                )
            # The first step, on a copy: limits the engine only meets when it parses (rows of more
            # than 2000 alternatives, too many lexer expressions) and languages without any string
            # (a schema that is only a $ref cycle, a rule that only refers to itself) fail here.
            probe = proto.deep_copy()
            first = self._bits(torch.frombuffer(bytearray(probe.compute_bitmask()), dtype=torch.int32)[None])[0]
            if probe.is_error() and not probe.get_error().startswith("NoExtensionBias"):
                raise BaigeError(
                    f"structured_outputs: the grammar engine cannot run this constraint ({engine_error(probe)})",
                    param="structured_outputs",
                )
            if probe.is_error() or not bool(first.any()):  # NoExtensionBias: no token can extend the empty text
                raise BaigeError(
                    "structured_outputs: the constraint accepts no output at all (no string satisfies "
                    "it, or none is made of this model's tokens)",
                    param="structured_outputs",
                )
            self.stats["compiles"] += 1
            self.stats["compile_seconds"] += time.perf_counter() - start
            self._protos[key] = (proto, first)
            if len(self._protos) > CACHE_SIZE:
                self._protos.popitem(last=False)
            return proto, first

    def _bits(self, bitmask: torch.Tensor) -> torch.Tensor:
        """``(R, ceil(V / 32))`` int32 bitmask -> ``(R, vocab)`` bool (bit j of word w: token 32 w + j)."""
        bits = torch.arange(32, dtype=torch.int32)
        return ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(bitmask), -1)[:, : self.vocab_size]

    def start_masks(self, matchers: dict[int, Any], drafts: dict[int, list[int]] | None = None) -> Future:
        """Compute the token masks of ``{row index: matcher}`` on the worker thread; the future
        resolves to ``{row index: (vocab,) bool tensor}`` (True: allowed). A row with draft tokens
        (speculative decoding, ``drafts[row]``, already validated) gets ``(len + 1, vocab)``: the
        mask at each draft position and after the last, the matcher left where it was."""
        return self._pool.submit(self._masks, matchers, drafts or {})

    def _masks(self, matchers: dict[int, Any], drafts: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        from llguidance.torch import (
            allocate_token_bitmask,
            fill_next_token_bitmask_par,
            fill_next_token_bitmask_par_with_draft_tokens,
        )

        start = time.perf_counter()
        rows = list(matchers)
        spans, at = [], 0
        for r in rows:
            spans.append((matchers[r], at, list(drafts.get(r, ()))))
            at += 1 + len(drafts.get(r, ()))
        bitmask = allocate_token_bitmask(at, self.vocab_size)  # (positions, ceil(V / 32)) int32
        plain = [(m, i) for m, i, d in spans if not d]
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if len(plain) < len(spans):  # llguidance wants a non-empty draft list there
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, [t for t in spans if t[2]], bitmask)
        allowed = self._bits(bitmask)
        self.stats["mask_seconds"] += time.perf_counter() - start
        self.stats["masked_tokens"] += at
        return {r: allowed[i] if r not in drafts else allowed[i : i + 1 + len(d)] for r, (_, i, d) in zip(rows, spans)}


def engine_error(matcher) -> str:
    """A matcher's error in one line, without the parser-state dump llguidance appends."""
    return _one_line(matcher.get_error().split("<state>")[0]) or "no allowed token is left"


def _one_line(e: object) -> str:
    return " ".join(str(e).split())[:300]
