"""``baige bench``: the group, its default suite (no subcommand), and :func:`execute`, the runner every
subcommand ends in (progress bar, rich table, JSON result)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.app import Typer, app
from baige.cli.bench.options import DEFAULT_OUT, KVCacheDTypeOpt, OutDirOpt, PeersOpt, PlotOpt, parse_peers
from baige.cli.options import DType, ModelOpt, progress_bar

bench_app = Typer(
    help="Benchmark baige against its peers and this machine's limits. Without a subcommand: a short "
    "suite (latency, throughput, serve, compare) on the model, one summary table.",
    invoke_without_command=True,
)
app.add_typer(bench_app, name="bench")


def execute(name: str, fn, cfg, output_dir: Path, plot: bool, render) -> dict:
    """Run ``fn(cfg, progress)`` under a progress bar, print its table, write its JSON (and charts).
    Exits 130 after writing when the run was interrupted (Ctrl-C)."""
    from rich.console import Console

    from baige.runtime.bench.common import write_result
    from baige.runtime.bench.report import write_plots
    from baige.runtime.config import check_output_path

    check_output_path("--output-dir", output_dir, "dir")  # before the run, not after it
    err = Console(stderr=True)
    with progress_bar(f"bench {name}", transient=True) as update:
        result = fn(cfg, update)
    Console().print(render(result))
    env = result.get("environment", {})
    if env.get("device") == "cpu":
        err.print(
            f"cpu: {env.get('cpu_model')}; flags {' '.join(env.get('cpu_flags') or []) or 'none'}; native "
            f"kernels {env.get('cpu_isa') or 'off'}, int8/int4 integer dot "
            f"{int_dot_words(env)}"
            + (f"; baige ran in {result['limits']['dtype']}" if result.get("limits", {}).get("dtype") else "")
        )
    load, cpus = (env.get("load_average") or [0.0])[0], env.get("cpu_count") or 1
    # the 1-minute load includes this run's own threads: a --threads 2 run on 2 CPUs alone reads ~2.0
    if load > cpus and load - (env.get("torch_num_threads") or 1) >= 0.5:
        err.print(
            f"[yellow]note:[/yellow] load average {load:.1f} on {cpus} CPUs while measuring: other work "
            "shared the machine, so timings and the measured limits are noisy (a % of limit can exceed 100%)"
        )
    path = write_result(output_dir, name, result)
    err.print(f"wrote {path}")
    if plot:
        for p in write_plots(result, output_dir, path.stem):
            err.print(f"wrote {p}")
    if result.get("interrupted"):
        err.print("[yellow]interrupted[/yellow]: the result covers what was measured before Ctrl-C")
        raise typer.Exit(130)
    return result


@bench_app.callback()
def bench(
    ctx: typer.Context,
    model: ModelOpt = None,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
    threads: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="CPU threads for torch here and in a launched "
            "`baige serve` (its OMP_NUM_THREADS). Default: torch's choice.",
        ),
    ] = None,
    kv_cache_dtype: KVCacheDTypeOpt = DType.auto,
    peers: PeersOpt = "hf,llama.cpp",
) -> None:
    """Benchmark baige against its peers and this machine's limits (memory bandwidth, matmul peak)."""
    if threads:
        import torch

        torch.set_num_threads(threads)  # a launched `baige serve` gets torch's count (serve_run.server_env)
    if ctx.invoked_subcommand is not None:
        # --model / --output-dir / --plot / --kv-cache-dtype given before the subcommand become its
        # defaults (compared by name: typer vendors its own click, whose ParameterSource is another enum)
        given = {
            name: ctx.params[name]
            for name in ("model", "output_dir", "plot", "kv_cache_dtype", "peers")
            if ctx.get_parameter_source(name).name != "DEFAULT"
        }
        sub = ctx.command.commands[ctx.invoked_subcommand]
        if "peers" in given and not parse_peers(given["peers"]) and not any(p.name == "peers" for p in sub.params):
            del given["peers"]  # none, before a subcommand without peers: nothing to apply
        for name in ("kv_cache_dtype", "peers"):
            if name in given and not any(p.name == name for p in sub.params):
                from baige.errors import BaigeError

                hint = (
                    " (pass it to the server: --server-arg=--kv-cache-dtype=...)"
                    if ctx.invoked_subcommand == "serve" and name == "kv_cache_dtype"
                    else ""
                )
                raise BaigeError(f"--{name.replace('_', '-')} does not apply to `bench {ctx.invoked_subcommand}`{hint}")
        if given:
            ctx.default_map = {
                name: {k: v for k, v in given.items() if any(p.name == k for p in cmd.params)}
                for name, cmd in ctx.command.commands.items()
            }
        return
    from rich.console import Console

    from baige import kernels
    from baige.runtime.bench.suite import run_suite, suite_table

    kernels.check_startup()  # what a subcommand's CheckedCommand does before it runs
    result = run_suite(model, output_dir, plot, kv_cache_dtype.value, parse_peers(peers))
    Console().print(suite_table(result))
    if result.get("interrupted"):
        raise typer.Exit(130)


def int_dot_words(env: dict) -> str:
    """'off', or 'on' with its activation passes (older result files have no passes: just 'on')."""
    if not env.get("cpu_int_dot"):
        return "off"
    passes = env.get("cpu_int_dot_passes")
    return "on" if passes is None else f"on ({passes} activation pass{'es' if passes == 2 else ''})"
