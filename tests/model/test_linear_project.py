"""model/linear.project and kernels.few_rows_linear / dense_linear: which projections of the per-op
inference path take the native CPU kernels (counted by wrapping qlinear.linear_f16), and that their
values are torch's (fp64 for fp32, one bf16 rounding step for bf16)."""

import pytest
import torch
from torch import nn

import baige.kernels as kernels
from baige.kernels import moe_cpu, reference
from baige.kernels.cpu import build as cpu_library
from baige.kernels.cpu import qlinear
from baige.kernels.cpu.build import current_isa
from baige.runtime.model.linear import project

pytestmark = pytest.mark.skipif(cpu_library.library() is None, reason="the native CPU kernels are not built here")


@pytest.fixture
def native_calls(monkeypatch):
    calls = []
    real = qlinear.linear_f16

    def counted(x, w, b):
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(qlinear, "linear_f16", counted)
    return calls


@pytest.mark.parametrize(
    "dtype,rows,native",
    [
        (torch.float32, 1, True),
        (torch.float32, 32, True),
        (torch.float32, 33, False),
        (torch.bfloat16, 1, True),
        (torch.bfloat16, 64, True),
        (torch.bfloat16, 65, False),
    ],
)
def test_project_takes_the_native_kernel_for_few_rows(native_calls, dtype, rows, native):
    torch.manual_seed(rows)
    mod = nn.Linear(96, 1003, bias=True).to(dtype)
    x = torch.randn(1, rows, 96).to(dtype)
    with torch.inference_mode():
        y = project(mod, x)
        ref = mod(x)
    assert y.shape == (1, rows, 1003) and y.dtype == dtype
    assert native_calls == ([rows] if native else [])
    exact = nn.functional.linear(x.double(), mod.weight.double(), mod.bias.double())
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), exact, atol=1e-4, rtol=1e-5)
    else:  # both round one fp32 sum to bf16: at most one bf16 step apart, both near fp64
        step = ref.float().abs().clamp_min(1e-3) * 2.0**-7
        assert ((y.float() - ref.float()).abs() <= step).all()
        assert ((y.double() - exact).abs() <= 2 * step.double() + 1e-2).all()


def test_project_calls_the_module_under_autograd_hooks_or_other_types(native_calls):
    mod = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    y = project(mod, x)  # autograd on: the module, differentiable
    assert y.requires_grad and native_calls == []
    mod.register_forward_hook(lambda m, i, o: o * 0 + 7.0)
    with torch.no_grad():
        assert torch.equal(project(mod, x), torch.full((3, 8), 7.0))  # the hook ran
    assert native_calls == []

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    sub = Scaled(16, 8)
    with torch.no_grad():
        torch.testing.assert_close(project(sub, x), nn.functional.linear(x, sub.weight, sub.bias) * 2)
    assert native_calls == []


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_cpu_fused_moe_without_autograd_is_the_grouped_reference(native_calls, tokens):
    """Experts with at most FEW_ROWS rows take the few-rows native kernel (under an AVX-512 variant, at
    most NATIVE_SKIP_ROWS: moe.c takes the rest), the others moe.c or oneDNN; the result is the
    reference's (same pairs, same combine) within fp32 summation order, and near fp64."""
    g = torch.Generator().manual_seed(tokens)
    E, H, inter, k = 6, 40, 24, 2
    x = torch.randn(tokens, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 0.2, torch.randn(E, H, inter, generator=g) * 0.2
    ids = torch.randint(0, E, (tokens, k), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % E  # distinct experts per token
    if tokens == 40:
        ids[:, 0] = 0  # expert 0 gets 40 rows (> FEW_ROWS[fp32] = 32): torch.mm
    wts = torch.rand(tokens, k, generator=g)
    with torch.inference_mode():
        got = kernels.fused_moe(x, w13, w2, wts, ids)
        ref = reference.fused_moe(x, w13, w2, wts, ids)
    exact = reference.fused_moe(x.double(), w13.double(), w2.double(), wts.double(), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    few = moe_cpu.NATIVE_SKIP_ROWS if (current_isa() or "").startswith("avx512") else 32
    assert sorted(native_calls) == sorted([c for c in counts if 0 < c <= few] * 2)  # gate_up and down each


def test_project_keeps_the_modules_dtype_rule(native_calls):
    """fp32 rows into a bf16 nn.Linear: the module's own error, not a silent fp32 result."""
    mod = nn.Linear(16, 8).bfloat16()
    with torch.inference_mode(), pytest.raises(RuntimeError):
        project(mod, torch.randn(2, 16))
    assert native_calls == []
