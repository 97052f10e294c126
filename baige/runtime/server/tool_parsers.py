"""Tool-call parsers: the text a model writes -> OpenAI ``tool_calls`` (vLLM's parser names).

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number of them, text around them.
- ``llama3_json`` (Llama 3.1-3.3 JSON tool calling): a JSON object ``{"name": ..., "parameters": {...}}`` at the
  start of the output or after ``<|python_tag|>``; several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` (or one such object).

Every parser is incremental: ``feed(text)`` returns what is certain so far, ``finish()`` the rest, as a list of
content strings and :class:`FunctionCall`. A call is returned only once it is complete and valid (JSON that
parses, a function name the request declared, arguments an object); otherwise its text, markup included,
stays content. Text that may be the start of a marker is held back. So the items of any chunking of a text
join to the same result as one ``feed(text)`` + ``finish()`` (the unit tests check every split point).
:mod:`.tool_streams` turns the items into response deltas.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class FunctionCall:
    """One parsed call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """``json.loads`` without NaN/Infinity (they are not JSON; a client could not parse them back).

    Raises:
        ValueError: not JSON, NaN/Infinity, or nested deeper than Python's recursion limit.
    """
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _held_prefix(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class _ValueEnd:
    """Finds where the JSON object or array starting at ``buf[start]`` ends, scanning each character once
    however often it is asked (the buffer only grows). Brackets inside strings do not count."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_str, self.esc = start, 0, False, False

    def scan(self, buf: str) -> int | None:
        """Index just past the closing bracket, or None while the value is incomplete."""
        depth, in_str, esc = self.depth, self.in_str, self.esc
        for i in range(self.pos, len(buf)):
            c = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "[{":
                depth += 1
            elif c in "]}":
                depth -= 1
                if depth == 0:
                    return i + 1
        self.pos, self.depth, self.in_str, self.esc = len(buf), depth, in_str, esc
        return None


class ToolParser(ABC):
    """Base of the parsers: a buffer of unconsumed text, ``feed``/``finish``, and what the default tool
    prompt needs (``instructions``, :meth:`render`).

    Class attributes:
        name: the ``--tool-call-parser`` value.
        markers: chat-template text that identifies the format (``--tool-call-parser auto``).
        keep_special_tokens: the format's markers are special tokens, so requests with tools decode them
            (vLLM's ``adjust_request`` for mistral).
        instructions: how the default tool prompt tells the model to call a function.
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    keep_special_tokens: ClassVar[bool] = False
    instructions: ClassVar[str]

    def __init__(self, tool_names: Collection[str]):
        self.tool_names = frozenset(tool_names)
        self._buf = ""

    def feed(self, text: str) -> list[str | FunctionCall]:
        self._buf += text
        return [x for x in self._drain(final=False) if x != ""]

    def finish(self) -> list[str | FunctionCall]:
        return [x for x in self._drain(final=True) if x != ""]

    @abstractmethod
    def _drain(self, final: bool) -> list[str | FunctionCall]:
        """Events from the buffer: text, and calls once complete (``final``: the output has ended)."""

    def _call(self, obj: Any, args_keys: tuple[str, ...]) -> FunctionCall | None:
        """``{"name": <declared tool>, <args key>: {...}}`` as a call (no arguments key: ``{}``), else None."""
        if not isinstance(obj, dict) or obj.get("name") not in self.tool_names:
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        if not isinstance(args, dict):
            return None
        return FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False))

    @staticmethod
    @abstractmethod
    def render(calls: list[tuple[str, Any]]) -> str:
        """The text this format gives earlier calls ``[(name, arguments value), ...]`` in a conversation."""

    @staticmethod
    def new_id() -> str:
        """A tool call id: ``call_`` and 24 random letters and digits (OpenAI's shape)."""
        return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START,)
    instructions = (
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def __init__(self, tool_names: Collection[str]):
        super().__init__(tool_names)
        self._open = False  # the buffer starts with <tool_call>
        self._searched = 0  # where the search for </tool_call> resumes

    def _drain(self, final: bool) -> list[str | FunctionCall]:
        out: list[str | FunctionCall] = []
        while self._buf:
            buf = self._buf
            if not self._open:
                j = buf.find(self.START)
                if j < 0:
                    keep = 0 if final else _held_prefix(buf, self.START)
                    out.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    break
                out.append(buf[:j])
                self._buf, self._open, self._searched = buf[j:], True, len(self.START)
                continue
            k = buf.find(self.END, self._searched)
            if k < 0 and not final:
                self._searched = max(len(self.START), len(buf) - len(self.END) + 1)
                break
            end = len(buf) if k < 0 else k + len(self.END)  # an unclosed call at the end still counts
            body = buf[len(self.START) : len(buf) if k < 0 else k]
            out.append(self._parse(body) or buf[:end])
            self._buf, self._open = buf[end:], False
        return out

    def _parse(self, body: str) -> FunctionCall | None:
        try:
            return self._call(loads(body), ("arguments",))
        except ValueError:
            return None

    @staticmethod
    def render(calls: list[tuple[str, Any]]) -> str:
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
            for n, a in calls
        )


