"""``baige quantize``: weight-only int8 / int4 / GPTQ, saved in the compressed-tensors format."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.app import app
from baige.cli.options import MODEL_HELP, Device, progress_bar
from baige.runtime.config import QuantizeConfig


class Method(str, Enum):
    int8 = "int8"
    int4 = "int4"
    gptq = "gptq"


@app.command()
def quantize(
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory (must not exist or be empty).")],
    method: Annotated[
        Method,
        typer.Option(help="int8: symmetric per channel; int4: group-wise round to nearest; gptq: int4 with GPTQ."),
    ],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    group_size: Annotated[int, typer.Option(help="int4/gptq: input columns per scale (32, 64, 128).")] = 128,
    symmetric: Annotated[bool, typer.Option("--symmetric/--asymmetric", help="int4/gptq: zero point or not.")] = True,
    act_order: Annotated[
        bool, typer.Option("--act-order/--no-act-order", help="gptq: visit columns by decreasing Hessian diagonal.")
    ] = False,
    calib_data: Annotated[
        Optional[Path],
        typer.Option(
            help="UTF-8 text file to calibrate on: gptq's Hessians and the clip search's "
            "activation weighting. int8 reads it only with --clip-search (its default "
            "scales are per-channel min/max)."
        ),
    ] = None,
    calib_samples: Annotated[
        int,
        typer.Option(
            min=1,
            help="gptq / clip search: calibration windows (the int4 "
            "clip search needs dozens; from 8 its result varies by sample).",
        ),
    ] = 128,
    calib_seq_len: Annotated[int, typer.Option(min=2, help="gptq / clip search: tokens per calibration window.")] = 512,
    clip_search: Annotated[
        Optional[bool],
        typer.Option(
            "--clip-search/--no-clip-search",
            help="int4/int8 round to nearest: per group, scale the range (x1.0 down to x0.525, up to x1.1; 24 "
            "steps; asymmetric also tries the zero point's two neighbours) to the smallest squared rounding "
            "error, weighted by each input column's mean squared activation on --calib-data (first token of "
            "each window left out). Default: on for int4 when --calib-data is given, else off (plain min/max scales). "
            "--clip-search without --calib-data weighs columns equally (raised perplexity on SmolLM2-135M). "
            "gptq: the same search where GPTQ fixes each group's scale, weighted by the Hessian diagonal "
            "(default: on; --no-clip-search: min/max group scales).",
        ),
    ] = None,
    ignore: Annotated[
        Optional[list[str]],
        typer.Option(help="Linear names to keep in full precision (glob, repeatable). Default: lm_head."),
    ] = None,
    device: Annotated[Device, typer.Option(help="auto = cuda when available, else cpu.")] = Device.auto,
) -> None:
    """Quantize every Linear except lm_head (and --ignore patterns); write an HF directory in the compressed-tensors
    format (vLLM, transformers and baige load it) with quantization_report.json."""
    from rich.console import Console
    from rich.table import Table

    from baige.runtime.quant.format import REPORT_FILE
    from baige.runtime.quantize import quantize_checkpoint

    cfg = QuantizeConfig(
        model=model,
        method=method.value,
        output=str(output),
        group_size=group_size,
        symmetric=symmetric,
        act_order=act_order,
        calib_data=str(calib_data) if calib_data else None,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        ignore=ignore or ["lm_head"],
        device=device.value,
        clip_search=clip_search,
    )
    console = Console(stderr=True)
    with progress_bar(f"quantize ({cfg.method})") as update:
        out, report = quantize_checkpoint(cfg, lambda done, total, name: update(done, total))

    table = Table(title=f"{out} ({report[0]['scheme']}, {report[0]['format']})")
    table.add_column("layer", overflow="fold")
    for col in ("shape", "relative weight error", "partial group"):
        table.add_column(col, justify="right")
    for row in report:
        table.add_row(
            row["name"],
            "x".join(map(str, row["shape"])),
            f"{row['relative_weight_error']:.4f}",
            "yes" if row["partial_last_group"] else "",
        )
    Console().print(table)
    partial = [r["name"] for r in report if r["partial_last_group"]]
    if partial:
        console.print(
            f"[yellow]note:[/yellow] {len(partial)} layers have in_features not divisible by {group_size}; their last "
            "group is partial. baige loads them; vLLM's int4 kernels and compressed-tensors' dequantizer need "
            "divisible in_features (choose a group size that divides them for those loaders)."
        )
    console.print(f"wrote {out} (report: {out / REPORT_FILE})")
