"""Every Triton kernel compiles for a Hopper GPU (sm_90) with the launch parameters its launcher picks
on CUDA, checked on this CPU-only machine (tests/kernel_compile.py, in a fresh process without
TRITON_INTERPRET). The interpreter tests check the numbers, not compilation: the interpreter accepts
code the GPU compiler rejects (loop-carried type changes, ``tl.dot`` tiles under 16, constexpr misuse)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


# fp32 (IEEE dots, a long ptxas run for the attention kernels on a cold Triton cache) is slow-marked
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_every_kernel_compiles_for_sm90(dtype):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "BAIGE_KERNELS")}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("kernel_compile.py")), dtype, "90"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "compiled" in proc.stdout and "sm_90" in proc.stdout
