"""Sliding windows, attention sinks and logit soft-capping (issue #47) in the attention ops, against a
hand-written fp64 loop (transformers' meanings: a query at p sees keys p - w < s <= p; a sink is an extra
per-head logit in the softmax denominator with no value; soft-cap c maps a score x to c * tanh(x / c)),
and the paged ops against the contiguous one."""

import math

import pytest
import torch

from baige import kernels


def _loop_attention(q, k, v, scale, q_offset=0, window=None, sinks=None, softcap=None):
    """The definition, one query row at a time in Python floats: q (B, T, H, D), k/v (B, S, Hkv, D)."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            p = q_offset + t
            first = 0 if window is None else max(0, p - window + 1)
            for h in range(H):
                logits = []
                for s in range(first, p + 1):
                    x = scale * float(q[b, t, h].double() @ k[b, s, h // group].double())
                    logits.append(softcap * math.tanh(x / softcap) if softcap is not None else x)
                extra = [float(sinks[h])] if sinks is not None else []
                m = max(logits + extra)
                denom = sum(math.exp(x - m) for x in logits + extra)
                for j, s in enumerate(range(first, p + 1)):
                    out[b, t, h] += math.exp(logits[j] - m) / denom * v[b, s, h // group].double()
    return out


def _qkv(B, T, S, H, Hkv, D, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen, dtype=dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "T,S,window",
    [(7, 7, 3), (4, 11, 5), (1, 9, 4), (5, 12, 1), (6, 6, 20), (3, 10, 10)],
)
def test_sliding_window_matches_the_definition(T, S, window):
    q, k, v = _qkv(2, T, S, 6, 2, 5, seed=T * 31 + window)
    out = kernels.attention(q, k, v, 0.4, q_offset=S - T, window=window)
    torch.testing.assert_close(out, _loop_attention(q, k, v, 0.4, S - T, window=window), atol=1e-12, rtol=1e-12)


def test_a_window_as_long_as_the_context_is_plain_causal():
    q, k, v = _qkv(1, 5, 9, 4, 4, 8, seed=3)
    out = kernels.attention(q, k, v, 0.3, q_offset=4, window=9)
    torch.testing.assert_close(out, kernels.attention(q, k, v, 0.3, q_offset=4), atol=1e-12, rtol=1e-12)
    narrow = kernels.attention(q, k, v, 0.3, q_offset=4, window=3)
    assert (narrow - out).abs().max() > 1e-2  # the window changes rows whose context is longer than it


@pytest.mark.parametrize("sink_values", [[0.0, 1.5, -0.7, 3.0, 0.2, -2.0], [-1e4] * 6, [8.0] * 6])
def test_sinks_match_the_definition(sink_values):
    q, k, v = _qkv(2, 5, 8, 6, 3, 7, seed=11)
    sinks = torch.tensor(sink_values, dtype=torch.float32)
    out = kernels.attention(q, k, v, 0.35, q_offset=3, sinks=sinks)
    torch.testing.assert_close(out, _loop_attention(q, k, v, 0.35, 3, sinks=sinks), atol=1e-12, rtol=1e-12)


def test_a_very_negative_sink_has_no_effect_and_a_large_one_shrinks_the_output():
    q, k, v = _qkv(1, 4, 4, 2, 1, 8, seed=5)
    plain = kernels.attention(q, k, v, 0.3)
    gone = kernels.attention(q, k, v, 0.3, sinks=torch.full((2,), -1e4))
    torch.testing.assert_close(gone, plain, atol=1e-12, rtol=1e-12)
    # a sink of logit s takes weight e^s / (e^s + sum e^scores): the output is the plain one scaled down
    loud = kernels.attention(q, k, v, 0.3, sinks=torch.full((2,), 30.0))
    assert loud.abs().max() < 1e-6 < plain.abs().max()


@pytest.mark.parametrize("softcap", [0.5, 2.0, 50.0])
def test_softcap_matches_the_definition(softcap):
    q, k, v = _qkv(2, 6, 6, 4, 2, 6, seed=int(softcap * 10))
    q = q * 3  # scores well past the cap
    out = kernels.attention(q, k, v, 0.5, softcap=softcap)
    torch.testing.assert_close(out, _loop_attention(q, k, v, 0.5, softcap=softcap), atol=1e-12, rtol=1e-12)


def test_window_sinks_and_softcap_together_and_their_gradients():
    q, k, v = _qkv(1, 5, 9, 4, 2, 3, seed=9)
    sinks = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)
    out = kernels.attention(q, k, v, 0.6, q_offset=4, window=3, sinks=sinks, softcap=1.5)
    ref = _loop_attention(q, k, v, 0.6, 4, window=3, sinks=sinks, softcap=1.5)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]

    def fn(q, k, v, sinks):
        return kernels.attention(q, k, v, 0.6, q_offset=4, window=3, sinks=sinks, softcap=1.5)

    assert torch.autograd.gradcheck(fn, inputs)


def test_masked_attention_takes_sinks_and_softcap():
    q, k, v = _qkv(2, 5, 5, 4, 2, 6, seed=13)
    sinks = torch.tensor([1.0, -0.5, 0.0, 2.5])
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5)
    out = kernels.masked_attention(q, k, v, 0.4, causal, sinks=sinks, softcap=3.0)
    torch.testing.assert_close(out, _loop_attention(q, k, v, 0.4, sinks=sinks, softcap=3.0), atol=1e-12, rtol=1e-12)


def _paged(seqs, Hkv, D, bs, dtype, seed):
    """Store each sequence's (k, v) (L, Hkv, D) in a shuffled block pool; returns the caches and the tables
    padded with the spare last block."""
    n_blocks = sum(-(-k.shape[0] // bs) for k, _ in seqs)
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    kc = torch.zeros(Hkv, n_blocks + 1, bs, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    tables = []
    for k, v in seqs:
        table = [free.pop() for _ in range(-(-k.shape[0] // bs))]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(k.shape[0])])
        kernels.store_kv(k, v, kc, vc, slots)
        tables.append(table)
    W = max(len(t) for t in tables) + 1
    return kc, vc, torch.tensor([t + [n_blocks] * (W - len(t)) for t in tables])


VARIANTS = [
    {"window": 4},
    {"window": 9, "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0])},
    {"softcap": 1.2},
    {"window": 3, "sinks": torch.tensor([-1e4, 4.0, 0.1, -0.2, 0.0, 1.0]), "softcap": 2.0},
]


@pytest.mark.parametrize("extra", VARIANTS)
def test_paged_decode_and_prefill_equal_the_contiguous_op(extra):
    gen = torch.Generator().manual_seed(7)
    H, Hkv, D, bs = 6, 2, 5, 4
    lens, Ts = [1, 6, 13, 17], [1, 4, 13, 3]
    full = [(torch.randn(L, H, D, generator=gen),) + _qkv(1, 0, L, H, Hkv, D, L, torch.float32)[1:] for L in lens]
    seqs = [(k[0], v[0]) for _, k, v in full]
    kc, vc, tables = _paged(seqs, Hkv, D, bs, torch.float32, seed=1)
    scale = D**-0.5
    q_last = torch.stack([q[-1] for q, *_ in full])
    out = kernels.paged_decode_attention(q_last, kc, vc, tables, torch.tensor(lens), scale, **extra)
    for i, (q, k, v) in enumerate(full):
        ref = kernels.attention(q[None], k, v, scale, **extra)[0, -1]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ref.double(), _loop_attention(q[None], k, v, scale, **extra)[0, -1], atol=1e-5, rtol=0
        )
    qs = torch.cat([q[L - T :] for (q, *_), L, T in zip(full, lens, Ts)])
    cu = torch.tensor([0] + torch.tensor(Ts).cumsum(0).tolist())
    out = kernels.paged_prefill_attention(qs, kc, vc, tables, cu, torch.tensor(lens), scale, **extra)
    for i, ((q, k, v), L, T) in enumerate(zip(full, lens, Ts)):
        ref = kernels.attention(q[None], k, v, scale, **extra)[0, L - T :]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_paged_ops_ignore_blocks_wholly_before_the_window():
    # a sliding layer's freed blocks are left in the table as any valid id: the window masks them
    gen = torch.Generator().manual_seed(2)
    H, Hkv, D, bs, L, window = 4, 2, 8, 4, 19, 6
    q, k, v = _qkv(1, L, L, H, Hkv, D, seed=4, dtype=torch.float32)
    kc, vc, tables = _paged([(k[0], v[0])], Hkv, D, bs, torch.float32, seed=3)
    spare = torch.randn(Hkv, 1, bs, D, generator=gen)
    kc, vc = torch.cat([kc, spare], 1), torch.cat([vc, spare], 1)  # the last block: garbage
    dropped = tables.clone()
    dropped[0, : (L - window) // bs] = kc.shape[1] - 1  # blocks 0..2 end before the window of the last queries
    scale = 0.3
    for tbl in (tables, dropped):
        out = kernels.paged_decode_attention(q[0, -1:], kc, vc, tbl, torch.tensor([L]), scale, window=window)
        ref = kernels.attention(q, k, v, scale, window=window)[0, -1:]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        T = 2  # queries at 17, 18 see 12..18: nothing in blocks 0..2
        cu = torch.tensor([0, T])
        out = kernels.paged_prefill_attention(q[0, -T:], kc, vc, tbl, cu, torch.tensor([L]), scale, window=window)
        torch.testing.assert_close(out, kernels.attention(q, k, v, scale, window=window)[0, -T:], atol=1e-5, rtol=1e-5)
