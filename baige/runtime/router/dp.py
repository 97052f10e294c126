"""Data-parallel serving in one command (``baige serve --data-parallel-size N``, vLLM's DP): N
``baige serve`` processes on free local ports, each a whole engine (its own threads, or its own GPUs),
behind one router on the command's ``--host``/``--port``.

- Devices: with ``gpus`` > 0, rank i sees GPUs ``[i*tp, (i+1)*tp)`` of the visible ones
  (``CUDA_VISIBLE_DEVICES``); on the CPU the cores are split, ``OMP_NUM_THREADS`` = cores // N each
  (unless set already: then every rank gets that many).
- Launcher variables (``RANK``, ``WORLD_SIZE``, SLURM's task ids) are removed from the ranks'
  environment: each rank is a one-machine server, whose own tensor parallelism starts its workers.
- The router checks the ranks' health as ``baige router`` does: a rank that exits is taken out of
  rotation and the others go on serving; when every rank has exited the command exits non-zero.
  SIGTERM or SIGINT drains the router (up to 5 s), then sends that same signal to the ranks, which
  drain as ``baige serve`` does, and exits 0 once every rank has exited 0 (SIGKILL to a rank still
  running after ``--shutdown-timeout`` + 15 s, and then a non-zero exit). A second signal forwards it
  to the ranks (which exit at once) and exits at once, 128 + the signal's number.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from baige.errors import BaigeError
from baige.runtime.config import RouterConfig
from baige.runtime.router.app import listen, make_server

logger = logging.getLogger("baige.router")

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


def rank_environments(size: int, tensor_parallel_size: int, gpus: int) -> list[dict[str, str]]:
    """Each rank's environment (module docstring). Raises BaigeError when ``gpus`` > 0 but fewer than
    ``size * tensor_parallel_size``."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    if gpus:
        need = size * tensor_parallel_size
        visible = base.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        if len(ids) < need:
            raise BaigeError(
                f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs {need} GPUs; "
                f"{len(ids)} visible"
            )
        tp = tensor_parallel_size
        return [dict(base, CUDA_VISIBLE_DEVICES=",".join(ids[i * tp : (i + 1) * tp])) for i in range(size)]
    threads = base.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // size))
    return [dict(base, OMP_NUM_THREADS=threads) for _ in range(size)]


class _Stopping(BaseException):
    """The first SIGTERM/SIGINT (outside uvicorn's own handling, which replays it once it has drained)."""


class _Signals:
    """The parent's SIGTERM/SIGINT handler: the first signal raises :class:`_Stopping` and is kept for
    the ranks; the next forwards itself to the ranks and exits at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.procs: list[subprocess.Popen] = []

    def __call__(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signum
            raise _Stopping()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)
        os._exit(128 + signum)


def _free_port() -> int:
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    """Until every rank's /health answers 200. Raises BaigeError when one exits or after ``timeout`` s."""
    pending = set(range(len(urls)))
    deadline = time.monotonic() + timeout
    while pending:
        for i in sorted(pending):
            if procs[i].poll() is not None:
                raise BaigeError(f"data-parallel rank {i} exited with code {procs[i].returncode} while starting")
            try:
                if httpx.get(f"{urls[i]}/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise BaigeError(f"data-parallel ranks {sorted(pending)} were not healthy within {timeout:.0f} s")
        time.sleep(0.25)


def _stop(procs: list[subprocess.Popen], signum: int, grace: float) -> bool:
    """Send ``signum`` to the running ranks and wait ``grace`` s for them; SIGKILL those left. True when
    every rank exited 0."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    deadline = time.monotonic() + grace
    clean = True
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        clean = clean and p.returncode == 0
    return clean


def _watch(procs: list[subprocess.Popen], server, stop: threading.Event, all_exited: threading.Event) -> None:
    """Log each rank that exits; stop the router once none is left (and set ``all_exited``)."""
    seen: set[int] = set()
    while not stop.wait(0.5):
        for i, p in enumerate(procs):
            if i not in seen and p.poll() is not None:
                seen.add(i)
                logger.error("data-parallel rank %d exited with code %s", i, p.returncode)
        if len(seen) == len(procs):
            all_exited.set()
            server.should_exit = True
            return


def serve_data_parallel(
    serve_args: list[str],
    envs: list[dict[str, str]],
    host: str,
    port: int,
    log_level: str = "info",
    startup_timeout: float = 1800,
    shutdown_timeout: float = 30.0,
) -> None:
    """Run ``len(envs)`` ranks of ``baige serve serve_args`` (rank i with ``--host 127.0.0.1 --port P``
    added and the environment ``envs[i]``) behind a ``least_load`` router on ``host:port``, until
    interrupted or every rank has exited. Returns after a clean drain on SIGTERM/SIGINT (module
    docstring); ``shutdown_timeout`` is the ranks' ``--shutdown-timeout``.

    Raises:
        BaigeError: the router's port cannot be bound, a rank fails to start in ``startup_timeout``
        seconds, every rank exited while serving, or a rank did not exit 0 when stopped.
    """
    sock = listen(host, port)  # a busy port fails now, before any model loads
    # uvicorn handles SIGTERM/SIGINT while the router serves and replays the signal once it has drained;
    # this handler then turns it into _Stopping, so the ranks get the same signal on the way out
    signals = _Signals()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signals)
    ports = [_free_port() for _ in envs]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    stop, all_exited = threading.Event(), threading.Event()
    try:
        for env, rank_port in zip(envs, ports):
            argv = [
                sys.executable,
                "-m",
                "baige",
                "serve",
                *serve_args,
                "--host",
                "127.0.0.1",
                "--port",
                str(rank_port),
            ]
            procs.append(subprocess.Popen(argv, env=env))
            signals.procs = procs
        _wait_healthy(urls, procs, startup_timeout)
        cfg = RouterConfig(policy="least_load", backends=urls, host=host, port=port, log_level=log_level)
        server = make_server(cfg)
        logger.info("data parallel: %d ranks (%s) behind http://%s:%d", len(urls), ", ".join(urls), host, port)
        threading.Thread(target=_watch, args=(procs, server, stop, all_exited), daemon=True).start()
        server.run(sockets=[sock])
    except _Stopping:
        pass
    finally:
        stop.set()
        sock.close()
        clean = _stop(procs, signals.received or signal.SIGINT, shutdown_timeout + 15)
    if signals.received is not None:
        logger.info("data parallel: stopped by signal %d", signals.received)
        if not clean:
            codes = ", ".join(str(p.returncode) for p in procs)
            raise BaigeError(f"data-parallel ranks did not all exit 0 when stopped (exit codes {codes})")
        return
    if all_exited.is_set():
        raise BaigeError("every data-parallel rank exited; see their logs above")
