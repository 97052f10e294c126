"""What the ``baige bench`` subcommands share: option types, the parsers of list-valued options, and
the ``EngineConfig`` the in-process benchmarks (latency, throughput, compare) build from their options."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.options import Device, DType

DEFAULT_OUT = Path("bench-results")

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
        help="Comparison: the peers to time, comma-separated: hf (HF transformers), llama.cpp (llama-cpp-python), "
        "openvino, onnxruntime-genai, ctranslate2 (each converts the model once with its own tool and times each "
        "row in its own process), or none (baige rows only). Default: hf,llama.cpp. On a big model HF's rows "
        "take minutes: --peers llama.cpp."
    ),
]
ServerArgOpt = Annotated[
    Optional[list[str]],
    typer.Option(help="Extra `baige serve` option (repeatable), e.g. --server-arg=--max-num-seqs=64."),
]


def split_names(text: str) -> tuple[str, ...]:
    """Comma-separated names (blanks dropped; ``none`` = no name at all)."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    return () if names == ("none",) else names


def parse_peers(text: str) -> tuple[str, ...]:
    """``--peers``' names, checked: known ones or ``none``. Raises BaigeError for an unknown name or an
    empty value (``none`` asks for baige's rows only)."""
    from baige.errors import BaigeError
    from baige.runtime.bench.compare import PEERS, check_names

    if not text.strip(" ,"):
        raise BaigeError("--peers is empty (none: baige's rows only)")
    names = split_names(text)
    check_names("--peers", names, PEERS)
    return names


def parse_numbers(text: str, option: str, kind: type, hint: str) -> list:
    """Comma-separated ``kind`` values of ``option`` (empty items skipped). Raises BaigeError with ``hint``."""
    from baige.errors import BaigeError

    try:
        return [kind(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise BaigeError(f"{option} {text!r}: {hint}") from None


def engine_config(
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
