"""The request schema of ``POST /v1/responses`` (OpenAI's Responses API, pydantic, strict) and its limits.

Input items: a message (``{"role", "content"}``, ``"type": "message"`` optional; content a string or
``input_text`` / ``output_text`` parts), ``function_call``, ``function_call_output`` and ``reasoning``
(accepted and left out of the prompt, as chat templates drop earlier reasoning). Any other item type, a
non-text content part (images, files, audio) and OpenAI's built-in tools (web search, file search,
computer use, code interpreter, ...) are a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from baige.runtime.infer.sampling_params import SEED_MAX, SEED_MIN
from baige.runtime.server.protocol import MAX_DESCRIPTION, MAX_ID_LEN, MAX_TOOLS, ToolName, _Strict

MAX_INPUT_ITEMS = 4096  # items of one request's ``input``
MAX_METADATA = 16  # metadata entries (OpenAI's limit), keys <= 64 and values <= 512 characters
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer_use",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)


# OpenAI's ``include`` values this server accepts: ``reasoning.encrypted_content`` (what stateless clients such as
# Codex CLI send with ``store: false`` to get the reasoning back for the next request): the reasoning items carry
# their text in ``content`` and no ``encrypted_content``, so sending them back as input continues the conversation
INCLUDE_SERVED = ("reasoning.encrypted_content",)
# the others, and why none can be honoured here (each is a 400 naming it, never ignored)
INCLUDE_NOT_SERVED = {
    "code_interpreter_call.outputs": "built-in tools are not served",
    "computer_call_output.output.image_url": "built-in tools are not served",
    "file_search_call.results": "built-in tools are not served",
    "web_search_call.action.sources": "built-in tools are not served",
    "web_search_call.results": "built-in tools are not served",
    "message.input_image.image_url": "image inputs are not served",
    "message.output_text.logprobs": "logprobs are not served on /v1/responses; use /v1/chat/completions for them",
}

NOT_SERVED = {
    "conversation": "conversations (OpenAI's Conversations API) are not served; continue with previous_response_id",
    "prompt": "stored prompt templates are not served; send the prompt's text as input or instructions",
    "top_logprobs": "logprobs are not served on /v1/responses; use /v1/chat/completions for them",
}


class TextContent(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = Field(None, max_length=MAX_ID_LEN)
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for k, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("input_text", "output_text", "text"):
                raise ValueError(f"content[{k}]: {kind[:40]!r} parts are not supported (text only)")
        return v


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LEN)
    name: ToolName
    arguments: str
    id: str | None = Field(None, max_length=MAX_ID_LEN)
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LEN)
    output: str
    id: str | None = Field(None, max_length=MAX_ID_LEN)
    status: str | None = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=MAX_ID_LEN)
    summary: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_INPUT_ITEMS)
    content: list[dict[str, Any]] | None = Field(None, max_length=MAX_INPUT_ITEMS)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


class FunctionTool(_Strict):
    """OpenAI's Responses function tool (flat: name, description and parameters beside ``type``)."""

    type: Literal["function"]
    name: ToolName
    description: str | None = Field(None, max_length=MAX_DESCRIPTION)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(_Strict):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=256)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfigField(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. ``background``, ``truncation: "auto"``, ``conversation``, ``prompt``,
    ``top_logprobs`` and the ``include`` values of INCLUDE_NOT_SERVED are refused (not served), not ignored."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfigField | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=MAX_ID_LEN)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=MAX_METADATA)
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    include: list[str] | None = Field(None, max_length=16)  # INCLUDE_SERVED pass, INCLUDE_NOT_SERVED are refused
    max_tool_calls: int | None = Field(None, ge=1)  # function calls in the response (plan_tools caps them)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # vLLM's extra (64-bit, as the chat route's)
    # OpenAI's fields for what this server does not keep or compute: a non-empty value is a 400
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None

    @field_validator("conversation", "prompt", "top_logprobs")
    @classmethod
    def _not_served(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or (info.field_name == "top_logprobs" and v == 0):
            return v
        raise ValueError(NOT_SERVED[info.field_name])

    @field_validator("include")
    @classmethod
    def _includable(cls, v: list[str] | None) -> list[str] | None:
        for k, value in enumerate(v or []):
            if value in INCLUDE_SERVED:
                continue
            why = INCLUDE_NOT_SERVED.get(value)
            if why is None:
                raise ValueError(f"[{k}]: {value[:60]!r} is not one of OpenAI's include values")
            raise ValueError(f"[{k}]: {value!r} cannot be included ({why})")
        return v

    @field_validator("previous_response_id")
    @classmethod
    def _id_not_empty(cls, v: str | None) -> str | None:
        if v == "":  # not "no previous response": a client bug that would drop the conversation
            raise ValueError("previous_response_id is empty; leave it out or give a stored response's id")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for k, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                what = "built-in tool" if kind in BUILT_IN_TOOLS else "tool type"
                raise ValueError(f"[{k}]: the {what} {kind[:40]!r} is not supported (function tools only)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] != "function":
            raise ValueError(f"the built-in tool {v['type'][:40]!r} is not supported (function tools only)")
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, v: Any) -> Any:
        """Messages may leave out ``"type": "message"`` (OpenAI's easy input messages); an unknown item
        type is named."""
        if not isinstance(v, list):
            return v
        out = []
        for k, item in enumerate(v):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise ValueError(f"[{k}].type: {kind[:40]!r} items are not supported (one of {', '.join(ITEM_TYPES)})")
            out.append(item)
        return out
