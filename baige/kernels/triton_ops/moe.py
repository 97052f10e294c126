"""Mixture-of-Experts in Triton: router top-k, block alignment, and the fused expert MLP (forward and backward).

- :func:`moe_topk`: one program per token: fp32 softmax over the experts, optional selection bias,
  ``top_k`` rounds of argmax, optional renormalization. Forward only (the public op runs the
  reference when the logits need a gradient). Ties go to the lowest expert index.
- :func:`moe_align_block_size`: vLLM's block alignment (``moe_align_block_size``, vllm-project/vllm
  ``csrc/moe``) in three kernels without a host sync: per-chunk expert histograms; one program that
  turns them into each chunk's offset inside each expert, the padded segment starts, ``expert_ids``
  and the padded total; a scatter where each pair's place is its expert's start + its chunk's offset +
  its rank among the chunk's earlier pairs of that expert (so the order inside an expert is the pair
  order: stable).
- :func:`fused_moe`: vLLM's fused MoE (grouped GEMM over the expert-sorted token blocks) with SwiGLU
  fused into the gate/up GEMM, the routing weight applied in the down GEMM's epilogue, and the
  combine as a separate deterministic fp32 reduction over each token's ``top_k`` rows (no atomics);
  the backward reuses the same grouped GEMMs (see :mod:`baige.kernels.triton_ops.moe_gemm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from baige.kernels.triton_ops import moe_gemm
from baige.kernels.triton_ops.common import block_for, new_empty, router_topk_buffers

ALIGN_CHUNK = 128  # pairs per program of the alignment's histogram and scatter kernels


@triton.jit
def _topk_kernel(
    LOGITS,
    BIAS,
    W,
    IDS,
    num_experts,
    s_t,
    top_k,
    norm_min,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    e_mask = offs < num_experts
    z = tl.load(LOGITS + t * s_t + offs, mask=e_mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, 0))
    p = p / tl.sum(p, 0)  # (E,) softmax; 0 on the padding lanes
    score = p
    if HAS_BIAS:
        score = p + tl.load(BIAS + offs, mask=e_mask, other=0.0).to(tl.float32)
    score = tl.where(e_mask, score, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    ids = tl.zeros((BLOCK_K,), tl.int64)
    for j in range(top_k):
        best = tl.argmax(score, 0)  # the first (lowest) index among equal maxima
        weights = tl.where(slots == j, tl.sum(tl.where(offs == best, p, 0.0), 0), weights)
        ids = tl.where(slots == j, best.to(tl.int64), ids)
        score = tl.where(offs == best, float("-inf"), score)
    if RENORMALIZE:
        weights = weights / tl.maximum(tl.sum(weights, 0), norm_min)
    k_mask = slots < top_k
    tl.store(W + t * top_k + slots, weights, mask=k_mask)
    tl.store(IDS + t * top_k + slots, ids, mask=k_mask)


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    norm_min: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`baige.kernels.moe_topk` (forward only: the outputs carry no gradient).

    Raises:
        ValueError: router_logits is not (T, E), top_k is not in [1, E], or the bias is not (E,).
    """
    if router_logits.dim() != 2:
        raise ValueError(f"moe_topk: router_logits {tuple(router_logits.shape)} is not (T, E)")
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_topk: top_k {top_k} is not in [1, {E}]")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"moe_topk: correction_bias {tuple(correction_bias.shape)} != ({E},)")
    logits, bias, weights, ids = router_topk_buffers(router_logits, top_k, correction_bias)
    if T:
        _topk_kernel[(T,)](
            logits,
            bias,
            weights,
            ids,
            E,
            logits.stride(0),
            top_k,
            float(norm_min),
            HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize,
            BLOCK_E=block_for(E, 2),
            BLOCK_K=block_for(top_k, 2),
        )
    return weights, ids


