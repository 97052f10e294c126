"""Checkpoint conversion (``baige convert``): GGUF or HF directory -> HF directory; HF directory -> GGUF
(an OUT ending in ``.gguf``: :mod:`baige.runtime.weights.gguf_export`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.config import check_output_path, parse_size
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import checkpoint_dtype
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import save_hf_checkpoint


def convert_checkpoint(src: str, out: str | Path, dtype: str = "auto", max_shard_size: str = "2GB") -> Path:
    """Write ``out`` as an HF directory from ``src`` (any model spec; a .gguf is imported directly).

    The source goes through the same strict load as ``baige generate``, so only a checkpoint that
    baige can run is written. Raises BaigeError for bad input, a bad ``max_shard_size`` or an ``out`` that exists and
    is not
    empty (or cannot be created).
    """
    out = Path(out)
    if out.name.lower().endswith(".gguf"):
        return convert_to_gguf(src, out, dtype)
    check_output_path("OUT", out, "new dir")
    shard_bytes = parse_size(max_shard_size, "--max-shard-size")
    if shard_bytes < 1:
        raise BaigeError(f"--max-shard-size {max_shard_size!r} must be at least 1 byte (e.g. 2GB)")
    with tempfile.TemporaryDirectory() as tmp:
        if src.lower().endswith(".gguf"):
            from baige.runtime.weights.gguf_import import import_gguf

            if not Path(src).is_file():
                raise BaigeError(f"{src}: GGUF file not found")
            src_dir = import_gguf(src, Path(tmp) / "imported")
        else:
            src_dir = resolve_model(src)
        keep = checkpoint_dtype(ModelConfig.from_file(Path(src_dir) / "config.json"))
        model = load_model(src_dir, keep if dtype in (None, "auto") else dtype)  # auto: the checkpoint's own
        return save_hf_checkpoint(model.state_dict(), model.config.raw, out, src_dir, shard_bytes)


def convert_to_gguf(src: str, out: Path, dtype: str = "auto") -> Path:
    """Write the HF checkpoint ``src`` (a directory, alias or repo id) as the GGUF file ``out``
    (:func:`~baige.runtime.weights.gguf_export.export_gguf`). Raises BaigeError: a GGUF source, an ``out``
    that exists or cannot be written, a family or field llama.cpp cannot take."""
    from baige.runtime.weights.gguf_export import export_gguf

    check_output_path("OUT", out, "file")
    if src.lower().endswith(".gguf"):
        raise BaigeError(f"{src}: already a GGUF file (convert writes a GGUF from an HF checkpoint)")
    src_dir = Path(resolve_model(src))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BaigeError(f"OUT {out}: cannot create its directory ({e.strerror})") from None
    return export_gguf(src_dir, out, dtype)
