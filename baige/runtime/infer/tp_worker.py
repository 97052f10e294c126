"""Tensor-parallel serving processes: rank 0 runs the engine (scheduler, sampler, HTTP), ranks
1..N-1 run :func:`worker_loop`, and every rank holds its shard of the model
(:mod:`~baige.runtime.infer.tensor_parallel`) and of the paged KV cache.

Launch (:func:`start_tensor_parallel`):

- one machine: rank 0 starts N-1 worker processes (``python -m baige.runtime.infer.tp_worker``; a
  child process, not ``multiprocessing`` spawn, so a user's script need no ``__main__`` guard), which
  meet it through a ``file://`` rendezvous in a private temp directory;
- several machines: every rank runs the same ``baige ...`` command under ``torchrun --nnodes`` (or
  ``srun``, whose variables map as in training); ``WORLD_SIZE`` must equal
  ``--tensor-parallel-size``; rank 0 serves, the others run the worker loop and exit with it.

Each engine has its own process groups (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a
``FileStore`` or torchrun's store; torch.distributed's default group is never initialised). Each step
rank 0 sends the step's flat inputs (:class:`~baige.runtime.infer.step_inputs.StepInputs`: token ids,
positions, slots, block tables -- a few KB, pickled) as one gloo broadcast of a
:data:`STEP_BYTES`-byte tensor (a second one only for a larger step), then every rank runs the same
forward. A tensor broadcast, not a shared-memory ring, because it is the one transport that also
spans machines; on a CPU host one costs a small fraction of a decode step even of a 135M model
(docs/benchmarks/archive.md, "Tensor-parallel serving on the CPU"). On GPU the metadata stays on the
gloo group (vLLM's ``cpu_group``); the model's collectives use NCCL.

Liveness: a step that raises on any rank is fatal for the group (the ranks' collectives could be out of
step), so a worker exits non-zero on any error, and rank 0 raises :class:`WorkerDied`: the serving
loop stops, /health answers 503 and the server exits non-zero. Rank 0 watches its child processes
(a worker that dies between steps is noticed at once) and pings the workers every
:data:`HEARTBEAT_S` seconds while idle (the gloo timeout, :data:`TIMEOUT`, would otherwise end an idle
worker's wait); workers die with rank 0 (``PR_SET_PDEATHSIG``, and a closed connection ends any wait).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.outputs import EngineDeadError
from baige.runtime.infer.pooling import pooling_runner
from baige.runtime.infer.step_inputs import StepInputs, forward_step
from baige.runtime.infer.tensor_parallel import Comm, check_shardable, shard_model
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import resolve_device
from baige.runtime.model.transformer import Transformer
from baige.runtime.weights.loader import load_model

logger = logging.getLogger("baige.engine")

HEARTBEAT_S = 30.0  # idle ping period, well inside TIMEOUT
TIMEOUT = timedelta(minutes=10)  # the groups' per-operation timeout
STEP_BYTES = 16384  # the step broadcast's fixed size: an 8-byte length, then the pickled step
_STOP, _PING = "stop", "ping"


class WorkerDied(EngineDeadError):
    """A tensor-parallel rank died or a step failed on one: the group cannot go on."""


def load_engine_model(
    cfg: EngineConfig, model_dir: Path, comm: Comm | None = None, pooling: bool = False
) -> Transformer:
    """The serving model of one rank: loaded (``pooling``: as ``load_model``'s, for the pooling runner),
    sharded for tensor parallelism with ``comm`` (every rank reads the whole checkpoint, then keeps its
    shard), then ``cfg.quantization`` applied. Raises BaigeError (load, shard or quantization errors)."""
    device = resolve_device(cfg.device)
    if device.type == "cuda" and comm is not None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = load_model(model_dir, cfg.dtype, device, pooling=pooling)
    if comm is not None:
        shard_model(model, comm, cfg.enable_expert_parallel)
    if cfg.quantization:
        from baige.runtime.quant.fp16_weight import apply_quantization

        apply_quantization(model, cfg.quantization)
    return model


def kv_config(model: Transformer) -> ModelConfig:
    """The config that sizes this rank's KV cache: the model's, with its own KV heads per layer."""
    kv_heads = model.model.layers[0].self_attn.n_kv_heads
    cfg = model.config
    return cfg if kv_heads == cfg.num_key_value_heads else dataclasses.replace(cfg, num_key_value_heads=kv_heads)


def _to(s: StepInputs, device: torch.device) -> StepInputs:
    """The step's tensors moved to ``device`` (CPU for the broadcast, the model's after it)."""

    def mv(t):
        return None if t is None else t.to(device)

    return dataclasses.replace(
        s,
        input_ids=mv(s.input_ids),
        positions=mv(s.positions),
        slot_mapping=mv(s.slot_mapping),
        decode_groups=[(mv(t), mv(n)) for t, n in s.decode_groups],
        prefill_block_tables=mv(s.prefill_block_tables),
        prefill_cu_seqlens=mv(s.prefill_cu_seqlens),
        prefill_context_lens=mv(s.prefill_context_lens),
        logit_rows=[mv(r) for r in s.logit_rows],
        hidden_rows=mv(s.hidden_rows),
    )


def _broadcast(obj, comm: Comm) -> object:
    """Rank 0's ``obj`` on every rank (pickled; one broadcast of STEP_BYTES, a second for the rest)."""
    buf = torch.zeros(STEP_BYTES, dtype=torch.uint8)
    if comm.rank == 0:
        data = pickle.dumps(obj)
        head = len(data).to_bytes(8, "little") + data[: STEP_BYTES - 8]
        buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    comm.broadcast(buf)
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    rest = torch.zeros(max(0, n - (STEP_BYTES - 8)), dtype=torch.uint8)
    if rest.numel():
        if comm.rank == 0:
            rest[:] = torch.frombuffer(bytearray(data[STEP_BYTES - 8 :]), dtype=torch.uint8)
        comm.broadcast(rest)
    if comm.rank == 0:
        return obj
    return pickle.loads(buf[8 : 8 + n].numpy().tobytes() + rest.numpy().tobytes())


