"""``baige bench latency`` and ``baige bench throughput``: the engine in this process (vLLM's offline benchmarks)."""

from __future__ import annotations

from typing import Annotated

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import (
    DEFAULT_OUT,
    DatasetOpt,
    EagerOpt,
    InputLenOpt,
    KVCacheDTypeOpt,
    MNBTOpt,
    OutDirOpt,
    OutputLenOpt,
    PlotOpt,
    QuantizationOpt,
    RangeRatioOpt,
    SeedOpt,
    engine_config,
)
from baige.cli.options import (
    Device,
    DeviceOpt,
    DType,
    ExpertParallelOpt,
    ModelOpt,
    SpeculativeConfigOpt,
    TensorParallelOpt,
    WeightsDTypeOpt,
)


@bench_app.command()
def latency(
    model: ModelOpt = None,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt length (tokens).")] = 32,
    output_len: Annotated[int, typer.Option(min=1, help="Tokens generated per prompt, EOS ignored.")] = 128,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts in the batch.")] = 8,
    num_iters_warmup: Annotated[int, typer.Option(min=0, help="Untimed iterations.")] = 1,
    num_iters: Annotated[int, typer.Option(min=1, help="Timed iterations.")] = 5,
    quantization: QuantizationOpt = None,
    kv_cache_dtype: KVCacheDTypeOpt = DType.auto,
    dtype: WeightsDTypeOpt = DType.auto,
    device: DeviceOpt = Device.auto,
    enforce_eager: EagerOpt = False,
    max_num_batched_tokens: MNBTOpt = 2048,
    seed: SeedOpt = 0,
    speculative_config: SpeculativeConfigOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    enable_expert_parallel: ExpertParallelOpt = False,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Latency of one batch (vllm bench latency): percentiles (s), TTFT, TPOT, prefill/decode tokens/s."""
    from baige.runtime.bench.offline import LatencyConfig, run_latency
    from baige.runtime.bench.report import latency_rows, metric_table

    engine = engine_config(
        model,
        dtype,
        device,
        enforce_eager,
        max_num_batched_tokens,
        quantization,
        kv_cache_dtype,
        speculative_config,
        tensor_parallel_size,
        enable_expert_parallel,
    )
    cfg = LatencyConfig(engine, input_len, output_len, batch_size, num_iters_warmup, num_iters, seed)
    execute(
        "latency",
        run_latency,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(
            f"baige bench latency (batch {batch_size}, {input_len} in, {output_len} out)", latency_rows(r)
        ),
    )


@bench_app.command()
def throughput(
    model: ModelOpt = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="Requests, all submitted at once.")] = 32,
    input_len: InputLenOpt = 128,
    output_len: OutputLenOpt = 128,
    range_ratio: RangeRatioOpt = 0.0,
    dataset_path: DatasetOpt = None,
    quantization: QuantizationOpt = None,
    kv_cache_dtype: KVCacheDTypeOpt = DType.auto,
    dtype: WeightsDTypeOpt = DType.auto,
    device: DeviceOpt = Device.auto,
    enforce_eager: EagerOpt = False,
    max_num_batched_tokens: MNBTOpt = 2048,
    seed: SeedOpt = 0,
    speculative_config: SpeculativeConfigOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    enable_expert_parallel: ExpertParallelOpt = False,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Offline throughput (vllm bench throughput): requests/s, total tokens/s, output tokens/s."""
    from baige.runtime.bench.offline import ThroughputConfig, run_throughput
    from baige.runtime.bench.report import metric_table, throughput_rows

    engine = engine_config(
        model,
        dtype,
        device,
        enforce_eager,
        max_num_batched_tokens,
        quantization,
        kv_cache_dtype,
        speculative_config,
        tensor_parallel_size,
        enable_expert_parallel,
    )
    cfg = ThroughputConfig(
        engine, num_prompts, input_len, output_len, range_ratio, str(dataset_path) if dataset_path else None, seed
    )
    execute(
        "throughput",
        run_throughput,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(f"baige bench throughput ({num_prompts} prompts)", throughput_rows(r)),
    )
