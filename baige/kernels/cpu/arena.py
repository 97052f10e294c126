"""Host memory for the native CPU kernels: a bump allocator for weights they stream at every decode
step (the repacked integer-dot tiles of :mod:`baige.kernels.cpu.qlinear`), and lazily zeroed pages for
the KV pools (:func:`zeroed_pages`); and :func:`keep_freed_heap`, which stops glibc handing freed
temporaries back to the OS.

Why: a batch-1 decode step reads every weight once, as ~200 separate matrices of 0.1-1 MB. In
separate allocations on 4 KiB pages the stream pays a TLB miss per page and a prefetcher restart per
matrix; placed back to back, in the order of first use (= execution order), in chunks advised as
transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux; works where THP is ``always`` or
``madvise``), the same reads take less time, int4 and int8 alike (measured: docs/benchmarks/archive.md,
"Repacked integer-dot tiles and the weight arena").

Each placed tensor is a view into a chunk; a chunk is freed when its last view is. Chunks are
reserved with ``torch.empty`` (untouched pages cost no memory), so the unused tail of the last chunk
costs address space only.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

CHUNK = 256 << 20  # bytes reserved per chunk (address space; pages are allocated when written)
HUGE = 2 << 20  # the x86-64 huge page
_MADV_HUGEPAGE = 14  # linux/mman.h


def _advise_huge(addr: int, size: int) -> None:
    """Ask Linux to back [addr, addr + size) with huge pages; silently nothing elsewhere or on refusal."""
    if sys.platform != "linux" or size <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(addr, size, _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


class Arena:
    """Places tensors back to back (64-byte aligned) in huge-page-advised chunks."""

    def __init__(self, chunk: int = CHUNK):
        self._chunk_size = chunk
        self._buf: torch.Tensor | None = None  # the current chunk (uint8)
        self._off = 0
        self._lock = threading.Lock()

    def _new_chunk(self, need: int) -> None:
        size = max(self._chunk_size, need) + HUGE
        buf = torch.empty(size, dtype=torch.uint8)
        start = (-buf.data_ptr()) % HUGE  # first huge-page boundary inside the chunk
        _advise_huge(buf.data_ptr() + start, (size - start) // HUGE * HUGE)
        self._buf, self._off = buf, start

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` (CPU) inside the arena, same dtype and shape."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            if self._buf is None or self._off + nbytes > self._buf.numel():
                self._new_chunk(nbytes)
            view = self._buf[self._off : self._off + nbytes]
            self._off += (nbytes + 63) // 64 * 64
        out = view.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


weights = Arena()  # the process-wide arena of streamed weights


def to_weight_arena(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` placed in the process-wide arena (:data:`weights`): the next one placed lands
    right after it."""
    return weights.place(t)


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on fresh anonymous memory (``mmap``): the OS hands out zero pages and allocates
    each one on its first write, so nothing is touched up front (``torch.zeros`` writes every page at
    once, which dominated an engine's start-up on a VM with slow first touches; measured:
    docs/benchmarks/archive.md, "Start-up, page faults and bf16 prefill ops") and the pages never
    written cost no memory. Small pages (see the comment in the code).

    Args:
        shape: the tensor's shape; dtype: its dtype (CPU).
    Returns:
        a contiguous CPU tensor of zeros; its memory is released when the last view of it is.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Python's mmap(-1) is a shared anonymous mapping (shmem), page aligned, which Linux does not back
    # with anonymous huge pages. Kept so: a private, huge-page-advised pool (MAP_PRIVATE + madvise) made
    # the first offline-throughput run slower (each first touch zeroes a 2 MiB page, and more memory is
    # backed) and later runs no faster (measured: docs/benchmarks/archive.md, "AVX-512 paged attention,
    # native prefill attention, one-call decode step").
    t = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return t.view(dtype).view(shape)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h


def keep_freed_heap(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Make glibc's malloc keep freed memory for reuse: blocks under ``mmap_threshold`` bytes come from
    the heap instead of a fresh ``mmap`` each, and up to ``trim_threshold`` free bytes stay mapped.

    Why: a prefill step allocates and frees tens of activation tensors of 1-30 MB; by default each is a
    fresh mapping whose every 4 KiB page faults on first write, so an offline-throughput run takes
    hundreds of thousands of page faults, and with this almost none (measured: docs/benchmarks/archive.md,
    "Start-up, page faults and bf16 prefill ops"). vLLM's CPU backend gets the same from tcmalloc via
    ``LD_PRELOAD``. 32 MiB is the ceiling of glibc's own dynamic threshold (``DEFAULT_MMAP_THRESHOLD_MAX``
    on 64-bit). Process-wide and idempotent (every CPU engine calls it).

    Returns:
        True when both settings took (glibc on Linux), False elsewhere (nothing changed).
    """
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
        )
    except (OSError, AttributeError):
        return False
