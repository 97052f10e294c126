"""DeepSeek's kernels: group-limited routing (``kernels.grouped_topk``) against hand-computed
choices and, in Triton (interpreted on CPU), against the reference and fp64."""

import math

import pytest
import torch

from baige import kernels
from baige.kernels.routing import grouped_topk_reference
from tests.kernel_checks import DEVICE, DTYPES, assert_close_fp64, rand, triton_kernels


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


# V3: sigmoid scores [0.9, 0.1 | 0.6, 0.55]: group 0's top-2 sum 1.0 < group 1's 1.15, so with one
# group kept the best expert (0) is left out; weights renormalized then scaled by 2.5
V3_LOGITS = torch.tensor([[_logit(0.9), _logit(0.1), _logit(0.6), _logit(0.55)]])
# V2: softmax probs [0.4, 0.1 | 0.3, 0.2]: group 0 holds the best expert and stays
V2_LOGITS = torch.tensor([[0.4, 0.1, 0.3, 0.2]]).log()
CASES = [  # (logits, scoring, bias, renormalize, scale, ids, weights)
    (V3_LOGITS, "sigmoid", [0.0] * 4, True, 2.5, [2, 3], [2.5 * 0.6 / 1.15, 2.5 * 0.55 / 1.15]),
    (V3_LOGITS, "sigmoid", [0.0, 0.3, 0.0, 0.0], True, 1.0, [0, 1], [0.9, 0.1]),  # the bias lifts group 0 (1.3)
    (V3_LOGITS, "sigmoid", [0.0] * 4, False, 1.0, [2, 3], [0.6, 0.55]),
    (V2_LOGITS, "softmax", None, False, 1.5, [0, 1], [0.6, 0.15]),
]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_grouped_topk_hand_computed(monkeypatch, impl, case):
    logits, scoring, bias, renorm, scale, ids, weights = CASES[case]
    bias = None if bias is None else torch.tensor(bias, device=DEVICE)
    args = dict(n_group=2, topk_group=1, scoring_func=scoring, renormalize=renorm, correction_bias=bias)
    if impl == "triton":
        with triton_kernels(monkeypatch):
            w, i = kernels.grouped_topk(logits.to(DEVICE), 2, **args, routed_scaling_factor=scale)
    else:
        w, i = kernels.grouped_topk(logits.to(DEVICE), 2, **args, routed_scaling_factor=scale)
    order = i[0].argsort()  # HF's top-k is unsorted: compare as sets with their weights
    assert i[0][order].tolist() == ids and w.dtype == torch.float32
    torch.testing.assert_close(w[0][order].cpu(), torch.tensor(weights), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T,E,top_k,n_group,topk_group,scoring,with_bias",
    [(37, 64, 6, 8, 3, "sigmoid", True), (13, 6, 2, 3, 1, "softmax", False), (5, 9, 3, 1, 1, "sigmoid", True)],
)
def test_grouped_topk_triton_against_reference(
    monkeypatch, dtype, T, E, top_k, n_group, topk_group, scoring, with_bias
):
    logits = rand(T, E, dtype=dtype, scale=2.0, seed=0)
    bias = rand(E, dtype=torch.float32, scale=0.1, seed=1) if with_bias else None
    args = dict(n_group=n_group, topk_group=topk_group, scoring_func=scoring, renormalize=True)
    with triton_kernels(monkeypatch):
        w, i = kernels.grouped_topk(logits, top_k, **args, correction_bias=bias, routed_scaling_factor=2.5)
    w_ref, i_ref = grouped_topk_reference(logits, top_k, n_group, topk_group, scoring, True, bias, 2.5)
    exact_bias = None if bias is None else bias.double()
    w_exact, i_exact = grouped_topk_reference(
        logits.double(), top_k, n_group, topk_group, scoring, True, exact_bias, 2.5
    )
    assert torch.equal(i, i_ref) and torch.equal(i, i_exact)  # random logits: no ties, both best first
    assert_close_fp64(w, w_ref, w_exact, name=f"grouped topk weights {dtype}")


def test_grouped_topk_has_a_gradient_and_checks_its_arguments():
    logits = torch.randn(5, 8, requires_grad=True)
    w, _ = kernels.grouped_topk(logits, 2, n_group=4, topk_group=2, scoring_func="sigmoid", renormalize=False)
    w.sum().backward()  # (renormalized weights sum to a constant: no gradient to see)
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="top_k"):
        kernels.grouped_topk(logits, 5, n_group=4, topk_group=2, scoring_func="sigmoid", renormalize=True)
    with pytest.raises(ValueError, match="scoring_func"):
        kernels.grouped_topk(logits, 2, n_group=4, topk_group=2, scoring_func="relu", renormalize=True)


# ---- MLA decode over the paged latent cache --------------------------------------------------------


def _latent_case(S, H, Dl, Dr, block_size, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    num_blocks = S * width + 3
    cache = torch.randn(1, num_blocks, block_size, Dl + Dr, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: S * width].view(S, width)  # scattered blocks
    q = torch.randn(S, H, Dl + Dr, generator=g)
    lens_t = torch.tensor(lens)
    return (t.to(DEVICE) for t in (q.to(dtype), cache.to(dtype), tables, lens_t))


def _expanded_oracle(q, cache, tables, lens, scale, Dl):
    """Per sequence: gather its rows, plain softmax attention in fp64, values = the latent columns."""
    outs = []
    for s in range(q.shape[0]):
        rows = cache[0][tables[s]].reshape(-1, cache.shape[-1])[: lens[s]].double()  # (n, Dl + Dr)
        p = torch.softmax(q[s].double() @ rows.T * scale, dim=-1)  # (H, n)
        outs.append(p @ rows[:, :Dl])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,H,Dl,Dr,block_size,lens", [(3, 5, 20, 6, 8, [1, 17, 40]), (2, 17, 36, 10, 16, [33, 5])])
def test_mla_decode_attention_triton_and_reference_against_fp64(monkeypatch, dtype, S, H, Dl, Dr, block_size, lens):
    q, cache, tables, lens_t = _latent_case(S, H, Dl, Dr, block_size, lens, dtype)
    scale = 0.3
    exact = _expanded_oracle(q, cache, tables, lens, scale, Dl)
    ref = kernels.mla_decode_attention(q, cache, tables, lens_t, scale, Dl)
    with triton_kernels(monkeypatch):
        got = kernels.mla_decode_attention(q, cache, tables, lens_t, scale, Dl)
    assert got.shape == ref.shape == (S, H, Dl) and got.dtype == dtype
    assert_close_fp64(got, ref, exact, name=f"mla decode {dtype}")
