"""The machines the records ran on: their labels (M1, M2, ...), the native kernel variant each CPU loads by
default, and the page's machine table."""

from __future__ import annotations

from .records import DASH, date, env, limits, model, table

# baige/kernels/cpu/isa.py's VARIANTS (the flags each native variant needs), highest first as isa.best ranks
# them: a record whose variant is below the highest its CPU's flags allow ran with BAIGE_CPU_ISA forcing it
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl")
VARIANT_FLAGS = (
    ("avx512_amx", (*_AVX512, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
    ("avx512_bf16", (*_AVX512, "avx512_vnni", "avx512_bf16")),
    ("avx512_vnni", (*_AVX512, "avx512_vnni")),
    ("avx512", _AVX512),
    ("avx2_vnni", (*_AVX2, "avx_vnni")),
    ("avx2", _AVX2),
)


def best_isa(flags) -> str | None:
    """The native variant a CPU with ``flags`` loads by default (isa.best), None without AVX2."""
    return next((name for name, need in VARIANT_FLAGS if set(need) <= set(flags)), None)


def forced_isa(r: dict) -> str | None:
    """The record's native variant when it is below its CPU's default (forced by BAIGE_CPU_ISA), else None."""
    e = env(r)
    isa, best = e.get("cpu_isa"), best_isa(e.get("cpu_flags") or ())
    return isa if isa and best and isa != best else None


def forced_note(r: dict) -> str:
    forced = forced_isa(r)
    return f" (`{forced}` forced)" if forced else ""


def machine_key(r: dict) -> tuple:
    e = env(r)
    return (e.get("device") or "?", e.get("cpu_model") or "?", e.get("cpu_count"), tuple(e.get("cpu_flags") or ()))


def machines(records: list[dict]) -> dict[tuple, str]:
    """Machine key -> its label (M1, M2, ...), in order of first appearance among the newest records."""
    out: dict[tuple, str] = {}
    for r in records:
        out.setdefault(machine_key(r), f"M{len(out) + 1}")
    return out


def machine_table(records: list[dict], labels: dict[tuple, str]) -> list[str]:
    """One row per machine: its CPU, flags, default native variant, the measured limits' best and range."""
    header = (
        "machine | device / CPU | cores | instruction-set flags | native kernels | memory bandwidth (copy) | "
        "matmul peak | records"
    )
    rows = []
    for key, label in labels.items():
        rs = [r for r in records if machine_key(r) == key]
        bws = sorted(limits(r)["bandwidth"] / 1e9 for r in rs if limits(r).get("bandwidth"))
        peaks = sorted(
            (limits(r)["matmul_peak"] / 1e9, limits(r).get("dtype")) for r in rs if limits(r).get("matmul_peak")
        )
        bw = (
            DASH if not bws else f"{bws[-1]:.1f} GB/s" + (f" ({bws[0]:.1f}-{bws[-1]:.1f})" if bws[0] != bws[-1] else "")
        )
        peak = DASH if not peaks else f"{peaks[-1][0]:.1f} GFLOP/s ({peaks[-1][1]})"
        device, cpu, cores, flags = key
        isa = env(next((r for r in rs if not forced_isa(r)), rs[0])).get("cpu_isa") or "off"
        what = cpu if device == "cpu" else f"{device} ({cpu})"
        rows.append([label, what, cores or DASH, " ".join(flags) or DASH, isa, bw, peak, len(rs)])
    return table(header, rows)


def lead(r: dict, labels: dict[tuple, str], note: str = "") -> list[str]:
    """The cells most rows begin with: the record's date, model and machine label (``note`` after it)."""
    return [date(r), model(r), labels[machine_key(r)] + note]
