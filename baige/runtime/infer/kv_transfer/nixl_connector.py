"""The NIXL transport (NVIDIA Inference Xfer Library, the PyPI ``nixl`` package; UCX backend): the
consumer READs the producer's blocks straight from its registered KV pools into its own (RDMA where the
network has it, TCP or shared memory otherwise), as vLLM's NixlConnector does.

Both sides register their pools with a NIXL agent. A pull asks the producer over a ZeroMQ side channel
(vLLM's handshake does the same): ``[b"pull", JSON {transfer_id, block_ids, fingerprint, timeout}]``;
the producer checks it (:meth:`BlockSource.open`) and answers ``[b"ok", JSON {agent, bases,
blocks_total}, agent metadata]`` (its pools' base addresses and block count) or ``[b"error",
reason]``. The consumer then builds one descriptor per (pool, KV head, block) on each side, the
block-granular slices of the ``(n_kv_heads, blocks, block_size, head_dim)`` pools, and issues one READ
whose notification ``done <transfer_id>`` tells the producer's side-channel thread to release the
transfer. A pull the consumer gives up on is released on the producer ``timeout`` + :data:`GRACE_S`
seconds after it was accepted.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
import uuid

from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.kv_transfer.blocks import block_bytes
from baige.runtime.infer.kv_transfer.connector import BlockReader, BlockSource, KVConnector, TransferError
from baige.runtime.infer.kv_transfer.zmq_connector import POLL_MS, bind, recv

logger = logging.getLogger("baige.kv_transfer")

GRACE_S = 5.0  # past a pull's own timeout, the producer releases a transfer never confirmed
# The NIXL agents this process has made. NIXL's UCX backend loads the libnl-route bundled with the wheel, whose
# destructor crashes (SIGSEGV) when such a process exits (nixl-cu12 1.x: a graceful `baige serve` shutdown ended
# with signal 11), so a CLI command that made one ends without the C libraries' destructors (baige.cli.main).
agents_made = 0
MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # the meta-package, then its CUDA builds


def _nixl_api():
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


class NixlConnector(KVConnector):
    """KV blocks by NIXL READs from the producer's registered pools (a ZeroMQ side channel for the
    handshake and the check of each pull)."""

    name = "nixl"

    def __init__(self, kv: KVCache) -> None:
        import zmq

        super().__init__(kv)
        api = _nixl_api()
        self._zmq, self._ctx = zmq, zmq.Context()
        self.agent_name = f"baige-{uuid.uuid4().hex}"
        global agents_made
        agents_made += 1  # before the agent: its backend loads the library even if a later step fails
        self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(backends=["UCX"]))
        self._pools = [*kv.k, *kv.v]
        self.agent.register_memory(self._pools)
        self._mem = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self._dev = kv.device.index or 0
        self._lock = threading.Lock()  # the agent, shared by the pull workers and the side-channel thread
        self._remotes: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        if _nixl_api() is None:
            return "NIXL is not installed (pip install nixl, or nixl-cu12)"
        return None

    def _descs(self, bases: list[int], blocks_total: int, block_ids: list[int]):
        """NIXL descriptors of ``block_ids`` in pools at ``bases`` of ``blocks_total`` blocks each:
        per pool, per KV head, per block, ``block_size * head_dim`` elements."""
        heads, _, size, dim = self._pools[0].shape
        span = size * dim * self._pools[0].element_size()
        rows = [
            (base + (h * blocks_total + b) * span, span, self._dev)
            for base in bases
            for h in range(heads)
            for b in block_ids
        ]
        return self.agent.get_xfer_descs(rows, self._mem)

    # ---- producer ---------------------------------------------------------------------------
    def serve(self, host: str, port: int, source: BlockSource) -> int:
        sock, port = bind(self._ctx, host, port)
        self._thread = threading.Thread(target=self._serve, args=(sock, source), name="baige-kv-nixl", daemon=True)
        self._thread.start()
        return port

    def _serve(self, sock, source: BlockSource) -> None:
        open_pulls: dict[str, tuple[BlockReader, float]] = {}
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    ident, *frames = sock.recv_multipart()
                    self._answer(sock, ident, frames, source, open_pulls)
                with self._lock:  # kv_both: the pull workers use the agent too
                    notifs = self.agent.get_new_notifs()
                for msgs in notifs.values():
                    for msg in msgs:
                        kind, _, transfer_id = bytes(msg).decode(errors="replace").partition(" ")
                        if kind == "done" and transfer_id in open_pulls:
                            open_pulls.pop(transfer_id)[0].close(ok=True)
                now = time.monotonic()
                for transfer_id in [t for t, (_, deadline) in open_pulls.items() if now > deadline]:
                    logger.warning("KV pull of transfer %s was never confirmed; releasing it", transfer_id)
                    open_pulls.pop(transfer_id)[0].close(ok=False)
        finally:
            sock.close()

    def _answer(self, sock, ident: bytes, frames: list[bytes], source: BlockSource, open_pulls: dict) -> None:
        try:
            if len(frames) != 2 or frames[0] != b"pull":
                raise TransferError("not a pull request")
            req = json.loads(frames[1])
            transfer_id = str(req["transfer_id"])
            reader = source.open(transfer_id, [int(b) for b in req["block_ids"]], str(req["fingerprint"]))
        except (TransferError, ValueError, KeyError, TypeError) as e:
            sock.send_multipart([ident, b"error", str(e).encode()[:500]])
            return
        open_pulls[transfer_id] = (reader, time.monotonic() + float(req.get("timeout", 30)) + GRACE_S)
        header = {
            "agent": self.agent_name,
            "bases": [t.data_ptr() for t in self._pools],
            "blocks_total": self._pools[0].shape[1],
        }
        with self._lock:
            meta = self.agent.get_agent_metadata()
        sock.send_multipart([ident, b"ok", json.dumps(header).encode(), meta])

    # ---- consumer ---------------------------------------------------------------------------
    def pull(
        self, host: str, port: int, transfer_id: str, src: list[int], dst: list[int], fingerprint: str, timeout: float
    ) -> int:
        zmq = self._zmq
        deadline = time.monotonic() + timeout
        where = f"{host}:{port}"
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{where}")
            req = {"transfer_id": transfer_id, "block_ids": src, "fingerprint": fingerprint, "timeout": timeout}
            sock.send_multipart([b"pull", json.dumps(req).encode()])
            frames = recv(sock, deadline, where)
        except zmq.ZMQError as e:
            raise TransferError(f"the pull from {where} failed: {e}") from None
        finally:
            sock.close()
        if frames[0] != b"ok" or len(frames) != 3:
            reason = bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else "?"
            raise TransferError(f"the producer at {where} refused the pull: {reason}")
        header = json.loads(bytes(frames[1]))
        self._read(header, bytes(frames[2]), transfer_id, src, dst, deadline, where)
        return len(dst) * block_bytes(self.kv)

    def _read(
        self, header: dict, meta: bytes, transfer_id: str, src: list[int], dst: list[int], deadline: float, where: str
    ) -> None:
        """One NIXL READ of the producer's ``src`` blocks into ``dst``, waited for until ``deadline``.
        Raises TransferError (the handle is released, which stops the transfer)."""
        remote = header["agent"]
        with self._lock:
            if remote not in self._remotes:
                self.agent.add_remote_agent(meta)
                self._remotes.add(remote)
            handle = self.agent.initialize_xfer(
                "READ",
                self._descs([t.data_ptr() for t in self._pools], self._pools[0].shape[1], dst),
                self._descs(header["bases"], header["blocks_total"], src),
                remote,
                f"done {transfer_id}".encode(),
            )
            state = self.agent.transfer(handle)
        try:
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransferError(f"the NIXL read from {where} {'timed out' if state == 'PROC' else 'failed'}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
