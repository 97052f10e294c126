"""``baige quantize``: load a checkpoint, quantize it (RTN or GPTQ), write a compressed-tensors
HF directory with its per-layer report."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.config import QuantizeConfig
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import checkpoint_dtype, resolve_device
from baige.runtime.model.tokenizer import Tokenizer, read_tokens
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.format import quantized_checkpoint
from baige.runtime.quant.scheme import ProgressFn, QuantScheme
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import save_hf_checkpoint

# --method gptq without --clip-search/--no-clip-search: whether group parameters come from the
# Hessian-weighted clip search (docs/benchmarks/archive.md, "Quantization (perplexity)", has the measurements)
GPTQ_CLIP_SEARCH_DEFAULT = True


def save_quantized(
    model: nn.Module,
    scheme: QuantScheme,
    report: list[dict],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
    clip_search: dict | None = None,
) -> Path:
    """Write the quantized model as an HF directory in the compressed-tensors format, with
    ``quantization_report.json`` beside the weights (see :func:`quant.format.quantized_checkpoint`).
    Atomic (temp dir + rename).

    Raises:
        BaigeError: ``out_dir`` exists and is not empty.
    """
    state, config, extra = quantized_checkpoint(model, scheme, report, clip_search)
    return save_hf_checkpoint(state, config, out_dir, tokenizer_dir, extra_files=extra)


def calibration_ids(tokenizer, path: str | Path, n_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``n_samples`` windows of ``seq_len`` tokens at random offsets (fixed seed) in a text file,
    as GPTQ's reference code samples its calibration set.

    Returns (n_samples, seq_len) int64. Raises BaigeError: unreadable file, or text shorter than
    ``seq_len + 1`` tokens.
    """
    ids = read_tokens(tokenizer, path)
    if len(ids) <= seq_len:
        raise BaigeError(f"{path}: {len(ids)} tokens, fewer than --calib-seq-len {seq_len} + 1")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len, (n_samples,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])  # (n_samples, seq_len)


def scheme_for(cfg: QuantizeConfig) -> QuantScheme:
    """The weight scheme ``cfg`` asks for (``QuantizeConfig`` has checked that the options fit the method)."""
    if cfg.method == "int8":
        return QuantScheme(8, None)
    return QuantScheme(4, cfg.group_size, cfg.symmetric, actorder=cfg.act_order and cfg.method == "gptq")


def clip_search_on(cfg: QuantizeConfig) -> bool:
    """Whether the clip search runs: as asked; by default on for int4 with calibration text
    (activation-weighted; the unweighted search raised perplexity) and GPTQ_CLIP_SEARCH_DEFAULT for gptq."""
    if cfg.clip_search is not None:
        return cfg.clip_search
    if cfg.method == "gptq":
        return GPTQ_CLIP_SEARCH_DEFAULT
    return cfg.method == "int4" and bool(cfg.calib_data)


def _clip_info(cfg: QuantizeConfig, clip: bool, calibrated: bool) -> dict | None:
    """The report's record of how the clip search was weighted (None: min/max scales)."""
    if not clip:
        return None
    calib = {"calib_data": str(cfg.calib_data), "calib_samples": cfg.calib_samples, "calib_seq_len": cfg.calib_seq_len}
    if cfg.method == "gptq":
        return {"weighting": "GPTQ Hessian diagonal per column, on the error-updated weights of each group", **calib}
    if calibrated:
        return {"weighting": "mean squared input activation per column", **calib}
    return {"weighting": "none (weight-space squared error)"}


def quantize_checkpoint(cfg: QuantizeConfig, progress: ProgressFn | None = None) -> tuple[Path, list[dict]]:
    """``baige quantize``: resolve and load the model, quantize it (RTN or GPTQ), save the
    compressed-tensors directory and its report. Returns (output dir, report rows).

    Raises:
        BaigeError: an already quantized model, calibration problems (``QuantizeConfig`` checked the
        options and the output directory before any work).
    """
    out = Path(cfg.output)
    scheme = scheme_for(cfg)
    clip = clip_search_on(cfg)
    model_dir = resolve_model(cfg.model)
    # the checkpoint's own dtype (not the CPU's inference choice): what the output keeps unquantized
    model = load_model(
        model_dir, checkpoint_dtype(ModelConfig.from_file(model_dir / "config.json")), resolve_device(cfg.device)
    )
    if model.config.raw.get("quantization_config"):
        raise BaigeError(f"{model_dir}: the model is already quantized")
    calib = None
    if cfg.calib_data and (cfg.method == "gptq" or clip):
        calib = calibration_ids(Tokenizer.from_dir(model_dir), cfg.calib_data, cfg.calib_samples, cfg.calib_seq_len)
    method = "gptq" if cfg.method == "gptq" else "rtn"
    report = quantize_model(model, scheme, cfg.ignore, method, calib, progress=progress, clip_search=clip)
    return save_quantized(model, scheme, report, out, model_dir, _clip_info(cfg, clip, calib is not None)), report