@triton.jit
def _align_count_kernel(IDS, COUNTS, num_pairs, num_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(IDS + offs, mask=offs < num_pairs, other=-1).to(tl.int32)  # -1 counts for no expert
    experts = tl.arange(0, BLOCK_E)
    counts = tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)  # (BLOCK_E,) histogram of this chunk
    tl.store(COUNTS + c * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit
def _align_offsets_kernel(
    COUNTS,
    CHUNK_OFF,
    EXPERT_START,
    EXPERT_IDS,
    NTPP,
    n_chunks,
    num_experts,
    block_size,
    n_blocks,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < num_experts
    total = tl.zeros((BLOCK_E,), tl.int32)
    for c in range(n_chunks):  # exclusive prefix over chunks, per expert
        counts = tl.load(COUNTS + c * num_experts + experts, mask=e_mask, other=0)
        tl.store(CHUNK_OFF + c * num_experts + experts, total, mask=e_mask)
        total += counts
    padded = (total + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, 0)  # (E,) one past each expert's padded segment
    tl.store(EXPERT_START + experts, ends - padded, mask=e_mask)
    n_padded = tl.sum(padded, 0)
    tl.store(NTPP, n_padded)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        pos = blocks * block_size
        # the expert whose segment holds pos = the number of segments ending at or before it
        expert = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), 1)
        tl.store(EXPERT_IDS + blocks, tl.where(pos < n_padded, expert, -1), mask=blocks < n_blocks)


@triton.jit
def _align_scatter_kernel(IDS, SORTED, CHUNK_OFF, EXPERT_START, num_pairs, num_experts, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    idx = tl.arange(0, CHUNK)
    offs = c * CHUNK + idx
    mask = offs < num_pairs
    e = tl.load(IDS + offs, mask=mask, other=-1).to(tl.int32)
    # rank of each pair among the earlier pairs of this chunk routed to the same expert
    rank = tl.sum(((e[:, None] == e[None, :]) & (idx[None, :] < idx[:, None])).to(tl.int32), 1)
    base = tl.load(EXPERT_START + e, mask=mask, other=0) + tl.load(CHUNK_OFF + c * num_experts + e, mask=mask, other=0)
    tl.store(SORTED + base + rank, offs.to(tl.int32), mask=mask)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`baige.kernels.moe_align_block_size` (see there); ids outside
    ``[0, num_experts)`` are not checked (that would need a device sync) and corrupt the layout."""
    flat = topk_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n, dev = flat.numel(), flat.device
    max_len = n + num_experts * (block_size - 1)
    n_blocks = triton.cdiv(max_len, block_size)
    sorted_ids = torch.full((max_len,), n, dtype=torch.int32, device=dev)  # padding slots keep the sentinel
    expert_ids = new_empty((n_blocks,), torch.int32, dev)
    ntpp = new_empty((1,), torch.int32, dev)
    n_chunks = triton.cdiv(n, ALIGN_CHUNK)
    counts = torch.empty((max(n_chunks, 1), num_experts), dtype=torch.int32, device=dev)
    chunk_off = torch.empty_like(counts)
    expert_start = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    block_e = block_for(num_experts, 2)
    if n_chunks:
        _align_count_kernel[(n_chunks,)](flat, counts, n, num_experts, CHUNK=ALIGN_CHUNK, BLOCK_E=block_e)
    _align_offsets_kernel[(1,)](
        counts,
        chunk_off,
        expert_start,
        expert_ids,
        ntpp,
        n_chunks,
        num_experts,
        block_size,
        n_blocks,
        BLOCK_E=block_e,
        BLOCK_B=64,
    )
    if n_chunks:
        _align_scatter_kernel[(n_chunks,)](flat, sorted_ids, chunk_off, expert_start, n, num_experts, CHUNK=ALIGN_CHUNK)
    return sorted_ids, expert_ids, ntpp


def _block_m(n_pairs: int, num_experts: int, device: torch.device) -> int:
    """Rows per block (vLLM's default-config rule of thumb): 16 while experts see few pairs, up to 64."""
    if device.type != "cuda":
        return 16
    per_expert = n_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _routing(topk_ids: torch.Tensor, num_experts: int, device: torch.device) -> tuple:
    """The block layout the grouped GEMMs walk: (sorted ids, expert ids, padded total, pairs, top_k,
    grid rows, BLOCK_M). The grid covers the most blocks any routing can fill, ``N // BLOCK_M +
    min(E, N)`` (or the buffer's blocks, if fewer); blocks past the padded total exit at once."""
    n_pairs, top_k = topk_ids.numel(), topk_ids.shape[1]
    block_m = _block_m(n_pairs, num_experts, device)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, num_experts, block_m)
    grid_m = min(expert_ids.numel(), n_pairs // block_m + min(num_experts, n_pairs))
    return sorted_ids, expert_ids, ntpp, n_pairs, top_k, grid_m, block_m


def _check(x, w13, w2, topk_weights, topk_ids):
    E, two_i, H = w13.shape
    if x.dim() != 2 or x.shape[1] != H or w2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit "
            "(T, H), (E, 2I, H), (E, H, I)"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)} "
            f"are not both ({x.shape[0]}, top_k)"
        )
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype} must share a dtype")


