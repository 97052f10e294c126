"""Training data: tokenize once into a memmap cache, pack into ``seq_len`` windows, shard per rank.

Inputs:
- plain text (any extension but ``.jsonl``/``.json``): the whole file is one document;
- JSONL, one record per line, either ``{"text": ...}`` (a document) or ``{"messages": [...]}`` (a
  conversation for SFT: the chat template is applied and only assistant tokens carry loss).

Each document is ``[BOS when the tokenizer adds it] + tokens + [EOS]`` (conversations end with the
template's own end-of-turn). Documents are concatenated into one stream and cut into windows of
``seq_len + 1`` tokens that overlap by one (inputs = window[:-1], targets = window[1:]). Document
boundaries are **not** respected: a window may span two documents and attention crosses the EOS
between them (the GPT-2 / nanoGPT / torchtitan packing), and positions restart at 0 in every window.
With ``training.attn_mask_type = "block_causal"`` the loader also hands out where each document starts,
and attention stays inside a document (positions keep counting over the window: RoPE sees only
distances, so within a document that is the same as restarting them).

The cache (``$BAIGE_CACHE/tokens``) is keyed by the tokenizer files' and the data file's SHA-256, so
editing either re-tokenizes. A cache entry is ``<key>.tokens`` (uint32), ``<key>.mask`` (uint8, only
for data with masked-out tokens), ``<key>.docs`` (int64 start offset of every document) and ``<key>.json``
(written last: its presence marks the entry complete).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from baige.errors import BaigeError
from baige.runtime.model.tokenizer import Tokenizer

IGNORE_INDEX = -100  # target id that carries no loss (PyTorch / HF convention)
_CACHE_VERSION = 2  # 2: document starts (.docs)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer_dir: Path) -> str:
    """SHA-256 over the tokenizer's files (those present), so any change re-tokenizes."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            h.update(name.encode() + b"\0" + bytes.fromhex(_sha256_file(tokenizer_dir / name)))
    return h.hexdigest()


