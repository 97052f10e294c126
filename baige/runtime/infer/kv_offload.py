"""A second KV tier (``--kv-offload-size``): prefix-cache blocks evicted from the paged pool are kept in
host memory (a GPU pool) or in files under a directory (a CPU pool), and a later prefix hit that misses
the pool but finds them here loads them back instead of recomputing them (vLLM's KV offloading,
SGLang's HiCache, LMCache: the same idea).

The block manager calls three methods, on the engine thread, in order with its own bookkeeping:
:meth:`KVOffload.save` when it evicts a cached block (before the block is handed out again),
:meth:`KVOffload.contains` while it walks a prompt's chain keys, and :meth:`KVOffload.load` to fill a
fresh pool block. ``save`` only snapshots the block (one copy out of the pool; an asynchronous
device-to-host copy into pinned memory on CUDA); the checksum, the file write and the LRU eviction
run on a background thread, so the engine step never waits for a write. A block still queued for
writing is served from its snapshot.

A stored block is keyed by its chain key (``block_manager.chain_hash``) under a *fingerprint* of
the model (its config, a sample of every weight tensor, the KV dtype and the pool's layout), so the
K/V of another model, dtype or block size is never read. A record is a header (magic, fingerprint,
key, the block's token ids, payload size, CRC-32 of the payload) and the payload, the block's K and V
of every layer, ``(2 * num_layers, n_kv_heads, block_size, head_dim)`` in the cache dtype. A load
checks all of it; a record that fails (a flipped byte, a truncated or renamed file, another
fingerprint) is dropped and counted as corrupted, and its tokens are computed instead.
"""

from __future__ import annotations

import hashlib
import logging
import math
import mmap
import os
import queue
import shutil
import struct
import tempfile
import threading
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.kv_cache import KVCache

logger = logging.getLogger("baige.engine")

MAGIC = b"BAIGEKV1"
_HEAD = struct.Struct("<8s32s32sIQI")  # magic, fingerprint, key, n_tokens, payload bytes, crc32
_SAMPLE = 16  # elements taken from each end of every weight tensor for the fingerprint


@dataclass
class KVOffloadStats:
    """The tier's counters since start-up (blocks, tokens and bytes) and its size now.

    Attributes:
        hit_blocks / hit_tokens: blocks (and their tokens) loaded from the tier instead of computed.
        stores: blocks written to the tier; store_bytes: their payload bytes.
        load_bytes: payload bytes loaded back into the pool.
        evictions: blocks dropped to keep the tier within its size (LRU).
        corrupted: blocks whose record failed its checks (checksum, fingerprint, key, tokens, size):
            dropped, and their tokens computed instead.
        dropped: evicted blocks not stored: the writer was ``capacity`` bytes behind (the oldest queued
            block is dropped, as the LRU would), or a write failed.
        used_bytes / capacity_bytes: payload bytes held now, and the bound.
    """

    hit_blocks: int = 0
    hit_tokens: int = 0
    stores: int = 0
    store_bytes: int = 0
    load_bytes: int = 0
    evictions: int = 0
    corrupted: int = 0
    dropped: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0


def model_fingerprint(model: torch.nn.Module, layout: tuple, salt: bytes = b"") -> bytes:
    """32-byte sha256 over the model's config, the name, shape, dtype and first/last ``_SAMPLE``
    elements of every state-dict tensor, ``layout`` (the KV dtype and the block shape) and ``salt``.
    Two checkpoints that differ anywhere in a sampled element (any training or weight update does)
    get different fingerprints."""
    h = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    h.update(repr(layout).encode())
    samples = []
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        flat = t.detach().reshape(-1)
        samples += [flat[:_SAMPLE], flat[-_SAMPLE:]] if flat.numel() else []
    if samples:
        h.update(torch.cat([s.to(torch.float64) for s in samples]).cpu().numpy().tobytes())
    h.update(salt)
    return h.digest()


