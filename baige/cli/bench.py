"""``baige bench``: latency, throughput, serve, kernels, train, compare; no subcommand = the default suite."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.app import app
from baige.cli.options import (
    MODEL_HELP,
    Device,
    DeviceOpt,
    DType,
    ExpertParallelOpt,
    ModelOpt,
    SpeculativeConfigOpt,
    TensorParallelOpt,
    WeightsDTypeOpt,
    progress_bar,
)

bench_app = typer.Typer(
    help="Benchmark baige against its peers and this machine's limits. Without a subcommand: a short "
    "suite (latency, throughput, serve, compare) on the model, one summary table.",
    invoke_without_command=True,
)
app.add_typer(bench_app, name="bench")

OutDirOpt = Annotated[Path, typer.Option(help="Directory for the JSON results (and PNG charts).")]
PlotOpt = Annotated[bool, typer.Option("--plot", help="Also write PNG charts (matplotlib).")]
EagerOpt = Annotated[
    bool,
    typer.Option(
        help=(
            "GPU: never capture the decode step as CUDA graphs (torch.compile reduce-overhead). No effect on CPU, "
            "where decode steps are never captured."
        )
    ),
]
MNBTOpt = Annotated[int, typer.Option(min=1, help="Most tokens computed in one engine step.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the random prompts, 0 .. 2**63-1.")]
QuantizationOpt = Annotated[
    Optional[str],
    typer.Option(
        help="fp16-weight: the engine's fbgemm fp16-weight linears (CPU fp32 only; on an int8/int4 checkpoint, "
        "its remaining fp32 linears, i.e. the tied lm_head); int8-weight: int8 per-channel weights rounded at "
        "load. Default: none."
    ),
]
KVCacheDTypeOpt = Annotated[
    DType,
    typer.Option(
        help="KV-cache dtype of every baige row; auto = the model's. On CPU "
        "float16 under an fp32 model halves the attention's reads (the "
        "native kernels read fp32, fp16 and bf16 caches)."
    ),
]
InputLenOpt = Annotated[int, typer.Option(min=1, help="Random dataset: prompt length (tokens).")]
OutputLenOpt = Annotated[int, typer.Option(min=1, help="Random dataset: output length (tokens).")]
RangeRatioOpt = Annotated[float, typer.Option(help="Random dataset: lengths uniform in len*[1-r, 1+r].")]
DatasetOpt = Annotated[Optional[Path], typer.Option(help="ShareGPT-format JSON instead of random prompts.")]
PeersOpt = Annotated[
    str,
    typer.Option(
        help="Comparison: the peers to time, comma-separated: hf (HF transformers) and/or llama.cpp "
        "(llama-cpp-python), or none (baige rows only). On a big model HF's rows take minutes: --peers llama.cpp."
    ),
]
DEFAULT_OUT = Path("bench-results")


class HFDType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _execute(name: str, fn, cfg, output_dir: Path, plot: bool, render) -> dict:
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
            f"{_int_dot_words(env)}"
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


def _engine(
    model: str | None,
    dtype: DType,
    device: Device,
    enforce_eager: bool,
    max_num_batched_tokens: int,
    quantization: str | None = None,
    kv_cache_dtype: DType = DType.auto,
    speculative_config: str | None = None,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
):
    """The benchmarks' ``EngineConfig`` from the shared engine options."""
    from baige.runtime.bench.offline import bench_engine

    return bench_engine(
        model=model,
        dtype=dtype.value,
        device=device.value,
        enforce_eager=enforce_eager,
        max_num_batched_tokens=max_num_batched_tokens,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype.value,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
    )


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated names (blanks dropped; ``none`` = no name at all)."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    return () if names == ("none",) else names


def _peers(text: str) -> tuple[str, ...]:
    """``--peers``' names, checked: known ones or ``none``. Raises BaigeError for an unknown name or an
    empty value (``none`` asks for baige's rows only)."""
    from baige.errors import BaigeError
    from baige.runtime.bench.compare import PEERS, check_names

    if not text.strip(" ,"):
        raise BaigeError("--peers is empty (none: baige's rows only)")
    names = _names(text)
    check_names("--peers", names, PEERS)
    return names


