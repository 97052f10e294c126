"""``baige bench grpo``: a short GRPO run on the procedural arithmetic task."""

from __future__ import annotations

from typing import Annotated

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import DEFAULT_OUT, OutDirOpt, PlotOpt
from baige.cli.options import Device, DeviceOpt, ModelOpt


@bench_app.command()
def grpo(
    model: ModelOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="GRPO steps (each: rollout, rewards, update, weight sync).")] = 5,
    prompts_per_step: Annotated[int, typer.Option(min=1, help="Arithmetic problems per step.")] = 4,
    group_size: Annotated[int, typer.Option(min=2, help="Samples per problem.")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per sample.")] = 48,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per trainer micro-batch.")] = 8,
    difficulty: Annotated[int, typer.Option(min=1, max=5, help="Problem difficulty, 1..5 (train/rl/tasks.py).")] = 1,
    lr: Annotated[float, typer.Option(help="Learning rate (constant).")] = 2e-6,
    batch_invariant: Annotated[
        bool, typer.Option("--batch-invariant/--no-batch-invariant", help="Engine = trainer logprobs bitwise.")
    ] = False,
    device: DeviceOpt = Device.auto,
    seed: Annotated[int, typer.Option(help="Seed of the problems and of the sampling, 0 .. 2**63-1.")] = 0,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Short GRPO run (exact_answer reward on arithmetic problems): step time by phase (s), rollout and train
    tokens/s, the reward curve (--plot)."""
    from baige.runtime.bench.grpo import GRPOBenchConfig, run_grpo
    from baige.runtime.bench.report import grpo_rows, metric_table

    cfg = GRPOBenchConfig(
        model, steps, prompts_per_step, group_size, max_tokens, batch_size, difficulty, lr, device.value,
        batch_invariant, seed,
    )  # fmt: skip
    title = f"baige bench grpo ({prompts_per_step} x {group_size} samples of <= {max_tokens} tokens per step)"
    execute("grpo", run_grpo, cfg, output_dir, plot, lambda r: metric_table(title, grpo_rows(r)))
