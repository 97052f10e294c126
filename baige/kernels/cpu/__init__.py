"""Native CPU kernels: C with AVX2/FMA intrinsics, compiled on first use by the system C compiler and
called through ctypes (no PyTorch headers, so the build takes about a second).

Only the weight-only quantized linear lives here (``qlinear.c``): on CPU, PyTorch has no fast
int8/int4 weight-only matmul for fp32 activations (``torch._weight_int8pack_mm`` measured 5-20x
slower than fp32 ``F.linear`` on the AVX2 dev box), so without it a quantized checkpoint dequantizes
every weight on every call. Dispatch (:func:`baige.kernels.quantized_linear`): with
``BAIGE_KERNELS`` unset or ``auto``, CPU fp32 inputs that need no gradient and have at most
:data:`MAX_ROWS` rows use this kernel when it builds; larger batches dequantize once and run
PyTorch's sgemm, which is as fast there (compute-bound). ``BAIGE_KERNELS=reference`` never uses it.

Build: ``cc -O3 -mavx2 -mfma -fopenmp -shared``, cached under ``$BAIGE_CACHE/cpu_kernels`` (default
``~/.cache/baige``, the model cache's root) by a hash of the source, flags and compiler version; written to a temporary name
and renamed, so concurrent first uses are safe. No compiler, a CPU without AVX2 or a failed build:
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
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("qlinear.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
# Above this many input rows, dequantize + PyTorch's sgemm is as fast (measured on the dev box's AVX2
# core, 1 thread, SmolLM2-135M shapes: int8 native 84 vs 121 ms at 64 rows, 167 vs 159 at 128;
# int4 g128 92 vs 138 at 32, 184 vs 168 at 64).
MAX_ROWS = {8: 96, 4: 48}

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _cache_dir() -> Path:
    return Path(os.environ.get("BAIGE_CACHE") or Path.home() / ".cache" / "baige").expanduser() / "cpu_kernels"


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build() -> ctypes.CDLL:
    """Compile (or find in the cache) and load ``qlinear.c``. Raises OSError/RuntimeError on failure."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(CFLAGS).encode() + version.encode()).hexdigest()[:16]
    out = _cache_dir() / f"qlinear-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
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
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first call; None where it cannot run (warned once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                if not _cpu_has_avx2():
                    raise RuntimeError("the CPU has no AVX2")
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"baige: native CPU quantized-linear kernel unavailable ({e}); using PyTorch", stacklevel=2)
                _lib = None
            _tried = True
    return _lib


def supports(x: torch.Tensor, qweight: torch.Tensor, group_size: int | None, bias: torch.Tensor | None) -> bool:
    """Whether :func:`quantized_linear` takes these arguments: CPU fp32 ``x`` with at most
    :data:`MAX_ROWS` rows for its bit width and no gradient needed, an int8 per-channel or int4
    weight whose group size is a multiple of 8, and a buildable kernel."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if x.numel() // max(x.shape[-1], 1) > MAX_ROWS[8 if qweight.dtype == torch.int8 else 4]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if qweight.dtype == torch.int8:
        if group_size is not None:
            return False
    elif qweight.dtype != torch.int32 or group_size is None or group_size % 8:
        return False
    return library() is not None


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`baige.kernels.quantized_linear` on the native kernel (same arguments and layouts; call
    only where :func:`supports` is true). Returns (..., out) fp32; no autograd."""
    lib = library()
    shape = x.shape
    k = shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y.view(*shape[:-1], n)
    # per-call work is a handful of pointer reads: decode calls this ~200 times per token
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    s = scale if scale.dtype == torch.float32 and scale.is_contiguous() else scale.float().contiguous()
    if qweight.stride(-1) != 1:
        qweight = qweight.contiguous()
    b_ptr = None if bias is None else bias.data_ptr()
    nthreads = torch.get_num_threads()
    if qweight.dtype == torch.int8:
        lib.baige_qlinear_int8(x2.data_ptr(), m, k, x2.stride(0), qweight.data_ptr(), n, qweight.stride(0),
                               s.data_ptr(), b_ptr, y.data_ptr(), n, nthreads)
    else:
        if k % 8:
            x2 = F.pad(x2, (0, 8 - k % 8))  # zero columns: the padded nibbles multiply 0
        z = None if zero_point is None else zero_point.to(torch.int32).contiguous()
        lib.baige_qlinear_int4(x2.data_ptr(), m, x2.shape[1], x2.stride(0), qweight.data_ptr(), n, qweight.stride(0),
                               s.data_ptr(), None if z is None else z.data_ptr(), s.shape[1], group_size,
                               b_ptr, y.data_ptr(), n, nthreads)
    return y if len(shape) == 2 else y.view(*shape[:-1], n)
