"""Ring attention and the load-balanced sharding in one process: the CP ranks are threads sharing a ring
(tests/train/cp_utils.py), held to full causal attention in fp64. The multi-process runs are in
test_train_cp.py."""

from __future__ import annotations

import pytest
import torch
from cp_utils import ring_case, run_ranks

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.train import context_parallel
from baige.runtime.train.context_parallel import (
    RingAttention,
    block_forward,
    document_ids,
    masked_attention,
    merge,
    shard_positions,
)


def test_shard_positions_are_the_load_balanced_chunks():
    assert [shard_positions(12, 3, r).tolist() for r in range(3)] == [
        [0, 1, 10, 11],
        [2, 3, 8, 9],
        [4, 5, 6, 7],
    ]
    assert shard_positions(8, 1, 0).tolist() == list(range(8))


def test_document_ids_count_starts():
    starts = torch.tensor([[True, False, False, True, False, True], [False, False, True, False, False, False]])
    assert document_ids(starts).tolist() == [[1, 1, 1, 2, 2, 3], [0, 0, 1, 1, 1, 1]]


def test_merge_of_key_blocks_is_the_full_softmax():
    """Odd lengths: 13 queries over 37 keys cut into blocks of 11, 19 and 7; a block where some rows see
    nothing (-inf log-sum-exp) merges as zero weight."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 2, 13, 5, generator=g, dtype=torch.float64)  # (B, Hkv, G, Tq, D)
    k = torch.randn(2, 3, 37, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 37, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, 1, 13, 37, generator=g) < 0.6
    mask[..., 0] = True  # every query sees key 0, so the full softmax is defined
    mask[..., 3, 1:] = False  # query 3 sees only key 0: later blocks are empty for it
    full, full_lse = block_forward(q, k, v, mask, 0.37)
    out = torch.zeros_like(full)
    lse = torch.full(full_lse.shape, float("-inf"), dtype=torch.float64)
    for lo, hi in ((0, 11), (11, 30), (30, 37)):
        o_b, l_b = block_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], mask[..., lo:hi], 0.37)
        out, lse = merge(out, lse, o_b, l_b)
    assert (out - full).abs().max() < 1e-12
    assert (lse - full_lse).abs().max() < 1e-12
    s = (q @ k.unsqueeze(2).transpose(-1, -2) * 0.37).masked_fill(~mask, float("-inf"))  # written out
    assert (out - torch.softmax(s, dim=-1) @ v.unsqueeze(2)).abs().max() < 1e-12


@pytest.mark.parametrize(
    ("n", "chunk", "docs", "tile"),
    [(2, 7, False, 512), (2, 7, True, 3), (3, 5, True, 512), (3, 5, False, 2), (4, 3, False, 512)],
)
def test_ring_attention_forward_backward_equal_full_attention_fp64(n, chunk, docs, tile, monkeypatch):
    """``tile`` below the chunk length: the chunks are cut into tiles of 3 (or 2) and a shorter last one."""
    monkeypatch.setattr(context_parallel, "TILE", tile)
    (q, k, v, grad, doc), (ref_out, ref_dq, ref_dk, ref_dv) = ring_case(n, chunk, docs)
    T = q.shape[1]

    def rank_fn(rank, ring):
        pos = shard_positions(T, n, rank)
        ql, kl, vl = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
        out = RingAttention.apply(ql, kl, vl, 0.41, ring, doc)
        out.backward(grad[:, pos])
        return pos, out.detach(), ql.grad, kl.grad, vl.grad

    for pos, out, dq, dk, dv in run_ranks(n, rank_fn):
        assert (out - ref_out[:, pos]).abs().max() < 1e-10
        assert (dq - ref_dq[:, pos]).abs().max() < 1e-10
        assert (dk - ref_dk[:, pos]).abs().max() < 1e-10
        assert (dv - ref_dv[:, pos]).abs().max() < 1e-10


def test_masked_attention_on_a_permuted_sequence():
    """Ulysses' gathered sequence is in shard order: attention follows the positions, not the order."""
    (q, k, v, _, doc), (ref_out, *_) = ring_case(3, 5, True)
    order = torch.cat([shard_positions(30, 3, r) for r in range(3)])
    out = masked_attention(q[:, order], k[:, order], v[:, order], 0.41, order, doc[:, order])
    assert (out - ref_out[:, order]).abs().max() < 1e-10
    (q, k, v, _, _), (ref_out, *_) = ring_case(3, 5, False)
    out = masked_attention(q[:, order], k[:, order], v[:, order], 0.41, order, None)
    assert (out - ref_out[:, order]).abs().max() < 1e-10


