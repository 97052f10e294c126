"""Mixture-of-Experts training: the router losses, expert-load statistics and DeepSeek-V3's
auxiliary-loss-free balancing (:class:`MoEBalancer`, one per run, used by the trainer).

Formulas (per step; ``E`` routed experts, ``k`` experts per token, router logits of every sparse
layer concatenated into ``R = L * N`` rows, as transformers' ``load_balancing_loss_func`` does):

- load-balancing loss (Switch Transformers, Fedus et al. 2021, eqs. 4-6; GShard):
  ``E * sum_e f_e * P_e`` with ``f_e = C_e / R`` the fraction of the ``R`` rows whose top-k picks
  expert ``e`` (``C_e`` counts all k slots, so ``sum_e f_e = k``), ``P_e`` the mean softmax
  probability of ``e``; 1.0 per slot when perfectly balanced (``k`` in all);
- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over the ``R`` rows of
  ``logsumexp(logits)^2``;
- auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2412.19437, section 2.1.2): a per-layer,
  per-expert bias ``b`` added to the routing probabilities for the top-k *selection* only (the
  weights stay the unbiased probabilities), updated after every optimizer step by
  ``b_e += rate * sign(mean_e(load) - load_e)`` with ``load_e`` the tokens that layer sent to ``e``
  in the whole step (every micro-batch, every data-parallel rank).

Normalisation over data parallelism is exact: ``C_e`` and ``R`` are summed over the data-parallel
ranks of each micro-batch (one all-reduce of ``(L + 1) * E + 1`` numbers) before the loss is
formed, so each rank's term is its share of the loss of the global micro-batch and the ranks'
terms sum to the one-process value. Over gradient accumulation the balance loss, like the
product of two batch means it is, is that of each global micro-batch (the windows of every rank at
one accumulation index), averaged over the ``grad_accum`` micro-batches (HF Trainer's behaviour
for Mixtral); the z-loss is a plain token mean and exact over the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.train.config import MoESection


class RouterLogits:
    """What ``Transformer.forward(router_logits=...)`` appends each sparse layer's (N, E) logits to.

    Not a list: FSDP2's forward-input casting rebuilds lists, tuples and dicts (even subclasses),
    so the model would append to a copy; this object passes through every wrapper as itself.
    Activation checkpointing's recompute appends again during backward; readers take the first
    ``num_layers`` entries.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def append(self, logits: torch.Tensor) -> None:
        self.tensors.append(logits)


