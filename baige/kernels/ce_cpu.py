"""The fused linear + cross-entropy on the CPU (:func:`baige.kernels.fused_linear_cross_entropy`'s CPU path):
the reference's chunked scheme (:func:`baige.kernels.reference.chunked_ce_forward`: each token chunk's logits
by one matmul, the loss and both gradients in forward, backward only scaling them), with the row pass of
bf16 chunks (log-sum-exp, loss, ``scale * (softmax - one_hot)`` as the bf16 gradient, in place of the logits)
in the native library (``cpu/ce_bf16.c``) instead of PyTorch's six passes over an fp32 copy of the logits.
fp32 / fp64 and fp16 chunks, ``BAIGE_KERNELS=reference``, a ``torch.compile`` trace or a machine where the
library does not build take the reference unchanged."""

from __future__ import annotations

import functools

import torch

from baige.kernels import reference


def _rows_native(logits, t, valid, scale, want_grad):
    """:func:`baige.kernels.reference._ce_rows_torch` for (n, vocab) bf16 CPU logits, on ``ce_bf16.c``.

    Raises:
        IndexError: a valid target outside ``[0, vocab)`` (as the reference's indexing does).
    """
    from baige.kernels.cpu.build import library

    n, vocab = logits.shape
    if bool((((t < 0) | (t >= vocab)) & valid).any()):
        raise IndexError(f"fused_linear_cross_entropy: a target id outside [0, {vocab})")
    logits = logits.contiguous()
    targets = torch.where(valid, t, -1).to(torch.int64).contiguous()
    scale = scale.to(torch.float32).contiguous()
    loss = torch.empty(n, dtype=torch.float32)
    library().baige_ce_rows_bf16(
        logits.data_ptr(),
        n,
        vocab,
        targets.data_ptr(),
        -1,
        scale.data_ptr(),
        int(want_grad),
        loss.data_ptr(),
        torch.get_num_threads(),
    )
    return loss.sum(), logits if want_grad else None


_ce_chunk_native = functools.partial(reference._ce_chunk_generic, rows=_rows_native)


class _NativeFusedLinearCrossEntropy(reference.FusedLinearCrossEntropyGrads):
    """The reference's autograd function with the native bf16 row pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, normalizer):
        return reference.chunked_ce_forward(ctx, hidden, weight, targets, ignore_index, normalizer, _ce_chunk_native)


def native_usable(hidden: torch.Tensor) -> bool:
    """Whether ``hidden`` takes the native row pass: a bf16 CPU tensor, ``BAIGE_KERNELS`` unset or ``auto``,
    not inside a ``torch.compile`` trace, and the native library built."""
    if hidden.device.type != "cpu" or hidden.dtype != torch.bfloat16:
        return False
    from baige.kernels.cpu.build import library, native_allowed

    return native_allowed() and library() is not None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`baige.kernels.fused_linear_cross_entropy` on the CPU (see there for shapes and dtypes)."""
    h, t, normalizer = reference.flatten_ce_inputs(hidden, targets, ignore_index, normalizer)
    fn = _NativeFusedLinearCrossEntropy if native_usable(h) else reference._FusedLinearCrossEntropy
    return fn.apply(h, weight, t, ignore_index, normalizer)
