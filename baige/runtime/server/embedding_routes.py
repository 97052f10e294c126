"""``/v1/embeddings`` (OpenAI's Embeddings API, vLLM's pooling runner): one input or a batch (text or
token ids), each pooled by the engine (``infer/pooling.py``) beside the other requests, ``dimensions``
(Matryoshka truncation, where the model declares it), ``encoding_format`` float or base64; vLLM's
``normalize``, ``add_special_tokens`` and ``truncate_prompt_tokens``.

Limits: at most :data:`MAX_EMBEDDING_INPUTS` inputs per request (OpenAI's), each non-empty and at most
``max_model_len`` tokens, ``truncate_prompt_tokens`` at most ``max_model_len`` (vLLM's rule); the body size
limit (``--max-request-bytes``) bounds the rest. vLLM's chat-style form (``messages``) is refused by name.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from baige.errors import BaigeError
from baige.runtime.infer.outputs import EmbeddingRequestOutput
from baige.runtime.infer.pooling import PoolingParams
from baige.runtime.server.protocol import APIError, TokenId, _Strict
from baige.runtime.server.serving import ServerState, collect, parse, state_of

router = APIRouter()

MAX_EMBEDDING_INPUTS = 2048  # inputs one request may embed (OpenAI's limit)


IdList = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request (vLLM's ``EmbeddingCompletionRequest`` fields that apply)."""

    model: str | None = None
    # vLLM's chat-style embedding request: refused by name (declared before input, so its error is the
    # one reported when input is missing too)
    messages: list | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[IdList], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)
    # vLLM extensions
    normalize: bool | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k tokens; -1: max_model_len

    @field_validator("messages")
    @classmethod
    def _no_messages(cls, v: list | None) -> list | None:
        if v is not None:
            raise ValueError("chat-style embedding requests are not served; send the text as input")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context) or at least 1")
        return v


def embedding_inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs as a list: one text, texts, one token-id list, or token-id lists."""
    x = req.input
    if isinstance(x, str) or (x and isinstance(x[0], int)):
        return [x]
    return list(x)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """The embedding as OpenAI sends it: floats, or base64 of little-endian float32 bytes (what the
    ``openai`` client asks for by default and decodes)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def _prepared(st: ServerState, req: EmbeddingRequest, params: PoolingParams) -> list[list[int]]:
    """Every input's token ids (``truncate_prompt_tokens``: its last that many), validated before anything
    is queued (off the event loop). Raises APIError naming ``input`` (or ``dimensions``)."""
    inputs = embedding_inputs(req)
    keep = st.engine.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens

    def run() -> list[list[int]]:
        out = []
        for k, x in enumerate(inputs):
            try:
                if isinstance(x, str):
                    if len(x) > st.engine.max_prompt_chars:
                        raise BaigeError(f"the input is far longer than {st.engine.max_model_len} tokens")
                    x = st.tokenizer.encode(x, add_special_tokens=req.add_special_tokens) if x else []
                if keep is not None:
                    x = x[-keep:]
                out.append(st.engine.prepare_pooling(x, params))
            except BaigeError as e:
                where = f"input[{k}]: " if len(inputs) > 1 and e.param is None else ""
                raise APIError(f"{where}{e}", param=e.param or "input") from None
        return out

    return await asyncio.to_thread(run)


async def _one(st: ServerState, ids: list[int], params: PoolingParams) -> AsyncIterator[EmbeddingRequestOutput]:
    yield await st.engine.embed(ids, params)


@router.post("/v1/embeddings", response_model=None)
async def embeddings(request: Request) -> Response | dict:
    """Embed the inputs; OpenAI's ``list`` of ``embedding`` objects in input order, with ``usage``."""
    req: EmbeddingRequest = await parse(request, EmbeddingRequest)
    st = state_of(request)
    if not st.engine.is_pooling:
        raise APIError(
            "this model runs the generate runner and does not serve embeddings; start the server with --runner pooling",
            param="model",
        )
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > st.engine.max_model_len:
        raise APIError(
            f"truncate_prompt_tokens ({req.truncate_prompt_tokens}) is larger than max_model_len "
            f"({st.engine.max_model_len}); give at most that, or -1 for the whole context",
            param="truncate_prompt_tokens",
        )
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    jobs = await _prepared(st, req, params)
    outs = await collect(request, [_one(st, ids, params) for ids in jobs])
    if outs is None:
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    n = sum(len(ids) for ids in jobs)
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model or st.served_model_name,
        "data": [
            {"index": k, "object": "embedding", "embedding": encode(o.outputs.embedding, req.encoding_format)}
            for k, o in enumerate(outs)
        ],
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
