"""``/tokenize`` and ``/detokenize`` (vLLM's shapes): a prompt, or chat messages rendered exactly as
``/v1/chat/completions`` renders them (chat template, tools), to token ids; token ids back to text.

Limits: a prompt or conversation of at most ``Engine.max_prompt_chars`` characters (the completion and
chat routes' rule), at most ``max_model_len`` token ids to detokenize, each inside the vocabulary.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from baige.runtime.server.chat import chat_prompt, check_chat_size
from baige.runtime.server.protocol import (
    APIError,
    ChatCompletionRequest,
    TokenId,
    _Strict,
    parse_body,
    validation_message,
)
from baige.runtime.server.serving import ServerState, state_of, validated
from baige.runtime.server.tools import plan_tools

router = APIRouter()


class TokenizeCompletionRequest(_Strict):
    """vLLM's ``TokenizeCompletionRequest``."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's ``TokenizeChatRequest``: the chat request's messages and tools, and how to render them.
    The ids are those ``/v1/chat/completions`` would prefill (BOS once where the tokenizer adds one), so
    ``add_special_tokens`` (vLLM's default False) adds nothing further."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


def _check_model(st: ServerState, model: str | None) -> None:
    st.lora_request(model)  # 404 for a model name this server does not serve


async def _chat_ids(st: ServerState, req: TokenizeChatRequest) -> list[int]:
    """The conversation's token ids as the chat route renders it. Raises APIError (400)."""
    if req.continue_final_message:
        raise APIError("continue_final_message is not supported", param="continue_final_message")
    check_chat_size(st, req)
    plan = await asyncio.to_thread(plan_tools, req, st.tools)
    return await chat_prompt(st, plan, req.chat_template_kwargs, req.add_generation_prompt)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    """``{"prompt": ...}`` or ``{"messages": [...]}`` (exactly one: both is a 400) ->
    ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    st = state_of(request)
    raw = parse_body(await request.body())
    if raw.get("prompt") is not None and raw.get("messages") is not None:
        raise APIError("give exactly one of prompt and messages, not both", param="messages")
    schema = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
    try:
        req = schema.model_validate(raw)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(msg, param=param) from None
    _check_model(st, req.model)
    if isinstance(req, TokenizeChatRequest):
        ids = await _chat_ids(st, req)
    else:
        if len(req.prompt) > st.engine.max_prompt_chars:
            raise APIError(
                f"the prompt has {len(req.prompt)} characters, more than the {st.engine.max_prompt_chars} allowed",
                param="prompt",
            )
        ids = await asyncio.to_thread(st.tokenizer.encode, req.prompt, req.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": st.engine.max_model_len,
        "tokens": ids,
        "token_strs": st.tokenizer.id_to_tokens(ids) if req.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    """``{"tokens": [...]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM's)."""
    st = state_of(request)
    req: DetokenizeRequest = await validated(request, DetokenizeRequest)
    _check_model(st, req.model)
    if len(req.tokens) > st.engine.max_model_len:
        raise APIError(f"{len(req.tokens)} tokens, more than max_model_len ({st.engine.max_model_len})", param="tokens")
    vocab = st.tokenizer.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(st.tokenizer.decode, req.tokens, False)
    return {"prompt": text}
