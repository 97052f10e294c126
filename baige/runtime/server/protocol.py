"""The OpenAI API's request schemas (pydantic) and error shape.

Request fields follow OpenAI's API reference; the vLLM extensions top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos and skip_special_tokens are accepted too. Every error is
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from baige.errors import BaigeError
from baige.runtime.infer.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
)

MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a request body
MAX_TOKEN_ID = 2**31 - 1  # token ids beyond int32 are refused by type; the engine checks the vocabulary


# ---- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """A request error with its HTTP status (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object: valid UTF-8 JSON, nested at most MAX_JSON_DEPTH deep,
    every string valid Unicode (no lone surrogates from ``\\ud800`` escapes), no integer literal past
    Python's int-from-text limit (4300 digits). Python's parser takes NaN and Infinity; the schemas
    refuse them. Raises APIError (400) naming the problem."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer literal longer than Python's int-from-text limit (sys.get_int_max_str_digits)
        raise APIError(f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    """Walk the parsed body iteratively: depth and string validity (keys included)."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            path = f"{where}.{key}" if where else str(key)
            for s in (key, value):
                if isinstance(s, str):
                    _check_unicode(s, path)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, path))


def _check_unicode(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            f"{where}: not valid Unicode (a lone surrogate at character {e.start})", param=where.split(".")[0]
        ) from None


# ---- request schemas ----------------------------------------------------------------------------
class _Strict(BaseModel):
    # strict: no coercion ("1" is not 1); NaN and +-Infinity are refused for every float
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(max_length=MAX_STOP_LEN)]


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field("schema", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` extra field (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


class SamplingFields(_Strict):
    """The sampling fields both endpoints share; ranges by the field's meaning (OpenAI's, vLLM's).
    ``n`` is further bounded by ``--max-n`` and ``max_tokens`` by the context (the routes check)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM extensions
    top_k: int = Field(0, ge=-1)  # -1 or 0: off; at most the vocabulary size (the engine checks)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's P/D disaggregation fields (do_remote_decode to a producer, the producer's answer to a
    # consumer); checked by the engine (baige/runtime/infer/kv_transfer/manager.py)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # vLLM's rule: a non-empty stream_options needs stream true (an empty {} passes, as vLLM's truthiness test)
        if v is not None and v.model_fields_set and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def constraint(self):
        """The request's :class:`StructuredOutputsParams` (None: free), from ``response_format`` or
        ``structured_outputs``. Raises APIError when both are given or one is incomplete."""
        from baige.runtime.infer.structured import StructuredOutputsParams

        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise APIError("give response_format or structured_outputs, not both", param="response_format")
        try:
            if so is not None:
                return StructuredOutputsParams(
                    json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object
                )
            if rf is None or rf.type == "text":
                return None
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        except BaigeError as e:
            raise APIError(str(e), param="structured_outputs" if so is not None else "response_format") from None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids as strings, OpenAI's form) as ints. Raises APIError."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            # ASCII digits only: str.isdigit() is also true of '²' and other Unicode digits int() refuses
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
                raise APIError(f"logit_bias: key {key[:40]!r} is not a token id", param="logit_bias")
            out[int(key)] = bias
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None  # OpenAI's insertion mode: refused (as vLLM does), not silently ignored
    best_of: int | None = Field(None, ge=1)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"best_of is not supported (only best_of == n, here {n}); ask for n completions")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# ---- tools (OpenAI's function tools; vLLM's tool_choice semantics: baige.runtime.server.tools) -------------
MAX_TOOLS = 128  # functions one request may declare (OpenAI's limit)
MAX_TOOL_CALLS = 128  # calls one assistant message may carry
MAX_DESCRIPTION = 32768  # characters of a function's description
MAX_ID_LEN = 256  # characters of a tool call id
MAX_TEMPLATE_KWARGS = 64  # entries of chat_template_kwargs
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for function names


class FunctionDefinition(_Strict):
    name: ToolName
    description: str | None = Field(None, max_length=MAX_DESCRIPTION)
    parameters: dict[str, Any] | None = None  # a JSON schema (checked when the request is planned)
    strict: bool | None = None


class ChatCompletionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str = Field(max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCallField(_Strict):
    name: str = Field(max_length=64)
    arguments: str  # JSON text (OpenAI's shape); parsed when the conversation is rendered


class ToolCallField(_Strict):
    id: str = Field(min_length=1, max_length=MAX_ID_LEN)
    type: Literal["function"] = "function"
    function: FunctionCallField


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCallField], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_ID_LEN)

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role[:20]!r}")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ChatCompletionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default)
    # vLLM's: further chat-template variables (enable_thinking, ...), and whether to return the reasoning
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    include_reasoning: bool = True


# pydantic's names for the members of a union in an error's location ("str", "list[TextPart]",
# "NamedToolChoice", "literal['none','auto']"): not field names, left out of the message
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-\w+\[.*\]|[A-Z]\w*)$")


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One line for the problem pydantic found deepest in the body (for a union, the member that
    matched the input furthest: a content part missing ``text`` names ``text``), and the top-level
    field it concerns."""
    errors = e.errors()
    # a list of the wrong length matched a list member of the union: its count is the problem, not
    # the other members' complaints ("should be a valid string", its items "should be integers")
    counts = [x for x in errors if x["type"] in ("too_long", "too_short")]
    err = max(counts or errors, key=lambda x: len([p for p in x["loc"] if not _UNION_TAG.match(str(p))]))
    loc = ".".join(str(x) for x in err["loc"] if not _UNION_TAG.match(str(x)))[:200]
    first = str(err["loc"][0]) if err["loc"] else None
    msg = _count_message(err) or err["msg"][:300]
    return (f"{loc}: {msg}" if loc else msg), first


def _count_message(err: dict) -> str | None:
    """A list-length error in words: too many items (with the limit), or an empty list."""
    ctx, n = err.get("ctx") or {}, err.get("input")
    n = len(n) if isinstance(n, list | dict) else ctx.get("actual_length")
    if err["type"] == "too_long" and "max_length" in ctx:
        return f"too many items ({n}; at most {ctx['max_length']})"
    if err["type"] == "too_short" and "min_length" in ctx:
        return "the list is empty" if n == 0 else f"too few items ({n}; at least {ctx['min_length']})"
    return None
