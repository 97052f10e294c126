"""Native CPU kernels: C with AVX2 / AVX-512 intrinsics (``qlinear.c``, ``qdot.c``, ``bf16.c``, ``ops.c``,
``act_bf16.c``, ``attention.c``, ``attention_amx.c``, ``decode.c``, ``invariant.c``, ``ce_bf16.c``), one build per
instruction-set variant, compiled on first use by the system C compiler and called through ctypes (no PyTorch
headers: the build takes a second or two, see :mod:`.build`).

Why: on CPU a decode step is either bound by weight bytes (PyTorch has no fast int8/int4 weight-only
matmul for fp32 activations) or by the dispatch cost of dozens of tiny eager ops per layer (a few
microseconds each). :mod:`.qlinear` answers the first, :mod:`.ops` the second (RMSNorm, residual add
+ RMSNorm, RoPE, KV store; ``attention.c``: paged attention read in place, one call each).

Dispatch (:mod:`baige.kernels`): with ``BAIGE_KERNELS`` unset or ``auto``, CPU fp32 tensors that need
no gradient use these kernels when the library builds; ``BAIGE_KERNELS=reference`` never does, and
training (tensors that require grad) always takes the reference.
"""

from baige.kernels.cpu.build import cpu_has_avx2, library, native_allowed

__all__ = ["cpu_has_avx2", "library", "native_allowed"]
