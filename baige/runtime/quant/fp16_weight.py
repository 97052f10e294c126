"""Serving-time rewrites of the loaded fp32 model's linears for CPU speed (a transform, never a subclass).

``fp16-weight``: weights stored as fp16, activations and accumulation fp32 (baige's native F16C
kernel for decode-sized batches, fbgemm's ``torch.ops.quantized.linear_dynamic_fp16`` for larger
ones; both widen fp16 weights to fp32 in registers). A decode step is bound by weight bytes (540 MB
per token in fp32 for the 135M model), and this halves them; the only error is rounding each weight
to fp16 (11-bit mantissa), which leaves the embedded model's wikitext-2 perplexity as good as
unchanged while batch-1 decode gets faster (measured: docs/benchmarks/archive.md, "The first CPU
runs").

Not offered: int8 W8A8 with fbgemm's dynamic per-tensor activations (``linear_dynamic``) was faster at
batch 1 but multiplied the embedded model's perplexity: SmolLM2's activation outliers do not survive a
per-tensor 7-bit activation scale. ``torch._weight_int8pack_mm`` (weight-only int8) measured slower
than fp32.

``int8-weight``: weights rounded to int8 per output channel at load (RTN, symmetric, max-based
scale: :func:`baige.runtime.quant.scheme.quantize_weight`), run by the int8 kernels of
``baige.kernels.quantized_linear`` (on CPU the integer-dot ones): a quarter of the fp32 bytes. On an
int8/int4 checkpoint this is the tied fp32 ``lm_head``, which otherwise is most of a decode step's
reads on a small model (113 MB of SmolLM2-135M's 166 MB at int4).

Only the serving engine uses this (``EngineConfig.quantization``); the model is rewritten in memory,
so state dicts and checkpoints are unchanged.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from baige import kernels
from baige.errors import BaigeError

FP16_WEIGHT = "fp16-weight"
INT8_WEIGHT = "int8-weight"
QUANTIZATION_METHODS = (FP16_WEIGHT, INT8_WEIGHT)


class Fp16WeightLinear(nn.Module):
    """A Linear with fp16 weights and fp32 activations/accumulation, so a memory-bound decode step
    reads half the fp32 bytes. Weight rounding to fp16 (11-bit mantissa) is the only error.

    Batches of up to :data:`baige.kernels.cpu.qlinear.MAX_ROWS` rows run baige's native F16C kernel
    (``baige_linear_f16``, also what the native decode step calls); larger ones, or any batch when the
    native library cannot be built, fbgemm's fp16 GEMM (``torch.ops.quantized.linear_dynamic_fp16``,
    which widens packed fp16 weight panels in registers the same way). Both copies are kept: 4 bytes
    per weight in memory, 2 read per forward.

    Args:
        linear: the fp32 ``nn.Linear`` to replace.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        # plain attributes, not buffers: packed_weight_bytes() is what one forward reads
        self.weight_fp16 = linear.weight.detach().to(torch.float16).contiguous()  # (out, in)
        self.bias_fp32 = bias  # (out,) or None
        self._bias_numel = 0 if bias is None else bias.numel()

    def packed_weight_bytes(self) -> int:
        """Bytes a forward reads: fp16 weights plus the fp32 bias."""
        return 2 * self.in_features * self.out_features + 4 * self._bias_numel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) fp32 -> (..., out) fp32."""
        shape = x.shape
        y = kernels.fp16_weight_linear(x.reshape(-1, shape[-1]), self.weight_fp16, self.bias_fp32, self._packed)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 weight"


def _int8_weight(linear: nn.Linear) -> nn.Module:
    """``linear`` as a :class:`QuantizedLinear` of int8 per-channel weights (its bias kept)."""
    from baige.runtime.quant.linear import QuantizedLinear
    from baige.runtime.quant.scheme import QuantScheme, quantize_weight

    scheme = QuantScheme(8, None)
    with torch.no_grad():
        q = QuantizedLinear.from_quantized(linear, scheme, *quantize_weight(linear.weight.detach().float(), scheme))
    return q.requires_grad_(False)


def apply_quantization(model: nn.Module, method: str, ignore: tuple[str, ...] = ()) -> int:
    """Swap every ``nn.Linear`` whose name matches none of ``ignore`` (fnmatch globs) for the
    ``method``'s module (:class:`Fp16WeightLinear`, or an int8 ``QuantizedLinear``), in place. A tied
    ``lm_head`` may be swapped: the embedding keeps its table. fp16-weight needs an fp32 model;
    int8-weight takes fp32 or bf16 (what ``--dtype auto`` picks on a CPU with native bf16).

    Returns:
        Number of layers swapped.
    Raises:
        BaigeError: an unknown method, a model not in one of those dtypes on the CPU (fbgemm's kernels
        are CPU fp32 only), or a PyTorch build without fbgemm.
    """
    if method not in QUANTIZATION_METHODS:
        raise BaigeError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    p = next(model.parameters())
    dtypes = (torch.float32,) if method == FP16_WEIGHT else (torch.float32, torch.bfloat16)
    if p.device.type != "cpu" or p.dtype not in dtypes:
        need = "a float32" if method == FP16_WEIGHT else "a float32 or bfloat16"
        raise BaigeError(
            f"--quantization {method} needs {need} model on the CPU "
            f"(got {p.dtype} on {p.device.type}); pass --dtype float32 --device cpu"
        )
    if method == FP16_WEIGHT and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise BaigeError(f"--quantization {method} needs PyTorch's fbgemm engine, absent on this CPU/build")
    make = Fp16WeightLinear if method == FP16_WEIGHT else _int8_weight
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(fnmatch.fnmatchcase(name, pat) for pat in ignore)
    ]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, make(m))
    return len(targets)
