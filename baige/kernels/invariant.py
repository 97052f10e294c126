"""Batch-invariant mode: one token's values do not depend on the rest of the batch, on how its prompt was
chunked, on whether it is computed as a decode step or inside a prefill, or on the thread count -- and the
training forward computes them with the same functions, so an engine's logprobs equal the trainer's bit for
bit (He & Thinking Machines Lab 2025, "Defeating Nondeterminism in LLM Inference"; vLLM's and SGLang's
batch-invariant / deterministic modes).

Why the usual path is not: GEMM libraries and the native few-rows kernels pick their blocking (and so their
fp32 summation order) from the number of rows; prefill attention (SDPA, chunks) and decode attention (paged
kernels) sum over keys in different orders; PyTorch's vectorized loops compute a tensor's tail values with
the scalar ``exp`` / ``silu`` (other bits than the vector ones), and one long reduction may be split over
threads.

What the mode does (CPU only): every op the plain forward calls runs a kernel whose each output value is
computed in an order fixed by its own operands -- ``cpu/invariant.c`` natively, else
:mod:`baige.kernels.reference_invariant` (other fixed orders, same guarantee): :func:`linear` (every
projection and ``lm_head``, any number of rows), one attention kernel for decode rows, prefill chunks and
the training forward's contiguous K/V (:func:`paged_decode_attention`, :func:`paged_prefill_attention`,
:func:`attention`), RMSNorm's sum of squares, SiLU; RoPE and the residual adds are elementwise arithmetic
(reference ops), and rotary cos/sin go through :func:`pointwise`. Values keep the model dtype between ops
as on the reference path (bf16 rounded after each op; fp32 inside each kernel). Native or twin is decided by
the process's settings alone (``BAIGE_KERNELS``, the library of ``BAIGE_CPU_ISA``'s variant), never by a
shape, so an engine and a trainer in one process take the same kernels.

Autograd: with gradients wanted, the forward values come from the same kernels and the backward uses the
ordinary formulas in PyTorch (the gradient of the non-invariant op, which equals it up to rounding).

Turning it on: ``with batch_invariant():`` around a forward (a context variable: per thread and per asyncio
task, so one process can run an invariant engine beside a plain one). The engine's runner enters it for
each step when ``EngineConfig.batch_invariant`` is set, ``runtime.model.logprobs.sequence_logprobs`` for
the trainer's forward. Not covered (callers refuse them in the mode): quantized / fp16-weight linears,
Mixture-of-Experts, LoRA, tensor parallelism, the native one-call decode step, Triton (CUDA), ``torch.compile``
(the mode runs eagerly) and ``flash_attention_varlen`` / ``fused_linear_cross_entropy``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from baige.kernels import reference
from baige.kernels import reference_invariant as ref
from baige.kernels.cpu import invariant as native

_MODE: ContextVar[bool] = ContextVar("baige_batch_invariant", default=False)


def enabled() -> bool:
    """Whether batch-invariant mode is on in this thread / task (see :func:`batch_invariant`)."""
    return _MODE.get()


@contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Turn the mode on (or, with ``on`` False, off) inside the ``with`` block; restored on exit."""
    token = _MODE.set(bool(on))
    try:
        yield
    finally:
        _MODE.reset(token)


def _native(t: torch.Tensor) -> bool:
    """Whether ``t``'s op runs the native kernels (else the PyTorch twins).

    Raises:
        ValueError: off the CPU, or inside a ``torch.compile`` trace (the twins' fixed orders would be fused
            away, the native calls cannot be traced): the mode runs eagerly.
    """
    if t.device.type != "cpu":
        raise ValueError(f"batch-invariant mode runs on CPU tensors only, got a {t.device.type} tensor")
    if torch.compiler.is_compiling():
        raise ValueError("batch-invariant mode runs eagerly, not inside torch.compile")
    return native.available()


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise torch function (``torch.cos``, ``torch.exp`` ...) whose every value is computed by the
    same code wherever it sits (:func:`baige.kernels.reference_invariant.pointwise`); no autograd."""
    return ref.pointwise(fn, x)


# ---- values (no autograd) -------------------------------------------------------------------------------


def _linear_values(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) @ (N, K)^T + bias -> (M, N) fp32."""
    if _native(x) and weight.dtype in (torch.float32, torch.bfloat16) and x.dtype == weight.dtype:
        b = None if bias is None else bias.detach().float()
        return native.linear(x.detach().float(), weight.detach(), b)
    return ref.linear(x.detach(), weight.detach(), None if bias is None else bias.detach())


def _sum_squares_values(x: torch.Tensor) -> torch.Tensor:
    """(R, n) fp32 -> (R,) fp32."""
    return native.sum_squares(x.detach()) if _native(x) else ref.sum_squares(x.detach())


