"""``baige router``: an OpenAI-compatible front door over several servers (round_robin, least_load,
prefix, or pd: prefill on a producer, decode on a consumer)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from baige.cli.app import app


class Policy(str, Enum):
    round_robin = "round_robin"
    least_load = "least_load"
    prefix = "prefix"
    pd = "pd"


class RouterLogLevel(str, Enum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"


URLS = "(repeat the flag for each)"


# a plain TyperCommand: the router imports no torch, so the kernel settings' check is not its business
@app.command(cls=TyperCommand)
def router(
    policy: Annotated[
        Policy,
        typer.Option(
            help="round_robin: in turn; least_load: fewest running + waiting requests (from the backends' "
            "/metrics); prefix: equal prompt prefixes to the same backend (consistent hashing); pd: prefill on "
            "a --prefill producer, then decode on a --decode consumer (vLLM's kv_transfer_params flow).",
            case_sensitive=False,
        ),
    ] = Policy.round_robin,
    backend: Annotated[
        Optional[list[str]], typer.Option(help=f"A backend's base URL, http://HOST:PORT {URLS}.")
    ] = None,
    prefill: Annotated[
        Optional[list[str]], typer.Option(help=f"--policy pd: a producer's (prefill instance's) base URL {URLS}.")
    ] = None,
    decode: Annotated[
        Optional[list[str]], typer.Option(help=f"--policy pd: a consumer's (decode instance's) base URL {URLS}.")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8000,
    prefix_chars: Annotated[
        int,
        typer.Option(
            min=1,
            help="--policy prefix (and pd's producers): how many leading prompt characters are hashed; keep it "
            "at most the length of the prefixes requests share (a system prompt, a document).",
        ),
    ] = 256,
    balance_abs_threshold: Annotated[
        float,
        typer.Option(
            min=0,
            help="--policy prefix: when the prefix's backend has more than this many requests over the "
            "lightest one, route by least load instead (SGLang's balance_abs_threshold).",
        ),
    ] = 32,
    health_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between health checks (a down backend is re-admitted by one).")
    ] = 5.0,
    health_timeout: Annotated[float, typer.Option(min=0.05, help="Seconds a health check may take.")] = 5.0,
    connect_timeout: Annotated[
        float, typer.Option(min=0.05, help="Seconds to connect to a backend before trying the next one.")
    ] = 5.0,
    request_timeout_secs: Annotated[
        float,
        typer.Option(
            min=0.05,
            help="Seconds a request may take end to end (SGLang's flag): past it the client gets a 504 "
            "request_timeout, or an error event if its stream had begun.",
        ),
    ] = 1800.0,
    max_request_bytes: Annotated[
        int, typer.Option(min=1024, help="Largest request body in bytes; larger bodies get 413.")
    ] = 16 * 2**20,
    log_level: Annotated[RouterLogLevel, typer.Option(case_sensitive=False, help="Logging level.")] = (
        RouterLogLevel.info
    ),
) -> None:
    """Route OpenAI-compatible requests over several servers (/v1/completions, /v1/chat/completions, /v1/models)."""
    import logging

    from baige.runtime.config import RouterConfig
    from baige.runtime.router.app import run_router

    logging.basicConfig(level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = RouterConfig(
        policy=policy.value,
        backends=list(backend or []),
        prefill=list(prefill or []),
        decode=list(decode or []),
        host=host,
        port=port,
        prefix_chars=prefix_chars,
        balance_abs_threshold=balance_abs_threshold,
        health_interval=health_interval,
        health_timeout=health_timeout,
        connect_timeout=connect_timeout,
        request_timeout_secs=request_timeout_secs,
        max_request_bytes=max_request_bytes,
        log_level=log_level.value,
    )
    run_router(cfg)
