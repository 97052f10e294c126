"""The KV-transfer transport interface: how block bytes travel between a producer and a consumer.

A transport only moves bytes. Which blocks a transfer may read, pinning and releasing them, where
they land in the consumer's cache and what happens when a pull fails are the engine side's
(:mod:`.manager`). A transport implements :class:`KVConnector` and is listed in
:mod:`.registry`, whose order is ``"auto"``'s preference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol


class TransferError(RuntimeError):
    """A pull that did not deliver every block it asked for: refused by the producer (an unknown or
    expired transfer, a fingerprint that differs, a block not in the transfer), cut off, or past its
    deadline. The consumer computes the prompt itself."""


class BlockSource(Protocol):
    """The producer side's blocks, as a transport's server reads them."""

    def open(self, transfer_id: str, block_ids: list[int], fingerprint: str) -> BlockReader:
        """The asked blocks of a pinned transfer. Raises TransferError when the pull is refused (an
        unknown, pulled or expired transfer, a block not in it, another model fingerprint)."""


class BlockReader(Protocol):
    """What :meth:`BlockSource.open` returns: iterating gives each block's bytes in order
    (:func:`.blocks.block_bytes` long each), read from the cache as the transport asks for them;
    the transport calls :meth:`close` exactly once when the pull is over, sent whole or not (the
    producer then releases the transfer's blocks)."""

    def __iter__(self) -> Iterator[memoryview]: ...

    def close(self) -> None: ...


# a consumer's landing function: (position in the pull's block list, the block's bytes)
BlockSink = Callable[[int, memoryview], None]


class KVConnector(ABC):
    """One transport. A producer calls :meth:`serve` once; a consumer calls :meth:`pull` from its
    worker threads (concurrently: each call uses its own connection); :meth:`close` stops both."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def unavailable(cls) -> str | None:
        """None when this transport can run here, else why not (one line: a missing package)."""

    @abstractmethod
    def serve(self, host: str, port: int, source: BlockSource) -> int:
        """Start answering pulls on a background thread, reading blocks from ``source``; returns the
        port bound (``port`` 0: a free one). Raises BaigeError when the address cannot be bound."""

    @abstractmethod
    def pull(
        self,
        host: str,
        port: int,
        transfer_id: str,
        block_ids: list[int],
        fingerprint: str,
        sink: BlockSink,
        timeout: float,
    ) -> int:
        """Fetch the producer's ``block_ids`` of ``transfer_id``, calling ``sink`` with each block as
        it arrives; returns the bytes received. Blocks the calling thread at most ``timeout`` seconds.
        Raises TransferError."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release the transport's resources."""
