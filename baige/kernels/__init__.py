"""The public op API of baige: the only place the model, engine and trainer call for hot ops.

Every op has a pure-PyTorch twin in :mod:`baige.kernels.reference` with the same signature and a
Triton implementation in :mod:`baige.kernels.triton_ops`. Dispatch (:func:`backend`):

- ``BAIGE_KERNELS`` unset or ``auto``: Triton for CUDA tensors; for CPU tensors the native C kernels
  of :mod:`baige.kernels.cpu` where they exist (fp32 inference: norms, RoPE, KV store, paged decode
  attention, quantized linear), else the reference;
- ``BAIGE_KERNELS=reference``: the reference everywhere;
- ``BAIGE_KERNELS=triton``: Triton everywhere. On CPU tensors that needs ``TRITON_INTERPRET=1`` set
  before the first Triton op runs (Triton's interpreter, the way CI tests the kernels).

The Triton modules are imported on first use, so a CPU-only process never compiles anything.
"""

from __future__ import annotations

import importlib

import torch

from baige.kernels import ce_cpu, dispatch, invariant, logprobs_cpu, moe_cpu, native, reference
from baige.kernels.dense import (  # noqa: F401  (re-exported: inference linears and argmax on the CPU)
    DENSE_NATIVE_MAX_ROWS,
    FEW_ROWS,
    argmax,
    dense_linear,
    few_rows_linear,
    fp16_weight_linear,
    inverse_cdf,
    onednn_linear,
)
from baige.kernels.dispatch import BACKENDS, KernelConfigError, backend, check_startup  # noqa: F401  (re-exported)
from baige.kernels.invariant import batch_invariant  # noqa: F401  (re-exported)
from baige.kernels.invariant import enabled as batch_invariant_enabled
from baige.kernels.invariant import linear as batch_invariant_linear  # noqa: F401
from baige.kernels.invariant import pointwise as batch_invariant_pointwise
from baige.kernels.lora import lora_apply  # noqa: F401  (in OPS)
from baige.kernels.mla import *  # noqa: F403  (DeepSeek: MLA over the latent cache, grouped routing)
from baige.kernels.mla import MLA_OPS
from baige.kernels.native import *  # noqa: F403  (re-exported: the native CPU library's names besides the ops)
from baige.kernels.settings import KernelSettings, reload_settings, settings

