"""Build and load the native CPU kernels (``*.c`` in this package) as one shared library.

Build: ``cc -O3 -mavx2 -mfma -mf16c -fopenmp -shared`` (:data:`CFLAGS`), cached under
``$BAIGE_CACHE/cpu_kernels`` (default ``~/.cache/baige``, the model cache's root) by a hash of the
sources, flags and compiler version; written to a temporary name and renamed, so concurrent first
uses are safe. No compiler, a CPU without AVX2 or a failed build:
one warning, then the PyTorch reference everywhere (never an error).
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

from baige.kernels.settings import settings

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# -ffp-contract=off: no FMA merges two roundings of the plain-C code (ops.c follows the reference
# op by op); the intrinsics' explicit FMAs are unaffected.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _cache_dir() -> Path:
    return settings().cache_dir / "cpu_kernels"


def native_allowed() -> bool:
    """The settings part of every native-kernel check: ``BAIGE_KERNELS`` unset or ``auto`` (the
    reference and Triton settings never use these kernels) and not inside a ``torch.compile`` trace."""
    return settings().mode == "auto" and not torch.compiler.is_compiling()


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build() -> ctypes.CDLL:
    """Compile (or find in the cache) and load ``qlinear.c``. Raises OSError/RuntimeError on failure."""
    cc = settings().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(src + " ".join(CFLAGS).encode() + version.encode()).hexdigest()[:16]
    out = _cache_dir() / f"baige_cpu-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    lib.baige_qlinear_int8.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int]
    lib.baige_qlinear_int8.restype = None
    lib.baige_qlinear_int4.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int]
    lib.baige_qlinear_int4.restype = None
    f32 = ctypes.c_float
    for name, args, res in [
        ("baige_rms_norm", [_ptr, _i64, _i64, _ptr, f32, _ptr], None),
        ("baige_add_rms_norm", [_ptr, _ptr, _i64, _i64, _ptr, f32, _ptr, _ptr], None),
        ("baige_rope", [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr], None),
        ("baige_store_kv", [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int], None),
        ("baige_silu_mul", [_ptr, _ptr, _i64, _ptr], None),
        ("baige_linear_f32", [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int], None),
        ("baige_linear_f16", [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int], None),
        ("baige_decode_layers", [_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, f32, f32, _i64, _i64, _ptr, _ptr,
                                 _ptr, _ptr, _ptr, _i64, _ptr, _int, _ptr, _int], _int),
        ("baige_paged_decode_attention", [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr,
                                          f32, _ptr, _int, _int], _int),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first call; None where it cannot run (warned once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                if not cpu_has_avx2():
                    raise RuntimeError("the CPU has no AVX2")
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"baige: native CPU kernels unavailable ({e}); using PyTorch", stacklevel=2)
                _lib = None
            _tried = True
    return _lib
