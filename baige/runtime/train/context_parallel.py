"""Context parallelism: the sequence dimension of every training window sharded over the ``cp`` mesh dimension.

Sharding (load-balanced causal, as torchtitan and Megatron-Core do): a window of ``T`` tokens is cut into
``2 N`` chunks of ``C = T / (2 N)`` tokens for ``N`` context-parallel ranks, and rank ``r`` holds chunks ``r``
and ``2N - 1 - r`` (so every rank has the same amount of causal attention work). Its tokens keep their
global positions (RoPE) and their labels; the loss of a shard is its summed token cross-entropy over the
step's global number of valid targets, so the sum over ranks is the one-process loss.

Attention over the sharded sequence, two methods (``parallelism.context_parallel_method``):

- ``ring`` (Liu et al. 2023, "Ring Attention", arXiv:2310.01889): the K/V of each shard travel around the
  CP ranks in ``N`` steps (P2P send to ``r + 1``, receive from ``r - 1``), each rank attends its queries
  to the visiting block and merges the partial outputs by their log-sum-exp (the online softmax of
  Milakov & Gimelshein 2018, arXiv:1805.02867; FlashAttention's rescaling). The backward recomputes each
  block's probabilities from the saved log-sum-exp and sends dK/dV around the ring with their block until
  they are back with their owner (FlashAttention-2's backward, Dao 2023, arXiv:2307.08691). Memory per
  rank: its own Q/K/V and one visiting block, never the whole sequence.
- ``ulysses`` (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509): an all-to-all turns the
  sequence-sharded (B, T/N, H, D) Q/K/V into head-sharded (B, T, H/N, D), each rank attends over the whole
  sequence for its heads, and a second all-to-all brings the output back. Needs ``H`` and ``H_kv`` (the
  per-rank counts under TP) divisible by ``N``.

Document masking (``training.attn_mask_type = "block_causal"``): a token attends only to earlier tokens of
its own document; the window's document ids ride along with the shard (every rank holds the whole
window's ids, so the masks of visiting blocks are known without communication).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from baige import kernels
from baige.errors import BaigeError

# ---- load-balanced sharding -------------------------------------------------------------------------


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of
    ``seq_len / (2 cp_size)`` tokens each. Returns (seq_len / cp_size,) int64. ``seq_len`` must be a
    multiple of ``2 cp_size`` (the config checks it)."""
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat((torch.arange(first, first + c), torch.arange(second, second + c))).to(device)


def document_ids(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True where a token starts a document -> (B, T) int64 document index (0, 1, ...)."""
    return torch.cumsum(starts.long(), dim=1)


# ---- block attention (the pieces the ring is built from) --------------------------------------------


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees no key) replaced by 0, so ``exp(s - lse)`` stays 0, not nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def block_forward(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block to one key block, with its log-sum-exp.

    Args:
        q: (B, Hkv, G, Tq, D) queries grouped by KV head (G = n_heads / n_kv_heads).
        k, v: (B, Hkv, Tk, D).
        mask: (B or 1, 1, 1, Tq, Tk) bool, True = visible; None = all visible.
    Returns:
        ``(out, lse)``: (B, Hkv, G, Tq, D) softmax-normalised over this block, and (B, Hkv, G, Tq) the
        log-sum-exp of the scaled scores (-inf where a query sees no key of the block; its out is 0).
    """
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Tq)
    p = torch.exp(s - _finite(lse)[..., None])
    return p @ v.unsqueeze(2), lse


