"""The native library's build cache (baige/kernels/cpu/build.py): the key hashes exactly the bytes the
compiler reads, and a library with an undefined symbol is refused at build time."""

import ctypes
import shutil
import subprocess

import pytest

from baige.kernels.cpu import build

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A one-function source tree in place of the package's, and an empty build cache."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "one.h").write_text("#define VALUE 1\n")
    (src / "one.c").write_text('#include "one.h"\nint baige_value(void) { return VALUE; }\n')
    monkeypatch.setattr(build, "_HERE", src)
    monkeypatch.setattr(build, "_cache_dir", lambda: tmp_path / "cache")
    return src


def _value(path):
    lib = ctypes.CDLL(str(path))
    lib.baige_value.restype = ctypes.c_int
    return lib.baige_value()


def test_a_source_edited_during_the_build_does_not_reach_the_cached_library(sources, monkeypatch):
    real_run = subprocess.run

    def edit_then_run(cmd, **kw):  # the header changes after the key was taken, before cc runs
        if "-shared" in cmd:
            (sources / "one.h").write_text("#define VALUE 2\n")
        return real_run(cmd, **kw)

    monkeypatch.setattr(build.subprocess, "run", edit_then_run)
    first = build.compile_variant("avx2")
    assert _value(first) == 1  # built from the bytes that were hashed
    monkeypatch.setattr(build.subprocess, "run", real_run)
    second = build.compile_variant("avx2")  # the edited tree: a new key, a new library
    assert second != first and _value(second) == 2


def test_a_library_with_an_undefined_function_is_refused(sources):
    (sources / "two.c").write_text("int baige_missing(void);\nint baige_two(void) { return baige_missing(); }\n")
    with pytest.raises(RuntimeError, match="baige_missing"):
        build.compile_variant("avx2")
    assert not list((sources.parent / "cache").glob("*.so"))  # nothing cached


def _qdot_asm(variant: str) -> str:
    """qdot.c compiled to assembly with ``variant``'s flags (as build.py compiles it)."""
    from baige.kernels.cpu import isa

    cc = shutil.which("cc") or shutil.which("gcc")
    flags = [*build.CFLAGS, *isa.VARIANTS[variant][1]]
    flags = [f for f in flags if f != "-shared"]
    r = subprocess.run([cc, *flags, "-S", "-o", "-", str(build._HERE / "qdot.c")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{cc} cannot compile the {variant} variant here: {r.stderr.strip()[:200]}")
    return r.stdout


def test_the_vnni_variants_dot_with_vpdpbusd_and_avx2_with_maddubs():
    """The integer-dot kernels' instructions per variant (compiled here whatever this CPU runs): avx2_vnni (Alder
    Lake, Zen 5) uses AVX-VNNI's VEX vpdpbusd on 256-bit registers, plain avx2 maddubs + madd and no vpdpbusd,
    and neither touches a 512-bit register."""
    vnni, avx2 = _qdot_asm("avx2_vnni"), _qdot_asm("avx2")
    assert "{vex} vpdpbusd" in vnni and "%zmm" not in vnni
    assert "vpdpbusd" not in avx2 and "vpmaddubsw" in avx2 and "vpmaddwd" in avx2 and "%zmm" not in avx2
