"""Helpers shared by the Triton launchers."""

from __future__ import annotations

import torch
import triton

# Tests set this to True so every output buffer starts as NaN: an element a kernel forgets to write
# then shows up as NaN instead of passing by luck with zeros or stale memory.
FILL_NAN = False


def new_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs (NaN-filled when :data:`FILL_NAN`; integers get -1)."""
    if not FILL_NAN:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else -1
    return torch.full(shape, fill, dtype=dtype, device=device)


def block_for(n: int, minimum: int = 16) -> int:
    """The power of two >= ``n`` (and >= ``minimum``): a ``tl.arange`` extent covering ``n`` elements."""
    return max(minimum, triton.next_power_of_2(n))
