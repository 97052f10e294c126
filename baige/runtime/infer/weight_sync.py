"""In-place weight updates of a serving model: what RL drivers call after each optimizer step (vLLM's
``update_weights`` / ``load_weights`` and ``/update_weights_from_disk``, SGLang's
``update_weights_from_tensor``).

Names are state-dict names: HF's, as the loader reads them from safetensors, which are baige's own
``Transformer.state_dict()`` names too, except for routed experts, which baige stacks
(``model.layers.{i}.mlp.experts.gate_up_proj`` (E, 2I, H), ``...experts.down_proj`` (E, H, I); see
``weights/moe_layout.py``). Both forms are accepted: a published per-expert name
(``mlp.experts.{j}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{j}.w1.weight``) writes its
slice of the stack. A tied model's ``lm_head.weight`` is the embedding (either name writes it).

Every tensor is copied into the parameter's own storage (``copy_``: dtype and device converted), so
nothing the model's users hold -- captured CUDA graphs, the native decode table's pointers -- moves; the
copies that are derived from weights (the native CPU decode table's fp32 norms of a bf16 model, joined
biases, permuted q/k) are rebuilt by the caller (``ModelRunner.rebuild_native``). Quantized models are
refused: their projections hold integer codes and scales, not the weights a trainer produces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.transformer import Transformer
from baige.runtime.quant.experts import QuantizedExperts, expert_names
from baige.runtime.quant.fp16_weight import Fp16WeightLinear
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.weights import moe_layout
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import check_state_dict
from baige.runtime.weights.safetensors_io import load_state_dict

# ModelConfig fields that do not shape the weights or the computation: they may differ between the
# served model and the checkpoint its new weights come from
_FREE_FIELDS = {"raw", "torch_dtype", "bos_token_id", "eos_token_id"}


def update_targets(model: Transformer) -> dict[str, torch.Tensor]:
    """Name -> the tensor an update of that name is copied into: every state-dict entry (parameters
    are returned as themselves) plus, for stacked experts, the published per-expert names as views.
    Built on every call: the views must see the parameters' current storage.

    Raises:
        BaigeError: the model is quantized (names the first quantized module).
    """
    for name, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, Fp16WeightLinear, QuantizedExperts)):
            raise BaigeError(
                f"update_weights: {name} is a {type(m).__name__}; in-place weight sync needs an unquantized "
                "model (fp32 / bf16 / fp16 weights): serve the float checkpoint without --quantization"
            )
    targets = dict(model.state_dict(keep_vars=True))
    cfg = model.config
    for i in cfg.moe.sparse_layers if cfg.moe is not None else ():
        hf, (g, u, d) = expert_names(cfg, i)
        mlp = model.model.layers[i].mlp
        targets[f"{hf}gate.weight"] = mlp.gate.weight
        gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
        inter = gate_up.shape[1] // 2
        for j in range(gate_up.shape[0]):
            targets[f"{hf}experts.{j}.{g}.weight"] = gate_up[j, :inter]  # (I, H) views of the stacks
            targets[f"{hf}experts.{j}.{u}.weight"] = gate_up[j, inter:]
            targets[f"{hf}experts.{j}.{d}.weight"] = down[j]  # (H, I)
    return targets


def copy_weights(model: Transformer, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy ``(name, tensor)`` pairs into ``model`` in place; all are checked before any is copied, so a
    bad pair leaves the model as it was. A DTensor (FSDP2 / tensor-parallel training) is gathered whole
    first (``full_tensor``: a collective, so every rank must call this with the same names in the same
    order). Returns the number of tensors copied.

    Raises:
        BaigeError: a quantized model, an item that is not a ``(name, tensor)`` pair (a state dict passed
        whole), a name the model does not have, a value that is not a floating tensor, or a shape that
        differs from the model's (each names the tensor).
    """
    targets = update_targets(model)
    pairs = []
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise BaigeError(
                f"update_weights takes (name, tensor) pairs, such as model.named_parameters() or "
                f"state_dict().items(); got an item {type(item).__name__} {str(item)[:40]!r}"
            )
        name, t = item
        dst = targets.get(name)
        if dst is None:
            raise BaigeError(
                f"update_weights: the model has no tensor {name!r} (state-dict names, such as "
                "model.layers.0.self_attn.q_proj.weight)"
            )
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise BaigeError(f"update_weights: {name}: a floating-point tensor is needed, got {got}")
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if tuple(t.shape) != tuple(dst.shape):
            raise BaigeError(f"update_weights: {name} has shape {tuple(t.shape)}, the model's is {tuple(dst.shape)}")
        pairs.append((dst, t))
    with torch.no_grad():
        for dst, t in pairs:
            dst.copy_(t)
    return len(pairs)


def _mismatch(ours: object, theirs: object, prefix: str = "") -> tuple[str, object, object] | None:
    """The first field (dotted name) in which two configs (dataclasses) differ, with both values."""
    if dataclasses.is_dataclass(ours) and type(ours) is type(theirs):
        for f in dataclasses.fields(ours):
            if f.name not in _FREE_FIELDS:
                found = _mismatch(getattr(ours, f.name), getattr(theirs, f.name), f"{prefix}{f.name}.")
                if found is not None:
                    return found
        return None
    return None if ours == theirs else (prefix.rstrip("."), ours, theirs)


def read_checkpoint(model_path: str, model: Transformer) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``model_path`` (a local HF directory or ``.gguf`` file), in the
    model's dtype and baige's layout, checked to fit ``model`` whole (what
    :meth:`Engine.update_weights_from_disk` copies in). Reads only: safe off the engine's thread.

    Raises:
        BaigeError: a path that does not exist or is not a model, a quantized checkpoint, a config that
        differs from the served model's in a field that shapes the model (named, with both values), or
        a missing, unexpected or mis-shaped tensor (named), a path the file system refuses (too long, an
        unknown ``~user``, no permission).
    """
    try:
        return _read_checkpoint(model_path, model)
    except OSError as e:
        raise _unreadable(model_path, e.strerror or type(e).__name__) from None


def _unreadable(model_path: str, why: str) -> BaigeError:
    shown = model_path if len(model_path) <= 120 else f"{model_path[:117]}..."
    return BaigeError(f"model_path {shown}: cannot be read ({why})", param="model_path")


def _read_checkpoint(model_path: str, model: Transformer) -> dict[str, torch.Tensor]:
    try:
        path = Path(model_path).expanduser()
    except RuntimeError as e:  # ~user of an unknown user
        raise _unreadable(model_path, str(e)) from None
    if not path.exists():
        raise BaigeError(f"model_path {model_path[:120]}: no such directory", param="model_path")
    try:
        model_dir = resolve_model(str(path))
        cfg = ModelConfig.from_file(model_dir / "config.json")
    except BaigeError as e:  # not a model, a broken config.json: the request's model_path is the bad field
        raise BaigeError(str(e), param="model_path") from None
    if cfg.raw.get("quantization_config"):
        raise BaigeError(
            f"{model_dir}: a quantized checkpoint (quantization_config); weight updates read float checkpoints",
            param="model_path",
        )
    found = _mismatch(model.config, cfg)
    if found is not None:
        field, ours, theirs = found
        raise BaigeError(
            f"{model_dir}: {field} is {theirs!r}, the served model's is {ours!r}; "
            "weight updates need the same architecture",
            param="model_path",
        )
    state = moe_layout.to_internal(load_state_dict(model_dir, next(model.parameters()).dtype), cfg, str(model_dir))
    check_state_dict(state, model, model_dir)
    return state
