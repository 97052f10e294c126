"""The engine side of P/D disaggregation (vLLM's NIXL-connector flow over any :class:`KVConnector`).

Producer (``kv_role`` kv_producer / kv_both): a request with ``kv_transfer_params.do_remote_decode``
runs as usual (a router sends it with ``max_tokens: 1``). When its first sequence finishes, its
prompt's blocks get one more reference (:meth:`BlockManager.hold`) instead of going back to the pool,
under a new transfer id, and the response's ``kv_transfer_params`` say where to pull them (host,
port, transfer id, block ids, the blocks' chained sha256 keys, the token count, the model
fingerprint). The transport's server thread reads pinned blocks while the engine goes on stepping;
once a pull has read them, or ``abort_request_timeout`` seconds after the prefill, the engine drops
the reference at its next step.

Consumer (kv_consumer / kv_both): a request with ``kv_transfer_params.do_remote_prefill`` gets its
blocks at once (local prefix-cache hits first, pulled only past them), is held aside
(``WAITING_FOR_REMOTE_KVS``) and pulled on a worker thread, each block written into the paged cache as
it arrives. When the pull ends the engine queues the request with all but its last prompt token
computed and the full blocks registered in its prefix cache; the first step computes the last
token (vLLM does the same: its logits give the first output token), so a transferred request
computes exactly 1 prompt token. A pull that fails or times out, or parameters that do not match
this engine and this prompt (another model fingerprint, transport, token count or block keys),
make the request compute its prompt here instead: logged, counted in ``pull_failures``, never
wrong text.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from baige.errors import BaigeError
from baige.runtime.config import KVTransferConfig
from baige.runtime.infer.block_manager import BlockManager, chain_hash
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.kv_transfer.blocks import block_bytes, model_fingerprint, read_block
from baige.runtime.infer.kv_transfer.connector import TransferError
from baige.runtime.infer.kv_transfer.registry import resolve_connector
from baige.runtime.infer.scheduler import Scheduler, Sequence

logger = logging.getLogger("baige.kv_transfer")

PULL_WORKERS = 2  # a consumer's concurrent pulls
PARAM = "kv_transfer_params"


@dataclass
class KVTransferStats:
    """Counters of one engine's transfers (``/metrics``), blocks and bytes as sent or received.

    ``pulls``: pulls that delivered every block; ``pull_failures``: requests whose pull failed, timed
    out or did not match (they computed their prompt); ``expired``: pinned prefills released unpulled;
    ``pinned``: prefills pinned now; ``block_bytes``: bytes of one block."""

    block_bytes: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    pulls: int = 0
    pull_failures: int = 0
    expired: int = 0
    pinned: int = 0


@dataclass
class _Pinned:
    """A finished prefill's blocks, kept for a consumer."""

    block_ids: list[int]
    deadline: float  # monotonic seconds
    busy: bool = False  # a pull is reading them
    done: bool = False  # pulled: released at the engine's next step


@dataclass
class _Pull:
    """One consumer pull in flight: the request's sequences and where its blocks go."""

    seqs: list[Sequence]
    dst: list[int]  # this engine's blocks to fill
    src: list[int]  # the producer's blocks, in the same order
    host: str
    port: int
    transfer_id: str
    error: BaseException | None = None
    received: int = 0
    started: float = field(default_factory=time.monotonic)


def block_keys(token_ids: list[int], block_size: int) -> list[str]:
    """Hex chained sha256 keys (:func:`chain_hash`) of a prompt's blocks, its last, partial block included."""
    keys, parent = [], None
    for i in range(0, len(token_ids), block_size):
        parent = chain_hash(parent, tuple(token_ids[i : i + block_size]))
        keys.append(parent.hex())
    return keys


