"""Rebuild a Hugging Face tokenizer (`tokenizer.json` + `tokenizer_config.json`) from GGUF metadata.

A GGUF file carries no `tokenizer.json`: llama.cpp stores the vocabulary, the BPE merges, the token
types and the special-token ids as metadata under `tokenizer.ggml.*` (spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, "Tokenizer" section). This module turns
that metadata back into the two JSON documents a Hugging Face checkpoint directory holds, so the rest
of baige loads every model through one path (`baige.runtime.model.tokenizer.Tokenizer.from_dir`).

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen 2, ...).
The pre-tokenizer (how text is split before BPE) is chosen by `tokenizer.ggml.pre`, the name
llama.cpp gives each model family's split rule.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from baige.errors import BaigeError

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf `tokenizer.ggml.token_type`, enum llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split rules for families whose rule is not GPT-2's, as one regex applied before byte-level BPE.
# Llama 3 (tiktoken cl100k rule: numbers in groups of up to three digits); Qwen 2 (one digit a piece).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# Families that split every digit off on its own, then apply GPT-2's rule (their HF tokenizer.json is
# `Sequence[Digits(individual_digits=True), ByteLevel]`; llama.cpp's rule is `\p{N}` then GPT-2's).
_DIGIT_SPLIT_FAMILIES = {"smollm", "starcoder"}
_GPT2_FAMILIES = {None, "default", "gpt-2", "gpt2"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    U+0100 upward in byte order, so e.g. the space byte 0x20 is spelled 'Ġ' (U+0120).
    Source: the GPT-2 encoder (openai/gpt-2, src/encoder.py).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata `key`, or `default` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name `pre`. Raises BaigeError when it is
    not a string."""
    if pre is not None and not isinstance(pre, str):
        raise BaigeError("metadata 'tokenizer.ggml.pre' must be a string")
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _DIGIT_SPLIT_FAMILIES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in _GPT2_FAMILIES:
        logger.warning("GGUF pre-tokenizer %r is not known to baige; splitting text with GPT-2's rule", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _vocab(tokens: list[str], token_types: list[int]) -> tuple[dict[str, int], list[AddedToken]]:
    """The BPE vocabulary (key -> id) and the added tokens (control: special, user-defined: plain), in id order.

    Vocabulary keys are spelled in the byte alphabet. A token written in plain text (llama.cpp
    stores added tokens as their text) is respelled, except added ones: those keep their text as
    the key, so the added token and the vocabulary entry share one id.
    """
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            vocab[token] = index
            added.append(AddedToken(token, normalized=False, special=token_type == TOKEN_TYPE_CONTROL))
        elif set(token) <= alphabet:
            vocab[token] = index
        else:
            vocab["".join(spelling[b] for b in token.encode("utf-8"))] = index
    return vocab, added


def _special_tokens(reader: gguf.GGUFReader, tokens: list[str]) -> dict[str, Any]:
    """``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` (token text, or None when the file
    names no id or one outside the vocabulary) and ``add_bos_token``, ``add_eos_token`` (True only
    when the file asks for it and the token exists), in `tokenizer_config.json`'s key order."""

    def text_of(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0):
            raise BaigeError(f"metadata 'tokenizer.ggml.{key}' must be a token id, got {str(token_id)[:40]}")
        return None if token_id is None or token_id >= len(tokens) else tokens[token_id]

    bos_token, eos_token = text_of("bos_token_id"), text_of("eos_token_id")
    return {
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": text_of("padding_token_id"),
        "unk_token": text_of("unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos_token is not None,
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos_token is not None,
    }


def _post_processor(reader: gguf.GGUFReader, specials: dict[str, Any]) -> processors.TemplateProcessing:
    """BOS/EOS that `encode(..., add_special_tokens=True)` adds, as HF's post-processor."""
    single, ids = ["$A:0"], {}
    if specials["add_bos_token"]:
        single.insert(0, f"{specials['bos_token']}:0")
        ids[specials["bos_token"]] = _field(reader, "tokenizer.ggml.bos_token_id")
    if specials["add_eos_token"]:
        single.append(f"{specials['eos_token']}:0")
        ids[specials["eos_token"]] = _field(reader, "tokenizer.ggml.eos_token_id")
    return processors.TemplateProcessing(single=single, special_tokens=list(ids.items()))


def _tokenizer_config(
    reader: gguf.GGUFReader, specials: dict[str, Any], vocab: dict[str, int], added: list[AddedToken]
) -> dict[str, Any]:
    """`tokenizer_config.json`: the special tokens, `added_tokens_decoder` (id -> entry),
    `chat_template` (when present) and `model_max_length` (tokens, from `<arch>.context_length`)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(vocab[t.content]): {
                "content": t.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t.special,
            }
            for t in added
        },
    }
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise BaigeError("metadata 'tokenizer.chat_template' must be a string")
    if chat_template is not None:
        config["chat_template"] = chat_template
    architecture = _field(reader, "general.architecture")
    context_length = _field(reader, f"{architecture}.context_length")
    if context_length is not None:
        config["model_max_length"] = int(context_length)
    return config


def build_tokenizer_files(reader: gguf.GGUFReader) -> tuple[dict, dict]:
    """Build the contents of `tokenizer.json` and `tokenizer_config.json` from a GGUF's metadata.

    Args:
        reader: an open `gguf.GGUFReader`. Keys read: `tokenizer.ggml.{model, pre, tokens, merges,
            token_type, bos_token_id, eos_token_id, padding_token_id, unknown_token_id,
            add_bos_token, add_eos_token}`, `tokenizer.chat_template`, `general.architecture` and
            `<arch>.context_length`.

    Returns:
        `(tokenizer_json, tokenizer_config)`: plain dicts ready for `json.dump`. `tokenizer_json` loads
        with `tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json))`. Control tokens (type 3)
        become special added tokens, user-defined tokens (type 4) plain added tokens, both matched
        whole in text. `tokenizer_config` holds `bos_token`, `eos_token`, `pad_token`, `unk_token`
        (token text or None), `add_bos_token`, `add_eos_token`, `chat_template` (when present),
        `model_max_length` (tokens, when the file states a context length) and `added_tokens_decoder`.

    Raises:
        BaigeError: the file has no tokenizer, or one other than byte-level BPE (`gpt2`).
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise BaigeError("GGUF file has no tokenizer metadata (tokenizer.ggml.model)")
    if kind != "gpt2":
        raise BaigeError(f"unsupported GGUF tokenizer model '{kind}'")

    tokens, token_types, merges = _checked_lists(reader)
    vocab, added = _vocab(tokens, token_types)
    pairs = [tuple(merge.split(" ")) for merge in merges]
    specials = _special_tokens(reader, tokens)
    pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        # Added in one call, in id order; each is found in the vocabulary, so no id moves.
        backend.add_tokens(added)
        backend.post_processor = _post_processor(reader, specials)
        tokenizer_json = json.loads(backend.to_str())
    except Exception as e:  # tokenizers raises a bare Exception on a vocabulary or merges it rejects
        raise BaigeError(f"its tokenizer metadata does not build a tokenizer ({str(e)[:120]})") from None
    return tokenizer_json, _tokenizer_config(reader, specials, vocab, added)


def _checked_lists(reader: gguf.GGUFReader) -> tuple[list[str], list[int], list[str]]:
    """``tokenizer.ggml.tokens`` (a non-empty list of strings), ``token_type`` (integers, one per token;
    default all normal) and ``merges`` (strings ``"left right"``). Raises BaigeError naming the key."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise BaigeError("metadata 'tokenizer.ggml.tokens' must be a non-empty array of strings")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if (
        not isinstance(token_types, list)
        or len(token_types) != len(tokens)
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_types)
    ):
        raise BaigeError(f"metadata 'tokenizer.ggml.token_type' must be {len(tokens)} integers, one per token")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise BaigeError("metadata 'tokenizer.ggml.merges' must be an array of strings 'left right'")
    return tokens, token_types, merges
