"""Fused linear + cross-entropy in Triton (Liger-Kernel's scheme, Hsu et al. 2024, arXiv:2410.10989).

Tokens are processed in chunks. For each chunk the logits ``h @ W.T`` are computed by a matmul in the
hidden dtype; a Triton kernel then makes two passes over each row: an online log-sum-exp in fp32,
the row's loss ``lse - logit[target]``, and, in place of the logits, the gradient
``(softmax - one_hot(target)) / normalizer`` (zero on ignored rows). Two more matmuls turn that into
the chunk's input gradient and its share of the weight gradient (accumulated over chunks in the
weight's dtype, Liger's trade of a little bf16 rounding for half the memory of an fp32 accumulator). Forward therefore
already holds both
gradients; backward only scales them by the incoming gradient. Peak extra memory is one chunk of
logits, sized so a chunk holds about as many elements as the hidden states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels import reference
from baige.kernels.reference import flatten_ce_inputs
from baige.kernels.triton_ops.common import new_empty


@triton.jit
def _ce_rows_kernel(
    LOGITS,
    TARGETS,
    LOSS,
    NORM,
    s_row,
    vocab,
    ignore_index,
    WANT_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * s_row
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    offs = tl.arange(0, BLOCK_V)
    m_i = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(x, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    safe_target = tl.where(valid, target, 0)
    x_t = tl.load(ptr + safe_target).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    if WANT_GRAD:
        w = tl.where(valid, 1.0 / tl.load(NORM), 0.0)
        for start in range(0, vocab, BLOCK_V):
            cols = start + offs
            mask = cols < vocab
            x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == safe_target, g - 1.0, g) * w
            tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def _chunk_rows(n_tokens: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: about ``hidden / vocab`` of the tokens (so a chunk of logits is about the size of
    the hidden states, Liger's rule), a power of two, at least 64 rows."""
    rows = triton.cdiv(n_tokens, triton.cdiv(vocab, hidden))
    return min(n_tokens, max(64, triton.next_power_of_2(rows)))


def _launch_options(vocab: int, device: torch.device) -> tuple[int, dict]:
    """(BLOCK_V, launch options): one row per program, 4096-wide vocab tiles and 16 warps on a GPU
    (Liger's choice for large vocabularies); wide tiles in the interpreter, where numpy likes them."""
    if device.type == "cuda":
        return min(triton.next_power_of_2(vocab), 4096), {"num_warps": 16}
    return min(triton.next_power_of_2(vocab), 8192), {}


class _FusedLinearCrossEntropy(reference.FusedLinearCrossEntropyGrads):
    """Forward computes the loss and both gradients; backward (inherited) scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, normalizer):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_grad = want_h or want_w
        grad_h = new_empty(hidden.shape, hidden.dtype, hidden.device) if want_h else None
        # the weight gradient accumulates over chunks in the weight's dtype (as Liger-Kernel does): an fp32
        # accumulator for a bf16 lm_head would cost twice the weight's memory again at vocab 128k
        grad_w = torch.zeros_like(weight) if want_w else None
        loss_rows = new_empty((n_tokens,), torch.float32, hidden.device)
        norm = (
            normalizer.reshape(1)
            if isinstance(normalizer, torch.Tensor)
            else torch.tensor([float(normalizer)], dtype=torch.float32, device=hidden.device)
        )
        targets = targets.contiguous()
        chunk = _chunk_rows(n_tokens, vocab, hidden.shape[1]) if n_tokens else 1
        block_v, opts = _launch_options(vocab, hidden.device)
        for s in range(0, n_tokens, chunk):
            h = hidden[s : s + chunk]
            logits = h @ weight.t()  # (n, vocab) in the hidden dtype; becomes the gradient in place
            _ce_rows_kernel[(h.shape[0],)](
                logits,
                targets[s:],
                loss_rows[s:],
                norm,
                logits.stride(0),
                vocab,
                ignore_index,
                WANT_GRAD=want_grad,
                BLOCK_V=block_v,
                **opts,
            )
            if want_h:
                grad_h[s : s + chunk] = logits @ weight  # (n, hidden)
            if want_w:
                grad_w.addmm_(logits.t(), h)  # (vocab, hidden), in place: no temporary of the weight's size
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss_rows.sum() / norm[0]


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.fused_linear_cross_entropy` (see there for shapes)."""
    h, t, normalizer = flatten_ce_inputs(hidden, targets, ignore_index, normalizer)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"fused_linear_cross_entropy: {t.shape[0]} targets for {h.shape[0]} hidden rows")
    if weight.shape[1] != h.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: weight {tuple(weight.shape)} for hidden size {h.shape[1]}")
    return _FusedLinearCrossEntropy.apply(h, weight, t.contiguous(), ignore_index, normalizer)
