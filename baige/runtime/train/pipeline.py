"""Pipeline parallelism with ``torch.distributed.pipelining``: stage split, stage modules, schedule,
the pipelined training step, its metrics and the HF-export gather.

Stages. The plain :class:`Transformer` (after TP, AC and compile) is cut into ``S = pp x v``
contiguous stages, ``v`` = 1 stage per rank for the single-stage schedules (GPipe, 1F1B) and 2 for
the multi-stage ones (Interleaved1F1B, ZBVZeroBubble: torchtitan's default). The embedding is on
the first stage, the final norm and ``lm_head`` (with the fused cross-entropy) on the last, where
torchtitan puts them; layers are split by count with the embedding and the head each weighing one
layer (torchtitan's ``input_weight = output_weight = 1``, see :func:`split_layers`). Stage ``s``
runs on pipeline rank ``s mod pp`` (looped: Interleaved1F1B) or on the V ``(r, S - 1 - r)`` (ZBV).

Names. Every stage module, and :class:`PipelinedModel` (all of this rank's stages: what the
optimizer, clipping, DCP and the export see), hold the original submodules under the unsplit
model's fully qualified names (``model.layers.7.mlp.up_proj.weight``), so a checkpoint written
with PP = 2 loads with PP = 1 and back (DCP reshards by name).

Loss. The last stage's ``loss_fn`` is the fused linear cross-entropy of its micro-batch summed over
tokens and divided by the valid-token count of the whole step (every pipeline micro-batch, every
gradient-accumulation step, every data-parallel rank), times the data-parallel size (FSDP averages
gradients); the schedules are built with ``scale_grads=False``. The gradient is then exactly that
of one process over the global batch, SFT loss masks included (torchtitan's global-token
normalisation).

Mixture-of-Experts. The router losses stay off (both coefficients 0; the load-balancing loss couples
every stage's logits). Each stage keeps its sparse layers' detached router logits per micro-batch;
after the schedule the trainer hands them to the balancer, whose one all-reduce per micro-batch sums
the expert load over the data-parallel ranks and the stages (disjoint layers): the ``bias`` update
and the router metrics are the one-process ones.

Bubble. ``pp_bubble_fraction`` is measured: per pipeline rank, ``1 - compute / wall`` over the
logged steps, where ``compute`` is the time in its stages' forward, backward and loss (not in
transfers or waits) and ``wall`` the time of the schedule's steps; the record holds the mean over
the pipeline ranks. ``pp_bubble_fraction_schedule`` is the schedule's ideal:
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B (Huang et al. 2019, arXiv:1811.06965), ``(p - 1) /
(v m + p - 1)`` for Interleaved1F1B (Narayanan et al. 2021, arXiv:2104.04473, section 2.2), and
for ZBVZeroBubble the idle share of torch's own action timeline where F, I and W take one unit
each (the zero-bubble paper's equal-cost assumption, Qi et al. 2023, arXiv:2401.10241).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from baige.errors import BaigeError
from baige.runtime.model.gemma import lm_head_cross_entropy
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.model.transformer import Transformer
from baige.runtime.train import parallel
from baige.runtime.train.moe import MoEBalancer, RouterLogits

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
}
STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, non-empty layer ranges, one per stage.

    Every stage starts with one layer; each further layer goes to the stage of least cost (earliest
    on ties), where cost = layers + 1 on the first stage (the embedding) + 1 on the last (norm and
    lm_head), torchtitan's weights. E.g. 4 layers, 2 stages: [0, 1], [2, 3]; 6 layers, 4 stages:
    [0], [1, 2], [3, 4], [5].

    Raises:
        BaigeError: more stages than layers.
    """
    if num_stages > num_layers:
        raise BaigeError(
            f"{num_stages} pipeline stages for {num_layers} layers: more stages than layers "
            "(lower --pp, or use GPipe/1F1B: one stage per rank)"
        )
    counts = [1] * num_stages

    def cost(s: int) -> int:
        return counts[s] + (s == 0) + (s == num_stages - 1)

    for _ in range(num_layers - num_stages):
        counts[min(range(num_stages), key=lambda s: (cost(s), s))] += 1
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