class KVOffload:
    """The second tier of one engine's paged pool.

    Args:
        kv: the pool whose blocks are saved and loaded.
        capacity: the most payload bytes kept; least recently used blocks are dropped beyond it.
        fingerprint: callable returning the model fingerprint (:func:`model_fingerprint`); called again
            by :meth:`clear`, since cleared K/V came from weights that may have changed.
        directory: files under ``directory/<fingerprint hex>/`` (records already there, from an earlier
            process with the same fingerprint, are used); None: host memory, or for a CPU pool a
            temporary directory removed at :meth:`close` (and at exit).
    Raises:
        BaigeError: a directory that cannot be created or written, or a capacity below one block.
    """

    def __init__(self, kv: KVCache, capacity: int, fingerprint, directory: str | None = None):
        self.kv, self._fingerprint_fn = kv, fingerprint
        n_layers = len(kv.k)
        self.block_shape = (2 * n_layers, kv.k[0].shape[0], kv.block_size, kv.k[0].shape[-1])
        self.block_bytes = math.prod(self.block_shape) * kv.k[0].element_size()
        if capacity < self.block_bytes:
            raise BaigeError(
                f"--kv-offload-size {capacity} bytes holds no block (one block is {self.block_bytes} bytes)"
            )
        self.stats = KVOffloadStats(capacity_bytes=capacity)
        self.on_cuda = kv.device.type == "cuda"
        self._tmp = None
        if directory is None and not self.on_cuda:
            directory = self._tmp = tempfile.mkdtemp(prefix="baige-kv-offload-")
            weakref.finalize(self, shutil.rmtree, directory, True)
        self.root = Path(directory) if directory is not None else None
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> record bytes; oldest first
        self._host: dict[bytes, tuple[bytes, torch.Tensor]] = {}  # host memory: key -> (header, payload)
        self._pending: dict[bytes, tuple[tuple[int, ...], torch.Tensor, object]] = {}  # queued for writing
        self._pending_bytes = 0
        self._gen = 0
        self._queued = 0  # items put on the queue and not yet done by the writer
        self._open(fingerprint())
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._writer, name="baige-kv-offload", daemon=True)
        self._thread.start()
        where = str(self.dir) if self.root is not None else "host memory"
        logger.info("KV offload: %d bytes (%d blocks) in %s", capacity, capacity // self.block_bytes, where)

    # ---- the engine thread -----------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Whether a block with this chain key is stored or queued for storing."""
        with self._lock:
            return key in self._index or key in self._pending

    def save(self, block_id: int, key: bytes, token_ids: tuple[int, ...]) -> None:
        """Snapshot pool block ``block_id`` (chain key ``key`` over ``token_ids``) and queue it for
        the writer; a block already stored or queued only becomes the most recently used."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if key in self._pending:
                return
            while self._pending_bytes + self.block_bytes > self.stats.capacity_bytes:
                # the writer is a whole tier behind: the oldest queued block would be evicted first anyway
                del self._pending[next(iter(self._pending))]
                self._pending_bytes -= self.block_bytes
                self.stats.dropped += 1
        snap = torch.stack([t[:, block_id] for t in self.kv.k] + [t[:, block_id] for t in self.kv.v])
        event = None
        if self.on_cuda:
            host = torch.empty(snap.shape, dtype=snap.dtype, pin_memory=True)
            host.copy_(snap, non_blocking=True)
            snap, event = host, torch.cuda.Event()
            event.record()
        with self._lock:
            self._pending[key] = (token_ids, snap, event)
            self._pending_bytes += self.block_bytes
            self._put((self._gen, key))

    def load(self, block_id: int, key: bytes, token_ids: tuple[int, ...]) -> bool:
        """Copy the stored block ``key`` into pool block ``block_id``. False (nothing copied) when it is
        gone (LRU) or fails its checks (counted in ``stats.corrupted``, dropped): compute it instead."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                if key not in self._index:
                    return False
                self._index.move_to_end(key)
        if pending is not None:
            tokens, block, event = pending
            if event is not None:
                event.synchronize()
            ok = tokens == token_ids
        else:
            block = self._read_verified(key, token_ids)
            ok = block is not None
        if not ok:
            return False
        block = block.to(self.kv.device, non_blocking=True)
        n = len(self.kv.k)
        for layer in range(n):
            self.kv.k[layer][:, block_id].copy_(block[layer])
            self.kv.v[layer][:, block_id].copy_(block[n + layer])
        self.stats.hit_blocks += 1
        self.stats.hit_tokens += len(token_ids)
        self.stats.load_bytes += self.block_bytes
        return True

    def _read_verified(self, key: bytes, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The stored payload of ``key`` as ``block_shape`` in the cache dtype, or None (missing, or
        corrupted: counted, dropped from the index, its file removed by the writer)."""
        record = self._read(key)
        if record is None:
            with self._lock:
                self._forget(key)
            return None
        header, payload = record
        n = len(token_ids)
        want = _HEAD.pack(MAGIC, self.fingerprint, key, n, self.block_bytes, 0)[:-4]
        crc = zlib.crc32(payload.numpy()) if payload.numel() == self.block_bytes else None
        good = (
            len(header) == _HEAD.size + 8 * n
            and header[: _HEAD.size - 4] == want
            and struct.unpack_from("<I", header, _HEAD.size - 4)[0] == crc
            and struct.unpack_from(f"<{n}q", header, _HEAD.size) == tuple(token_ids)
        )
        if good:
            return payload.view(self.kv.dtype).view(self.block_shape)
        logger.warning("KV offload: block %s failed its checks (corrupted or stale); recomputing it", key.hex()[:16])
        self.stats.corrupted += 1
        with self._lock:
            self._forget(key)
            self._put((self._gen, key, "remove"))
        return None

    def clear(self) -> None:
        """Drop every stored and queued block (the prefix cache was reset: the weights may have
        changed) and take the fingerprint again; the writer removes the files."""
        fingerprint = self._fingerprint_fn()
        with self._lock:
            self._gen += 1
            old = list(self._index)
            self._index.clear()
            self._host.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self.stats.used_bytes = 0
            old_dir = self.dir if self.root is not None else None
            self._put((self._gen, old, "clear", old_dir))
            # the same weights: the directory's files are the generation just dropped (the writer removes them)
            self._open(fingerprint, scan=old_dir is None or old_dir.name != fingerprint.hex())

    def flush(self) -> None:
        """Wait until every queued block is written (tests, benchmarks, :meth:`close`)."""
        with self._idle:
            self._idle.wait_for(lambda: self._queued == 0)

    def close(self) -> None:
        """Stop the writer (queued blocks are written first) and remove a temporary directory."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _put(self, item: tuple) -> None:
        """Queue work for the writer (under the lock)."""
        self._queued += 1
        self._queue.put(item)

    # ---- storage ---------------------------------------------------------------------------
    def _open(self, fingerprint: bytes, scan: bool = True) -> None:
        """Use ``fingerprint``'s records (under the lock, or before the writer starts); with ``scan``, a
        directory's records already on disk enter the LRU oldest first (a file removed meanwhile is
        passed over)."""
        self.fingerprint = fingerprint
        if self.root is None:
            return
        self.dir = self.root / fingerprint.hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            found = []
            for path in self.dir.glob("*.kv") if scan else ():
                try:
                    found.append((path.stat().st_mtime, path))
                except FileNotFoundError:  # removed by the writer since the listing
                    continue
        except OSError as e:
            raise BaigeError(f"--kv-offload-dir {self.root}: cannot use it ({e.strerror})") from None
        for _, path in sorted(found):
            try:
                self._index[bytes.fromhex(path.stem)] = self.block_bytes
            except ValueError:
                continue
        self.stats.used_bytes = len(self._index) * self.block_bytes
        for key in self._evict():
            (self.dir / f"{key.hex()}.kv").unlink(missing_ok=True)

    def _read(self, key: bytes) -> tuple[bytes, torch.Tensor] | None:
        if self.root is None:
            with self._lock:
                return self._host.get(key)
        try:
            with open(self.dir / f"{key.hex()}.kv", "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # gone (LRU, clear) or empty
            return None
        head = mm[: _HEAD.size]
        n = _HEAD.unpack(head)[3] if len(head) == _HEAD.size else 0
        end = min(_HEAD.size + 8 * n, len(mm))
        return mm[:end], torch.frombuffer(mm, dtype=torch.uint8, offset=end) if len(mm) > end else torch.empty(0)

    def _forget(self, key: bytes) -> None:
        if self._index.pop(key, None) is not None:
            self.stats.used_bytes -= self.block_bytes
            self._host.pop(key, None)

    def _evict(self) -> list[bytes]:
        """Drop least recently used keys until the tier fits its capacity (under the lock)."""
        victims = []
        while self.stats.used_bytes > self.stats.capacity_bytes:
            key, _ = self._index.popitem(last=False)
            self._host.pop(key, None)
            self.stats.used_bytes -= self.block_bytes
            self.stats.evictions += 1
            victims.append(key)
        return victims

    # ---- the writer thread -----------------------------------------------------------------
    def _writer(self) -> None:
        while (item := self._queue.get()) is not None:
            if len(item) == 2:
                self._store(*item)
            elif item[2] == "remove":
                with self._lock:
                    stored = item[1] in self._index
                if not stored and self.root is not None:
                    (self.dir / f"{item[1].hex()}.kv").unlink(missing_ok=True)
            elif item[3] is not None:  # clear: the old generation's files
                for key in item[1]:
                    (item[3] / f"{key.hex()}.kv").unlink(missing_ok=True)
            with self._idle:
                self._queued -= 1
                self._idle.notify_all()

    def _store(self, gen: int, key: bytes) -> None:
        with self._lock:
            if gen != self._gen or key not in self._pending:
                return
            tokens, snap, event = self._pending[key]
            directory = self.dir if self.root is not None else None
            fingerprint = self.fingerprint
        if event is not None:
            event.synchronize()
        payload = snap.reshape(-1).view(torch.uint8)
        header = _HEAD.pack(MAGIC, fingerprint, key, len(tokens), payload.numel(), zlib.crc32(payload.numpy()))
        header += struct.pack(f"<{len(tokens)}q", *tokens)
        written = True
        if directory is not None:
            path = directory / f"{key.hex()}.kv"
            try:
                with open(path.with_suffix(".tmp"), "wb") as f:
                    f.write(header)
                    f.write(payload.numpy().data)
                os.replace(path.with_suffix(".tmp"), path)
            except OSError as e:  # a full or vanished disk: the block is not kept (counted), the engine goes on
                logger.warning("KV offload: cannot write %s (%s); block not stored", path, e.strerror)
                path.with_suffix(".tmp").unlink(missing_ok=True)
                written = False
        with self._lock:
            dropped_meanwhile = self._pending.pop(key, None) is None  # by save(), the writer being behind
            if not dropped_meanwhile:
                self._pending_bytes -= self.block_bytes
            if not written:
                self.stats.dropped += not dropped_meanwhile
                victims = []
            elif gen != self._gen or dropped_meanwhile:
                victims = [key]
            else:
                if directory is None:
                    self._host[key] = (header, payload)
                self._index[key] = self.block_bytes
                self.stats.used_bytes += self.block_bytes
                self.stats.stores += 1
                self.stats.store_bytes += self.block_bytes
                victims = self._evict()
        if directory is not None:
            for victim in victims:
                (directory / f"{victim.hex()}.kv").unlink(missing_ok=True)


def attach_kv_offload(cfg: EngineConfig, model: torch.nn.Module, kv: KVCache, block_manager) -> KVOffload | None:
    """The engine's second tier when ``cfg.kv_offload_size`` is set (None otherwise), attached as
    ``block_manager.offload``. With LoRA on, the fingerprint is salted per process: adapter ids are
    this process's own, so its blocks are never shared with another process. Raises BaigeError as
    :class:`KVOffload`."""
    if cfg.kv_offload_size is None:
        return None
    salt = os.urandom(16) if cfg.enable_lora else b""
    layout = (str(kv.dtype), len(kv.k), tuple(kv.k[0].shape[:1] + kv.k[0].shape[2:]))  # dtype, layers, (H, bs, D)
    tier = KVOffload(kv, cfg.kv_offload_size, lambda: model_fingerprint(model, layout, salt), cfg.kv_offload_dir)
    block_manager.offload = tier
    return tier
