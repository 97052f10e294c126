"""Host-memory reuse for CPU training: freed tensors' memory stays in the process for the next step.

A training step allocates and frees the same large tensors every step (activations, the weights' bf16
copies, every gradient: hundreds of MB for a 135M-parameter model). glibc's malloc returns such memory to
the kernel when it is freed (chunks above ``M_MMAP_THRESHOLD`` are unmapped, and a free top of the heap
above ``M_TRIM_THRESHOLD`` is trimmed), so the next step touches fresh pages: one minor page fault per
4 KiB, each zero-filled by the kernel (system time that grows with the step's allocations). Raising both
thresholds (``mallopt``, glibc's documented tuning; the same as the ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` environment variables) keeps allocations up to :data:`MMAP_THRESHOLD` on the
heap and freed heap memory in the process, as a caching allocator would: the process's resident memory
stays at its peak instead of shrinking between steps. The fault counts and the step time it saves are
measured in docs/commands/train.md ("Where a bf16 training step's time goes").

Elsewhere (musl, macOS: no ``mallopt``) nothing changes.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h parameter numbers
# glibc's largest M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX = 4 MiB * sizeof(long)); larger
# chunks are always mapped (and faulted in) afresh
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # an int: never trim a free top of the heap below 2 GiB

_applied: list[bool] = []


def keep_freed_memory() -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` to :data:`MMAP_THRESHOLD` and ``M_TRIM_THRESHOLD`` to
    :data:`TRIM_THRESHOLD` for this process (once; later calls return the first result). Returns whether
    both took effect (False without glibc's ``mallopt``)."""
    if not _applied:
        try:
            mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's on Linux
        except (OSError, AttributeError, TypeError):
            _applied.append(False)
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        _applied.append(ok)
    return _applied[0]
