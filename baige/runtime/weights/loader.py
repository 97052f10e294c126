"""Strict loading of an HF checkpoint into the one :class:`Transformer` (built on the meta device,
tensors assigned without copies, gpt-fast style)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import resolve_dtype
from baige.runtime.model.rope import RotaryEmbedding
from baige.runtime.model.transformer import Transformer
from baige.runtime.quant.format import prepare_quantized_model
from baige.runtime.weights import moe_layout
from baige.runtime.weights.safetensors_io import load_state_dict


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    pooling: bool = False,
) -> Transformer:
    """Build a :class:`Transformer` on the meta device and assign the checkpoint's tensors (strict).

    ``dtype`` auto: on the CPU bf16 where the CPU has native bf16, else fp32; on CUDA the checkpoint's
    (:func:`baige.runtime.model.device.resolve_dtype`).

    Every checkpoint tensor must be consumed and every parameter loaded. A config.json with a
    compressed-tensors ``quantization_config`` loads its Linears as ``QuantizedLinear``
    (see :func:`baige.runtime.quant.format.prepare_quantized_model`); integer tensors keep their dtype.

    ``pooling`` (the engine's pooling runner, which never computes logits): a bare-decoder checkpoint
    (transformers' ``LlamaModel``, ``Qwen3Model``, ...: tensor names without the ``model.`` prefix) loads
    too, and a checkpoint without ``lm_head.weight`` gets the embedding as its (unused) head.

    Raises:
        BaigeError: bad config, missing shard/tensor, unexpected tensor, shape mismatch, an untied
        model without ``lm_head.weight``.
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    state = load_state_dict(model_dir, torch_dtype)
    if pooling:
        if not any(k.startswith("model.") for k in state):
            state = {f"model.{k}": v for k, v in state.items()}
        if "lm_head.weight" not in state:
            cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    state = moe_layout.to_internal(state, cfg, str(model_dir))
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.raw.get("quantization_config"):
        prepare_quantized_model(model, cfg.raw["quantization_config"], str(model_dir / "config.json"))
    check_state_dict(state, model, model_dir)
    state = {k: v.to(device) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.rotary_emb = RotaryEmbedding(cfg).to(device)  # its buffer was built on meta
    return model.eval()


def check_state_dict(state: dict[str, torch.Tensor], model: Transformer, where: str | Path) -> None:
    """Check that ``state`` (baige's layout: :func:`moe_layout.to_internal` applied) holds exactly the
    tensors of ``model``, each of the model's shape; a tied model's ``lm_head.weight`` is dropped from
    ``state`` (in place), as tied checkpoints usually omit it and, when present, it duplicates the
    embedding.

    Raises:
        BaigeError: naming ``where`` and the first missing, mis-shaped or unexpected tensor, or an untied
        model without ``lm_head.weight``.
    """
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    elif "lm_head.weight" not in state:
        raise BaigeError(f"{where}: untied model (tie_word_embeddings=false) but no lm_head.weight in the checkpoint")
    for name, ref in expected.items():
        if name not in state:
            raise BaigeError(f"{where}: tensor {name!r} missing from the checkpoint")
        if tuple(state[name].shape) != tuple(ref.shape):
            raise BaigeError(
                f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, config expects {tuple(ref.shape)}"
            )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise BaigeError(f"{where}: unexpected tensor {unexpected[0]!r} in the checkpoint ({len(unexpected)} in all)")
