"""The compressed-tensors checkpoint format: ``quantization_config`` in config.json, load and save.

Spec: compressed-tensors (https://github.com/neuralmagic/compressed-tensors), ``QuantizationConfig``
(``quant_method: "compressed-tensors"``, ``format``, ``config_groups`` of ``{targets, weights}``,
``ignore``, ``quantization_status: "compressed"``) and the per-format tensor names documented in
``quant.py``. vLLM's ``compressed-tensors`` method and transformers' ``CompressedTensorsHfQuantizer``
read this config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from baige.errors import BaigeError
from baige.runtime.config import QuantizeConfig
from baige.runtime.quant import (
    CLIP_KWARGS,
    ProgressFn,
    QuantizedLinear,
    QuantScheme,
    quantize_model,
    set_submodule,
)

REPORT_FILE = "quantization_report.json"
# --method gptq without --clip-search/--no-clip-search: whether group parameters come from the
# Hessian-weighted clip search (README "Quantization (perplexity)" has the measurements)
GPTQ_CLIP_SEARCH_DEFAULT = True


def quantization_config(scheme: QuantScheme, ignored: list[str], clip_search: bool = False) -> dict:
    """The config.json ``quantization_config`` for one scheme applied to every Linear not in
    ``ignored`` (exact module names, e.g. ``["lm_head"]``).

    ``observer`` records how the scales were chosen (compressed-tensors ``QuantizationArgs.observer``,
    free text; loaders ignore it): ``minmax``, or with ``clip_search`` ``mse`` with
    ``observer_kwargs`` ``maxshrink``/``grid``/``norm`` -- llm-compressor's names for the shrink grid
    and error exponent -- plus baige's ``maxexpand`` and ``zero_point_offsets`` (see
    ``quant.search_qparams``; its activation weighting is in the report).
    """
    weights = {
        "num_bits": scheme.num_bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": "channel" if scheme.group_size is None else "group",
        "dynamic": False,
        "actorder": "weight" if scheme.actorder else None,
        "block_structure": None,
        "observer": "mse" if clip_search else "minmax",
        "observer_kwargs": dict(CLIP_KWARGS) if clip_search else {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": scheme.format,
            }
        },
        "ignore": list(ignored),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def _scheme_from_weights(w: dict, where: str) -> QuantScheme:
    if w.get("type", "int") != "int" or w.get("dynamic"):
        raise BaigeError(f"{where}: only static integer weight quantization is supported")
    strategy = w.get("strategy")
    if strategy not in ("channel", "group"):
        raise BaigeError(f"{where}: weight strategy {strategy!r} is not supported (channel, group)")
    return QuantScheme(
        num_bits=int(w["num_bits"]),
        group_size=int(w["group_size"]) if strategy == "group" else None,
        symmetric=bool(w.get("symmetric", True)),
        actorder=w.get("actorder") == "weight",
    )


def _matches(name: str, module: nn.Module, pattern: str) -> bool:
    """compressed-tensors target matching: ``re:<regex>`` on the name, else an exact name or class name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__


def prepare_quantized_model(model: nn.Module, qcfg: dict, where: str = "config.json") -> list[str]:
    """Swap the Linears a ``quantization_config`` targets for empty :class:`QuantizedLinear` modules,
    so that a strict state-dict load fills them (used by ``loader.load_model``, also on meta).

    Returns the swapped module names.
    Raises:
        BaigeError: not compressed-tensors, an unsupported format/scheme, activation quantization,
        or a group that matches no module.
    """
    if qcfg.get("quant_method") != "compressed-tensors":
        raise BaigeError(f"{where}: quantization method {qcfg.get('quant_method')!r} is not supported (compressed-tensors)")
    if qcfg.get("quantization_status", "compressed") != "compressed":
        raise BaigeError(f"{where}: quantization_status {qcfg.get('quantization_status')!r}; baige loads compressed checkpoints")
    ignore = qcfg.get("ignore") or []
    swapped: list[str] = []
    for gname, group in (qcfg.get("config_groups") or {}).items():
        where_g = f"{where}: config_groups.{gname}"
        if group.get("input_activations") or group.get("output_activations"):
            raise BaigeError(f"{where_g}: activation quantization is not supported (weight-only)")
        scheme = _scheme_from_weights(group.get("weights") or {}, where_g)
        fmt = group.get("format") or qcfg.get("format")
        if fmt != scheme.format:
            raise BaigeError(f"{where_g}: format {fmt!r} with int{scheme.num_bits} weights (baige reads {scheme.format})")
        hits = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and any(_matches(name, m, t) for t in group.get("targets", []))
            and not any(_matches(name, m, p) for p in ignore)
        ]
        if not hits:
            raise BaigeError(f"{where_g}: targets {group.get('targets')} match no Linear layer")
        for name, m in hits:
            device = m.weight.device
            q = QuantizedLinear(m.in_features, m.out_features, m.bias is not None, scheme, m.weight.dtype, device)
            set_submodule(model, name, q)
            swapped.append(name)
    return swapped