# The hot ops: each has a reference twin of the same name and signature (``baige bench kernels`` times them).
OPS = (
    "rms_norm",
    "add_rms_norm",
    "apply_rope",
    "silu_mul",
    "attention",
    "flash_attention_varlen",
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "fused_linear_cross_entropy",
    "quantized_linear",
    "moe_topk",
    "moe_align_block_size",
    "fused_moe",
    "lora_apply",
)
__all__ = [*OPS, "OPS", *MLA_OPS]
# inside `with batch_invariant():` (kernels/invariant.py) the ops below take its batch-invariant kernels
__all__ += ["batch_invariant", "batch_invariant_enabled", "batch_invariant_linear", "batch_invariant_pointwise"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square layer norm (Zhang & Sennrich 2019, arXiv:1910.07467).

    ``y = weight * (x / sqrt(mean(x**2, -1) + eps))`` with the statistics in fp32.

    Args:
        x: (..., hidden), any float dtype.
        weight: (hidden,), same dtype as ``x`` (or fp32).
        eps: added to the mean square.
    Returns:
        (..., hidden) in the promoted dtype of ``weight`` and ``x``.
    """
    impl = (
        invariant if invariant.enabled() else dispatch.native_cpu(x, weight, bf16=True) or dispatch.impl_for(x, "norm")
    )
    return impl.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm for inference (the Triton path has no backward: its outputs do
    not require grad; training uses ``x + residual`` and :func:`rms_norm`).

    Args:
        x, residual: (..., hidden), same dtype.
        weight: (hidden,).
    Returns:
        ``(rms_norm(x + residual), x + residual)``, both (..., hidden).
    """
    impl = (
        invariant
        if invariant.enabled()
        else dispatch.native_cpu(x, residual, weight, bf16=True) or dispatch.impl_for(x, "norm")
    )
    return impl.add_rms_norm(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864), rotate-half (HF) convention.

    Args:
        q: (..., n_heads, head_dim).
        k: (..., n_kv_heads, head_dim); GQA shapes are fine, heads only broadcast.
        cos, sin: (..., head_dim), the leading dims matching q/k's without the head axis.
    Returns:
        ``(q_rot, k_rot)`` with the shapes and dtypes of ``q`` and ``k``.
    """
    native = (
        dispatch.native_cpu(q, k, cos, sin, bf16=True) if q.shape[-1] % 2 == 0 else None
    )  # odd: the reference's error
    impl = invariant if invariant.enabled() else native or dispatch.impl_for(q, "rope")
    return impl.apply_rope(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` (Shazeer 2020, arXiv:2002.05202).

    Args:
        gate, up: (..., intermediate), same shape and dtype.
    Returns:
        (..., intermediate).
    """
    impl = (
        invariant
        if invariant.enabled()
        else dispatch.native_cpu(gate, up, bf16=True) or dispatch.impl_for(gate, "swiglu")
    )
    return impl.silu_mul(gate, up)


from baige.kernels.attention_ops import (  # noqa: E402  (in OPS; dispatched as the ops here)
    attention,
    flash_attention_varlen,
    masked_attention,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` without materialising all logits
    (the fused linear + cross-entropy of Liger-Kernel, Hsu et al. 2024, arXiv:2410.10989).

    Tokens are processed in chunks; the log-sum-exp is taken in fp32. Targets equal to
    ``ignore_index`` contribute nothing.

    Args:
        hidden: (..., hidden) final hidden states, any float dtype.
        weight: (vocab, hidden) output projection (``lm_head.weight``), ``hidden``'s dtype or fp32 (master
            weights: matmuls in ``hidden``'s dtype, the gradient in fp32 with no bf16 round trip on the CPU).
        targets: (...) int64 next-token ids in ``[0, vocab)`` or ``ignore_index``, the leading shape of
            ``hidden``; the Triton path does not range-check them (no device sync), so an out-of-range
            id gives an undefined loss instead of the reference's IndexError.
        ignore_index: target value that is skipped (HF / PyTorch convention: -100).
        normalizer: divide the summed loss by this (e.g. the number of valid target tokens across
            all micro-batches and ranks); None = the number of valid targets here (a mean).
    Returns:
        () fp32 loss: ``sum(-log softmax(logits)[target]) / normalizer`` in nats per token.
    """
    impl = dispatch.impl_for(hidden, "cross_entropy")
    if impl is reference:  # on the CPU with a native bf16 row pass (ce_cpu.py), else the reference
        return ce_cpu.fused_linear_cross_entropy(hidden, weight, targets, ignore_index, normalizer)
    return impl.fused_linear_cross_entropy(hidden, weight.to(hidden.dtype), targets, ignore_index, normalizer)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of one chosen token per row, ``log softmax(logits)[target]``, differentiable
    w.r.t. ``logits``, and optionally each row's entropy (RL: the policy's logprobs of sampled tokens).

    bf16 CPU logits take the native row pass (:mod:`baige.kernels.logprobs_cpu`), everything else
    the reference (``log_softmax`` of an fp32 copy, the formula of
    :func:`baige.runtime.model.logprobs.log_probs`).

    Args:
        logits: (N, vocab), any float dtype.
        targets: (N,) int64 token ids in ``[0, vocab)``.
        entropy: also return the entropies.
    Returns:
        (N,) fp32 logprobs (natural log) with gradient, and (N,) fp32 entropies ``-sum p log p`` (nats,
        no gradient) or None.
    Raises:
        IndexError: a target outside ``[0, vocab)``.
    """
    return logprobs_cpu.token_logprobs(logits, targets, entropy)


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
    """Weight-only quantized ``x @ W.T + bias`` with ``W = (q - zero_point) * scale`` dequantized
    inside the matmul (compressed-tensors layouts, see ``baige.runtime.quant.scheme``).

    Args:
        x: (..., in_features) fp32/fp16/bf16.
        qweight: int8 (out, in_features) for int8 per output channel, or int32 (out, ceil(in / 8))
            for int4: eight 4-bit values per word, element ``j`` in bits ``4j..4j+3``, stored as q + 8.
        scale: (out, n_groups) in x's dtype or fp32; n_groups = 1 for int8 per channel,
            ceil(in / group_size) for int4 (the last group may be partial).
        zero_point: None (symmetric) or (out, n_groups) int8/int32 signed zero points, unpacked.
        group_size: columns per scale group; None = one group per output channel.
        bias: (out,) or None.
        int_dot: the native CPU kernel may round ``x`` to int8 blocks for integer dot products
            (None: ``BAIGE_CPU_INT_DOT``, on by default; False: the exact dequantizing kernel, as a
            training forward whose backward uses the dequantized weight wants).
    Returns:
        (..., out) in the dtype of ``x``; accumulation in fp32 on the Triton path, which is forward
        only (inference: its output does not require grad).

    On CPU with ``BAIGE_KERNELS`` auto, fp32 or bf16 batches that need no gradient run the native
    kernels of :mod:`baige.kernels.cpu.qlinear` (integer dot products, any number of rows, unless
    ``int_dot`` is off or the int4 group is not a multiple of 32; the exact kernels up to 512 rows;
    bf16 ``x`` widened to fp32 and the result rounded back, as a bf16 model's int8/int4 layers then run
    at the fp32 kernels' speed instead of dequantizing the weight per call) -- except bf16 batches of
    many rows on AMX (``qlinear.takes_amx_dequant``: prefill chunks), which take the reference's bf16
    matmul on oneDNN's AMX kernels; everything else dequantizes and calls ``F.linear`` (the reference).
    """
    widen = x.dtype == torch.bfloat16 and x.device.type == "cpu" and not x.requires_grad and backend(x) == "reference"
    if widen and int_dot is not False and dispatch.native_cpu(x, bf16=True) is not None:
        from baige.kernels.cpu import qlinear

        if qlinear.takes_amx_dequant(x, qweight):  # many bf16 rows on AMX: the reference's bf16 matmul
            w = qlinear.dequantized_bf16(x, qweight, scale, zero_point, group_size)
            return torch.nn.functional.linear(x, w, None if bias is None else bias.to(torch.bfloat16))
    xf = x.float() if widen else x
    if dispatch.native_cpu(xf) is not None:
        from baige.kernels.cpu import qlinear

        if qlinear.supports(xf, qweight, group_size, bias, int_dot):
            bias_f = None if bias is None else bias.float()
            y = qlinear.quantized_linear(xf, qweight, scale.float(), zero_point, group_size, bias_f, int_dot=int_dot)
            return y.to(x.dtype)
    return dispatch.impl_for(x, "quant_matmul").quantized_linear(x, qweight, scale, zero_point, group_size, bias)


# ---- Mixture-of-Experts (Mixtral, Qwen2/3-MoE, ERNIE-4.5 routing; vLLM's fused_moe block layout) ---------


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    norm_min: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-k: ``probs = softmax(router_logits.float())``, experts chosen by ``topk(probs +
    correction_bias)`` (bias None: ``probs``), weights the *unbiased* probs of the chosen experts,
    divided by ``clamp(sum, min=norm_min)`` when ``renormalize`` (HF Mixtral/Qwen2-MoE: bias None;
    ERNIE-4.5: ``e_score_correction_bias`` and ``moe_norm_min``).

    Args:
        router_logits: (T, E), any float dtype (computed in fp32).
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the chosen weights by their sum (Mixtral always; Qwen ``norm_topk_prob``).
        correction_bias: (E,) fp32 added to the probs for the selection only, or None.
        norm_min: the lower clamp of the renormalizing sum.
    Returns:
        ``(topk_weights, topk_ids)``: (T, top_k) fp32 (fp64 for fp64 logits, reference) and int64,
        best first. Ties: the reference uses ``torch.topk`` (order unspecified); the Triton kernel
        takes the lowest index first. Differentiable w.r.t. router_logits: when it needs a gradient
        the reference runs (the Triton kernel is forward only).
    """
    needs_grad = router_logits.requires_grad and torch.is_grad_enabled()
    impl = reference if needs_grad else dispatch.impl_for(router_logits, "moe")
    return impl.moe_topk(router_logits, top_k, renormalize, correction_bias, norm_min)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size``: the (token, expert) pairs ``p = t * top_k + j`` sorted by expert
    (stable: ascending ``p`` inside an expert), each expert's segment padded to a multiple of
    ``block_size`` with the sentinel ``N = T * top_k``; experts without pairs get no block.

    Fixed-size outputs (a CUDA graph can capture the call; nothing is read back to the host):

    - ``sorted_token_ids``: (N + E * (block_size - 1),) int32; the valid prefix is the first
      ``num_tokens_post_padded`` entries, every other entry is ``N``.
    - ``expert_ids``: (ceil(len(sorted_token_ids) / block_size),) int32 expert of each block; -1 for
      the blocks past the valid prefix.
    - ``num_tokens_post_padded``: (1,) int32 tensor, the padded total (a multiple of block_size).

    Args:
        topk_ids: (T, top_k) integer expert ids in ``[0, num_experts)``.
    """
    return dispatch.impl_for(topk_ids, "moe").moe_align_block_size(topk_ids, num_experts, block_size)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, combined: ``out[t] = sum_j topk_weights[t, j] * w2[e] @
    (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))`` with ``e = topk_ids[t, j]``, fp32 accumulation.

    Reference: pairs sorted by expert, matmuls per expert with pairs, index_add combine (on the CPU
    without autograd :func:`baige.kernels.moe_cpu.fused_moe`: the same with each expert's matmuls
    picked by its row count). Triton:
    vLLM's fused MoE grouped GEMMs over :func:`moe_align_block_size` blocks, with a backward.

    Args:
        x: (T, H) fp32/fp16/bf16.
        w13: (E, 2I, H), x's dtype: rows [0, I) gate_proj, [I, 2I) up_proj (HF ``experts.gate_up_proj``).
        w2: (E, H, I), x's dtype (HF ``experts.down_proj``).
        topk_weights: (T, top_k) fp32; topk_ids: (T, top_k) int64 in ``[0, E)`` (any top_k <= E).
    Returns:
        (T, H) in x's dtype; differentiable w.r.t. x, w13, w2 and topk_weights on both paths.
    """
    impl = dispatch.impl_for(x, "moe")
    if impl is reference and x.device.type == "cpu" and not torch.is_grad_enabled():
        return moe_cpu.fused_moe(x, w13, w2, topk_weights, topk_ids)
    return impl.fused_moe(x, w13, w2, topk_weights, topk_ids)


# Quantization math shared with the runtime's quantizer (pure PyTorch).
from baige.kernels.reference import dequantize_weight, expand_groups, unpack_int4, visible_keys  # noqa: E402

__all__ += [
    "argmax",
    "inverse_cdf",
    "fp16_weight_linear",
    "dense_linear",
    "few_rows_linear",
    "onednn_linear",
    "FEW_ROWS",
    *native.__all__,
    "dequantize_weight",
    "expand_groups",
    "unpack_int4",
    "visible_keys",
    "backend",
    "check_startup",
    "settings",
    "reload_settings",
    "KernelSettings",
    "KernelConfigError",
    "reference",
]
