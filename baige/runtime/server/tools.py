"""Tool calling on /v1/chat/completions (OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, with
vLLM's behaviour): how a request's tools reach the prompt, how the output is constrained, and which stream
reads the output (:mod:`.tool_parsers`, :mod:`.tool_streams`).

- The prompt: tools go to the chat template as its ``tools`` variable (HF's convention). A template that
  ignores them (it renders the same with and without a probe tool, as SmolLM2's does) gets baige's
  *default tool prompt* instead: a system block (appended to the first system message, or a new first
  message) listing each tool as ``{"type": "function", "function": {name, description, parameters}}``
  inside ``<tools></tools>``, then the parser's call format (Hermes' ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` by default). Earlier assistant calls are then written in that format
  and ``tool`` messages become user turns ``<tool_response>\\n...\\n</tool_response>`` (Qwen2.5's
  convention). With ``tool_choice: "none"`` the tools are still rendered, as vLLM does, unless
  ``--exclude-tools-when-tool-choice-none``; nothing is parsed.
- ``"auto"`` (the default when tools are given): the parser reads what the model wrote; what is not a
  valid call stays content.
- ``"required"`` and a named function: structured outputs constrain the output to the JSON call itself,
  ``{"name": <const>, "arguments": <the tool's parameters>}`` (``required``: anyOf over the tools, a
  non-empty list of them unless ``parallel_tool_calls`` is false), which is read into ``tool_calls``.
  In the constraint, objects that declare ``properties`` and say nothing of extra ones get
  ``additionalProperties: false`` (outside ``allOf``), so the model writes the declared arguments; the
  output still validates against the tool's own schema.

Every tool's ``parameters`` must be a JSON schema (llguidance's checker, unknown keywords allowed), else
a 400 naming it; for ``required``/named the schema must also be one llguidance can enforce.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from baige.runtime.infer.structured import JSON_OPTIONS, StructuredOutputsParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from baige.runtime.server.tool_parsers import (
    PARSERS,
    ToolParser,
    loads,
    parser_for_template,
)
from baige.runtime.server.tool_streams import (
    ForcedCallStream,
    PlainStream,
    ToolCallStream,
)

TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{instructions}"""

_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "baige_probe", "description": "Probe.", "parameters": {"type": "object", "properties": {}}},
}


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool-calling settings (``baige serve`` flags, and what the chat template does)."""

    parser: type[ToolParser]
    template_renders_tools: bool
    exclude_tools_when_tool_choice_none: bool = False
    enable_auto_tool_choice: bool = True


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes the ``tools`` it is given: a probe conversation renders
    differently with a tool than without. A template that fails on the probe with tools ignores them."""
    if not tokenizer.has_chat_template:
        return False
    try:
        plain = tokenizer.render_chat_template(_PROBE_MESSAGES, True)
    except Exception:  # the template refuses the probe itself (user code): let it see tools
        return True
    try:
        return tokenizer.render_chat_template(_PROBE_MESSAGES, True, tools=[_PROBE_TOOL]) != plain
    except Exception:
        return False


def tool_config(
    tokenizer: Tokenizer, tool_call_parser: str = "auto", exclude_none: bool = False, enable_auto: bool = True
) -> ToolConfig:
    """The settings for a tokenizer's chat template; ``tool_call_parser`` is ``auto`` or a key of PARSERS."""
    parser = parser_for_template(tokenizer.chat_template) if tool_call_parser == "auto" else PARSERS[tool_call_parser]
    return ToolConfig(parser, template_renders_tools(tokenizer), exclude_none, enable_auto)


# ---- schemas ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _schema_error(schema_json: str, lenient: bool) -> str:
    """llguidance's complaint about a JSON schema ('' when none); lenient: unknown keywords are fine."""
    from llguidance import LLMatcher

    schema = json.loads(schema_json)
    if lenient:
        schema = {**schema, "x-guidance": {"lenient": True}}
    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except ValueError as e:
        return str(e)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
)


