"""LoRA fine-tuning in the Trainer: the adapters as a transformation of the plain model, their FLOPs,
and the two exports (the PEFT adapter directory, and with ``lora.merge`` the merged HF checkpoint).

Applied before the other parallelisms (AC, compile, FSDP2), like torchtitan's model converters, but
after tensor parallelism, whose layout the adapters follow: FSDP2 shards the frozen base with everything else
(its frozen parameters get no gradient and no reduce-scatter) and the adapters train. The
optimizer sees only the adapters; the DCP checkpoint holds only them (``ignore_frozen_params``)
plus the optimizer state.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baige.runtime.model.lora import add_lora, find_targets, lora_dropout, lora_modules
from baige.runtime.train import parallel
from baige.runtime.train.config import LoRASection
from baige.runtime.weights.peft import adapter_config, save_peft_adapter


def apply_lora(model: nn.Module, cfg: LoRASection, seed: int, tp_mesh=None) -> int:
    """Freeze ``model`` and add a rank-``cfg.rank`` adapter on each target (``lora_A`` drawn in module
    order from a ``torch.Generator`` seeded with ``seed``; ``lora_B`` zero). With ``tp_mesh`` (tensor
    parallel) the model is first split by :func:`parallel.apply_tp` and each adapter takes its
    projection's layout (:func:`_shard_adapter`). Returns the number of trainable (adapter) parameters.

    Raises:
        BaigeError: a target absent from the model (:func:`find_targets`), TP-indivisible widths.
    """
    targets = find_targets(model, cfg.targets)
    model.requires_grad_(False)
    if tp_mesh is not None:
        parallel.apply_tp(model, tp_mesh)
    generator = torch.Generator().manual_seed(seed)
    for _, module in targets:
        add_lora(module, cfg.rank, cfg.alpha, cfg.dropout, cfg.use_rslora, generator)
        if tp_mesh is not None:
            _shard_adapter(module, tp_mesh)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _shard_adapter(module: nn.Module, tp_mesh) -> None:
    """Place a TP projection's adapter as DTensors on ``tp_mesh``: column-parallel (weight ``Shard(0)``):
    A replicated, B ``Shard(0)``; row-parallel (``Shard(1)``): A ``Shard(1)``, B replicated. Its
    forward then runs on the local shards (:func:`_tp_lora_term`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    colwise = module.weight.placements[0] == Shard(0)
    placements = ([Replicate()], [Shard(0)]) if colwise else ([Shard(1)], [Replicate()])
    for lin, p in zip((module.lora_A, module.lora_B), placements):
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), tp_mesh, p))
    module.lora_term = functools.partial(_tp_lora_term, module, tp_mesh.get_group(), colwise)


