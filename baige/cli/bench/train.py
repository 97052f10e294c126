"""``baige bench train``: a short training run through the Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import DEFAULT_OUT, OutDirOpt, PlotOpt
from baige.cli.options import MODEL_HELP, Device, DeviceOpt


@bench_app.command()
def train(
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model", "-m", help=MODEL_HELP + " Or a preset architecture trained from scratch: debug, smollm2-135m."
        ),
    ] = None,
    seq_len: Annotated[int, typer.Option(min=2, help="Tokens per window.")] = 256,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per micro-batch.")] = 4,
    grad_accum: Annotated[int, typer.Option(min=1, help="Micro-batches per optimizer step.")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps, warm-up included.")] = 6,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Untimed steps.")] = 2,
    dtype: Annotated[
        str,
        typer.Option(
            help="Compute dtype: auto (bf16 on CUDA and on CPUs with native bf16, else fp32) | float32 | bfloat16."
        ),
    ] = "auto",
    optimizer: Annotated[
        str, typer.Option(help="adamw | muon (Newton-Schulz on the hidden matrices, AdamW for the rest).")
    ] = "adamw",
    lr: Annotated[Optional[float], typer.Option(help="Peak learning rate (default: baige train's).")] = None,
    device: DeviceOpt = Device.auto,
    activation_checkpointing: Annotated[str, typer.Option(help="none | full | N.")] = "none",
    compile: Annotated[
        Optional[bool],
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile each block. Default: the Trainer's (training.compile = "
            "auto: on for single-device CPU training).",
        ),
    ] = None,
    data: Annotated[Optional[Path], typer.Option(help="UTF-8 text to train on (default: synthetic).")] = None,
    seed: Annotated[
        int, typer.Option(help="Seed of the init, the data order and the synthetic text, 0 .. 2**63-1.")
    ] = 0,
    cp: Annotated[
        int,
        typer.Option(
            "--cp",
            min=1,
            help="Context-parallel degree: N >= 2 runs, per sequence length, one process and N processes "
            "(--cp N), and reports tokens/s and memory per rank.",
        ),
    ] = 1,
    cp_method: Annotated[str, typer.Option("--cp-method", help="ring | ulysses (with --cp).")] = "ring",
    seq_lens: Annotated[
        Optional[str],
        typer.Option("--seq-lens", help="With --cp: comma-separated sequence lengths to sweep (default: --seq-len)."),
    ] = None,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Short training run through the Trainer: tokens/s per device, MFU (%), peak memory; with --cp, tokens/s
    and memory per rank against sequence length, one process against context parallel."""
    from baige.errors import BaigeError
    from baige.runtime.bench.report import metric_table, train_cp_table, train_rows
    from baige.runtime.bench.train import TrainBenchConfig, run_train

    try:
        lens = [int(x) for x in seq_lens.split(",")] if seq_lens is not None else None
    except ValueError:
        raise BaigeError(f"--seq-lens {seq_lens!r}: expected comma-separated integers (e.g. 1024,2048)") from None

    cfg = TrainBenchConfig(
        model,
        seq_len,
        batch_size,
        grad_accum,
        steps,
        warmup_steps,
        dtype,
        device.value,
        activation_checkpointing,
        "auto" if compile is None else compile,
        str(data) if data else None,
        seed,
        cp,
        cp_method,
        lens,
        optimizer,
        lr,
    )
    if cp > 1:
        from baige.runtime.bench.train_cp import run_train_cp

        execute("train_cp", run_train_cp, cfg, output_dir, plot, train_cp_table)
        return
    execute(
        "train",
        run_train,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(
            f"baige bench train ({batch_size} x {seq_len} tokens/step, {r['dtype']}, {optimizer})", train_rows(r)
        ),
    )
