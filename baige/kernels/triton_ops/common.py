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


def router_topk_buffers(
    router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a router top-k kernel reads and writes: ``(logits, bias, weights, ids)``: the (T, E) logits with a
    unit last stride, the (E,) bias contiguous (the logits as an unread pointer when there is none), and the
    empty outputs ``weights`` (T, top_k) fp32 and ``ids`` (T, top_k) int64."""
    T = router_logits.shape[0]
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    weights = new_empty((T, top_k), torch.float32, logits.device)
    ids = new_empty((T, top_k), torch.int64, logits.device)
    return logits, bias, weights, ids