class KVTransfer:
    """Pins, serves, pulls and lands KV blocks for one engine (everything but the transport).

    All methods but :meth:`open` run on the engine's thread; :meth:`open` runs on the transport's
    server thread and shares only the pinned-transfer table with it (under a lock).

    Args:
        cfg: the ``--kv-transfer-config``.
        model: the engine's model (for the fingerprint).
        kv: the engine's KV cache.
        block_manager: the engine's block manager.
    Raises:
        BaigeError: no transport available, or the block server cannot bind.
    """

    def __init__(self, cfg: KVTransferConfig, model: torch.nn.Module, kv: KVCache, block_manager: BlockManager):
        self.cfg, self.kv, self.bm = cfg, kv, block_manager
        self.connector = resolve_connector(cfg.kv_connector)(kv)
        self.engine_id = cfg.engine_id or f"baige-{uuid.uuid4().hex[:12]}"
        self.fingerprint = model_fingerprint(model, kv, block_manager.block_size)
        self.stats = KVTransferStats(block_bytes=block_bytes(kv))
        self._lock = threading.Lock()
        self._to_pin: set[str] = set()  # producer: request ids whose prefill is kept for a consumer
        self._pinned: dict[str, _Pinned] = {}
        self._params: dict[str, dict] = {}  # request id -> its response's kv_transfer_params
        self._done: queue.Queue[_Pull] = queue.Queue()
        self._todo: queue.Queue[_Pull | None] = queue.Queue()
        self._wake = threading.Event()
        # daemon threads (not an executor's, which exit would wait for): a pull stuck in a transport
        # never holds up the process's exit
        for i in range(PULL_WORKERS if cfg.kv_role != "kv_producer" else 0):
            threading.Thread(target=self._worker, name=f"baige-kv-pull-{i}", daemon=True).start()
        self.port = self.connector.serve(cfg.kv_ip, cfg.kv_port, self) if cfg.kv_role != "kv_consumer" else None
        logger.info(
            "KV transfer: %s over %s, engine %s%s",
            cfg.kv_role,
            self.connector.name,
            self.engine_id,
            f", serving blocks on {cfg.kv_ip}:{self.port}" if self.port is not None else "",
        )

    @classmethod
    def build(
        cls, cfg: KVTransferConfig | None, model: torch.nn.Module, kv: KVCache, block_manager: BlockManager
    ) -> KVTransfer | None:
        """The engine's P/D side for ``--kv-transfer-config`` (None without one). Raises BaigeError."""
        return None if cfg is None else cls(cfg, model, kv, block_manager)

    def close(self) -> None:
        for _ in range(PULL_WORKERS):
            self._todo.put(None)
        self.connector.close()

    # ---- requests (engine thread) -----------------------------------------------------------
    def on_add(self, seqs: list[Sequence], params: dict | None, scheduler: Scheduler) -> bool:
        """A new request's ``kv_transfer_params``: note a producer's pin, or start a consumer's pull.
        Returns True when the sequences were queued here (held until their pull ends).

        Raises:
            BaigeError: params that are not an object, a flag this role cannot serve, or malformed
            remote fields (the caller's 400).
        """
        if params is None:
            return False
        if not isinstance(params, dict):
            raise BaigeError(f"{PARAM} must be an object", param=PARAM)
        if params.get("do_remote_decode"):
            if self.cfg.kv_role == "kv_consumer":
                raise BaigeError(f"{PARAM}.do_remote_decode: this server is not a KV producer", param=PARAM)
            self._to_pin.add(seqs[0].request_id)
            return False
        if not params.get("do_remote_prefill"):
            return False
        if self.cfg.kv_role == "kv_producer":
            raise BaigeError(f"{PARAM}.do_remote_prefill: this server is not a KV consumer", param=PARAM)
        remote = _remote_fields(params)
        why = self._mismatch(seqs[0], remote)
        if why is None and not self.bm.can_allocate(seqs[0], len(seqs[0].token_ids)):
            why = "no free KV blocks for the prompt now"
        if why is not None:
            self._fallback(seqs[0].request_id, why)
            return False
        self._start_pull(seqs, remote, scheduler)
        return True

    def _mismatch(self, seq: Sequence, remote: dict) -> str | None:
        """Why the producer's blocks cannot stand for this prompt here (None: they can)."""
        n = len(seq.token_ids)
        if remote["remote_model_fingerprint"] != self.fingerprint:
            return "the producer's model, KV dtype or block size differs from this engine's"
        if remote["remote_kv_connector"] != self.connector.name:
            return f"the producer uses transport {remote['remote_kv_connector']!r}, this engine {self.connector.name!r}"
        if seq.lora_int_id or seq.prompt_logprobs is not None:
            return "LoRA and prompt-logprob requests compute their prompt"
        if remote["remote_num_tokens"] != n or remote["remote_block_hashes"] != block_keys(
            seq.token_ids, self.bm.block_size
        ):
            return "the producer's prompt tokens differ from this request's"
        if len(remote["remote_block_ids"]) != self.bm.blocks_needed(n):
            return "the producer sent the wrong number of blocks"
        return None

    def _fallback(self, request_id: str, why: str) -> None:
        self.stats.pull_failures += 1
        logger.warning("request %s: no KV transfer (%s); computing the prompt here", request_id, why)

    def _start_pull(self, seqs: list[Sequence], remote: dict, scheduler: Scheduler) -> None:
        seq = seqs[0]
        self.bm.allocate(seq, len(seq.token_ids))  # prefix-cache hits, then blocks for the rest
        first = seq.num_computed_tokens // self.bm.block_size
        pull = _Pull(
            seqs,
            seq.block_table[first:],
            remote["remote_block_ids"][first:],
            remote["remote_host"],
            remote["remote_port"],
            remote["remote_request_id"],
        )
        self.bm.hold(pull.dst)  # an abort meanwhile frees the sequence, never blocks still being written
        for s in seqs:
            scheduler.add(s, remote_kv=True)
        self._todo.put(pull)

    def _worker(self) -> None:
        while (pull := self._todo.get()) is not None:
            self._pull(pull)

    def _pull(self, pull: _Pull) -> None:
        """Worker thread: pull the blocks into the cache; the engine's next :meth:`poll` lands it."""
        try:
            pull.received = self.connector.pull(
                pull.host,
                pull.port,
                pull.transfer_id,
                pull.src,
                pull.dst,
                self.fingerprint,
                self.cfg.extra("transfer_timeout"),
            )
            if self.kv.device.type == "cuda":
                torch.cuda.synchronize(self.kv.device)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the request computes its prompt
            pull.error = e
        self._done.put(pull)
        self._wake.set()

    def poll(self, scheduler: Scheduler) -> None:
        """Each step: land the pulls that ended, release pulled and expired pins."""
        while True:
            try:
                pull = self._done.get_nowait()
            except queue.Empty:
                break
            self._land(pull, scheduler)
        now = time.monotonic()
        with self._lock:
            gone = [t for t, p in self._pinned.items() if p.done or (now > p.deadline and not p.busy)]
            released = [(t, self._pinned.pop(t)) for t in gone]
            self.stats.pinned = len(self._pinned)
        for transfer_id, pinned in released:
            if not pinned.done:
                self.stats.expired += 1
                logger.warning("KV transfer %s expired unpulled; its blocks are released", transfer_id)
            self.bm.release(pinned.block_ids)

    def _land(self, pull: _Pull, scheduler: Scheduler) -> None:
        self.bm.release(pull.dst)
        seq = pull.seqs[0]
        if not seq.is_finished:
            if pull.error is None:
                seq.num_computed_tokens = seq.num_cached_tokens = len(seq.token_ids) - 1
                self.bm.cache_computed_blocks(seq)
                self.stats.pulls += 1
                self.stats.blocks_received += len(pull.dst)
                self.stats.bytes_received += pull.received
            else:
                self._fallback(seq.request_id, f"{type(pull.error).__name__}: {pull.error}")
                self.bm.free(seq)
                seq.num_cached_tokens = 0
        for s in pull.seqs:
            scheduler.remote_kv_done(s)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a pull to end (an engine with nothing else to run)."""
        self._wake.wait(timeout)
        self._wake.clear()

    # ---- producer (engine thread) -----------------------------------------------------------
    def on_finish(self, seq: Sequence, reason: str) -> None:
        """Scheduler hook, before a finished sequence's blocks are freed: pin a producer's prefill."""
        if seq.index != 0 or seq.request_id not in self._to_pin:
            return
        self._to_pin.discard(seq.request_id)
        n = seq.num_prompt_tokens
        if reason == "abort" or seq.lora_int_id or seq.num_computed_tokens < n:
            return
        ids = seq.block_table[: self.bm.blocks_needed(n)]
        self.bm.hold(ids)
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._pinned[transfer_id] = _Pinned(ids, time.monotonic() + self.cfg.extra("abort_request_timeout"))
            self.stats.pinned = len(self._pinned)
        self._params[seq.request_id] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.cfg.kv_ip,
            "remote_port": self.port,
            "remote_request_id": transfer_id,
            "remote_block_ids": list(ids),
            "remote_block_hashes": block_keys(seq.token_ids[:n], self.bm.block_size),
            "remote_num_tokens": n,
            "remote_model_fingerprint": self.fingerprint,
            "remote_kv_connector": self.connector.name,
            "tp_size": 1,
        }

    def take_params(self, request_id: str) -> dict | None:
        """The ``kv_transfer_params`` of a finished request's response (None: nothing pinned)."""
        return self._params.pop(request_id, None)

    # ---- the transport's server thread ------------------------------------------------------
    def open(self, transfer_id: str, block_ids: list[int], fingerprint: str) -> Iterator[memoryview]:
        """:class:`BlockSource`: check a pull and return its blocks' bytes, in order. Raises
        TransferError (another model, an unknown, released or expired transfer, a block not in it)."""
        if fingerprint != self.fingerprint:
            raise TransferError("the consumer's model, KV dtype or block size differs from this producer's")
        with self._lock:
            pinned = self._pinned.get(transfer_id)
            if pinned is None or pinned.done or pinned.busy or time.monotonic() > pinned.deadline:
                raise TransferError(f"transfer {transfer_id} is unknown, already pulled or expired")
            if not set(block_ids) <= set(pinned.block_ids):
                raise TransferError(f"transfer {transfer_id} does not hold every block asked for")
            pinned.busy = True
        return _BlockReader(self, pinned, block_ids)


