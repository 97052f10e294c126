"""``baige generate`` (one prompt, streamed) and ``baige chat`` (interactive, multi-turn)."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from baige.cli.app import app
from baige.cli.options import (
    BatchInvariantOpt,
    Device,
    DeviceOpt,
    DType,
    ModelOpt,
    SpeculativeConfigOpt,
    TensorParallelOpt,
)
from baige.runtime.config import GenerateConfig

MaxTokensOpt = Annotated[
    int, typer.Option(min=1, help="Most tokens to generate (stops earlier at EOS or where the model's context ends).")
]
TemperatureOpt = Annotated[
    Optional[float], typer.Option(min=0.0, help="0 = greedy. Default: the model's generation_config, else 1.0.")
]
TopPOpt = Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).")]
TopKOpt = Annotated[Optional[int], typer.Option(min=0, help="Keep the K most likely tokens (0 = off).")]
MinPOpt = Annotated[float, typer.Option(min=0.0, max=1.0, help="Drop tokens below min_p * p(top token).")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Random seed for reproducible sampling (any 64-bit integer).")]
DTypeOpt = Annotated[DType, typer.Option(help="Weights dtype; auto = the checkpoint's torch_dtype.")]
SystemOpt = Annotated[Optional[str], typer.Option(help="System message for the chat template.")]


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text.")],
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    dtype: DTypeOpt = DType.auto,
    device: DeviceOpt = Device.auto,
    chat: Annotated[
        Optional[bool],
        typer.Option(
            "--chat/--no-chat", help="Apply the chat template to one user turn (default: when the model has one)."
        ),
    ] = None,
    system: SystemOpt = None,
    speculative_config: SpeculativeConfigOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    batch_invariant: BatchInvariantOpt = False,
) -> None:
    """Generate a completion for one prompt, streamed to stdout as it is produced."""
    from baige.runtime.infer.session import ChatSession

    cfg = GenerateConfig(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        dtype=dtype.value,
        device=device.value,
        chat=chat,
        system=system,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        batch_invariant=batch_invariant,
    )
    session = ChatSession.load(cfg)
    _native_library_ready(cfg.device)
    t0 = time.perf_counter()
    n = 0
    for delta, n in session.complete(prompt):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _stats(n, time.perf_counter() - t0)


def _native_library_ready(device: str | None) -> None:
    """On the CPU, build (or load) the native kernels now, so a first run's compile stays out of the
    tokens/s that generate reports."""
    from baige import kernels
    from baige.runtime.model.device import resolve_device

    if resolve_device(device).type == "cpu":
        kernels.native_cpu_available()


@app.command()
def chat(
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    dtype: DTypeOpt = DType.auto,
    device: DeviceOpt = Device.auto,
    system: SystemOpt = None,
    speculative_config: SpeculativeConfigOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
) -> None:
    """Talk to a model turn by turn with its chat template. Exit with Ctrl-D or /exit; /reset clears the history."""
    from rich.console import Console

    from baige.errors import BaigeError
    from baige.runtime.infer.session import ChatSession

    cfg = GenerateConfig(
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        dtype=dtype.value,
        device=device.value,
        chat=True,
        system=system,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
    )
    session = ChatSession.load(cfg)
    err = Console(stderr=True)
    err.print(f"[dim]{session.name} — Ctrl-D or /exit to quit, /reset to clear the conversation[/dim]")
    while True:
        try:
            text = input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return
        if text.strip() == "/exit":
            return
        if text.strip() == "/reset":
            session.reset()
            continue
        if not text.strip():
            continue
        try:
            for delta, _ in session.chat_turn(text):
                sys.stdout.write(delta)
                sys.stdout.flush()
        except BaigeError as e:
            err.print(f"[red]error:[/red] {e}")
        sys.stdout.write("\n")


def _stats(n_tokens: int, seconds: float) -> None:
    from rich.console import Console

    rate = n_tokens / seconds if seconds > 0 else 0.0
    Console(stderr=True).print(f"[dim]{n_tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s)[/dim]")