class TensorParallelGroup:
    """Rank 0's handle on the group: sends steps, watches the workers, stops them.

    Args:
        comm: the model's collectives (rank 0's shard is built on it).
        cpu_comm: the gloo group steps travel on (``comm`` itself on CPU).
        processes: the worker processes rank 0 started (none under torchrun).
        rendezvous: their private temp directory (the store and the workers' spec), removed on close.
    """

    def __init__(self, comm: Comm, cpu_comm: Comm, processes: list[subprocess.Popen], rendezvous: Path | None = None):
        self.comm, self.cpu_comm, self.processes, self.rendezvous = comm, cpu_comm, processes, rendezvous
        self.world_size = comm.world_size
        self.lock = threading.Lock()
        self.dead: str | None = None
        self.on_death: list[Callable[[str], None]] = []
        self._closing = False
        self._last = time.monotonic()
        for r, p in enumerate(processes, start=1):
            threading.Thread(target=self._watch, args=(r, p), name=f"baige-tp-watch-{r}", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="baige-tp-heartbeat", daemon=True).start()
        atexit.register(self.close)

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        if not self._closing:
            self._died(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {code}")

    def _died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        logger.critical("%s; the engine cannot go on", why)
        for fn in list(self.on_death):
            fn(why)

    def _heartbeat(self) -> None:
        while not self._closing and self.dead is None:
            time.sleep(1.0)
            if time.monotonic() - self._last < HEARTBEAT_S or not self.lock.acquire(blocking=False):
                continue
            try:
                self._send(_PING)
            except Exception as e:
                self._died(f"tensor-parallel heartbeat failed: {type(e).__name__}: {e}")
            finally:
                self.lock.release()

    def _send(self, obj) -> None:
        _broadcast(obj, self.cpu_comm)
        self._last = time.monotonic()

    def send_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        """Tell the workers the KV pool rank 0 sized (each allocates its shard of it). Raises WorkerDied."""
        with self.step((num_blocks, block_size, dtype)):
            pass

    @contextlib.contextmanager
    def step(self, s: StepInputs | tuple) -> Iterator[None]:
        """Send ``s`` (a step's inputs, or the KV pool's size) to the workers and hold the group
        while rank 0 runs the same forward. Raises WorkerDied when the group is dead or anything
        fails inside (module docstring)."""
        if self.dead is not None:
            raise WorkerDied(self.dead)
        if isinstance(s, StepInputs) and s.input_ids.device.type != "cpu":
            s = _to(s, torch.device("cpu"))
        with self.lock:
            try:
                self._send(s)
                yield
            except Exception as e:
                exited = self._exited_worker(1.0)  # a killed worker often shows first as a gloo error
                failed = f"a tensor-parallel step failed ({type(e).__name__}: {e})"
                self._died(f"{exited}; {failed}" if exited else failed)
                raise WorkerDied(self.dead) from e

    def _exited_worker(self, wait_s: float) -> str | None:
        """Which started worker has exited, waiting up to ``wait_s`` seconds for one; None if none has."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self.processes, start=1):
                if p.poll() is not None:
                    return f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.returncode}"
            if not self.processes or time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the workers (a stop message, then a bounded wait, then SIGKILL) and leave the group."""
        if self._closing:
            return
        self._closing = True
        if self.dead is None and self.lock.acquire(timeout=5):
            try:
                self._send(_STOP)
            except Exception as e:  # noqa: BLE001 - a worker already gone: it is killed below either way
                logger.debug("tensor-parallel stop message not delivered: %s", e)
            finally:
                self.lock.release()
        for r, p in enumerate(self.processes, start=1):
            try:
                code = p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                code = "killed: it did not stop within 5 s"
            if code != 0 and self.dead is None:
                logger.warning("tensor-parallel worker rank %d (pid %d) exited with code %s", r, p.pid, code)
        if self.rendezvous is not None:
            shutil.rmtree(self.rendezvous, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the workers rank 0 started and remove their rendezvous, without waiting for
        anything (the lock included): for a process that exits at once. Workers under torchrun are
        not this process's to kill; their connection to rank 0 closes when it exits."""
        self._closing = True
        for p in self.processes:
            with contextlib.suppress(OSError):
                p.kill()
        if self.rendezvous is not None:
            shutil.rmtree(self.rendezvous, ignore_errors=True)


def threads_per_rank(world_size: int) -> int:
    """CPU threads each rank uses: this process's torch thread count split over the ranks on the machine."""
    return max(1, torch.get_num_threads() // world_size)


def _torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun or a multi-task srun step, else None."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in os.environ:
            raise BaigeError("srun launch of tensor-parallel serving: set MASTER_ADDR (the first node)")
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
            LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        )
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _groups(store, rank: int, world_size: int, device_type: str) -> tuple[Comm, Comm]:
    """This engine's process groups over ``store``: (the model's: NCCL on CUDA, else gloo; the gloo
    group steps travel on, the same one on CPU)."""
    gloo = Comm(
        dist.ProcessGroupGloo(dist.PrefixStore("baige-tp-gloo", store), rank, world_size, TIMEOUT), rank, world_size
    )
    if device_type != "cuda":
        return gloo, gloo
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = TIMEOUT
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("baige-tp-nccl", store), rank, world_size, opts)
    return Comm(nccl, rank, world_size), gloo


def start_tensor_parallel(cfg: EngineConfig, model_dir: Path) -> TensorParallelGroup:
    """Form the group of ``cfg.tensor_parallel_size`` ranks with this process as rank 0 (module
    docstring). Under torchrun a rank other than 0 runs :func:`worker_loop` here and then exits the
    process. Raises BaigeError for a model that cannot split (before any worker starts) or a torchrun
    world of another size."""
    n = cfg.tensor_parallel_size
    check_shardable(ModelConfig.from_file(model_dir / "config.json"), n, cfg.enable_expert_parallel)
    device_type = resolve_device(cfg.device).type
    launched = _torchrun_env()
    if launched is not None:
        rank, world = launched
        if world != n:
            raise BaigeError(f"--tensor-parallel-size {n} but the launcher started {world} processes (WORLD_SIZE)")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store, _, _ = next(dist.rendezvous("env://", timeout=TIMEOUT))
        comm, cpu_comm = _groups(store, rank, n, device_type)
        if rank:
            raise SystemExit(worker_loop(cfg, model_dir, comm, cpu_comm))
        return TensorParallelGroup(comm, cpu_comm, [])
    threads = threads_per_rank(n)
    torch.set_num_threads(threads)
    rendezvous = Path(tempfile.mkdtemp(prefix="baige-tp-"))
    spec = rendezvous / "spec.pkl"
    spec.write_bytes(
        pickle.dumps(
            {
                "cfg": cfg,
                "model_dir": str(model_dir),
                "world_size": n,
                "threads": threads,
                "store": str(rendezvous / "store"),
                "parent": os.getpid(),
            }
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = [
        subprocess.Popen([sys.executable, "-m", "baige.runtime.infer.tp_worker", str(spec), str(r)], env=env)
        for r in range(1, n)
    ]
    try:
        if device_type == "cuda":
            torch.cuda.set_device(0)
        comm, cpu_comm = _groups(dist.FileStore(str(rendezvous / "store"), n), 0, n, device_type)
    except Exception as e:
        for p in procs:
            p.kill()
        shutil.rmtree(rendezvous, ignore_errors=True)
        raise BaigeError(f"tensor-parallel workers did not join ({type(e).__name__}: {e})") from None
    return TensorParallelGroup(comm, cpu_comm, procs, rendezvous)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker when rank 0's process dies (Linux ``prctl(PR_SET_PDEATHSIG)``, set here at
    start-up rather than in a ``preexec_fn``, which is unsafe in a threaded parent); exit now if it
    already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


def _ignore_stop_signals() -> None:
    """A worker ignores SIGINT and SIGTERM: rank 0 alone decides when the group stops. Ctrl-C in a
    terminal, systemd and torchrun signal every process, and a worker that left at once would fail
    the requests rank 0 is still draining (``baige serve --shutdown-timeout``); it exits on rank 0's
    stop message, with rank 0 (``PR_SET_PDEATHSIG``), or when its connection to rank 0 closes."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def worker_loop(cfg: EngineConfig, model_dir: Path, comm: Comm, cpu_comm: Comm) -> int:
    """A worker rank: load and shard the model, allocate the KV shard rank 0 sizes, then run every
    step rank 0 sends until it says stop. Returns the process exit code: 0 after stop, 1 when
    loading fails (rank 0 meets the same error and reports it). Stop signals are ignored
    (:func:`_ignore_stop_signals`)."""
    _ignore_stop_signals()
    try:
        model = load_engine_model(cfg, model_dir, comm, pooling=pooling_runner(cfg.runner, model_dir) is not None)
    except BaigeError as e:
        logger.info("tensor-parallel rank %d: %s", comm.rank, e)
        return 1
    model.eval()
    device = next(model.parameters()).device
    msg = _broadcast(None, cpu_comm)
    if msg == _STOP:
        return 0
    num_blocks, block_size, dtype = msg
    kv = KVCache(kv_config(model), num_blocks, block_size, dtype, device)
    with torch.inference_mode():
        while True:
            msg = _broadcast(None, cpu_comm)
            if msg == _STOP:
                return 0
            if msg == _PING:
                continue
            forward_step(model, kv, _to(msg, device) if device.type != "cpu" else msg)


def _main(spec_path: str, rank: str) -> int:
    _ignore_stop_signals()  # from the start: a Ctrl-C while the group forms is rank 0's to handle
    spec = pickle.loads(Path(spec_path).read_bytes())
    _die_with_parent(spec["parent"])
    torch.set_num_threads(spec["threads"])
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(message)s")
    cfg: EngineConfig = spec["cfg"]
    r, n = int(rank), spec["world_size"]
    device_type = resolve_device(cfg.device).type
    if device_type == "cuda":
        torch.cuda.set_device(r)
    comm, cpu_comm = _groups(dist.FileStore(spec["store"], n), r, n, device_type)
    return worker_loop(cfg, Path(spec["model_dir"]), comm, cpu_comm)


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
