"""Helpers for the context-parallel tests: a ring of threads standing in for CP ranks, and the fp64 oracle."""

from __future__ import annotations

import threading

import torch

from baige.runtime.train.context_parallel import shard_positions


class ThreadRing:
    """``shift`` for ``size`` threads of one process, each a CP rank: what rank r hands in, rank r + 1 gets."""

    def __init__(self, rank: int, size: int, board: dict):
        self.rank, self.size, self.board = rank, size, board

    def shift(self, t: torch.Tensor):
        self.board["slots"][self.rank] = t.clone()
        self.board["barrier"].wait()
        got = self.board["slots"][(self.rank - 1) % self.size].clone()
        self.board["barrier"].wait()
        return _Done(got)


class _Done:
    def __init__(self, t):
        self.t = t

    def wait(self):
        return self.t


def run_ranks(size: int, fn):
    """Run ``fn(rank, ring)`` on ``size`` threads sharing one ring; returns the results by rank."""
    board = {"slots": [None] * size, "barrier": threading.Barrier(size)}
    results, errors = [None] * size, []

    def target(rank):
        try:
            results[rank] = fn(rank, ThreadRing(rank, size, board))
        except BaseException as e:  # surfaces in the test, not lost in a thread
            errors.append(e)
            board["barrier"].abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def reference_attention(q, k, v, scale, docs=None):
    """Causal (and same-document) softmax attention written out: q (B, T, H, D), k/v (B, T, Hkv, D)."""
    B, T, H, D = q.shape
    g = H // k.shape[2]
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), vv)


def ring_case(n: int, chunk: int, docs: bool):
    """fp64 q/k/v of a window of 2 n chunk tokens (GQA 6 heads over 2 KV heads, head_dim 5) and the oracle's
    output and gradients."""
    from baige.runtime.train.context_parallel import document_ids

    T = 2 * n * chunk
    g = torch.Generator().manual_seed(n * 100 + chunk)
    q, k, v = (torch.randn(2, T, h, 5, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    grad = torch.randn(2, T, 6, 5, generator=g, dtype=torch.float64)
    doc = None
    if docs:  # documents of random lengths, the two rows cut differently
        doc = document_ids(torch.rand(2, T, generator=g) < 0.15)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(qr, kr, vr, 0.41, doc)
    out.backward(grad)
    return (q, k, v, grad, doc), (out.detach(), qr.grad, kr.grad, vr.grad)


def job_ring_gloo(output: str) -> None:
    """Each gloo rank runs ring and Ulysses attention (fp64, 2 x 7-token chunks per rank, documents) on its
    shard, forward and backward, and writes the largest differences to the oracle to ``output/attn_rank{R}.json``."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from baige.runtime.train.context_parallel import ContextParallel, ProcessGroupRing, RingAttention, TrainAttention

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    (q, k, v, grad, doc), ref = ring_case(n, 7, True)
    cp = ContextParallel(dist.group.WORLD, n, rank, "ulysses")
    pos = shard_positions(q.shape[1], n, rank)
    errors = {}
    for method in ("ring", "ulysses"):
        ql, kl, vl = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
        if method == "ring":
            out = RingAttention.apply(ql, kl, vl, 0.41, ProcessGroupRing(dist.group.WORLD), doc)
        else:
            out = TrainAttention(cp, pos, doc).attend(0, ql, kl, vl, 0.41)
        out.backward(grad[:, pos])
        got = (out.detach(), ql.grad, kl.grad, vl.grad)
        errors[method] = [float((a - b[:, pos]).abs().max()) for a, b in zip(got, ref)]
    Path(output).mkdir(parents=True, exist_ok=True)
    (Path(output) / f"attn_rank{rank}.json").write_text(json.dumps(errors))


def docs_data(path, chars: int = 30_000, seed: int = 0):
    """JSONL of ``{"text": ...}`` documents of 50 to 400 characters of Shakespeare: several per 1024-token window."""
    import json
    import random

    from train_utils import shakespeare

    text, rng, i = shakespeare(chars), random.Random(seed), 0
    with open(path, "w") as f:
        while i < len(text):
            n = rng.randint(50, 400)
            f.write(json.dumps({"text": text[i : i + n]}) + "\n")
            i += n
    return path
