"""torch.distributed set-up and the parallelisms, applied to the plain :class:`Transformer`.

Order (as torchtitan applies them): :func:`apply_tp` -> :func:`apply_ep` (``expert_parallel.py``) ->
:func:`apply_ac` -> :func:`apply_compile` -> :func:`apply_fsdp`. Each transforms the model in place and keeps every
parameter's fully qualified
name, so state dicts stay in the HF layout.

Launch forms: torchrun (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set) or
``srun`` with one task per device (the same values derived from ``SLURM_*``, see
:func:`dist_env_from_slurm`). Backend nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import functools
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.gemma import GemmaRMSNorm, gemma_rms_norm
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.train.expert_parallel import ExpertParallelExperts, apply_ep, sparse_blocks
from baige.runtime.train.tied_embedding import apply_tied_embedding_grad

DEFAULT_MASTER_PORT = 29500


# ---- launch environment ----------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM host list: ``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``.

    Supports several bracket groups per name (``"r[1-2]n[1-2]"``) and keeps zero padding.
    Raises BaigeError on unbalanced brackets.
    """
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(hostlist + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if hostlist[start:i]:
                names.extend(_expand_one(hostlist[start:i]))
            start = i + 1
        if depth < 0:
            break
    if depth != 0:
        raise BaigeError(f"bad SLURM host list {hostlist!r}: unbalanced brackets")
    return names


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[: m.start()], name[m.end() :]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        values = [lo] if not hi else [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
        for v in values:
            out.extend(_expand_one(head + v + tail))
    return out


def dist_env_from_slurm(env: Mapping[str, str]) -> dict[str, str] | None:
    """torch.distributed variables for ``srun`` with one task per device, from SLURM's.

    ``SLURM_PROCID`` -> ``RANK``, ``SLURM_LOCALID`` -> ``LOCAL_RANK``, ``SLURM_NTASKS`` -> ``WORLD_SIZE``,
    first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``) ->
    ``MASTER_ADDR``; ``MASTER_PORT`` kept when set, else 29500. Variables already set (``MASTER_ADDR``)
    win. Returns None when not inside a multi-task SLURM step.
    """
    if "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("MASTER_ADDR") and not nodelist:
        raise BaigeError("SLURM step without SLURM_NODELIST: set MASTER_ADDR")
    return {
        "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "MASTER_ADDR": env.get("MASTER_ADDR") or expand_hostlist(nodelist)[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(DEFAULT_MASTER_PORT),
    }


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group when launched with several processes (torchrun or srun).

    torchrun's variables win over SLURM's (srun one task per node starting torchrun). With one
    process no process group is created. On CUDA the device is ``cuda:LOCAL_RANK``.

    Raises:
        BaigeError: inconsistent launch variables.
    """
    if "WORLD_SIZE" not in os.environ:
        slurm = dist_env_from_slurm(os.environ)
        if slurm is not None:
            os.environ.update(slurm)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    info = DistInfo(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world_size)
    if not 0 <= info.rank < world_size:
        raise BaigeError(f"RANK={info.rank} is outside WORLD_SIZE={world_size}")
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return info


# ---- device mesh -----------------------------------------------------------------------------------


@dataclass
class ParallelDims:
    """Sizes of the mesh dimensions: ``pp x dp_replicate x dp_shard x cp x tp == world_size``; ``ep`` (expert
    parallel) divides ``dp_shard`` (EP borrows from the data-parallel shard dimension); ``cp`` (context
    parallel) shards each window's sequence, and FSDP shards over ``dp_shard x cp`` (torchtitan's
    ``dp_shard_cp``)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    pp: int = 1
    cp: int = 1

    @classmethod
    def resolve(
        cls, world_size: int, dp_replicate: int, dp_shard: int, tp: int, ep: int = 1, pp: int = 1, cp: int = 1
    ) -> "ParallelDims":
        """``dp_shard = -1`` takes what the others leave. Raises BaigeError when the product is wrong
        or ``ep`` does not divide ``dp_shard``."""
        if dp_replicate < 1 or tp < 1 or ep < 1 or pp < 1 or cp < 1 or dp_shard == 0 or dp_shard < -1:
            raise BaigeError("parallelism degrees must be >= 1 (data_parallel_shard_degree may be -1)")
        if world_size % pp:
            raise BaigeError(f"pipeline_parallel_degree {pp} does not divide world_size {world_size}")
        others = dp_replicate * tp * pp * cp
        if dp_shard == -1:
            if world_size % others:
                raise BaigeError(
                    f"world_size {world_size} is not divisible by pipeline_parallel_degree x "
                    f"data_parallel_replicate_degree x context_parallel_degree x tensor_parallel_degree = {others}"
                )
            dp_shard = world_size // others
        if dp_shard * others != world_size:
            raise BaigeError(
                f"parallelism degrees {pp} (pp) x {dp_replicate} (replicate) x {dp_shard} (shard) x {cp} (cp) x "
                f"{tp} (tp) != world_size {world_size}"
            )
        if dp_shard % ep:
            raise BaigeError(
                f"expert_parallel_degree {ep} must divide data_parallel_shard_degree {dp_shard} "
                "(EP borrows ranks from the data-parallel shard dimension)"
            )
        return cls(dp_replicate, dp_shard, tp, ep, pp, cp)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that see the same data (``tp x pp``, Megatron's model-parallel size): a sum over the
        world of per-rank data counts is that many times the sum over data-parallel ranks (CP ranks
        hold disjoint shards of the same windows, so they count as different data)."""
        return self.tp * self.pp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp_size(self) -> int:
        """Ranks FSDP averages gradients over (data-parallel x context-parallel)."""
        return self.dp_size * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_cp_size > 1

    def build_mesh(self, device_type: str) -> "torch.distributed.device_mesh.DeviceMesh | None":
        """The mesh ``("dp_replicate", "dp_shard", "tp")``, with ``"cp"`` before ``"tp"`` when context
        parallel and ``"pp"`` outermost when pipelining (torchtitan's order: ranks of one pipeline are the
        farthest apart); None for a single process."""
        if self.dp_cp_size * self.tp * self.pp == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = (self.dp_replicate, self.dp_shard, self.tp), ("dp_replicate", "dp_shard", "tp")
        if self.cp > 1:
            shape, names = (*shape[:2], self.cp, shape[2]), (*names[:2], "cp", names[2])
        if self.pp > 1:
            shape, names = (self.pp, *shape), ("pp", *names)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    def build_dp_cp_mesh(self, device_type: str) -> "torch.distributed.device_mesh.DeviceMesh | None":
        """With context parallel, FSDP's mesh: ``dp_shard_cp`` (torchtitan's name; the ``dp_shard`` and ``cp``
        ranks of :meth:`build_mesh` in the same order, one dimension) or ``(dp_replicate, dp_shard_cp)`` for
        HSDP; None without CP. Built as its own mesh over the same ranks (as the experts' mesh is)."""
        if self.cp == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard * self.cp, self.tp),
            mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"),
        )
        return mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else mesh["dp_shard_cp"]

    def build_sparse_mesh(self, device_type: str) -> "torch.distributed.device_mesh.DeviceMesh | None":
        """The experts' 4-D mesh ``("dp_replicate", "efsdp", "ep", "tp")`` over the same ranks in the
        same order (``dp_shard = efsdp * ep``); None without expert parallelism."""
        if self.ep == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp),
            mesh_dim_names=("dp_replicate", "efsdp", "ep", "tp"),
        )

    def dp_rank(self, mesh) -> int:
        """This rank's index among the data-parallel ranks (``replicate_idx * dp_shard + shard_idx``)."""
        if mesh is None:
            return 0
        return mesh.get_local_rank("dp_replicate") * self.dp_shard + mesh.get_local_rank("dp_shard")