def _numbers(text: str, option: str, kind: type, hint: str) -> list:
    """Comma-separated ``kind`` values of ``option`` (empty items skipped). Raises BaigeError with ``hint``."""
    from baige.errors import BaigeError

    try:
        return [kind(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise BaigeError(f"{option} {text!r}: {hint}") from None


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
        if "peers" in given and not _peers(given["peers"]) and not any(p.name == "peers" for p in sub.params):
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

    from baige.runtime.bench.suite import run_suite, suite_table

    result = run_suite(model, output_dir, plot, kv_cache_dtype.value, _peers(peers))
    Console().print(suite_table(result))
    if result.get("interrupted"):
        raise typer.Exit(130)


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

    engine = _engine(
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
    _execute(
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

    engine = _engine(
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
    _execute(
        "throughput",
        run_throughput,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(f"baige bench throughput ({num_prompts} prompts)", throughput_rows(r)),
    )


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
    server_arg: Annotated[
        Optional[list[str]],
        typer.Option(help="Extra `baige serve` option (repeatable), e.g. --server-arg=--max-num-seqs=64."),
    ] = None,
    speculative_config: SpeculativeConfigOpt = None,
    seed: SeedOpt = 0,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Online serving load (vllm bench serve): streamed requests, TTFT/TPOT/ITL/E2EL (ms), goodput."""
    from baige.runtime.bench.report import metric_table, serve_rows
    from baige.runtime.bench.serve_run import ServeBenchConfig, run_serve

    pcts = _numbers(percentiles, "--percentiles", float, "use comma-separated numbers, e.g. 50,90,99")
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

    _execute(
        "serve",
        run,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(
            f"baige bench serve ({num_prompts} requests at {request_rate} requests/s)", serve_rows(r)
        ),
    )


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

    size_list = tuple(_numbers(sizes, "--sizes", int, "use comma-separated integers"))
    cfg = KernelsConfig(dtype, device.value, size_list, tuple(op or ()), compile, iters, shape, backward)
    _execute("kernels", run_kernels, cfg, output_dir, plot, kernels_table)


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
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16.")] = "auto",
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
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """Short training run through the Trainer: tokens/s per device, MFU (%), peak memory."""
    from baige.runtime.bench.report import metric_table, train_rows
    from baige.runtime.bench.train import TrainBenchConfig, run_train

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
    )
    _execute(
        "train",
        run_train,
        cfg,
        output_dir,
        plot,
        lambda r: metric_table(f"baige bench train ({batch_size} x {seq_len} tokens/step)", train_rows(r)),
    )


@bench_app.command()
def compare(
    model: ModelOpt = None,
    input_len: Annotated[int, typer.Option(min=1, help="Decode: prompt length (tokens).")] = 32,
    output_len: Annotated[int, typer.Option(min=2, help="Decode: tokens generated.")] = 64,
    num_prompts: Annotated[int, typer.Option(min=1, help="Throughput: prompts.")] = 32,
    tp_input_len: Annotated[int, typer.Option(min=1, help="Throughput: mean prompt length (tokens).")] = 128,
    tp_output_len: Annotated[int, typer.Option(min=1, help="Throughput: mean output length (tokens).")] = 64,
    range_ratio: Annotated[float, typer.Option(help="Throughput: lengths uniform in len*[1-r, 1+r].")] = 0.5,
    hf_batch_size: Annotated[int, typer.Option(min=1, help="HF static batch size.")] = 32,
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved rounds (median kept).")] = 1,
    quantized: Annotated[
        bool, typer.Option(help="Also time the baige variants (--variants); --no-quantized: baige's own row only.")
    ] = True,
    variants: Annotated[
        Optional[str],
        typer.Option(
            help="Comma-separated baige variants to time: fp32, bf16 (the model in that dtype; the 'baige' row is "
            "--dtype's), int8, int4 (group 128), int4-g32 (group 32), fp16-weight, int8+fp16-weight, "
            "int8+int8-weight, int4-g32+int8-weight (quantized copies and/or load-time rewrites). int8 and "
            "int4-g32 also bring llama.cpp re-quantized to Q8_0 / Q4_0. Default: all."
        ),
    ] = None,
    peers: PeersOpt = "hf,llama.cpp",
    kv_cache_dtype: KVCacheDTypeOpt = DType.auto,
    hf_dtype: Annotated[
        Optional[list[HFDType]],
        typer.Option(
            help="HF transformers dtypes to time (repeat the option; no auto). Decode times each in every round; "
            "static-batch throughput times each in round 1, then only the fastest. Default: float32 and bfloat16."
        ),
    ] = None,
    dtype: WeightsDTypeOpt = DType.auto,
    device: DeviceOpt = Device.auto,
    enforce_eager: EagerOpt = False,
    max_num_batched_tokens: MNBTOpt = 2048,
    seed: SeedOpt = 0,
    tensor_parallel_size: TensorParallelOpt = 1,
    enable_expert_parallel: ExpertParallelOpt = False,
    output_dir: OutDirOpt = DEFAULT_OUT,
    plot: PlotOpt = False,
) -> None:
    """baige vs HF transformers and llama.cpp (when installed): batch-1 decode tokens/s, offline throughput
    total tokens/s, their ratios, and llama.cpp at baige's bits per weight."""
    from baige.runtime.bench.compare import CompareConfig, run_compare
    from baige.runtime.bench.report import compare_ratios_table, compare_table

    engine = _engine(
        model,
        dtype,
        device,
        enforce_eager,
        max_num_batched_tokens,
        None,
        kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
    )
    cfg = CompareConfig(
        engine,
        input_len,
        output_len,
        num_prompts,
        tp_input_len,
        tp_output_len,
        range_ratio,
        hf_batch_size,
        repeats,
        seed=seed,
        quantized=() if not quantized else _names(variants) if variants else CompareConfig.quantized,
        hf_dtypes=tuple(d.value for d in hf_dtype) if hf_dtype else CompareConfig.hf_dtypes,
        peers=_peers(peers),
    )

    def render(r):
        from rich.console import Group

        tables = [t for t in (compare_table(r), compare_ratios_table(r)) if t is not None]
        return Group(*tables, *[f"note: {n}" for n in r["notes"]])

    _execute("compare", run_compare, cfg, output_dir, plot, render)


def _int_dot_words(env: dict) -> str:
    """'off', or 'on' with its activation passes (older result files have no passes: just 'on')."""
    if not env.get("cpu_int_dot"):
        return "off"
    passes = env.get("cpu_int_dot_passes")
    return "on" if passes is None else f"on ({passes} activation pass{'es' if passes == 2 else ''})"
