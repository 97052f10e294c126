"""`baige serve --data-parallel-size`'s launch plan without starting anything: each rank's command line
(the router's options taken out) and environment (GPUs split by tensor-parallel groups, CPU threads split,
launcher variables removed), and its one-line errors."""

from __future__ import annotations

import pytest

from baige.cli.serve import rank_args
from baige.errors import BaigeError
from baige.runtime.router.dp import rank_environments


def test_rank_args_drop_the_routers_options():
    argv = ["serve", "--model", "m", "--port", "8000", "--host=0.0.0.0", "--data-parallel-size", "2"]
    argv += ["--api-key", "k", "--max-num-seqs", "4", "--lora-modules", "a=/x", "--lora-modules", "b=/y"]
    assert rank_args(argv) == [
        "--model",
        "m",
        "--max-num-seqs",
        "4",
        "--lora-modules",
        "a=/x",
        "--lora-modules",
        "b=/y",
    ]
    assert rank_args(["serve", "--data-parallel-size=3", "--model", "serve"]) == ["--model", "serve"]


def test_rank_environments_split_gpus_and_threads(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.setenv(name, "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,9")
    envs = rank_environments(2, 2, gpus=5)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert not {"RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"} & set(envs[0])
    with pytest.raises(BaigeError, match="needs 6 GPUs; 5 visible"):
        rank_environments(3, 2, gpus=5)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in rank_environments(4, 1, gpus=4)] == ["0", "1", "2", "3"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # given: each rank gets that many
    assert [e["OMP_NUM_THREADS"] for e in rank_environments(2, 1, gpus=0)] == ["3", "3"]
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [e["OMP_NUM_THREADS"] for e in rank_environments(3, 1, gpus=0)] == ["2", "2", "2"]
    assert [e["OMP_NUM_THREADS"] for e in rank_environments(16, 1, gpus=0)] == ["1"] * 16


def test_data_parallel_cli_errors(cli_error, tmp_path):
    assert "--data-parallel-size" in cli_error("serve", "--data-parallel-size", "0")
    import torch

    if not torch.cuda.is_available():
        assert "no CUDA device" in cli_error("serve", "--device", "cuda", "--data-parallel-size", "2", "--port", "0")


def test_stop_forwards_the_signal_it_got(tmp_path):
    """The ranks get the parent's signal itself (SIGTERM stays SIGTERM); a clean exit of every rank is
    reported clean, a rank that exits non-zero is not."""
    import signal
    import subprocess
    import sys

    from baige.runtime.router.dp import _stop

    code = (
        "import signal, sys, time\n"
        "def on(sig, _):\n"
        "    print(signal.Signals(sig).name, flush=True); sys.exit(int(sys.argv[1]))\n"
        "signal.signal(signal.SIGTERM, on); signal.signal(signal.SIGINT, on)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, rc], stdout=subprocess.PIPE, text=True) for rc in ("0", "0")]
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
    assert _stop(procs, signal.SIGTERM, 30) is True
    assert [p.stdout.read().strip() for p in procs] == ["SIGTERM", "SIGTERM"]
    procs = [subprocess.Popen([sys.executable, "-c", code, rc], stdout=subprocess.PIPE, text=True) for rc in ("0", "3")]
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
    assert _stop(procs, signal.SIGINT, 30) is False
    assert [p.stdout.read().strip() for p in procs] == ["SIGINT", "SIGINT"] and procs[1].returncode == 3