class _JsonCallsParser(ToolParser):
    """Calls as bare JSON values after a ``tag`` (and, with ``leading_brace``, at the very start of the
    output), optionally several joined by ``separator``. States: content (looking for the tag), region
    (a JSON value expected at ``_skip``), after (a call was read; a separator may bring another)."""

    tag: ClassVar[str]
    leading_brace: ClassVar[bool] = False
    separator: ClassVar[str | None] = None
    openers: ClassVar[str] = "{"

    def __init__(self, tool_names: Collection[str]):
        super().__init__(tool_names)
        self._mode, self._at_start, self._skip, self._scan = "content", True, 0, None

    @abstractmethod
    def _calls(self, value: Any) -> list[FunctionCall] | None:
        """The calls one parsed JSON value holds in this format, or None when it is not calls."""

    def _drain(self, final: bool) -> list[str | FunctionCall]:
        out: list[str | FunctionCall] = []
        step = {"content": self._content, "region": self._region, "after": self._after}
        while self._buf and step[self._mode](out, final):
            pass
        return out

    def _enter(self, skip: int) -> bool:
        self._mode, self._skip, self._scan = "region", skip, None
        return True

    def _to_content(self, out: list, upto: int) -> bool:
        out.append(self._buf[:upto])
        self._buf, self._mode = self._buf[upto:], "content"
        return True

    def _content(self, out: list, final: bool) -> bool:
        buf = self._buf
        if self._at_start and self.leading_brace:
            body = buf.lstrip()
            if not body:  # only whitespace so far: the first other character decides
                if final:
                    self._to_content(out, len(buf))
                return False
            self._at_start = False
            if body[0] == "{":
                return self._enter(len(buf) - len(body))
        self._at_start = False
        j = buf.find(self.tag)
        if j < 0:
            keep = 0 if final else _held_prefix(buf, self.tag)
            self._to_content(out, len(buf) - keep)
            return False
        self._to_content(out, j)
        return self._enter(len(self.tag))

    def _region(self, out: list, final: bool) -> bool:
        buf = self._buf
        i = self._skip
        while i < len(buf) and buf[i].isspace():
            i += 1
        if i == len(buf) or buf[i] not in self.openers:
            if i < len(buf):
                return self._to_content(out, i)  # the tag is not followed by a call: all of it is text
            if final:
                self._to_content(out, len(buf))
            return False
        if self._scan is None:
            self._scan = _ValueEnd(i)
        end = self._scan.scan(buf)
        if end is None:
            if final:
                self._to_content(out, len(buf))
            return False
        self._scan = None
        try:
            calls = self._calls(loads(buf[i:end]))
        except ValueError:
            calls = None
        if calls is None:
            return self._to_content(out, end)
        out.extend(calls)
        self._buf, self._mode = buf[end:], ("after" if self.separator else "content")
        return True

    def _after(self, out: list, final: bool) -> bool:
        buf = self._buf
        i = len(buf) - len(buf.lstrip())
        if i < len(buf) and buf[i] == self.separator:
            j = i + 1
            while j < len(buf) and buf[j].isspace():
                j += 1
            if j < len(buf):
                if buf[j] in self.openers:
                    return self._enter(i + 1)
                self._mode = "content"
                return True
        elif i < len(buf):
            self._mode = "content"
            return True
        if final:
            self._to_content(out, len(buf))
        return False


class Llama3JsonToolParser(_JsonCallsParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    markers = (tag, "<|eom_id|>")
    leading_brace, separator = True, ";"
    instructions = (
        'To call a function, respond with only a JSON object of the form {"name": <function-name>, '
        '"parameters": <args-json-object>}; separate several calls with "; ".'
    )

    def _calls(self, value: Any) -> list[FunctionCall] | None:
        call = self._call(value, ("parameters", "arguments"))
        return None if call is None else [call]

    @staticmethod
    def render(calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


class MistralToolParser(_JsonCallsParser):
    name = "mistral"
    tag = "[TOOL_CALLS]"
    markers = (tag, "[AVAILABLE_TOOLS]")
    keep_special_tokens = True
    openers = "[{"
    instructions = (
        "To call functions, respond with [TOOL_CALLS] followed by a JSON list of calls: "
        '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    )

    def _calls(self, value: Any) -> list[FunctionCall] | None:
        items = value if isinstance(value, list) else [value]
        calls = [self._call(x, ("arguments", "parameters")) for x in items]
        return calls if calls and None not in calls else None

    @staticmethod
    def render(calls: list[tuple[str, Any]]) -> str:
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    @staticmethod
    def new_id() -> str:
        """9 random letters and digits: Mistral's chat templates refuse other tool call ids (as vLLM)."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def parser_for_template(template: str | None) -> type[ToolParser]:
    """``--tool-call-parser auto``: the parser whose markers the chat template mentions; else hermes (the
    format of baige's default tool prompt)."""
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser):
        if template and any(m in template for m in parser.markers):
            return parser
    return HermesToolParser
