"""``baige convert``: write an HF-layout directory from a GGUF file or an HF directory, or a GGUF file
(llama.cpp's format) from an HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from baige.cli.app import app
from baige.cli.options import DType


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="A .gguf file, an HF directory, an alias or an HF repo id.")],
    out: Annotated[
        Path, typer.Argument(help="Output directory (must not exist or be empty), or a new file ending in .gguf.")
    ],
    dtype: Annotated[
        DType, typer.Option(help="Dtype of the written weights (GGUF: F32/F16/BF16); auto keeps the source's.")
    ] = DType.auto,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 500MB, 2GB, 1GiB.")] = "2GB",
) -> None:
    """Convert a checkpoint to an HF directory: config.json, generation_config.json, safetensors (sharded with an index
    past --max-shard-size) and tokenizer files; or, with an OUT ending in .gguf, an HF checkpoint to a GGUF file that
    llama.cpp loads (llama, mistral, qwen2, ernie4_5, gemma3_text, deepseek_v3, gpt_oss)."""
    from rich.console import Console

    from baige.runtime.weights.convert import convert_checkpoint

    written = convert_checkpoint(src, out, dtype.value, max_shard_size)
    Console(stderr=True).print(f"wrote {written}")