def _silu_values(g: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32, any shape."""
    return native.silu(g.detach()) if _native(g) else ref.silu(g.detach())


def _attention_values(q, k_cache, v_cache, tables, table_of_row, lens, scale) -> torch.Tensor:
    """``cpu/invariant.py``'s ``attention`` arguments, q in any float dtype -> (S, hq, d) fp32."""
    q = q.detach().float()
    if _native(q) and k_cache.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return native.attention(q, k_cache, v_cache, tables, table_of_row, lens, scale)
    return ref.attention(q, k_cache, v_cache, tables, table_of_row, lens, scale)


def _contiguous_attention_values(q, k, v, scale: float, q_offset: int) -> torch.Tensor:
    """:func:`attention` without autograd: sequence b's K/V become block b (of S slots) of a one-block-per-
    sequence pool, query i of it a row of context ``q_offset + i + 1``; -> (B, T, H, D) fp32."""
    B, T, H, D = q.shape
    dev = q.device
    pool_k = k.detach().permute(2, 0, 1, 3).contiguous()  # (Hkv, B, S, D)
    pool_v = v.detach().permute(2, 0, 1, 3).contiguous()
    tables = torch.arange(B, device=dev)[:, None]  # (B, 1)
    rows = torch.arange(B, device=dev).repeat_interleave(T)  # (B * T,)
    lens = (torch.arange(T, device=dev) + q_offset + 1).repeat(B)
    out = _attention_values(q.reshape(B * T, H, D), pool_k, pool_v, tables, rows, lens, scale)
    return out.view(B, T, H, D)


# ---- autograd: invariant forward values, the ordinary backward -----------------------------------------


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_values(x, weight, bias).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy @ weight.to(gy.dtype) if ctx.needs_input_grad[0] else None
        gw = (gy.t() @ x.to(gy.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _SumSquares(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _sum_squares_values(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g[:, None]


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g):
        ctx.save_for_backward(g)
        return _silu_values(g)

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        s = torch.sigmoid(g)
        return grad * s * (1 + g * (1 - s))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, q_offset):
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.q_offset = scale, q_offset
        return _contiguous_attention_values(q, k, v, scale, q_offset).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = reference.attention(*inputs, ctx.scale, ctx.q_offset)
        return (*torch.autograd.grad(out, inputs, grad), None, None)


# ---- the ops (the signatures of baige.kernels') ---------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x (..., K) -> (..., N) in x's dtype (fp32 accumulation, rounded once);
    weight (N, K) in x's dtype, bias (N,) or None. Differentiable."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if _needs_grad(x, weight, bias):
        y = _Linear.apply(x2, weight, bias)
    else:
        y = _linear_values(x2, weight, bias).to(x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` as :func:`baige.kernels.reference.rms_norm` orders it (the
    normalized value rounded to x's dtype before the weight), the sum of squares invariant. Differentiable."""
    xf = x.float()
    n = x.shape[-1]
    rows = xf.reshape(-1, n)
    ss = _SumSquares.apply(rows) if _needs_grad(rows) else _sum_squares_values(rows)
    inv = (ss.view(*x.shape[:-1], 1) / n + eps).sqrt().reciprocal()
    return weight * (xf * inv).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the sum rounded to the dtype first, as the training
    forward's ``x + h`` then :func:`rms_norm`."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def apply_rope(q, k, cos, sin):
    """:func:`baige.kernels.reference.apply_rope` (elementwise multiplies and adds: already invariant)."""
    return reference.apply_rope(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, silu in fp32 rounded to gate's dtype, as ``F.silu`` then the multiply. Differentiable."""
    g = gate.float()
    s = _Silu.apply(g) if _needs_grad(g) else _silu_values(g)
    return s.to(gate.dtype) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0) -> torch.Tensor:
    """:func:`baige.kernels.attention` (causal, contiguous K/V; the training forward) on the kernel the paged
    ops use: (B, T, H, D) -> (B, T, H, D) in q's dtype. Differentiable (backward: the reference attention's)."""
    if _needs_grad(q, k, v):
        return _Attention.apply(q, k, v, scale, q_offset)
    return _contiguous_attention_values(q, k, v, scale, q_offset).to(q.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """:func:`baige.kernels.paged_decode_attention`: (S, H, D) -> (S, H, D) in q's dtype."""
    return _attention_values(q, k_cache, v_cache, block_tables, None, context_lens, scale).to(q.dtype)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale) -> torch.Tensor:
    """:func:`baige.kernels.paged_prefill_attention`, each chunk token a row of its own context (as a decode
    row): (N, H, D) -> (N, H, D) in q's dtype."""
    counts = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # (P,) queries per sequence
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=q.device), counts)  # (N,)
    j = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q[seq]  # index within its chunk
    lens = context_lens[seq] - counts[seq] + j + 1
    return _attention_values(q, k_cache, v_cache, block_tables, seq, lens, scale).to(q.dtype)
