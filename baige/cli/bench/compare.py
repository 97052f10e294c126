"""``baige bench compare``: baige against HF transformers, llama.cpp and the other CPU engines on the same model."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.bench.group import bench_app, execute
from baige.cli.bench.options import (
    DEFAULT_OUT,
    EagerOpt,
    KVCacheDTypeOpt,
    MNBTOpt,
    OutDirOpt,
    PeersOpt,
    PlotOpt,
    SeedOpt,
    engine_config,
    parse_numbers,
    parse_peers,
    split_names,
)
from baige.cli.options import Device, DeviceOpt, DType, ExpertParallelOpt, ModelOpt, TensorParallelOpt, WeightsDTypeOpt


class HFDType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


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
    prefill_lens: Annotated[
        str,
        typer.Option(
            help="Prefill: prompt lengths (tokens, comma-separated; none: no prefill), each timed as one "
            "batch-1 prompt and one new token (llama-bench's pp)."
        ),
    ] = "128,512",
    peer_venv: Annotated[
        Optional[Path],
        typer.Option(
            help="A venv whose python runs a peer's converter that cannot share baige's environment "
            "(optimum-intel's OpenVINO export; scripts/setup.sh --with-peers makes .peers-venv). Default: "
            ".peers-venv when it exists."
        ),
    ] = None,
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
    """baige vs HF transformers, llama.cpp, OpenVINO, ONNX Runtime GenAI and CTranslate2 (--peers; those
    installed): batch-1 decode, prefill and offline throughput tokens/s, their ratios, and the peers at
    baige's bits per weight."""
    from baige.runtime.bench.compare import CompareConfig, run_compare
    from baige.runtime.bench.report import compare_ratios_table, compare_table

    engine = engine_config(
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
        quantized=() if not quantized else split_names(variants) if variants else CompareConfig.quantized,
        hf_dtypes=tuple(d.value for d in hf_dtype) if hf_dtype else CompareConfig.hf_dtypes,
        peers=parse_peers(peers),
        prefill_lens=tuple(parse_numbers(prefill_lens, "--prefill-lens", int, "comma-separated token counts"))
        if split_names(prefill_lens)
        else (),
        peer_venv=str(peer_venv) if peer_venv else (".peers-venv" if Path(".peers-venv").is_dir() else None),
    )

    def render(r):
        from rich.console import Group

        tables = [t for t in (compare_table(r), compare_ratios_table(r)) if t is not None]
        return Group(*tables, *[f"note: {n}" for n in r["notes"]])

    execute("compare", run_compare, cfg, output_dir, plot, render)
