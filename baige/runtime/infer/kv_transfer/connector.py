"""The KV-transfer transport interface: how a transfer's blocks travel from a producer's KV cache
into a consumer's.

A transport only moves blocks. Which blocks a transfer may read, pinning and releasing them, which
consumer blocks they land in and what happens when a pull fails are the engine side's
(:mod:`.manager`). A transport implements :class:`KVConnector` and is listed in :mod:`.registry`,
whose order is ``"auto"``'s preference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar, Protocol

from baige.runtime.infer.kv_cache import KVCache


class TransferError(RuntimeError):
    """A pull that did not deliver every block it asked for: refused by the producer (an unknown or
    expired transfer, a fingerprint that differs, a block not in the transfer), cut off, or past its
    deadline. The consumer computes the prompt itself."""


class BlockReader(Protocol):
    """One accepted pull on the producer (:meth:`BlockSource.open`). ``block_ids``: the blocks it
    reads; iterating gives each one's bytes in order (:func:`.blocks.block_bytes` long each, read
    from the cache as the transport asks: for transports that copy bytes). The transport calls
    :meth:`close` exactly once when the pull is over (``ok``: every block reached the consumer);
    the producer then releases the transfer's blocks."""

    block_ids: list[int]

    def __iter__(self) -> Iterator[memoryview]: ...

    def close(self, ok: bool) -> None: ...


class BlockSource(Protocol):
    """The producer's side of pulls, as a transport's server calls it."""

    def open(self, transfer_id: str, block_ids: list[int], fingerprint: str) -> BlockReader:
        """Accept a pull of ``block_ids`` of a pinned transfer. Raises TransferError when it is
        refused (an unknown, pulled or expired transfer, a block not in it, another model
        fingerprint)."""


class KVConnector(ABC):
    """One transport, built over an engine's KV cache (vLLM's ``register_kv_caches``: a transport
    may register the pools' memory). A producer calls :meth:`serve` once; a consumer calls
    :meth:`pull` from its worker threads, concurrently; :meth:`close` stops both.

    Args:
        kv: the engine's KV cache (its pools are read for a producer, written for a consumer).
    """

    name: ClassVar[str]

    def __init__(self, kv: KVCache):
        self.kv = kv

    @classmethod
    @abstractmethod
    def unavailable(cls) -> str | None:
        """None when this transport can run here, else why not (one line: a missing package)."""

    @abstractmethod
    def serve(self, host: str, port: int, source: BlockSource) -> int:
        """Start answering pulls on a background thread; returns the TCP port bound (``port`` 0: a
        free one). Raises BaigeError when the address cannot be bound."""

    @abstractmethod
    def pull(
        self, host: str, port: int, transfer_id: str, src: list[int], dst: list[int], fingerprint: str, timeout: float
    ) -> int:
        """Copy the producer's blocks ``src`` of ``transfer_id`` into this cache's blocks ``dst`` (same
        length, same order); returns the bytes received. Blocks the calling thread at most ``timeout``
        seconds, and once it returns or raises nothing writes into ``dst`` any more. Raises
        TransferError."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release the transport's resources."""
