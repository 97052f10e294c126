"""Batched multi-adapter LoRA (kernels.lora_apply): Triton (interpreted on CPU) and the grouped CPU
reference against a per-token loop in fp64; odd ranks zero-padded into one stack, adapters without
tokens, tokens without adapter (-1), prefill-like segments and decode-like mixes."""

import pytest
import torch

from baige import kernels
from baige.kernels import reference
from tests.kernel_checks import DEVICE, DTYPES, assert_close_fp64, rand, triton_kernels

RANKS = (1, 7, 16)  # adapter i has rank RANKS[i]; a fourth adapter (rank 5) never gets a token


def _stacks(n_in: int, n_out: int, dtype, seed: int = 0):
    ranks = RANKS + (5,)
    r_max = max(ranks)
    a = torch.zeros(len(ranks), r_max, n_in)
    b = torch.zeros(len(ranks), n_out, r_max)
    for i, r in enumerate(ranks):
        a[i, :r] = rand(r, n_in, dtype=torch.float32, seed=seed + 2 * i).cpu() / n_in**0.5
        b[i, :, :r] = rand(n_out, r, dtype=torch.float32, seed=seed + 2 * i + 1).cpu()
    scalings = torch.tensor([16 / r for r in ranks], dtype=torch.float32)  # alpha 16 over each rank
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), scalings.to(DEVICE)


def _per_token(y, x, a, b, s, ids):
    """The oracle: one token at a time, in fp64."""
    out = y.double().clone()
    for t, i in enumerate(ids.tolist()):
        if i >= 0:
            out[t] += s[i].double() * (b[i].double() @ (a[i].double() @ x[t].double()))
    return out


IDS = {
    "segments": [0] * 21 + [2] * 17 + [-1] * 5 + [1] * 27,  # prefill: runs of one adapter (70 tokens)
    "decode": [2, -1, 0, 1, 1, 2, 0, -1, 2, 1, 0],  # a different adapter nearly every token
    "none": [-1] * 9,
    "one": [2],  # a single decode token
}


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(IDS))
def test_lora_apply_against_per_token(monkeypatch, impl, dtype, case):
    ids = torch.tensor(IDS[case], device=DEVICE, dtype=torch.int32 if case == "decode" else torch.int64)
    T, n_in, n_out = len(ids), 72, 100
    x = rand(T, n_in, dtype=dtype, seed=11)
    y0 = rand(T, n_out, dtype=dtype, seed=12)
    a, b, s = _stacks(n_in, n_out, dtype)
    exact = _per_token(y0, x, a, b, s, ids)
    ref = reference.lora_apply(y0.clone(), x, a, b, s, ids)
    y = y0.clone()
    if impl == "triton":
        with triton_kernels(monkeypatch):
            out = kernels.lora_apply(y, x, a, b, s, ids)
    else:
        out = kernels.lora_apply(y, x, a, b, s, ids)
    assert out is y  # in place
    assert_close_fp64(out, ref, exact, name=f"lora_apply {impl} {dtype} {case}")
    untouched = ids < 0
    assert torch.equal(out[untouched], y0[untouched])  # rows without an adapter are not rewritten
    if case != "none":
        assert (exact - y0.double()).abs().max() > 0.1  # the adapters do change the rows they own


def test_lora_apply_matches_one_adapter_linear_algebra():
    # a single full-rank check against plain matmuls: y + s * x A^T B^T
    x, a, b = (
        rand(5, 8, dtype=torch.float64, seed=1),
        rand(1, 3, 8, dtype=torch.float64, seed=2),
        rand(1, 6, 3, dtype=torch.float64, seed=3),
    )
    y = torch.zeros(5, 6, dtype=torch.float64, device=DEVICE)
    kernels.lora_apply(y, x, a, b, torch.tensor([0.5], device=DEVICE), torch.zeros(5, dtype=torch.long, device=DEVICE))
    torch.testing.assert_close(y, 0.5 * x @ a[0].t() @ b[0].t())


def test_lora_apply_rejects_bad_arguments():
    a, b, s = torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), torch.ones(2)
    x, y, ids = torch.zeros(3, 8), torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="expected"):
        kernels.lora_apply(y, x, a, b[:, :5], s, ids)
    with pytest.raises(ValueError, match="share one float dtype"):
        kernels.lora_apply(y, x.half(), a, b, s, ids)
    with pytest.raises(ValueError, match="outside"):
        kernels.lora_apply(y, x, a, b, s, torch.tensor([0, 2, -1]))
