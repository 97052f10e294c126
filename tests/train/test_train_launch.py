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
    env = {"SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_NTASKS": "16",
           "SLURM_JOB_NODELIST": "gpu-a[017-018]", "SLURM_STEP_NODELIST": "gpu-a[017-018]"}
    assert dist_env_from_slurm(env) == {"RANK": "13", "LOCAL_RANK": "5", "WORLD_SIZE": "16",
                                        "MASTER_ADDR": "gpu-a017", "MASTER_PORT": "29500"}
    # An explicit MASTER_ADDR / MASTER_PORT (e.g. exported by the sbatch script) wins.
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="6000")
    got = dist_env_from_slurm(env)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.1", "6000")
    # SLURM_NODELIST alone (older SLURM) is enough.
    got = dist_env_from_slurm({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1,n2"})
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
