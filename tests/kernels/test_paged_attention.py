"""Paged-attention ops against contiguous causal attention (reference kernels, fp32), and the
runner's grouping of decodes by context length."""

import torch

from baige import kernels
from baige.runtime.infer.step_inputs import group_by_width


def test_decode_and_prefill_match_contiguous_attention():
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs, nb = 6, 2, 16, 4, 64
    kc, vc = torch.zeros(Hkv, nb + 1, bs, D), torch.zeros(Hkv, nb + 1, bs, D)
    lens = [1, 5, 13, 16]
    seqs = []
    free = list(torch.randperm(nb, generator=gen).tolist())
    for L in lens:
        q = torch.randn(L, H, D, generator=gen)
        k = torch.randn(L, Hkv, D, generator=gen)
        v = torch.randn(L, Hkv, D, generator=gen)
        table = [free.pop() for _ in range(-(-L // bs))]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
        kernels.store_kv(k, v, kc, vc, slots)
        seqs.append((q, k, v, table))
    scale = D**-0.5
    W = max(len(t) for *_, t in seqs) + 1  # one extra padded column
    tables = torch.tensor([t + [nb] * (W - len(t)) for *_, t in seqs])
    # decode: the last query of each sequence over its whole cache
    out = kernels.paged_decode_attention(
        torch.stack([q[-1] for q, *_ in seqs]), kc, vc, tables, torch.tensor(lens), scale
    )
    for i, (q, k, v, _) in enumerate(seqs):
        ref = kernels.attention(q[None], k[None], v[None], scale)[0, -1]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
    # prefill with a cached prefix: the last T_i queries of each sequence
    Ts = [1, 3, 13, 6]
    qs = torch.cat([q[L - T :] for (q, *_), L, T in zip(seqs, lens, Ts)])
    cu = torch.tensor([0] + torch.tensor(Ts).cumsum(0).tolist())
    out = kernels.paged_prefill_attention(qs, kc, vc, tables, cu, torch.tensor(lens), scale)
    for i, ((q, k, v, _), L, T) in enumerate(zip(seqs, lens, Ts)):
        ref = kernels.attention(q[None], k[None], v[None], scale)[0, L - T :]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_decode_groups_of_a_batch_match_one_call():
    # narrower tables per group (as the runner passes them) give the same rows as one wide call
    gen = torch.Generator().manual_seed(1)
    H, Hkv, D, bs = 4, 2, 8, 4
    kc, vc = torch.randn(Hkv, 12, bs, D, generator=gen), torch.randn(Hkv, 12, bs, D, generator=gen)
    q = torch.randn(3, H, D, generator=gen)
    tables = torch.tensor([[3, 11, 11], [0, 1, 11], [5, 6, 7]])
    lens = torch.tensor([2, 7, 12])
    full = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.3)
    first = kernels.paged_decode_attention(q[:1], kc, vc, tables[:1, :1], lens[:1], 0.3)
    torch.testing.assert_close(first, full[:1], atol=1e-6, rtol=1e-6)


def test_store_kv_writes_only_its_slots():
    kc, vc = torch.zeros(2, 3, 4, 2), torch.zeros(2, 3, 4, 2)  # (Hkv, blocks, block_size, D)
    k = torch.stack([torch.ones(2, 2), 3 * torch.ones(2, 2)], dim=1)  # (N=2, Hkv=2, D): head 0 ones, head 1 threes
    kernels.store_kv(k, 2 * k, kc, vc, torch.tensor([5, 10]))
    assert kc[0].reshape(-1, 2)[[5, 10]].eq(1).all() and kc[1].reshape(-1, 2)[[5, 10]].eq(3).all()
    assert vc[0].reshape(-1, 2)[[5, 10]].eq(2).all() and vc[1].reshape(-1, 2)[[5, 10]].eq(6).all()
    assert kc.sum() == 16 and vc.sum() == 32


def test_group_by_width_minimises_padded_work():
    assert group_by_width([3, 3, 3], overhead=6) == [3]
    assert group_by_width([1, 1, 1, 1, 30, 30], overhead=6) == [4, 6]  # 4*1+6 + 2*30+6 < 6*30+6
    assert group_by_width([1, 2, 3], overhead=100) == [3]  # overhead beats any saving
    assert group_by_width([1, 2, 3], overhead=0) == [1, 2, 3]
