"""Reasoning parsers (``baige serve --reasoning-parser``, vLLM's names): a reasoning model's output split
into its reasoning and its answer, whole or as it streams.

- ``qwen3`` (Qwen3, QwQ): ``<think>REASONING</think>ANSWER``. The output reasons when its first token is
  ``<think>``, or when the prompt left a ``<think>`` open (a template that writes it into the generation
  prompt); a prompt that already closed it (``enable_thinking: false``, whose template writes
  ``<think>\\n\\n</think>\\n\\n``) gives an answer only.
- ``deepseek_r1`` (DeepSeek-R1 and its distills): the same markers, but the output reasons from its first
  token unless the prompt closed the reasoning (R1's template opens ``<think>`` in the prompt; the
  model may also write it), as vLLM's parser assumes.
- ``gpt_oss`` (OpenAI's harmony format): ``<|channel|>analysis<|message|>REASONING<|end|>`` then
  ``<|start|>assistant<|channel|>final<|message|>ANSWER``; a ``commentary`` message addressed
  ``to=functions.NAME`` is a tool call whose arguments are its body (:class:`HarmonyStream`).
- ``auto``: from the chat template: harmony's ``<|channel|>`` -> gpt_oss; ``<think>`` with DeepSeek's
  ``<｜Assistant｜>`` -> deepseek_r1; ``<think>`` otherwise -> qwen3; no marker -> no parser.

The split is decided on token ids: the markers must be single tokens of the vocabulary, and the reasoning
ends where the ``</think>`` *token* was generated (the same text spelled from smaller tokens is text).
The text is cut at the marker's text, which requests decode even where the marker is a special token
(``keep_special_tokens``), so a marker split across stream chunks, or held back by a stop string, is still
cut whole. Reasoning is the text between the markers, the answer the text after the end marker, both
exactly as generated. With a structured-output constraint the engine masks only the answer (the
constraint engages after ``</think>``; :class:`~baige.runtime.infer.sampling.SamplingParams`'s
``reasoning_end_token_id``).

Events: ``("reasoning", text)`` besides :mod:`.tool_streams`' ``("content", text)`` and call events.
"""

from __future__ import annotations

from dataclasses import dataclass

from baige.errors import BaigeError
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.server.tool_parsers import ToolParser
from baige.runtime.server.tool_streams import Event

PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")
THINK, END_THINK = "<think>", "</think>"
HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"


@dataclass(frozen=True)
class ReasoningConfig:
    """The server's reasoning parser: its name, its markers' token ids, and whether requests must decode
    special tokens to see them."""

    name: str
    start_id: int | None = None  # <think> (qwen3, deepseek_r1)
    end_id: int | None = None  # </think>: the constraint engages after it
    keep_special_tokens: bool = False

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool | None:
        """Whether the output begins inside the reasoning: the last marker of the prompt decides (an open
        ``<think>``: yes, a closed one: no); with neither, deepseek_r1 says yes and qwen3 None (the
        output's first token decides)."""
        for t in reversed(prompt_ids):
            if t == self.start_id:
                return True
            if t == self.end_id:
                return False
        return True if self.name == "deepseek_r1" else None

    def stream(self, prompt_ids: list[int], tools: frozenset[str] = frozenset()) -> ThinkStream | HarmonyStream:
        """A fresh reader of one output (one per choice). ``tools``: names a harmony call may address."""
        if self.name == "gpt_oss":
            return HarmonyStream(tools)
        return ThinkStream(self, self.starts_in_reasoning(prompt_ids))


