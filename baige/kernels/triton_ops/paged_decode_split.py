"""Split-K decode of the Triton paged attention (flash-decoding, Dao et al. 2023): how many key ranges a
decode is split into, and the kernel that combines the ranges' partial softmax statistics and outputs
(:mod:`.paged_attention` launches both). Attention sinks join here, once per row, not in the ranges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_reduce_kernel(
    WS_M,
    WS_L,
    WS_ACC,
    O,
    SINKS,
    so_t,
    so_h,
    n_kv,
    n_splits,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Combine the per-split (max, sum, unnormalised output) of one sequence's KV head: the query's
    rows are the first G_PAD rows of each split's tile (token 0 of the decode). With sinks, each query
    head's sink logit (base 2) joins the max and the denominator and adds no value."""
    seq, kvh = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq * n_kv + kvh) * n_splits
    s_mask = sp < n_splits
    idx = (base + sp)[:, None] * ROWS + g[None, :]  # (SPLITS_PAD, G_PAD)
    m = tl.load(WS_M + idx, mask=s_mask[:, None], other=float("-inf"))
    l = tl.load(WS_L + idx, mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)  # finite: the split holding the query's own key saw it
    if HAS_SINKS:
        sink = tl.load(SINKS + kvh * GROUP + g, mask=g < GROUP, other=0.0)
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max[None, :])  # 0 for empty splits (m = -inf)
    l_tot = tl.sum(l * w, 0)
    if HAS_SINKS:
        l_tot += tl.exp2(sink - m_max)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for s in range(0, n_splits):
        ms = tl.load(WS_M + (base + s) * ROWS + g)
        part = tl.load(WS_ACC + ((base + s) * ROWS + g)[:, None] * BLOCK_D + offs_d[None, :])
        acc += part * tl.exp2(ms - m_max)[:, None]
    out = acc / l_tot[:, None]
    head = kvh * GROUP + g
    tl.store(
        O + seq * so_t + head[:, None] * so_h + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=(g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


_SM_COUNT: dict[int, int] = {}


def decode_splits(n_seq: int, n_kv: int, span: int, device: torch.device) -> int:
    """How many key ranges each decode (sequence, KV head) is split into (flash-decoding, Dao et al.
    2023), ``span`` the most keys one decode reads (the table's slots; with a window, the window plus
    one key tile): enough programs for two waves over the GPU's SMs when the batch alone gives fewer,
    each range at least 256 keys; at most 64. In the interpreter: up to 4 ranges of 64+ keys, so the
    tests exercise the split path. A host-side choice from shapes only: CUDA-graph safe."""
    if device.type != "cuda":
        return max(1, min(4, span // 64))
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * _SM_COUNT[device.index], max(1, n_seq * n_kv))
    return max(1, min(want, span // 256, 64))


def merge_splits(ws_m, ws_l, ws_acc, out, sinks, group: int, g_pad: int, head_dim: int, block_d: int) -> None:
    """Combine a split decode's partials into ``out`` (S, n_heads, head_dim): one program per (sequence,
    KV head). ``ws_m``, ``ws_l``: (S, n_kv, n_splits, rows) fp32 running max and sum per split (base 2);
    ``ws_acc``: (S, n_kv, n_splits, rows, block_d) fp32 unnormalised outputs; ``sinks``: (n_heads,) fp32
    sink logits in base-2 units, or None."""
    n_seq, n_kv, n_splits, rows = ws_m.shape
    _decode_reduce_kernel[(n_seq, n_kv)](
        ws_m,
        ws_l,
        ws_acc,
        out,
        ws_m if sinks is None else sinks,
        out.stride(0),
        out.stride(1),
        n_kv,
        n_splits,
        GROUP=group,
        G_PAD=g_pad,
        ROWS=rows,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SPLITS_PAD=triton.next_power_of_2(n_splits),
        HAS_SINKS=sinks is not None,
    )
