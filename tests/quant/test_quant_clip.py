"""Clip search (RTN and GPTQ): per-group range shrinking that minimises the weighted squared error."""

import json
import math

import pytest
import torch
from tiny import make_checkpoint

from baige.runtime.quant.apply import input_sq_means, quantize_model
from baige.runtime.quant.format import REPORT_FILE
from baige.runtime.quant.scheme import QuantScheme, clip_factors, quantize_weight, search_qparams
from baige.runtime.quantize import save_quantized
from baige.runtime.weights.loader import load_model


def _group_sq_err(w, q, scale, zp, group_size, col_weight=None):
    """(out, n_groups) float64 sum_j c_j (w_j - w_hat_j)^2, dequantized column by column."""
    out_f, in_f = w.shape
    g = in_f if group_size is None else group_size
    n_groups = scale.shape[1]
    err = torch.zeros(out_f, n_groups, dtype=torch.float64)
    for c in range(in_f):
        gi = c // g
        z = 0.0 if zp is None else zp[:, gi].double()
        w_hat = (q[:, c].double() - z) * scale[:, gi].double()
        cw = 1.0 if col_weight is None else float(col_weight[c])
        err[:, gi] += cw * (w[:, c].double() - w_hat) ** 2
    return err


def test_clip_factors_grid():
    f = clip_factors()
    assert len(f) == 24 and f[0] == 1.0 and f[1] == pytest.approx(0.975) and f[19] == pytest.approx(0.525)
    assert f[20:] == pytest.approx([1.025, 1.05, 1.075, 1.1])
    assert clip_factors(10, 0.3, 0.0) == pytest.approx([1.0, 0.9, 0.8])
    assert clip_factors(10, 0.3, 0.2) == pytest.approx([1.0, 0.9, 0.8, 1.1, 1.2])


def test_asymmetric_search_is_the_best_candidate_and_uses_zero_point_neighbours():
    """Brute force over every (factor, zero point) candidate, one group at a time in float64: the
    search reaches the smallest weighted error; the zero-point neighbours win some groups and
    lower the total error against a search with the range's own zero point only."""
    torch.manual_seed(11)
    scheme = QuantScheme(4, 32, symmetric=False)
    w = torch.randn(12, 96) * 0.3 + 0.1
    cw = torch.rand(96) + 0.05
    grouped, cwg = w.view(12, 3, 32), cw.view(3, 32)
    scale, zp = search_qparams(grouped, scheme, col_weight=cwg)
    s_own, z_own = search_qparams(grouped, scheme, col_weight=cwg, zp_offsets=(0,))

    def err(r, gi, s, z):
        x = grouped[r, gi].double()
        q = torch.clamp(torch.round(x / s + z), -8, 7)
        return float((((x - (q - z) * s) ** 2) * cwg[gi].double()).sum())

    used_neighbour = 0
    for r in range(12):
        for gi in range(3):
            lo, hi = float(grouped[r, gi].min()), float(grouped[r, gi].max())
            best = math.inf
            for a in clip_factors():
                lo_a, hi_a = min(a * lo, 0.0), max(a * hi, 0.0)
                s = float(torch.tensor((hi_a - lo_a) / 15, dtype=torch.float32))  # stored in float32
                z0 = min(max(round(-8 - lo_a / s), -8), 7)
                best = min(best, *(err(r, gi, s, min(max(z0 + d, -8), 7)) for d in (-1, 0, 1)))
            got = err(r, gi, float(scale[r, gi]), float(zp[r, gi]))
            assert got <= best * (1 + 1e-5) + 1e-12, (r, gi, got, best)
            assert got <= err(r, gi, float(s_own[r, gi]), float(z_own[r, gi])) * (1 + 1e-6) + 1e-12
            # the chosen zero point is not the one its own scaled range gives
            alpha = (scale[r, gi] * 15 / (max(hi, 0.0) - min(lo, 0.0))).item()
            z_range = min(max(round(-8 - min(alpha * lo, 0.0) / float(scale[r, gi])), -8), 7)
            used_neighbour += int(zp[r, gi]) != z_range
    assert used_neighbour > 0


def test_symmetric_search_ignores_zero_point_offsets():
    torch.manual_seed(12)
    w = torch.randn(8, 2, 32)
    a = search_qparams(w, QuantScheme(4, 32))
    b = search_qparams(w, QuantScheme(4, 32), zp_offsets=(0,))
    assert torch.equal(a[0], b[0]) and not a[1].any()


