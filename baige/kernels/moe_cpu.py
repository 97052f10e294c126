"""The routed experts of CPU inference (no autograd): :func:`baige.kernels.fused_moe`'s CPU path.

The reference's grouped formulation (pairs sorted by expert, one SwiGLU matmul chain per expert on
its contiguous slice, one ``index_add`` combine; :func:`baige.kernels.reference.fused_moe`), with each
expert's matmuls picked by its row count:

- at most :data:`NATIVE_SKIP_ROWS` rows (decode, small batches): :func:`few_rows_linear`, the
  native kernels that read each weight row once for all rows (faster than a tiled GEMM there: the
  weights' bandwidth is the bound);
- more fp32 rows with the native library's AVX-512 variants: ``moe.c`` (:func:`baige.kernels.cpu.ops.
  moe_experts`), every such expert in one call: rows transposed into 16-wide columns, gate/up and
  SwiGLU in registers, the down product from the activations the first product left, no padded
  rows past each expert's count but the last vector's lanes. Measured on an AMD EPYC with full-width
  AVX-512: faster than the oneDNN path below at tens of rows per expert, slower than few_rows_linear
  at one or two rows per expert but faster at eight (hence the threshold between);
- more bf16 rows with the ``avx512_amx`` variant: ``moe_amx.c``, the same transposed scheme on AMX
  tiles (TDPBF16PS: 16 x 16 fp32 += 16 x 32 bf16 by 32 x 16 bf16), the weights read in place as the
  tiles' A operand; measured in docs/benchmarks/archive.md ("AMX experts: MoE forward vs
  transformers");
- more fp32 rows elsewhere (AVX2 variants, no native library): oneDNN's matmul computing the
  transposed products ``W13_e @ rows.T`` (2I, c) and ``W2_e @ act.T`` (H, c), ``c`` rounded up to a
  multiple of :data:`ROW_PAD` (the pad rows are the next expert's rows or zeros; their columns are
  dropped): oneDNN's fp32 kernels run these shapes faster with the expert's weight as the left
  operand and a column count a multiple of 16, and the gate and up halves of ``W13_e @ rows.T`` are
  contiguous row blocks, so SwiGLU writes its activations in place without a copy (on the same host
  faster than ``rows @ W.T`` through oneDNN, and than PyTorch's ``F.linear``, whose MKL sgemm runs its
  AVX2 code on AMD: docs/benchmarks/archive.md, "MoE forward vs transformers through oneDNN");
- anything else (bf16/fp16 past the native rows, oneDNN missing): ``F.linear`` in the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baige.kernels.dense import FEW_ROWS, few_rows_linear, onednn_linear, onednn_takes

ROW_PAD = 16  # the transposed path's column count is rounded up to this (oneDNN's fp32 N blocking)
NATIVE_SKIP_ROWS = 4  # experts with at most this many rows stay on few_rows_linear beside moe.c


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))``,
    ``e = topk_ids[t, j]``, for CPU tensors without autograd (the caller checks).

    Args:
        x: (T, H) fp32/bf16/fp16 on the CPU. w13: (E, 2I, H), x's dtype (gate rows, then up rows).
        w2: (E, H, I), x's dtype. topk_weights: (T, k) float. topk_ids: (T, k) int64 in [0, E).
    Returns:
        (T, H) in x's dtype: the weighted combine in fp32 (x's dtype fp64: fp64), as the reference.
    """
    T, k = topk_ids.shape
    H, inter = x.shape[1], w2.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = topk_ids.reshape(-1)  # (T * k,)
    order = torch.argsort(flat, stable=True)  # (T * k,) pair indices grouped by expert
    bincount = torch.bincount(flat, minlength=w13.shape[0])  # (E,)
    counts = bincount.tolist()
    tok = order // k  # (T * k,) token of each sorted pair
    wsorted = topk_weights.reshape(-1).index_select(0, order).to(acc)  # (T * k,) routing weight of each pair
    native = _native(x, w13, w2)
    if native and x.dtype == torch.bfloat16:
        return _bf16_amx(native, x, w13, w2, tok, wsorted, bincount, counts)
    n = T * k
    transposed = (
        not native
        and onednn_takes(x, w13[0], None)
        and w2.dtype == torch.float32
        and w13.stride(-1) == 1
        and w2.stride(-1) == 1
    )
    xs = x.new_empty(n + (ROW_PAD - 1 if transposed else 0), H)  # (n [+ pad], H) sorted by expert
    torch.index_select(x, 0, tok, out=xs[:n])
    xs[n:].zero_()
    weighted = x.new_empty(n, H)  # (n, H) the experts' outputs in sorted order
    few = FEW_ROWS.get(w13.dtype, 0)
    if native:
        native = native.moe_experts(xs, _offsets(bincount), w13, w2, NATIVE_SKIP_ROWS, weighted)
    start = 0
    for e, c in enumerate(counts):
        if not c or (native and c > NATIVE_SKIP_ROWS):
            start += c
            continue
        if transposed and c > few:
            cp = -(-c // ROW_PAD) * ROW_PAD
            gate_up = onednn_linear(w13[e], xs[start : start + cp])  # (2I, cp)
            act = F.silu(gate_up[:inter], inplace=True).mul_(gate_up[inter:])  # (I, cp) contiguous
            weighted[start : start + c] = onednn_linear(w2[e], act.t()).t()[:c]  # (H, cp) -> (c, H)
        else:
            weighted[start : start + c] = _few_rows_expert(xs[start : start + c], w13[e], w2[e])
        start += c
    weighted = weighted.to(acc).mul_(wsorted[:, None])
    return torch.zeros(T, H, dtype=acc, device=x.device).index_add_(0, tok, weighted).to(x.dtype)


def _bf16_amx(
    native,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    tok: torch.Tensor,
    wsorted: torch.Tensor,
    bincount: torch.Tensor,
    counts: list[int],
) -> torch.Tensor:
    """bf16 experts under ``avx512_amx``: ``moe_amx.c`` gathers, computes and adds every expert with more
    than :data:`NATIVE_SKIP_ROWS` pairs into an fp32 (T, H) sum; the others (all, where Linux refuses
    AMX) run :func:`_few_rows_expert` and are added after. Returns (T, H) bf16."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    done = native.moe_experts_combine(x, tok, wsorted, _offsets(bincount), w13, w2, NATIVE_SKIP_ROWS, out)
    start = 0
    for e, c in enumerate(counts):
        if c and not (done and c > NATIVE_SKIP_ROWS):
            t = tok[start : start + c]
            y = _few_rows_expert(x.index_select(0, t), w13[e], w2[e])  # (c, H) bf16
            out.index_add_(0, t, y.float().mul_(wsorted[start : start + c, None]))
        start += c
    return out.to(x.dtype)


def _few_rows_expert(rows: torch.Tensor, w13e: torch.Tensor, w2e: torch.Tensor) -> torch.Tensor:
    """One expert on its (c, H) rows through :func:`few_rows_linear`: ``w2e @ (silu(gate) * up)``, (c, H)."""
    inter = w2e.shape[-1]
    gate_up = few_rows_linear(rows, w13e)  # (c, 2I)
    act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])  # (c, I)
    return few_rows_linear(act, w2e)


def _offsets(bincount: torch.Tensor) -> torch.Tensor:
    """(E,) counts -> (E + 1,) int64 offsets 0, c0, c0 + c1, ..."""
    offsets = torch.zeros(bincount.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(bincount, 0, out=offsets[1:])
    return offsets


def _native(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    """:mod:`baige.kernels.cpu.ops` when a native kernel may run these experts (contiguous weights,
    native kernels allowed and built; fp32 everywhere under an AVX-512 variant: ``moe.c``, or bf16
    everywhere under ``avx512_amx``: ``moe_amx.c``), else None."""
    from baige.kernels.cpu import native_allowed, ops
    from baige.kernels.cpu.build import current_isa

    variant = current_isa() or ""
    bf16 = x.dtype == torch.bfloat16
    if not (
        w13.is_contiguous()
        and w2.is_contiguous()
        and x.stride(-1) == 1
        and variant.startswith("avx512")
        and (not bf16 or variant == "avx512_amx")
    ):
        return None
    return ops if x.device.type == "cpu" and native_allowed() and ops.usable(x, w13, w2, bf16=bf16) else None
