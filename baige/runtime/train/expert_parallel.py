"""Expert parallelism (EP): each sparse layer's routed experts sharded over the ``ep`` mesh dimension.

Layout (torchtitan's): EP borrows from the data-parallel shard dimension. The sparse mesh is
``("dp_replicate", "efsdp", "ep", "tp")`` over the same ranks as the dense mesh
``("dp_replicate", "dp_shard", "tp")``, with ``dp_shard = efsdp * ep``: EP rank ``r`` of a group holds
experts ``[r * E / ep, (r + 1) * E / ep)`` -- the stacked ``experts.gate_up_proj`` (E, 2I, H) and
``experts.down_proj`` (E, H, I) as DTensors ``Shard(0)`` on ``ep`` (global shapes, the same names:
the state dict and DCP checkpoints keep the one-process layout and reshard between EP degrees).
FSDP2 then shards the experts over ``efsdp`` (and replicates over ``dp_replicate``), the other
parameters over the whole ``dp_shard`` (:func:`baige.runtime.train.parallel.apply_fsdp`).

Forward of one sparse layer on every EP rank (Megatron-Core / torchtitan "all-to-all token
dispatcher", no token dropping): the (token, slot) pairs sorted by expert; per-expert counts
exchanged (``all_to_all_single``); the token rows sent to their experts' ranks
(``all_to_all_single`` with uneven splits); the local experts run (``kernels.fused_moe``, one
expert per row); the outputs sent back by the reverse exchange and combined with the routing
weights in fp32, as the one-process path does. The exchanges are differentiable (the backward is
the reverse exchange), so expert gradients collect every rank's tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.moe import Experts, SparseMoeBlock


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; the backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """Drop-in for :class:`~baige.runtime.model.moe.Experts` holding this EP rank's experts only.

    ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) are DTensors ``Shard(0)`` on ``ep_mesh``
    (local: ``num_local_experts`` rows, the global experts ``expert_ids``).

    Gradient scale: every rank's backward loss carries the trainer's ``dp_size`` factor (FSDP
    averages dense gradients over the ``dp_size`` ranks), and an expert's gradient sums the tokens
    of its ``ep`` ranks while FSDP averages it over the other ``dp_size / ep``; the local weights
    therefore pass a ``1 / ep`` gradient scale, which makes the expert gradient the same average.
    """

    def __init__(self, experts: Experts, ep_mesh):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        self.num_local_experts = self.num_experts // ep
        first = rank * self.num_local_experts
        self.expert_ids = list(range(first, first + self.num_local_experts))
        self.ep_size, self.group = ep, ep_mesh.get_group()
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach()[first : first + self.num_local_experts].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(dt, requires_grad=full.requires_grad))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: (N, H); topk_weights (N, k) fp32; topk_ids (N, k) int64 global ids -> (N, H) in x's dtype.
        Collective over the EP group (every rank calls it once per sparse layer)."""
        n, k = topk_ids.shape
        flat = topk_ids.reshape(-1)  # (N * k,)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, hence by destination rank
        tok = order // k  # (N * k,) token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,) pairs per global expert
        recv_counts = torch.empty_like(counts)  # (ep * E_local,): [source rank][local expert]
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(self.ep_size, -1).sum(1).tolist()  # rows to each rank
        recv = recv_counts.view(self.ep_size, -1).sum(1).tolist()  # rows from each rank
        xr = _AllToAll.apply(x[tok], recv, send, self.group)  # (M, H)
        local_ids = torch.arange(self.num_local_experts, device=x.device).repeat(self.ep_size)
        local_ids = local_ids.repeat_interleave(recv_counts.to(x.device))  # (M,) local expert of each row
        scale = 1.0 / self.ep_size  # see the class docstring
        w13 = _ScaleGrad.apply(self.gate_up_proj.to_local(), scale)  # (E_local, 2I, H)
        w2 = _ScaleGrad.apply(self.down_proj.to_local(), scale)  # (E_local, H, I)
        if xr.shape[0]:
            ones = torch.ones(xr.shape[0], 1, dtype=torch.float32, device=x.device)
            y = kernels.fused_moe(xr, w13, w2, ones, local_ids[:, None])  # (M, H)
        else:  # no rows for this rank: zero gradients (not None) keep every rank's reductions alike
            y = xr + 0.0 * (w13.sum() + w2.sum())
        yb = _AllToAll.apply(y, send, recv, self.group)  # (N * k, H) in `order`
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        weighted = yb.to(acc) * topk_weights.reshape(-1)[order].to(acc)[:, None]
        out = torch.zeros(n, x.shape[1], dtype=acc, device=x.device).index_add(0, tok, weighted)
        return out.to(x.dtype)


def sparse_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's sparse MLP blocks, layer order."""
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Swap every sparse layer's ``mlp.experts`` for an :class:`ExpertParallelExperts` over ``ep_mesh``
    (1-D). Parameter names and global shapes are unchanged.

    Raises:
        BaigeError: a dense model, or a number of routed experts not divisible by the EP degree.
    """
    ep = ep_mesh.size()
    blocks = sparse_blocks(model)
    if not blocks:
        raise BaigeError(
            f"expert_parallel_degree={ep} needs a Mixture-of-Experts model "
            f"({model.config.model_type} has no sparse layer)"
        )
    e = model.config.moe.num_experts
    if model.config.moe.expert_bias:
        raise BaigeError(f"expert_parallel_degree={ep}: {model.config.model_type}'s biased experts are not supported")
    if e % ep:
        raise BaigeError(f"num_experts={e} is not divisible by expert_parallel_degree={ep}")
    for block in blocks:
        block.experts = ExpertParallelExperts(block.experts, ep_mesh)
