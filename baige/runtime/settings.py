"""The runtime's settings, read from the environment once.

- ``BAIGE_CACHE``: the cache root (models imported from GGUF, token files, the native library);
  read by :mod:`baige.kernels.settings`, the one reader of that variable.
- ``BAIGE_CPU_DECODE=0``: keep CPU decode steps on the per-op path instead of the one-call native
  decode step (:mod:`baige.runtime.infer.cpu_decode`).
- ``BAIGE_CPU_AUTO_DTYPE=auto|float32|bfloat16``: what ``--dtype auto`` runs on the CPU (auto: bf16
  where the CPU has native bf16, else fp32; :func:`baige.runtime.model.device.cpu_auto_dtype`).
- ``BAIGE_CPU_KEEP_HEAP=0``: leave glibc's malloc as it is; by default an engine on the CPU makes it
  keep freed memory for reuse (:func:`baige.kernels.keep_freed_heap`: no page faults per prefill
  temporary).
- ``CXX``: the C++ compiler Inductor would use; ``training.compile = auto`` stays eager without one.
- ``BAIGE_TEST_CHECKPOINT_HOLD=STEP:MARKER`` (fault injection, for tests): the write of step STEP's training
  checkpoint creates the file MARKER before each rank writes its shards and waits until the file is removed
  (at most 600 s): a write held in flight, to kill or to overlap with training
  (:class:`baige.runtime.train.checkpoint.CheckpointManager`).
- ``BAIGE_TEST_FAIL_AT=STEP:RANK`` (fault injection, for tests): training rank RANK kills itself with SIGKILL
  as optimizer step STEP begins, in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0, which
  torchrun's elastic agent raises on each restart; :func:`baige.runtime.train.lifecycle.inject_fault`).

Torch.distributed's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, SLURM's) are read where
torch.distributed needs them (:mod:`baige.runtime.train.parallel`). Code that changes these
variables at run time calls :func:`reload_settings` afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from baige import kernels
from baige.errors import BaigeError


@dataclass(frozen=True)
class RuntimeSettings:
    cache_dir: Path
    cpu_decode: bool
    cpu_auto_dtype: str
    cpu_keep_heap: bool
    cxx: str | None
    checkpoint_hold: tuple[int, Path] | None  # (step, marker file)
    fail_at: tuple[int, int] | None  # (step, rank)
    elastic_restart_count: int


def _step_and(name: str, kind: type) -> tuple[int, object] | None:
    """``STEP:VALUE`` of the variable ``name`` as ``(int, kind(VALUE))``; None when unset.

    Raises:
        BaigeError: a value not of that form.
    """
    text = os.environ.get(name, "")
    if not text:
        return None
    step, sep, value = text.partition(":")
    try:
        if not sep or not value:
            raise ValueError
        return int(step), kind(value)
    except ValueError:
        raise BaigeError(f"{name}={text!r}: expected STEP:{kind.__name__.upper()}") from None


def _read() -> RuntimeSettings:
    auto_dtype = os.environ.get("BAIGE_CPU_AUTO_DTYPE", "auto") or "auto"  # checked where it is used
    return RuntimeSettings(
        cache_dir=kernels.settings().cache_dir,
        cpu_decode=os.environ.get("BAIGE_CPU_DECODE", "1") != "0",
        cpu_auto_dtype=auto_dtype,
        cpu_keep_heap=os.environ.get("BAIGE_CPU_KEEP_HEAP", "1") != "0",
        cxx=os.environ.get("CXX") or None,
        checkpoint_hold=_step_and("BAIGE_TEST_CHECKPOINT_HOLD", Path),
        fail_at=_step_and("BAIGE_TEST_FAIL_AT", int),
        elastic_restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    )


_current: list[RuntimeSettings] = [_read()]


def settings() -> RuntimeSettings:
    return _current[0]


def reload_settings() -> RuntimeSettings:
    """Re-read the environment, the kernels' settings included."""
    kernels.reload_settings()
    _current[0] = _read()
    return _current[0]