def _forward(x, w13, w2, weights, routing, save_pre: bool):
    """out (T, H) in x's dtype, act (pairs, I), pre-activations (pairs, 2I) or None."""
    act, hpre = moe_gemm.gate_up(x, w13, routing, save_pre)
    down = (w2.stride(0), w2.stride(1), w2.stride(2))  # B[e][k=i, n=h] = w2[e, h, i]
    y = moe_gemm.grouped_rows(act, w2, down, w2.shape[1], routing, weights)  # (pairs, H) fp32, weighted
    return moe_gemm.combine(y, x.shape[0], routing[4], x.dtype), act, hpre


class _FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, topk_weights, topk_ids):
        routing = _routing(topk_ids, w13.shape[0], x.device)
        weights = topk_weights.reshape(-1).float().contiguous()  # (pairs,)
        out, act, hpre = _forward(x, w13, w2, weights, routing, save_pre=True)
        ctx.save_for_backward(x, w13, w2, weights, act, hpre, *routing[:3])
        ctx.meta = routing[3:], topk_weights.shape, topk_weights.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, w13, w2, weights, act, hpre, *layout = ctx.saved_tensors
        (n_pairs, top_k, grid_m, block_m), w_shape, w_dtype = ctx.meta
        routing = (*layout, n_pairs, top_k, grid_m, block_m)
        dout = dout.contiguous()
        E = w13.shape[0]
        dh, d_weights = moe_gemm.down_backward(dout, w2, act, hpre, weights, routing)  # (pairs, 2I), (pairs,)
        # each expert's first block (E + 1,): expert_ids is ascending up to the padded total, -1 after
        ex = layout[1].to(torch.int64)
        ex = torch.where(ex < 0, E, ex)
        bounds = torch.searchsorted(ex, torch.arange(E + 1, device=ex.device))
        # dw2[e] = sum_p (w_p dout[t])^T act_p ; dw13[e] = sum_p dh_p^T x[t]
        dw2 = moe_gemm.expert_outer(dout, act, w2.shape, w2.dtype, routing, bounds, True, False, weights)
        dw13 = moe_gemm.expert_outer(dh, x, w13.shape, w13.dtype, routing, bounds, False, True)
        # dx[t] = sum_j dh_p @ w13[e]: B[e][k=c, n=h] = w13[e, c, h]
        up = (w13.stride(0), w13.stride(2), w13.stride(1))
        dx = moe_gemm.combine(moe_gemm.grouped_rows(dh, w13, up, x.shape[1], routing), x.shape[0], top_k, x.dtype)
        return dx, dw13, dw2, d_weights.view(w_shape).to(w_dtype), None


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Triton twin of :func:`baige.kernels.fused_moe` (see there for shapes), with autograd for x, w13,
    w2 and topk_weights. Without a gradient to track, no pre-activations are kept. Expert ids are not
    range-checked (no device sync).

    Raises:
        ValueError: shapes or dtypes that do not fit (T, H), (E, 2I, H), (E, H, I), (T, top_k).
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights)):
        return _FusedMoE.apply(x, w13, w2, topk_weights, topk_ids)
    routing = _routing(topk_ids, w13.shape[0], x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    return _forward(x, w13, w2, weights, routing, save_pre=False)[0]