class _AllReduceForward(torch.autograd.Function):
    """Sum over ``group`` in the forward, identity in the backward (Megatron's ``g``, Shoeybi et al. 2019)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tp_lora_term(module: nn.Module, group, colwise: bool, x) -> torch.Tensor:
    """The adapter term of a TP projection on local shards, added to the projection's local output.

    Column-parallel: ``x`` is the replicated input (a DTensor): ``dropout(x) @ A^T @ B_local^T``, the
    local output columns; A's gradient is a partial sum per rank, summed over ``group``, and x's
    gradient is handed back as ``Partial`` (like the projection's own). Row-parallel: ``x`` is
    ``Shard(-1)``: ``x_local @ A_local^T`` is summed over ``group``, then ``@ B^T`` (replicated, so every
    rank computes the same B gradient).
    """
    from torch.distributed.tensor import Partial

    a, b = module.lora_A.weight.to_local(), module.lora_B.weight.to_local()
    if colwise:
        x_local = lora_dropout(module, x.to_local(grad_placements=[Partial()]))
        t = F.linear(x_local, parallel._SumGradOverGroup.apply(a, group))  # (..., r)
    else:
        t = _AllReduceForward.apply(F.linear(lora_dropout(module, x.to_local()), a), group)  # (..., r)
    return F.linear(t, b) * module.lora_scaling


def flops_per_token(model: nn.Module, n_lora: int, seq_len: int) -> int:
    """Training FLOPs per token; with LoRA (``n_lora`` > 0 adapter parameters) and a frozen base:
    ``4 N_frozen + 6 N_lora + 12 L H Q T``, else the model's ``6 N + 12 L H Q T``.

    The ``6 N`` rule (Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1; PaLM appendix B) is 2N for the
    forward and 4N for the backward, half of which is the weight-gradient matmuls. A frozen weight
    needs no weight gradient, only the activation gradient: ``2N + 2N = 4N`` (the same split of a
    weight's backward into an input-gradient and a weight-gradient matmul underlies the FLOP count of
    Narayanan et al. 2021, arXiv:2104.04473).
    The attention term (no weights) is unchanged. N_frozen is the base's non-embedding parameter
    count (active ones for MoE).
    """
    if not n_lora:
        return model.flops_per_token(seq_len)
    c = model.config
    n_frozen = c.num_params(non_embedding=True, active=True)
    return 4 * n_frozen + 6 * n_lora + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len


def train_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, lora: bool, options=None) -> tuple[dict, dict]:
    """``get_state_dict(model, optimizer, options)`` for the DCP checkpoint; with ``lora`` only the
    trained tensors (``options``: a ``StateDictOptions``, default ones when None).

    ``ignore_frozen_params`` drops the frozen base, except the tied ``lm_head.weight``: torch finds the
    frozen parameters through ``named_parameters()``, which names a shared tensor once (as the
    embedding), so its alias stays; the model state is therefore filtered to the trained names.
    """
    import dataclasses

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = dataclasses.replace(options or StateDictOptions(), ignore_frozen_params=lora)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if lora:
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trained}
    return model_sd, optim_sd


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on the CPU, gathered from FSDP shards (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_adapter(
    model: nn.Module,
    cfg: LoRASection,
    base_model: str | None,
    out_dir: Path,
    dtype: torch.dtype,
    is_main: bool,
    full: dict | None = None,
) -> Path | None:
    """Write the PEFT adapter directory ``out_dir`` from rank 0 (collective: gathers the adapters).
    Returns ``out_dir`` on rank 0, None elsewhere."""
    full = _full_state(model) if full is None else full
    if not is_main:
        return None
    weights = {name: (full[f"{name}.lora_A.weight"], full[f"{name}.lora_B.weight"]) for name, _ in lora_modules(model)}
    config = adapter_config(cfg.rank, cfg.alpha, cfg.dropout, cfg.targets, cfg.use_rslora, base_model)
    return save_peft_adapter(weights, config, out_dir, dtype)


def merged_state(model: nn.Module, full: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF state dict of the base with every adapter folded in: ``W + scaling * B @ A`` (fp32
    arithmetic, then ``dtype``), A and B taken from the gathered ``full`` state (right under FSDP). A
    quantized base (QLoRA) is dequantized (its buffers are whole on every rank), so the result is a
    plain float checkpoint (the caller drops ``quantization_config``). Adapter tensors are left out."""
    out = {k: v for k, v in full.items() if ".lora_" not in k}
    for name, module in model.named_modules():
        if hasattr(module, "dequantized_weight"):  # QuantizedLinear: replace the integer layout
            for suffix in ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point"):
                out.pop(f"{name}.{suffix}", None)
            out[f"{name}.weight"] = module.dequantized_weight().detach().float().cpu()
        if hasattr(module, "lora_A"):
            a, b = full[f"{name}.lora_A.weight"].float(), full[f"{name}.lora_B.weight"].float()
            out[f"{name}.weight"] = out[f"{name}.weight"].float() + (b @ a) * module.lora_scaling
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}


def export_merged(
    model: nn.Module,
    config: dict,
    out_dir: Path,
    tokenizer_dir: Path | None,
    dtype: torch.dtype,
    is_main: bool,
    full: dict,
) -> Path | None:
    """Write the merged HF checkpoint from rank 0 with ``save_hf_checkpoint`` (the plain export's writer);
    an existing ``out_dir`` is replaced. Returns ``out_dir`` on rank 0, None elsewhere."""
    import shutil

    from baige.runtime.weights.safetensors_io import save_hf_checkpoint

    if not is_main:
        return None
    state = merged_state(model, full, dtype)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if out_dir.exists():
        shutil.rmtree(out_dir)
    return save_hf_checkpoint(state, config, out_dir, tokenizer_dir)


def export_lora(trainer, dtype: torch.dtype) -> Path | None:
    """The LoRA run's exports (collective): ``<output>/adapter`` (PEFT) and, with ``lora.merge``,
    ``<output>/hf`` (merged). ``trainer``: the :class:`~baige.runtime.train.trainer.Trainer`. Returns
    the adapter directory on rank 0, None elsewhere."""
    cfg, main = trainer.cfg, trainer.dist.is_main
    full = _full_state(trainer.model)
    base = cfg.model.name or str(trainer.model_dir)
    out = export_adapter(trainer.model, cfg.lora, base, trainer.output / "adapter", dtype, main, full)
    if out is not None:
        trainer.log.print(f"exported LoRA adapter (PEFT) to {out}")
    if cfg.lora.merge:
        merged = export_merged(
            trainer.model,
            dict(trainer.model_config.raw),
            trainer.output / "hf",
            trainer.tokenizer_dir,
            dtype,
            main,
            full,
        )
        if merged is not None:
            trainer.log.print(f"exported the merged HF checkpoint to {merged}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out
