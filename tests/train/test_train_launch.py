"""Launch environments: SLURM variable mapping, host lists, the sbatch template, mesh sizes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from baige.errors import BaigeError
from baige.runtime.train.parallel import ParallelDims, dist_env_from_slurm, expand_hostlist

SBATCH = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "train.sbatch"


def test_expand_hostlist():
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_hostlist("a[9-10]") == ["a9", "a10"]
    with pytest.raises(BaigeError, match="unbalanced"):
        expand_hostlist("gpu[01-03")


def test_slurm_env_mapping_one_task_per_gpu():
    env = {
        "SLURM_PROCID": "13",
        "SLURM_LOCALID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_JOB_NODELIST": "gpu-a[017-018]",
        "SLURM_STEP_NODELIST": "gpu-a[017-018]",
    }
    assert dist_env_from_slurm(env) == {
        "RANK": "13",
        "LOCAL_RANK": "5",
        "WORLD_SIZE": "16",
        "MASTER_ADDR": "gpu-a017",
        "MASTER_PORT": "29500",
    }
    # An explicit MASTER_ADDR / MASTER_PORT (e.g. exported by the sbatch script) wins.
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="6000")
    got = dist_env_from_slurm(env)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.1", "6000")
    # SLURM_NODELIST alone (older SLURM) is enough.
    got = dist_env_from_slurm(
        {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1,n2"}
    )
    assert got["MASTER_ADDR"] == "n1"


def test_slurm_single_task_is_not_distributed():
    assert dist_env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n1"}) is None
    assert dist_env_from_slurm({}) is None


def test_sbatch_template_parses():
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = SBATCH.read_text()
    assert "--rdzv-backend=c10d" in text and "--no-python baige train" in text


def test_parallel_dims():
    assert ParallelDims.resolve(8, 2, -1, 2) == ParallelDims(2, 2, 2)
    assert ParallelDims.resolve(1, 1, -1, 1).dp_size == 1
    with pytest.raises(BaigeError, match="not divisible"):
        ParallelDims.resolve(6, 1, -1, 4)
    with pytest.raises(BaigeError, match="world_size 8"):
        ParallelDims.resolve(8, 1, 2, 2)


def test_parallel_dims_with_pipeline():
    dims = ParallelDims.resolve(8, 1, -1, 2, pp=2)
    assert dims == ParallelDims(1, 2, 2, 1, 2) and dims.dp_size == 2 and dims.model_parallel_size == 4
    with pytest.raises(BaigeError, match="pipeline_parallel_degree 3 does not divide world_size 8"):
        ParallelDims.resolve(8, 1, -1, 1, pp=3)
    with pytest.raises(
        BaigeError, match=r"2 \(pp\) x 1 \(replicate\) x 4 \(shard\) x 1 \(cp\) x 1 \(tp\) != world_size 4"
    ):
        ParallelDims.resolve(4, 1, 4, 1, pp=2)


def test_parallel_dims_with_context_parallel():
    """CP ranks come out of the data-parallel shard degree; FSDP averages over dp_shard x cp."""
    dims = ParallelDims.resolve(8, 1, -1, 2, cp=2)
    assert dims == ParallelDims(1, 2, 2, 1, 1, 2) and dims.dp_size == 2 and dims.dp_cp_size == 4
    assert dims.model_parallel_size == 2 and dims.fsdp_enabled
    assert ParallelDims.resolve(2, 1, -1, 1, cp=2).fsdp_enabled  # cp alone: FSDP over the cp ranks
    with pytest.raises(BaigeError, match="context_parallel_degree x tensor_parallel_degree = 6"):
        ParallelDims.resolve(8, 1, -1, 3, cp=2)


def _slurm_stand_ins(tmp_path: Path, **bodies: str) -> dict[str, str]:
    """The environment of a 2-node SLURM job (node[1-2], job 7) whose PATH starts with bash stand-ins for the
    tools named in ``bodies`` (each runs its body), written into ``tmp_path / "bin"``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool, body in bodies.items():
        (bindir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / tool).chmod(0o755)
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "7",
    }


def test_sbatch_multi_node_pp_runs_torchrun_once_per_node_with_pp(tmp_path):
    """The template under stand-in srun/scontrol/torchrun (each prints its arguments): PP=2 on 2 nodes."""
    # scontrol writes line by line: the template must read them all (a reader that stops early would
    # SIGPIPE it, a 141 exit under pipefail)
    env = _slurm_stand_ins(
        tmp_path,
        scontrol="echo node1; sleep 0.2; echo node2",
        srun='echo "srun $*"; shift 2; "$@"',
        torchrun='echo "torchrun $*"',
    )
    env |= {"PP": "2", "GPUS_PER_NODE": "8"}
    out = subprocess.run(["bash", str(SBATCH), "--config", "run.toml"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    srun, torchrun = out.stdout.splitlines()
    assert srun.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun")
    assert "--nnodes=2 --nproc-per-node=8" in torchrun and "--rdzv-endpoint=node1:29500" in torchrun
    assert torchrun.endswith("--no-python baige train --pp 2 --config run.toml")


def test_serve_sbatch_runs_one_torchrun_per_node_with_tp_over_every_gpu(tmp_path):
    """scripts/slurm/serve.sbatch under stand-in srun/scontrol/torchrun: 2 nodes x 4 GPUs -> TP=8, a
    static rendezvous whose node rank is the task's SLURM_NODEID, the user's flags passed through."""
    sbatch = SBATCH.with_name("serve.sbatch")
    env = _slurm_stand_ins(
        tmp_path, scontrol="echo node1; echo node2", srun='shift 2; SLURM_NODEID=1 "$@"', torchrun='echo "torchrun $*"'
    )
    env["GPUS_PER_NODE"] = "4"
    out = subprocess.run(
        ["bash", str(sbatch), "--model", "m dir", "--max-num-seqs", "8"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "torchrun --nnodes=2 --node-rank=1 --nproc-per-node=4 --master-addr=node1 "
        "--master-port=29500 --no-python baige serve --host 0.0.0.0 --port 8000 "
        "--tensor-parallel-size 8 --model m dir --max-num-seqs 8"
    )
