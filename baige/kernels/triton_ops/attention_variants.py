"""The sliding window, attention sinks and logit soft-cap of the Triton attention kernels (flash attention
forward and backward, paged attention), with the meanings of :func:`baige.kernels.attention`: a query at
position p sees keys ``p - w < s <= p``; a sink is one logit per query head in every row's softmax
denominator that carries no value; a soft-cap c maps a score x to ``c * tanh(x / c)`` before masking.

The kernels score in base-2 units (``scale * log2(e) * q.k``, exponentials by ``exp2``), so the sinks go
in as ``sink * log2(e)`` and the cap as ``c * log2(e)``: ``c tanh(x / c) log2(e) = c' tanh(x' / c')`` with
``x' = x log2(e)``, ``c' = c log2(e)``. Each variant is a ``constexpr`` flag of the kernels, so the plain
causal specialisation compiles exactly as without them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def softcap(x, cap):
    """``cap * tanh(x / cap)`` elementwise (fp32). ``tanh(a) = sign(a) (1 - e^{-2|a|}) / (1 + e^{-2|a|})``:
    no overflow for any ``|a|`` (``e^{-2|a|}`` only underflows to 0, giving +-1); the constant is
    ``2 log2(e)``, so ``exp2`` gives ``e^{-2|a|}``."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x / cap))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def window_first_tile(first_pos, window, BLOCK: tl.constexpr):
    """Start of the first ``BLOCK``-key tile holding a key inside the window of the query at
    ``first_pos`` (the earliest query of a tile: later queries' windows start later); 0 when the window
    reaches key 0. Tiles before it are never read."""
    return tl.maximum(first_pos - window + 1, 0) // BLOCK * BLOCK


@triton.jit
def softmax_start(SINKS, heads, mask, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The running (max, sum) each of ``ROWS`` rows' online softmax starts from: (-inf, 0), or with sinks
    (the sink logit of the row's query head, 1): the sink then sits in the denominator with weight
    ``exp2(sink - m)`` as the max m moves, and adds no value. ``heads``: the rows' query heads (a scalar
    or (ROWS,)), read where ``mask``."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    if HAS_SINKS:
        m = tl.zeros([ROWS], tl.float32) + tl.load(SINKS + heads, mask=mask, other=0.0)
        l = tl.full([ROWS], 1.0, tl.float32)
    return m, l


@triton.jit
def online_max(m_i, qk, HAS_WINDOW: tl.constexpr):
    """The online softmax's new running max per row and the value to subtract before ``exp2``. With a
    window a row can meet a key tile wholly outside its window before its first visible key (its running
    max still -inf): it subtracts 0 there, so ``exp2(-inf - 0) = 0`` instead of NaN, and its max stays
    -inf. Without a window every row sees a key in its first tile, so both are the max."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if HAS_WINDOW:
        return m_new, tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_new


def variant_args(
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    n_heads: int,
    like: torch.Tensor,
) -> dict:
    """The kernel arguments of the variants: ``SINKS`` ((n_heads,) fp32 ``sink * log2(e)``, or ``like`` as
    an unread pointer), ``window`` (at most 2**30, so that position arithmetic stays in int32: no context
    is that long; 0 when unset) and ``cap`` (``c * log2(e)``, 0.0 when unset), and the constexpr flags
    ``HAS_SINKS``, ``HAS_WINDOW``, ``HAS_SOFTCAP``.

    Raises:
        ValueError: ``window`` < 1, ``softcap`` <= 0, or ``sinks`` not of shape (n_heads,).
    """
    if window is not None and window < 1:
        raise ValueError(f"attention: sliding window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention: softcap must be > 0, got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (n_heads,):
        raise ValueError(f"attention: sinks of shape {tuple(sinks.shape)} for {n_heads} query heads")
    return {
        "SINKS": like if sinks is None else (sinks.detach().float() * LOG2E).contiguous(),
        "window": 0 if window is None else min(int(window), 1 << 30),
        "cap": 0.0 if softcap is None else float(softcap) * LOG2E,
        "HAS_SINKS": sinks is not None,
        "HAS_WINDOW": window is not None,
        "HAS_SOFTCAP": softcap is not None,
    }
