"""``baige`` command line. Command modules stay thin: parse -> config dataclass -> runtime call."""

from __future__ import annotations

import sys
from typing import NoReturn

from typer.exceptions import Abort, TyperException

# the command modules register their commands on `app` when imported
from baige.cli import bench, convert, evaluate, generate, quantize, router, serve, train  # noqa: F401
from baige.cli.app import app
from baige.errors import BaigeError

MULTI_VALUE_OPTIONS = ("--lora-modules",)  # vLLM's nargs="+" options: `--lora-modules a=X b=Y`


def expand_multi_value(argv: list[str]) -> list[str]:
    """Repeat a multi-value option before each of its values (what click parses): ``--lora-modules
    a=X b=Y`` -> ``--lora-modules a=X --lora-modules b=Y``; the values run up to the next ``-`` word."""
    out, multi, pending = [], None, False
    for arg in argv:
        if arg.startswith("-"):
            if pending:
                out.append(multi)  # the option without a value: click's usage error
            multi = arg if arg in MULTI_VALUE_OPTIONS else None
            pending = multi is not None
            if multi:
                continue
        elif multi:
            out.append(multi)
            pending = False
        out.append(arg)
    if pending:
        out.append(multi)
    return out


def _nixl_agents() -> int:
    """How many NIXL agents this process has made (``kv_transfer.nixl_connector.agents_made``; 0 when that module
    was never imported: the check imports nothing)."""
    nixl = sys.modules.get("baige.runtime.infer.kv_transfer.nixl_connector")
    return 0 if nixl is None else nixl.agents_made


def exit_process(code: int, agents_before: int) -> NoReturn:
    """``sys.exit(code)``, unless the command made a NIXL agent (more than ``agents_before``): then Python's exit
    handlers and stream flushes run and ``os._exit(code)`` skips the C libraries' destructors, one of which
    crashes in such a process, so it ends with ``code`` instead of signal 11."""
    if _nixl_agents() <= agents_before:
        sys.exit(code)
    import atexit
    import logging
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to lose
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: every user mistake prints one line (``error: ...``) and exits
    non-zero (1 for bad values and files, 2 for bad command-line usage); Ctrl-C exits 130."""
    agents = _nixl_agents()
    try:
        args = expand_multi_value(sys.argv[1:] if argv is None else list(argv))
        # obj: the command line as given, for a command that starts copies of itself (serve --data-parallel-size)
        code = app(args=args, standalone_mode=False, obj={"argv": args})
    except TyperException as e:  # click's usage errors (unknown option, bad value, missing argument)
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()
            exit_process(0, agents)
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        print(f"error: {' '.join(e.format_message().split())}{hint}", file=sys.stderr)
        exit_process(getattr(e, "exit_code", 2), agents)
    except BaigeError as e:
        print(f"error: {e}", file=sys.stderr)
        exit_process(1, agents)
    except (KeyboardInterrupt, Abort):
        print("interrupted", file=sys.stderr)
        exit_process(130, agents)
    except ValueError as e:
        kernels = sys.modules.get("baige.kernels")  # loaded by then if the error came from it; no torch import here
        if kernels is None or not isinstance(e, kernels.KernelConfigError):
            raise
        print(f"error: {e}", file=sys.stderr)
        exit_process(1, agents)
    exit_process(code if isinstance(code, int) else 0, agents)