def balance_statistics(router_logits: Sequence[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-expert top-k counts ``C`` (E,) fp32 (no gradient), probability sums ``S`` (E,) fp32
    (differentiable) and the row count ``R`` over all layers' (N, E) logits (any float dtype)."""
    counts = prob_sum = None
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)  # (N, E) in the logits' dtype (HF's order of operations)
        ids = torch.topk(probs.detach(), top_k, dim=-1).indices  # (N, k)
        c = torch.bincount(ids.reshape(-1), minlength=logits.shape[-1]).float()  # (E,)
        s = probs.float().sum(0)  # (E,)
        counts, prob_sum = (c, s) if counts is None else (counts + c, prob_sum + s)
        rows += logits.shape[0]
    return counts, prob_sum, rows


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func(tuple(router_logits), num_experts, top_k)`` with no
    attention mask (see the module docstring): () fp32, 1 per selected slot when balanced."""
    counts, prob_sum, rows = balance_statistics(router_logits, top_k)
    return num_experts * torch.sum(counts / rows * (prob_sum / rows))


def router_z_loss(router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over every layer's rows of ``logsumexp(logits)^2``, () fp32."""
    total = sum(torch.logsumexp(x.float(), dim=-1).square().sum() for x in router_logits)
    return total / sum(x.shape[0] for x in router_logits)


def load_stats(load: torch.Tensor) -> dict[str, list[float]]:
    """Expert load per layer from tokens per expert ``load`` (L, E): ``max / mean`` (1 = balanced,
    ``E / k`` at worst) and the coefficient of variation ``std / mean`` (population std, 0 = balanced)."""
    mean = load.mean(1).clamp(min=1e-12)
    return {
        "expert_load_max_mean": (load.max(1).values / mean).tolist(),
        "expert_load_cv": (load.std(1, correction=0) / mean).tolist(),
    }


class SelectionBias(nn.Module):
    """The routing-selection bias for families without one of their own: ``e_score_correction_bias``
    (1, E) fp32, a non-persistent buffer, so the model's state dict (and its HF export) is unchanged.
    Installed as the block's ``moe_statics``, which ``SparseMoeBlock.route`` adds to the
    probabilities for the top-k choice (ERNIE-4.5's rule, DeepSeek-V3's bias)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(1, num_experts), persistent=False)


def _add_(t: torch.Tensor, delta: torch.Tensor) -> None:
    """``t += delta`` for a plain tensor or a DTensor (an FSDP-sharded ERNIE bias); ``delta`` full."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(t, DTensor):
        t.add_(distribute_tensor(delta.to(t.dtype), t.device_mesh, t.placements))
    else:
        t.add_(delta.to(t.device, t.dtype))


class MoEBalancer:
    """The run's MoE terms: router losses per micro-batch, expert load per step, bias updates.

    Build it on the plain model before the parallelisms (it may install :class:`SelectionBias`
    modules); call :meth:`micro_batch_loss` after each forward, :meth:`end_step` after each
    optimizer step.
    """

    def __init__(
        self, model: nn.Module, cfg: MoESection, grad_accum: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
    ):
        """``all_reduce``: sums a fp64 tensor over the data-parallel ranks and the pipeline stages (the
        world sum / the TP degree: TP ranks hold the same statistics, pipeline stages disjoint layers)."""
        m = model.config.moe
        self.layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        self.blocks = [model.model.layers[i].mlp for i in self.layers]
        self.num_experts, self.top_k, self.grad_accum, self.all_reduce = m.num_experts, m.top_k, grad_accum, all_reduce
        self.bias_mode = cfg.load_balance == "bias"
        default = 0.0 if self.bias_mode else m.router_aux_loss_coef
        self.aux_coef = default if cfg.router_aux_loss_coef is None else cfg.router_aux_loss_coef
        self.z_coef, self.rate = cfg.router_z_loss_coef, cfg.bias_update_rate
        self.own_bias = m.correction_bias  # ERNIE-4.5 / DeepSeek-V3: selection already biased by their own
        if self.bias_mode and m.routing is not None and not m.correction_bias:
            raise BaigeError(
                f"moe.load_balance=bias: {model.config.model_type}'s router has no selection bias to train"
            )
        if self.bias_mode and not self.own_bias:
            for block in self.blocks:
                block.moe_statics = SelectionBias(self.num_experts)
        shape = (len(self.blocks), self.num_experts)
        self.step_load = torch.zeros(shape, dtype=torch.float64)  # tokens per expert, this step (global)
        self.window_load = torch.zeros(shape, dtype=torch.float64)  # since the last metrics record
        self._aux = self._z = 0.0  # this rank's share of the step's values

    def _selection_bias(self, j: int) -> torch.Tensor | None:
        """Layer ``j``'s whole selection bias (an FSDP-sharded one gathered): ERNIE's / the installed
        :class:`SelectionBias` (1, E), DeepSeek's ``gate.e_score_correction_bias`` (E,); None without."""
        block = self.blocks[j]
        if block.routing is not None:
            bias = block.gate.e_score_correction_bias
        else:
            bias = None if block.moe_statics is None else block.moe_statics.e_score_correction_bias
        if bias is None:
            return None
        return bias.full_tensor() if hasattr(bias, "full_tensor") else bias

    def micro_batch_loss(self, router_logits: RouterLogits) -> torch.Tensor:
        """The router terms of one micro-batch to add to its loss (before the trainer's data-parallel
        factor): ``(aux_coef * aux + z_coef * z) / grad_accum``, this rank's share. Collective.

        Args:
            router_logits: each sparse layer's (N, E) logits of this rank's micro-batch, layer order.
        Returns:
            () fp32, differentiable w.r.t. the logits (zero without gradient when both coefficients are 0).
        """
        logits = router_logits.tensors[: len(self.blocks)]
        if not (self.aux_coef or self.z_coef):  # measured for the metrics only
            logits = [x.detach() for x in logits]
        aux, z = self._observe(list(enumerate(logits)))
        return (self.aux_coef * aux + self.z_coef * z) / self.grad_accum

    def observe_stages(self, logits_by_layer: dict[int, torch.Tensor]) -> None:
        """Pipeline parallel: the statistics of one micro-batch from the sparse layers this rank's
        stages hold (``{model layer index: (N, E) detached logits}``, possibly empty): the expert load
        for the bias update and the ``aux_loss`` / ``z_loss`` metrics, no gradient (the pipeline runs
        only with both coefficients 0). Collective; the all-reduce sums over the data-parallel ranks
        and the stages, whose layers are disjoint, so the values are the one-process ones."""
        self._observe([(self.layers.index(i), x.detach()) for i, x in sorted(logits_by_layer.items())])

    def _observe(self, pairs: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate one micro-batch's expert load (chosen experts, selection bias included) from
        ``(block position, (N, E) logits)`` pairs; returns this rank's shares of ``(aux, z)``, () fp32
        (differentiable w.r.t. the logits that carry gradient). Collective (one all-reduce)."""
        logits = [x for _, x in pairs]
        if logits:
            counts, prob_sum, rows = balance_statistics(logits, self.top_k)
        else:  # a pipeline rank whose stages hold no sparse layer
            counts, prob_sum, rows = torch.zeros(self.num_experts), torch.zeros(self.num_experts), 0
        with torch.no_grad():  # the experts actually chosen (bias included) per layer
            chosen = torch.zeros(self.step_load.shape, dtype=torch.float64, device=counts.device)
            for j, x in pairs:
                if self.blocks[j].routing is not None:  # DeepSeek's group-limited rule
                    ids = self.blocks[j].topk(x.detach(), self._selection_bias(j))[1]
                else:
                    scores, bias = torch.softmax(x.detach().float(), dim=-1), self._selection_bias(j)
                    ids = torch.topk(scores if bias is None else scores + bias, self.top_k, dim=-1).indices
                chosen[j] = torch.bincount(ids.reshape(-1), minlength=self.num_experts).to(chosen)
            local = torch.cat(
                [
                    chosen.reshape(-1),
                    counts.double(),
                    torch.tensor([float(rows)], dtype=torch.float64, device=counts.device),
                ]
            )
            total = self.all_reduce(local).cpu()
        n_load = self.step_load.numel()
        self.step_load += total[:n_load].view_as(self.step_load)
        global_counts, global_rows = total[n_load:-1], float(total[-1])
        f = (global_counts / global_rows).to(prob_sum.device, torch.float32)  # (E,) fraction of rows per expert
        aux = self.num_experts * torch.sum(f * (prob_sum / global_rows))  # this rank's share
        z = sum((torch.logsumexp(x.float(), dim=-1).square().sum() for x in logits), torch.zeros(())) / global_rows
        self._aux += aux.item() / self.grad_accum
        self._z += z.item() / self.grad_accum
        return aux, z

    def step_values(self) -> list[float]:
        """This rank's shares of the step's ``[aux_loss, z_loss]`` (sum them over the ranks); resets."""
        values, self._aux, self._z = [self._aux, self._z], 0.0, 0.0
        return values

    @torch.no_grad()
    def end_step(self) -> None:
        """After the optimizer step: the bias update (``bias`` mode) from this step's global load."""
        if self.bias_mode:
            for j, block in enumerate(self.blocks):
                load = self.step_load[j]
                delta = self.rate * torch.sign(load.mean() - load)  # (E,) fp64
                bias = (
                    block.moe_statics.e_score_correction_bias
                    if block.routing is None
                    else block.gate.e_score_correction_bias
                )
                _add_(bias, delta.float().view(bias.shape))
        self.window_load += self.step_load
        self.step_load.zero_()

    def metrics(self) -> dict[str, list[float] | list[int]]:
        """Expert load since the previous call (:func:`load_stats`) and the sparse layers' indices."""
        stats = load_stats(self.window_load)
        self.window_load.zero_()
        return {"moe_layers": self.layers, **stats}

    # ---- checkpoint: the selection biases (ERNIE's own is a model parameter) ----------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"expert_bias": (L, E) fp32}`` -- zeros without ``bias`` mode, so either mode resumes the
        other's checkpoints; empty for ERNIE-4.5 (its bias is in the model's state dict)."""
        if self.own_bias:
            return {}
        if not self.bias_mode:
            return {"expert_bias": torch.zeros(len(self.blocks), self.num_experts)}
        return {"expert_bias": torch.cat([b.moe_statics.e_score_correction_bias for b in self.blocks]).cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.bias_mode and not self.own_bias:
            for block, row in zip(self.blocks, state["expert_bias"]):
                block.moe_statics.e_score_correction_bias.copy_(row.view(1, -1))
