"""Helpers for the context-parallel tests: a ring of threads standing in for CP ranks, and the fp64 oracle."""

from __future__ import annotations

import threading

import torch


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
