"""The Responses API's plumbing (``/v1/responses``, :mod:`.responses_routes`): a request's input as a chat
conversation, the output items built from a chat output's events (:mod:`.tool_streams`, :mod:`.reasoning`)
together with the typed stream events, in OpenAI's order, and the store that ``previous_response_id``,
``GET`` and ``DELETE`` read.

Stream events of one output item, in order: ``response.output_item.added``, then for a message
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for reasoning the same with ``reasoning_text``; for a function call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``; then
``response.output_item.done``. The whole response is framed by ``response.created`` and
``response.in_progress`` first and ``response.completed`` (or ``response.incomplete``) last. The
non-streamed response is the same builder's items, so the two agree by construction.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from baige.runtime.server.protocol import APIError
from baige.runtime.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from baige.runtime.server.tool_parsers import loads
from baige.runtime.server.tool_streams import Event

STORE_MAX_RESPONSES = 1024  # responses kept for previous_response_id / GET (oldest dropped first)
STORE_TTL_S = 3600.0  # a stored response is forgotten this long after it was created
STORE_MAX_CHARS = 64 * 2**20  # characters of stored conversations in all (oldest dropped first)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def owner_of(authorization: str | None) -> str:
    """The key a stored response belongs to: the sha256 of the request's ``Authorization`` header (a
    response made with one API key is not found with another)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


@dataclass
class Stored:
    owner: str
    response: dict
    messages: list[dict]  # the conversation including this response's output (chat messages)
    created: float
    chars: int


class ResponseStore:
    """Stored responses in memory, bounded by count, age and size (thread-safe)."""

    def __init__(
        self, max_responses: int = STORE_MAX_RESPONSES, ttl_s: float = STORE_TTL_S, max_chars: int = STORE_MAX_CHARS
    ):
        self.max_responses, self.ttl_s, self.max_chars = max_responses, ttl_s, max_chars
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._items:
            rid, first = next(iter(self._items.items()))
            if (
                now - first.created <= self.ttl_s
                and len(self._items) <= self.max_responses
                and self._chars <= self.max_chars
            ):
                break
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        self._chars -= self._items.pop(rid).chars

    def put(self, owner: str, response: dict, messages: list[dict]) -> None:
        chars = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        with self._lock:
            self._items[response["id"]] = Stored(owner, response, messages, time.monotonic(), chars)
            self._chars += chars
            self._expire(time.monotonic())

    def get(self, owner: str, rid: str, param: str = "response_id") -> Stored:
        """The stored response ``rid`` of ``owner``. Raises APIError (404 naming ``param``, the field that
        gave the id) for one that does not exist, has expired, or belongs to another key."""
        with self._lock:
            self._expire(time.monotonic())
            found = self._items.get(rid)
        if found is None or found.owner != owner:
            raise APIError(f"no response with id {rid[:80]!r} is stored", 404, param=param, code="not_found")
        return found

    def delete(self, owner: str, rid: str) -> None:
        self.get(owner, rid)
        with self._lock:
            if rid in self._items:
                self._drop(rid)


# ---- input -> chat conversation -----------------------------------------------------------------
def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _replayable(call: dict) -> dict:
    """A function call as the chat pipeline takes it. The Responses API takes ``arguments`` strings as
    given (a call cut off by ``max_output_tokens`` stores a truncated one): a string that is not JSON
    goes on JSON-quoted, so the chat pipeline hands the template that text as a string (templates that
    take string arguments, as Qwen3's, show it as written; others ``tojson`` it)."""
    args = call["function"]["arguments"]
    try:
        loads(args)
    except ValueError:
        return {**call, "function": {**call["function"], "arguments": json.dumps(args, ensure_ascii=False)}}
    return call


def conversation(req: ResponsesRequest, previous: list[dict]) -> list[dict]:
    """The chat messages of a request: ``instructions`` as the system message, the previous response's
    conversation (``previous``), then the input items (``developer`` is ``system``; function calls join
    the assistant message before them; outputs become ``tool`` messages; reasoning items are dropped).
    Call arguments that are not JSON are kept as text (:func:`_replayable`), never refused. Raises
    APIError (400) for a ``function_call_output`` whose ``call_id`` answers no function call before it (in
    ``previous`` or earlier in the input), and for a conversation of nothing but instructions."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    called: set[str] = set()  # call_ids of the function calls so far (an output must answer one of them)
    for m in previous:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_replayable(c) for c in m["tool_calls"]]
            called.update(c["id"] for c in m["tool_calls"])
        messages.append(m)
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for k, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = _replayable(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            )
            called.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise APIError(
                    f"input[{k}].call_id: no function_call with call_id {item.call_id[:80]!r} comes before this "
                    "function_call_output (in input or in the previous response)",
                    param="input",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not any(m["role"] != "system" for m in messages):
        raise APIError("input: the conversation has no message besides the instructions", param="input")
    return messages


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The /v1/chat/completions body that generates this response."""
    body: dict = {"messages": messages, "temperature": req.temperature, "top_p": req.top_p}
    if req.model is not None:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.seed is not None:
        body["seed"] = req.seed
    if req.tools is not None:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError("text.format json_schema needs text.format.schema", param="text")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "schema", "schema": fmt.schema_},
        }
    return body