def merge(out, lse, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets:
    ``lse = log(e^lse + e^lse_b)``, ``out = out e^(lse_old - lse) + out_b e^(lse_b - lse)``."""
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    return out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None], new


def block_backward(q, k, v, mask, scale: float, do, lse, delta):
    """Gradients of one (query block, key block) pair from the final log-sum-exp (FlashAttention-2's
    backward): ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - delta)``, ``dQ = dS K scale``,
    ``dK = dS^T Q scale``, with ``delta = rowsum(dO * O)``.

    Shapes as :func:`block_forward`; ``do`` (B, Hkv, G, Tq, D), ``lse``/``delta`` (B, Hkv, G, Tq).
    Returns ``(dq, dk, dv)``: (B, Hkv, G, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D).
    """
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - _finite(lse)[..., None])
    dv = (p.transpose(-1, -2) @ do).sum(2)  # (B, Hkv, Tk, D)
    ds = p * (do @ v.unsqueeze(2).transpose(-1, -2) - delta[..., None]) * scale  # (B, Hkv, G, Tq, Tk)
    return ds @ k.unsqueeze(2), (ds.transpose(-1, -2) @ q).sum(2), dv


# ---- the ring ---------------------------------------------------------------------------------------


class ProcessGroupRing:
    """The CP ranks as a ring over a torch.distributed group: :meth:`shift` sends a tensor to the next
    rank and receives the previous rank's (P2P, so the transfer overlaps the caller's compute until
    ``wait``). Works over gloo (CPU) and nccl (CUDA)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, t: torch.Tensor) -> "_Pending":
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self._next, self.group), dist.P2POp(dist.irecv, buf, self._prev, self.group)]
        return _Pending(dist.batch_isend_irecv(ops), buf, t)


class _Pending:
    def __init__(self, works, buf: torch.Tensor, sent: torch.Tensor):
        self.works, self.buf, self.sent = works, buf, sent  # the sent tensor lives until the send completes

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.buf


TILE = 512  # query and key tile of the ring's block attention: transient scores are (B, H, TILE, TILE)


def _tiles(rank: int, src: int, n: int, c: int):
    """The (query tile, key tile) pairs where rank ``rank``'s queries see something of rank ``src``'s keys, as
    ``(query slice, key slice, mask)`` with ``mask`` one of ``"all"`` (every key visible to every query) or
    ``(q0, k0)``, the global positions of the tiles' first query and key (a causal mask is needed). Tiles
    are at most :data:`TILE` long and never straddle a chunk, so their positions are contiguous."""
    mine, theirs = (rank, 2 * n - 1 - rank), (src, 2 * n - 1 - src)
    for a, i in enumerate(mine):
        for qlo in range(0, c, TILE):
            nq = min(TILE, c - qlo)
            q0 = i * c + qlo
            for b, j in enumerate(theirs):
                for klo in range(0, c, TILE):
                    nk = min(TILE, c - klo)
                    k0 = j * c + klo
                    if k0 > q0 + nq - 1:  # every key after every query
                        continue
                    mask = "all" if k0 + nk - 1 <= q0 else (q0, k0)
                    yield slice(a * c + qlo, a * c + qlo + nq), slice(b * c + klo, b * c + klo + nk), mask, q0, k0


def _tile_mask(mask, q0: int, k0: int, nq: int, nk: int, docs: torch.Tensor | None, device):
    """Mask of a tile pair: causal unless ``mask == "all"``, same document when ``docs`` (B, T) is given.
    (B or 1, 1, 1, nq, nk) bool, or None (all visible)."""
    out = None
    if mask != "all":
        qpos = torch.arange(q0, q0 + nq, device=device)
        kpos = torch.arange(k0, k0 + nk, device=device)
        out = (kpos[None, :] <= qpos[:, None])[None, None, None]
    if docs is not None:
        same = (docs[:, q0 : q0 + nq, None] == docs[:, None, k0 : k0 + nk])[:, None, None]  # (B, 1, 1, nq, nk)
        out = same if out is None else out & same
    return out


def _heads_first(q: torch.Tensor, n_kv: int, dtype) -> torch.Tensor:
    B, T, H, D = q.shape
    return q.view(B, T, n_kv, H // n_kv, D).permute(0, 2, 3, 1, 4).to(dtype)  # (B, Hkv, G, T, D)


def _heads_last(x: torch.Tensor, dtype) -> torch.Tensor:
    B, Hkv, G, T, D = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G, D).to(dtype)  # (B, T, H, D)


