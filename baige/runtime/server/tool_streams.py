"""Tool-call streams: what one output's text becomes, as events that are both the streamed deltas and,
joined by :func:`assemble`, the non-streamed message (so the two are the same by construction).

Events: ``("content", text)``, ``("call", index, id, name)`` (a call's header: OpenAI's first delta of a
call carries its id, type and name with ``arguments: ""``), ``("args", index, fragment)``, and
``("cut", index)``: the call ``index`` ended before its JSON did (``max_tokens``, a stop string), so its
arguments are not a complete call (no delta of its own: the non-streamed message leaves that call out).

- :class:`PlainStream`: no tools: every delta is content.
- :class:`ToolCallStream`: ``tool_choice: "auto"``: a parser's (:mod:`.tool_parsers`) items; a call is
  sent whole once it is complete and valid, so a stream never shows a call the full text would leave as
  content.
- :class:`ForcedCallStream`: ``"required"``/named: the constrained JSON, each call's arguments streamed
  as they are generated; JSON cut off before a call's name is dropped, never content.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from baige.runtime.server.tool_parsers import FunctionCall, ToolParser, loads

Event = tuple  # ("content", text) | ("call", index, id, name) | ("args", index, arguments fragment) | ("cut", index)
# (| ("reasoning", text) from :mod:`.reasoning`)


class PlainStream:
    """No tool parsing: every delta is content."""

    def feed(self, text: str) -> list[Event]:
        return [("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []

    calls = 0


class ToolCallStream:
    """``tool_choice: "auto"``: a parser's items as events. Trailing whitespace of content is held until
    more text follows, and dropped at the end when there were calls (so ``"...\\n<tool_call>..."`` gives
    content without the newline; with no calls the content is the text as written). With
    ``max_calls`` (``parallel_tool_calls: false`` -> 1) later calls are dropped, as vLLM does."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.calls = 0
        self._held = ""

    def feed(self, text: str) -> list[Event]:
        return self._events(self.parser.feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._events(self.parser.finish(), final=True)

    def _events(self, items: list[str | FunctionCall], final: bool) -> list[Event]:
        out: list[Event] = []
        for item in items:
            if isinstance(item, str):
                text = self._held + item
                body = text.rstrip()
                self._held = text[len(body) :]
                if body:
                    out.append(("content", body))
            elif self.max_calls is None or self.calls < self.max_calls:
                out += [("call", self.calls, self.parser.new_id(), item.name), ("args", self.calls, item.arguments)]
                self.calls += 1
        if final and self._held and not self.calls:
            out.append(("content", self._held))
        return out


class ForcedCallStream:
    """``tool_choice: "required"`` or a named function: the output is JSON that the structured-output grammar
    shapes as ``{"name": N, "arguments": A}`` (``array``: a list of them). Each call's header is sent once
    its name is read, then its arguments as they are generated. An output cut off (``length``, a stop
    string) inside a call ends with ``("cut", index)`` for it, its streamed arguments cut short (as vLLM and
    OpenAI stream them); cut off before a call's name, the partial JSON is dropped: the grammar allows
    nothing but calls, so it is never content. ``calls`` counts the complete calls."""

    _HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
    _MAX_HEAD = 400  # characters of a call's start before its arguments

    def __init__(self, array: bool, new_id: Callable[[], str] = ToolParser.new_id):
        self._base = 1 if array else 0  # nesting depth at which a call object opens
        self._new_id = new_id
        self._depth, self._in_str, self._esc = 0, False, False
        self._head: str | None = None  # the current call's text until its arguments begin
        self._state = "between"  # between | head | before_args | args
        self._started = 0  # calls whose header was read
        self.calls = 0  # calls whose object closed

    def _step(self, c: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
        elif c == '"':
            self._in_str = True
        elif c in "[{":
            self._depth += 1
        elif c in "]}":
            self._depth -= 1

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        frag: list[str] = []
        for c in text:
            state, depth, in_str = self._state, self._depth, self._in_str
            if state == "before_args" and not c.isspace():
                state = self._state = "args"
            if state == "args" and not in_str and depth == self._base + 1 and c == "}":
                out.append(("args", self._started - 1, "".join(frag)))
                frag, self._state = [], "between"
                self.calls += 1
            elif state == "args":
                frag.append(c)
            elif state == "head":
                self._head += c
                m = self._HEAD.fullmatch(self._head)
                if not m and len(self._head) > self._MAX_HEAD:  # not a call's start (names are short)
                    self._state = "between"
                elif m:
                    out.append(("call", self._started, self._new_id(), loads(m.group(1))))
                    self._started += 1
                    self._state = "before_args"
            elif c == "{" and not in_str and depth == self._base:
                self._head, self._state = c, "head"
            self._step(c)
        if frag:
            out.append(("args", self._started - 1, "".join(frag)))
        return [e for e in out if e[0] != "args" or e[2]]

    def finish(self) -> list[Event]:
        return [("cut", self._started - 1)] if self._started > self.calls else []


def assemble(events: list[Event]) -> tuple[str | None, list[dict]]:
    """The message's ``content`` and ``tool_calls`` from all events of one output, a ``cut`` call left out
    (its arguments are not a complete call). Content is None when there are calls and no text besides them."""
    content = "".join(e[1] for e in events if e[0] == "content")
    calls: dict[int, dict] = {}
    for e in events:
        if e[0] == "call":
            calls[e[1]] = {"id": e[2], "type": "function", "function": {"name": e[3], "arguments": ""}}
        elif e[0] == "args":
            calls[e[1]]["function"]["arguments"] += e[2]
        elif e[0] == "cut":
            del calls[e[1]]
    return (content or None) if calls else content, list(calls.values())


def delta_of(event: Event) -> dict:
    """The chat.completion.chunk ``delta`` of one event (OpenAI's shape; reasoning as vLLM streams it)."""
    if event[0] == "reasoning":
        return {"reasoning_content": event[1], "reasoning": event[1]}
    if event[0] == "content":
        return {"content": event[1]}
    if event[0] == "call":
        return {
            "tool_calls": [
                {"index": event[1], "id": event[2], "type": "function", "function": {"name": event[3], "arguments": ""}}
            ]
        }
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}
