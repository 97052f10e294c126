"""Strict loading of an HF checkpoint into the one :class:`Transformer` (built on the meta device,
tensors assigned without copies, gpt-fast style)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import resolve_dtype
from baige.runtime.model.rope import rotary_embedding
from baige.runtime.model.transformer import Transformer
from baige.runtime.quant.format import prepare_quantized_model
from baige.runtime.weights import gpt_oss_layout, moe_layout, mtp_layout
from baige.runtime.weights.safetensors_io import checkpoint_headers, load_state_dict
from baige.runtime.weights.validate import check_config_fits, check_fits, check_layer_count, loaded_bytes, meta_state


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

    DeepSeek-V3's MTP modules (``num_nextn_predict_layers``) load as ``model.mtp``
    (:mod:`baige.runtime.weights.mtp_layout`); a checkpoint whose config declares them but that holds
    none of their tensors loads without them (``mtp_depth`` 0).

    ``pooling`` (the engine's pooling runner, which never computes logits): a bare-decoder checkpoint
    (transformers' ``LlamaModel``, ``Qwen3Model``, ...: tensor names without the ``model.`` prefix) loads
    too, and a checkpoint without ``lm_head.weight`` gets the embedding as its (unused) head.

    Before any tensor is read or the model allocated: config.json is checked
    (:func:`~baige.runtime.model.config_checks.check_config_fields`), the parameters it declares and
    the bytes the headers declare against the memory free on the CPU and ``device``, every safetensors
    header against the format, and the layer count, tensor names and shapes against the config
    (:mod:`baige.runtime.weights.validate`).

    Raises:
        BaigeError: bad config, a model larger than the memory free, a bad safetensors header or
        index, missing shard/tensor, unexpected tensor, shape mismatch, an untied model without
        ``lm_head.weight``.
    """
    model_dir = Path(model_dir)
    cfg = gpt_oss_layout.dense_config(ModelConfig.from_file(model_dir / "config.json"))  # MXFP4: dequantized
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    devices = [torch.device("cpu"), device]  # tensors are read into CPU memory, then moved
    check_config_fits(cfg, torch_dtype, devices, model_dir / "config.json")
    headers = checkpoint_headers(model_dir)
    if pooling:
        headers = _decoder_names(headers)
        if "lm_head.weight" not in headers:
            cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    if cfg.mtp_depth and not mtp_layout.has_mtp(headers, cfg):
        cfg = dataclasses.replace(cfg, mtp_depth=0)  # published without its MTP layers: the main model only
    headers = mtp_layout.to_internal(headers, cfg, str(model_dir))
    check_layer_count(list(headers), cfg, model_dir)
    check_fits(loaded_bytes(headers, torch_dtype), devices, f"{model_dir}: loading the checkpoint")
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.raw.get("quantization_config"):
        prepare_quantized_model(model, cfg.raw["quantization_config"], str(model_dir / "config.json"))
    # names, shapes and expert layout checked on meta tensors from the headers: nothing read yet
    check_state_dict(moe_layout.to_internal(meta_state(headers), cfg, str(model_dir)), model, model_dir)
    state = load_state_dict(model_dir, torch_dtype)
    state = mtp_layout.to_internal(state, cfg, str(model_dir))
    state = moe_layout.to_internal(_decoder_names(state) if pooling else state, cfg, str(model_dir))
    check_state_dict(state, model, model_dir)
    state = {k: v.to(device) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.rotary_emb = rotary_embedding(cfg).to(device)  # its buffer was built on meta
    return model.eval()


def _decoder_names(named: dict) -> dict:
    """A bare decoder's tensor names (transformers' ``LlamaModel``: no ``model.`` prefix) as the causal
    LM's; names that already have the prefix stay."""
    if any(k.startswith("model.") for k in named):
        return named
    return {f"model.{k}": v for k, v in named.items()}


def check_state_dict(state: dict[str, torch.Tensor], model: Transformer, where: str | Path) -> None:
    """Check that ``state`` (baige's layout: :func:`moe_layout.to_internal` applied) holds exactly the
    tensors of ``model``, each of the model's shape; a tied model's ``lm_head.weight`` is dropped from
    ``state`` (in place), as tied checkpoints usually omit it and, when present, it duplicates the
    embedding.

    Raises:
        BaigeError: naming ``where`` and the first missing, mis-shaped or unexpected tensor, one that is
        integer where the model holds floats (or the reverse), or an untied model without ``lm_head.weight``.
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
        if state[name].dtype.is_floating_point != ref.dtype.is_floating_point:
            kind = "a floating-point" if ref.dtype.is_floating_point else f"an integer ({ref.dtype})"
            got = str(state[name].dtype).removeprefix("torch.")
            raise BaigeError(f"{where}: tensor {name!r} is {got}, the model expects {kind} tensor")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise BaigeError(f"{where}: unexpected tensor {unexpected[0]!r} in the checkpoint ({len(unexpected)} in all)")