# ---- transformations -------------------------------------------------------------------------------


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Megatron-style tensor parallelism with DTensor (Shoeybi et al. 2019, arXiv:1909.08053).

    q/k/v and gate/up projections column-wise, o_proj and down_proj row-wise (one all-reduce after
    attention and one after the MLP); embeddings, norms and lm_head stay replicated over ``tp_mesh``.
    In sparse (MoE) layers the shared expert is split the same way; the router and the routed
    experts stay replicated (every TP rank routes the same tokens). Each attention module's head
    counts become per-rank counts (as gpt-fast does).

    Raises:
        BaigeError: heads, KV heads or an MLP width not divisible by the TP degree.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    cfg = model.config
    if cfg.attention_sinks:
        raise BaigeError(f"tensor_parallel_degree={tp}: {cfg.model_type} (attention sinks) is not supported")
    widths = [("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads)]
    if len(sparse_blocks(model)) < cfg.num_hidden_layers:
        widths.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe is not None and cfg.moe.shared_intermediate_size:
        widths.append(("shared_expert_intermediate_size", cfg.moe.shared_intermediate_size))
    for name, n in widths:
        if n % tp:
            raise BaigeError(f"{name}={n} is not divisible by tensor_parallel_degree={tp}")

    def swiglu(prefix: str) -> dict:
        return {
            f"{prefix}.gate_proj": ColwiseParallel(),
            f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel(),
        }

    group = tp_mesh.get_group()
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
        }
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoeBlock):
            plan.update(swiglu("mlp"))
        for shared in ("shared_expert", "shared_experts"):
            if getattr(mlp, shared, None) is not None:
                plan.update(swiglu(f"mlp.{shared}"))
        parallelize_module(layer, tp_mesh, plan)
        layer.self_attn.n_heads //= tp  # local heads: the projections' outputs are local shards
        layer.self_attn.n_kv_heads //= tp
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if norm is not None:  # Qwen3's per-head norms see only the local heads
                norm.forward = functools.partial(_head_norm_forward, norm, group)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _head_norm_forward(norm: nn.Module, group, x: torch.Tensor) -> torch.Tensor:
    """A q/k head norm under TP: x (B, T, local heads, D); its weight is replicated and each rank's
    gradient covers only its heads, so the gradient is summed over the TP group (Megatron's
    sequence-parallel norm rule). Gemma 3's head norms scale by ``1 + weight`` (:func:`gemma_rms_norm`)."""
    norm_fn = gemma_rms_norm if isinstance(norm, GemmaRMSNorm) else kernels.rms_norm
    return norm_fn(x, _SumGradOverGroup.apply(norm.weight, group), norm.eps)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per decoder block (Chen et al. 2016, arXiv:1604.06174).

    ``mode``: ``"none"``, ``"full"`` (every block) or ``"N"`` (every N-th block: 0, N, 2N, ...).
    Uses the composable ``checkpoint`` hook, so parameter names do not change.
    """
    if mode == "none":
        return
    from torch.distributed._composable import checkpoint

    every = 1 if mode == "full" else int(mode)
    for i, layer in enumerate(model.model.layers):
        if i % every == 0:
            checkpoint(layer)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each decoder block in place (repeated blocks share one compiled graph); a
    sparse block's expert grouping reads counts to the host, so those compile with graph breaks."""
    for layer in model.model.layers:
        layer.compile(fullgraph=not isinstance(layer.mlp, SparseMoeBlock))


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    expert_mesh=None,
    reshard_after_forward: bool = True,
) -> None:
    """FSDP2 ``fully_shard`` on every decoder block, then on the root (embeddings, final norm, lm_head).

    ``dp_mesh`` is 1-D (FSDP) or 2-D ``(dp_replicate, dp_shard)`` (HSDP: replicate across the first
    dimension, shard within the second). Gradients are averaged over the data-parallel ranks in
    ``reduce_dtype``; parameters are all-gathered in ``param_dtype`` (the MixedPrecisionPolicy).
    The last block is not resharded after forward: backward needs it at once; a pipeline stage
    (``reshard_after_forward=False``, ``model.model.layers`` a ModuleDict) keeps every block unsharded
    between its micro-batches' forward and backward, as torchtitan does with PP.

    With expert parallelism, each sparse layer's experts (already ``Shard(0)`` over ``ep``) are
    their own FSDP unit over ``expert_mesh`` (``efsdp``, or ``(dp_replicate, efsdp)``; torchtitan
    keeps it even at size 1 for mixed precision), averaging over those ``dp_size / ep`` ranks (the
    experts scale their gradient by ``1 / ep``, see ``ExpertParallelExperts``). Their inputs are not
    cast (the routing weights stay fp32).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    expert_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    layers = model.model.layers
    layers = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    for i, layer in enumerate(layers):
        reshard = reshard_after_forward and i < len(layers) - 1
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, ExpertParallelExperts):
            fully_shard(experts, mesh=expert_mesh, mp_policy=expert_policy, reshard_after_forward=reshard)
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def data_parallel_mesh(dims: ParallelDims, mesh):
    """FSDP's mesh without context parallel: ``dp_shard``, or the 2-D ``(dp_replicate, dp_shard)`` for HSDP
    (with CP: :meth:`ParallelDims.build_dp_cp_mesh`)."""
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh,
    *,
    ac: str,
    compile: bool,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    sparse_mesh=None,
    dp_cp_mesh=None,
) -> None:
    """Apply TP, EP, AC, compile and FSDP in that order (each only when enabled; with pipeline
    parallel, FSDP is left to :func:`~baige.runtime.train.pipeline.build_pipeline`, per stage);
    without FSDP, TP and PP, route a tied embedding's gradient into the lm_head's
    (:func:`apply_tied_embedding_grad`).
    ``sparse_mesh``: :meth:`ParallelDims.build_sparse_mesh` (needed when ``dims.ep > 1``); ``dp_cp_mesh``:
    :meth:`ParallelDims.build_dp_cp_mesh` (FSDP's mesh when ``dims.cp > 1``)."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.ep > 1:
        apply_ep(model, sparse_mesh["ep"])
    apply_ac(model, ac)
    if compile:
        apply_compile(model)
    if dims.fsdp_enabled and dims.pp == 1:  # with PP, each stage is sharded (pipeline.py)
        expert_mesh = None
        if dims.ep > 1:
            expert_mesh = sparse_mesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else sparse_mesh["efsdp"]
        dp_mesh = dp_cp_mesh if dims.cp > 1 else data_parallel_mesh(dims, mesh)
        apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype, expert_mesh)
    elif dims.tp == 1 and dims.pp == 1:
        apply_tied_embedding_grad(model)


