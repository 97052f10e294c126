"""What the command modules share: option types, the dtype/device choices, and the progress bar."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Annotated, Optional

import typer

MODEL_HELP = "HF directory, .gguf file, alias or HF repo id. Default: smollm2-135m-instruct (embedded)."


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)]
DeviceOpt = Annotated[Device, typer.Option(help="auto = cuda when available, else cpu.")]
WeightsDTypeOpt = Annotated[
    DType,
    typer.Option(help="Weights dtype (and the KV cache's unless --kv-cache-dtype is set); auto = the checkpoint's."),
]

TensorParallelOpt = Annotated[
    int,
    typer.Option(
        "--tensor-parallel-size",
        min=1,
        help="Ranks the model is split over (Megatron-style tensor parallelism: "
        "attention heads, MLP, vocabulary and KV cache sharded). One machine: baige starts the worker processes "
        "(gloo on CPU, NCCL on GPU); several: run the same command under torchrun --nnodes, rank 0 serving.",
    ),
]
ExpertParallelOpt = Annotated[
    bool,
    typer.Option(
        "--enable-expert-parallel/--no-enable-expert-parallel",
        help="MoE under --tensor-parallel-size: place whole experts on the ranks instead of splitting each one.",
    ),
]

BatchInvariantOpt = Annotated[
    bool,
    typer.Option(
        "--batch-invariant/--no-batch-invariant",
        help="CPU: a sequence's logprobs and greedy tokens do not depend on the rest of its batch or on how its "
        "prompt is chunked, and equal a trainer's forward bit for bit (RL rollouts). Slower: per-op kernels with "
        "fixed reduction orders; plain fp32/bf16 dense models only.",
    ),
]
KVTransferConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--kv-transfer-config",
        help='Prefill/decode disaggregation, vLLM\'s JSON keys: {"kv_connector": "auto" (or "zmq"), "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both", "kv_ip": ADDR, "kv_port": PORT (0: free), '
        '"kv_connector_extra_config": {"transfer_timeout": S, "abort_request_timeout": S}}. A producer serves '
        "its finished prefills' KV blocks; a consumer pulls them for requests carrying kv_transfer_params. "
        "Default: off.",
    ),
]
SpeculativeConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--speculative-config",
        help='Speculative decoding, vLLM\'s JSON keys: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1} (prompt lookup) or '
        '{"method": "draft_model", "model": SPEC, "num_speculative_tokens": 4} (a smaller model with the same '
        'tokenizer, e.g. a `baige quantize --method int4` copy); "disable_by_batch_size": N stops speculating '
        "in steps with more than N decoding sequences. Default: off.",
    ),
]


@contextmanager
def progress_bar(description: str, transient: bool = False) -> Iterator[Callable[..., None]]:
    """A rich progress bar on stderr; yields ``update(done, total, what=None)``. A run that fails
    erases its bar, so the error is the one line it leaves."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=transient) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int | None, what: str | None = None) -> None:
            bar.update(task, completed=done, total=total, **({"description": f"{description}: {what}"} if what else {}))

        try:
            yield update
        except BaseException:
            bar.live.transient = True  # erase the bar...
            bar.live.stop()
            bar.disable = True  # ...and let Progress.stop add no blank line (it does on a non-terminal)
            raise
