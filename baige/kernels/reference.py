"""Pure-PyTorch twins of every ``baige.kernels`` op.

These are the numerical oracle for the Triton kernels and the CPU path of the model. Each
function has the same signature and semantics as its public counterpart in
``baige.kernels``; see the docstrings there for shapes and dtypes. The weight-only quantization
twins and their math live in :mod:`.reference_quant` and :mod:`.reference_int_dot`, the attention twins in
:mod:`.reference_attention`, all re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baige.kernels.reference_attention import (  # noqa: F401 (re-exported: the attention twins)
    attention,
    flash_attention_varlen,
    masked_attention,
    paged_decode_attention,
    paged_prefill_attention,
    softmax_attention,
    store_kv,
    visible_keys,
)
from baige.kernels.reference_int_dot import (  # noqa: F401 (re-exported)
    ACT_BLOCK,
    quantize_activation_blocks,
    quantize_activation_residual,
)
from baige.kernels.reference_quant import (  # noqa: F401 (re-exported: the quantized_linear twins and their math)
    dequantize_weight,
    expand_groups,
    quantized_linear,
    quantized_linear_int_dot,
    unpack_int4,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32, cast back before the weight multiply: the order HF's LlamaRMSNorm uses.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(-2)  # (..., 1, D): broadcast over heads
    sin = sin.unsqueeze(-2)
    q_rot = (q * cos + _rotate_half(q) * sin).to(q.dtype)  # fp32 cos/sin must not promote fp16 q
    k_rot = (k * cos + _rotate_half(k) * sin).to(k.dtype)
    return q_rot, k_rot


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class FusedLinearCrossEntropyGrads(torch.autograd.Function):
    """Backward of a fused linear + cross-entropy whose forward saved ``(grad_hidden, grad_weight)``
    of the unit-scaled loss and ``ctx.weight_dtype``: it only scales them by the incoming gradient.
    Shared by this reference and the Triton implementation.

    A CPU upstream gradient of exactly 1 (a plain ``loss.backward()``) returns the saved gradients
    as they are: scaling a (vocab, hidden) weight gradient by 1 is a full pass over it for nothing.
    Autograd accumulates into a returned tensor in place only when nothing else holds it, so this is
    safe under ``retain_graph`` too. On a GPU the check would need a device sync, so it always scales.
    """

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        if grad_out.device.type == "cpu" and grad_out.item() == 1.0:
            gw = grad_w.to(ctx.weight_dtype) if grad_w is not None else None
            return grad_h, gw, None, None, None
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


# Vocabulary rows per block of the fp32 path: a (block, chunk) fp32 logit tile of 512 x 256 (512 KiB)
# stays in a core's L2 between its matmul, its softmax statistics and its gradient matmul.
_VOCAB_BLOCK = 512


def _ce_chunk_blocked(h, weight, t, valid, scale, grad_h, grad_w, first):
    """Summed loss of one token chunk, writing its gradients, for ``h`` (n, hidden) and ``weight``
    (vocab, hidden) both fp32 (or both fp64, which tests use); ``t`` (n,) int64 targets, ``valid``
    (n,) bool, ``scale`` (n,) ``valid / normalizer`` (fp32; fp64 for fp64 inputs); ``grad_h`` the
    chunk's (n, hidden) rows or None; ``grad_w`` (vocab, hidden) in ``h``'s dtype or None (written
    when ``first``, else accumulated).

    The logits are computed transposed, (vocab, n), in vocabulary blocks, and the softmax is taken
    blockwise with the usual max shift (the "safe softmax" merge of Milakov & Gimelshein 2018,
    arXiv:1805.02867): pass 1 stores ``e_b = exp(z_b - m_b)`` with each block's column max ``m_b``
    and sum ``s_b``; then ``m = max_b m_b``, ``s = sum_b s_b exp(m_b - m)``, ``lse = m + log s``; pass 2
    turns each block into the gradient ``dL/dz = scale * (softmax - one_hot)`` by one multiply with
    ``scale exp(m_b - m) / s``, and multiplies it into ``grad_w`` while it is still in cache. The
    loss is ``sum(scale (lse - z_target))`` before the division by the normalizer, with ``z_target``
    the dot product ``h . weight[target]``. One exp per logit, and no full-size temporaries besides
    the (vocab, n) tile buffer.
    """
    n, vocab = h.shape[0], weight.shape[0]
    block = _VOCAB_BLOCK
    n_blocks = -(-vocab // block)
    z = h.new_empty(vocab, n)  # logits^T, then exp, then dL/dz^T
    m_b, s_b = h.new_empty(n_blocks, n), h.new_empty(n_blocks, n)
    ht = h.t()
    for b in range(n_blocks):
        zb = z[b * block : (b + 1) * block]  # (block, n)
        torch.mm(weight[b * block : (b + 1) * block], ht, out=zb)
        torch.amax(zb, 0, out=m_b[b])
        zb.sub_(m_b[b]).exp_()
        torch.sum(zb, 0, out=s_b[b])
    m = m_b.amax(0)  # (n,)
    factor = (m_b - m).exp_()  # (n_blocks, n): exp(m_b - m)
    s = (s_b * factor).sum(0)  # (n,)
    safe_t = torch.where(valid, t, 0)
    z_target = (h * weight[safe_t]).sum(-1)  # (n,)
    loss = ((m + s.log() - z_target) * valid).sum()
    if grad_h is None and grad_w is None:
        return loss
    factor.mul_(scale / s)
    # the one-hot term: -scale at (target row, column) for every valid column, grouped by block
    cols = torch.arange(n, device=h.device)[valid]
    rows = safe_t[valid]
    blk = torch.div(rows, block, rounding_mode="floor")
    order = torch.argsort(blk)
    counts = torch.bincount(blk, minlength=n_blocks).tolist()
    rows_in = (rows - blk * block)[order].split(counts)
    cols_in, minus = cols[order].split(counts), (-scale[cols]).to(z.dtype)[order].split(counts)
    for b in range(n_blocks):
        zb = z[b * block : (b + 1) * block]
        zb.mul_(factor[b])
        if counts[b]:
            zb.index_put_((rows_in[b], cols_in[b]), minus[b], accumulate=True)
        if grad_w is not None:
            gw = grad_w[b * block : (b + 1) * block]
            if first:
                torch.mm(zb, h, out=gw)  # (block, hidden)
            else:
                gw.addmm_(zb, h)
    if grad_h is not None:
        torch.mm(z.t(), weight, out=grad_h)  # (n, hidden)
    return loss


def _ce_chunk_generic(h, weight, t, valid, scale, grad_h, grad_w, first):
    """:func:`_ce_chunk_blocked` for any dtype: (n, vocab) logits cast to fp32 for the log-sum-exp, the
    gradient cast back to ``h``'s dtype for the two matmuls, ``grad_w`` accumulated over the chunks in fp32
    (each chunk's product in bf16 for bf16 inputs, at bf16 speed as a bf16 linear's weight gradient is; in
    fp32 for fp16 inputs, whose range a (vocab, hidden) product over many tokens may exceed)."""
    logits = (h @ weight.t()).float()  # (n, vocab)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    safe_t = torch.where(valid, t, 0)
    rows = torch.arange(len(t), device=t.device)
    loss = ((lse - logits[rows, safe_t]) * valid).sum()
    if grad_h is None and grad_w is None:
        return loss
    # d(sum of losses)/d(logits) = softmax - one_hot(target), zero on ignored rows (in place)
    g = logits.sub_(lse[:, None]).exp_()
    g[rows, safe_t] -= 1.0
    g = g.mul_(scale[:, None]).to(h.dtype)
    if grad_h is not None:
        grad_h.copy_(g @ weight)  # (n, hidden)
    if grad_w is not None:
        acc = torch.bfloat16 if h.dtype == torch.bfloat16 else grad_w.dtype
        gw = g.t().to(acc) @ h.to(acc)  # (vocab, hidden)
        if first:
            grad_w.copy_(gw)
        else:
            grad_w.add_(gw)
    return loss


class _FusedLinearCrossEntropy(FusedLinearCrossEntropyGrads):
    """Loss and both gradients in one pass over token chunks (Liger-Kernel's scheme): each chunk's
    logits live only inside the loop, and backward just scales the gradients kept from forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, normalizer):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        chunk = max(1, (1 << 24) // vocab)  # ~16M logits (64 MB in fp32) at a time
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        # fp32 (fp64 for fp64 weights) accumulator, cast to the weight's dtype in backward
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = torch.empty(weight.shape, dtype=acc, device=weight.device) if want_w else None
        if want_w and n_tokens == 0:
            grad_w.zero_()
        blocked = hidden.dtype == weight.dtype and hidden.dtype in (torch.float32, torch.float64)
        chunk_fn = _ce_chunk_blocked if blocked else _ce_chunk_generic
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n_tokens, chunk):
            t = targets[s : s + chunk]
            valid = t != ignore_index
            scale = valid.to(acc) / normalizer  # (n,) d(loss)/d(token loss)
            total += chunk_fn(
                hidden[s : s + chunk],
                weight,
                t,
                valid,
                scale,
                grad_h[s : s + chunk] if want_h else None,
                grad_w,
                s == 0,
            )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / normalizer


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    h, t, normalizer = flatten_ce_inputs(hidden, targets, ignore_index, normalizer)
    return _FusedLinearCrossEntropy.apply(h, weight, t, ignore_index, normalizer)