# ---- gradient clipping -----------------------------------------------------------------------------


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, pp_group=None, not_counted: Iterable[torch.Tensor] = ()
) -> torch.Tensor:
    """Clip gradients by their global L2 norm; correct when they are DTensors sharded by FSDP and/or TP.

    Norms are taken per group of gradients on the same mesh and placements, then made global with
    ``full_tensor()`` (the reduction the placements call for); plain tensors are local (identical
    across the ranks that hold them). With pipeline parallel, ``pp_group`` sums the squared norms of
    the stages (each rank holds disjoint parameters), as torchtitan does; ``not_counted`` are clipped but
    left out of the norm (a copy another rank counts: a tied embedding). ``max_norm <= 0`` only measures.

    Returns:
        () fp32 total norm before clipping (the same on every rank).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else g.device].append(p)
    skip = {id(p) for p in not_counted}
    total_sq = None
    for params in groups.values():
        counted = [p.grad for p in params if id(p) not in skip]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = norm.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq.to(total_sq.device)
    if pp_group is not None:
        total_sq = torch.zeros(()) if total_sq is None else total_sq
        dist.all_reduce(total_sq, group=pp_group)
    if total_sq is None:
        return torch.zeros(())
    total = total_sq.sqrt()
    if max_norm > 0:
        for params in groups.values():  # per group: one foreach call may not mix DTensors and tensors
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
