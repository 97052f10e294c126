"""``baige bench startup``: time-to-ready of ``baige serve``, time-to-first-token of ``baige generate`` and
the wall time of ``baige --help``, from process start, warm and cold (vLLM's ``bench startup``)."""

from __future__ import annotations

from typing import Annotated

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import DEFAULT_OUT, OutDirOpt, ServerArgOpt
from baige.cli.options import ModelOpt


@bench_app.command()
def startup(
    model: ModelOpt = None,
    repeats: Annotated[
        int, typer.Option(min=1, help="Timed runs of each measurement, warm and (with --cold) cold; median and min.")
    ] = 3,
    num_iters_warmup: Annotated[
        int, typer.Option(min=0, help="Untimed runs of each command before its warm runs (they fill the cache).")
    ] = 1,
    cold: Annotated[
        bool,
        typer.Option(
            "--cold/--no-cold",
            help="Also time serve and generate with empty caches (BAIGE_CACHE, Triton's, Inductor's in a fresh "
            "temporary directory): the model imported again and the native CPU kernels compiled again, as on a "
            "first run. The OS page cache is not dropped.",
        ),
    ] = True,
    prompt: Annotated[str, typer.Option(help="The prompt `baige generate` is run with (greedy).")] = (
        "What is the capital of France?"
    ),
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens `baige generate` produces before it exits.")] = 8,
    server_arg: ServerArgOpt = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds one process may take to be ready (serve) or to exit (generate, --help).")
    ] = 600.0,
    output_dir: OutDirOpt = DEFAULT_OUT,
) -> None:
    """Start-up (vllm bench startup): `baige serve` time to ready, `baige generate` time to first token and
    `baige --help`, from process start (s), warm and cold."""
    from baige.runtime.bench.report import startup_table
    from baige.runtime.bench.startup import StartupConfig, run_startup

    cfg = StartupConfig(model, repeats, num_iters_warmup, cold, prompt, max_tokens, list(server_arg or []), timeout)
    execute("startup", run_startup, cfg, output_dir, False, startup_table)
