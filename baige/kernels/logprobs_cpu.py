"""Log-probabilities of chosen tokens (and the entropy of each row's distribution) from logits, with the
bf16 CPU case on the native row pass of ``cpu/ce_bf16.c`` (:func:`baige.kernels.token_logprobs`).

The reference (:func:`reference_token_logprobs`) is the formula of
:func:`baige.runtime.model.logprobs.log_probs`: ``log_softmax`` of an fp32 copy of the logits, gathered
at the targets; its backward goes through the (N, vocab) fp32 ``log_softmax`` gradient and a cast back
to the logits' dtype. The native path makes one pass over the bf16 logits in forward (the row's
log-sum-exp, ``logprob = z[t] - lse``, both in fp32) and one in backward, writing the bf16 gradient
``g * (one_hot(t) - softmax(z))`` (rounded once from fp32, as the reference's final cast rounds it)
into a copy of the logits. The entropy ``-sum p log p`` (no gradient) is taken in fp32 over row chunks.
"""

from __future__ import annotations

import torch

ENTROPY_ROWS = 16  # rows per chunk of the entropy pass (an fp32 chunk of a 49k vocabulary stays cached)


def reference_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`baige.kernels.token_logprobs` in PyTorch (see there)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, vocab)
    chosen = logp.gather(1, targets[:, None])[:, 0]
    if not entropy:
        return chosen, None
    with torch.no_grad():
        return chosen, -(logp.exp() * logp).sum(-1)


def native_usable(logits: torch.Tensor) -> bool:
    """Whether ``logits`` take the native path: a bf16 CPU tensor, ``BAIGE_KERNELS`` unset or ``auto``,
    not inside a ``torch.compile`` trace, and the native library built."""
    if logits.device.type != "cpu" or logits.dtype != torch.bfloat16:
        return False
    from baige.kernels.cpu.build import library, native_allowed

    return native_allowed() and library() is not None


def _rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``ce_bf16.c`` over (n, vocab) contiguous bf16 ``logits``: returns (n,) fp32 ``lse - z[t]``; with
    ``scale`` (n,) fp32 it also overwrites ``logits`` by ``scale * (softmax - one_hot(t))`` in bf16."""
    from baige.kernels.cpu.build import library

    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32)
    s = scale if scale is not None else loss  # not read without the gradient
    library().baige_ce_rows_bf16(
        logits.data_ptr(), n, vocab, targets.data_ptr(), -1, s.data_ptr(), int(scale is not None),
        loss.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return loss


class _NativeTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        return _rows(logits, targets, None).neg_()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        out = logits.clone()
        # d logprob / d z = one_hot - softmax = -(softmax - one_hot): the kernel's gradient at scale -g
        _rows(out, targets, grad.float().neg().contiguous())
        return out, None


def _entropy(logits: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 ``-sum p log p`` of each row of (N, vocab) bf16 ``logits``, its log-sum-exp recovered as
    ``z[t] - logprob[t]``."""
    lse = logits.gather(1, targets[:, None])[:, 0].float() - logprobs  # (N,)
    out = torch.empty_like(lse)
    for s in range(0, logits.shape[0], ENTROPY_ROWS):
        logp = logits[s : s + ENTROPY_ROWS].float().sub_(lse[s : s + ENTROPY_ROWS, None])
        out[s : s + ENTROPY_ROWS] = -(logp.exp() * logp).sum(-1)
    return out


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`baige.kernels.token_logprobs` (see there)."""
    if not native_usable(logits):
        return reference_token_logprobs(logits, targets, entropy)
    vocab = logits.shape[-1]
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise IndexError(f"token_logprobs: a target id outside [0, {vocab})")
    logits, targets = logits.contiguous(), targets.to(torch.int64).contiguous()
    chosen = _NativeTokenLogprobs.apply(logits, targets)
    if not entropy:
        return chosen, None
    with torch.no_grad():
        return chosen, _entropy(logits.detach(), chosen.detach(), targets)
