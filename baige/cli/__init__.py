"""``baige`` command line. Command modules stay thin: parse -> config dataclass -> runtime call."""

from __future__ import annotations

import sys

from baige.cli import (  # noqa: F401  (modules register their commands)  # noqa: F401
    bench,  # noqa: F401
    convert,
    evaluate,
    generate,
    quantize,
    serve,  # noqa: F401
    train,  # noqa: F401
)
from baige.cli.app import app
from baige.errors import BaigeError


def main() -> None:
    """Console-script entry point: user errors print one line and exit 1; Ctrl-C exits 130."""
    try:
        app()
    except BaigeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:
        kernels = sys.modules.get("baige.kernels")  # loaded by then if the error came from it; no torch import here
        if kernels is None or not isinstance(e, kernels.KernelConfigError):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