def stage_ids(pp_rank: int, pp: int, num_stages: int, v_shape: bool) -> tuple[int, ...]:
    """The stages pipeline rank ``pp_rank`` runs: ``r, r + p, r + 2p, ...`` (looped), or ``(r, S - 1 - r)``
    (V-shaped, ZBV: the first and the last stage share rank 0)."""
    if v_shape:
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(range(pp_rank, num_stages, pp))


class StageModule(nn.Module):
    """One pipeline stage: a contiguous run of decoder layers, with the embedding on the first
    stage and the final norm and lm_head on the last, held under the unsplit model's names."""

    def __init__(
        self, model: Transformer, layers: range, first: bool, last: bool, autocast_dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        self.rotary_emb = model.rotary_emb
        self.config = model.config  # the loss reads the final logit soft-cap (Gemma)
        self.is_first, self.is_last, self.autocast_dtype = first, last, autocast_dtype
        self.sparse = [i for i in layers if isinstance(model.model.layers[i].mlp, SparseMoeBlock)]
        # per forward with gradients, this stage's sparse layers' (N, E) router logits, detached
        self.router_logits: list[dict[int, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T) int64 token ids on the first stage, else the previous stage's (B, T, hidden)
        activations. Returns (B, T, hidden): the final normed hidden states on the last stage (its
        loss applies lm_head), activations for the next stage otherwise. Positions are 0 .. T-1
        (packed training windows, causal attention)."""
        device_type = x.device.type
        with torch.autocast(
            device_type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        ):
            if self.is_first:
                x = self.model.embed_tokens(x)  # (B, T, hidden)
            B, T = x.shape[:2]
            positions = torch.arange(T, device=x.device).expand(B, T)  # (B, T)
            cos, sin = self.rotary_emb(positions, x.dtype)  # (B, T, head_dim) each
            router = RouterLogits() if self.sparse and torch.is_grad_enabled() else None
            for layer in self.model.layers.values():
                x = layer(x, cos, sin, None, router)
            if router is not None:  # (an activation-checkpointing recompute appends later: not read)
                self.router_logits.append({i: t.detach() for i, t in zip(self.sparse, router.tensors)})
            if self.is_last:
                x = self.model.norm(x)
        return x


class PipelinedModel(nn.Module):
    """All of this rank's stages as one module under the unsplit model's names (embedding, this
    rank's layers in order, final norm, lm_head — the parts it holds): what the optimizer, gradient
    clipping, DCP checkpoints and the export use. It has no forward; the schedule runs the stages.

    With tied embeddings the last stage's rank also holds ``model.embed_tokens``, whose weight is its
    lm_head's (see :meth:`retie`): the tied tensor is then named ``model.embed_tokens.weight`` first,
    as in the unsplit model (its optimizer state, weight-decay group and checkpoint names match)."""

    def __init__(self, model: Transformer, stages: list[StageModule]):
        super().__init__()
        self.config = model.config
        self.model = nn.Module()
        self.tied = model.lm_head.weight is model.model.embed_tokens.weight
        if any(s.is_first or (self.tied and s.is_last) for s in stages):
            self.model.embed_tokens = model.model.embed_tokens
        layers = {k: v for s in stages for k, v in s.model.layers.items()}
        self.model.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        if any(s.is_last for s in stages):
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head

    def retie(self) -> None:
        """Point the embedding at lm_head's weight again (after FSDP replaced it on the last stage's
        root, on a rank without the first stage, whose embedding is then only a name)."""
        if self.tied and hasattr(self, "lm_head"):
            self.model.embed_tokens.weight = self.lm_head.weight

    def flops_per_token(self, seq_len: int) -> int:
        """The whole model's training FLOPs per token (:meth:`Transformer.flops_per_token`)."""
        return Transformer.flops_per_token(self, seq_len)


class ComputeTimer:
    """Seconds of computation inside ``with timer():`` blocks: wall clock on a CPU, CUDA events
    (read at :meth:`pop`, after a synchronize) on a GPU, so timing adds no synchronisation to a step."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self._events = device, 0.0, []

    @contextlib.contextmanager
    def __call__(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def pop(self) -> float:
        """The seconds since the last pop (and reset)."""
        if self._events:
            torch.cuda.synchronize(self.device)
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3  # ms -> s
        seconds, self.seconds, self._events = self.seconds, 0.0, []
        return seconds


class TimedPipelineStage(PipelineStage):
    """A :class:`PipelineStage` whose forward and backward computations (not its transfers) are
    timed by a shared :class:`ComputeTimer`."""

    def __init__(self, *args, timer: ComputeTimer, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = timer

    def forward_one_chunk(self, *args, **kwargs):
        with self.timer():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.timer():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.timer():
            return super().backward_weight_one_chunk(*args, **kwargs)


class PipelineLoss:
    """The schedules' ``loss_fn(output, target)`` for the last stage: summed token cross-entropy of
    ``lm_head(output)`` (fused, no logits materialised) / ``normalizer``, times ``scale`` for the
    backward. The unscaled values are kept in ``values`` (one () fp32 tensor per micro-batch)."""

    def __init__(self, last: StageModule | None, timer: ComputeTimer):
        self.last, self.timer = last, timer
        self.autocast_dtype = last.autocast_dtype if last is not None else None
        self.normalizer, self.scale = 1.0, 1.0
        self.values: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """hidden (B_mb, T, hidden), labels (B_mb, T) int64 (-100 = no loss) -> () fp32."""
        with (
            self.timer(),
            torch.autocast(
                hidden.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
            ),
        ):  # as the unpipelined step
            loss = lm_head_cross_entropy(self.last.config, hidden, self.last.lm_head.weight, labels, self.normalizer)
        self.values.append(loss.detach())
        return loss * self.scale


class Pipeline:
    """This rank's stages and the schedule that drives them. Every method is collective over the
    pipeline group (``step`` and ``eval_loss`` over the whole world, like the unpipelined step)."""

    def __init__(
        self,
        schedule,
        stages: list[TimedPipelineStage],
        loss: PipelineLoss,
        model: PipelinedModel,
        pp_group,
        device: torch.device,
        microbatches: int,
        ideal_bubble: float,
        embedding_group=None,
        description: str = "",
    ):
        self.schedule, self.stages, self.loss, self.model = schedule, stages, loss, model
        self.microbatches, self.embedding_group = microbatches, embedding_group
        self.pp_group, self.device, self.ideal_bubble = pp_group, device, ideal_bubble
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.timer = stages[0].timer
        self._wall, self._steps = 0.0, 0
        self.description = description  # one line for the log: schedule, stages and their layers
        self.router_logits: list[dict[int, torch.Tensor]] = []

    def _run(self, fn: Callable, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One schedule pass over a (B, T) batch; returns the sum of its micro-batches' unscaled
        losses on a rank with the last stage, 0 elsewhere. With gradients on an MoE model, appends
        to ``router_logits`` this rank's sparse layers' logits of the batch: ``{layer: (B * T, E)}``,
        the pipeline micro-batches' rows in batch order."""
        self.loss.values = []
        for stage in self.stages:
            stage.submod.router_logits = []
        args = (input_ids.to(self.device),) if self.has_first else ()
        fn(*args, target=labels.to(self.device) if self.has_last else None, losses=[])
        # the last n: a schedule's first step also runs the loss once to infer the stages' shapes
        values = self.loss.values[-self.microbatches :] if self.has_last else []
        if torch.is_grad_enabled() and self.model.config.moe is not None:  # every rank: the balancer's collectives
            # the last n again: the first step's shape inference runs each stage once on empty tensors
            seen = [m for stage in self.stages for m in stage.submod.router_logits[-self.microbatches :]]
            layers = sorted({i for m in seen for i in m})
            self.router_logits.append({i: torch.cat([m[i] for m in seen if i in m]) for i in layers})
        return float(sum(v.item() for v in values))

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]], normalizer: float, scale: float) -> float:
        """Forward and backward of the step's (B, T) micro-batches, each split into the schedule's
        pipeline micro-batches. Returns this rank's summed loss / ``normalizer`` (nats/token; 0 off
        the last stage). Gradients accumulate in the parameters' ``.grad``."""
        self.loss.normalizer, self.loss.scale = normalizer, scale
        self.router_logits: list[dict[int, torch.Tensor]] = []  # per micro-batch of `micro` (see _run)
        t0 = time.perf_counter()
        total = sum(self._run(self.schedule.step, ids, labels) for ids, labels in micro)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._wall += time.perf_counter() - t0
        self._steps += 1
        self._sync_tied_grad()
        return total

    def _tied_copy(self) -> torch.Tensor | None:
        """The tied embedding weight this rank holds when the first and last stages are on different
        ranks (Megatron's embedding group), else None."""
        if self.embedding_group is None or not (self.has_first or self.has_last):
            return None
        return self.model.model.embed_tokens.weight

    def _sync_tied_grad(self) -> None:
        """Sum the tied weight's gradient over the embedding group: the first stage holds the
        embedding's part, the last the lm_head's, the unsplit model their sum. Both copies then take
        the same optimizer step. (FSDP: the two ranks' shards cover the same rows.)"""
        weight = self._tied_copy()
        if weight is not None:
            grad = weight.grad
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.embedding_group)

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """:func:`parallel.clip_grad_norm_` over the stages (``pp_group``), the tied copy on the last
        stage's rank clipped but not counted (the first stage's rank counts it)."""
        copy = self._tied_copy() if self.has_last and not self.has_first else None
        return parallel.clip_grad_norm_(
            parameters, max_norm, self.pp_group, not_counted=[copy] if copy is not None else []
        )

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Summed token cross-entropy of a (B, T) batch (forward only; 0 off the last stage). Its
        compute time is left out of the training metrics."""
        self.loss.normalizer, self.loss.scale = 1.0, 1.0
        training = self.timer.pop()
        try:
            return self._run(self.schedule.eval, input_ids, labels)
        finally:
            self.timer.pop()
            self.timer.seconds = training

    def metrics(self) -> dict:
        """Per-stage timings since the last call (collective over the pipeline group): per pipeline
        rank, compute seconds per step (``pp_stage_compute_seconds``), the schedule's wall seconds
        per step (``pp_step_seconds``, the slowest rank), the measured ``pp_bubble_fraction`` and the
        schedule's ideal ``pp_bubble_fraction_schedule`` (module docstring)."""
        steps = max(self._steps, 1)
        mine = torch.tensor([self.timer.pop() / steps, self._wall / steps], dtype=torch.float64, device=self.device)
        self._wall, self._steps = 0.0, 0
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.pp_group))]
        dist.all_gather(every, mine, group=self.pp_group)
        compute, wall = [float(t[0]) for t in every], [float(t[1]) for t in every]
        idle = [max(0.0, 1.0 - c / w) if w > 0 else 0.0 for c, w in zip(compute, wall)]
        return {
            "pp_stage_compute_seconds": compute,
            "pp_step_seconds": max(wall),
            "pp_bubble_fraction": sum(idle) / len(idle),
            "pp_bubble_fraction_schedule": self.ideal_bubble,
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's unsharded CPU state dict on global rank 0 ({} elsewhere); collective.

        Each rank gathers its stages over FSDP/TP (``full_state_dict``); then the ranks of rank 0's
        pipeline group send theirs to rank 0 (``gather_object``), which merges them by name."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        full = {k: v.detach().cpu() for k, v in full.items()}
        ranks = dist.get_process_group_ranks(self.pp_group)
        if 0 not in ranks:
            return {}
        parts = [None] * len(ranks) if dist.get_rank() == 0 else None
        dist.gather_object(full, parts, dst=0, group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()} if parts is not None else {}


def schedule_bubble_fraction(name: str, schedule, pp: int, microbatches: int, pp_rank: int) -> float:
    """The schedule's ideal bubble fraction (module docstring); ZBV: the idle share of this rank's
    action list in torch's schedule IR (``pipeline_order``), trailing idle slots dropped."""
    v = STAGES_PER_RANK[name]
    if name != "ZBVZeroBubble":
        return (pp - 1) / (v * microbatches + pp - 1)

    def trimmed(actions: list) -> list:
        while actions and actions[-1] is None:
            actions = actions[:-1]
        return actions

    timelines = {r: trimmed(list(a)) for r, a in schedule.pipeline_order.items()}
    longest = max(len(t) for t in timelines.values())
    return 1.0 - sum(a is not None for a in timelines[pp_rank]) / longest


def build_pipeline(
    model: Transformer,
    dims: parallel.ParallelDims,
    mesh,
    device: torch.device,
    *,
    schedule: str,
    microbatches: int,
    batch_size: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None,
    moe: MoEBalancer | None = None,
) -> Pipeline:
    """Split ``model`` (already on ``device``, TP/AC/compile applied) into this rank's stages, shard
    each with FSDP when data parallel (no resharding between micro-batches), and build the schedule.

    ``microbatches`` per schedule step (0 = ``batch_size``: one window each).
    On CUDA without FSDP, ``autocast_dtype`` runs the stages and the loss under autocast.

    Tied embeddings: the first and the last stage each hold the tensor; their ranks sum its
    gradient (:meth:`Pipeline._sync_tied_grad`) and so stay equal.

    Mixture-of-Experts (``moe``, the run's balancer): the stages keep their sparse layers' router
    logits for the expert load (the ``bias`` update, metrics); the router losses must be off.

    Raises:
        BaigeError: router losses with a coefficient, more stages than layers, a micro-batch count the
        schedule rejects, or tied embeddings under FSDP with ZBVZeroBubble (one rank would hold the
        tensor in two FSDP units).
    """
    cfg = model.config
    if moe is not None and (moe.aux_coef or moe.z_coef):
        raise BaigeError(
            f"pipeline parallel (--pp) trains Mixture-of-Experts models without router losses: set "
            f"moe.router_aux_loss_coef=0 (here {moe.aux_coef}) and moe.router_z_loss_coef=0 (here {moe.z_coef}), "
            "e.g. with moe.load_balance=bias (the load-balancing loss couples the router logits of every stage)"
        )
    v_shape, tied = schedule == "ZBVZeroBubble", model.lm_head.weight is model.model.embed_tokens.weight
    if tied and v_shape and dims.fsdp_enabled:
        raise BaigeError(
            "ZBVZeroBubble with tied embeddings and FSDP is not supported (rank 0 would shard the "
            "tied tensor in two FSDP units): use Interleaved1F1B or 1F1B"
        )
    v = STAGES_PER_RANK[schedule]
    num_stages = dims.pp * v
    ranges = split_layers(cfg.num_hidden_layers, num_stages)
    pp_rank, pp_group = mesh.get_local_rank("pp"), mesh.get_group("pp")
    ids = stage_ids(pp_rank, dims.pp, num_stages, v_shape)
    modules = [StageModule(model, ranges[s], s == 0, s == num_stages - 1, autocast_dtype) for s in ids]
    parts = PipelinedModel(model, modules)
    if dims.fsdp_enabled:
        dp_mesh = parallel.data_parallel_mesh(dims, mesh)
        for m in modules:
            parallel.apply_fsdp(m, dp_mesh, param_dtype, reduce_dtype, reshard_after_forward=False)
        parts.retie()
    timer = ComputeTimer(device)
    stages = [TimedPipelineStage(m, s, num_stages, device, group=pp_group, timer=timer) for m, s in zip(modules, ids)]
    loss = PipelineLoss(next((m for m in modules if m.is_last), None), timer)
    m = microbatches or batch_size
    cls = SCHEDULES[schedule]
    try:
        sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss, scale_grads=False)
    except ValueError as e:  # the schedule's own constraints on m (1F1B: m >= stages; interleaved: rounds)
        reason = " ".join(str(e).split())
        raise BaigeError(
            f"{m} pipeline micro-batches do not fit {schedule} with {num_stages} stages on "
            f"{dims.pp} ranks (parallelism.pipeline_parallel_microbatches): {reason}"
        ) from None
    ideal = schedule_bubble_fraction(schedule, sched, dims.pp, m, pp_rank)
    group = _embedding_group(mesh) if tied and not v_shape else None
    rank_of = {s: q for q in range(dims.pp) for s in stage_ids(q, dims.pp, num_stages, v_shape)}
    layout = " | ".join(f"{r.start}-{r.stop - 1}@{rank_of[s]}" for s, r in enumerate(ranges))
    text = (
        f"pipeline: {schedule}, {num_stages} stages (layers@pp rank: {layout}), {m} micro-batches per "
        f"batch, ideal bubble {ideal:.3f}"
    )
    return Pipeline(sched, stages, loss, parts, pp_group, device, m, ideal, group, text)


def _embedding_group(mesh):
    """This rank's process group of {first stage's rank, last stage's rank} at its data/tensor
    coordinates (None on a middle stage); every rank creates every pair (collective)."""
    grid = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
    pairs = [list(pair) for pair in zip(grid[0].flatten().tolist(), grid[-1].flatten().tolist())]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group
