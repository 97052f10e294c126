"""``baige convert``: write an HF-layout directory from a GGUF file or an HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from baige.cli.app import app
from baige.cli.options import DType


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="A .gguf file, an HF directory, an alias or an HF repo id.")],
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist or be empty).")],
    dtype: Annotated[DType, typer.Option(help="Dtype of the written weights; auto keeps the source's.")] = DType.auto,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 500MB, 2GB, 1GiB.")] = "2GB",
) -> None:
    """Convert a checkpoint to an HF directory: config.json, generation_config.json, safetensors (sharded with an index
    past --max-shard-size) and tokenizer files."""
    from rich.console import Console

    from baige.runtime.weights.convert import convert_checkpoint

    written = convert_checkpoint(src, out, dtype.value, max_shard_size)
    Console(stderr=True).print(f"wrote {written}")
