"""The ZeroMQ transport (pyzmq): the portable one, TCP between any two hosts, no special hardware.

The producer binds a ROUTER socket served by one background thread. A consumer's pull opens its own
DEALER socket and sends one request message ``[b"pull", JSON {transfer_id, block_ids,
fingerprint}]``; the producer answers with a header message ``[b"ok", JSON {"num_blocks"}]`` (or
``[b"error", reason]``), then one message ``[b"block", index as 4 bytes little-endian, bytes]``
per block, each sent as soon as it is read from the cache (zero-copy from the block's buffer); the
consumer writes them into its cache :data:`WRITE_BATCH` blocks at a time while the next ones travel.
ZeroMQ does the framing, reconnection and queueing; the messages above are the whole protocol.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time

from baige.errors import BaigeError
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.kv_transfer.blocks import write_blocks
from baige.runtime.infer.kv_transfer.connector import BlockSource, KVConnector, TransferError

logger = logging.getLogger("baige.kv_transfer")

POLL_MS = 100  # the server thread's wake-up to notice close()
WRITE_BATCH = 16  # blocks a consumer receives before it writes them into its cache at once


class ZmqConnector(KVConnector):
    """KV blocks over ZeroMQ ROUTER/DEALER sockets (TCP)."""

    name = "zmq"

    def __init__(self, kv: KVCache) -> None:
        import zmq

        super().__init__(kv)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            import zmq  # noqa: F401
        except ImportError:
            return "pyzmq is not installed (pip install pyzmq)"
        return None

    # ---- producer ---------------------------------------------------------------------------
    def serve(self, host: str, port: int, source: BlockSource) -> int:
        sock, port = bind(self._ctx, host, port)
        self._thread = threading.Thread(target=self._serve, args=(sock, source), name="baige-kv-server", daemon=True)
        self._thread.start()
        return port

    def _serve(self, sock, source: BlockSource) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                ident, *frames = sock.recv_multipart()
                try:
                    self._answer(sock, ident, frames, source)
                except zmq.ZMQError as e:  # the consumer went away mid-answer: its pull fails there
                    logger.warning("KV pull answer cut off: %s", e)
        finally:
            sock.close()

    def _answer(self, sock, ident: bytes, frames: list[bytes], source: BlockSource) -> None:
        try:
            if len(frames) != 2 or frames[0] != b"pull":
                raise TransferError("not a pull request")
            req = json.loads(frames[1])
            blocks = source.open(str(req["transfer_id"]), [int(b) for b in req["block_ids"]], str(req["fingerprint"]))
        except (TransferError, ValueError, KeyError, TypeError) as e:
            sock.send_multipart([ident, b"error", str(e).encode()[:500]])
            return
        sent = 0
        try:
            sock.send_multipart([ident, b"ok", json.dumps({"num_blocks": len(blocks.block_ids)}).encode()])
            for i, payload in enumerate(blocks):
                sock.send_multipart([ident, b"block", struct.pack("<I", i), payload], copy=False)
                sent += 1
        finally:
            blocks.close(ok=sent == len(blocks.block_ids))

    # ---- consumer ---------------------------------------------------------------------------
    def pull(
        self, host: str, port: int, transfer_id: str, src: list[int], dst: list[int], fingerprint: str, timeout: float
    ) -> int:
        zmq = self._zmq
        deadline = time.monotonic() + timeout
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        where = f"{host}:{port}"
        received = 0
        try:
            sock.connect(f"tcp://{where}")
            req = {"transfer_id": transfer_id, "block_ids": src, "fingerprint": fingerprint}
            sock.send_multipart([b"pull", json.dumps(req).encode()])
            frames = recv(sock, deadline, where)
            if frames[0] != b"ok":
                reason = bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else "?"
                raise TransferError(f"the producer at {where} refused the pull: {reason}")
            pending: list[memoryview] = []
            for i in range(len(src)):
                frames = recv(sock, deadline, where)
                if len(frames) != 3 or frames[0] != b"block" or struct.unpack("<I", frames[1])[0] != i:
                    raise TransferError(f"block {i} of the pull from {where} came malformed or out of order")
                pending.append(frames[2])
                received += len(frames[2])
                if len(pending) == WRITE_BATCH or i == len(src) - 1:
                    write_blocks(self.kv, dst[i + 1 - len(pending) : i + 1], pending)
                    pending = []
        except zmq.ZMQError as e:
            raise TransferError(f"the pull from {where} failed: {e}") from None
        finally:
            sock.close()
        return received

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def bind(ctx, host: str, port: int):
    """A ROUTER socket of ``ctx`` bound to ``host:port`` (0: a free port): ``(socket, port)``. Raises
    BaigeError when the address cannot be bound."""
    import zmq

    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        sock.close()
        raise BaigeError(f"--kv-transfer-config: cannot bind the KV block server to {host}:{port} ({e})") from None
    return sock, port


def recv(sock, deadline: float, where: str) -> list[memoryview]:
    """One answer message's frames (buffers, not copies). Raises TransferError past ``deadline``."""
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0 or not sock.poll(left_ms):
        raise TransferError(f"the pull from {where} timed out")
    return [f.buffer for f in sock.recv_multipart(copy=False)]