def _enforced(node: Any, ref_root: str, close: bool = True) -> Any:
    """A tool's schema as it sits in the forced-call constraint: local ``$ref``s re-rooted under
    ``ref_root`` (its place in ``$defs``) and, where ``close``, objects with ``properties`` closed."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = ref_root + value[1:]
        elif key in _SUB_MAPS and isinstance(value, dict):
            out[key] = {k: _enforced(v, ref_root, close) for k, v in value.items()}
        elif key in _SUB_LISTS and isinstance(value, list):
            out[key] = [_enforced(v, ref_root, close and key != "allOf") for v in value]
        elif key in _SUB_ONE:
            out[key] = _enforced(value, ref_root, close)
        else:
            out[key] = value
    if (
        close
        and isinstance(out.get("properties"), dict)
        and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys()
    ):
        out["additionalProperties"] = False
    return out


def _call_schema(k: int, name: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{k}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_constraint(
    req: ChatCompletionRequest, names: list[str], max_calls: int | None = None
) -> tuple[StructuredOutputsParams, bool]:
    """The structured-output constraint for ``tool_choice`` "required" / named, and whether the output
    is a list of calls (of at most ``max_calls``; 1: one call, not a list). Raises APIError (400) for a
    tool schema llguidance cannot enforce."""
    tools = {t.function.name: (k, t) for k, t in enumerate(req.tools)}
    defs = {}
    for name in names:
        k, tool = tools[name]
        params = (
            tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}
        )
        defs[f"tool{k}"] = _enforced(params, f"#/$defs/tool{k}")
        alone = {"$defs": {f"tool{k}": defs[f"tool{k}"]}, "$ref": f"#/$defs/tool{k}"}
        error = _schema_error(json.dumps(alone, sort_keys=True), False)
        if error:
            raise APIError(
                f"tools[{k}].function.parameters: tool_choice {_choice_name(req)} cannot enforce this "
                f"schema ({_one_line(error)})",
                param="tools",
            )
    calls = [_call_schema(tools[n][0], n) for n in names]
    array = req.tool_choice == "required" and req.parallel_tool_calls is not False and max_calls != 1
    if array:
        schema = {"$defs": defs, "type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if max_calls is not None:
            schema["maxItems"] = max_calls
    else:
        schema = {"$defs": defs, "anyOf": calls} if len(calls) > 1 else {"$defs": defs, **calls[0]}
    return StructuredOutputsParams(json=schema), array


def _choice_name(req: ChatCompletionRequest) -> str:
    return json.dumps(req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.function.name)


# ---- the request's plan -------------------------------------------------------------------------
@dataclass
class ToolPlan:
    """What the chat route does with a request's tools: the messages and template variables to render,
    the constraint for ``required``/named, and the stream that reads each output."""

    messages: list[dict]
    template_vars: dict
    mode: str  # plain | auto | forced
    parser: type[ToolParser]
    tool_names: tuple[str, ...] = ()
    constraint: StructuredOutputsParams | None = None
    array: bool = False
    max_calls: int | None = None
    keep_special_tokens: bool = False

    def stream(self) -> PlainStream | ToolCallStream | ForcedCallStream:
        """A fresh reader for one output (one per choice)."""
        if self.mode == "auto":
            return ToolCallStream(self.parser(self.tool_names), self.max_calls)
        if self.mode == "forced":
            return ForcedCallStream(self.array, self.parser.new_id)
        return PlainStream()


def resolve_tool_choice(req: ChatCompletionRequest, cfg: ToolConfig) -> str | None:
    """``"none"``, ``"auto"``, ``"required"``, or None for a named function, after vLLM's rules: no
    tool_choice means auto with tools and none without; a tool_choice other than none needs tools
    (``"auto"``/``"required"`` with ``tools: []`` are none). Raises APIError (400)."""
    choice, tools = req.tool_choice, req.tools
    if choice is None:
        choice = "auto" if tools else "none"
    if tools == [] and choice in ("auto", "required"):
        choice = "none"
    if choice != "none" and tools is None:
        raise APIError('a tool_choice other than "none" needs tools', param="tool_choice")
    if isinstance(choice, str):
        if choice == "auto" and not cfg.enable_auto_tool_choice:
            raise APIError(
                'tool_choice "auto" is off on this server (--no-enable-auto-tool-choice); use "none", '
                '"required" or a named function',
                param="tool_choice",
            )
        return choice
    if choice.function.name not in {t.function.name for t in tools}:
        raise APIError(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools", param="tool_choice"
        )
    return None


def check_tools(req: ChatCompletionRequest) -> None:
    """Distinct names, and every ``parameters`` a JSON schema. Raises APIError (400) naming the tool."""
    seen: set[str] = set()
    for k, tool in enumerate(req.tools or []):
        f = tool.function
        if f.name in seen:
            raise APIError(f"tools[{k}].function.name: {f.name!r} is declared twice", param="tools")
        seen.add(f.name)
        if f.parameters is not None:
            error = _schema_error(json.dumps(f.parameters, sort_keys=True), True)
            if error:
                raise APIError(
                    f"tools[{k}].function.parameters is not a valid JSON schema ({_one_line(error)})", param="tools"
                )


def plan_tools(req: ChatCompletionRequest, cfg: ToolConfig, max_calls: int | None = None) -> ToolPlan:
    """The :class:`ToolPlan` of a chat request; ``max_calls`` (the Responses API's ``max_tool_calls``) caps
    the calls of one output: ``auto`` drops later ones, ``required`` constrains the list's length. Raises
    APIError (400) for bad tools, tool_choice or tool messages, and for ``required``/named beside
    ``response_format``/``structured_outputs``."""
    check_tools(req)
    choice = resolve_tool_choice(req, cfg)
    tools = req.tools or []
    offered = bool(tools) and not (choice == "none" and cfg.exclude_tools_when_tool_choice_none)
    default_prompt = not cfg.template_renders_tools
    messages = conversation(req.messages, cfg.parser, default_prompt)
    template_vars: dict = {}
    if offered:
        specs = [t.model_dump(exclude_none=True) for t in tools]
        if default_prompt:
            messages = with_tool_prompt(messages, specs, cfg.parser)
        else:
            template_vars["tools"] = specs
    names = tuple(t.function.name for t in tools)
    plan = ToolPlan(messages, template_vars, "plain", cfg.parser, names)
    if choice == "none":
        return plan
    plan.keep_special_tokens = cfg.parser.keep_special_tokens
    if choice == "auto":
        plan.mode, plan.max_calls = "auto", (1 if req.parallel_tool_calls is False else max_calls)
        return plan
    if req.constraint() is not None:
        raise APIError(
            f"tool_choice {_choice_name(req)} constrains the output itself; it cannot be combined "
            "with response_format or structured_outputs",
            param="tool_choice",
        )
    forced = list(names) if choice == "required" else [req.tool_choice.function.name]
    plan.constraint, plan.array = forced_constraint(req, forced, max_calls)
    plan.mode = "forced"
    return plan


# ---- messages -----------------------------------------------------------------------------------
def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""


def _call_arguments(k: int, j: int, text: str) -> Any:
    try:
        return loads(text)
    except ValueError:
        raise APIError(
            f"messages[{k}].tool_calls[{j}].function.arguments is not valid JSON", param="messages"
        ) from None


def conversation(msgs: list[ChatMessage], parser: type[ToolParser], default_prompt: bool) -> list[dict]:
    """The request's messages as the chat template takes them: text parts joined, call arguments as
    objects (HF templates ``tojson`` them). With ``default_prompt`` (the template ignores tools) calls are
    written in the parser's format and tool results become ``<tool_response>`` user turns."""
    out: list[dict] = []
    responses = False  # the last message is a user turn of tool responses (consecutive ones join it)
    for k, m in enumerate(msgs):
        msg = {**(m.model_extra or {}), "role": m.role, "content": _text(m.content)}
        calls = [
            (c.id, c.function.name, _call_arguments(k, j, c.function.arguments))
            for j, c in enumerate(m.tool_calls or [])
        ]
        if default_prompt and m.role == "tool":
            response = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            responses = True
            continue
        responses = False
        if default_prompt and calls:
            rendered = parser.render([(n, a) for _, n, a in calls])
            msg["content"] = f"{msg['content']}\n{rendered}" if msg["content"] else rendered
        elif calls:
            msg["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
            ]
        if m.tool_call_id is not None and not default_prompt:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def with_tool_prompt(messages: list[dict], specs: list[dict], parser: type[ToolParser]) -> list[dict]:
    """``messages`` with the default tool prompt in the first system message (a new one if none)."""
    block = TOOL_PROMPT.format(
        tools="\n".join(json.dumps(s, ensure_ascii=False) for s in specs), instructions=parser.instructions
    )
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{block}" if messages[0]["content"] else block)
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
