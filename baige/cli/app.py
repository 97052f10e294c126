"""The Typer application every command module registers on.

Start-up stays light: importing the command modules and showing any ``--help`` imports neither torch
nor anything else heavy (``tests/test_cli_startup.py``). Commands import what they need in their
bodies, and the kernel settings are checked when a command runs, not when its help is shown.
"""

from typing import Any

import typer
from typer.core import TyperCommand


class CheckedCommand(TyperCommand):
    """A command that checks the kernel settings (:func:`baige.kernels.check_startup`: a bad
    ``BAIGE_KERNELS`` fails before any model loads) once its options have parsed, just before it runs;
    ``--help`` and usage errors exit earlier, without importing torch."""

    def invoke(self, ctx: Any) -> Any:
        from baige import kernels

        kernels.check_startup()
        return super().invoke(ctx)


class Typer(typer.Typer):
    """``typer.Typer`` whose commands are :class:`CheckedCommand` unless a command names its own class."""

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or CheckedCommand, **kwargs)


app = Typer(
    name="baige",
    help="Train, serve, quantize and benchmark Llama-family LLMs from Hugging Face checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
