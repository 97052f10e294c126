"""baige/runtime/train/host_memory.py: after keep_freed_memory, freed tensors' memory is reused by the next
step's allocations without new page faults (glibc; elsewhere the call reports False). Measured in a fresh
process (the test process's heap holds other tests' allocations)."""

import subprocess
import sys

PROGRAM = """
import resource, sys, torch
from baige.runtime.train import host_memory
applied = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():  # one "step": 32 tensors of 3 MiB (a layer's gradients), filled, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = [torch.empty(3 << 20, dtype=torch.uint8) for _ in range(32)]
    for t in ts:
        t.fill_(1)
    del ts, t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
counts = [faults() for _ in range(6)]  # 24,576 pages each
print(applied, counts[-1])
"""


def _run(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True, timeout=120)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_freed_memory_is_reused_without_page_faults():
    applied, faults = _run("keep")
    if applied == "False":
        return  # no glibc mallopt here: nothing to check
    assert applied == "True"
    # the sixth step reuses the earlier steps' pages (under 1% of 24,576 faulted); glibc's default (its
    # dynamic thresholds) faults all of them again in some runs and none in others, so it is not asserted
    assert faults < 245