def save_quantized(
    model: nn.Module,
    scheme: QuantScheme,
    report: list[dict],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
    clip_search: dict | None = None,
) -> Path:
    """Write the quantized model as an HF directory in the compressed-tensors format, with
    ``quantization_report.json`` (the per-layer report) beside the weights. Atomic (temp dir + rename).

    ``clip_search``: how the RTN or GPTQ clip search ran (e.g. ``{"weighting": ..., "calib_data": ...}``),
    written to the report under ``clip_search`` (null: min/max scales) and recorded in config.json
    as the ``mse`` observer.

    Raises:
        BaigeError: ``out_dir`` exists and is not empty.
    """
    from baige.runtime.loader import save_hf_checkpoint

    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    ignored = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in quantized]
    config = dict(model.config.raw)
    config["quantization_config"] = quantization_config(scheme, ignored, clip_search is not None)
    state = {k: v for k, v in model.state_dict().items()}
    summary = {
        "scheme": scheme.describe(),
        "format": scheme.format,
        "clip_search": None if clip_search is None else {**CLIP_KWARGS, **clip_search},
        "layers": report,
        "quantized_bytes": sum(v.numel() * v.element_size() for k, v in state.items() if k.rsplit(".", 1)[0] in quantized),
    }
    return save_hf_checkpoint(
        state, config, out_dir, tokenizer_dir, extra_files={REPORT_FILE: json.dumps(summary, indent=2)}
    )

def calibration_ids(tokenizer, path: str | Path, n_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``n_samples`` windows of ``seq_len`` tokens at random offsets (fixed seed) in a text file,
    as GPTQ's reference code samples its calibration set.

    Returns (n_samples, seq_len) int64. Raises BaigeError: unreadable file, or text shorter than
    ``seq_len + 1`` tokens.
    """
    from baige.runtime.evaluate import read_tokens

    ids = read_tokens(tokenizer, path)
    if len(ids) <= seq_len:
        raise BaigeError(f"{path}: {len(ids)} tokens, fewer than --calib-seq-len {seq_len} + 1")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len, (n_samples,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])  # (n_samples, seq_len)


def quantize_checkpoint(cfg: QuantizeConfig, progress: ProgressFn | None = None) -> tuple[Path, list[dict]]:
    """``baige quantize``: resolve and load the model, quantize it (RTN or GPTQ), save the
    compressed-tensors directory and its report. Returns (output dir, report rows).

    Raises:
        BaigeError: bad method or options, an already quantized model, calibration problems,
        a non-empty output directory (checked before any work).
    """
    from baige.runtime.loader import load_model, resolve_device, resolve_model
    from baige.runtime.tokenizer import Tokenizer

    out = Path(cfg.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BaigeError(f"{out}: already exists and is not empty; choose a new output directory")
    if cfg.method not in ("int8", "int4", "gptq"):
        raise BaigeError(f"unknown method {cfg.method!r} (choose int8, int4, gptq)")
    if cfg.method == "int8":
        if not cfg.symmetric:
            raise BaigeError("int8 is symmetric per output channel; --asymmetric applies to int4 and gptq")
        scheme = QuantScheme(8, None)
    else:
        if cfg.group_size not in (32, 64, 128):
            raise BaigeError(f"--group-size {cfg.group_size}: choose 32, 64 or 128")
        scheme = QuantScheme(4, cfg.group_size, cfg.symmetric, actorder=cfg.act_order and cfg.method == "gptq")
    if cfg.act_order and cfg.method != "gptq":
        raise BaigeError("--act-order applies to --method gptq only")
    if cfg.method == "gptq" and not cfg.calib_data:
        raise BaigeError("--method gptq needs --calib-data FILE (text to calibrate on)")
    # default: on for int4 with calibration text (activation-weighted; unweighted search raised ppl),
    # GPTQ_CLIP_SEARCH_DEFAULT for gptq (Hessian-diagonal-weighted)
    if cfg.clip_search is not None:
        clip = cfg.clip_search
    elif cfg.method == "gptq":
        clip = GPTQ_CLIP_SEARCH_DEFAULT
    else:
        clip = cfg.method == "int4" and bool(cfg.calib_data)

    model_dir = resolve_model(cfg.model)
    model = load_model(model_dir, "auto", resolve_device(cfg.device))
    if model.config.raw.get("quantization_config"):
        raise BaigeError(f"{model_dir}: the model is already quantized")
    calib = None
    if cfg.calib_data and (cfg.method == "gptq" or clip):
        tok = Tokenizer.from_dir(model_dir)
        calib = calibration_ids(tok, cfg.calib_data, cfg.calib_samples, cfg.calib_seq_len)
    method = "gptq" if cfg.method == "gptq" else "rtn"
    report = quantize_model(model, scheme, cfg.ignore, method, calib, progress=progress, clip_search=clip)
    clip_info = None
    if clip and method == "gptq":
        clip_info = {
            "weighting": "GPTQ Hessian diagonal per column, on the error-updated weights of each group",
            "calib_data": str(cfg.calib_data),
            "calib_samples": cfg.calib_samples,
            "calib_seq_len": cfg.calib_seq_len,
        }
    elif clip:
        clip_info = {"weighting": "none (weight-space squared error)"}
        if calib is not None:
            clip_info = {
                "weighting": "mean squared input activation per column",
                "calib_data": str(cfg.calib_data),
                "calib_samples": cfg.calib_samples,
                "calib_seq_len": cfg.calib_seq_len,
            }
    return save_quantized(model, scheme, report, out, model_dir, clip_info), report
