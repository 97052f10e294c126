"""``baige eval ppl`` and ``baige eval compare``: perplexity, KL divergence, top-1 agreement."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.app import app
from baige.cli.options import MODEL_HELP, Device, DType, progress_bar
from baige.runtime.config import EvalConfig

eval_app = typer.Typer(
    help="Measure a model on text: perplexity, and agreement between two models.", no_args_is_help=True
)
app.add_typer(eval_app, name="eval")

DataOpt = Annotated[Path, typer.Option(help="UTF-8 text file (e.g. wikitext-2-raw test).")]
SeqLenOpt = Annotated[int, typer.Option(min=2, help="Tokens per non-overlapping window.")]
MaxTokensOpt = Annotated[Optional[int], typer.Option(min=2, help="Use only the first N tokens of the file.")]
OutputOpt = Annotated[
    Optional[Path], typer.Option(help="Also write the JSON result to this file (its directory is created).")
]


def _run(fn, cfg: EvalConfig) -> dict:
    import json

    with progress_bar("windows") as update:
        result = fn(cfg, update)
    text = json.dumps(result, indent=2)
    if cfg.output is not None:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(text + "\n")
    print(text)
    return result


@eval_app.command("ppl")
def ppl(
    data: DataOpt,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    seq_len: SeqLenOpt = 1024,
    max_tokens: MaxTokensOpt = None,
    dtype: Annotated[DType, typer.Option(help="Weights dtype; auto = the checkpoint's torch_dtype.")] = DType.auto,
    device: Annotated[Device, typer.Option(help="auto = cuda when available, else cpu.")] = Device.auto,
    output: OutputOpt = None,
) -> None:
    """Token-level perplexity over non-overlapping --seq-len windows of the first --max-tokens tokens
    (HF's perplexity guide with stride = window). Prints JSON."""
    from baige.runtime.evaluate import evaluate_ppl

    cfg = EvalConfig(
        [model], str(data), seq_len, max_tokens, dtype.value, device.value, str(output) if output else None
    )
    _run(evaluate_ppl, cfg)


@eval_app.command("compare")
def compare(
    model_a: Annotated[str, typer.Argument(help="Reference model (" + MODEL_HELP + ")")],
    model_b: Annotated[str, typer.Argument(help="Model compared against A, e.g. its quantized directory.")],
    data: DataOpt,
    seq_len: SeqLenOpt = 1024,
    max_tokens: MaxTokensOpt = None,
    dtype: Annotated[DType, typer.Option(help="Weights dtype; auto = each checkpoint's torch_dtype.")] = DType.auto,
    device: Annotated[Device, typer.Option(help="auto = cuda when available, else cpu.")] = Device.auto,
    output: OutputOpt = None,
) -> None:
    """Perplexity of A and B, mean KL(P_A || P_B) of next-token distributions (nats) and top-1
    agreement, on the same windows. Prints JSON."""
    from baige.runtime.evaluate import evaluate_compare

    cfg = EvalConfig(
        [model_a, model_b], str(data), seq_len, max_tokens, dtype.value, device.value, str(output) if output else None
    )
    _run(evaluate_compare, cfg)
