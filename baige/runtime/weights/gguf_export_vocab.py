"""An HF ``tokenizer.json`` as GGUF tokenizer metadata (``tokenizer.ggml.*``), for ``baige convert SRC OUT.gguf``.

The keys are those of the GGUF spec's tokenizer section (``ggml/docs/gguf.md``) and the conventions are
llama.cpp's converter's (``convert_hf_to_gguf.py``: ``_set_vocab_gpt2``, ``_set_vocab_llama_hf``;
``gguf-py/gguf/vocab.py``): one token string per id (the vocabulary, then the added tokens, then
``[PAD{i}]`` up to the model's ``vocab_size``), a token type per id (llama.h's ``llama_token_type``: 1
normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), the BPE merges as ``"a b"`` strings, and
the special-token ids, add-BOS/EOS flags and chat template that ``gguf.SpecialVocab`` reads from the
directory.

Two tokenizer kinds map:

- byte-level BPE (``model.type`` BPE, a ByteLevel decoder, no ``byte_fallback``): ``tokenizer.ggml.model``
  ``gpt2``, and ``tokenizer.ggml.pre`` the name llama.cpp gives the split rule (``llama-vocab.cpp``): plain
  GPT-2 (a ByteLevel pre-tokenizer with its own regex), SmolLM's (each digit split off first), Llama 3's,
  Qwen 2's, o200k's (gpt-oss: ``gpt-4o``) and DeepSeek-V3's three (``deepseek-v3``) regexes
  (:mod:`baige.runtime.weights.gguf_tokenizer` holds the same table for the import direction);
- SentencePiece-style BPE (``byte_fallback``, ``▁`` for spaces; Gemma, ERNIE 4.5, Llama 2): ``llama``, each
  token scored ``-id`` (earlier ids win merges, the order SentencePiece assigns them) and the ``<0xNN>``
  byte tokens typed 6.

Anything else (WordLevel, Unigram, WordPiece, a split rule not in the table) raises BaigeError naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from baige.errors import BaigeError
from baige.runtime.weights.gguf_tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# llama.cpp's tokenizer.ggml.pre names of the split rules baige knows (src/llama-vocab.cpp's
# tokenizer_pre table; the HF tokenizer.json pre_tokenizer each name is written for, convert_hf_to_gguf.py's
# get_vocab_base_pre), keyed by the Split steps' regexes in order
_DIGITS_THEN_GPT2 = "each digit alone, then GPT-2's rule"  # SmolLM's Sequence[Digits, ByteLevel]
# o200k (tiktoken's o200k_base split; openai/gpt-oss and Xenova/gpt-4o): llama.cpp's "gpt-4o"
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's three Splits (digit runs of up to three, then CJK runs, then words and punctuation; the
# third regex holds real CR and LF characters, as tokenizer.json's "\r\n" decodes): llama.cpp's "deepseek-v3"
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
_SPLIT_NAMES = {
    (_LLAMA3_SPLIT,): "llama-bpe",
    (_QWEN2_SPLIT,): "qwen2",
    (_O200K_SPLIT,): "gpt-4o",
    _DEEPSEEK_V3_SPLITS: "deepseek-v3",
    (_DIGITS_THEN_GPT2,): "smollm",
}


def _split_regexes(pre: dict[str, Any] | None) -> tuple[str, ...] | None | bool:
    """The byte-level pre-tokenizer's split regexes, in order: the Split steps' patterns before a
    ByteLevel without its own regex; None for GPT-2's own (a lone ByteLevel with ``use_regex``),
    ``(_DIGITS_THEN_GPT2,)`` for SmolLM's digits-then-GPT-2, False for a shape this module does not know."""
    if pre is None:
        return False
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    levels = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(steps) == 1 and levels and levels[0].get("use_regex", True):
        return None
    digits = [s for s in steps if s.get("type") == "Digits" and s.get("individual_digits")]
    if len(steps) == 2 and digits and levels and levels[0].get("use_regex", True):
        return (_DIGITS_THEN_GPT2,)
    *splits, last = steps
    if not splits or last.get("type") != "ByteLevel" or last.get("use_regex", True):
        return False
    patterns = []
    for s in splits:
        pattern = s.get("pattern")
        if s.get("type") != "Split" or s.get("behavior", "Isolated") != "Isolated" or s.get("invert"):
            return False
        if not isinstance(pattern, dict) or not isinstance(pattern.get("Regex"), str):
            return False
        patterns.append(pattern["Regex"])
    return tuple(patterns)


