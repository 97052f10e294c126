"""Batched multi-adapter LoRA (the Punica kernels of Chen et al. 2023, arXiv:2310.18547, as vLLM
serves many LoRA adapters): one batch whose tokens belong to different adapters.

``y[t] += scalings[i] * (x[t] @ lora_a_stack[i].T) @ lora_b_stack[i].T`` with ``i = token_lora_ids[t]``
(nothing for ``i = -1``): the *shrink* ``x @ A^T`` (in -> rank) then the *expand* ``@ B^T`` (rank ->
out), added into the projection's output. Adapters of different rank share one stack, zero-padded to
``R_max`` (padded rows of A / columns of B are zeros and add nothing).

- Reference (CPU, and the oracle): tokens grouped by adapter, one ``index_select`` + matmul pair per
  adapter present, ``index_add_`` back into ``y``.
- Triton: a shrink and an expand kernel over blocks of tokens. Each block loops over the distinct
  adapters among its tokens (the smallest id left first) and runs ``tl.dot`` on the rows of that
  adapter: a prefill segment (one adapter for a run of tokens) costs one pass, as SGMV; a decode
  batch with a different adapter per token degrades to per-row work, as BGMV. The shrink's result
  stays fp32 between the two kernels.
"""

from __future__ import annotations

import importlib

import torch

from baige.kernels import reference
from baige.kernels.dispatch import backend


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stack: torch.Tensor,
    lora_b_stack: torch.Tensor,
    scalings: torch.Tensor,
    token_lora_ids: torch.Tensor,
) -> torch.Tensor:
    """Add each token's LoRA term to the projection output ``y``, in place (see the module docstring).

    Args:
        y: (T, out) the base projection's output; fp32/fp16/bf16, unit column stride.
        x: (T, in) the projection's input, ``y``'s dtype.
        lora_a_stack: (L, R_max, in) the adapters' A (``lora_A.weight``), ``y``'s dtype.
        lora_b_stack: (L, out, R_max) the adapters' B (``lora_B.weight``), ``y``'s dtype.
        scalings: (L,) fp32, ``alpha / r`` (or rsLoRA's ``alpha / sqrt(r)``) per adapter.
        token_lora_ids: (T,) int32/int64 adapter slot per token in ``[-1, L)``, -1 = no adapter.
            The Triton path does not range-check them (no device sync): an id >= L reads out of bounds.
    Returns:
        ``y`` itself, updated. Products accumulate in fp32 on the Triton path (forward only: serving);
        the reference computes in the inputs' dtype and records its in-place add for autograd.
    Raises:
        ValueError: shapes or dtypes that do not fit together (both paths); on the reference path
        also an id outside ``[-1, L)``.
    """
    T, n_in = x.shape if x.dim() == 2 else (None, None)
    L, r_max = lora_a_stack.shape[:2] if lora_a_stack.dim() == 3 else (None, None)
    ok = (
        T is not None
        and L is not None
        and y.dim() == 2
        and y.shape[0] == T
        and lora_a_stack.shape[2] == n_in
        and lora_b_stack.shape == (L, y.shape[1], r_max)
        and scalings.shape == (L,)
        and token_lora_ids.shape == (T,)
    )
    if not ok:
        raise ValueError(
            f"lora_apply: y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a_stack "
            f"{tuple(lora_a_stack.shape)}, lora_b_stack {tuple(lora_b_stack.shape)}, scalings "
            f"{tuple(scalings.shape)}, token_lora_ids {tuple(token_lora_ids.shape)}: expected "
            "(T, out), (T, in), (L, R, in), (L, out, R), (L,), (T,)"
        )
    if not (x.dtype == y.dtype == lora_a_stack.dtype == lora_b_stack.dtype) or token_lora_ids.is_floating_point():
        raise ValueError(
            f"lora_apply: y, x, A, B must share one float dtype (got {y.dtype}, {x.dtype}, "
            f"{lora_a_stack.dtype}, {lora_b_stack.dtype}) and ids be integers ({token_lora_ids.dtype})"
        )
    if backend(x) == "reference":
        return reference.lora_apply(y, x, lora_a_stack, lora_b_stack, scalings, token_lora_ids)
    impl = importlib.import_module("baige.kernels.triton_ops.lora")
    return impl.lora_apply(y, x, lora_a_stack, lora_b_stack, scalings, token_lora_ids)
