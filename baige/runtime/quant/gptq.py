"""GPTQ: one-shot weight quantization that corrects each rounding error with the inverse Hessian.

Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", arXiv:2210.17323 (Algorithm 1: Cholesky form of the inverse
Hessian, lazy batch updates; section 4 and the reference code: damping, act-order, groups).

For a Linear ``W`` (out, in) with calibration inputs ``X`` (n, in), the layer-wise objective
``||W X^T - W_hat X^T||^2`` has Hessian ``H = 2/n * X^T X`` (in, in). Columns are quantized one at a
time; column ``i``'s error ``(w_i - q_i) / [H^-1]_ii`` is propagated to the not-yet-quantized
columns through row ``i`` of the upper Cholesky factor of ``H^-1``.
"""

from __future__ import annotations

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.quant.experts import NO_TOKEN_FALLBACK
from baige.runtime.quant.linear import QuantizedLinear, layer_report, set_submodule
from baige.runtime.quant.scheme import (
    ProgressFn,
    QuantScheme,
    compute_qparams,
    quantize_weight,
    quantize_with,
    search_qparams,
)


def _inverse_hessian_factor(H: torch.Tensor, percdamp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^-1``, ``damp = percdamp * mean(diag H)``.

    A Hessian that is not positive definite after damping is retried with 10x the damping,
    up to three times (the paper's Cholesky reformulation needs a PD matrix).
    """
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    damp = percdamp * torch.diag(H).mean()
    for _ in range(4):
        L, info = torch.linalg.cholesky_ex(H + damp * eye)
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            return torch.linalg.cholesky(Hinv, upper=True)
        damp = damp * 10
    raise BaigeError(f"{name}: calibration Hessian is not positive definite even with damping {damp:.3g}")


def _drop_dead_inputs(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 copies of ``W`` (out, in) and ``H`` (in, in) without the inputs that were always zero
    (``diag H == 0``): their weights cannot matter, so they are set to 0 and their Hessian diagonal
    to 1 (keeps ``H`` invertible; the reference code's ``dead`` columns)."""
    Wf = W.float().clone()
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    Wf[:, dead] = 0.0
    return Wf, H


def _initial_qparams(
    W: torch.Tensor, scheme: QuantScheme, hdiag: torch.Tensor, clip_search: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (out, n_groups) float32 before GPTQ's column loop.

    Per channel (``group_size=None``) or with act-order they are final: fixed from the original
    weights ``W`` (out, in) (static groups), by the clip search weighted with ``hdiag`` (in,) when
    ``clip_search``; the scale is rounded through ``W.dtype``, the zero point is 0 when symmetric.
    Otherwise they are placeholders (scale 1, zero point 0) that :func:`_group_qparams` overwrites
    group by group.
    """
    out_f, in_f = W.shape
    if scheme.group_size is None or scheme.actorder:
        _, s, z = quantize_weight(W.float(), scheme, clip_search, hdiag if clip_search else None)
        return s.to(W.dtype).float(), (torch.zeros_like(s) if z is None else z.float())
    n_groups = scheme.n_groups(in_f)
    return torch.ones(out_f, n_groups, device=W.device), torch.zeros(out_f, n_groups, device=W.device)


def _group_qparams(
    grp: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, hdiag: torch.Tensor, clip_search: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (out,) float32 rounded through ``dtype`` and zero point (out,) of one group.

    ``grp`` (out, <=g) is the group's error-updated columns when its first column is reached;
    ``hdiag`` (<=g,) their Hessian diagonal, used only by the clip search (else min/max).
    """
    if clip_search:
        s, z = search_qparams(grp[:, None, :], scheme, dtype, hdiag[None])
        s, z = s[:, 0], z[:, 0]
    else:
        s, z = compute_qparams(grp.amin(dim=1), grp.amax(dim=1), scheme)
    return s.to(dtype).float(), z


@torch.no_grad()
def gptq_quantize_weight(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    percdamp: float = 0.01,
    block_size: int = 128,
    name: str = "weight",
    clip_search: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize one weight matrix with GPTQ.

    Args:
        W: (out, in) float weight (not modified).
        H: (in, in) float32 Hessian ``2/n X^T X`` of the layer's inputs.
        scheme: group-wise (or per-channel) scheme. With ``scheme.actorder`` columns are visited in
            decreasing ``diag(H)`` order and every group's scale/zero point is fixed up front from
            the original weights of its contiguous columns (compressed-tensors ``actorder: "weight"``),
            so the stored layout is unchanged. Otherwise a group's parameters are taken from the
            error-updated weights when its first column is reached (the reference implementation).
        percdamp: damping as a fraction of the mean Hessian diagonal (paper: 1%).
        block_size: columns per lazy batch update; rounded to a multiple of the group size so a
            group's columns are current when its parameters are computed.
        clip_search: choose each group's scale/zero point by :func:`quant.search_qparams` (shrunk
            ranges, smallest ``sum_j H_jj (w_j - w_hat_j)^2``) instead of the group's min/max.
            ``H_jj`` (the undamped Hessian diagonal, ``2/n sum_t x_tj^2``, i.e. twice the mean
            squared input of column ``j`` -- the RTN clip search's weighting up to a constant and
            the first-token weight) weights column ``j``. The search runs where the parameters are
            fixed: on the error-updated weights of the group when its first column is reached, or
            on the original weights up front (per channel, act-order).
    Returns:
        q (out, in) int8, scale (out, n_groups) in ``W.dtype``, zero point (out, n_groups) int8 or None.
    Raises:
        BaigeError: the Hessian cannot be made positive definite.
    """
    out_f, in_f = W.shape
    Wf, H = _drop_dead_inputs(W, H)
    g = scheme.group_size
    dev = W.device
    hdiag = torch.diag(H).clone()  # (in,) column weights of the clip search, original column order
    scale, zp = _initial_qparams(W, scheme, hdiag, clip_search)
    if g is not None:
        block_size = max(1, block_size // g) * g

    perm = torch.argsort(torch.diag(H), descending=True) if scheme.actorder else torch.arange(in_f, device=dev)
    Wf, H = Wf[:, perm], H[perm][:, perm]
    group_of = (
        (perm // g) if g is not None else torch.zeros(in_f, dtype=torch.long, device=dev)
    )  # permuted col -> group
    Hinv = _inverse_hessian_factor(H, percdamp, name)

    Q = torch.zeros(out_f, in_f, dtype=torch.int8, device=dev)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = Wf[:, i1:i2].clone()  # (out, B): this block's columns, updated column by column
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            gid = int(group_of[col])
            if g is not None and not scheme.actorder and col % g == 0:
                grp = W1[:, i : i + g]  # (out, <=g) the whole group lies in this block
                # no act-order here, so permuted column == original column
                scale[:, gid], zp[:, gid] = _group_qparams(
                    grp, scheme, W.dtype, hdiag[col : col + grp.shape[1]], clip_search
                )
            w = W1[:, i]
            q = quantize_with(w, scale[:, gid], zp[:, gid], scheme)
            Q[:, col] = q
            w_hat = (q.float() - zp[:, gid]) * scale[:, gid]
            err = (w - w_hat) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]  # (out, B - i)
            Err1[:, i] = err
        Wf[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # lazy batch update of the later columns

    Q = Q[:, torch.argsort(perm)]  # back to the original column order
    return Q, scale.to(W.dtype), None if scheme.symmetric else zp.to(torch.int8)


class _HessianAccumulator:
    """Running weighted ``H = 2/n sum_t w_t x_t x_t^T`` over every token a Linear sees (forward
    pre-hook); ``w_t = 1`` except ``first_token_weight`` at position 0, ``n = sum w_t``. ``tokens``
    counts the rows seen (a routed expert's Linear sees only the tokens routed to it, as (c, in))."""

    def __init__(self, in_features: int, device: torch.device, first_token_weight: float = 1.0):
        self.H = torch.zeros(in_features, in_features, device=device)
        self.n = 0.0
        self.tokens = 0
        self.first_token_weight = first_token_weight

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].float()  # (B, T, in)
        x = x[None] if x.dim() == 2 else x
        w = torch.ones(x.shape[1], device=x.device)
        w[0] = self.first_token_weight  # position 0 of every calibration window counts this many times
        m = float(w.sum()) * x.shape[0]
        self.tokens += x.shape[0] * x.shape[1]
        x = (x * w.sqrt()[None, :, None]).reshape(-1, x.shape[-1])  # (tokens, in)
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.t() @ x


def _swap(parent: nn.Module, name: str, full: str, linear: nn.Linear, scheme: QuantScheme, qparams) -> dict:
    """Replace ``parent.<name>`` by a QuantizedLinear from ``(q, scale, zero_point)``; its report row."""
    qlinear = QuantizedLinear.from_quantized(linear, scheme, *qparams)
    set_submodule(parent, name, qlinear)
    return layer_report(full, linear.weight, qlinear)


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module,
    scheme: QuantScheme,
    names: list[str],
    calib_ids: torch.Tensor,
    percdamp: float = 0.01,
    block_size: int = 128,
    batch_size: int = 8,
    progress: ProgressFn | None = None,
    sink_weight: float = 32.0,
    down_percdamp: float = 1.0,
    clip_search: bool = False,
) -> list[dict]:
    """Quantize the named Linears of a :class:`Transformer` decoder layer by decoder layer.

    Calibration hidden states enter layer 0; each layer's Hessians are collected from its
    full-precision forward, its Linears are quantized, and the quantized layer's outputs feed the
    next layer (the sequential scheme of the paper's reference code). Named Linears outside the
    decoder layers (an unignored untied ``lm_head``) get round-to-nearest. The Linears of routed
    experts (``quant.experts.QuantizedExperts``) see only the tokens the router sends them, so each
    expert's Hessian is built from its own tokens; one that receives none gets min/max
    round-to-nearest, reported as ``fallback`` (:func:`_quantize_layer_linear`).

    Args:
        calib_ids: (n_samples, seq_len) int64 token ids.
        batch_size: calibration samples per forward.
        sink_weight: weight of each window's first token in the Hessian of the attention input
            projections (``q_proj``/``k_proj``/``v_proj``). The first position is the attention sink
            that every later query reads; with weight 1 it is 1/seq_len of the objective and GPTQ
            moves rounding error onto its keys/values (on SmolLM2-135M, GPTQ on v_proj alone then
            did worse than RTN, and weight 32 better: docs/benchmarks/archive.md, "Quantization
            (perplexity)").
        down_percdamp: damping for ``down_proj`` (the MLP output; also every routed expert's,
            Mixtral's ``w2``), whose 1536-wide gated input Hessian from a small off-domain
            calibration set overfits: with 1% damping GPTQ's held-out output error on down_proj
            exceeded RTN's in most layers.
        clip_search: group scales/zero points from the Hessian-diagonal-weighted clip search
            (:func:`gptq_quantize_weight`). The round-to-nearest fallback outside the decoder
            layers keeps min/max parameters (no Hessian is collected for it, and the unweighted
            search raised perplexity for RTN).
    Returns:
        report rows as :func:`linear.layer_report` plus ``calibration_tokens`` (and ``fallback``),
        in ``names`` order.
    """
    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    ids = calib_ids.to(device)
    n, T = ids.shape
    positions = torch.arange(T, device=device)[None]  # (1, T)
    batches = [ids[i : i + batch_size] for i in range(0, n, batch_size)]
    hidden = [model.model.embed_tokens(b) for b in batches]  # each (b, T, hidden)
    cos, sin = model.rotary_emb(positions, dtype)  # (1, T, head_dim)
    wanted = set(names)
    rows: dict[str, dict] = {}
    damping = {
        "percdamp": percdamp,
        "down_percdamp": down_percdamp,
        "block_size": block_size,
        "clip_search": clip_search,
    }

    for li, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{li}."
        linears = [(n_, m) for n_, m in layer.named_modules() if isinstance(m, nn.Linear) and prefix + n_ in wanted]
        attn_in = ("q_proj", "k_proj", "v_proj")
        accs = {
            n_: _HessianAccumulator(m.in_features, device, sink_weight if n_.endswith(attn_in) else 1.0)
            for n_, m in linears
        }
        hooks = [m.register_forward_pre_hook(accs[n_]) for n_, m in linears]
        for x in hidden:
            layer(x, cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1), None)
        for h in hooks:
            h.remove()
        for n_, linear in linears:
            rows[prefix + n_] = _quantize_layer_linear(layer, n_, prefix + n_, linear, accs[n_], scheme, **damping)
            if progress:
                progress(len(rows), len(names), prefix + n_)
        hidden = [layer(x, cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1), None) for x in hidden]

    for full in names:
        if full not in rows:
            linear = model.get_submodule(full)
            rows[full] = _swap(model, full, full, linear, scheme, quantize_weight(linear.weight, scheme))
            if progress:
                progress(len(rows), len(names), full)
    return [rows[n_] for n_ in names]


def _quantize_layer_linear(
    layer: nn.Module,
    name: str,
    full: str,
    linear: nn.Linear,
    acc: _HessianAccumulator,
    scheme: QuantScheme,
    percdamp: float,
    down_percdamp: float,
    block_size: int,
    clip_search: bool,
) -> dict:
    """GPTQ of one Linear of a decoder layer from its accumulated Hessian, swapped in place; its
    report row with ``calibration_tokens`` (the rows its Hessian summed). A Linear that saw no token
    (a routed expert the router never chose) gets min/max round-to-nearest and a ``fallback`` note."""
    if acc.tokens == 0:
        row = _swap(layer, name, full, linear, scheme, quantize_weight(linear.weight, scheme))
        return {**row, "calibration_tokens": 0, "fallback": NO_TOKEN_FALLBACK}
    damp = down_percdamp if name.endswith(("down_proj", ".w2")) else percdamp  # Mixtral's expert w2 is down
    qparams = gptq_quantize_weight(linear.weight, acc.H, scheme, damp, block_size, name=full, clip_search=clip_search)
    return {**_swap(layer, name, full, linear, scheme, qparams), "calibration_tokens": acc.tokens}