def test_packed_windows_mark_document_starts():
    """Two files of 10 and 7 tokens, the first holding documents at 0, 4 and 9: windows of 5 tokens."""
    import numpy as np

    from baige.runtime.train.data import PackedWindows, TokenFile

    files = [
        TokenFile(np.arange(10, dtype=np.uint32), None, 9, np.array([0, 4, 9], dtype=np.int64)),
        TokenFile(np.arange(10, 17, dtype=np.uint32), None, 16),  # one document (the default)
    ]
    w = PackedWindows(files, 5)
    assert w.num_windows == 3
    assert w.starts(0).tolist() == [True, False, False, False, True]
    assert w.starts(1).tolist() == [False, False, False, False, True]  # token 9 starts the third document
    assert w.starts(2).tolist() == [True, False, False, False, False]  # the second file starts at token 10
    ids, labels, starts = w.batch([2, 0], documents=True)
    assert ids[0].tolist() == [10, 11, 12, 13, 14] and starts[1].tolist() == w.starts(0).tolist()
    assert document_ids(starts).tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 2]]


def test_token_cache_records_where_each_document_starts(tmp_path):
    """Three JSONL documents of 3, 1 and 5 characters, each followed by EOS: they start at 0, 4 and 6."""
    import json

    from train_utils import write_char_tokenizer

    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.train.data import tokenize_file

    write_char_tokenizer(tmp_path, "abcdefgh")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "d", "efgha")))
    f = tokenize_file(data, Tokenizer.from_dir(tmp_path), tmp_path, tmp_path / "cache")
    assert len(f.tokens) == 12 and f.doc_starts.tolist() == [0, 4, 6]
    again = tokenize_file(data, Tokenizer.from_dir(tmp_path), tmp_path, tmp_path / "cache")  # from the cache
    assert again.doc_starts.tolist() == [0, 4, 6]


def test_masked_attention_with_window_sinks_softcap_on_a_permuted_sequence():
    """Documents, a sliding window, sinks and a soft-cap on Ulysses' shard order equal each document's own
    windowed attention (kernels.attention) in position order."""
    (q, k, v, _, doc), _ = ring_case(3, 5, True)
    H = q.shape[2]
    extra = {"window": 4, "sinks": torch.linspace(-1.0, 2.0, H, dtype=q.dtype), "softcap": 2.5}
    order = torch.cat([shard_positions(30, 3, r) for r in range(3)])
    out = masked_attention(q[:, order], k[:, order], v[:, order], 0.41, order, doc[:, order], **extra)
    ref = torch.empty_like(q)
    for b in range(q.shape[0]):
        for d in doc[b].unique().tolist():
            at = (doc[b] == d).nonzero()[:, 0]
            ref[b, at] = kernels.attention(q[b : b + 1, at], k[b : b + 1, at], v[b : b + 1, at], 0.41, **extra)[0]
    assert (out - ref[:, order]).abs().max() < 1e-10


def test_ring_attention_refuses_a_window():
    cp = context_parallel.ContextParallel(None, 2, 0, "ring")
    meta = context_parallel.TrainAttention.__new__(context_parallel.TrainAttention)
    meta.cp, meta.positions, meta.docs, meta._ring = cp, torch.arange(4), None, None
    q = torch.zeros(1, 4, 2, 4)
    with pytest.raises(BaigeError, match="ring attention does not support window"):
        meta.attend(0, q, q, q, 0.5, window=8)
