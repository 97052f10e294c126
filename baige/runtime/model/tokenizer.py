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
from pathlib import Path
from typing import Any

import jinja2
import torch
from tokenizers import Tokenizer as HFTokenizer

from baige.errors import BaigeError
from baige.runtime.model.chat_template import compile_template, probe_template, render
from baige.runtime.model.config_checks import read_json

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# the largest tokenizer.json read (the biggest published ones, with 256k-entry vocabularies, are ~35 MB)
MAX_TOKENIZER_BYTES = 2**30


def _read_object(path: Path) -> dict:
    """The JSON object in ``path``. Raises BaigeError naming ``path`` when it is not one."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise BaigeError(f"{path}: must hold a JSON object, not {type(data).__name__}")
    return data


def check_tokenizer_config(config: dict, path: Path | str) -> None:
    """``tokenizer_config.json``'s fields baige reads: the special tokens (a string, an AddedToken object
    with a string ``content``, or null), ``add_bos_token`` / ``add_eos_token`` (booleans) and
    ``chat_template`` (a string, or HF's list of ``{"name", "template"}``). Raises BaigeError naming
    ``path`` and the field."""
    for key in _SPECIAL_TOKENS:
        value = config.get(key)
        if not (
            value is None or isinstance(value, str) or isinstance(value, dict) and isinstance(value.get("content"), str)
        ):
            raise BaigeError(
                f"{path}: {key} must be a string or an object with a string content, got {str(value)[:60]}"
            )
    for key in ("add_bos_token", "add_eos_token"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise BaigeError(f"{path}: {key} must be true or false, got {str(config[key])[:60]}")
    template = config.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template
    )
    if not (template is None or isinstance(template, str) or named):
        raise BaigeError(f"{path}: chat_template must be a string or a list of {{name, template}} objects")


def _number_in(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def check_generation_config(config: dict, path: Path | str, vocab_size: int) -> None:
    """``generation_config.json``'s fields baige reads: the token ids (``bos/eos/pad_token_id``: null, an
    id, or for EOS a list of ids) inside the vocabulary, and the sampling defaults: ``do_sample`` a
    boolean, ``temperature`` in [0, 100], ``top_p`` in [0, 1], ``top_k`` an integer >= 0. Raises
    BaigeError naming ``path`` and the field."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if isinstance(value, list) and key == "eos_token_id" else [] if value is None else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise BaigeError(f"{path}: {key} must be null or token ids in [0, {vocab_size}), got {str(value)[:60]}")
    checks = {
        "do_sample": (lambda v: isinstance(v, bool), "true or false"),
        "temperature": (lambda v: _number_in(v, 0, 100), "a number in [0, 100]"),
        "top_p": (lambda v: _number_in(v, 0, 1), "a number in [0, 1]"),
        "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    }
    for key, (ok, requirement) in checks.items():
        if config.get(key) is not None and not ok(config[key]):
            raise BaigeError(f"{path}: {key} must be {requirement}, got {str(config[key])[:60]}")


def _token_text(value: str | dict | None) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict `{"content": ...}`."""
    return value.get("content") if isinstance(value, dict) else value


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
        chat_template_source: str = "tokenizer_config.json",
    ) -> None:
        """Wrap a `tokenizers.Tokenizer` with the settings of `tokenizer_config.json` (`config`).

        `chat_template`, when given, overrides `config["chat_template"]`; `generation_config` is the
        parsed `generation_config.json` (its `eos_token_id` adds stop ids). `chat_template_source` names
        where the template came from, in its errors.
        """
        self._backend = backend
        # A twin that reads special-token text as plain text; used for message content.
        self._plain = HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        self._special_text = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKENS}
        self.bos_token_id: int | None = self._id_of(self._special_text["bos_token"])
        self.pad_token_id: int | None = self._id_of(self._special_text["pad_token"])
        eos = [self._id_of(self._special_text["eos_token"])]
        gen_eos = (generation_config or {}).get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self.generation_config: dict = dict(generation_config or {})  # as read (checked by from_dir)
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
        self.chat_template_source = chat_template_source
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
        if tokenizer_file.stat().st_size > MAX_TOKENIZER_BYTES:
            raise BaigeError(f"{tokenizer_file}: larger than {MAX_TOKENIZER_BYTES} bytes")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise BaigeError(f"{tokenizer_file} is not a valid tokenizer: {str(e)[:200]}") from None
        config_file, template_file, gen_file = (
            path / name for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")
        )
        config = _read_object(config_file) if config_file.is_file() else {}
        check_tokenizer_config(config, config_file)
        source = str(config_file)
        template = None
        if template_file.is_file():
            try:
                template, source = template_file.read_text(encoding="utf-8"), str(template_file)
            except (OSError, UnicodeDecodeError) as e:
                raise BaigeError(f"{template_file}: not a readable UTF-8 file ({type(e).__name__})") from None
        generation_config = _read_object(gen_file) if gen_file.is_file() else None
        if generation_config is not None:
            check_generation_config(generation_config, gen_file, backend.get_vocab_size(with_added_tokens=True))
        return cls(backend, config, generation_config, template, source)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def set_chat_template(self, source: str, where: str = "--chat-template") -> None:
        """Replace the chat template (``baige serve --chat-template``, vLLM's option); compiled now.

        Raises:
            BaigeError: the template does not compile.
        """
        self._compiled = compile_template(source, where)
        self.chat_template, self.chat_template_source = source, where

    def check_chat_template(self) -> None:
        """Compile the chat template and render a one-message conversation, at start-up
        (:func:`~baige.runtime.model.chat_template.probe_template`).

        Raises:
            ChatTemplateError: naming the template: it does not compile, breaks the sandbox or exceeds
            its budget.
        """
        if self.chat_template is not None and self._compiled is None:
            variables = {k: v for k, v in self._special_text.items() if v is not None}
            self._compiled = probe_template(self.chat_template, self.chat_template_source, **variables)

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
            BaigeError: no chat template; ChatTemplateError (naming the template): it does not compile,
            rejects the conversation (`raise_exception`), breaks the sandbox or exceeds its budget
            (:mod:`baige.runtime.model.chat_template`).
        """
        if self.chat_template is None:
            raise BaigeError("this model has no chat template; pass a raw prompt instead of chat messages")
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template, self.chat_template_source)
        variables = {k: v for k, v in self._special_text.items() if v is not None}
        variables.update(tools=None, documents=None)
        variables.update(template_vars)
        return render(
            self._compiled,
            self.chat_template_source,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

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