def _single_token(tokenizer: Tokenizer, text: str, flag: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != text:  # not an unknown-token stand-in
        raise BaigeError(f"--reasoning-parser {flag}: {text!r} is not one token of this model's vocabulary")
    return ids[0]


def _is_special(tokenizer: Tokenizer, token_id: int) -> bool:
    return tokenizer.decode([token_id], skip_special_tokens=True) == ""


def detect(template: str | None) -> str | None:
    """``--reasoning-parser auto``: the parser the chat template's markers name, else None."""
    if not template:
        return None
    if HARMONY[0] in template and "analysis" in template:
        return "gpt_oss"
    if THINK in template or END_THINK in template:
        return "deepseek_r1" if DEEPSEEK_ASSISTANT in template else "qwen3"
    return None


def reasoning_config(tokenizer: Tokenizer, name: str | None) -> ReasoningConfig | None:
    """The config for ``--reasoning-parser name`` (None or "none": no parser; "auto": :func:`detect`).

    Raises:
        BaigeError: an unknown name, or a marker that is not one token of the vocabulary.
    """
    if name == "auto":
        name = detect(tokenizer.chat_template)
    if name in (None, "", "none"):
        return None
    if name not in PARSERS:
        raise BaigeError(f"--reasoning-parser: {name!r} is not one of auto, {', '.join(PARSERS)}")
    if name == "gpt_oss":
        ids = [_single_token(tokenizer, m, name) for m in HARMONY]
        return ReasoningConfig(name, keep_special_tokens=any(_is_special(tokenizer, t) for t in ids))
    start, end = _single_token(tokenizer, THINK, name), _single_token(tokenizer, END_THINK, name)
    special = _is_special(tokenizer, start) or _is_special(tokenizer, end)
    return ReasoningConfig(name, start, end, special)


def _held(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ThinkStream:
    """``<think>...</think>`` outputs: ``feed(token_ids, text)`` with each step's new tokens and text returns
    ``("reasoning", text)`` events while the output reasons and ``("content", text)`` after, ``finish()``
    what is held. A marker token's text is removed from the events; text that only spells a marker stays.

    Args:
        cfg: the markers' ids.
        reasoning: whether the output starts inside the reasoning (None: its first token decides).
    """

    def __init__(self, cfg: ReasoningConfig, reasoning: bool | None):
        self.cfg = cfg
        self.mode = {True: "reasoning", False: "content", None: "undecided"}[reasoning]
        self._buf = ""
        self._starts = 0  # <think> tokens generated whose text has not been cut out yet
        self._ends = 0  # </think> tokens generated whose text has not been cut out yet
        self.reasoned = reasoning is True

    def feed(self, token_ids: list[int], text: str) -> list[Event]:
        self._buf += text
        for t in token_ids:
            if self.mode == "undecided":
                self.mode = "reasoning" if t == self.cfg.start_id else "content"
                self.reasoned = self.mode == "reasoning"
            if self.mode == "reasoning" and not self._ends:
                if t == self.cfg.start_id:
                    self._starts += 1
                elif t == self.cfg.end_id:
                    self._ends += 1
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self.mode == "reasoning" and self._buf:
            buf = self._buf
            if self._starts:  # cut the <think> text the start token left (it comes before any end)
                j = buf.find(THINK)
                if j < 0:
                    break
                buf, self._starts = buf[:j] + buf[j + len(THINK) :], self._starts - 1
                self._buf = buf
                continue
            if self._ends:
                k = buf.find(END_THINK)
                if k >= 0:
                    if buf[:k]:
                        out.append(("reasoning", buf[:k]))
                    self._buf, self.mode, self._ends = buf[k + len(END_THINK) :], "content", 0
                    break
                keep = _held(buf, END_THINK)
            else:
                keep = 0
            if len(buf) > keep:
                out.append(("reasoning", buf[: len(buf) - keep]))
            self._buf = buf[len(buf) - keep :]
            break
        if final and self.mode == "reasoning" and self._buf:
            out.append(("reasoning", self._buf))
            self._buf = ""
        if self.mode == "content" and self._buf:
            out.append(("content", self._buf))
            self._buf = ""
        if final and self.mode == "undecided" and self._buf:
            out.append(("content", self._buf))
            self._buf = ""
        return out


class HarmonyStream:
    """gpt-oss's harmony format (special tokens decoded): messages ``<|channel|>CHANNEL[ to=RECIPIENT]
    <|message|>BODY<|end|>``, each after ``<|start|>ROLE`` (the first one's is in the prompt); the
    recipient may also follow the role. ``analysis`` bodies are reasoning, ``final`` bodies content, a
    ``commentary`` body addressed ``to=functions.NAME`` (a declared tool) a call whose arguments are
    the body, other commentary content. ``<|call|>`` and ``<|return|>`` end the output (stop tokens).
    """

    def __init__(self, tools: frozenset[str] = frozenset()):
        self.tools = tools
        self._buf = ""
        self._kind: str | None = None  # the open message's event: reasoning | content | args
        self.calls = 0
        self.reasoned = False

    def feed(self, token_ids: list[int], text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _open(self, header: str) -> list[Event]:
        """The events that open a message with this header (channel, recipient, content type)."""
        words = header.replace("<|channel|>", " ").replace("<|constrain|>", " ").split()
        to = next((w[3:] for w in words if w.startswith("to=")), None)
        channel = next((w for w in words if w in ("analysis", "commentary", "final")), "final")
        if to is not None and to.startswith("functions.") and to[10:] in self.tools:
            self._kind = "args"
            self.calls += 1
            return [("call", self.calls - 1, ToolParser.new_id(), to[10:])]
        self._kind = "reasoning" if channel == "analysis" else "content"
        self.reasoned |= self._kind == "reasoning"
        return []

    def _body(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._kind == "args":
            return [("args", self.calls - 1, text)]
        return [(self._kind, text)]

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            buf = self._buf
            if self._kind is None:  # in a header: held whole until its <|message|>
                j = buf.find("<|message|>")
                if j < 0:
                    if final:  # text that never became a message (no harmony header): content, not lost
                        out.append(("content", buf))
                        self._buf = ""
                    break
                out += self._open(buf[:j])
                self._buf = buf[j + len("<|message|>") :]
                continue
            j = buf.find("<|end|>")
            if j >= 0:
                out += self._body(buf[:j])
                self._kind, self._buf = None, buf[j + len("<|end|>") :]
                continue
            keep = 0 if final else _held(buf, "<|end|>")
            out += self._body(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            break
        return out


class AnswerStream:
    """One output's reader for a chat response: the reasoning parser's split (None: no parser), the answer
    read by the request's tool stream (:mod:`.tool_streams`), reasoning events dropped unless
    ``include_reasoning``. ``feed(token_ids, text)`` / ``finish()`` return :mod:`.tool_streams` events plus
    ``("reasoning", text)``; ``calls`` counts the calls read; ``reasoned``: whether the output reasoned."""

    def __init__(self, reasoning: ThinkStream | HarmonyStream | None, tools, include_reasoning: bool = True):
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning

    @property
    def calls(self) -> int:
        return self.tools.calls + (self.reasoning.calls if isinstance(self.reasoning, HarmonyStream) else 0)

    @property
    def reasoned(self) -> bool:
        return self.reasoning is not None and self.reasoning.reasoned

    def feed(self, token_ids: list[int], text: str) -> list[Event]:
        if self.reasoning is None:
            return self.tools.feed(text) if text else []
        return self._route(self.reasoning.feed(token_ids, text))

    def finish(self) -> list[Event]:
        if self.reasoning is None:
            return self.tools.finish()
        return self._route(self.reasoning.finish()) + self.tools.finish()

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if e[0] == "content":
                out += self.tools.feed(e[1])
            elif e[0] != "reasoning" or self.include_reasoning:
                out.append(e)
        return out


def reasoning_text(events: list[Event]) -> str:
    return "".join(e[1] for e in events if e[0] == "reasoning")
