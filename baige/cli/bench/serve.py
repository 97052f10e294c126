"""``baige bench serve``: load on an OpenAI-compatible server (vLLM's ``bench serve``)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import (
    DEFAULT_OUT,
    DatasetOpt,
    InputLenOpt,
    OutDirOpt,
    OutputLenOpt,
    PlotOpt,
    RangeRatioOpt,
    SeedOpt,
    ServerArgOpt,
    parse_numbers,
)
from baige.cli.options import ModelOpt, SpeculativeConfigOpt


@bench_app.command()
def serve(
    model: ModelOpt = None,
    base_url: Annotated[
        Optional[str],
        typer.Option(
            help="An OpenAI-compatible server to load; default: start `baige serve` on --model and stop it afterwards."
        ),
    ] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="Model name sent in requests.")] = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="Requests to send.")] = 64,
    input_len: InputLenOpt = 128,
    output_len: OutputLenOpt = 64,
    range_ratio: RangeRatioOpt = 0.0,
    dataset_path: DatasetOpt = None,
    request_rate: Annotated[float, typer.Option(help="Requests/s (inf: all at once).")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="Gamma shape of the arrivals (1 = Poisson).")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(min=1, help="Most requests in flight.")] = None,
    percentiles: Annotated[str, typer.Option(help="Comma-separated percentiles to report.")] = "50,90,99",
    slo: Annotated[Optional[str], typer.Option(help="Goodput SLOs, e.g. ttft:500,tpot:50,e2el:3000 (ms).")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="BAIGE_API_KEY", help="Bearer token for the server.")] = None,
    server_arg: ServerArgOpt = None,
    speculative_config: SpeculativeConfigOpt = None,
    seed: SeedOpt = 0,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Online serving load (vllm bench serve): streamed requests, TTFT/TPOT/ITL/E2EL (ms), goodput."""
    from baige.runtime.bench.report import metric_table, serve_rows
    from baige.runtime.bench.serve_run import ServeBenchConfig, run_serve

    pcts = parse_numbers(percentiles, "--percentiles", float, "use comma-separated numbers, e.g. 50,90,99")
    cfg = ServeBenchConfig(
        model,
        base_url,
        served_model_name,
        num_prompts,
        input_len,
        output_len,
        range_ratio,
        str(dataset_path) if dataset_path else None,
        request_rate,
        burstiness,
        max_concurrency,
        seed,
        pcts,
        slo,
        api_key,
        list(server_arg or []) + (["--speculative-config", speculative_config] if speculative_config else []),
    )

    def run(cfg, progress):
        done = []
        return run_serve(cfg, lambda r: (done.append(r), progress(len(done), cfg.num_prompts, "requests")))

    execute(
        "serve",
        run,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(
            f"baige bench serve ({num_prompts} requests at {request_rate} requests/s)", serve_rows(r)
        ),
    )
