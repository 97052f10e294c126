"""``baige bench train --cp N``: tokens/s and memory per rank against sequence length, one process against
context parallel degree N.

For each sequence length, two runs of :func:`~baige.runtime.bench.train.run_train`, each in fresh processes
(a process's peak RSS only grows): one process (plain causal attention, ``kernels.attention``) and N
processes with ``parallelism.context_parallel_degree = N`` (a local gloo group on CPU; nccl with one GPU per
rank on CUDA). On CPU every rank of both runs gets ``cpu_count // N`` threads, so that a rank stands for one
device of the same size. Per run:

- step time: rank 0's median over the timed steps (the ranks step in lockstep);
- tokens/s per device = batch_size * seq_len * grad_accum / step time / ranks;
- per rank, the peak memory (RSS on CPU, max allocated on CUDA) and what the steps added over the
  set-up's peak (``step_memory_bytes``: activations, gradients and optimizer state);
- the last step's loss (CP and one process train on the same data: it must agree).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.bench.common import environment, set_dist_env
from baige.runtime.bench.offline import Progress
from baige.runtime.bench.train import TrainBenchConfig, run_train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, cfg: TrainBenchConfig, threads: int, out: str) -> None:
    """One rank of a run (torch.multiprocessing entry): join the group, run, write ``out/rank{R}.json``."""
    import torch
    import torch.distributed as dist

    set_dist_env(rank, world_size, port)
    torch.set_num_threads(threads)
    result = run_train(cfg, measure_limits=False)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(cfg: TrainBenchConfig, world_size: int, threads: int) -> list[dict]:
    """``run_train(cfg)`` on ``world_size`` fresh processes; their results by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="baige-bench-cp-") as tmp:
        mp.spawn(_rank_main, args=(world_size, _free_port(), cfg, threads, tmp), nprocs=world_size, join=True)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]


def _row(cfg: TrainBenchConfig, ranks: list[dict]) -> dict:
    s0 = ranks[0]["summary"]
    n = len(ranks)
    return {
        "seq_len": cfg.seq_len,
        "context_parallel_degree": n,
        "context_parallel_method": cfg.context_parallel_method if n > 1 else None,
        "step_time_s": s0["step_time_s"],
        "tokens_per_s_per_device": cfg.batch_size * cfg.seq_len * cfg.grad_accum / s0["step_time_s"] / n,
        "peak_memory_bytes": [r["summary"]["peak_memory_bytes"] for r in ranks],
        "step_memory_bytes": [
            r["summary"]["peak_memory_bytes"] - r["summary"]["setup_peak_memory_bytes"] for r in ranks
        ],
        "last_loss": ranks[0]["samples"][-1]["loss"],
    }


def run_train_cp(cfg: TrainBenchConfig, progress: Progress | None = None) -> dict:
    """The sweep over ``cfg.seq_lens`` (or ``cfg.seq_len``): one process, then ``context_parallel_degree``
    processes, per length. Returns the JSON result (``rows``: one per run, see the module docstring).

    Raises:
        BaigeError: a sequence length not a multiple of 2 x the degree, or (CUDA) fewer GPUs than ranks.
    """
    import torch

    n = cfg.context_parallel_degree
    lens = cfg.seq_lens or [cfg.seq_len]
    for length in lens:
        if length % (2 * n):
            raise BaigeError(f"--seq-lens: {length} is not a multiple of 2 x --cp = {2 * n}")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() < n:
        raise BaigeError(f"--cp {n} needs {n} GPUs (one per rank); {torch.cuda.device_count()} visible")
    threads = max(1, (os.cpu_count() or 1) // n)
    rows = []
    for i, length in enumerate(lens):
        for world_size in (1, n):
            one = dataclasses.replace(
                cfg, seq_len=length, context_parallel_degree=world_size, seq_lens=None, compile=False
            )
            rows.append(_row(one, _run(one, world_size, threads)))
            if progress:
                progress(len(rows), 2 * len(lens), f"seq_len {length}, {world_size} rank(s)")
    return {
        "benchmark": "train_cp",
        "args": dataclasses.asdict(cfg),
        "environment": environment(),
        "threads_per_rank": threads,
        "rows": rows,
        "interrupted": False,
    }
