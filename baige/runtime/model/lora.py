"""LoRA (Hu et al. 2021, arXiv:2106.09685) on the linear projections of the plain Transformer.

A LoRA-capable linear is the model's own projection module (``nn.Linear``, or a ``QuantizedLinear``
for a QLoRA-style frozen int8/int4 base, Dettmers et al. 2023, arXiv:2305.14314) with a forward hook
(:func:`lora_forward_hook`) that adds the adapter's product to the module's output. The module keeps
its class and its parameter names, so the base's state-dict layout does not change
(``model.layers.0.self_attn.q_proj.weight``); the adapter adds PEFT's names beside it
(``...q_proj.lora_A.weight`` (r, in), ``...q_proj.lora_B.weight`` (out, r)).

Two modes, one hook (a parallelism that places the adapter itself, tensor parallel training, sets
``module.lora_term(x)`` and the hook adds that instead of the plain term):

- training (:func:`add_lora`): one adapter, ``y = base(x) + lora_B(lora_A(dropout(x))) * scaling``
  in PEFT's order of operations, autograd through it; only ``lora_A``/``lora_B`` train. Dropout
  applies in train mode with gradients enabled (the trainer's evaluation runs under ``no_grad``).
- serving (:func:`attach_lora_stack`): many adapters stacked and zero-padded to one rank, the
  adapter of every token chosen per step through a shared :class:`LoRABatch`
  (``token_lora_ids``, -1 = none), computed by ``kernels.lora_apply`` (SGMV/BGMV) into the output.

Scaling: ``alpha / r`` (the paper), or rsLoRA's ``alpha / sqrt(r)`` (Kalajdzievski 2023,
arXiv:2312.03732). Init as PEFT's default: ``lora_A`` kaiming-uniform with ``a = sqrt(5)`` (the
``nn.Linear`` default), ``lora_B`` zero, so the adapted model starts equal to the base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.config import LORA_TARGETS  # noqa: F401  (re-exported: the usual targets)


def lora_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """The factor on ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (arXiv:2312.03732)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def is_linear(module: nn.Module) -> bool:
    """A projection LoRA can adapt: ``nn.Linear`` or a weight-only quantized linear (``in_features``,
    ``out_features`` and a ``forward(x) -> (..., out)``)."""
    return isinstance(module, nn.Linear) or (
        hasattr(module, "in_features") and hasattr(module, "out_features") and hasattr(module, "scheme")
    )