@pytest.mark.parametrize(
    "scheme", [QuantScheme(4, 64), QuantScheme(4, 64, symmetric=False), QuantScheme(8, None)], ids=str
)
def test_search_never_worse_than_minmax_and_strictly_better_with_outlier(scheme):
    torch.manual_seed(0)
    w = torch.randn(32, 300) + (0.0 if scheme.symmetric else 0.4)  # 300: partial last group of 44 columns
    w[3, 10] = -5.0  # one outlier in row 3, first group (the rest of a group of 64 normals spans about +-2.5)
    q0, s0, z0 = quantize_weight(w, scheme)
    q1, s1, z1 = quantize_weight(w, scheme, clip_search=True)
    e0 = _group_sq_err(w, q0, s0, z0, scheme.group_size)
    e1 = _group_sq_err(w, q1, s1, z1, scheme.group_size)
    assert (e1 <= e0 * (1 + 1e-6) + 1e-12).all()
    if scheme.num_bits == 4:  # (int8's 255 levels over 300 normals: the 2.5% steps find nothing better)
        assert e1.sum() < e0.sum()  # the search did something overall
        assert e1[3, 0] < 0.9 * e0[3, 0] and s1[3, 0] < s0[3, 0]  # the outlier's group gains from a shrunk range
    # searched scales come from a grid point: scale / minmax scale is one of the shrink factors
    ratio = (s1 / s0).flatten()
    factors = torch.tensor(clip_factors())
    assert ((ratio[:, None] - factors[None]).abs().min(dim=1).values < 1e-5).all()


def test_hand_computed_choice_symmetric():
    # group of 9: max|w| = 7.5, so alpha = 1 gives scale 1.0 and alpha = 0.8 gives scale 0.8.
    # alpha = 1:   -7.5 -> round(-7.5) = -8 (half to even), err 0.25; 2.4 -> 2, err 0.16 each: 0.25 + 8 * 0.16 = 1.53
    # alpha = 0.8: -7.5 / 0.8 = -9.375 -> clamp -8 -> -6.4, err 1.21; 2.4 / 0.8 = 3 exactly: 1.21  -> 0.8 wins
    w = torch.tensor([[-7.5] + [2.4] * 8])  # (1, 9)
    scheme = QuantScheme(4, 9)
    scale, zp = search_qparams(w.view(1, 1, 9), scheme, factors=[1.0, 0.8])
    assert scale.item() == pytest.approx(0.8) and zp.item() == 0.0
    # weighting column 0 by 10: alpha = 1 costs 2.5 + 1.28 = 3.78, alpha = 0.8 costs 12.1  -> 1.0 wins
    cw = torch.tensor([[10.0] + [1.0] * 8])
    scale, _ = search_qparams(w.view(1, 1, 9), scheme, col_weight=cw, factors=[1.0, 0.8])
    assert scale.item() == pytest.approx(1.0)


def test_weighted_search_minimises_weighted_error():
    torch.manual_seed(1)
    scheme = QuantScheme(4, 32, symmetric=False)
    w = torch.randn(16, 96)
    cw = torch.rand(96) ** 4 * 100  # very uneven column importance
    q0, s0, z0 = quantize_weight(w, scheme)
    qu, su, zu = quantize_weight(w, scheme, clip_search=True)
    qw, sw, zw = quantize_weight(w, scheme, clip_search=True, col_weight=cw)
    ew = lambda q, s, z: _group_sq_err(w, q, s, z, 32, cw)  # noqa: E731
    assert (ew(qw, sw, zw) <= ew(q0, s0, z0) * (1 + 1e-6) + 1e-12).all()
    assert (ew(qw, sw, zw) <= ew(qu, su, zu) * (1 + 1e-6) + 1e-12).all()
    assert ew(qw, sw, zw).sum() < ew(qu, su, zu).sum()


def test_asymmetric_search_keeps_zero_exact():
    torch.manual_seed(2)
    w = torch.randn(24, 256) * 0.5 + 0.9  # mostly positive: the zero point is far from 0
    zeros = torch.rand(24, 256) < 0.1
    w[zeros] = 0.0
    scheme = QuantScheme(4, 64, symmetric=False)
    q, s, z = quantize_weight(w, scheme, clip_search=True)
    assert int(z.min()) >= -8 and int(z.max()) <= 7
    w_hat = (q.double() - z.double().repeat_interleave(64, dim=1)) * s.double().repeat_interleave(64, dim=1)
    assert (w_hat[zeros] == 0).all()
    _, s0, _ = quantize_weight(w, scheme)
    assert (s < s0).any()  # the search really shrank some ranges