class RingAttention(torch.autograd.Function):
    """Causal (optionally document-masked) attention of load-balanced shards around a ring.

    forward(q (B, Tl, H, D), k, v (B, Tl, Hkv, D), scale, ring, docs (B, T) int64 or None) -> (B, Tl, H, D),
    where Tl = T / N and this rank holds chunks ``ring.rank`` and ``2N - 1 - ring.rank``. Accumulates in
    fp32 (fp64 for fp64 inputs). ``ring``: anything with ``rank``, ``size`` and ``shift(t).wait()``.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, ring, docs):
        n, r, c = ring.size, ring.rank, q.shape[1] // 2
        dt = _acc_dtype(q)
        qh = _heads_first(q, k.shape[2], dt)  # (B, Hkv, G, Tl, D)
        out = torch.zeros_like(qh)
        lse = torch.full(qh.shape[:-1], float("-inf"), dtype=dt, device=q.device)  # (B, Hkv, G, Tl)
        block = torch.stack((k, v)).transpose(2, 3).contiguous()  # (2, B, Hkv, Tl, D): travels the ring
        for step in range(n):
            src = (r - step) % n
            pending = ring.shift(block) if step < n - 1 else None
            for qs, ks, kind, q0, k0 in _tiles(r, src, n, c):
                kb, vb = block[0][:, :, ks].to(dt), block[1][:, :, ks].to(dt)
                mask = _tile_mask(kind, q0, k0, qs.stop - qs.start, ks.stop - ks.start, docs, q.device)
                o_b, l_b = block_forward(qh[..., qs, :], kb, vb, mask, scale)
                out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o_b, l_b)
            if pending is not None:
                block = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.ring, ctx.docs = scale, ring, docs
        return _heads_last(out, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, docs = ctx.ring, ctx.scale, ctx.docs
        n, r, c = ring.size, ring.rank, q.shape[1] // 2
        dt = out.dtype
        qh, do = _heads_first(q, k.shape[2], dt), _heads_first(grad_out, k.shape[2], dt)
        delta = (do * out).sum(-1)  # (B, Hkv, G, Tl)
        dq = torch.zeros_like(qh)
        block = torch.stack((k, v)).transpose(2, 3).contiguous()  # (2, B, Hkv, Tl, D)
        dblock = torch.zeros(block.shape, dtype=dt, device=q.device)  # dK/dV of the visiting block
        for step in range(n):
            src = (r - step) % n
            pending = ring.shift(block) if step < n - 1 else None
            for qs, ks, kind, q0, k0 in _tiles(r, src, n, c):
                kb, vb = block[0][:, :, ks].to(dt), block[1][:, :, ks].to(dt)
                mask = _tile_mask(kind, q0, k0, qs.stop - qs.start, ks.stop - ks.start, docs, q.device)
                dq_b, dk_b, dv_b = block_backward(
                    qh[..., qs, :], kb, vb, mask, scale, do[..., qs, :], lse[..., qs], delta[..., qs]
                )
                dq[..., qs, :] += dq_b
                dblock[0][:, :, ks] += dk_b
                dblock[1][:, :, ks] += dv_b
            dblock = ring.shift(dblock).wait()  # with its block to the next rank; after N shifts, home
            if pending is not None:
                block = pending.wait()
        dk, dv = dblock.transpose(2, 3)  # (B, Tl, Hkv, D) each
        return _heads_last(dq, q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# ---- Ulysses: all-to-all between sequence and head sharding ------------------------------------------


def _all_to_all(x: torch.Tensor, group, n: int, to_heads: bool) -> torch.Tensor:
    """(B, T/N, H, D) sequence-sharded -> (B, T, H/N, D) head-sharded (``to_heads``), or back.
    The gathered sequence is in rank order (rank 0's shard, rank 1's, ...)."""
    B, T, H, D = x.shape
    if to_heads:
        send = x.view(B, T, n, H // n, D).permute(2, 0, 1, 3, 4).contiguous()  # (N, B, T/N, H/N, D)
    else:
        send = x.view(B, n, T // n, H, D).transpose(0, 1).contiguous()  # (N, B, T/N, H/N, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # dim 0: from rank i
    if to_heads:
        return recv.transpose(0, 1).reshape(B, n * T, H // n, D)  # (B, T, H/N, D)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, T // n, n * H, D)  # (B, T/N, H, D)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, n, to_heads):
        ctx.group, ctx.n, ctx.to_heads = group, n, to_heads
        return _all_to_all(x, group, n, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.n, not ctx.to_heads), None, None, None


def masked_attention(
    q, k, v, scale: float, positions: torch.Tensor, docs: torch.Tensor | None, **extra
) -> torch.Tensor:
    """Attention over a whole (possibly permuted) sequence: query at ``positions[i]`` sees keys at
    positions ``<=`` its own (and ``> positions[i] - window`` with a window), of the same document when
    ``docs`` (B, T) is given.

    q (B, T, H, D), k/v (B, T, Hkv, D), positions (T,) int64 -> (B, T, H, D); ``extra``: ``window``,
    ``sinks`` ((H,), this call's heads), ``softcap`` as :func:`baige.kernels.attention`'s. Plain causal
    attention in position order goes through ``kernels.attention``; a document mask through
    ``kernels.masked_attention``.
    """
    if docs is None:
        order = torch.argsort(positions)
        if torch.equal(order, torch.arange(len(order), device=order.device)):
            return kernels.attention(q, k, v, scale, **extra)
        inverse = torch.argsort(order)
        o = kernels.attention(q[:, order], k[:, order], v[:, order], scale, **extra)
        return o[:, inverse]
    window = extra.pop("window", None)
    mask = kernels.visible_keys(positions, positions, window)[None] & (
        docs[:, :, None] == docs[:, None, :]
    )  # (B, T, T)
    return kernels.masked_attention(q, k, v, scale, mask, **extra)


# ---- the trainer's handle ---------------------------------------------------------------------------


@dataclass
class ContextParallel:
    """This rank's place on the ``cp`` mesh dimension and the attention method; ``group`` None with
    ``size`` 1 (document masking without CP)."""

    group: object
    size: int
    rank: int
    method: str = "ring"

    @classmethod
    def from_mesh(cls, mesh, method: str) -> "ContextParallel":
        cp = mesh["cp"]
        return cls(cp.get_group(), cp.size(), cp.get_local_rank(), method)

    def shard(
        self, input_ids: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, "TrainAttention"]:
        """One micro-batch's shard for this rank.

        Args:
            input_ids, labels: (B, T) int64, the whole windows.
            starts: (B, T) bool document starts (block_causal), or None (causal over the window).
        Returns:
            ``(input_ids, labels, positions, attn_metadata)``: (B, T/N) int64 each, positions global.
        """
        B, T = input_ids.shape
        pos = shard_positions(T, self.size, self.rank, input_ids.device)  # (T/N,)
        docs = document_ids(starts).to(input_ids.device) if starts is not None else None
        meta = TrainAttention(self, pos, docs)
        return input_ids[:, pos], labels[:, pos], pos.expand(B, -1), meta


class TrainAttention:
    """Attention metadata of one training micro-batch under context parallelism or document masking
    (the model calls :meth:`attend`; ``attn_metadata=None`` stays plain causal attention)."""

    def __init__(self, cp: ContextParallel, positions: torch.Tensor, docs: torch.Tensor | None):
        self.cp, self.positions, self.docs = cp, positions, docs  # (T/N,) global positions, (B, T) or None
        self._ring = ProcessGroupRing(cp.group) if cp.size > 1 and cp.method == "ring" else None

    def attend(self, layer_idx: int, q, k, v, scale: float, *, window=None, sinks=None, softcap=None) -> torch.Tensor:
        """q (B, T/N, H, D), k/v (B, T/N, Hkv, D) of this rank's shard -> (B, T/N, H, D); ``window``,
        ``sinks`` (H,), ``softcap`` as :func:`baige.kernels.attention`'s.

        Raises:
            BaigeError: ring attention (``cp.method`` ring, more than one rank) asked for one of them.
        """
        cp = self.cp
        extra = {"window": window, "sinks": sinks, "softcap": softcap}
        if cp.size == 1:
            return masked_attention(q, k, v, scale, self.positions, self.docs, **extra)
        if cp.method == "ring":
            for name, value in extra.items():
                if value is not None:
                    raise BaigeError(f"context parallelism with ring attention does not support {name} (use ulysses)")
            return RingAttention.apply(q, k, v, scale, self._ring, self.docs)
        n = cp.size
        qh, kh, vh = (_AllToAll.apply(t, cp.group, n, True) for t in (q, k, v))  # (B, T, H/N, D)
        every = torch.cat([shard_positions(len(self.positions) * n, n, i, q.device) for i in range(n)])  # (T,)
        docs = self.docs[:, every] if self.docs is not None else None
        if sinks is not None:  # this rank holds query heads [rank * H/N, (rank + 1) * H/N) after the all-to-all
            per = qh.shape[2]
            extra["sinks"] = sinks[cp.rank * per : (cp.rank + 1) * per]
        o = masked_attention(qh, kh, vh, scale, every, docs, **extra)
        return _AllToAll.apply(o, cp.group, n, False)  # (B, T/N, H, D)
