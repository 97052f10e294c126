"""PyTorch twins of the batch-invariant kernels (``cpu/invariant.c``), used by :mod:`baige.kernels.invariant`
where the native library does not run (``BAIGE_KERNELS=reference``, no compiler, no AVX2): slower, and with
their own fixed orders (so their values differ from the native kernels', never between two calls here).

Only operations whose every value PyTorch computes the same way wherever it sits in a tensor are used:
elementwise ``+ - * /``, ``sqrt``, ``reciprocal`` and casts (correctly rounded, vector and scalar loops
alike), ``max`` (exact). Sums over a dimension are :func:`tree_sum`: adjacent pairs added level by level with
elementwise adds, so a value's sum never depends on the tensor's other rows or on the thread count
(``torch.sum`` splits one long row over threads). Transcendental functions go through :func:`pointwise`:
PyTorch's vectorized loops compute a tensor's last ``numel % vector width`` values with the scalar function
(``exp``, ``silu`` ... of glibc rather than Sleef), so a value's bits would depend on its position; on a
strided copy every value takes the scalar loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_CHUNK = 1 << 22  # elements of the products tensor per linear / attention chunk


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise torch function, every value through its scalar loop: x is copied into a
    stride-2 buffer (no unit stride, so PyTorch's TensorIterator never takes the vectorized loop). Same
    shape and dtype as ``fn(x)``."""
    buf = x.new_empty(*x.shape, 2)[..., 0]  # (..., n) with stride 2 along n
    buf.copy_(x)
    return fn(buf)


def tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension by adjacent pairs, level by level, an odd level padded with a zero:
    (..., n) -> (...). Padding a row with trailing zeros does not change its sum (every level then pairs
    the same values, and adds zeros), so rows padded to a common length sum as they would alone."""
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = F.pad(t, (0, 1))
        t = t[..., 0::2] + t[..., 1::2]
    return t[..., 0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) @ (N, K)^T (+ (N,) bias) in fp32 -> (M, N) fp32: products rounded once, :func:`tree_sum` over K."""
    x, weight = x.float(), weight.float()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    cols = max(1, min(N, _CHUNK // max(1, K)))
    rows = max(1, _CHUNK // (cols * max(1, K)))
    for m0 in range(0, M, rows):
        for n0 in range(0, N, cols):
            xs, ws = x[m0 : m0 + rows, None, :], weight[None, n0 : n0 + cols, :]
            out[m0 : m0 + rows, n0 : n0 + cols] = tree_sum(xs * ws)  # (m, n, K) -> (m, n)
    return out if bias is None else out + bias.float()


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """(R, n) -> (R,) fp32 sums of squares (:func:`tree_sum`)."""
    x = x.float()
    return tree_sum(x * x)


def silu(g: torch.Tensor) -> torch.Tensor:
    """``silu(g)`` in fp32, every value through the scalar loop (:func:`pointwise`)."""
    return pointwise(F.silu, g.float())


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    table_of_row: torch.Tensor | None,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``cpu/invariant.py``'s ``attention`` (same arguments; (S, hq, d) fp32 out): each row's keys gathered and
    padded to the longest row's, scores, max, ``exp`` (:func:`pointwise`), the softmax sum and the weighted V
    sum by :func:`tree_sum` (padding-invariant: masked keys weigh an exact zero)."""
    S, hq, d = q.shape
    hk, _, bs, _ = k_cache.shape
    rows = torch.arange(S, device=q.device) if table_of_row is None else table_of_row
    out = torch.empty(S, hq, d, dtype=torch.float32, device=q.device)
    L = int(lens.max())
    pos = torch.arange(L, device=q.device)
    step = max(1, _CHUNK // max(1, hq * L * d))
    for s0 in range(0, S, step):
        sl = slice(s0, s0 + step)
        slots = tables[rows[sl]][:, pos // bs] * bs + pos % bs  # (n, L) cache slot of each key
        keep = pos[None, :] < lens[sl, None]  # (n, L)
        k = k_cache.flatten(1, 2)[:, slots].float().repeat_interleave(hq // hk, 0)  # (hq, n, L, d)
        v = v_cache.flatten(1, 2)[:, slots].float().repeat_interleave(hq // hk, 0)
        qs = q[sl].float().transpose(0, 1)  # (hq, n, d)
        scores = tree_sum(qs[:, :, None, :] * k) * scale  # (hq, n, L)
        scores = scores.masked_fill(~keep, float("-inf"))
        p = pointwise(torch.exp, scores - scores.amax(-1, keepdim=True))  # exp(-inf) = 0 at masked keys
        pv = torch.where(keep[None, :, :, None], p[..., None] * v, 0.0)  # (hq, n, L, d): garbage slots -> 0
        o = tree_sum(pv.transpose(-1, -2)) / tree_sum(p)[..., None]  # (hq, n, d)
        out[sl] = o.transpose(0, 1)
    return out