def test_bf16_scale_is_rounded_before_rounding_weights():
    torch.manual_seed(3)
    w = torch.randn(8, 128, dtype=torch.bfloat16)
    q, s, _ = quantize_weight(w, QuantScheme(4, 64), clip_search=True)
    assert s.dtype == torch.bfloat16
    ref = torch.clamp(torch.round(w.float() / s.float().repeat_interleave(64, dim=1)), -8, 7)
    assert torch.equal(q.float(), ref)


def test_input_sq_means_matches_manual_first_layer(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "src", "llama"))
    ids = torch.randint(0, 160, (3, 17))
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]
    stats = input_sq_means(model, names, ids, batch_size=2)
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))  # (3, 17, hidden): q_proj's input
    assert stats[names[0]].shape == (x.shape[-1],)
    assert torch.allclose(stats[names[0]], (x.float() ** 2).mean(dim=(0, 1)), rtol=1e-5, atol=1e-7)
    assert stats[names[1]].shape == (model.model.layers[0].mlp.down_proj.in_features,)
    assert not model.model.layers[0].self_attn.q_proj._forward_pre_hooks  # hooks removed
    skipped = input_sq_means(model, names, ids, batch_size=2, skip_first=True)
    assert torch.allclose(skipped[names[0]], (x[:, 1:].float() ** 2).mean(dim=(0, 1)), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(skipped[names[0]], stats[names[0]])


def test_rtn_clip_search_leaves_out_each_windows_first_token(tmp_path, monkeypatch):
    from baige.runtime.quant import apply as quant

    seen = []
    real = quant.input_sq_means
    monkeypatch.setattr(quant, "input_sq_means", lambda *a, **k: (seen.append(k), real(*a, **k))[1])
    model = load_model(make_checkpoint(tmp_path / "src", "llama"))
    quantize_model(model, QuantScheme(4, 32), calib_ids=torch.randint(0, 160, (2, 16)), clip_search=True)
    assert seen == [{"skip_first": True}]


def test_quantize_model_clip_search_with_calibration_and_format(tmp_path):
    src = make_checkpoint(tmp_path / "src", "llama")
    calib = torch.randint(0, 160, (4, 32))
    scheme = QuantScheme(4, 32, symmetric=False)
    m0, m1 = load_model(src), load_model(src)
    w = m0.model.layers[0].mlp.up_proj.weight.detach().clone()
    quantize_model(m0, scheme)
    report = quantize_model(m1, scheme, calib_ids=calib, clip_search=True)
    # the weighted search changed some scales, only to grid points within the factor range
    s0 = m0.model.layers[0].mlp.up_proj.weight_scale
    s1 = m1.model.layers[0].mlp.up_proj.weight_scale
    assert (s1 <= s0 * 1.1 * (1 + 1e-6)).all() and (s1 >= s0 * 0.525 * (1 - 1e-6)).all() and (s1 != s0).any()
    out = save_quantized(m1, scheme, report, tmp_path / "q", None, {"weighting": "test"})
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    wq = qc["config_groups"]["group_0"]["weights"]
    kwargs = {"maxshrink": 0.5, "maxexpand": 0.1, "grid": 40, "norm": 2, "zero_point_offsets": [0, -1, 1]}
    assert wq["observer"] == "mse" and wq["observer_kwargs"] == kwargs
    rep = json.loads((out / REPORT_FILE).read_text())
    assert rep["clip_search"] == {**kwargs, "weighting": "test"}
    loaded = load_model(out)  # same tensors and layout as min/max scales
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight_scale, s1)
    w_hat = loaded.model.layers[0].mlp.up_proj.dequantized_weight()
    assert (w - w_hat).abs().max() < 0.5 * w.abs().max()
    ct = pytest.importorskip("compressed_tensors.quantization")
    ct.QuantizationConfig.model_validate(qc)  # the spec accepts the observer fields


def test_minmax_config_unchanged(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "src", "llama"))
    report = quantize_model(model, QuantScheme(4, 32))
    out = save_quantized(model, QuantScheme(4, 32), report, tmp_path / "q", None)
    wq = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert wq["observer"] == "minmax" and wq["observer_kwargs"] == {}
    assert json.loads((out / REPORT_FILE).read_text())["clip_search"] is None


def test_per_channel_search_equals_one_group_of_all_columns():
    torch.manual_seed(4)
    w = torch.randn(8, 40)
    w[0, 0] = 9.0
    _, s, _ = quantize_weight(w, QuantScheme(8, None), clip_search=True)
    s_ref, _ = search_qparams(w.view(8, 1, 40), QuantScheme(8, None))
    assert torch.equal(s, s_ref)


