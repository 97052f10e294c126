"""``baige bench kernels``: every ``baige.kernels`` op against its reference and the machine's limits."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import DEFAULT_OUT, OutDirOpt, PlotOpt, parse_numbers
from baige.cli.options import Device, DeviceOpt


@bench_app.command()
def kernels(
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16.")] = "float32",
    device: DeviceOpt = Device.auto,
    sizes: Annotated[str, typer.Option(help="Comma-separated tokens per call.")] = "128,512,2048",
    op: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Only this op (repeatable), a baige.kernels name such as "
            "rms_norm or paged_decode_attention. Default: every op."
        ),
    ] = None,
    compile: Annotated[bool, typer.Option(help="Also time torch.compile of the reference.")] = True,
    iters: Annotated[int, typer.Option(min=1, help="Timed calls per measurement (CPU).")] = 10,
    shape: Annotated[
        str,
        typer.Option(
            help="Layer shapes: smollm2-135m (hidden 576, vocab 49152) | llama3-8b "
            "(hidden 4096, head_dim 128, vocab 128256)."
        ),
    ] = "smollm2-135m",
    backward: Annotated[bool, typer.Option(help="Time forward + backward of the ops that have one.")] = False,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Every baige.kernels op vs its PyTorch reference and torch.compile: µs, GB/s, TFLOP/s, % of limit
    (and peak memory on CUDA)."""
    from baige.runtime.bench.kernels import KernelsConfig, run_kernels
    from baige.runtime.bench.report import kernels_table

    size_list = tuple(parse_numbers(sizes, "--sizes", int, "use comma-separated integers"))
    cfg = KernelsConfig(dtype, device.value, size_list, tuple(op or ()), compile, iters, shape, backward)
    execute("kernels", run_kernels, cfg, output_dir, plot, kernels_table)