def output_messages(items: list[dict]) -> list[dict]:
    """A response's output as chat messages for the next turn: its text and calls as one assistant
    message (its reasoning is left out, as chat templates drop earlier reasoning)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items
        if it["type"] == "function_call"
    ]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


# ---- output items and stream events -------------------------------------------------------------
class OutputBuilder:
    """Output items from one output's events, and the stream events that build them (without
    ``sequence_number``, which the route numbers). ``feed(events)`` / ``close()`` return stream events;
    ``items`` holds the finished items."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._text = ""
        self._cut = False  # the open function call ended before its JSON did (status "incomplete")

    def _index(self) -> int:
        return len(self.items)

    def _start(self, item: dict) -> list[dict]:
        self._open, self._text, self._cut = item, "", False
        out = [{"type": "response.output_item.added", "output_index": self._index(), "item": dict(item)}]
        if item["type"] in ("message", "reasoning"):
            part = "output_text" if item["type"] == "message" else "reasoning_text"
            out.append({**self._where(), "type": "response.content_part.added", "part": self._part(part, "")})
        return out

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": self._index(), "content_index": 0}

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        return {"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})}

    def feed(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            kind = self._open["type"] if self._open is not None else None
            if e[0] in ("reasoning", "content"):
                want = "reasoning" if e[0] == "reasoning" else "message"
                if kind != want:
                    out += self.close()
                    out += self._start(
                        {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                        if want == "reasoning"
                        else {
                            "id": new_id("msg"),
                            "type": "message",
                            "role": "assistant",
                            "status": "in_progress",
                            "content": [],
                        }
                    )
                self._text += e[1]
                delta = "response.output_text.delta" if want == "message" else "response.reasoning_text.delta"
                out.append(
                    {**self._where(), "type": delta, "delta": e[1], **({"logprobs": []} if want == "message" else {})}
                )
            elif e[0] == "call":
                out += self.close()
                out += self._start(
                    {
                        "id": new_id("fc"),
                        "type": "function_call",
                        "call_id": e[2],
                        "name": e[3],
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            elif e[0] == "cut" and kind == "function_call":
                self._cut = True
            elif e[0] == "args" and kind == "function_call":
                self._text += e[2]
                out.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": self._index(),
                        "delta": e[2],
                    }
                )
        return out

    def close(self) -> list[dict]:
        """Finish the open item (if any): its done events, and the item joins ``items``."""
        item = self._open
        if item is None:
            return []
        out: list[dict] = []
        if item["type"] == "function_call":
            item = {**item, "arguments": self._text, "status": "incomplete" if self._cut else "completed"}
            out.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": self._index(),
                    "name": item["name"],
                    "arguments": self._text,
                }
            )
        else:
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = "response.output_text.done" if kind == "output_text" else "response.reasoning_text.done"
            out.append(
                {
                    **self._where(),
                    "type": done,
                    "text": self._text,
                    **({"logprobs": []} if kind == "output_text" else {}),
                }
            )
            out.append({**self._where(), "type": "response.content_part.done", "part": self._part(kind, self._text)})
            item = {**item, "content": [self._part(kind, self._text)], "status": "completed"}
        out.append({"type": "response.output_item.done", "output_index": self._index(), "item": item})
        self.items.append(item)
        self._open, self._text = None, ""
        return out


def response_object(
    req: ResponsesRequest, rid: str, created: int, model: str, output: list[dict], status: str, usage: dict | None
) -> dict:
    """OpenAI's ``response`` object."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump())
        if req.tool_choice is not None
        else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def response_usage(n_prompt: int, n_out: int, n_reasoning: int, n_cached: int) -> dict:
    return {
        "input_tokens": n_prompt,
        "input_tokens_details": {"cached_tokens": n_cached},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": n_reasoning},
        "total_tokens": n_prompt + n_out,
    }
