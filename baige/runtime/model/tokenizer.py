"""Tokenizer: HF `tokenizers` for text <-> ids, jinja2 for chat templates, and an incremental detokenizer.

Reads a Hugging Face checkpoint directory (`tokenizer.json`, `tokenizer_config.json`, optionally
`chat_template.jinja` and `generation_config.json`); GGUF files are first converted to that layout by
`baige.runtime.weights.gguf_tokenizer`.

Chat templates render as in HF transformers (`apply_chat_template`: sandboxed jinja2,
`trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`), with one deliberate
difference in tokenization: the text of a special token that appears inside a message (for example
a user typing `<|im_end|>\\n<|im_start|>assistant`) is tokenized as plain text, so only the template
itself can emit turn markers. HF tokenizes the rendered string as a whole and would turn such text
into real control tokens.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from baige.errors import BaigeError


def _read_json(path: Path) -> dict:
    """Parsed JSON object at `path`. Raises BaigeError when it is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BaigeError(f"{path} is not valid JSON: {e}") from None


def _token_text(value: str | dict | None) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict `{"content": ...}`."""
    return value.get("content") if isinstance(value, dict) else value


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text with it; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON (as HF renders it).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox, with HF's environment settings. Raises BaigeError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise BaigeError(f"chat template does not compile: {e.message} (line {e.lineno})") from None


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Attributes:
        vocab_size: number of token ids, added tokens included (int).
        bos_token_id: id of the beginning-of-sequence token, or None.
        eos_token_ids: ids that end generation: tokenizer_config's `eos_token` followed by
            generation_config's `eos_token_id` (int or list), without repeats.
        pad_token_id: id of the padding token, or None.
        chat_template: jinja2 source of the chat template, or None.
        add_bos_token: whether `encode` and `apply_chat_template` put BOS first.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        config: dict,
        generation_config: dict | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer` with the settings of `tokenizer_config.json` (`config`).

        `chat_template`, when given, overrides `config["chat_template"]`; `generation_config` is the
        parsed `generation_config.json` (its `eos_token_id` adds stop ids).
        """
        self._backend = backend
        # A twin that reads special-token text as plain text; used for message content.
        self._plain = HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        self._special_text = {k: _token_text(config.get(k)) for k in names}
        self.bos_token_id: int | None = self._id_of(self._special_text["bos_token"])
        self.pad_token_id: int | None = self._id_of(self._special_text["pad_token"])
        eos = [self._id_of(self._special_text["eos_token"])]
        gen_eos = (generation_config or {}).get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        # tokenizer_config's flags win (as in HF); without them, whatever tokenizer.json's post-processor adds.
        with_specials = backend.encode("", add_special_tokens=True).ids
        add_bos = config.get("add_bos_token", with_specials[:1] == [self.bos_token_id])
        add_eos = config.get("add_eos_token", bool(self.eos_token_ids) and with_specials[-1:] == self.eos_token_ids[:1])
        self.add_bos_token: bool = bool(add_bos) and self.bos_token_id is not None
        self.add_eos_token: bool = bool(add_eos) and bool(self.eos_token_ids)

        if chat_template is None:
            chat_template = config.get("chat_template")
            if isinstance(chat_template, list):  # [{"name": ..., "template": ...}], HF's named templates
                named = {t["name"]: t["template"] for t in chat_template}
                chat_template = named.get("default")
        self.chat_template: str | None = chat_template
        self._compiled: jinja2.Template | None = None

        specials = sorted(
            (t.content for t in backend.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )  # longest first: the leftmost-longest match, as tokenizers does
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def to_json(self) -> str:
        """The backend's ``tokenizer.json`` serialisation (what grammar engines build their vocabulary from)."""
        return self._backend.to_str()

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included (HF's ``get_vocab``)."""
        return self._backend.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (byte-level entries count one per byte, so this
        bounds the text one token can stand for): a text longer than ``n * max_token_chars`` chars
        tokenizes to more than ``n`` tokens, before normalization."""
        return max((len(s) for s in self._backend.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a HF checkpoint directory.

        Reads `tokenizer.json` (required), `tokenizer_config.json`, `chat_template.jinja` (which, as in
        HF, takes precedence over the config's `chat_template`) and `generation_config.json`.

        Raises:
            BaigeError: the directory or its `tokenizer.json` is missing, or a file is not valid.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise BaigeError(f"no tokenizer.json in {path}")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise BaigeError(f"{tokenizer_file} is not a valid tokenizer: {e}") from None
        config_file, template_file, gen_file = (
            path / name for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")
        )
        config = _read_json(config_file) if config_file.is_file() else {}
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        generation_config = _read_json(gen_file) if gen_file.is_file() else None
        return cls(backend, config, generation_config, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def set_chat_template(self, source: str) -> None:
        """Replace the chat template (``baige serve --chat-template``, vLLM's option); compiled now.

        Raises:
            BaigeError: the template does not compile.
        """
        self._compiled = _compile_template(source)
        self.chat_template = source

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return self.chat_template is not None

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Special-token text in `text` (e.g. `<|im_end|>`) becomes that special token, as in HF. With
        `add_special_tokens`, BOS is put first when tokenizer_config says `add_bos_token` (never a
        second one when `text` already starts with it) and EOS last when it says `add_eos_token`.
        """
        ids = self._with_bos(self._backend.encode(text, add_special_tokens=False).ids, add_special_tokens)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids `ids`; special tokens are left out when `skip_special_tokens`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Each id's token string (its vocabulary entry, as HF's ``convert_ids_to_tokens``; None for an
        id the tokenizer does not have)."""
        return [self._backend.id_to_token(i) for i in ids]

    def render_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """The prompt string the chat template makes of `messages`, as HF's
        `apply_chat_template(messages, tokenize=False)` renders it.

        Args:
            messages: `[{"role": "user", "content": "..."}, ...]`.
            add_generation_prompt: end with the header that opens the assistant's turn.
            template_vars: further variables the template reads (`tools`, `enable_thinking`, ...).

        Raises:
            BaigeError: no chat template, or the template rejects the conversation (`raise_exception`).
        """
        if self.chat_template is None:
            raise BaigeError("this model has no chat template; pass a raw prompt instead of chat messages")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        variables = {k: v for k, v in self._special_text.items() if v is not None}
        variables.update(tools=None, documents=None)
        variables.update(template_vars)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise BaigeError(f"chat template error: {e}") from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any
    ) -> list[int]:
        """Token ids of the rendered chat prompt (see `render_chat_template`).

        Only the template's own text can produce special tokens: special-token text inside the
        messages (content, names, ...) is tokenized as plain text, so a user cannot forge a turn.
        For messages without such text the ids equal HF's `apply_chat_template(..., tokenize=True)`.
        BOS is put first when `add_bos_token` is set and the template did not already emit it
        (HF never adds it here; llama.cpp does, once).

        Raises:
            BaigeError: as `render_chat_template`.
        """
        if self._special_re is None:
            return self._with_bos(
                self.encode(self.render_chat_template(messages, add_generation_prompt, **template_vars), False), True
            )
        # Hide special-token text in the messages behind placeholders that cannot match a special
        # token, render, cut the result at the (now template-only) special tokens, then restore the
        # hidden text inside the plain spans and tokenize those with special matching off.
        # Digits only, so filters like `upper` or `trim` leave the placeholders intact.
        seen = json.dumps(messages, ensure_ascii=False, default=str)
        nonce = str(secrets.randbelow(10**12))
        while nonce in seen:
            nonce = str(secrets.randbelow(10**12))
        hidden: list[str] = []

        def hide(match: re.Match) -> str:
            hidden.append(match.group(0))
            return f"\ue000{nonce}:{len(hidden) - 1}\ue001"

        def escape(value: Any) -> Any:
            if isinstance(value, str):
                return self._special_re.sub(hide, value)
            if isinstance(value, dict):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [escape(v) for v in value]
            return value

        rendered = self.render_chat_template(escape(messages), add_generation_prompt, **template_vars)
        placeholder = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        ids: list[int] = []
        start = 0
        for match in [*self._special_re.finditer(rendered), None]:
            end = len(rendered) if match is None else match.start()
            if end > start:
                span = placeholder.sub(lambda m: hidden[int(m.group(1))], rendered[start:end])
                ids += self._plain.encode(span, add_special_tokens=False).ids
            if match is not None:
                ids.append(self._backend.token_to_id(match.group(0)))
                start = match.end()
        return self._with_bos(ids, True)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, for streaming responses.

    Decodes only a short window of recent ids per token (vLLM's prefix/read offsets): the window
    starts at the last id that already produced text, so decoders that treat the first token
    specially and multi-token characters both come out right. A character whose UTF-8 bytes span
    several tokens is held back until its last byte arrives, so no delta ends in U+FFFD for it.
    The concatenation of all deltas and `flush()` equals `tokenizer.decode(all_ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it have been emitted as text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. bytes of an unfinished character)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


def read_tokens(tokenizer: Tokenizer, path: str | Path, max_tokens: int | None = None) -> torch.Tensor:
    """Tokenize a UTF-8 text file (with the tokenizer's special tokens, as ``tokenizer(text)`` does)
    and keep the first ``max_tokens``.

    Returns (N,) int64. Raises BaigeError: missing/unreadable file, or fewer than 2 tokens.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BaigeError(f"{path}: data file not found") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise BaigeError(f"{path}: not a UTF-8 text file ({type(e).__name__})") from None
    ids = tokenizer.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise BaigeError(f"{path}: fewer than 2 tokens of text")
    return torch.tensor(ids, dtype=torch.long)
