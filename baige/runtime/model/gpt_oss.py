"""gpt-oss's routed experts: projections with biases and the clamped SwiGLU variant.

transformers' ``GptOssExperts`` (models/gpt_oss/modeling_gpt_oss.py, 5.24), per routed pair (token t,
expert e, routing weight w)::

    gate_up = x_t @ W13_e^T + b13_e                        # (2I,)
    g = clamp(gate, max=limit); u = clamp(up, -limit, limit)
    act = (u + 1) * g * sigmoid(alpha * g)                 # (I,)
    out_t += w * (act @ W2_e^T + b2_e)                     # (H,)

HF keeps gate and up interleaved (``gate_up[..., ::2]``, ``[..., 1::2]``) in an (E, H, 2I) tensor; baige
holds them as its other families do, gate rows then up rows in (E, 2I, H)
(:mod:`baige.runtime.weights.gpt_oss_layout` converts on load and save), so the same halves are
``gate_up[:, :I]`` and ``gate_up[:, I:]``.

``kernels.fused_moe`` (reference, native CPU and Triton) has neither biases nor this activation, so
these experts run the reference's grouped formulation here in PyTorch: the (token, expert) pairs
sorted by expert, one matmul chain per expert that has pairs, one ``index_add`` combine (Megablocks'
dropless form, Gale et al. 2022, arXiv:2211.15841). It is differentiable (training) and runs on any
device; it reads the expert counts on the host once per call, so it is not CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``
    (OpenAI's gpt-oss reference; transformers' ``GptOssExperts._apply_gate``). gate, up: (..., I) -> (..., I)."""
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def biased_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    alpha: float | None,
    limit: float | None,
) -> torch.Tensor:
    """The routed experts with optional biases and the clamped SwiGLU (module docstring).

    Args:
        x: (T, H) fp32/fp16/bf16/fp64.
        w13: (E, 2I, H), x's dtype: rows [0, I) gate, [I, 2I) up. b13: (E, 2I) or None.
        w2: (E, H, I), x's dtype. b2: (E, H) or None.
        topk_weights: (T, k) float; topk_ids: (T, k) int64 in [0, E).
        alpha, limit: the clamped SwiGLU's parameters; both None: the plain SwiGLU ``silu(gate) * up``.
    Returns:
        (T, H) in x's dtype; the weighted combine in fp32 (fp64 for fp64 x). Differentiable w.r.t. x,
        the weights, the biases and topk_weights.
    """
    T, k = topk_ids.shape
    inter = w2.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = topk_ids.reshape(-1)  # (T * k,)
    order = torch.argsort(flat, stable=True)  # (T * k,) pair indices grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tok = order // k  # (T * k,) token of each sorted pair
    xs = x.index_select(0, tok)  # (T * k, H) sorted by expert
    w_sorted = topk_weights.reshape(-1).index_select(0, order).to(acc)[:, None]  # (T * k, 1)
    b13s = b13.unbind(0) if b13 is not None else [None] * len(counts)
    b2s = b2.unbind(0) if b2 is not None else [None] * len(counts)
    pieces, start = [], 0
    # unbind: one backward stack for all experts instead of a full-size zero gradient per indexed expert
    for c, w13_e, b13_e, w2_e, b2_e in zip(counts, w13.unbind(0), b13s, w2.unbind(0), b2s):
        if c:
            gate_up = F.linear(xs[start : start + c], w13_e, b13_e)  # (c, 2I)
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            act = F.silu(gate) * up if limit is None else clamped_swiglu(gate, up, alpha, limit)  # (c, I)
            pieces.append(F.linear(act, w2_e, b2_e))  # (c, H)
            start += c
    y = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])  # (T * k, H) in sorted order
    weighted = y.to(acc) * w_sorted
    return torch.zeros(T, x.shape[1], dtype=acc, device=x.device).index_add(0, tok, weighted).to(x.dtype)