def flatten_ce_inputs(
    hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int, normalizer: float | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor]:
    """(..., hidden), (...) -> (N, hidden), (N,), and the normalizer: the number of valid targets when
    None, an fp32 tensor on hidden's device when given as a tensor (shared by both implementations)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if normalizer is None:
        normalizer = (t != ignore_index).sum()
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(device=h.device, dtype=torch.float32)
    return h, t, normalizer


# ---- Mixture-of-Experts (routing, block alignment, grouped expert MLPs) -----------------------------------


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    norm_min: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(router_logits.dtype, torch.float32)  # fp32 (fp64 stays fp64: the tests' oracle)
    probs = torch.softmax(router_logits.to(acc), dim=-1)  # (T, E)
    scores = probs + correction_bias if correction_bias is not None else probs  # selection only
    topk_ids = torch.topk(scores, top_k, dim=-1).indices  # (T, top_k) int64
    topk_weights = probs.gather(-1, topk_ids)  # the unbiased probabilities (ERNIE-4.5's rule)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True).clamp(min=norm_min)
    return topk_weights, topk_ids


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1)  # (N,) expert of pair t * top_k + j
    n, dev = flat.numel(), flat.device
    counts = torch.bincount(flat, minlength=num_experts)  # (E,) pairs per expert
    padded = (counts + block_size - 1) // block_size * block_size
    starts = padded.cumsum(0) - padded  # (E,) first slot of each expert's segment
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert, ascending inside one
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]  # position inside the expert
    max_len = n + num_experts * (block_size - 1)
    sorted_token_ids = torch.full((max_len,), n, dtype=torch.int32, device=dev)
    sorted_token_ids[starts[sorted_e] + rank] = order.to(torch.int32)
    expert_ids = torch.full((-(-max_len // block_size),), -1, dtype=torch.int32, device=dev)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=dev), padded // block_size)
    expert_ids[: blocks.numel()] = blocks.to(torch.int32)
    return sorted_token_ids, expert_ids, padded.sum().to(torch.int32).reshape(1)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    # Grouped: pairs sorted by expert, one matmul chain per expert that has pairs on its contiguous
    # slice, then the weighted combine as one index_add (Megablocks' "dropless" formulation, Gale et
    # al. 2022, arXiv:2211.15841). Without autograd the chain writes in place into one buffer (CPU
    # inference runs kernels.moe_cpu.fused_moe instead: the same, with each expert's matmuls picked
    # by its row count).
    T, k = topk_ids.shape
    inter = w2.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = topk_ids.reshape(-1)  # (T * k,)
    order = torch.argsort(flat, stable=True)  # (T * k,) pair indices grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tok = order // k  # (T * k,) token of each sorted pair
    xs = x.index_select(0, tok)  # (T * k, H)
    w_sorted = topk_weights.reshape(-1).index_select(0, order).to(acc)[:, None]  # (T * k, 1)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights)):
        pieces, start = [], 0
        # unbind: one backward stack for all experts instead of a full-size zero gradient per indexed expert
        for c, w13_e, w2_e in zip(counts, w13.unbind(0), w2.unbind(0)):
            if c:
                gate_up = xs[start : start + c] @ w13_e.t()  # (c, 2 * I)
                pieces.append(silu_mul(gate_up[:, :inter], gate_up[:, inter:]) @ w2_e.t())  # (c, H)
                start += c
        y = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])  # (T * k, H) in sorted order
        weighted = y.to(acc) * w_sorted
    else:
        weighted = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)  # (T * k, H) sorted
        start = 0
        for e, c in enumerate(counts):
            if c:
                gate_up = torch.mm(xs[start : start + c], w13[e].t())  # (c, 2 * I)
                act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])  # (c, I)
                torch.mm(act, w2[e].t(), out=weighted[start : start + c])
                start += c
        weighted = weighted.to(acc).mul_(w_sorted)
    return torch.zeros(T, x.shape[1], dtype=acc, device=x.device).index_add_(0, tok, weighted).to(x.dtype)


# ---- batched multi-adapter LoRA (see baige.kernels.lora) ---------------------------------------------------


def lora_apply(y, x, lora_a_stack, lora_b_stack, scalings, token_lora_ids):
    """Tokens grouped by adapter: per adapter present, gather its rows, shrink, expand, scale, add back."""
    ids = token_lora_ids.long()
    present = torch.unique(ids).tolist()  # sorted; one host read per call (CPU path)
    if present and (present[0] < -1 or present[-1] >= lora_a_stack.shape[0]):
        raise ValueError(
            f"lora_apply: token_lora_ids hold {present[0] if present[0] < -1 else present[-1]}, "
            f"outside [-1, {lora_a_stack.shape[0]})"
        )
    for i in present:
        if i < 0:
            continue
        rows = (ids == i).nonzero().squeeze(1)  # (n,)
        v = x.index_select(0, rows) @ lora_a_stack[i].t()  # (n, R_max)
        y.index_add_(0, rows, (v @ lora_b_stack[i].t()) * scalings[i].to(y.dtype))  # (n, out)
    return y
