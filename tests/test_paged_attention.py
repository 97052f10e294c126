"""Paged-attention ops against contiguous causal attention (reference kernels, fp32)."""

import torch

from baige import kernels




def test_decode_and_prefill_match_contiguous_attention():
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs, nb = 6, 2, 16, 4, 64
    kc, vc = torch.zeros(nb + 1, bs, Hkv, D), torch.zeros(nb + 1, bs, Hkv, D)
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
    scale = D ** -0.5
    W = max(len(t) for *_, t in seqs) + 1  # one extra padded column
    tables = torch.tensor([t + [nb] * (W - len(t)) for *_, t in seqs])
    # decode: the last query of each sequence over its whole cache
    out = kernels.paged_decode_attention(torch.stack([q[-1] for q, *_ in seqs]), kc, vc, tables,
                                         torch.tensor(lens), scale)
    for i, (q, k, v, _) in enumerate(seqs):
        ref = kernels.attention(q[None], k[None], v[None], scale)[0, -1]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
    # prefill with a cached prefix: the last T_i queries of each sequence
    Ts = [1, 3, 13, 6]
    qs = torch.cat([q[L - T:] for (q, *_), L, T in zip(seqs, lens, Ts)])
    cu = torch.tensor([0] + torch.tensor(Ts).cumsum(0).tolist())
    out = kernels.paged_prefill_attention(qs, kc, vc, tables, cu, torch.tensor(lens), scale)
    for i, ((q, k, v, _), L, T) in enumerate(zip(seqs, lens, Ts)):
        ref = kernels.attention(q[None], k[None], v[None], scale)[0, L - T:]
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_only_its_slots():
    kc, vc = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
    k = torch.ones(2, 1, 2)
    kernels.store_kv(k, 2 * k, kc, vc, torch.tensor([5, 10]))
    assert kc.view(-1, 1, 2)[[5, 10]].eq(1).all() and vc.view(-1, 1, 2)[[5, 10]].eq(2).all()
    assert kc.sum() == 4 and vc.sum() == 8
