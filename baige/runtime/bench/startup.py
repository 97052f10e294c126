"""``baige bench startup`` (vLLM's ``bench startup``): how long baige takes, from a fresh process, to be
useful, measured from outside on the real command lines (``python -m baige ...``):

- ``serve_ready_s``: ``baige serve`` from process start until ``GET /health`` answers 200, its
  time-to-ready (imports, model load, KV cache allocation, native kernels, the HTTP server up). Once the
  server's port listens (it does before the model loads) one request waits in its accept queue, so the
  moment the server answers is timed exactly, not to a polling interval;
- ``generate_ttft_s``: ``baige generate`` from process start until the first byte of its output on
  stdout (the first token's text): a command-line user's time-to-first-token; ``generate_exit_s``: until
  the process has exited (``--max-tokens`` tokens, greedy);
- ``help_s``: ``baige --help`` from process start to exit: the command line's own start-up.

Cache states (vLLM's cold and warm start-up):

- warm: the cache in force (``BAIGE_CACHE``, else ``~/.cache/baige``) after ``num_iters_warmup`` untimed
  runs of each command: what a user meets from the second run on;
- cold: every run with empty caches, ``BAIGE_CACHE`` and Triton's and Inductor's cache directories in a
  fresh temporary directory (removed afterwards), so an embedded or GGUF model is imported again and the
  native CPU kernels are compiled again, as on a user's first run. The operating system's page cache is
  not dropped (that needs root): files read before may still come from memory. ``baige --help`` uses no
  cache and has no cold row.

Each child gets this process's environment with ``OMP_NUM_THREADS`` = torch's thread count here
(``baige bench --threads``), as ``baige bench serve`` launches its server.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.bench.common import environment
from baige.runtime.bench.offline import Progress
from baige.runtime.bench.serve_run import free_port, log_tail, server_env, stop_server
from baige.runtime.config import check_float, check_int

# (measurement, the command it times, unit), in table order
MEASUREMENTS = (
    ("serve_ready_s", "serve", "s"),
    ("generate_ttft_s", "generate", "s"),
    ("generate_exit_s", "generate", "s"),
    ("help_s", "help", "s"),
)
RETRY_S = 0.02  # pause between connection attempts while the server's port is not listening yet


@dataclass
class StartupConfig:
    """Resolved arguments of ``baige bench startup``. Raises BaigeError for a bad count or timeout."""

    model: str | None = None  # None: the embedded default model
    repeats: int = 3  # timed runs of each measurement, per cache state
    num_iters_warmup: int = 1  # untimed runs of each command before its warm runs
    cold: bool = True  # also time runs with empty caches (not `baige --help`)
    prompt: str = "What is the capital of France?"
    max_tokens: int = 8  # tokens `baige generate` produces (greedy)
    server_args: list[str] = field(default_factory=list)  # extra `baige serve` options
    timeout: float = 600.0  # seconds one process may take to be ready (or to exit, for generate and --help)

    def __post_init__(self) -> None:
        check_int("--repeats", self.repeats, 1)
        check_int("--num-iters-warmup", self.num_iters_warmup, 0)
        check_int("--max-tokens", self.max_tokens, 1)
        check_float("--timeout", self.timeout, 0.0, low_open=True)


def commands(cfg: StartupConfig, port: int | str = "PORT") -> dict[str, list[str]]:
    """The argument lists timed (after ``sys.executable``), by command name; ``port`` is serve's."""
    model = ["--model", cfg.model] if cfg.model else []
    return {
        "serve": ["-m", "baige", "serve", "--port", str(port), "--log-level", "warning", *model, *cfg.server_args],
        "generate": [
            *("-m", "baige", "generate", "--prompt", cfg.prompt, "--max-tokens", str(cfg.max_tokens)),
            *("--temperature", "0", *model),
        ],
        "help": ["-m", "baige", "--help"],
    }


