"""``baige train``'s optimizers: AdamW, and Muon for the hidden matrices with AdamW for the rest.

``optimizer.name = adamw``: AdamW (Loshchilov & Hutter 2019) on every trained parameter, no weight decay
on norms, biases and embeddings.

``optimizer.name = muon``: Muon (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/) on the
2-D (and stacked 3-D expert) weights of the decoder layers; AdamW on the embeddings, the LM head, norms
and biases. That is the split of Kimi's Moonlight (Liu et al. 2025, "Muon is Scalable for LLM
Training", arXiv:2502.16982) and of torchtitan's Muon. One learning rate and weight decay serve both
parts: each Muon update is scaled by ``0.2 * sqrt(max(A, B))`` for an A x B matrix, which gives it the
RMS of a typical AdamW update (Moonlight, section 2.2; ``torch.optim.Muon``'s ``match_rms_adamw``).

Both parts live in one :class:`Muon` optimizer (its ``param_groups`` carry ``algorithm = "muon" |
"adamw"``), so the learning-rate schedule, gradient clipping and the DCP checkpoint see one optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

# Keller Jordan's quintic Newton-Schulz coefficients (a, b, c), chosen to maximise the slope at zero
# (https://github.com/KellerJordan/Muon/blob/master/muon.py; torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def zeropower_via_newtonschulz(
    g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32, eps: float = NS_EPS
) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (U S V^T -> about U V^T) with ``steps`` quintic Newton-Schulz
    iterations X <- a X + (b X X^T + c (X X^T)^2) X, after scaling X to unit Frobenius norm (so its
    spectral norm is at most 1). The iteration runs on the wide orientation (rows <= columns) and returns
    ``g``'s. Keller Jordan's Muon (coefficients :data:`NS_COEFFICIENTS`); the same operations, in the same
    order, as ``torch.optim.Muon`` (addmm), which computes in bf16: ``dtype`` picks the compute dtype here.

    Args:
        g: (..., A, B) a matrix, or a stack of matrices (MoE experts) each orthogonalised alone.
        dtype: compute dtype (bf16 as Keller's and torch's Muon, fp32, fp64).

    Returns:
        (..., A, B) in ``dtype``.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = g.size(-2) <= g.size(-1)
    if not wide:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT  # (..., rows, rows)
        poly = mm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = mm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x if wide else x.mT


def muon_lr_scale(shape: torch.Size) -> float:
    """``0.2 * sqrt(max(A, B))`` for a (..., A, B) weight: Moonlight's update-RMS match with AdamW."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _orthogonalised(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of the whole matrix behind ``update``; returns this rank's part of it (a plain tensor
    in ``dtype``). A DTensor (FSDP2 / TP / EP shards) is gathered whole on every rank
    (``full_tensor``), orthogonalised, and cut back to this rank's shard by its own placements (no
    communication): each matrix is orthogonalised whole, as torchtitan's DistMuon does (which also
    spreads the matrices' Newton-Schulz work over the ranks; here every rank computes every matrix)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        return zeropower_via_newtonschulz(update, steps, dtype)
    full = zeropower_via_newtonschulz(update.full_tensor(), steps, dtype)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None).to_local()


class Muon(torch.optim.Optimizer):
    """Muon for the groups with ``algorithm = "muon"``, AdamW for those with ``"adamw"`` (see the module
    docstring). Muon, per parameter W (Keller Jordan's and ``torch.optim.Muon``'s update)::

        B <- momentum * B + (1 - momentum) * G          (state "momentum_buffer", G's placements)
        U <- G + momentum * (B - G) if nesterov else B
        O <- NewtonSchulz(U)  (the whole matrix; :func:`zeropower_via_newtonschulz`, ``ns_dtype``)
        W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(A, B)) * O

    AdamW groups hold AdamW's state ("step", "exp_avg", "exp_avg_sq") and run ``torch.optim.adamw``'s
    functional update (``fused`` when the group asks and the tensors allow).

    Args:
        param_groups: dicts with ``params`` and ``algorithm`` (and any per-group overrides).
        lr, weight_decay: shared by both algorithms. betas, eps: AdamW's. momentum, nesterov, ns_steps:
            Muon's. ns_dtype: Newton-Schulz compute dtype. fused: AdamW's fused kernels (None = off).
    """

    def __init__(
        self,
        param_groups: Iterable[dict],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        fused: bool | None = None,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            betas=tuple(betas),
            eps=eps,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            fused=fused,
        )
        super().__init__(list(param_groups), defaults)
        self.ns_dtype = ns_dtype  # a property of the run, not of the state: not saved
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"unknown algorithm {group['algorithm']!r} (muon or adamw)")
            if group["algorithm"] == "muon" and any(p.ndim < 2 for p in group["params"]):
                raise ValueError("Muon takes matrices (ndim >= 2); put vectors in an adamw group")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = _orthogonalised(update, group["ns_steps"], self.ns_dtype)
            w = _local(p)
            w.mul_(1 - lr * wd)
            w.add_(ortho.to(w.dtype), alpha=-lr * muon_lr_scale(p.shape))

    def _adamw_group(self, group: dict) -> None:
        from torch.optim.adamw import adamw

        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        fused = bool(group["fused"])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # torch.optim.AdamW's state: a float32 step (on the device when fused), two moments
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else None)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            fused=fused or None,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _uses_muon(name: str, param: torch.Tensor) -> bool:
    """Muon for the decoder layers' matrices (2-D, and 3-D stacked experts); AdamW for embeddings, the LM
    head, norms and biases (Moonlight's and torchtitan's split)."""
    return param.ndim >= 2 and "embed_tokens" not in name and "lm_head" not in name


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    betas: list[float],
    eps: float,
    weight_decay: float,
    fused: bool,
    momentum: float = 0.95,
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.float32,
) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s trained parameters: ``name`` ``adamw`` (torch.optim.AdamW) or
    ``muon`` (:class:`Muon`). AdamW takes no weight decay on norms, biases and embeddings. Groups hold
    one kind of tensor each (fused/foreach kernels take DTensors or plain tensors, not both); the same
    groups on every layout, so checkpoints reshard between layouts.

    Raises:
        ValueError: an unknown ``name`` (the config validates it first).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[str, bool, bool], list] = {}
    for pname, param in ((n, p) for n, p in model.named_parameters() if p.requires_grad):  # not a frozen base
        algorithm = "muon" if name == "muon" and _uses_muon(pname, param) else "adamw"
        decay = param.ndim >= 2 and "embed_tokens" not in pname
        groups.setdefault((algorithm, decay, isinstance(param, DTensor)), []).append(param)
    param_groups = [
        {"params": params, "weight_decay": weight_decay if decay else 0.0, "algorithm": algorithm}
        for (algorithm, decay, _), params in sorted(groups.items(), reverse=True)
    ]
    if name == "adamw":
        for g in param_groups:
            del g["algorithm"]
        return torch.optim.AdamW(param_groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)
    if name != "muon":
        raise ValueError(f"unknown optimizer {name!r}")
    return Muon(
        param_groups,
        lr=lr,
        weight_decay=weight_decay,
        betas=tuple(betas),
        eps=eps,
        momentum=momentum,
        ns_steps=ns_steps,
        ns_dtype=ns_dtype,
        fused=fused or None,
    )
