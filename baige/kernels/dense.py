"""Dense linears and greedy argmax of CPU inference on the native kernels (:mod:`baige.kernels.cpu`),
falling back to PyTorch: re-exported by :mod:`baige.kernels`, the API the runtime calls."""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's argmax, ``torch.argmax(logits, -1)`` (first index of a row's maximum, or its first
    NaN): (S, V) float, V >= 1 -> (S,) int64; natively on fp32 CPU rows (two vector passes, faster than
    torch's for vocabulary-wide rows; measured: docs/benchmarks/archive.md)."""
    from baige.kernels.cpu import native_allowed, ops

    if (
        logits.dim() == 2
        and logits.shape[1] > 0
        and logits.device.type == "cpu"
        and native_allowed()
        and ops.usable(logits)
    ):
        return ops.argmax(logits)
    return logits.argmax(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-transform sampling's draw: (R, V) float non-negative probabilities (each row with
    positive mass), (R,) float64 uniforms in ``[0, 1)`` -> (R,) int64, per row the first position whose
    float64 cumulative mass (summed in vocabulary order) reaches ``x = (1 - u) * total``:
    ``torch.searchsorted(probs.double().cumsum(-1), x)`` clamped to ``V - 1``, bitwise. fp32 CPU rows
    run natively (two passes, no (R, V) float64 copy); a row with a non-finite total, and other
    devices or dtypes, take the PyTorch formula."""
    from baige.kernels.cpu import native_allowed, ops

    if (
        probs.dim() == 2
        and probs.shape[1] > 0
        and probs.device.type == "cpu"
        and u.device.type == "cpu"
        and native_allowed()
        and ops.usable(probs)
    ):
        out = ops.inverse_cdf(probs, u)
        if out is not None:
            return out
    cdf = probs.double().cumsum(-1)  # (R, V)
    x = (1 - u.to(cdf)) * cdf[:, -1]
    return torch.searchsorted(cdf, x[:, None]).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (x (M, in) -> (M, out), x's dtype) of the per-op inference path: at most
    :data:`FEW_ROWS` rows run :func:`dense_linear`'s native kernel, more run ``F.linear``: for weights
    streamed from memory the native kernel beats MKL for few rows and loses past about FEW_ROWS
    (measured: docs/benchmarks/archive.md, "Native MoE decode step, few-row per-op linears"); bf16: see
    :func:`dense_linear`."""
    return dense_linear(x, weight, bias, max_rows=FEW_ROWS.get(weight.dtype, 0))


FEW_ROWS = {torch.float32: 32, torch.bfloat16: 64}  # few_rows_linear's native rows, by weight dtype


def fp16_weight_linear(
    x: torch.Tensor, weight_fp16: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """``x @ W.T + bias`` with fp16 weights and fp32 activations and accumulation.

    Args:
        x: (M, in) fp32 on the CPU.
        weight_fp16: (out, in) fp16, contiguous.
        bias: (out,) fp32 or None.
        packed: the same weight prepacked by ``torch.ops.quantized.linear_prepack_fp16``.
    Returns:
        (M, out) fp32. Batches the native F16C kernel takes (:mod:`baige.kernels.cpu.qlinear`) run
        there; others, or any batch without the native library, run fbgemm's fp16 GEMM
        (``torch.ops.quantized.linear_dynamic_fp16``).
    """
    from baige.kernels.cpu import qlinear

    if qlinear.supports_f16(x):
        return qlinear.linear_f16(x, weight_fp16, bias)
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for inference. CPU rows with no gradient run the native kernel, which reads
    each weight row once for all rows: an fp32 weight under fp32 rows (at most 128, where it stops
    beating torch's sgemm), a bf16 weight under fp32 or bf16 rows (at most 64, where it stops beating
    torch's bf16 linear: bf16.c, see :mod:`baige.kernels.cpu.qlinear`; measured:
    docs/benchmarks/archive.md). More fp32 rows without autograd run oneDNN's matmul
    (:func:`onednn_linear`); anything else is ``F.linear`` in the weight's dtype (a bias is then rounded to
    it; the native kernel adds an fp32 bias exactly).

    Args:
        x: (M, in) float. weight: (out, in). bias: (out,) or None. max_rows: a lower native limit than
            :data:`DENSE_NATIVE_MAX_ROWS`, or None.
    Returns:
        (M, out) in x's dtype (bf16 rows: fp32 accumulation rounded once, as torch's bf16 linear).
    """
    from baige.kernels.cpu import qlinear

    limit = DENSE_NATIVE_MAX_ROWS.get(weight.dtype, 0)
    limit = limit if max_rows is None else min(limit, max_rows)
    xf = (
        x.float() if x.dim() == 2 and x.shape[0] <= limit and x.dtype in (torch.float32, weight.dtype) else None
    )  # bf16 -> fp32 is exact
    if (
        xf is not None
        and weight.device.type == "cpu"
        and weight.stride(-1) == 1
        and qlinear.supports_f16(xf)
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and (bias is None or bias.is_contiguous())
    ):
        return qlinear.linear_f16(xf, weight, None if bias is None else bias.float()).to(x.dtype)
    bias = None if bias is None else bias.to(weight.dtype)
    if onednn_takes(x, weight, bias):
        return onednn_linear(x, weight, bias)
    return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`onednn_linear` computes ``x @ weight.T + bias`` here: fp32 x (M >= 1, in) and
    weight (out, in) with unit stride along ``in``, on the CPU, no gradient wanted, bias None or
    fp32 (out,), PyTorch built with oneDNN and its linear op, ``BAIGE_CPU_ONEDNN`` on."""
    from baige.kernels.settings import settings

    return (
        _ONEDNN
        and settings().cpu_onednn
        and x.dim() == 2
        and x.shape[0] > 0
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.stride(-1) == 1
        and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1))
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
        and not torch.compiler.is_compiling()
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN's fp32 matmul (``torch.ops.mkldnn._linear_pointwise``,
    the op PyTorch's inductor emits for CPU linears; it reads the plain row-major weight, no second
    packed copy). Why: PyTorch's CPU ``F.linear`` calls MKL's sgemm, which on AMD CPUs runs its AVX2
    code; oneDNN picks its kernel from the CPU's instruction-set flags (``brg_matmul:avx512_core``
    with AVX-512), about twice MKL's rate on AMD CPUs with full-width AVX-512 (measured:
    docs/benchmarks/archive.md, "MoE forward vs transformers through oneDNN"). Same values up to fp32
    summation order (tests: against fp64).

    Args:
        x: (M, in) fp32 CPU, M >= 1 (any strides). weight: (out, in) fp32, unit stride along in.
        bias: (out,) fp32 or None.
    Returns:
        (M, out) fp32, contiguous. Call it only where :func:`onednn_takes` is true (a PyTorch without
        oneDNN or without the op keeps ``F.linear``).
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN's linear op exists in this PyTorch (decided once at import: a build fact, not a run-time state)
_ONEDNN = bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


DENSE_NATIVE_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 64}  # dense_linear's native rows, by weight dtype
