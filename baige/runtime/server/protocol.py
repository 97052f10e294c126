"""The OpenAI API's request schemas (pydantic) and error shape.

Request fields follow OpenAI's API reference; the vLLM extensions top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos and skip_special_tokens are accepted too. Every error is
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# ---- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """A request error with its HTTP status (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# ---- request schemas ----------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One line for the first problem pydantic found, and the top-level field it concerns."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    first = str(err["loc"][0]) if err["loc"] else None
    return (f"{loc}: {err['msg']}" if loc else err["msg"]), first
