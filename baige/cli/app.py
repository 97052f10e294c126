"""The Typer application every command module registers on."""

import typer

app = typer.Typer(
    name="baige",
    help="Train, serve, quantize and benchmark Llama-family LLMs from Hugging Face checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
