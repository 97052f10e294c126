"""What the native CPU library runs on here (instruction-set variant, flags, integer dot, native bf16),
re-exported by :mod:`baige.kernels` as part of its public API."""

from __future__ import annotations

from baige.kernels.settings import int_dot_passes, settings


def cpu_isa() -> str | None:
    """The instruction-set variant of the native CPU library ops use (``avx2``, ``avx512_vnni``, ...;
    see :mod:`baige.kernels.cpu.isa`), or None where the library cannot run (no AVX2, no compiler).
    Builds the library on first call."""
    from baige.kernels.cpu import build

    return build.current_isa() if build.library() is not None else None


def cpu_isa_flags() -> list[str]:
    """This CPU's instruction-set flags worth recording beside a benchmark number (``avx2``,
    ``avx512_vnni``, ``amx_tile``, ...), as /proc/cpuinfo names them."""
    from baige.kernels.cpu import isa

    return isa.reported_flags()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16's vdpbf16ps or AMX-BF16 tiles, as
    /proc/cpuinfo reports ``avx512_bf16`` / ``amx_bf16``): where bf16 matmuls beat fp32 ones."""
    from baige.kernels.cpu import isa

    return bool({"avx512_bf16", "amx_bf16"} & isa.cpu_flags())


def cpu_int_dot() -> bool:
    """Whether int8/int4 linears on CPU run as integer dot products over int8-rounded activations
    (``BAIGE_CPU_INT_DOT``, on by default; :mod:`baige.kernels.cpu.qlinear`)."""
    return settings().cpu_int_dot


def cpu_int_dot_passes() -> int:
    """The integer-dot linears' activation passes (``BAIGE_CPU_INT_DOT_PASSES``: 1 or 2, default 2).

    Raises:
        ValueError: one line, for any other value.
    """
    return int_dot_passes()


def native_cpu_available() -> bool:
    """Whether the native CPU library is built and loadable here (builds it on first call)."""
    from baige.kernels.cpu import library

    return library() is not None


def native_allowed() -> bool:
    """Whether the settings let ops use the native CPU kernels (``BAIGE_KERNELS`` auto, and not
    inside a ``torch.compile`` trace)."""
    from baige.kernels.cpu import native_allowed as allowed

    return allowed()
