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
  Ctrl-C stops the router, then the ranks (SIGINT, SIGKILL after 15 s).
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


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


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


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


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
) -> None:
    """Run ``len(envs)`` ranks of ``baige serve serve_args`` (rank i with ``--host 127.0.0.1 --port P``
    added and the environment ``envs[i]``) behind a ``least_load`` router on ``host:port``, until
    interrupted or every rank has exited.

    Raises:
        BaigeError: the router's port cannot be bound, a rank fails to start in ``startup_timeout``
        seconds, or every rank exited while serving.
    """
    sock = listen(host, port)  # a busy port fails now, before any model loads
    # SIGTERM as an exception, so the ranks are stopped on the way out (uvicorn re-raises the signal it
    # caught once it has shut down; with the default handler the process would die on the spot)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
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
        _wait_healthy(urls, procs, startup_timeout)
        cfg = RouterConfig(policy="least_load", backends=urls, host=host, port=port, log_level=log_level)
        server = make_server(cfg)
        logger.info("data parallel: %d ranks (%s) behind http://%s:%d", len(urls), ", ".join(urls), host, port)
        threading.Thread(target=_watch, args=(procs, server, stop, all_exited), daemon=True).start()
        server.run(sockets=[sock])
    finally:
        stop.set()
        sock.close()
        _stop(procs)
    if all_exited.is_set():
        raise BaigeError("every data-parallel rank exited; see their logs above")
