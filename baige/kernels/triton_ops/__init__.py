"""Triton implementations of the :mod:`baige.kernels` ops, one module per op family.

Each module follows Liger-Kernel's structure: ``@triton.jit`` kernels -> a launcher that checks
shapes, makes strides explicit and picks block sizes -> a ``torch.autograd.Function`` where training
needs a backward -> functions with the exact signatures of :mod:`baige.kernels.reference`.
Imported lazily by :func:`baige.kernels.dispatch.impl_for`: importing one of these modules decorates kernels
with ``triton.jit``, which reads ``TRITON_INTERPRET`` at that moment.
"""
