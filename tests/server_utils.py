"""Launching `baige serve` for the server tests: a subprocess on a free port, waited for until
/health answers, terminated afterwards."""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(model_dir, *args: str, api_key: str | None = None, code: str | None = None, timeout: float = 120):
    """Run `baige serve --model model_dir --port P args...`; ``code`` runs in the server process
    before the CLI (fault injection). Yields (base url, process)."""
    port = free_port()
    argv = ["serve", "--model", str(model_dir), "--port", str(port), *args]
    boot = (code or "") + "\nfrom baige.cli import main\nmain(" + repr(argv) + ")\n"
    env = dict(os.environ, **({"BAIGE_API_KEY": api_key} if api_key else {}))
    proc = subprocess.Popen(
        [sys.executable, "-c", boot], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def parse_metrics(text: str, prefix: str = "") -> dict[str, float]:
    """The samples of a Prometheus text exposition (``/metrics``) whose name starts with ``prefix``:
    ``name{labels}`` -> value (comment lines skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
