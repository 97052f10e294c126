"""The chat pipeline that ``/v1/chat/completions`` and ``/v1/responses`` share: the size check, the tool
plan (:mod:`.tools`), the chat template (with the request's ``chat_template_kwargs``), the reasoning
parser's set-up (:mod:`.reasoning`), the engine's parameters, and the reader of each output."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.server.protocol import APIError, ChatCompletionRequest
from baige.runtime.server.reasoning import AnswerStream
from baige.runtime.server.serving import ServerState, prepared
from baige.runtime.server.tools import ToolPlan, plan_tools

RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt")  # the renderer's own arguments


def check_chat_size(st: ServerState, req: ChatCompletionRequest) -> None:
    """Refuse, before rendering or tokenizing anything, a conversation whose text (messages, tool
    calls, tools) is longer than ``Engine.max_prompt_chars``, the rule ``Engine.prepare`` applies to a
    completion prompt. Raises APIError (400)."""
    limit = st.engine.max_prompt_chars
    chars = 0
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        chars += (
            len(content)
            + len(m.role)
            + sum(len(c.function.arguments) + len(c.function.name) for c in m.tool_calls or [])
        )
    if chars <= limit and req.tools:
        chars += len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools]))
    if chars > limit:
        raise APIError(
            f"this model's maximum context length is {st.engine.max_model_len} tokens; the conversation "
            f"has {chars} characters, far more than that many tokens can hold",
            param="messages",
        )


async def chat_prompt(
    st: ServerState, plan: ToolPlan, template_kwargs: dict | None = None, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of the rendered conversation (off the event loop); ``template_kwargs`` are further
    template variables (``enable_thinking``, ...). Raises APIError (400)."""
    extra = dict(template_kwargs or {})
    bad = next((k for k in extra if k in RESERVED_TEMPLATE_VARS), None)
    if bad is not None:
        raise APIError(f"chat_template_kwargs: {bad!r} is the renderer's own argument", param="chat_template_kwargs")
    extra.update(plan.template_vars)
    try:
        return await asyncio.to_thread(
            st.tokenizer.apply_chat_template, plan.messages, add_generation_prompt=add_generation_prompt, **extra
        )
    except BaigeError as e:
        raise APIError(str(e), param="messages") from None
    except Exception as e:  # the template met message fields it cannot render (jinja2 type errors)
        raise APIError(
            f"messages: the chat template cannot render them ({type(e).__name__}: {str(e)[:200]})", param="messages"
        ) from None


def finish_reason(o, reader) -> str | None:
    """``tool_calls`` when the output called tools and ended normally (a cut-off call keeps ``length``)."""
    return "tool_calls" if reader.calls and o.finish_reason == "stop" else o.finish_reason


@dataclass
class ChatJob:
    """A chat request ready for the engine: prompt ids, parameters, and the reader of each output."""

    ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    include_reasoning: bool
    st: ServerState

    def reader(self) -> AnswerStream:
        """A fresh reader for one output (one per choice)."""
        cfg = self.st.reasoning
        split = None if cfg is None else cfg.stream(self.ids, frozenset(self.plan.tool_names))
        return AnswerStream(split, self.plan.stream(), self.include_reasoning)


def with_reasoning(
    st: ServerState, ids: list[int], params: SamplingParams, field: str = "response_format"
) -> SamplingParams:
    """``params`` for the server's reasoning parser: its markers decoded, and a constraint deferred to
    the end of the reasoning when the output starts inside it. Raises APIError (400) for a constraint
    that the parser cannot place (gpt_oss: its answer starts after several tokens), naming ``field``."""
    cfg = st.reasoning
    if cfg is None:
        return params
    if cfg.keep_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    if params.structured_outputs is not None and cfg.starts_in_reasoning(ids) is not False:
        if cfg.end_id is None:
            raise APIError(
                f"the {cfg.name} reasoning parser cannot constrain the answer (its reasoning does not end at "
                "one token); drop response_format / structured_outputs / a forced tool_choice",
                param=field,
            )
        opens = cfg.start_id if cfg.starts_in_reasoning(ids) is None else None  # qwen3: the first token decides
        params = dataclasses.replace(params, reasoning_end_token_id=cfg.end_id, reasoning_start_token_id=opens)
    return params


async def prepare_chat(
    st: ServerState,
    req: ChatCompletionRequest,
    params: SamplingParams,
    include_reasoning: bool = True,
    max_tool_calls: int | None = None,
) -> ChatJob:
    """Plan the tools (at most ``max_tool_calls`` calls per output: :func:`.tools.plan_tools`), render and
    tokenize the conversation, and validate it with ``params`` (a forced tool call's constraint, special
    tokens the tool and reasoning parsers need). Raises APIError (400; under the pooling runner before
    anything is rendered: its model may have no chat template, and that is not the problem)."""
    if st.engine.is_pooling:
        raise APIError(
            "this model runs the pooling runner (--runner pooling): it embeds (/v1/embeddings), it does not "
            "generate; chat and responses need --runner generate",
            param="model",
        )
    check_chat_size(st, req)
    # tool schemas are checked by llguidance
    plan = await asyncio.to_thread(plan_tools, req, st.tools, max_tool_calls)
    if plan.constraint is not None:
        params = dataclasses.replace(params, structured_outputs=plan.constraint)
    if plan.keep_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    ids = await chat_prompt(st, plan, req.chat_template_kwargs)
    params = with_reasoning(st, ids, params, "tool_choice" if plan.constraint is not None else "response_format")
    ((ids, params),) = await prepared(st, [ids], params, req)
    return ChatJob(ids, params, plan, include_reasoning, st)