def find_targets(model: nn.Module, targets: list[str] | tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every linear whose last name component is in ``targets``, in
    module order (``lm_head`` is never a target: it is not a block projection).

    Raises:
        BaigeError: a target name matching no linear of the model (one line naming it and what exists).
    """
    found = [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] in targets and is_linear(m)]
    for t in targets:
        if not any(n.rpartition(".")[2] == t for n, _ in found):
            present = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if is_linear(m)} - {"lm_head"})
            raise BaigeError(
                f"lora target {t!r} is not a linear module of this model "
                f"({model.config.model_type}: {', '.join(present)})"
            )
    return found


def add_lora(
    module: nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Give ``module`` a trainable adapter, in place: ``lora_A`` = ``nn.Linear(in, rank)``
    (kaiming-uniform, ``a = sqrt(5)``, drawn from ``generator``), ``lora_B`` = ``nn.Linear(rank,
    out)`` (zeros), both without bias, in ``dtype`` on the module's device; ``lora_dropout``
    (``nn.Dropout(dropout)``, ``nn.Identity`` at 0) and the float ``lora_scaling``. The module's own
    parameters are frozen (``requires_grad = False``).

    Raises:
        ValueError: ``rank < 1`` or ``module`` already has an adapter (programming errors; user input is
        checked by the config).
    """
    if rank < 1 or hasattr(module, "lora_A"):
        raise ValueError(f"add_lora: rank {rank} < 1 or {module} already adapted")
    device = next(t for t in (*module.parameters(), *module.buffers())).device
    module.requires_grad_(False)
    a = nn.Linear(module.in_features, rank, bias=False, device="meta").to_empty(device=device).to(dtype)
    b = nn.Linear(rank, module.out_features, bias=False, device="meta").to_empty(device=device).to(dtype)
    with torch.no_grad():
        a.weight.copy_(
            nn.init.kaiming_uniform_(torch.empty_like(a.weight, device="cpu"), a=math.sqrt(5), generator=generator)
        )
        b.weight.zero_()
    module.lora_A, module.lora_B = a, b
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_scaling = lora_scaling(rank, alpha, use_rslora)
    _install_hook(module)


@dataclass
class LoRABatch:
    """Per-step adapter choice shared by every stacked LoRA module of a model (serving): the runner
    sets ``token_lora_ids`` ((N,) int64/int32, the adapter slot of each flattened token, -1 = none)
    before each forward, for the N = B * T tokens the projections see; None = no adapter this step."""

    token_lora_ids: torch.Tensor | None = None


def attach_lora_stack(
    module: nn.Module, lora_a_stack: torch.Tensor, lora_b_stack: torch.Tensor, scalings: torch.Tensor, batch: LoRABatch
) -> None:
    """Serve many adapters on ``module``: ``lora_a_stack`` (L, R_max, in), ``lora_b_stack`` (L, out,
    R_max) in the activations' dtype (adapters of lower rank zero-padded), ``scalings`` (L,) fp32;
    which adapter each token uses is read from ``batch`` at every forward. Replaces an earlier stack.

    Raises:
        ValueError: shapes that do not match the module's in/out features or each other.
    """
    L, r, n_in = lora_a_stack.shape
    if n_in != module.in_features or lora_b_stack.shape != (L, module.out_features, r) or scalings.shape != (L,):
        raise ValueError(
            f"attach_lora_stack: A {tuple(lora_a_stack.shape)}, B {tuple(lora_b_stack.shape)}, "
            f"scalings {tuple(scalings.shape)} do not fit a {module.in_features} -> "
            f"{module.out_features} linear"
        )
    module.lora_stack = (lora_a_stack, lora_b_stack, scalings.float(), batch)
    _install_hook(module)


def _install_hook(module: nn.Module) -> None:
    if getattr(module, "_lora_hook", None) is None:
        module._lora_hook = module.register_forward_hook(lora_forward_hook)


def lora_dropout(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's input dropout: only when gradients are on (not in evaluation passes)."""
    return module.lora_dropout(x) if torch.is_grad_enabled() else x


def lora_forward_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted linear: ``args[0]`` (..., in) input, ``output`` (..., out) the base
    projection; returns the output with the adapter's term added (training adapter and/or the
    serving stack)."""
    x = args[0]
    if hasattr(module, "lora_A"):
        term = getattr(module, "lora_term", None)  # set by a parallelism that places the adapter itself (TP)
        output = output + (
            term(x) if term is not None else module.lora_B(module.lora_A(lora_dropout(module, x))) * module.lora_scaling
        )
    stack = getattr(module, "lora_stack", None)
    if stack is not None and stack[3].token_lora_ids is not None:
        a, b, s, batch = stack
        y = output.reshape(-1, output.shape[-1])  # (N, out); a copy when the output was not contiguous
        output = kernels.lora_apply(y, x.reshape(-1, x.shape[-1]), a, b, s, batch.token_lora_ids).view(output.shape)
    return output


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module with a training adapter, in module order."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and is_linear(m)]


def peft_key(module_name: str, which: str) -> str:
    """PEFT's saved key of an adapter weight: ``base_model.model.<module>.lora_<A|B>.weight``."""
    return f"base_model.model.{module_name}.lora_{which}.weight"


def attach_adapters(
    model: nn.Module,
    adapters: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]],
    batch: LoRABatch,
    dtype: torch.dtype,
) -> None:
    """Serve ``adapters`` on ``model``: slot ``i`` is ``adapters[i]`` (module name -> ``(A (r, in), B
    (out, r), scaling)``, as :func:`baige.runtime.weights.peft.load_peft_adapter` reads them). Every
    module any adapter touches gets a stack (:func:`attach_lora_stack`) zero-padded to the largest
    rank there; an adapter that leaves a module out has zeros in its slot (adds nothing)."""
    modules = dict(model.named_modules())
    L = len(adapters)
    for name in sorted({n for adapter in adapters for n in adapter}):
        m = modules[name]
        device = next(t for t in (*m.parameters(), *m.buffers())).device
        r_max = max(adapter[name][0].shape[0] for adapter in adapters if name in adapter)
        a = torch.zeros(L, r_max, m.in_features, dtype=dtype, device=device)
        b = torch.zeros(L, m.out_features, r_max, dtype=dtype, device=device)
        s = torch.zeros(L, dtype=torch.float32, device=device)
        for i, adapter in enumerate(adapters):
            if name in adapter:
                ai, bi, s[i] = adapter[name]
                a[i, : ai.shape[0]], b[i, :, : ai.shape[0]] = ai, bi
        attach_lora_stack(m, a, b, s, batch)


def detach_adapters(model: nn.Module) -> None:
    """Remove every serving stack from ``model`` (its projections compute the base alone again;
    the hooks stay and cost one attribute check). Training adapters (``lora_A``) are kept."""
    for m in model.modules():
        if getattr(m, "lora_stack", None) is not None:
            m.lora_stack = None
