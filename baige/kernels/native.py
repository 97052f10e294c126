"""The native CPU library's names the runtime uses besides the ops, re-exported by :mod:`baige.kernels`
(the runtime imports only that package): host memory, the one-call decode step's ABI, what the library
runs on here, and the context size past which native one-row-per-token attention stops paying."""

from __future__ import annotations

# Host memory: the step's streamed weights, the KV pools' lazily zeroed pages, malloc's freed heap.
from baige.kernels.cpu.arena import keep_freed_heap, to_weight_arena, zeroed_pages

# The one-call native decode step's ABI (the runtime describes the layers, the kernel runs them).
from baige.kernels.cpu.decode import LINEAR_BF16, LINEAR_F16, LINEAR_F32, LINEAR_INT4, LINEAR_INT8
from baige.kernels.cpu.decode import PROJECTIONS as DECODE_PROJECTIONS
from baige.kernels.cpu.decode import DecodeLayers as NativeDecodeLayers
from baige.kernels.cpu.decode import LayerDesc as DecodeLayerDesc
from baige.kernels.cpu.decode import LinearDesc as DecodeLinearDesc
from baige.kernels.cpu.decode import MoEDesc as DecodeMoEDesc

# What the native CPU library runs on here.
from baige.kernels.cpu.info import (
    cpu_has_native_bf16,
    cpu_int_dot,
    cpu_int_dot_passes,
    cpu_isa,
    cpu_isa_flags,
    native_allowed,
    native_cpu_available,
)

# Above this many bytes of K + V per KV head a row's context streams too much for one-row-per-token attention.
from baige.kernels.cpu.ops import PREFILL_NATIVE_MAX_BYTES as NATIVE_ATTENTION_MAX_BYTES

__all__ = [
    "native_cpu_available",
    "native_allowed",
    "cpu_isa",
    "cpu_isa_flags",
    "cpu_int_dot",
    "cpu_int_dot_passes",
    "cpu_has_native_bf16",
    "LINEAR_BF16",
    "LINEAR_F16",
    "LINEAR_F32",
    "LINEAR_INT4",
    "LINEAR_INT8",
    "DECODE_PROJECTIONS",
    "NativeDecodeLayers",
    "DecodeLayerDesc",
    "DecodeLinearDesc",
    "DecodeMoEDesc",
    "NATIVE_ATTENTION_MAX_BYTES",
    "to_weight_arena",
    "zeroed_pages",
    "keep_freed_heap",
]
