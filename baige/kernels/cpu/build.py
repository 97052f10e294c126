"""Build and load the native CPU kernels (``*.c`` in this package) as one shared library per
instruction-set variant (:mod:`baige.kernels.cpu.isa`), the one in force picked at run time.

Build: ``cc -O3 <variant flags> -fopenmp -shared`` (:data:`CFLAGS` + ``isa.VARIANTS``), cached under
``$BAIGE_CACHE/cpu_kernels`` (default ``~/.cache/baige``, the model cache's root) by a hash of the
sources (read once per build and compiled from copies of exactly those bytes), flags and compiler
version; one process compiles while others wait on a lock file beside the library (``filelock``), and the
library is written to a temporary name and renamed, so concurrent first uses (torchrun ranks, pytest
workers, data-parallel servers) compile it once and never read a half-written file. Only the variant in
use is built (``BAIGE_CPU_ISA``, else the best the CPU supports).
No compiler, a CPU without AVX2 or a failed build: one warning, then the PyTorch reference everywhere
(never an error; a ``BAIGE_CPU_ISA`` the CPU lacks is refused at start-up by ``kernels.check_startup``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from filelock import FileLock

from baige.kernels.cpu import isa
from baige.kernels.cpu.abi import SIGNATURES
from baige.kernels.settings import settings

_HERE = Path(__file__).parent
# -ffp-contract=off: no FMA merges two roundings of the plain-C code (ops.c follows the reference
# op by op); the intrinsics' explicit FMAs are unaffected. The instruction-set flags are the variant's.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_libs: dict[str, ctypes.CDLL | None] = {}  # variant -> its library (None: it could not be built)
_resolved: dict[str, str | None] = {}  # BAIGE_CPU_ISA value -> the variant it selects
_lock = threading.Lock()


def _cache_dir() -> Path:
    return settings().cache_dir / "cpu_kernels"


def native_allowed() -> bool:
    """The settings part of every native-kernel check: ``BAIGE_KERNELS`` unset or ``auto`` (the
    reference and Triton settings never use these kernels) and not inside a ``torch.compile`` trace."""
    return settings().mode == "auto" and not torch.compiler.is_compiling()


def cpu_has_avx2() -> bool:
    return isa.best() is not None


def current_isa() -> str | None:
    """The variant ops use now: ``BAIGE_CPU_ISA`` when it names one this CPU supports, else the best
    supported one (a bad value is refused at start-up, see ``kernels.check_startup``); None without AVX2."""
    requested = settings().cpu_isa
    if requested not in _resolved:  # once per setting: library() runs on every op call
        try:
            _resolved[requested] = isa.resolve(requested)
        except ValueError:
            _resolved[requested] = isa.best()
    return _resolved[requested]


def compile_variant(variant: str) -> Path:
    """Compile (or find in the cache) the library for ``variant``; any variant compiles on any x86-64
    machine whose compiler knows its flags. Returns the .so path. Raises OSError/RuntimeError."""
    cc = settings().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    # the sources as they are now, read once: the key hashes these bytes and the compiler reads copies of
    # them, so a file edited (or a checkout switched) during a build cannot land under the wrong key
    files = {p.name: p.read_bytes() for p in sorted([*_HERE.glob("*.c"), *_HERE.glob("*.h")])}
    flags = [*CFLAGS, *isa.VARIANTS[variant][1]]
    digest = hashlib.sha256(" ".join(flags).encode() + version.encode())
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    out = _cache_dir() / f"baige_cpu-{variant}-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.with_suffix(".lock"))):
        if not out.exists():  # another process may have built it while this one waited
            _compile(cc, flags, files, out)
    return out


def _compile(cc: str, flags: list[str], files: dict[str, bytes], out: Path) -> None:
    """Compile ``files`` (name -> source bytes) with ``cc flags`` into ``out``, through a temporary file
    in ``out``'s directory renamed at the end. Raises RuntimeError with the compiler's message."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="baige-cc-") as src_dir:
            for name, data in files.items():
                Path(src_dir, name).write_bytes(data)
            sources = [str(Path(src_dir, name)) for name in files if name.endswith(".c")]
            # --no-undefined: a library missing one of its own functions fails here, not at load
            r = subprocess.run(
                [cc, *flags, *sources, "-o", tmp, "-lm", "-Wl,--no-undefined"], capture_output=True, text=True
            )
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(variant: str) -> ctypes.CDLL:
    """Compile (or find) and load ``variant``'s library, its functions typed (:data:`.abi.SIGNATURES`).
    Raises OSError/RuntimeError."""
    lib = ctypes.CDLL(str(compile_variant(variant)))
    for name, args, res in SIGNATURES:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.baige_set_int8_prefetch(int(isa.int8_prefetch()))
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library of :func:`current_isa`, built on first use; None where it cannot run
    (warned once per variant)."""
    variant = current_isa()
    if variant in _libs:
        return _libs[variant]
    with _lock:
        if variant not in _libs:
            try:
                if variant is None:
                    raise RuntimeError("the CPU has no AVX2")
                _libs[variant] = _build(variant)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"baige: native CPU kernels unavailable ({e}); using PyTorch", stacklevel=2)
                _libs[variant] = None
    return _libs[variant]
