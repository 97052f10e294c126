"""Which instruction-set variant of the native CPU library this machine runs, decided at run time.

The library is compiled once per variant (:data:`VARIANTS`, lowest first; each level's compiler flags
include the levels below it) and the best one the CPU supports is loaded, never an instruction set
assumed at build time. ``BAIGE_CPU_ISA`` (read by :mod:`baige.kernels.settings`) forces a variant,
which must be one the CPU supports: tests run every supported variant this way, so an AVX-512 machine
also tests the AVX2 path.

Flags come from ``/proc/cpuinfo`` (the kernel's view of CPUID, names as Linux prints them); elsewhere
from torch's own CPU capability (AVX2 or AVX-512 F only).

| variant | needs (cpuinfo flags) | extra compiler flags |
|---|---|---|
| ``avx2`` | avx2 fma f16c | -mavx2 -mfma -mf16c |
| ``avx2_vnni`` | + avx_vnni (AVX-VNNI, Alder Lake / Zen 5) | -mavxvnni |
| ``avx512`` | + avx512f avx512bw avx512vl | -mavx512f -mavx512bw -mavx512vl |
| ``avx512_vnni`` | + avx512_vnni | -mavx512vnni |
| ``avx512_bf16`` | + avx512_bf16 (Zen 4, Sapphire Rapids) | -mavx512bf16 |
| ``avx512_amx`` | + amx_tile amx_bf16 amx_int8 (Sapphire Rapids and later) | -mamx-tile -mamx-bf16 -mamx-int8 |
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# name -> (cpuinfo flags needed, compiler flags), lowest first; every level includes the ones above it
# in its chain (avx2_vnni branches off avx2; the AVX-512 levels build on avx2)
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "avx2_vnni": (("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    "avx512": (
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"),
    ),
    "avx512_vnni": (
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    ),
    "avx512_bf16": (
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"),
    ),
    "avx512_amx": (
        (
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512_vnni",
            "avx512_bf16",
            "amx_tile",
            "amx_bf16",
            "amx_int8",
        ),
        (
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512vnni",
            "-mavx512bf16",
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
        ),
    ),
}
# the flags worth recording beside a benchmark number
REPORTED = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first CPU's ``name: value`` lines of /proc/cpuinfo (read once); {} where there is none."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            name, sep, value = line.partition(":")
            if sep:
                fields.setdefault(name.strip(), value.strip())
    return fields


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: the first ``flags`` line of /proc/cpuinfo, else torch's capability
    mapped to the flags it implies."""
    if "flags" in _cpuinfo():
        return frozenset(_cpuinfo()["flags"].split())
    cap = torch.backends.cpu.get_cpu_capability()
    flags = {"avx2", "fma", "f16c"} if cap in ("AVX2", "AVX512") else set()
    return frozenset(flags | ({"avx512f", "avx512bw", "avx512vl"} if cap == "AVX512" else set()))


def supported(flags: frozenset[str] | None = None) -> list[str]:
    """The variants whose flags the CPU has, lowest first."""
    flags = cpu_flags() if flags is None else flags
    return [name for name, (need, _) in VARIANTS.items() if set(need) <= flags]


def best(flags: frozenset[str] | None = None) -> str | None:
    """The highest supported variant (the AVX-512 levels rank above ``avx2_vnni``), or None without AVX2."""
    names = supported(flags)
    return names[-1] if names else None


def resolve(requested: str | None, flags: frozenset[str] | None = None) -> str | None:
    """The variant to load: ``requested`` (``BAIGE_CPU_ISA``; None or ``auto``: :func:`best`).

    Raises:
        ValueError: an unknown name, or a variant this CPU lacks (the message lists the supported ones).
    """
    if requested in (None, "", "auto"):
        return best(flags)
    if requested not in VARIANTS:
        raise ValueError(f"unknown BAIGE_CPU_ISA {requested!r} (choose auto, {', '.join(VARIANTS)})")
    have = supported(flags)
    if requested not in have:
        missing = sorted(set(VARIANTS[requested][0]) - (cpu_flags() if flags is None else flags))
        raise ValueError(
            f"BAIGE_CPU_ISA={requested} needs CPU flags this machine lacks ({', '.join(missing)}); "
            f"supported here: {', '.join(have) or 'none (no AVX2)'}"
        )
    return requested


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``, ...); "" elsewhere."""
    return _cpuinfo().get("vendor_id", "")


# CPUs whose int8 weight tiles stream faster with qdot.c's software prefetch (int4's always have it):
# int8 batch-1 decode is faster with it on an Intel Xeon (Sapphire Rapids class) and an int8 matrix
# streams slower with it on an AMD EPYC (Zen 4), so AMD and any vendor not measured keep int8 without
# (measured: docs/benchmarks/archive.md, "AMX attention scores, int8 prefetch on Intel").
INT8_PREFETCH_VENDORS = ("GenuineIntel",)


def int8_prefetch(vendor: str | None = None) -> bool:
    """Whether qdot.c prefetches int8 weight tiles on this CPU (``vendor``: default :func:`cpu_vendor`)."""
    return (cpu_vendor() if vendor is None else vendor) in INT8_PREFETCH_VENDORS


def reported_flags() -> list[str]:
    """The instruction-set flags of :data:`REPORTED` this CPU has (what benchmarks record)."""
    flags = cpu_flags()
    return [f for f in REPORTED if f in flags]