def _pre_name(tok: dict[str, Any]) -> str:
    """``tokenizer.ggml.pre`` of a byte-level BPE tokenizer. Raises BaigeError for an unknown rule."""
    regexes = _split_regexes(tok.get("pre_tokenizer"))
    if regexes is None:
        return "gpt-2"
    if regexes in _SPLIT_NAMES:
        return _SPLIT_NAMES[regexes]
    what = "its pre_tokenizer" if regexes is False else f"its split regex {' then '.join(regexes)[:60]!r}"
    raise BaigeError(
        f"tokenizer.json: {what} has no llama.cpp tokenizer.ggml.pre name baige knows "
        "(known: GPT-2's ByteLevel, SmolLM's digits then ByteLevel, Llama 3's, Qwen 2's, o200k's (gpt-oss) "
        "and DeepSeek-V3's regexes)"
    )


def _space_prefix(tok: dict[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer puts ``▁`` before the text (SentencePiece's
    ``add_dummy_prefix``: a ``Prepend("▁")`` normalizer as Llama 2's, or a Metaspace pre-tokenizer that
    prepends), which llama.cpp's ``tokenizer.ggml.add_space_prefix`` says. Gemma's does not."""
    steps = []
    for part in (tok.get("normalizer"), tok.get("pre_tokenizer")):
        if part:
            steps += part.get("normalizers", part.get("pretokenizers", [part]))
    return any(
        (s.get("type") == "Prepend" and s.get("prepend") == "\u2581")
        or (s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") in ("always", "first"))
        for s in steps
    )


def _tokens(tok: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int], set[int]]:
    """Token strings and types by id, padded to ``vocab_size``; the ids of the added tokens.
    Raises BaigeError for a hole in the ids or more tokens than ``vocab_size``."""
    by_id: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    types = {i: NORMAL for i in by_id}
    added: set[int] = set()
    for a in tok.get("added_tokens", []):
        i = int(a["id"])
        by_id[i] = a["content"]
        types[i] = CONTROL if a.get("special") else USER_DEFINED
        added.add(i)
    n = max(by_id, default=-1) + 1
    if n > vocab_size:
        raise BaigeError(f"tokenizer.json has {n} tokens, more than the model's vocab_size {vocab_size}")
    tokens, token_types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            token_types.append(types[i])
        elif i < n:
            raise BaigeError(f"tokenizer.json has no token with id {i} (ids must run 0..{n - 1})")
        else:
            tokens.append(f"[PAD{i}]")
            token_types.append(UNUSED)
    return tokens, token_types, added


def add_vocab(writer, model_dir: Path, vocab_size: int) -> None:
    """Add ``model_dir``'s tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) to ``writer`` (a
    ``gguf.GGUFWriter``) as ``tokenizer.ggml.*`` metadata, ``vocab_size`` tokens long.

    Raises:
        BaigeError: no tokenizer.json, or a tokenizer kind or split rule llama.cpp's metadata cannot
        express (naming it), or ids that do not fit ``vocab_size``.
    """
    import gguf

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise BaigeError(f"{model_dir}: no tokenizer.json (a GGUF carries the tokenizer; llama.cpp needs one)")
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        kind = tok["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BaigeError(f"{path}: not a readable tokenizer.json ({type(e).__name__})") from None
    decoder = (tok.get("decoder") or {}).get("type")
    byte_fallback = bool(tok["model"].get("byte_fallback"))
    if kind != "BPE" or (not byte_fallback and decoder != "ByteLevel"):
        raise BaigeError(
            f"tokenizer.json: a {kind} tokenizer (decoder {decoder}) has no GGUF equivalent baige writes "
            "(byte-level BPE -> gpt2, SentencePiece-style BPE with byte_fallback -> llama)"
        )
    tokens, types, added = _tokens(tok, vocab_size)
    if byte_fallback:
        writer.add_tokenizer_model("llama")
        unk = tok["model"].get("unk_token")
        for i, t in enumerate(tokens):
            if _BYTE_TOKEN.fullmatch(t) and i not in added:
                types[i] = BYTE
            elif t == unk:
                types[i] = UNKNOWN
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_add_space_prefix(_space_prefix(tok))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_name(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=not byte_fallback, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
