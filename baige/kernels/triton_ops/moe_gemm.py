"""The grouped GEMMs of the fused MoE (:mod:`baige.kernels.triton_ops.moe`), forward and backward.

Every kernel walks the block layout of :func:`moe_align_block_size` (vLLM's ``fused_moe`` scheme):
``sorted_token_ids`` lists the (token, expert) pairs ``p = t * top_k + j`` grouped by expert, each
expert's segment padded to a multiple of ``BLOCK_M`` with the sentinel ``num_pairs``, and
``expert_ids[b]`` is the expert of block ``b``. A program of the row-wise kernels takes one block of
``BLOCK_M`` pairs (one expert) and one tile of output columns; blocks at or past
``num_tokens_post_padded`` (read from the device: no host sync) exit at once, sentinel rows are masked.

- :func:`gate_up`: ``act[p] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)`` with both halves in
  fp32 accumulators and SwiGLU in the epilogue (one rounding of ``act``; optionally the pre-activations).
- :func:`grouped_rows`: ``c[p] = (w_p *) a[p] @ B[e]``, fp32 rows per pair: the down projection with
  the routing weight (forward) and ``dx`` per pair (backward); :func:`combine` sums each token's
  ``top_k`` rows in fp32, deterministically (no atomics; vLLM's ``moe_sum`` step).
- :func:`down_backward`: ``g[p] = dout[t] @ w2[e]``, then ``d act = w_p g``, the SwiGLU backward and
  the partial sums of ``d w_p = g . act_p`` (one per column tile, summed by the caller).
- :func:`expert_outer`: ``dW[e] = sum over e's pairs of a[p]^T b[p]`` (``dw2``, ``dw13``): one program
  per (expert, output tile) loops over its expert's blocks, so no atomics and every tile is written
  (experts without pairs get zeros).

Tile sizes are a first guess (vLLM's default-config heuristic), not tuned on a GPU; the interpreter
gets wide tiles (its cost is mostly per program and per step, not per element).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baige.kernels.triton_ops.common import block_for, new_empty


@triton.jit
def _block_tile(SORTED, EXPERTS, pid_m, pid_n, num_pairs, top_k, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns of a row-wise kernel's program (block ``pid_m``, column tile ``pid_n`` of ``N``):
    ``(pairs, tokens, m_mask, e, cols, n_mask)``: the block's pair ids (int64), their tokens, the row mask
    (not the sentinel), its expert (int64), the tile's column ids and their mask."""
    pairs = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    e = tl.load(EXPERTS + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs // top_k, pairs < num_pairs, e, cols, cols < N


@triton.jit
def _rows_dot(
    A,
    rows,
    m_mask,
    B,
    cols,
    n_mask,
    K,
    sa_m,
    sb_n,
    sb_k,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) fp32 ``A[rows, :K] @ B[:K, cols]`` with ``B[k, n]`` at ``B + n * sb_n + k * sb_k``."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * sa_m + offs_k[None, :]
    b_ptrs = B + cols[None, :] * sb_n + offs_k[:, None] * sb_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * sb_k
    return acc


@triton.jit
def _gate_up_kernel(
    X,
    W13,
    ACT,
    HPRE,
    SORTED,
    EXPERTS,
    NTPP,
    num_pairs,
    top_k,
    inter,
    hidden,
    sx_t,
    sw_e,
    sw_n,
    sw_k,
    SAVE_PRE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NTPP):  # past the padded total: sorted_token_ids ends before this block
        return
    pairs, tok, m_mask, e, cols, n_mask = _block_tile(
        SORTED, EXPERTS, pid_m, pid_n, num_pairs, top_k, inter, BLOCK_M, BLOCK_N
    )
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = X + tok[:, None] * sx_t + offs_k[None, :]
    g_ptrs = W13 + e * sw_e + cols[None, :] * sw_n + offs_k[:, None] * sw_k  # (BLOCK_K, BLOCK_N) of gate_proj
    u_ptrs = g_ptrs + inter * sw_n  # the same columns of up_proj (rows I.. of w13[e])
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * sw_k
        u_ptrs += BLOCK_K * sw_k
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(ACT + pairs[:, None] * inter + cols[None, :], act.to(ACT.dtype.element_ty), mask=mask)
    if SAVE_PRE:
        h_ptrs = HPRE + pairs[:, None] * (2 * inter) + cols[None, :]
        tl.store(h_ptrs, acc_g.to(HPRE.dtype.element_ty), mask=mask)
        tl.store(h_ptrs + inter, acc_u.to(HPRE.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_rows_kernel(
    A,
    B,
    C,
    WEIGHTS,
    SORTED,
    EXPERTS,
    NTPP,
    num_pairs,
    top_k,
    N,
    K,
    sa_m,
    sb_e,
    sb_n,
    sb_k,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NTPP):  # past the padded total: sorted_token_ids ends before this block
        return
    pairs, _, m_mask, e, cols, n_mask = _block_tile(
        SORTED, EXPERTS, pid_m, pid_n, num_pairs, top_k, N, BLOCK_M, BLOCK_N
    )
    acc = _rows_dot(
        A, pairs, m_mask, B + e * sb_e, cols, n_mask, K, sa_m, sb_n, sb_k, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K
    )
    if MUL_WEIGHT:
        acc *= tl.load(WEIGHTS + pairs, mask=m_mask, other=0.0)[:, None]
    tl.store(C + pairs[:, None] * N + cols[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_backward_kernel(
    DOUT,
    W2,
    ACT,
    HPRE,
    WEIGHTS,
    DH,
    DW_PART,
    SORTED,
    EXPERTS,
    NTPP,
    num_pairs,
    top_k,
    inter,
    hidden,
    sdo_t,
    sw_e,
    sw_h,
    sw_i,
    n_parts,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NTPP):  # past the padded total: sorted_token_ids ends before this block
        return
    pairs, tok, m_mask, e, cols, n_mask = _block_tile(
        SORTED, EXPERTS, pid_m, pid_n, num_pairs, top_k, inter, BLOCK_M, BLOCK_N
    )
    # g[p, i] = sum_h dout[t, h] * w2[e, h, i]: d(unweighted down output) back through w2
    g = _rows_dot(
        DOUT, tok, m_mask, W2 + e * sw_e, cols, n_mask, hidden, sdo_t, sw_i, sw_h, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K
    )
    mask = m_mask[:, None] & n_mask[None, :]
    act = tl.load(ACT + pairs[:, None] * inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h_ptrs = HPRE + pairs[:, None] * (2 * inter) + cols[None, :]
    h1 = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    h3 = tl.load(h_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(WEIGHTS + pairs, mask=m_mask, other=0.0)
    tl.store(DW_PART + pairs * n_parts + pid_n, tl.sum(g * act, 1), mask=m_mask)
    d_act = g * w[:, None]
    sig = tl.sigmoid(h1)
    dh_ptrs = DH + pairs[:, None] * (2 * inter) + cols[None, :]
    tl.store(dh_ptrs, (d_act * h3 * sig * (1.0 + h1 * (1.0 - sig))).to(DH.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + inter, (d_act * h1 * sig).to(DH.dtype.element_ty), mask=mask)


@triton.jit
def _expert_outer_kernel(
    A,
    B,
    DW,
    WEIGHTS,
    SORTED,
    BOUNDS,
    num_pairs,
    top_k,
    N,
    K,
    sa_m,
    sb_m,
    sd_e,
    sd_n,
    sd_k,
    A_BY_TOKEN: tl.constexpr,
    B_BY_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, pid = tl.program_id(0), tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    cols_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = (pid // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = cols_n < N, cols_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for b in range(tl.load(BOUNDS + e), tl.load(BOUNDS + e + 1)):
        pairs = tl.load(SORTED + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_mask = pairs < num_pairs
        rows_a = pairs // top_k if A_BY_TOKEN else pairs
        rows_b = pairs // top_k if B_BY_TOKEN else pairs
        a = tl.load(A + rows_a[:, None] * sa_m + cols_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        if MUL_WEIGHT:
            w = tl.load(WEIGHTS + pairs, mask=m_mask, other=0.0)
            a = (a.to(tl.float32) * w[:, None]).to(A.dtype.element_ty)
        bt = tl.load(B + rows_b[:, None] * sb_m + cols_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), bt, acc, input_precision=PRECISION)
    e64 = e.to(tl.int64)
    tl.store(
        DW + e64 * sd_e + cols_n[:, None] * sd_n + cols_k[None, :] * sd_k,
        acc.to(DW.dtype.element_ty),
        mask=n_mask[:, None] & k_mask[None, :],
    )


@triton.jit
def _combine_kernel(Y, OUT, top_k, N, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(top_k):
        acc += tl.load(Y + (t * top_k + j) * N + cols, mask=mask, other=0.0)
    tl.store(OUT + t * N + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def tiles(dtype: torch.dtype, device: torch.device, n: int) -> tuple[int, int, dict]:
    """(BLOCK_N, BLOCK_K, launch options) for ``n`` output columns: 64-wide tiles on a GPU (32 for fp32,
    whose tiles take twice the registers); up to 256 x 128 in the interpreter, whose cost is per program."""
    if device.type != "cuda":
        return min(256, block_for(n)), 128, {}
    wide = 32 if dtype == torch.float32 else 64
    return min(wide, block_for(n)), wide, {"num_warps": 4, "num_stages": 3}


def precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 inputs (no TF32: the reference does not use it), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gate_up(x, w13, routing, save_pre: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``act`` (pairs, I) in x's dtype and, when ``save_pre``, the gate/up pre-activations (pairs, 2I)."""
    (sorted_ids, expert_ids, ntpp, n_pairs, top_k, grid_m, block_m) = routing
    inter = w13.shape[1] // 2
    act = new_empty((n_pairs, inter), x.dtype, x.device)
    hpre = new_empty((n_pairs, 2 * inter), x.dtype, x.device) if save_pre else act
    bn, bk, opts = tiles(x.dtype, x.device, inter)
    _gate_up_kernel[(grid_m, triton.cdiv(inter, bn))](
        x,
        w13,
        act,
        hpre,
        sorted_ids,
        expert_ids,
        ntpp,
        n_pairs,
        top_k,
        inter,
        x.shape[1],
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        SAVE_PRE=save_pre,
        PRECISION=precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **opts,
    )
    return act, hpre if save_pre else None


def grouped_rows(a, b, b_strides, n_cols, routing, weights=None) -> torch.Tensor:
    """(pairs, n_cols) fp32: row ``p`` is ``(w_p *) a[p] @ B[e]`` with ``B[e][k, n]`` at strides
    ``b_strides = (expert, n, k)`` of ``b``; ``a`` (pairs, K) contiguous."""
    (sorted_ids, expert_ids, ntpp, n_pairs, top_k, grid_m, block_m) = routing
    c = new_empty((n_pairs, n_cols), torch.float32, a.device)
    bn, bk, opts = tiles(a.dtype, a.device, n_cols)
    _grouped_rows_kernel[(grid_m, triton.cdiv(n_cols, bn))](
        a,
        b,
        c,
        weights if weights is not None else c,
        sorted_ids,
        expert_ids,
        ntpp,
        n_pairs,
        top_k,
        n_cols,
        a.shape[1],
        a.stride(0),
        *b_strides,
        MUL_WEIGHT=weights is not None,
        PRECISION=precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **opts,
    )
    return c


def combine(y: torch.Tensor, n_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(T * top_k, N) fp32 rows -> (T, N) in ``dtype``: each token's ``top_k`` rows summed in fp32."""
    n = y.shape[1]
    out = new_empty((n_tokens, n), dtype, y.device)
    block = min(1024, block_for(n))
    if n_tokens:
        _combine_kernel[(n_tokens, triton.cdiv(n, block))](y, out, top_k, n, BLOCK=block)
    return out


def down_backward(dout, w2, act, hpre, weights, routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh`` (pairs, 2I) in act's dtype (gradient of the gate/up pre-activations) and ``d weights`` (pairs,) fp32."""
    (sorted_ids, expert_ids, ntpp, n_pairs, top_k, grid_m, block_m) = routing
    inter = act.shape[1]
    bn, bk, opts = tiles(act.dtype, act.device, inter)
    n_parts = triton.cdiv(inter, bn)
    dh = new_empty((n_pairs, 2 * inter), act.dtype, act.device)
    parts = new_empty((n_pairs, n_parts), torch.float32, act.device)
    _down_backward_kernel[(grid_m, n_parts)](
        dout,
        w2,
        act,
        hpre,
        weights,
        dh,
        parts,
        sorted_ids,
        expert_ids,
        ntpp,
        n_pairs,
        top_k,
        inter,
        w2.shape[1],
        dout.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        n_parts,
        PRECISION=precision(act.dtype),
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **opts,
    )
    return dh, parts.sum(1)


def expert_outer(a, b, out_shape, out_dtype, routing, bounds, a_by_token, b_by_token, weights=None):
    """(E, N, K) in ``out_dtype``: ``dW[e] = sum over e's pairs p of (w_p *) a[row_a(p)]^T b[row_b(p)]``
    with rows the pair or (``*_by_token``) its token; ``bounds`` (E + 1,) the first block of each expert."""
    (sorted_ids, _, _, n_pairs, top_k, _, block_m) = routing
    n_exp, N, K = out_shape
    dw = new_empty(out_shape, out_dtype, a.device)
    bn, _, opts = tiles(a.dtype, a.device, N)
    bk, _, _ = tiles(a.dtype, a.device, K)
    _expert_outer_kernel[(n_exp, triton.cdiv(N, bn) * triton.cdiv(K, bk))](
        a,
        b,
        dw,
        weights if weights is not None else dw,
        sorted_ids,
        bounds,
        n_pairs,
        top_k,
        N,
        K,
        a.stride(0),
        b.stride(0),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        A_BY_TOKEN=a_by_token,
        B_BY_TOKEN=b_by_token,
        MUL_WEIGHT=weights is not None,
        PRECISION=precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **opts,
    )
    return dw
