"""Weight-only int8/int4 linear on the native CPU kernels: integer dot products over int8 block-quantized
activations (``qdot.c``, the default; ``BAIGE_CPU_INT_DOT=0`` turns it off, and int4 with a group
size that is not a multiple of 32 or more than :data:`INT4_DOT_MAX_ROWS` rows never takes it) or the
exact dequantize-in-registers kernels (``qlinear.c``).

On CPU, PyTorch has no fast int8/int4 weight-only matmul for fp32 activations
(``torch._weight_int8pack_mm`` measured 5-20x slower than fp32 ``F.linear`` on the AVX2 dev box), so
without this a quantized checkpoint dequantizes every weight on every call. Inputs with at most
:data:`MAX_ROWS` rows use it; larger batches dequantize once and run PyTorch's sgemm, which is as
fast there (compute-bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baige.kernels.cpu.build import library, native_allowed
from baige.kernels.settings import settings

# Above this many input rows, dequantize + PyTorch's sgemm is as fast (measured on the dev box's AVX2
# core, 1 thread, 70 matrices of SmolLM2-135M shapes: int8 native 95 vs 121 ms at 96 rows, 251 vs 292
# at 256, 556 vs 574 at 512; int4 g128 18 vs 88 at 6 rows, 281 vs 364 at 256, 518 vs 562 at 512).
MAX_ROWS = 512
# int4 integer dot products (qdot.c) beat the dequantizing kernel up to about this many rows; above,
# qlinear.c's fp32 tiles reuse each unpacked weight over more rows (1 thread, SmolLM2-135M shapes, Xeon
# AVX-512 VNNI: g32 2.1x faster at 16 rows, 0.84x at 64). decode.c uses the same limit.
INT4_DOT_MAX_ROWS = 32


def supports(x: torch.Tensor, qweight: torch.Tensor, group_size: int | None, bias: torch.Tensor | None) -> bool:
    """Whether :func:`quantized_linear` takes these arguments: CPU fp32 ``x`` with at most
    :data:`MAX_ROWS` rows and no gradient needed, an int8 per-channel or int4
    weight whose group size is a multiple of 8, and a buildable kernel."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if x.numel() // max(x.shape[-1], 1) > MAX_ROWS:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if qweight.dtype == torch.int8:
        if group_size is not None:
            return False
    elif qweight.dtype != torch.int32 or group_size is None or group_size % 8:
        return False
    return library() is not None


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
    *,
    int_dot: bool | None = None,
) -> torch.Tensor:
    """:func:`baige.kernels.quantized_linear` on the native kernel (same arguments and layouts; call
    only where :func:`supports` is true). ``int_dot``: None follows ``BAIGE_CPU_INT_DOT``; False
    forces the exact kernels. Returns (..., out) fp32; no autograd."""
    lib = library()
    shape = x.shape
    k = shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y.view(*shape[:-1], n)
    # per-call work is a handful of pointer reads: decode calls this ~200 times per token
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    s = scale if scale.dtype == torch.float32 and scale.is_contiguous() else scale.float().contiguous()
    if qweight.stride(-1) != 1:
        qweight = qweight.contiguous()
    b_ptr = None if bias is None else bias.data_ptr()
    nthreads = torch.get_num_threads()
    int_dot = settings().cpu_int_dot if int_dot is None else int_dot
    if qweight.dtype == torch.int8:
        fn = lib.baige_qdot_int8 if int_dot else lib.baige_qlinear_int8
        fn(x2.data_ptr(), m, k, x2.stride(0), qweight.data_ptr(), n, qweight.stride(0),
           s.data_ptr(), b_ptr, y.data_ptr(), n, nthreads)
    else:
        if k % 8:
            x2 = F.pad(x2, (0, 8 - k % 8))  # zero columns: the padded nibbles multiply 0
        z = None if zero_point is None else zero_point.to(torch.int32).contiguous()
        args = (x2.data_ptr(), m, x2.shape[1], x2.stride(0), qweight.data_ptr(), n, qweight.stride(0),
                s.data_ptr(), None if z is None else z.data_ptr(), s.shape[1], group_size, b_ptr, y.data_ptr(), n,
                nthreads)
        if not (int_dot and group_size % 32 == 0 and m <= INT4_DOT_MAX_ROWS and lib.baige_qdot_int4(*args) == 0):
            lib.baige_qlinear_int4(*args)
    return y if len(shape) == 2 else y.view(*shape[:-1], n)


def supports_f16(x: torch.Tensor) -> bool:
    """Whether :func:`linear_f16` takes ``x``: (rows, in) CPU fp32, at most :data:`MAX_ROWS` rows, no
    gradient needed, ``BAIGE_KERNELS`` unset or ``auto``, outside a ``torch.compile`` trace, library built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= MAX_ROWS
            and not (torch.is_grad_enabled() and x.requires_grad) and native_allowed() and library() is not None)


def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.float().T + bias`` without materialising the fp32 weight.

    Args:
        x: (rows, in) fp32, rows unit-strided.
        weight: (out, in) fp16, bf16 or fp32, rows unit-strided (fp32 runs the fp32 kernel: a weight row is
            read from memory once for all rows, where a BLAS sgemm at a few rows reads it per row;
            bf16 runs bf16.c: vdpbf16ps over x rounded to bf16 on AVX-512 BF16, else exact widening).
        bias: (out,) fp32 contiguous, or None.
    Returns:
        (rows, out) fp32 (accumulated in fp32).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib = library()
        fn = {torch.float32: lib.baige_linear_f32, torch.bfloat16: lib.baige_linear_bf16}.get(weight.dtype,
                                                                                              lib.baige_linear_f16)
        fn(x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, weight.stride(0), None,
           None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    return y