class _BlockReader:
    """One accepted pull (:class:`.connector.BlockReader`): its blocks' bytes read from the cache as
    the transport sends them; :meth:`close` counts them as sent when the pull succeeded and marks
    the transfer pulled (its blocks are released at the engine's next step)."""

    def __init__(self, owner: KVTransfer, pinned: _Pinned, block_ids: list[int]):
        self.owner, self.pinned, self.block_ids = owner, pinned, block_ids

    def __iter__(self) -> Iterator[memoryview]:
        for b in self.block_ids:
            yield read_block(self.owner.kv, b)

    def close(self, ok: bool) -> None:
        stats = self.owner.stats
        if ok:
            stats.blocks_sent += len(self.block_ids)
            stats.bytes_sent += len(self.block_ids) * stats.block_bytes
        with self.owner._lock:
            self.pinned.busy, self.pinned.done = False, True


def _remote_fields(params: dict) -> dict:
    """The consumer-side fields of ``kv_transfer_params``, type-checked. Raises BaigeError (400)."""
    kinds = {
        "remote_host": str,
        "remote_port": int,
        "remote_request_id": str,
        "remote_block_ids": list,
        "remote_block_hashes": list,
        "remote_num_tokens": int,
        "remote_model_fingerprint": str,
        "remote_kv_connector": str,
    }
    for key, kind in kinds.items():
        value = params.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BaigeError(f"{PARAM}.{key}: expected {kind.__name__}, got {type(value).__name__}", param=PARAM)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in params["remote_block_ids"]):
        raise BaigeError(f"{PARAM}.remote_block_ids: expected block ids (integers >= 0)", param=PARAM)
    if not all(isinstance(h, str) for h in params["remote_block_hashes"]):
        raise BaigeError(f"{PARAM}.remote_block_hashes: expected hex strings", param=PARAM)
    if not 0 < params["remote_port"] < 65536:
        raise BaigeError(f"{PARAM}.remote_port: not a TCP port", param=PARAM)
    return {key: params[key] for key in kinds}