def cold_env(env: dict[str, str], root: Path) -> dict[str, str]:
    """``env`` with every cache baige, Triton and Inductor write pointed under the empty ``root``."""
    return {
        **env,
        "BAIGE_CACHE": str(root / "baige"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
    }


def _failed(what: str, proc: subprocess.Popen, log: Path) -> BaigeError:
    return BaigeError(f"`baige {what}` exited with code {proc.returncode}: {log_tail(log)}")


def time_serve(cfg: StartupConfig, env: dict[str, str], workdir: Path) -> dict[str, float]:
    """Seconds from starting ``baige serve`` until ``/health`` answers 200 (the server is stopped
    afterwards). Raises BaigeError when the server exits first or is not ready within ``cfg.timeout``."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    log = workdir / "serve.log"
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, *commands(cfg, port)["serve"]],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        while (left := t0 + cfg.timeout - time.perf_counter()) > 0:
            if proc.poll() is not None:
                raise _failed("serve", proc, log)
            try:  # a cheap probe while the port is not listening yet (a request per try would cost more)
                socket.create_connection(("127.0.0.1", port), timeout=left).close()
                # listening: this request waits in the accept queue until the server takes it
                if httpx.get(url, timeout=left).status_code == 200:
                    return {"serve_ready_s": time.perf_counter() - t0}
            except (OSError, httpx.HTTPError):  # not listening yet, or a connection dropped by a process that exits
                pass
            time.sleep(RETRY_S)
        raise BaigeError(f"`baige serve` did not answer {url} within {cfg.timeout:g} s")
    finally:
        stop_server(proc)


def time_generate(cfg: StartupConfig, env: dict[str, str], workdir: Path) -> dict[str, float]:
    """Seconds from starting ``baige generate`` to its first stdout byte and to its exit. Raises
    BaigeError when it fails, prints nothing, or takes longer than ``cfg.timeout``."""
    log = workdir / "generate.log"
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, *commands(cfg)["generate"]],
            stdout=subprocess.PIPE,
            stderr=fh,
            env=env,
            start_new_session=True,
        )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], cfg.timeout)
        first = os.read(proc.stdout.fileno(), 1) if ready else None
        ttft = time.perf_counter() - t0
        if first is None:
            raise BaigeError(f"`baige generate` printed no token within {cfg.timeout:g} s")
        proc.communicate(timeout=max(t0 + cfg.timeout - time.perf_counter(), 0.0))
        done = time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        raise BaigeError(f"`baige generate` did not exit within {cfg.timeout:g} s") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if proc.returncode != 0 or not first:  # b"": stdout closed before any output
        raise _failed("generate", proc, log)
    return {"generate_ttft_s": ttft, "generate_exit_s": done}


def time_help(cfg: StartupConfig, env: dict[str, str], workdir: Path) -> dict[str, float]:
    """Seconds ``baige --help`` takes from start to exit. Raises BaigeError when it fails or times out."""
    log = workdir / "help.log"
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, *commands(cfg)["help"]],
                stdout=subprocess.DEVNULL,
                stderr=fh,
                env=env,
                timeout=cfg.timeout,
            )
        except subprocess.TimeoutExpired:
            raise BaigeError(f"`baige --help` did not exit within {cfg.timeout:g} s") from None
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise BaigeError(f"`baige --help` exited with code {proc.returncode}: {log_tail(log)}")
    return {"help_s": seconds}


TIMERS = {"serve": time_serve, "generate": time_generate, "help": time_help}


def plan(cfg: StartupConfig) -> list[tuple[str, str, bool]]:
    """``(command, cache state, timed)`` in run order: each command's warm-up runs, its warm runs,
    then its cold runs (none for ``--help``)."""
    runs = []
    for command in ("help", "generate", "serve"):
        runs += [(command, "warm", False)] * cfg.num_iters_warmup + [(command, "warm", True)] * cfg.repeats
        if cfg.cold and command != "help":
            runs += [(command, "cold", True)] * cfg.repeats
    return runs


def summarize_runs(samples: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """``{measurement: {cache: {runs, median, min, max}}}`` (seconds) of the timed samples."""
    import statistics

    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, _, _ in MEASUREMENTS:
        for cache in ("warm", "cold"):
            values = [s["seconds"] for s in samples if s["measurement"] == name and s["cache"] == cache]
            if values:
                stats = {"runs": len(values), "median": statistics.median(values), "min": min(values)}
                out.setdefault(name, {})[cache] = {**stats, "max": max(values)}
    return out


def run_startup(cfg: StartupConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench startup``; returns the JSON result (args, commands, environment, samples,
    summary). A Ctrl-C stops the runs and the result covers those that finished (``"interrupted": true``).
    Raises BaigeError when a command fails or times out (its log's last lines in the message)."""
    from baige.runtime.weights.hub import DEFAULT_MODEL

    runs = plan(cfg)
    env = server_env()
    samples: list[dict] = []
    interrupted = False
    try:
        for i, (command, cache, timed) in enumerate(runs):
            if progress:
                progress(i, len(runs), f"{command} ({cache}{'' if timed else ', warm-up'})")
            with tempfile.TemporaryDirectory(prefix="baige-bench-startup-") as tmp:
                run_env = cold_env(env, Path(tmp)) if cache == "cold" else env
                times = TIMERS[command](cfg, run_env, Path(tmp))
            if timed:
                samples += [{"measurement": k, "cache": cache, "seconds": v} for k, v in times.items()]
    except KeyboardInterrupt:
        interrupted = True
    return {
        "benchmark": "startup",
        "args": asdict(cfg),
        "commands": {name: ["python", *argv] for name, argv in commands(cfg).items()},
        "environment": environment(),
        "interrupted": interrupted,
        "model_id": cfg.model or DEFAULT_MODEL,
        "units": {name: unit for name, _, unit in MEASUREMENTS},
        "samples": samples,
        "summary": summarize_runs(samples),
    }