def chat_tokens(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (1 = an assistant token to be learned).

    An assistant turn's tokens are those the template adds for that message after the generation
    prompt (``apply_chat_template(messages[:i], add_generation_prompt=True)``), up to and including
    its end-of-turn token (the last EOS id in that span); template glue after the EOS (ChatML's
    ``"\\n"``) is not learned. System and user turns and the assistant header carry no loss.

    Returns:
        ``(ids, mask)``, two lists of the same length.
    Raises:
        BaigeError: the template does not render earlier turns as a prefix of the whole
        conversation (e.g. it rewrites history), so assistant spans cannot be located.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    eos = set(tokenizer.eos_token_ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True) if i else []
        through = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if ids[: len(before)] != before or ids[: len(through)] != through or len(through) < len(before):
            raise BaigeError(
                f"the chat template does not render turn {i} as a prefix of the conversation; "
                "assistant tokens cannot be masked for this template"
            )
        end = len(through)
        ends = [j for j in range(len(before), len(through)) if ids[j] in eos]
        if ends:
            end = ends[-1] + 1
        mask[len(before) : end] = [1] * (end - len(before))
    return ids, mask


def _documents(path: Path, tokenizer: Tokenizer):
    """Yield ``(ids, mask or None)`` per document of ``path``. Raises BaigeError on bad records and
    on a file that is not UTF-8 text."""
    try:
        yield from _records(path, tokenizer)
    except UnicodeDecodeError as e:
        raise BaigeError(f"{path}: not UTF-8 text (it holds the byte {e.object[e.start]:#04x})") from None


def _records(path: Path, tokenizer: Tokenizer):
    eos = tokenizer.eos_token_ids[:1]
    if path.suffix.lower() not in (".jsonl", ".json"):
        yield tokenizer.encode(path.read_text(encoding="utf-8")) + eos, None
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BaigeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                yield tokenizer.encode(record["text"]) + eos, None
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                yield chat_tokens(tokenizer, record["messages"])
            else:
                raise BaigeError(f'{path}:{lineno}: expected a JSON object with a "text" string or a "messages" list')


@dataclass
class TokenFile:
    """One tokenized data file: ``tokens`` (N,) uint32, ``mask`` (N,) uint8 or None (all tokens learned) and
    ``doc_starts`` (D,) int64, the offset of each document's first token (0 first)."""

    tokens: np.ndarray
    mask: np.ndarray | None
    max_id: int
    doc_starts: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # default: one document


def tokenize_file(path: str | Path, tokenizer: Tokenizer, tokenizer_dir: Path, cache_root: Path) -> TokenFile:
    """Tokenize ``path`` into the cache (once) and map it.

    Raises:
        BaigeError: missing file, bad JSONL record, no tokens.
    """
    path = Path(path)
    if not path.is_file():
        raise BaigeError(f"{path}: data file not found")
    key = hashlib.sha256(
        f"{_CACHE_VERSION}:{tokenizer_fingerprint(tokenizer_dir)}:{_sha256_file(path)}".encode()
    ).hexdigest()[:24]
    base = cache_root / f"{path.stem}-{key}"
    meta_path = base.with_suffix(".json")
    if not meta_path.is_file():
        id_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        for doc_ids, doc_mask in _documents(path, tokenizer):
            id_parts.append(np.asarray(doc_ids, dtype=np.uint32))
            mask_parts.append(np.ones(len(doc_ids), np.uint8) if doc_mask is None else np.asarray(doc_mask, np.uint8))
        starts = np.cumsum([0] + [len(p) for p in id_parts[:-1]]).astype(np.int64)  # (D,)
        ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.uint32)
        mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8)
        any_masked = bool((mask == 0).any())
        if len(ids) == 0:
            raise BaigeError(f"{path}: no tokens (empty data file)")
        cache_root.mkdir(parents=True, exist_ok=True)
        # Each file goes to a temporary name first; the .json (written last) marks the entry complete.
        _atomic_write(base.with_suffix(".tokens"), ids.tobytes())
        if any_masked:
            _atomic_write(base.with_suffix(".mask"), mask.tobytes())
        _atomic_write(base.with_suffix(".docs"), starts.tobytes())
        meta = {"source": str(path), "num_tokens": len(ids), "masked": any_masked, "max_id": int(ids.max())}
        _atomic_write(meta_path, json.dumps(meta).encode())
    meta = json.loads(meta_path.read_text())
    tokens = np.memmap(base.with_suffix(".tokens"), dtype=np.uint32, mode="r")
    mask_arr = np.memmap(base.with_suffix(".mask"), dtype=np.uint8, mode="r") if meta["masked"] else None
    doc_starts = np.fromfile(base.with_suffix(".docs"), dtype=np.int64)
    return TokenFile(tokens, mask_arr, int(meta["max_id"]), doc_starts)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class PackedWindows:
    """The concatenation of token files cut into windows of ``seq_len + 1`` tokens (overlap 1)."""

    def __init__(self, files: list[TokenFile], seq_len: int):
        self.files = files
        self.seq_len = seq_len
        self.offsets = np.cumsum([0] + [len(f.tokens) for f in files])  # (F + 1,) token offsets
        self.num_tokens = int(self.offsets[-1])
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        self.max_id = max(f.max_id for f in files)
        # (D,) every document's first token in the concatenation; each file starts a document
        self.doc_starts = np.concatenate([f.doc_starts + off for f, off in zip(files, self.offsets[:-1])])

    def _slice(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, mask = [], []
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            f, lo = self.files[i], int(self.offsets[i])
            hi = min(end, int(self.offsets[i + 1]))
            tokens.append(np.asarray(f.tokens[start - lo : hi - lo], dtype=np.int64))
            mask.append(
                np.ones(hi - start, dtype=bool)
                if f.mask is None
                else np.asarray(f.mask[start - lo : hi - lo], dtype=bool)
            )
            start, i = hi, i + 1
        return np.concatenate(tokens), np.concatenate(mask)

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``index`` -> ``(input_ids, labels)``, each (seq_len,) int64; masked targets are -100."""
        tokens, mask = self._slice(index * self.seq_len, (index + 1) * self.seq_len + 1)
        labels = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
        return torch.from_numpy(tokens[:-1].copy()), torch.from_numpy(labels)

    def starts(self, index: int) -> torch.Tensor:
        """Window ``index``'s document starts: (seq_len,) bool, True where an input token begins a document."""
        lo = index * self.seq_len
        first = np.searchsorted(self.doc_starts, lo)
        last = np.searchsorted(self.doc_starts, lo + self.seq_len)
        out = torch.zeros(self.seq_len, dtype=torch.bool)
        out[torch.from_numpy(self.doc_starts[first:last] - lo)] = True
        return out

    def batch(self, indices, documents: bool = False) -> tuple[torch.Tensor, ...]:
        """Windows ``indices`` stacked: ``(input_ids, labels)``, each (B, seq_len) int64, and with
        ``documents`` their (B, seq_len) bool :meth:`starts`."""
        pairs = [self.window(int(i)) for i in indices]
        out = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
        return out + (torch.stack([self.starts(int(i)) for i in indices]),) if documents else out


def load_windows(
    paths: list[str], tokenizer: Tokenizer, tokenizer_dir: Path, cache_root: Path, seq_len: int
) -> PackedWindows:
    """Tokenize (or reuse the cache of) every file and pack them. Raises BaigeError when too short."""
    windows = PackedWindows([tokenize_file(p, tokenizer, tokenizer_dir, cache_root) for p in paths], seq_len)
    if windows.num_windows == 0:
        raise BaigeError(
            f"{', '.join(paths)}: {windows.num_tokens} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}"
        )
    return windows


class DataLoader:
    """Deterministic, resumable per-rank micro-batches over :class:`PackedWindows`.

    Each optimizer step consumes ``G = dp_size * batch_size * grad_accum`` windows of the epoch's order
    (a permutation seeded by ``seed + epoch`` when shuffling); micro-batch ``a`` of data-parallel rank
    ``r`` holds the windows at ``position + a * dp_size * batch_size + r * batch_size`` onwards. A
    step that would run past the epoch's end starts the next epoch (the remainder is dropped). The
    state is ``(epoch, position)`` in windows, independent of the world size, so a run can resume
    on a different number of ranks with the same global batch.
    """

    def __init__(
        self,
        windows: PackedWindows,
        batch_size: int,
        grad_accum: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        shuffle: bool,
        documents: bool = False,
    ):
        self.windows, self.batch_size, self.grad_accum = windows, batch_size, grad_accum
        self.dp_size, self.dp_rank, self.seed, self.shuffle = dp_size, dp_rank, seed, shuffle
        self.documents = documents
        self.global_batch = dp_size * batch_size * grad_accum
        if windows.num_windows < self.global_batch:
            raise BaigeError(
                f"the training data holds {windows.num_windows} windows of {windows.seq_len} tokens; one step needs "
                f"{self.global_batch} (data-parallel ranks x batch_size x grad_accum)"
            )
        self.epoch, self.position = 0, 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            n = self.windows.num_windows
            self._order = np.random.default_rng(self.seed + self.epoch).permutation(n) if self.shuffle else np.arange(n)
        return self._order

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``grad_accum`` micro-batches for the next step: (input_ids, labels), each (B, T) int64,
        plus (B, T) bool document starts when the loader was built with ``documents``."""
        if self.position + self.global_batch > self.windows.num_windows:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        order = self._epoch_order()
        B = self.batch_size
        micro = []
        for a in range(self.grad_accum):
            start = self.position + (a * self.dp_size + self.dp_rank) * B
            micro.append(self.windows.batch(order[start : start + B], self.documents))
        self.position += self.global_batch
        return micro

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def eval_batches(
    windows: PackedWindows, batch_size: int, dp_size: int, dp_rank: int, max_batches: int = 0, documents: bool = False
):
    """This rank's evaluation micro-batches, in file order: rounds of ``dp_size * batch_size`` windows.

    ``max_batches`` > 0 stops after that many rounds. Yields (input_ids, labels), each (B, T) int64
    (plus (B, T) bool document starts with ``documents``).
    Raises BaigeError when the eval data holds less than one round.
    """
    rounds = windows.num_windows // (dp_size * batch_size)
    if rounds == 0:
        raise BaigeError(
            f"the eval data holds {windows.num_windows} windows; one evaluation batch needs {dp_size * batch_size}"
        )
    if max_batches > 0:
        rounds = min(rounds, max_batches)
    for r in range(rounds):
        start = (r * dp_size + dp_rank) * batch_size
        yield windows.batch(range(start, start + batch_size), documents)