def _correlated_hessian(n=1024, d_in=96, seed=5):
    """(d_in, d_in) float32 ``2/n X^T X`` of correlated inputs with uneven column scales."""
    torch.manual_seed(seed)
    mix = torch.randn(d_in, d_in) * 0.3 + torch.eye(d_in)
    X = torch.randn(n, d_in) @ mix * torch.linspace(0.2, 3.0, d_in)
    return 2 * X.t() @ X / n


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_search_never_worse_than_minmax_on_the_updated_group(monkeypatch, symmetric):
    """Inside GPTQ, at the moment each group's parameters are fixed (error-updated weights), the
    searched parameters give at most the H_jj-weighted squared error of the group's min/max ones."""
    from baige.runtime.quant import gptq
    from baige.runtime.quant.scheme import compute_qparams, quantize_with

    H = _correlated_hessian()
    torch.manual_seed(7)
    w = torch.randn(24, 96)
    w[3, 5] = 6.0  # an outlier, so shrinking pays off somewhere
    scheme = QuantScheme(4, 32, symmetric)
    calls, gains = [], []

    def spy(grouped, sch, dtype, col_weight):
        s, z = search_qparams(grouped, sch, dtype, col_weight)
        calls.append((grouped.clone(), col_weight.clone(), s, z))
        return s, z

    monkeypatch.setattr(gptq, "search_qparams", spy)
    _, scale, zp = gptq.gptq_quantize_weight(w, H, scheme, block_size=64, clip_search=True)
    assert len(calls) == 3
    for gi, (grp, cw, s, z) in enumerate(calls):
        grp, cw = grp[:, 0], cw[0]  # (out, 32), (32,)
        assert torch.equal(cw, torch.diag(H)[32 * gi : 32 * gi + 32])
        if gi == 0:
            assert torch.equal(grp, w[:, :32])  # nothing has been updated yet
        else:
            assert not torch.allclose(grp, w[:, 32 * gi : 32 * gi + 32])  # the error-updated weights
        assert torch.equal(scale[:, gi], s[:, 0])
        if not symmetric:
            assert torch.equal(zp[:, gi].float(), z[:, 0])

        def werr(sc, zz):
            sc, zz = sc.double()[:, None], zz.double()[:, None]
            w_hat = (quantize_with(grp.double(), sc, zz, scheme).double() - zz) * sc
            return ((grp.double() - w_hat) ** 2 * cw.double()).sum(dim=1)  # (out,)

        s_mm, z_mm = compute_qparams(grp.amin(dim=1), grp.amax(dim=1), scheme)
        e_search, e_mm = werr(s[:, 0], z[:, 0]), werr(s_mm, z_mm)
        assert (e_search <= e_mm * (1 + 1e-6) + 1e-12).all()
        gains.append(float((e_mm - e_search).sum() / e_mm.sum()))
    assert max(gains) > 0.01, gains  # and the search does move some parameters


def test_gptq_search_with_diagonal_hessian_equals_weighted_rtn_search():
    """Uncorrelated inputs: nothing to compensate, so GPTQ with the search is RTN's search
    weighted by the Hessian diagonal, bit for bit."""
    torch.manual_seed(8)
    w = torch.randn(16, 64)
    w[0, 0] = 7.0
    d = torch.rand(64) * 3 + 0.1
    scheme = QuantScheme(4, 32, symmetric=False)
    from baige.runtime.quant.gptq import gptq_quantize_weight

    q_g, s_g, z_g = gptq_quantize_weight(w, torch.diag(d), scheme, clip_search=True)
    q_r, s_r, z_r = quantize_weight(w, scheme, clip_search=True, col_weight=d)
    assert torch.equal(s_g, s_r) and torch.equal(z_g, z_r) and torch.equal(q_g, q_r)
    _, s_mm, _ = quantize_weight(w, scheme)
    assert not torch.equal(s_g, s_mm)  # the search did move some scale


def test_gptq_actorder_search_fixes_groups_from_original_weights():
    from baige.runtime.quant.gptq import gptq_quantize_weight

    H = _correlated_hessian(d_in=64)
    torch.manual_seed(9)
    w = torch.randn(8, 64)
    scheme = QuantScheme(4, 32, symmetric=True, actorder=True)
    _, s_g, _ = gptq_quantize_weight(w, H, scheme, clip_search=True)
    _, s_r, _ = quantize_weight(w, scheme, clip_search=True, col_weight=torch.diag(H))
    assert torch.equal(s_g, s_r)
